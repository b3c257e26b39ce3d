"""Scale planning: what a layout needs per rank and which mesh suits a cluster, computed in one
process without the devices (scripts/estimate.py, `train.py --job.simulate_world_size`).

- `planning.memory`: activation formulas (Korthikanti et al. 2022 and the model family's
  block count) and the ZeRO paper's bytes per parameter; pure arithmetic.
- `planning.simulate`: the real model on the meta device, parallelized as one rank of a `fake`
  process group per simulated rank, and what that rank holds (`simulate`, `format_plan`).
- `planning.communication`: bytes per step along each mesh dimension (CP's K/V all-gathers
  included) and their time.
- `planning.advise`: the `--advise` search over TP x PP x CP x FSDP and its explanation.

Results are values (`Plan`, `Activations`, `Advice`); nothing is stored on the config.
"""
