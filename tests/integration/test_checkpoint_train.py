"""Checkpointing through train.py on CPU gloo ranks, with real DCP writes.

Exact resume (bit-identical losses, gradient norms and final weights) per layout with
asynchronous saves, resharding between layouts (the fp32 parity tolerances of
`tests/parity.py` on loss, gradient norm and final weights; the data loader continuing at
another DP degree), a save killed by SIGKILL, the seed checkpoint, a checkpoint that does not
fit, the weights-only export and Hugging Face folders loaded and exported under TP x FSDP, PP
and EP.

The runs resumed and resharded here continue the parity runs' own step-5 checkpoints
(tests/integration/test_parallel_parity.py and test_pipeline_parity.py: the same arguments,
so the run pool launches each once); every layout trains the same global batch (8 sequences
per step), so all layouts compute the same losses up to float reassociation.
"""

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import TINY_CONFIG, Run
from parity import EXACT, FP32, RESUME_STEP, STEPS, assert_layout, assert_parity, moe_local_blocks
from test_parallel_parity import COMMON
from test_parallel_parity import LAYOUTS as PARITY
from test_pipeline_parity import COMMON as PP_COMMON
from test_pipeline_parity import LAYOUTS as PP_PARITY

ROOT = Path(__file__).resolve().parents[2]
TP = ("--parallelism.tensor_parallel_degree=2",)
PP = ("--parallelism.pipeline_parallel_degree=2",)
# layout -> (ranks, arguments over COMMON, or over PP_COMMON for the 4-layer pipeline runs)
LAYOUTS = {
    "single": (1, ()),
    "fsdp2": (2, ("--training.local_batch_size=4",)),
    "fsdp4": (PARITY["zero3_4"].nproc, PARITY["zero3_4"].args),
    "tp2_fsdp2": (PARITY["tp2_fsdp2"].nproc, PARITY["tp2_fsdp2"].args),
    "pp2_tp2": (4, (*PP, *TP)),
    "zero1": (PARITY["zero1_2_ac_op"].nproc, PARITY["zero1_2_ac_op"].args),
    "zero2": (PARITY["zero2_2_accum_ac_sel2"].nproc, PARITY["zero2_2_accum_ac_sel2"].args),
    "zero3": (2, ("--parallelism.zero_stage=3", "--training.local_batch_size=4")),
    "hsdp": (PARITY["hsdp_2x2"].nproc, PARITY["hsdp_2x2"].args),
    # Llama 3.2's tied embeddings under TP 2 x FSDP 2 (the one matrix re-tied after a load)
    "tied_tp2_fsdp2": (PARITY["tied_tp2_fsdp2"].nproc, PARITY["tied_tp2_fsdp2"].args),
    # the same tied model split by PP: the output's copy on the last stage loads its own name
    "tied_pp2": (
        2,
        ("--model.flavor=1B", *PP, "--parallelism.pipeline_parallel_microbatch_size=2"),
    ),
    "pp2": (PP_PARITY["pp2_1f1b"].nproc, PP_PARITY["pp2_1f1b"].args),
    "pp2_interleaved": (2, PP_PARITY["pp2_interleaved_1f1b"].args),
    "pp2_2_layers": (2, PP),  # one layer per stage, the default schedule
}
PIPELINE_COMMON = {"pp2", "pp2_interleaved"}  # the layouts of the pipeline parity runs
# The parity run of each layout is the reference; its step-5 checkpoint (saved synchronously)
# continues to step 10 saving asynchronously every 2 steps, keeping the latest 2, and that
# run's asynchronously saved step-8 continues again to step 10: both bit for bit. (ZeRO-2's
# shards are views at a storage offset: async staging once crashed on them.)
RESUMED = ["single", "fsdp4", "tp2_fsdp2", "pp2", "zero1", "zero2", "hsdp", "tied_tp2_fsdp2"]
ASYNC = ("--checkpoint.async_mode=async", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=2")
AGAIN_STEP = 8  # the async save the second resume starts from
RESHARDS = [
    ("fsdp4", "fsdp2"),
    ("tp2_fsdp2", "single"),
    ("single", "pp2_tp2"),
    ("pp2", "tp2_fsdp2"),
    ("zero1", "zero3"),
    # two pipeline stages per rank (one optimizer over both parts) save under the plain
    # model's names: FSDP 2 continues from them
    ("pp2_interleaved", "fsdp2"),
    # tied embeddings: one matrix under TP x FSDP, two equal copies on two stages under PP
    ("tied_tp2_fsdp2", "tied_pp2"),
]
# checkpoint.hf_export from these layouts: (family, layout, more arguments)
HF_EXPORTS = [
    ("llama3", "tp2_fsdp2", []),
    ("qwen3", "single", []),
    ("qwen3_moe", "fsdp2", ["--parallelism.expert_parallel_degree", "2"]),
    ("gemma2", "single", []),
    ("gemma3", "fsdp2", []),
    ("llama3", "pp2_2_layers", []),
]
# tests that need runs besides their parameters'
NEEDS = {
    "test_killed_save_leaves_the_previous_checkpoint": ["ref_fsdp2"],
    "test_seed_checkpoint_then_mismatched_model": ["ref_fsdp2", "seed", "seed_again", "seeded",
                                                   "bigger"],
    "test_weights_only_export_converts_to_hf": ["export"],
}  # fmt: skip


def layout_run(name: str, layout: str, *args: str, model: str = "", **fields) -> Run:
    """A run of `layout` with more `args`, over the common arguments of the parity module that
    trains `model` (a layout name; `layout` itself by default)."""
    nproc, extra = LAYOUTS[layout]
    common = PP_COMMON if (model or layout) in PIPELINE_COMMON else COMMON
    return Run(name, nproc, [*common, *extra, *args], **fields)


def n_layers(run: Run) -> int:
    return 4 if "--model.n_layers" in run.args else 2


def _plan() -> list[Run]:
    """Every declared launch of this module, with what each starts from."""
    plan = [layout_run(f"ref_{layout}", layout) for layout in LAYOUTS]
    middle = f"checkpoint/step-{RESUME_STEP}"
    for layout in RESUMED:
        async_save = (f"resumed_{layout}", f"checkpoint/step-{AGAIN_STEP}")
        plan.append(
            layout_run(f"resumed_{layout}", layout, *ASYNC, copy_from=(f"ref_{layout}", middle))
        )
        plan.append(layout_run(f"again_{layout}", layout, *ASYNC, copy_from=async_save))
    for src, dst in RESHARDS:
        copy = (f"ref_{src}", middle)
        plan.append(layout_run(f"reshard_{src}_{dst}", dst, model=src, copy_from=copy))
    plan += _seed_plan()
    export = ["--training.steps=2", "--checkpoint.interval=5", "--checkpoint.model_only=true",
              "--checkpoint.export_dtype=bfloat16"]  # fmt: skip
    plan.append(Run("export", 1, ["--checkpoint.enable=true", *export]))
    for family, layout, extra in HF_EXPORTS:
        plan.append(layout_run(f"hf_export_{family}_{layout}", layout, "--model.name", family,
                               "--model.flavor", "debugmodel", *extra, "--training.steps=2",
                               "--checkpoint.interval=2", "--checkpoint.hf_export=true",
                               "--checkpoint.hf_export_interval=1",
                               "--checkpoint.hf_export_dtype=float32"))  # fmt: skip
    return plan


def _seed_plan() -> list[Run]:
    """A seed checkpoint (one process, of the TP 2 x FSDP 2 model), asked for again (refused),
    trained from under FSDP 2, and loaded by a model of another shape (refused)."""
    seed = [*COMMON, "--checkpoint.create_seed_checkpoint=true", *TP]
    five = ["--training.steps=5", "--checkpoint.interval=5"]
    bigger = ["--model.n_layers=3", "--model.dim=128",
              "--checkpoint.initial_load_path={run:seed}/checkpoint"]  # fmt: skip
    return [
        Run("seed", 1, seed),
        Run("seed_again", 1, seed, copy_from=("seed", "")),
        layout_run("seeded", "fsdp2", *five, copy_from=("seed", "")),
        layout_run("bigger", "fsdp2", *bigger),
    ]


def pool_runs(selected) -> list[Run]:
    """The runs the selected tests need, and what those start from."""
    plan = {r.name: r for r in _plan()}
    want = set()
    for item in selected:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.originalname == "test_exact_resume_with_async_saves":
            want |= {f"resumed_{params['layout']}", f"again_{params['layout']}"}
        if item.originalname == "test_reshard":
            want |= {f"reshard_{params['src']}_{params['dst']}"}
        if item.originalname == "test_hf_export_loads_in_transformers_with_the_trained_logits":
            want |= {f"hf_export_{params['family']}_{params['layout']}"}
        want |= set(NEEDS.get(item.originalname, ()))
    while True:  # and every run those start from
        more = {s for w in want for s in (plan[w].after, (plan[w].copy_from or [None])[0]) if s}
        more |= {"seed"} if "bigger" in want else set()
        if more <= want:
            return [plan[n] for n in sorted(want)]
        want |= more


def losses(dump: Path) -> dict[int, float]:
    """Train loss per step; a resumed run appends, so the latest record of a step wins."""
    path = dump / "metrics.jsonl"
    if not path.is_file():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def log_text(dump: Path) -> str:
    return (dump / "logs" / "rank_0.log").read_text()


def dcp_values(ckpt: Path, keys: dict) -> dict:
    """Small non-tensor entries of a checkpoint, read in this process."""
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.load(keys, checkpoint_id=str(ckpt), no_dist=True)
    if "dataloader" in keys:
        keys["dataloader"] = pickle.loads(keys["dataloader"]["state"])
    return keys


def steps(d: dict, lo: int, hi: int) -> list[float]:
    return [d[s] for s in range(lo, hi + 1)]


@pytest.mark.parametrize("layout", RESUMED)
def test_exact_resume_with_async_saves(runs, layout):
    ref = runs[f"ref_{layout}"].check()
    assert_layout(ref.folder, ref.nproc, ref.args, n_layers(ref))
    assert sorted(losses(ref.folder)) == list(range(1, STEPS + 1))
    resumed = runs[f"resumed_{layout}"].check()
    start = f"step-{RESUME_STEP} (latest checkpoint in the run folder) step {RESUME_STEP}"
    assert start in log_text(resumed.folder)
    assert sorted(losses(resumed.folder)) == list(range(RESUME_STEP + 1, STEPS + 1))
    # async saves at 6, 8 and 10, the latest 2 kept: the copied step-5 and step-6 are gone
    names = sorted(p.name for p in (resumed.folder / "checkpoint").iterdir())
    assert names == [f"step-{STEPS}", f"step-{AGAIN_STEP}"], names
    # every step's loss and grad norm, and the final weights (read from the async step-10)
    assert_parity(ref.folder, resumed.folder, EXACT, first=RESUME_STEP + 1)
    # the asynchronously saved step-8 (weights, optimizer, loader, schedule, RNG) continues
    again = runs[f"again_{layout}"].check()
    start = f"step-{AGAIN_STEP} (latest checkpoint in the run folder) step {AGAIN_STEP}"
    assert start in log_text(again.folder)
    assert sorted(losses(again.folder)) == list(range(AGAIN_STEP + 1, STEPS + 1))
    assert_parity(ref.folder, again.folder, EXACT, first=AGAIN_STEP + 1)


@pytest.mark.parametrize("src,dst", RESHARDS)
def test_reshard(runs, src, dst):
    source = runs[f"ref_{src}"].check()
    assert_layout(source.folder, source.nproc, source.args, n_layers(source))
    src_dump = source.folder
    run = runs[f"reshard_{src}_{dst}"].check()
    assert sorted(losses(run.folder)) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert_layout(run.folder, run.nproc, run.args, n_layers(run))
    assert_parity(src_dump, run.folder, FP32, first=RESUME_STEP + 1)
    if LAYOUTS[src][0] != LAYOUTS[dst][0] and src.startswith("fsdp"):
        # the data loader continued from the global position at another DP degree
        before = dcp_values(src_dump / f"checkpoint/step-{RESUME_STEP}",
                            {"dataloader": {"state": b""}})  # fmt: skip
        after = dcp_values(run.folder / f"checkpoint/step-{STEPS}", {"dataloader": {"state": b""}})
        assert before["dataloader"]["dp_degree"] == 4 and after["dataloader"]["dp_degree"] == 2
        assert before["dataloader"]["consumed_sequences"] == RESUME_STEP * 8
        assert after["dataloader"]["consumed_sequences"] == STEPS * 8


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


def torchrun(dump: Path, layout: str, *args: str) -> subprocess.Popen:
    """`layout` under torchrun itself: the killed save sends SIGKILL to every worker."""
    nproc, extra = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "train.py", "--config", str(TINY_CONFIG), *COMMON,
           *extra, "--job.dump_folder", str(dump), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip


def test_killed_save_leaves_the_previous_checkpoint(tmp_path, runs, pool):
    ref = losses(runs["ref_fsdp2"].check().folder)
    dump = tmp_path / "run"
    ckpt = dump / "checkpoint"
    proc = torchrun(dump, "fsdp2", "--checkpoint.interval=5", "--checkpoint.async_mode=async",
                    "--debug.checkpoint_save_delay_step=10", "--debug.checkpoint_save_delay_s=120")  # fmt: skip
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
    # the same folder, continued by a run of the pool
    again = layout_run("again", "fsdp2", "--checkpoint.interval=5", f"--job.dump_folder={dump}")
    pool.launch(__name__, [again])["again"].check()
    text = log_text(dump)
    assert "ignoring incomplete checkpoint" in text and "step-10.tmp" in text
    assert "step-5 (latest checkpoint in the run folder) step 5" in text
    assert steps(losses(dump), 6, STEPS) == steps(ref, 6, STEPS)
    assert _digest(ckpt / "step-5") == saved
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-10", "step-5"]


def test_seed_checkpoint_then_mismatched_model(runs):
    ref = losses(runs["ref_fsdp2"].check().folder)
    step0 = runs["seed"].check().folder / "checkpoint" / "step-0"
    assert json.loads((step0 / "layout.json").read_text())["contents"] == ["model"]
    again = runs["seed_again"]
    assert again.returncode == 2 and "already holds checkpoints" in again.output, again.output
    # any layout starts from it: same losses as initialising in place
    seeded = runs["seeded"].check().folder
    assert "step-0 (latest checkpoint in the run folder) step 0: model in" in log_text(seeded)
    assert steps(losses(seeded), 1, 5) == steps(ref, 1, 5)

    other = runs["bigger"]
    assert other.returncode != 0
    text = log_text(other.folder)
    assert text.count("does not fit this model") == 1, text
    assert "missing from the checkpoint: model.layers.2." in text
    assert "model.layers.0.attention.wq.weight: checkpoint [64, 64] vs model [128, 128]" in text
    assert losses(other.folder) == {} and "training from step" not in text


def test_weights_only_export_converts_to_hf(tmp_path, runs):
    transformers = pytest.importorskip("transformers")
    from checkpoint.hf import model_from_layout, read_dcp_model
    from models.llama3.model import Transformer

    dump = runs["export"].check().folder
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


def test_converted_hf_model_loads_under_tp_and_fsdp(tmp_path, pool):
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

    start = ["--training.steps=1", f"--checkpoint.initial_load_path={tmp_path / 'converted'}"]
    dump = pool.launch(__name__, [layout_run("run", "tp2_fsdp2", *start)])["run"].check().folder
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


def test_sharded_stream_resumes_at_another_dp_through_train(tmp_path, pool):
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
    stream = ["--training.dataset=huggingface", f"--training.dataset_path={data}",
              "--training.shuffle=false", "--training.stream_shards=4", "--training.steps=6",
              "--checkpoint.interval=3"]  # fmt: skip
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = pool.launch(__name__, [
        layout_run("ref", "fsdp2", *stream, env=env),
        layout_run("resumed", "single", *stream, env=env, copy_from=("ref", "checkpoint/step-3")),
    ])  # fmt: skip
    ref, resumed = done["ref"].check(), done["resumed"].check()
    assert_layout(ref.folder, 2, ref.args)
    saved = dcp_values(ref.folder / "checkpoint/step-3", {"dataloader": {"state": b""}})
    assert saved["dataloader"]["consumed_sequences"] == 3 * 8
    shards = saved["dataloader"]["cursor"]["shards"]
    assert sorted(shards) == ["0", "1", "2", "3"]  # both ranks' shards
    assert_layout(resumed.folder, 1, resumed.args)
    assert sorted(losses(resumed.folder)) == [4, 5, 6]
    assert_parity(ref.folder, resumed.folder, FP32, first=4, step=6)


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
        ("llama3", "pp2_2_layers", []),
    ],
)
def test_hf_folder_loads_directly_into_a_sharded_run(tmp_path, pool, family, layout, extra):
    """checkpoint.initial_load_path = a Hugging Face folder: every rank reads only its slices
    (TP 2 x FSDP 2 and PP 2 for Llama, EP 2 for Qwen3-MoE); the step-1 loss equals the one-process run's
    from the same folder, and the HF model's own loss on that batch."""
    want = hf_folder_for_run(tmp_path / "hf", family)
    model = ["--model.name", family, "--model.flavor", "debugmodel"]
    start = ["--training.steps", "1", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
    done = pool.launch(__name__, [layout_run("one", "single", *model, *start),
                                  layout_run("many", layout, *model, *extra, *start)])  # fmt: skip
    one_run, many_run = done["one"].check(), done["many"].check()
    assert "loaded the weights of Hugging Face folder" in log_text(many_run.folder)
    nproc, layout_args = LAYOUTS[layout]
    args = [*layout_args, *model, *extra]  # the run built the layout it names
    assert_layout(many_run.folder, nproc, args, local_blocks=moe_local_blocks(nproc, args, 2))
    one, many = losses(one_run.folder)[1], losses(many_run.folder)[1]
    assert many == pytest.approx(one, rel=1e-5)
    assert one == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("family,layout,extra", HF_EXPORTS)
def test_hf_export_loads_in_transformers_with_the_trained_logits(runs, family, layout, extra):
    """checkpoint.hf_export: the trained weights as a Hugging Face folder (one tensor gathered
    at a time, written by the lowest rank holding it) that transformers loads with no missing
    or unexpected tensor and whose logits are the trained model's (its final DCP checkpoint)."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.hf import model_from_layout, read_dcp_model

    dump = runs[f"hf_export_{family}_{layout}"].check().folder
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


def test_hf_export_carries_the_runs_hugging_face_tokenizer(tmp_path, pool):
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
    run = layout_run("run", "single", "--model.name", "qwen3", "--model.tokenizer_path", str(tok),
                     "--training.dataset", "text", "--training.dataset_path", str(docs),
                     "--training.steps", "1", "--checkpoint.hf_export", "true")  # fmt: skip
    dump = pool.launch(__name__, [run])["run"].check().folder
    export = dump / "checkpoint" / "hf-step-1"
    assert (export / "tokenizer.json").is_file()
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(export)
    text = "the model and the mesh shard the loss"
    assert theirs(text)["input_ids"] == tokenizers.Tokenizer.from_file(str(tok)).encode(text).ids
    config = json.loads((export / "config.json").read_text())
    assert config["vocab_size"] == theirs.vocab_size and config["torch_dtype"] == "bfloat16"
