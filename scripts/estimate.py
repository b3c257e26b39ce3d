"""Scale planning from this machine: per-rank memory of a real layout, ZeRO arithmetic, and a
proposed mesh for a cluster (see the planning/ package for the models).

    python scripts/estimate.py --config llama3_70b --world-size 512 \
        --parallelism.tensor_parallel_degree 8 [--device-memory-gib 80] [--section.key V ...]
    python scripts/estimate.py --exercise 1      # 13B, bf16 + AdamW, 8 GPUs: DDP vs ZeRO-1/2/3
    python scripts/estimate.py --exercise 2      # 70B on 8 nodes x 8 H100: proposed mesh
    python scripts/estimate.py --advise --config llama3_405b --gpus-per-node 8 --nodes 64 \
        --intra-node-gbs 900 --inter-node-gbits 400 --device-memory-gib 80
    python scripts/estimate.py --advise --config debug_model --model.name qwen3_moe \
        --model.flavor 235B-A22B --training.seq_len 4096 --nodes 8 --device-memory-gib 141
    python scripts/estimate.py --advise --config llama3_8b --training.seq_len 131072 \
        --nodes 1 --device-memory-gib 131     # 128K tokens on 8 GPUs of 141 GB: CP

Nothing is allocated: the model is built on the meta device and each simulated rank joins a
`fake` process group, so 405B on 2048 ranks takes seconds on a laptop CPU.
"""

from __future__ import annotations

import argparse
import sys
import time

from job_config import ConfigError, JobConfig
from metrics.flops import flops_per_token
from models import get_model_spec, model_args_for
from models.llama3 import ModelArgs
from parallelisms.parallel_dims import ParallelismError
from planning.advice_report import explain, format_candidates, format_header
from planning.advise import Workload, advise, verification_config
from planning.communication import Cluster
from planning.memory import GIB, layer_attention_specs, zero_bytes_per_param
from planning.simulate import count_experts, format_plan, simulate
from training.preflight import load_config

# Llama 2 13B's shape (the classic ZeRO exercise model): 13.0B parameters.
LLAMA_13B = ModelArgs(
    dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, multiple_of=256
)


def count(args, name: str = "llama3") -> tuple[int, int, list]:
    """(parameters, parameters one token's matmuls use: without the embeddings unless an
    output projection shares them; for a family with routing hooks its active parameters, as
    the trainer counts FLOPs; each layer's attention spec) of family `name`'s model with these
    args, on meta."""
    import torch

    from metrics import count_params

    spec = get_model_spec(name)
    with torch.device("meta"):
        model = spec.model_cls(args)
    specs = layer_attention_specs(model)
    if spec.routing is not None:
        return count_params(model), spec.routing.active_params(model), specs
    return count_params(model), count_params(model, spec.embeddings), specs


def report(
    cfg: JobConfig,
    world_size: int,
    memory_gib: float,
    device_type: str = "cuda",
    all_stages: bool = False,
) -> str:
    """The per-rank memory table of `cfg` on `world_size` ranks (real parallelize functions)."""
    from training.preflight import check_config

    check_config(cfg, world_size)
    spec = get_model_spec(cfg.model.name)
    t0 = time.perf_counter()
    plan = simulate(
        spec,
        model_args_for(cfg, cfg.training.seq_len),
        cfg,
        world_size,
        device_type=device_type,
        all_stages=all_stages,
    )
    text = format_plan(plan, memory_gib)
    return text + f"\n(simulated {len(plan.ranks)} rank(s) in {time.perf_counter() - t0:.1f} s)"


def exercise_1() -> str:
    n, _, _ = count(LLAMA_13B)
    gpus = 8
    lines = [
        f"Exercise 1: a 13B Llama (Llama 2 13B shape: dim 5120, 40 layers, 40 heads, vocab "
        f"32000) = {n:,} parameters (Psi), bf16 mixed precision + AdamW, {gpus} GPUs.",
        "Per parameter, mixed-precision Adam keeps 2 B bf16 weights + 2 B bf16 gradients + "
        "12 B fp32 optimizer state (4 master weights + 4 momentum + 4 variance) = 16 B.",
        f"{'':8} {'bytes/param/GPU':>22} {'per GPU':>22}",
    ]
    for stage, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")):
        per, formula = zero_bytes_per_param(stage, gpus)
        total = per * n
        lines.append(
            f"{name:8} {formula + f' = {per:g}':>22} {f'{total / 1e9:.1f} GB = {total / GIB:.1f} GiB':>22}"
        )
    lines += [
        "(activations, buffers and fragmentation come on top: ZeRO shards only model states.)",
        "",
        "The same model through meshtrain's real apply functions (fake 8-rank group, meta "
        "device; bf16 compute, fp32 gradient reduction and master state):",
    ]
    spec = get_model_spec("llama3")
    for stage, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")):
        cfg = JobConfig()
        cfg.training.seq_len, cfg.training.local_batch_size = 4096, 1
        cfg.training.mixed_precision_param = "bfloat16"
        cfg.parallelism.zero_stage = stage
        plan = simulate(spec, LLAMA_13B, cfg, gpus, ranks=[0])
        r = plan.ranks[0]
        lines.append(
            f"{name:8} params {r.params / GIB:6.1f} + grads {r.grads / GIB:6.1f} + AdamW "
            f"{r.optimizer / GIB:6.1f} = {r.states / GIB:6.1f} GiB ({r.states / n:.2f} B/param)"
        )
    lines.append(
        f"meshtrain's stages 0-2 keep a bf16 compute copy of every weight beside fp32 master "
        f"weights (whole for DDP, a 1/{gpus} shard for ZeRO-1/2) and reduce gradients in fp32: "
        f"DDP 2+4+4+8 = 18; ZeRO-1 2+4/{gpus}+4+8/{gpus} = 7.5 (the full all-reduced fp32 "
        f"gradient stays); ZeRO-2 2+(4+4+8)/{gpus} = 4; FSDP (ZeRO-3) (4+4+8)/{gpus} = 2 (fp32 "
        "shards; bf16 copies exist only for the blocks being gathered)."
    )
    return "\n".join(lines)


