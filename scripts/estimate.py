"""Scale planning from this machine: per-rank memory of a real layout, ZeRO arithmetic, and a
proposed mesh for a cluster (see parallelisms/estimate.py for the models).

    python scripts/estimate.py --config llama3_70b --world-size 512 \
        --parallelism.tensor_parallel_degree 8 [--device-memory-gib 80] [--section.key V ...]
    python scripts/estimate.py --exercise 1      # 13B, bf16 + AdamW, 8 GPUs: DDP vs ZeRO-1/2/3
    python scripts/estimate.py --exercise 2      # 70B on 8 nodes x 8 H100: proposed mesh
    python scripts/estimate.py --advise --config llama3_405b --gpus-per-node 8 --nodes 64 \
        --intra-node-gbs 900 --inter-node-gbits 400 --device-memory-gib 80

Nothing is allocated: the model is built on the meta device and each simulated rank joins a
`fake` process group, so 405B on 2048 ranks takes seconds on a laptop CPU.
"""

from __future__ import annotations

import argparse
import sys
import time

from job_config import ConfigError, JobConfig, parse_args
from metrics.flops import flops_per_token
from models import get_model_spec, model_args_for
from models.llama3 import ModelArgs
from parallelisms import estimate as est
from parallelisms.parallel_dims import ParallelismError

GIB = est.GIB
# Llama 2 13B's shape (the classic ZeRO exercise model): 13.0B parameters.
LLAMA_13B = ModelArgs(
    dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, multiple_of=256
)


def count(args, name: str = "llama3") -> tuple[int, int]:
    """(parameters, parameters doing matmul work: without the embeddings unless an output
    projection shares them) of family `name`'s model with these args, on meta."""
    import torch

    from metrics import count_params

    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    return count_params(model), count_params(model, exclude_embedding=True)


def report(
    cfg: JobConfig,
    world_size: int,
    memory_gib: float,
    device_type: str = "cuda",
    all_stages: bool = False,
) -> str:
    """The per-rank memory table of `cfg` on `world_size` ranks (real parallelize functions)."""
    from train import check_config

    check_config(cfg, world_size)
    spec = get_model_spec(cfg.model.name)
    t0 = time.perf_counter()
    plan = est.simulate(
        spec,
        model_args_for(cfg.model, cfg.training.seq_len),
        cfg,
        world_size,
        device_type=device_type,
        all_stages=all_stages,
    )
    text = est.format_plan(plan, memory_gib)
    return text + f"\n(simulated {len(plan.ranks)} rank(s) in {time.perf_counter() - t0:.1f} s)"


def exercise_1() -> str:
    n, _ = count(LLAMA_13B)
    gpus = 8
    lines = [
        f"Exercise 1: a 13B Llama (Llama 2 13B shape: dim 5120, 40 layers, 40 heads, vocab "
        f"32000) = {n:,} parameters (Psi), bf16 mixed precision + AdamW, {gpus} GPUs.",
        "Per parameter, mixed-precision Adam keeps 2 B bf16 weights + 2 B bf16 gradients + "
        "12 B fp32 optimizer state (4 master weights + 4 momentum + 4 variance) = 16 B.",
        f"{'':8} {'bytes/param/GPU':>22} {'per GPU':>22}",
    ]
    for stage, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")):
        per, formula = est.zero_bytes_per_param(stage, gpus)
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
        plan = est.simulate(spec, LLAMA_13B, cfg, gpus, ranks=[0])
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


