"""Checkpointing through train.py on CPU gloo ranks (torchrun), with real DCP writes.

Exact resume (bit-identical losses, gradient norms and final weights) per layout and async
mode, resharding between layouts (the fp32 parity tolerances of `tests/parity.py` on loss,
gradient norm and final weights; the data loader continuing at another DP degree), a save
killed by SIGKILL, the seed
checkpoint, a checkpoint that does not fit, the weights-only export and a converted HF model
loaded under TP x FSDP. Every layout trains the same global batch (8 sequences per step), so
all layouts compute the same losses up to float reassociation.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import TINY_SHAPE
from parity import EXACT, FP32, assert_layout, assert_parity

ROOT = Path(__file__).resolve().parent.parent
BASE = [
    "--config",
    "debug_model",
    *TINY_SHAPE,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--training.device",
    "cpu",
    "--training.mixed_precision_param",
    "float32",
    # constant after warmup: a 10-step run has the same schedule as the first 10 of 20 steps
    "--lr_scheduler.warmup_steps",
    "3",
    "--lr_scheduler.decay_type",
    "constant",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--validation.enable",
    "false",
    "--debug.deterministic",
    "true",
    "--checkpoint.enable",
    "true",
]
TP = ["--parallelism.tensor_parallel_degree", "2"]
PP = ["--parallelism.pipeline_parallel_degree", "2"]
LAYOUTS = {
    "single": (1, []),
    "fsdp2": (2, []),
    "fsdp4": (4, []),
    "tp2_fsdp2": (4, TP),
    "pp2": (2, PP),
    "pp2_tp2": (4, PP + TP),
    "zero1": (2, ["--parallelism.zero_stage", "1"]),
    "zero2": (2, ["--parallelism.zero_stage", "2"]),
    "zero3": (2, ["--parallelism.zero_stage", "3"]),
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
}
NEEDS = {  # layout piece -> module that provides it (other engineers' work)
    "tp": "parallelisms.tensor_parallel",
    "pp": "models.llama3.pipeline",
    "zero": "parallelisms.zero",
}


def require(layout: str) -> None:
    """Skips, naming the missing piece, when a layout's parallelism is not in the tree."""
    for key, module in NEEDS.items():
        if key in layout and importlib.util.find_spec(module) is None:
            pytest.skip(f"{layout} needs {module}, not in the tree yet")


def train(dump: Path, layout: str, *args: str, env: dict | None = None, wait: bool = True):
    nproc, extra = LAYOUTS[layout]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "train.py",
        *BASE,
        *extra,
        "--job.dump_folder",
        str(dump),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    out = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)
    return out


def ok(out) -> None:
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def losses(dump: Path) -> dict[int, float]:
    """Train loss per step; a resumed run appends, so the latest record of a step wins."""
    path = dump / "metrics.jsonl"
    if not path.is_file():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def log_text(dump: Path) -> str:
    return (dump / "logs" / "rank_0.log").read_text()


def copy_checkpoint(src_dump: Path, step: int, dst_dump: Path) -> None:
    shutil.copytree(
        src_dump / "checkpoint" / f"step-{step}", dst_dump / "checkpoint" / f"step-{step}"
    )


def dcp_values(ckpt: Path, keys: dict) -> dict:
    """Small non-tensor entries of a checkpoint, read in this process."""
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.load(keys, checkpoint_id=str(ckpt), no_dist=True)
    if "dataloader" in keys:
        keys["dataloader"] = pickle.loads(keys["dataloader"]["state"])
    return keys