def advise_report(cfg: JobConfig, cluster: Cluster, global_batch: int, verify: bool = True) -> str:
    """The proposed mesh for `cfg`'s model on `cluster`, every candidate tried, why, and (with
    `verify`) the proposal's per-rank table from the real parallelize functions."""
    args = model_args_for(cfg, cfg.training.seq_len)
    n, n_no_emb, layers = count(args, cfg.model.name)
    t, spec = cfg.training, get_model_spec(cfg.model.name)
    fpt = flops_per_token(n_no_emb, args.n_layers, args.n_heads, args.head_dim, t.seq_len, layers)
    work = Workload(
        args,
        n,
        fpt,
        t.seq_len,
        global_batch,
        spec.block_activation_bytes,
        micro_batch=t.local_batch_size,
        experts=count_experts(spec, args, cfg),
        document_mask=t.document_mask,
        attention=tuple(dict.fromkeys(layers)),
    )
    advice = advise(work, cluster)
    model = f"{cfg.model.name} {cfg.model.flavor}"
    lines = [*format_header(model, work, cluster), ""]
    lines += format_candidates(advice, ep_columns=work.experts is not None)
    lines += explain(advice, cluster, work)
    if verify and advice.best is not None:
        vcfg = verification_config(cfg, advice.best, global_batch)
        try:
            table = report(vcfg, cluster.world, cluster.memory_gib, "cuda")
        except (ConfigError, ParallelismError) as e:  # a layout this build cannot run yet
            lines += ["", f"Not checked with the real parallelize functions: {e}"]
        else:
            lines += ["", "Checked with the real parallelize functions (simulated ranks):", table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="debug_model")
    ap.add_argument("--world-size", type=int, default=0)
    ap.add_argument("--device-memory-gib", type=float, default=80.0)
    ap.add_argument("--device-type", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--all-stages", action="store_true", help="simulate every PP stage")
    ap.add_argument("--exercise", type=int, choices=(1, 2))
    ap.add_argument("--advise", action="store_true")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--intra-node-gbs", type=float, default=900.0, help="NVLink GB/s per GPU")
    ap.add_argument("--inter-node-gbits", type=float, default=400.0, help="network Gb/s per GPU")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense (H100: 989)")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument(
        "--global-batch-tokens",
        type=int,
        default=4 * 1024 * 1024,
        help="tokens per optimizer step for --advise (default 4M, Llama 3's initial batch)",
    )
    ns, overrides = ap.parse_known_args(argv)
    try:
        if ns.exercise == 1:
            print(exercise_1())
            return 0
        config = "llama3_70b" if ns.exercise == 2 else ns.config
        cfg = load_config(["--config", config, *overrides])  # honours --job.custom_import
        if ns.exercise == 2 or ns.advise:
            cluster = Cluster(
                gpus_per_node=ns.gpus_per_node,
                nodes=8 if ns.exercise == 2 else ns.nodes,
                intra_gbs=ns.intra_node_gbs,
                inter_gbits=ns.inter_node_gbits,
                memory_gib=ns.device_memory_gib,
                peak_tflops=ns.peak_tflops,
                mfu=ns.mfu,
            )
            global_batch = max(1, ns.global_batch_tokens // cfg.training.seq_len)
            print(advise_report(cfg, cluster, global_batch))
            return 0
        if ns.world_size < 1:
            ap.error("--world-size N is required (or --exercise / --advise)")
        print(report(cfg, ns.world_size, ns.device_memory_gib, ns.device_type, ns.all_stages))
    except (ConfigError, ParallelismError, ValueError) as e:
        print(f"estimate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
