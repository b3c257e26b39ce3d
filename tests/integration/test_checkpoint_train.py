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
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from dist_utils import SELECTED_ITEMS, TINY_SHAPE, Run, launch_many
from parity import EXACT, FP32, assert_layout, assert_parity, moe_local_blocks

ROOT = Path(__file__).resolve().parents[2]
PRESET = "debug_model"
SETTINGS = [
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
BASE = ["--config", PRESET, *SETTINGS]
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
RESUMED = ["single", "fsdp2", "tp2_fsdp2", "pp2", "zero1", "zero2", "hsdp"]
# the sync-saved step-10 resumed with async saves: one process, FSDP and ZeRO-2 (whose
# shards are views at a storage offset: async staging once crashed on them)
RESUMED_ASYNC = ["single", "fsdp2", "zero2"]
RESHARDS = [
    ("fsdp4", "fsdp2"),
    ("tp2_fsdp2", "single"),
    ("single", "pp2_tp2"),
    ("pp2", "tp2_fsdp2"),
    ("zero1", "zero3"),
]
FOUR_LAYERS = ["--model.n_layers", "4", "--training.steps", "20", "--checkpoint.interval", "10"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
# tests that need runs besides their parameters'
NEEDS = {
    "test_killed_save_leaves_the_previous_checkpoint": ["ref_fsdp2"],
    "test_seed_checkpoint_then_mismatched_model": ["ref_fsdp2"],
    "test_reshard_interleaved_pipeline_to_fsdp": ["interleaved", "interleaved_to_fsdp2"],
}


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


def _wanted(request) -> set[str]:
    """The runs the selected tests of this module need (`-k` launches only those)."""
    want = set()
    for item in getattr(request.config, SELECTED_ITEMS):
        if item.module is not request.module:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "layout" in params:
            layout = params["layout"]
            want |= {f"ref_{layout}", f"async_{layout}", f"resumed_{layout}"}
            want |= {f"async_resumed_{layout}"} if layout in RESUMED_ASYNC else set()
        if "src" in params:
            want |= {f"ref_{params['src']}", f"reshard_{params['src']}_{params['dst']}"}
        want |= set(NEEDS.get(item.originalname, ()))
    return want


def _copier(src: Path, dst: Path) -> Callable[[], None]:
    return lambda: shutil.copytree(src, dst)


def _plan(base: Path) -> list[Run]:
    """Every launch of the resume and reshard tests, with what each waits for."""

    def run(name, layout, *args, after=None, prepare=None):
        nproc, extra = LAYOUTS[layout]
        return Run(name, base / name, nproc, [*SETTINGS, *extra, *args], after=after,
                   config=PRESET, prepare=prepare)  # fmt: skip

    twenty = ["--training.steps", "20", "--checkpoint.interval", "10"]
    asyncs = ["--checkpoint.async_mode", "async"]
    plan = [run(f"ref_{layout}", layout, *twenty) for layout in LAYOUTS]
    for layout in RESUMED:
        # 10 steps saving asynchronously, then (a copy of that folder) resumed to 20 steps
        first = ["--training.steps", "10", "--checkpoint.interval", "5", *asyncs]
        plan.append(run(f"async_{layout}", layout, *first, "--checkpoint.keep_latest_k", "1"))
        copy = _copier(base / f"async_{layout}", base / f"resumed_{layout}")
        again = ["--training.steps", "20", "--checkpoint.interval", "5"]
        plan.append(run(f"resumed_{layout}", layout, *again, after=f"async_{layout}", prepare=copy))
    for layout in RESUMED_ASYNC:
        # the reference's synchronously saved step-10, resumed in a fresh folder, async saves
        name = f"async_resumed_{layout}"
        copy = _step_copier(base / f"ref_{layout}", 10, base / name)
        plan.append(run(name, layout, *twenty, *asyncs, after=f"ref_{layout}", prepare=copy))
    for src, dst in RESHARDS:
        name = f"reshard_{src}_{dst}"
        copy = _step_copier(base / f"ref_{src}", 10, base / name)
        plan.append(run(name, dst, *twenty, after=f"ref_{src}", prepare=copy))
    # two pipeline stages per rank (one optimizer over both parts) save under the plain
    # model's names: FSDP 2 continues from them
    plan.append(run("interleaved", "pp2", *FOUR_LAYERS, *INTERLEAVED))
    copy = _step_copier(base / "interleaved", 10, base / "interleaved_to_fsdp2")
    plan.append(
        run("interleaved_to_fsdp2", "fsdp2", *FOUR_LAYERS, after="interleaved", prepare=copy)
    )
    return plan


def _step_copier(src_dump: Path, step: int, dst_dump: Path) -> Callable[[], None]:
    return lambda: copy_checkpoint(src_dump, step, dst_dump)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected tests' launches, two at a time (most of a short run is process start-up)."""
    base = tmp_path_factory.mktemp("ckpt")
    want = _wanted(request)
    todo = [r for r in _plan(base) if r.name in want]
    todo.sort(key=lambda r: -r.nproc)  # the widest first, so the others overlap them
    return launch_many(todo, parallel=2)


def steps(d: dict, lo: int, hi: int) -> list[float]:
    return [d[s] for s in range(lo, hi + 1)]


@pytest.mark.parametrize("layout", RESUMED)
def test_exact_resume_sync_and_async(runs, layout):
    ref = runs[f"ref_{layout}"].check()
    assert_layout(ref.folder, ref.nproc, ref.args)
    ref_losses = losses(ref.folder)
    assert sorted(ref_losses) == list(range(1, 21))
    # a 10-step run saving asynchronously, then resumed to 20 steps saving synchronously
    first = runs[f"async_{layout}"].check().folder
    assert steps(losses(first), 1, 10) == steps(ref_losses, 1, 10)  # async saves: no effect
    assert sorted(p.name for p in (first / "checkpoint").iterdir()) == ["step-10"]
    resumed = runs[f"resumed_{layout}"].check().folder
    assert "step-10 (latest checkpoint in the run folder) step 10" in log_text(resumed)
    assert_parity(ref.folder, resumed, EXACT)  # every step's loss and grad norm, final weights
    if layout in RESUMED_ASYNC:
        dump = runs[f"async_resumed_{layout}"].check().folder
        assert sorted(losses(dump)) == list(range(11, 21))
        assert_parity(ref.folder, dump, EXACT, first=11)


@pytest.mark.parametrize("src,dst", RESHARDS)
def test_reshard(runs, src, dst):
    src_dump = runs[f"ref_{src}"].check().folder
    run = runs[f"reshard_{src}_{dst}"].check()
    assert sorted(losses(run.folder)) == list(range(11, 21))
    assert_layout(run.folder, run.nproc, run.args)
    assert_parity(src_dump, run.folder, FP32, first=11)
    if LAYOUTS[src][0] != LAYOUTS[dst][0] and src.startswith("fsdp"):
        # the data loader continued from the global position at another DP degree
        before = dcp_values(src_dump / "checkpoint/step-10", {"dataloader": {"state": b""}})
        after = dcp_values(run.folder / "checkpoint/step-20", {"dataloader": {"state": b""}})
        assert before["dataloader"]["dp_degree"] == 4 and after["dataloader"]["dp_degree"] == 2
        assert before["dataloader"]["consumed_sequences"] == 10 * 8
        assert after["dataloader"]["consumed_sequences"] == 20 * 8


def test_reshard_interleaved_pipeline_to_fsdp(runs):
    src, dst = runs["interleaved"].check(), runs["interleaved_to_fsdp2"].check()
    assert_layout(src.folder, src.nproc, src.args, n_layers=4)
    assert_parity(src.folder, dst.folder, FP32, first=11)


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


def test_killed_save_leaves_the_previous_checkpoint(tmp_path, runs):
    ref = losses(runs["ref_fsdp2"].check().folder)
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


def test_seed_checkpoint_then_mismatched_model(tmp_path, runs):
    ref = losses(runs["ref_fsdp2"].check().folder)
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
        shuffle_seed=0,  # the run's order: training.shuffle on, training.shuffle_seed 0
    )
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        logits = hf(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert losses(dump)[1] == pytest.approx(want, rel=1e-4)


def test_sharded_stream_resumes_at_another_dp_through_train(tmp_path):
    """A streamed Hugging Face dataset in 4 virtual shards (training.stream_shards): 2 ranks
    each read only their own 2 shards; the checkpoint at step 3 joins both ranks' shard cursors,
    and one process resumes from it with the 2-rank run's losses, gradient norms and weights."""
    data = tmp_path / "hf"
    data.mkdir()
    for f in range(4):
        docs = [f"shard {f} document {i} " + "some words of text " * (1 + (i + f) % 5)
                for i in range(40)]  # fmt: skip
        (data / f"train-{f:05d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                           for d in docs))  # fmt: skip
    stream = ["--training.dataset", "huggingface", "--training.dataset_path", str(data),
              "--training.shuffle", "false", "--training.stream_shards", "4",
              "--training.steps", "6", "--checkpoint.interval", "3"]  # fmt: skip
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    ref = tmp_path / "ref"
    ok(train(ref, "fsdp2", *stream, env=env))
    assert_layout(ref, 2, list(stream))
    saved = dcp_values(ref / "checkpoint/step-3", {"dataloader": {"state": b""}})["dataloader"]
    assert saved["consumed_sequences"] == 3 * 8
    assert sorted(saved["cursor"]["shards"]) == ["0", "1", "2", "3"]  # both ranks' shards
    resumed = tmp_path / "resumed"
    copy_checkpoint(ref, 3, resumed)
    ok(train(resumed, "single", *stream, env=env))
    assert_layout(resumed, 1, list(stream))
    assert sorted(losses(resumed)) == [4, 5, 6]
    assert_parity(ref, resumed, FP32, first=4, step=6)


def hf_folder_for_run(folder: Path, family: str, **overrides) -> float:
    """A random Hugging Face checkpoint (sharded safetensors: several files, an index) of the
    run's shape (TINY_SHAPE on the family's debugmodel, the sample tokenizer's vocabulary),
    written by transformers itself; returns its loss on the run's first global batch."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from data.dataloader import build_dataloader
    from data.sample_corpus import default_cache_dir, ensure_sample_tokenizer
    from data.tokenizer import build_tokenizer
    from models import get_model_spec

    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    spec = get_model_spec(family)
    args = dataclasses.replace(
        spec.flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
        vocab_size=tokenizer.vocab_size, **overrides,
    )  # fmt: skip
    config = transformers.AutoConfig.for_model(**spec.hf.config_from_args(args, torch.float32))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(folder, max_shard_size="60KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    loader = build_dataloader(
        dataset="sample", dataset_path="", tokenizer=tokenizer, seq_len=32, local_batch_size=8,
        dp_rank=0, dp_degree=1, shuffle_seed=0,
    )  # fmt: skip
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        logits = hf(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


@pytest.mark.parametrize(
    "family,layout,extra",
    [
        ("llama3", "tp2_fsdp2", []),
        ("qwen3_moe", "fsdp2", ["--parallelism.expert_parallel_degree", "2"]),
        ("llama3", "pp2", []),
    ],
)
def test_hf_folder_loads_directly_into_a_sharded_run(tmp_path, family, layout, extra):
    """checkpoint.initial_load_path = a Hugging Face folder: every rank reads only its slices
    (TP 2 x FSDP 2 and PP 2 for Llama, EP 2 for Qwen3-MoE); the step-1 loss equals the one-process run's
    from the same folder, and the HF model's own loss on that batch."""
    want = hf_folder_for_run(tmp_path / "hf", family)
    model = ["--model.name", family, "--model.flavor", "debugmodel"]
    start = ["--training.steps", "1", "--checkpoint.interval", "5",
             "--checkpoint.initial_load_path", str(tmp_path / "hf")]  # fmt: skip
    ok(train(tmp_path / "one", "single", *model, *start))
    ok(train(tmp_path / "many", layout, *model, *extra, *start))
    assert "loaded the weights of Hugging Face folder" in log_text(tmp_path / "many")
    nproc, layout_args = LAYOUTS[layout]
    args = [*layout_args, *model, *extra]  # the run built the layout it names
    assert_layout(tmp_path / "many", nproc, args, local_blocks=moe_local_blocks(nproc, args, 2))
    one, many = losses(tmp_path / "one")[1], losses(tmp_path / "many")[1]
    assert many == pytest.approx(one, rel=1e-5)
    assert one == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize(
    "family,layout,extra",
    [
        ("llama3", "tp2_fsdp2", []),
        ("qwen3", "single", []),
        ("qwen3_moe", "fsdp2", ["--parallelism.expert_parallel_degree", "2"]),
        ("gemma2", "single", []),
        ("gemma3", "fsdp2", []),
        ("llama3", "pp2", []),
    ],
)
def test_hf_export_loads_in_transformers_with_the_trained_logits(tmp_path, family, layout, extra):
    """checkpoint.hf_export: the trained weights as a Hugging Face folder (one tensor gathered
    at a time, written by the lowest rank holding it) that transformers loads with no missing
    or unexpected tensor and whose logits are the trained model's (its final DCP checkpoint)."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.hf import model_from_layout, read_dcp_model

    dump = tmp_path / "run"
    ok(
        train(
            dump, layout, "--model.name", family, "--model.flavor", "debugmodel", *extra,
            "--training.steps", "2", "--checkpoint.interval", "2", "--checkpoint.hf_export",
            "true", "--checkpoint.hf_export_interval", "1", "--checkpoint.hf_export_dtype",
            "float32",
        )
    )  # fmt: skip
    nproc, layout_args = LAYOUTS[layout]
    args = [*layout_args, "--model.name", family, *extra]  # the run built the layout it names
    assert_layout(dump, nproc, args, local_blocks=moe_local_blocks(nproc, args, 2))
    folder = dump / "checkpoint"
    assert (folder / "hf-step-1").is_dir() and (folder / "hf-step-2").is_dir()
    index = json.loads((folder / "hf-step-2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 1
    spec, args = model_from_layout(folder / "step-2")
    ours = spec.model_cls(args)
    ours.load_state_dict(read_dcp_model(folder / "step-2"), strict=False)
    ours.init_buffers("cpu")
    ours.eval()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "hf-step-2", output_loading_info=True
    )
    assert not any(info.values()), info
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.float().eval()(tokens).logits
        mine = ours(tokens)
    torch.testing.assert_close(theirs, getattr(mine, "logits", mine), rtol=1e-4, atol=1e-4)


def test_hf_export_carries_the_runs_hugging_face_tokenizer(tmp_path):
    """A run whose tokenizer is a tokenizer.json exports it beside the weights: transformers
    reads it from the export and encodes as the run's tokenizer does."""
    transformers = pytest.importorskip("transformers")
    import tokenizers
    from hf_tokenizer_files import HF_WORDS, qwen_like_tokenizer

    tok = qwen_like_tokenizer(tmp_path / "tok")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(20):
        (docs / f"doc{i}.txt").write_text(" ".join(HF_WORDS[(i + 3 * j) % 10] for j in range(60)))
    dump = tmp_path / "run"
    ok(
        train(
            dump, "single", "--model.name", "qwen3", "--model.tokenizer_path", str(tok),
            "--training.dataset", "text", "--training.dataset_path", str(docs),
            "--training.steps", "1", "--checkpoint.hf_export", "true",
        )
    )  # fmt: skip
    export = dump / "checkpoint" / "hf-step-1"
    assert (export / "tokenizer.json").is_file()
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(export)
    text = "the model and the mesh shard the loss"
    assert theirs(text)["input_ids"] == tokenizers.Tokenizer.from_file(str(tok)).encode(text).ids
    config = json.loads((export / "config.json").read_text())
    assert config["vocab_size"] == theirs.vocab_size and config["torch_dtype"] == "bfloat16"
