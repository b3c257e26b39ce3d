"""Peak memory of the offline Hugging Face conversions, both directions, on random checkpoints
of a Llama 3 flavor's shape (benchmarks/hf_stream): each conversion runs in a fresh process
whose peak RSS is recorded: /proc/self/status VmHWM, file pages mapped by safetensors
included. (Not getrusage's ru_maxrss: Linux carries the parent's peak into a child across
fork + exec, so a child of the process that generated the model reports the parent's peak.)

    python scripts/bench_hf_stream.py --flavors 1B 3B --work /tmp/hfbench --out benchmarks/hf_stream
    python scripts/bench_hf_stream.py --load 1B --ranks 4 --work /tmp/hfbench --out benchmarks/hf_stream

`--load`: a run's start from a Hugging Face folder (`checkpoint/hf.py` fill_from_hf) into a
float32 model, FSDP over N gloo ranks (each reading its slices) against one process reading
the whole model: per-rank peak RSS and wall time of the load.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_hf(flavor: str, folder: Path, shard_bytes: int, dtype=torch.bfloat16) -> dict:
    """A random HF Llama folder of `flavor`'s shape, written shard by shard (one shard in
    memory at a time), tied flavors without lm_head.weight as published."""
    from safetensors.torch import save_file

    from checkpoint.hf import tensor_map, to_hf_tensors
    from models import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.flavors[flavor]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}
    if args.tie_embeddings:
        shapes.pop("output.weight")
    where = tensor_map(spec, args)
    folder.mkdir(parents=True, exist_ok=True)
    groups, size = [[]], 0
    for n, s in shapes.items():
        nbytes = torch.Size(s).numel() * dtype.itemsize
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    weight_map, total, g = {}, 0, torch.Generator().manual_seed(0)
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for n in group:
            t = (torch.randn(shapes[n], generator=g) * 0.02).to(dtype)
            shard.update(to_hf_tensors(where(n), t))
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
        del shard
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = spec.hf.config_from_args(args, dtype)
    (folder / "config.json").write_text(json.dumps(config))
    return {"bytes": total, "files": len(groups)}


def measure(cmd: list[str]) -> dict:
    """Runs one conversion in a fresh process: its peak RSS and wall time."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "_child", *cmd], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    rss = json.loads(out.stdout.strip().splitlines()[-1])["vm_hwm_kib"]
    return {"peak_rss_gib": round(rss / 2**20, 3), "wall_s": round(time.perf_counter() - start, 1)}


def child(argv: list[str]) -> None:
    """In the measured process: the conversion itself, then its peak RSS (VmHWM, KiB)."""
    import importlib.util

    name = argv[0]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open("/dev/null", "w") as devnull:
        sys.stdout, real = devnull, sys.stdout
        rc = mod.main(argv[1:])
        sys.stdout = real
    if rc:
        sys.exit(rc)
    status = Path("/proc/self/status").read_text().splitlines()
    hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"vm_hwm_kib": hwm}))


def load_rank(folder: str, flavor: str) -> None:
    """One rank (torchrun; or alone): the model on meta, FSDP over every rank, materialised,
    then filled from the HF folder; prints its load time and peak RSS."""
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from checkpoint.hf import fill_from_hf
    from models import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.flavors[flavor]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    with torch.device("meta"):
        model = spec.model_cls(args)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    sd = get_model_state_dict(model)
    fill_from_hf(sd, Path(folder), spec, args)
    set_model_state_dict(model, sd)
    if world > 1:
        dist.barrier()
    wall = time.perf_counter() - start
    status = Path("/proc/self/status").read_text().splitlines()
    hwm = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    rank = dist.get_rank() if world > 1 else 0
    print("RESULT " + json.dumps({"rank": rank, "peak_rss_gib": round(hwm / 2**20, 3),
                                  "load_s": round(wall, 1)}), flush=True)  # fmt: skip
    if world > 1:
        dist.destroy_process_group()


def bench_load(flavor: str, ranks: int, work: Path) -> dict:
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    made = make_hf(flavor, work / "hf", 2**30)
    rows = {}
    for n in (1, ranks):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", __file__, "_load", str(work / "hf"), flavor]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                             env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        # ranks print concurrently: a line may hold several results
        per_rank = [json.JSONDecoder().raw_decode(part)[0]
                    for part in out.stdout.split("RESULT ")[1:]]  # fmt: skip
        rows[f"{n}_process" if n == 1 else f"fsdp_{n}"] = sorted(per_rank, key=lambda r: r["rank"])
    shutil.rmtree(work, ignore_errors=True)
    return {"flavor": flavor, "model_gib_bf16_files": round(made["bytes"] / 2**30, 3),
            "model_dtype_in_memory": "float32", **rows}  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        return child(sys.argv[2:])
    if sys.argv[1:2] == ["_load"]:
        return load_rank(*sys.argv[2:4])
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--flavors", nargs="+", default=["1B", "3B"])
    p.add_argument("--work", type=Path, required=True, help="scratch folder (several GB)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shard_gb", type=float, default=1.0)
    p.add_argument("--load", default="", help="flavor: benchmark a run's load instead")
    p.add_argument("--ranks", type=int, default=4)
    a = p.parse_args()
    import shutil

    if a.load:
        row = bench_load(a.load, a.ranks, a.work / f"load-{a.load}")
        print(json.dumps(row), flush=True)
        a.out.mkdir(parents=True, exist_ok=True)
        record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "torch": torch.__version__, "command": " ".join(sys.argv), "result": row}  # fmt: skip
        (a.out / "load.json").write_text(json.dumps(record, indent=2) + "\n")
        return None

    results = []
    for flavor in a.flavors:
        work = a.work / flavor
        shutil.rmtree(work, ignore_errors=True)
        made = make_hf(flavor, work / "hf", int(a.shard_gb * 2**30))
        row = {"flavor": flavor, "model_gib": round(made["bytes"] / 2**30, 3),
               "hf_files": made["files"], "shard_gib": a.shard_gb}  # fmt: skip
        row["from_hf"] = measure(["convert_from_hf", str(work / "hf"), str(work / "dcp")])
        row["to_hf"] = measure(
            [
                "convert_to_hf",
                str(work / "dcp"),
                str(work / "back"),
                "--max_shard_gb",
                str(a.shard_gb),
            ]
        )
        print(json.dumps(row), flush=True)
        results.append(row)
        shutil.rmtree(work, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "results": results,
    }
    (a.out / "offline.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