def advise_report(
    cfg: JobConfig, cluster: est.Cluster, global_batch: int, verify: bool = True
) -> str:
    args = model_args_for(cfg.model, cfg.training.seq_len)
    n, n_no_emb = count(args, cfg.model.name)
    t = cfg.training
    fpt = flops_per_token(n_no_emb, args.n_layers, args.n_heads, args.head_dim, t.seq_len)
    best, tried = est.advise(
        args,
        n,
        fpt,
        cluster,
        seq_len=t.seq_len,
        global_batch=global_batch,
        block_bytes=get_model_spec(cfg.model.name).block_activation_bytes,
        micro_batch=t.local_batch_size,
    )
    lines = [
        f"Advice for {cfg.model.name} {cfg.model.flavor} ({n / 1e9:.1f}B params, seq_len "
        f"{t.seq_len}, global batch {global_batch} sequences = {global_batch * t.seq_len:,} "
        f"tokens, micro-batch <= {t.local_batch_size}) on {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} GPUs ({cluster.world} ranks), {cluster.memory_gib:g} GiB each.",
        f"Links: intra-node {cluster.intra_gbs:g} GB/s bidirectional -> "
        f"{cluster.intra_bps / 1e9:.0f} GB/s per direction x efficiency; inter-node "
        f"{cluster.inter_gbits:g} Gb/s per GPU -> {cluster.inter_bps / 1e9:.0f} GB/s. Compute: "
        f"{cluster.peak_tflops:g} TFLOP/s peak at {cluster.mfu:.0%} MFU.",
        "",
        f"{'tp':>3} {'pp':>3} {'dp':>5} {'ac':>5} {'mb x acc':>8} {'mem GiB':>8} {'compute s':>9} "
        f"{'dp comm s':>9} {'tp comm s':>9} {'pp comm s':>9} {'bubble s':>8} {'step s':>7}",
    ]
    for c in tried:
        by = {x.dim: x.seconds for x in c.comms}
        mark = " <-" if c is best else ""
        lines.append(
            f"{c.layout.tp:>3} {c.layout.pp:>3} {c.layout.dp:>5} {c.layout.ac:>5} "
            f"{f'{c.micro_batch}x{c.accum}':>8} {c.memory / GIB:>8.1f} {c.compute:>9.2f} {by.get('dp', 0):>9.3f} "
            f"{by.get('tp', 0):>9.3f} {by.get('pp', 0):>9.3f} {c.bubble:>8.2f} {c.step:>7.2f}{mark}"
        )
    if best is None:
        lines.append("No layout fits: add GPUs, lower seq_len/local batch or use CPU offload.")
        return "\n".join(lines)
    lay = best.layout
    lines += ["", f"Proposed: TP {lay.tp} x PP {lay.pp} x FSDP {lay.dp}, AC {lay.ac}.", "Why:"]
    for c in best.comms:
        lines.append(
            f"- {c.dim} ({c.size} ranks over {c.link}): {c.what}: {c.bytes / 1e9:.2f} GB per "
            f"rank per step = {c.seconds:.3f} s, "
            + ("on the critical path." if c.exposed else "overlapped with compute.")
        )
    if lay.tp > 1:
        lines.append(
            f"- TP {lay.tp} stays inside a node: its traffic is per layer and exposed, so it "
            "needs NVLink; it divides the weights and activations by the TP degree."
        )
    else:
        lines.append("- No TP: FSDP alone fits memory, and its traffic hides behind compute.")
    others = sorted(
        (c for c in tried if c is not best and c.memory <= 0.9 * cluster.memory_gib * GIB),
        key=lambda c: (c.layout.pp, c.step),
    )
    if others:
        o = others[0]
        lines.append(
            f"- Runner-up: TP {o.layout.tp} x PP {o.layout.pp} x FSDP {o.layout.dp}, AC "
            f"{o.layout.ac}: {o.step:.2f} s per step"
            + (" (full AC recomputes the forward: +1/3 compute)" if o.layout.ac == "full" else "")
            + "."
        )
    unfit = [
        c for c in tried if c.layout.pp <= lay.pp and c.memory > 0.9 * cluster.memory_gib * GIB
    ]
    if unfit:
        lines.append(
            "- Rejected for memory (> 90% of the device): "
            + ", ".join(
                f"TP {c.layout.tp}/PP {c.layout.pp}/AC {c.layout.ac} {c.memory / GIB:.0f} GiB"
                for c in unfit
            )
            + "."
        )
    lines.append(
        f"- PP {lay.pp}: "
        + (
            "not needed (it costs a bubble and needs microbatches)."
            if lay.pp == 1
            else "needed, no layout with fewer stages fits memory."
        )
    )
    lines.append(f"- Step time model: {best.step:.2f} s (compute {best.compute:.2f} s).")
    if verify:
        vcfg = est.replace_parallelism(
            cfg,
            tensor_parallel_degree=lay.tp,
            pipeline_parallel_degree=lay.pp,
            data_parallel_shard_degree=-1,
            data_parallel_replicate_degree=1,
            zero_stage=3,
            ac=lay.ac,
        )
        local = global_batch // lay.dp
        vcfg.training.local_batch_size = local if lay.pp > 1 else best.micro_batch
        vcfg.training.global_batch_size = global_batch
        if lay.pp > 1:
            vcfg.parallelism.pipeline_parallel_schedule = "1F1B"
            vcfg.parallelism.pipeline_parallel_layers_per_stage = -1
            vcfg.parallelism.pipeline_parallel_microbatch_size = 1
        lines += ["", "Checked with the real parallelize functions (simulated ranks):"]
        lines.append(report(vcfg, cluster.world, cluster.memory_gib, "cuda"))
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
        cfg = parse_args(["--config", config, *overrides])
        if ns.exercise == 2 or ns.advise:
            cluster = est.Cluster(
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