_REFERENCES: dict[str, tuple[Path, dict[int, float]]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 steps of a layout, saving step-10 and step-20 synchronously (cached per layout)."""

    def get(layout: str):
        require(layout)
        if layout not in _REFERENCES:
            dump = tmp_path_factory.mktemp(f"ref_{layout}")
            ok(train(dump, layout, "--training.steps", "20", "--checkpoint.interval", "10"))
            got = losses(dump)
            assert sorted(got) == list(range(1, 21))
            _REFERENCES[layout] = dump, got
        return _REFERENCES[layout]

    return get


def steps(d: dict, lo: int, hi: int) -> list[float]:
    return [d[s] for s in range(lo, hi + 1)]


@pytest.mark.parametrize(
    "layout", ["single", "fsdp2", "tp2_fsdp2", "pp2", "zero1", "zero2", "hsdp"]
)
def test_exact_resume_sync_and_async(tmp_path, reference, layout):
    ref_dump, ref = reference(layout)
    nproc, extra = LAYOUTS[layout]
    assert_layout(ref_dump, nproc, BASE + extra)
    # a 10-step run saving asynchronously, then resumed to 20 steps saving synchronously
    dump = tmp_path / "a"
    ok(
        train(
            dump,
            layout,
            "--training.steps",
            "10",
            "--checkpoint.interval",
            "5",
            "--checkpoint.async_mode",
            "async",
            "--checkpoint.keep_latest_k",
            "1",
        )
    )
    assert steps(losses(dump), 1, 10) == steps(ref, 1, 10)  # async saves leave training alone
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-10"]
    ok(train(dump, layout, "--training.steps", "20", "--checkpoint.interval", "5"))
    assert "step-10 (latest checkpoint in the run folder) step 10" in log_text(dump)
    assert_parity(ref_dump, dump, EXACT)  # every step's loss and grad norm, final weights
    # the reference's synchronously saved step-10, resumed in a fresh folder with async saves
    dump = tmp_path / "c"
    copy_checkpoint(ref_dump, 10, dump)
    ok(
        train(
            dump,
            layout,
            "--training.steps",
            "20",
            "--checkpoint.interval",
            "10",
            "--checkpoint.async_mode",
            "async",
        )
    )
    assert sorted(losses(dump)) == list(range(11, 21))
    assert_parity(ref_dump, dump, EXACT, first=11)


@pytest.mark.parametrize(
    "src,dst",
    [
        ("fsdp4", "fsdp2"),
        ("tp2_fsdp2", "single"),
        ("single", "pp2_tp2"),
        ("pp2", "tp2_fsdp2"),
        ("zero1", "zero3"),
    ],
)
def test_reshard(tmp_path, reference, src, dst):
    require(dst)
    src_dump, ref = reference(src)
    dump = tmp_path / "dst"
    copy_checkpoint(src_dump, 10, dump)
    ok(train(dump, dst, "--training.steps", "20", "--checkpoint.interval", "10"))
    assert sorted(losses(dump)) == list(range(11, 21))
    assert_layout(dump, LAYOUTS[dst][0], BASE + LAYOUTS[dst][1])
    assert_parity(src_dump, dump, FP32, first=11)
    if LAYOUTS[src][0] != LAYOUTS[dst][0] and src.startswith("fsdp"):
        # the data loader continued from the global position at another DP degree
        before = dcp_values(src_dump / "checkpoint/step-10", {"dataloader": {"state": b""}})
        after = dcp_values(dump / "checkpoint/step-20", {"dataloader": {"state": b""}})
        assert before["dataloader"]["dp_degree"] == 4 and after["dataloader"]["dp_degree"] == 2
        assert before["dataloader"]["consumed_sequences"] == 10 * 8
        assert after["dataloader"]["consumed_sequences"] == 20 * 8


def test_reshard_interleaved_pipeline_to_fsdp(tmp_path):
    """Two pipeline stages per rank (one optimizer over both parts) save under the plain
    model's names: FSDP 2 continues from them."""
    require("pp2")
    layers = ["--model.n_layers", "4", "--training.steps", "20", "--checkpoint.interval", "10"]
    src = tmp_path / "interleaved"
    ok(train(src, "pp2", *layers, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"))
    dst = tmp_path / "fsdp"
    copy_checkpoint(src, 10, dst)
    ok(train(dst, "fsdp2", *layers))
    assert_parity(src, dst, FP32, first=11)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_killed_save_leaves_the_previous_checkpoint(tmp_path, reference):
    _, ref = reference("fsdp2")
    dump = tmp_path / "run"
    ckpt = dump / "checkpoint"
    proc = train(
        dump,
        "fsdp2",
        "--training.steps",
        "20",
        "--checkpoint.interval",
        "5",
        "--checkpoint.async_mode",
        "async",
        "--debug.checkpoint_save_delay_step",
        "10",
        "--debug.checkpoint_save_delay_s",
        "120",
        wait=False,
    )
    try:
        deadline = time.time() + 240
        log = dump / "logs" / "rank_0.log"
        while "sleeping" not in (log.read_text() if log.is_file() else ""):
            assert proc.poll() is None and time.time() < deadline, "the save never started"
            time.sleep(0.2)
        saved = _digest(ckpt / "step-5")
    finally:
        for pid in reversed(_descendants(proc.pid)):  # every rank, then torchrun
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert not (ckpt / "step-10").exists() and (ckpt / "step-10.tmp").is_dir()
    assert any((ckpt / "step-10.tmp").iterdir())  # shards written, never committed
    ok(train(dump, "fsdp2", "--training.steps", "20", "--checkpoint.interval", "5"))
    text = log_text(dump)
    assert "ignoring incomplete checkpoint" in text and "step-10.tmp" in text
    assert "step-5 (latest checkpoint in the run folder) step 5" in text
    assert steps(losses(dump), 6, 20) == steps(ref, 6, 20)
    assert _digest(ckpt / "step-5") == saved
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-10", "step-15", "step-20", "step-5"]


def test_seed_checkpoint_then_mismatched_model(tmp_path, reference):
    _, ref = reference("fsdp2")
    dump = tmp_path / "seeded"
    seed = [
        sys.executable,
        "train.py",
        *BASE,
        *TP,
        "--job.dump_folder",
        str(dump),
        "--checkpoint.create_seed_checkpoint",
        "true",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok(subprocess.run(seed, cwd=ROOT, env=env, capture_output=True, text=True))
    step0 = dump / "checkpoint" / "step-0"
    assert json.loads((step0 / "layout.json").read_text())["contents"] == ["model"]
    again = subprocess.run(seed, cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr
    # any layout starts from it: same losses as initialising in place
    ok(train(dump, "fsdp2", "--training.steps", "5", "--checkpoint.interval", "5"))
    assert "step-0 (latest checkpoint in the run folder) step 0: model in" in log_text(dump)
    assert steps(losses(dump), 1, 5) == steps(ref, 1, 5)

    other = tmp_path / "bigger"
    out = train(
        other,
        "fsdp2",
        "--model.n_layers",
        "3",
        "--model.dim",
        "128",
        "--checkpoint.initial_load_path",
        str(dump / "checkpoint"),
    )
    assert out.returncode != 0
    text = log_text(other)
    assert text.count("does not fit this model") == 1, text
    assert "missing from the checkpoint: model.layers.2." in text
    assert "model.layers.0.attention.wq.weight: checkpoint [64, 64] vs model [128, 128]" in text
    assert losses(other) == {} and "training from step" not in text


def test_weights_only_export_converts_to_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    from checkpoint.hf import model_from_layout, read_dcp_model
    from models.llama3.model import Transformer

    dump = tmp_path / "run"
    ok(
        train(
            dump,
            "single",
            "--training.steps",
            "2",
            "--checkpoint.interval",
            "5",
            "--checkpoint.model_only",
            "true",
            "--checkpoint.export_dtype",
            "bfloat16",
        )
    )
    export = dump / "checkpoint" / "export-step-2"
    assert (dump / "checkpoint" / "step-2").is_dir()  # the full checkpoint is kept as well
    weights = read_dcp_model(export)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    spec = importlib.util.spec_from_file_location("to_hf", ROOT / "scripts/convert_to_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(export), str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    ours = Transformer(model_from_layout(export)[1]).eval()
    ours.load_state_dict({k: v.float() for k, v in weights.items()})
    tokens = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_converted_hf_model_loads_under_tp_and_fsdp(tmp_path):
    """A random HF Llama converted to DCP starts a TP 2 x FSDP 2 run whose first loss is the
    HF model's loss on the run's first global batch."""
    require("tp2_fsdp2")
    transformers = pytest.importorskip("transformers")
    from data.dataloader import build_dataloader
    from data.sample_corpus import default_cache_dir, ensure_sample_tokenizer
    from data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=tokenizer.vocab_size,
        rms_norm_eps=1e-5,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    spec = importlib.util.spec_from_file_location("from_hf", ROOT / "scripts/convert_from_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (
        mod.main([str(tmp_path / "hf"), str(tmp_path / "converted"), "--flavor", "debugmodel"]) != 0
    )  # other shape: refused
    assert mod.main([str(tmp_path / "hf"), str(tmp_path / "converted")]) == 0

    dump = tmp_path / "run"
    ok(
        train(
            dump,
            "tp2_fsdp2",
            "--training.steps",
            "1",
            "--checkpoint.interval",
            "5",
            "--checkpoint.initial_load_path",
            str(tmp_path / "converted"),
        )
    )
    assert "checkpoint.initial_load_path) step 0: model in" in log_text(dump)
    loader = build_dataloader(
        dataset="sample",
        dataset_path="",
        tokenizer=tokenizer,
        seq_len=32,
        local_batch_size=8,
        dp_rank=0,
        dp_degree=1,
    )
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        logits = hf(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert losses(dump)[1] == pytest.approx(want, rel=1e-4)
