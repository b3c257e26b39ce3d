"""Every option of `job_config/schema.py` is proven to reach the code it configures.

`EFFECTS`: one entry per option that changes training: the option, a changed value, and a probe
that builds what the option configures (with the trainer's own functions) and observes it. The
probe runs on a base config and on the base with the changed value: the two observations must
differ, and the changed one must be the expected one. A bug in which the option silently does
not arrive (AdamW built with `betas=(beta1, beta1)`, say) fails here, where one-process and
parity runs, sharing the bug, agree with each other.
`ELSEWHERE`: options whose effect only a launch observes, with the test that does.
`LOGGING_ONLY`: options that change only what is logged or written, each with the reason.
`test_every_option_is_accounted_for` fails when a schema option is in none of the three (a new
option needs its proof) or when an entry names no option of the schema.

`test_resume_restores_every_counter`: what `checkpoint/state.py` saves comes back on resume.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import TINY_SHAPE, fake_world
from torch.distributed.checkpoint import FileSystemReader

from checkpoint.state import COMPONENTS
from data.shuffle import permuted
from job_config import JobConfig, parse_args
from job_config.schema import config_sections
from models import get_model_spec, model_args_for
from parallelisms.layout_record import _rank_view
from parallelisms.parallel_dims import ParallelDims
from training.inputs import sequence_inputs
from training.launch import prepare
from training.loop import TrainState, is_log_step, maybe_inject_failure, optimizer_step
from training.trainer import (
    batch_sizes,
    build_checkpointer,
    build_loaders,
    build_model_parts,
    build_optimizers,
    build_source_validation,
    layout_forward_contexts,
    load_tokenizer,
    meta_model,
    sequence_split,
    start_runtime,
    step_loss_fn,
)

DOCS = [f"document {i}: " + "abc" * (i % 4) for i in range(40)]
BODIES = [f"body {i} " + "xy" * (i % 3) for i in range(40)]
PLAIN = "plain text " * 40


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A byte-level tokenizer (ids = UTF-8 bytes), the same with one merge ("ab"), and two
    corpus folders: `docs` (JSON lines with a `text` and a `body` field, and a text file, the
    one the text reader takes there) and `docs2` (other JSON lines); a module to import."""
    root = tmp_path_factory.mktemp("option_files")

    def tokenizer(name: str, merges: list[bytes]) -> str:
        ranks = [bytes([b]) for b in range(256)] + merges
        path = root / name
        path.write_text(
            "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks))
        )
        return str(path)

    docs, docs2 = root / "corpus", root / "corpus2"
    docs.mkdir(), docs2.mkdir()
    records = (json.dumps({"text": d, "body": b}) + "\n" for d, b in zip(DOCS, BODIES))
    (docs / "docs.jsonl").write_text("".join(records))
    (docs / "docs.txt").write_text(PLAIN)  # what the text reader reads in the same folder
    (docs2 / "docs.jsonl").write_text("".join(json.dumps({"text": d[::-1]}) + "\n" for d in DOCS))
    module = root / "h_options_probe_module.py"  # job.custom_import's
    module.write_text("LOADED = True\n")
    return {
        "probe_module": str(module),
        "tok": tokenizer("bytes.model", []),
        "tok_merge": tokenizer("merge.model", [b"ab"]),
        "docs": str(docs),
        "docs2": str(docs2),
    }


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(autouse=True)
def _private_token_cache(token_cache, monkeypatch):
    """The loaders' token caches go to a temporary folder, not the repository's `.cache`."""
    monkeypatch.setenv("MESHTRAIN_CACHE", token_cache)


def stream(texts: list[str]) -> list[int]:
    """The byte tokenizer's token stream of these documents (BOS 256, EOS 257)."""
    return [t for text in texts for t in (256, *text.encode(), 257)]


@dataclass
class Case:
    """One config a probe observes: the parsed config, its command line and its folder."""

    cfg: JobConfig
    argv: list[str]
    dump: Path


def base_argv(files: dict[str, str], dump: Path) -> list[str]:
    """The tiny run every probe starts from: 2 layers of width 64, the byte tokenizer,
    sequences of 32 tokens from `docs` in corpus order (unshuffled), 10 steps with 2 of
    warmup."""
    return [*TINY_SHAPE, "--model.tokenizer_path", files["tok"], "--training.seq_len", "32",
            "--training.local_batch_size", "4", "--training.steps", "10",
            "--training.dataset", "jsonl", "--training.dataset_path", files["docs"],
            "--training.shuffle", "false",
            "--lr_scheduler.warmup_steps", "2", "--job.dump_folder", str(dump)]  # fmt: skip


# ----------------------------------------------------------------------------------- probes
_TOKENIZERS: dict[str, Any] = {}


def tokenizer(case: Case):
    """`load_tokenizer` of the case's config, loaded once per file."""
    path = case.cfg.model.tokenizer_path
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = load_tokenizer(case.cfg)
    return _TOKENIZERS[path]


def vocab(case: Case) -> int:
    return tokenizer(case).vocab_size


def model(case: Case) -> torch.nn.Module:
    """The whole model on meta, as `build_run` builds it (its RoPE table filled)."""
    cfg = case.cfg
    args = model_args_for(cfg, cfg.training.seq_len, vocab(case))
    m = meta_model(get_model_spec(cfg.model.name), cfg.training, args)
    m.init_buffers("cpu")
    return m


def _sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def real_parts(case: Case) -> list[torch.nn.Module]:
    """The one-process model parts `build_run` trains (materialised on the CPU)."""
    cfg = case.cfg
    args = model_args_for(cfg, cfg.training.seq_len, vocab(case))
    dims = ParallelDims.from_parallelism(cfg.parallelism, 1)
    spec = get_model_spec(cfg.model.name)
    return build_model_parts(cfg, spec, dims, args, torch.device("cpu"), _sum_loss).parts


_BUILT: dict[tuple, Any] = {}  # built layouts by command line (the dump folder left out)


def fake_compile(fn, **kwargs):
    """Stands in for `torch.compile` in the layout probes: marks the function as compiled
    the way the layout record recognises it, without loading the compiler."""

    def compiled(*args, **kw):
        return fn(*args, **kw)

    compiled._torchdynamo_orig_callable = fn
    return compiled


def layout(world: int, key: str) -> Callable[[Case], Any]:
    """`key` of the layout rank 0 of `world` ranks builds (fake process group, real mesh,
    the trainer's `build_model_parts`): the record `layout.json` holds per rank, plus the mesh,
    the pipeline schedule, FSDP's policies, or the error the layout is refused with. The
    base configs' layouts are built once."""

    def probe(case: Case):
        cache_key = (world, *(a.replace(str(case.dump), "<dump>") for a in case.argv))
        if cache_key not in _BUILT:
            _BUILT[cache_key] = _build_layout(case, world)
        view = _BUILT[cache_key]
        return view if isinstance(view, str) else view[key]

    return probe


def _build_layout(case: Case, world: int):
    cfg = case.cfg
    try:
        dims = ParallelDims.from_parallelism(cfg.parallelism, world)
    except ValueError as e:
        return f"{type(e).__name__}: {str(e)[:40]}"
    args = model_args_for(cfg, cfg.training.seq_len, vocab(case))
    with fake_world(world), mock.patch("torch.compile", fake_compile):
        dims.build_mesh("cpu")
        spec = get_model_spec(cfg.model.name)
        built = build_model_parts(cfg, spec, dims, args, torch.device("cpu"), _sum_loss)
        parts, schedule = built.parts, built.schedule
        view = _rank_view(parts, dims)
        view["mesh"] = {n: dims.mesh[n].size() for n in dims.mesh.mesh_dim_names or ()}
        view["schedule"] = type(schedule).__name__ if schedule is not None else None
        view["microbatches"] = getattr(schedule, "_n_microbatches", None)
        view["loss_context"] = layout_forward_contexts(cfg, dims, "cpu")[0].__name__
        fsdp = [m for m in parts[0].modules() if hasattr(m, "_get_fsdp_state")]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp]
        groups = [g for g in groups if g is not None]
        if groups:
            mp = groups[0].mp_policy
            view["mp"] = (str(mp.param_dtype), str(mp.reduce_dtype))
            view["offload"] = type(groups[0].offload_policy).__name__
        view["reshard"] = [g.post_forward_mesh_info is not None for g in groups]
        view["compiled_loss"] = compiled_loss(case)
    return view


def optimizer(case: Case):
    """(optimizer, LR scheduler, parts) as `build_run` builds them, over a model of three
    parameters named as the families name them."""
    part = torch.nn.Module()
    part.tok_embeddings = torch.nn.Embedding(4, 2)
    part.norm = torch.nn.RMSNorm(2)
    part.output = torch.nn.Linear(2, 4, bias=False)
    opt, sched = build_optimizers(case.cfg, [part], "cpu")
    return opt, sched, [part]


def group(key: str, index: int = 0) -> Callable[[Case], Any]:
    return lambda case: optimizer(case)[0].param_groups[index][key]


def no_decay_names(case: Case) -> list[str]:
    opt, _, parts = optimizer(case)
    names = {id(p): n for n, p in parts[0].named_parameters()}
    return sorted(names[id(p)] for p in opt.param_groups[1]["params"])


def lr_factors(case: Case) -> tuple[float, ...]:
    """The LR each step of the loop uses (as `optimizer_step` reads it), over the peak LR, at
    steps 1, 3, 6 and 10."""
    opt, sched, _ = optimizer(case)
    seen = []
    for _ in range(10):
        seen.append(sched.get_last_lr()[0] / case.cfg.optimizer.lr)
        opt.step()
        sched.step()
    return tuple(round(seen[s - 1], 4) for s in (1, 3, 6, 10))


def clipped_norm(case: Case) -> float:
    """The gradient norm the optimizer steps with, after the loop's `optimizer_step` clipped
    a gradient of norm 10."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 5.0)
    opt = torch.optim.SGD([p], lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(round(p.grad.norm().item(), 4)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    noop = SimpleNamespace(mark=lambda *_: None, step=lambda *_: None)
    run = SimpleNamespace(cfg=case.cfg, params=[p], tied_copies=[], pp_group=None, optimizer=opt,
                          routing=None, state=SimpleNamespace(step=1), first_step=0, lr_scheduler=sched,
                          phases=noop, profiler=noop, snapshot=noop)  # fmt: skip
    optimizer_step(run)
    return seen[0]


def batch(case: Case, split: str = "train") -> tuple:
    """(shape, first 12 token ids) of the first batch of the loader `build_run` reads."""
    train_loader, val_loader = build_loaders(case.cfg, tokenizer(case), 0, 1)
    inputs, _ = next(iter(train_loader if split == "train" else val_loader))
    return tuple(inputs.shape), inputs[0, :12].tolist()


def source_validation(case: Case) -> dict:
    """The first 12 ids of each per-source validation loader the trainer builds."""
    loaders = build_source_validation(case.cfg, tokenizer(case), 0, 1)
    return {label: next(iter(data))[0][0, :12].tolist() for label, data in loaders.items()}


def shuffled_row(seed: int) -> list[int]:
    """The first 12 ids of the first sequence of `docs` in the seed's epoch-0 order."""
    tokens = stream(DOCS)
    first = permuted(0, (len(tokens) - 1) // 32, seed, 0)
    return tokens[first * 32 : first * 32 + 12]


def model_kwargs(case: Case) -> list[str]:
    """The keyword arguments the model gets with a batch (`sequence_split` of the layout)."""
    with fake_world(1):
        dims = ParallelDims.from_parallelism(case.cfg.parallelism, 1)
        dims.build_mesh("cpu")
        split = sequence_split(case.cfg, dims)
    inputs = torch.randint(0, 256, (2, 32))
    one_document = torch.zeros_like(inputs, dtype=torch.int32)
    return sorted(sequence_inputs(split, inputs, inputs, one_document)[2])


def runtime(key: str) -> Callable[[Case], Any]:
    """What `start_runtime` (device, process group, seeds, mesh) sets up for one rank; its
    error's type when it refuses."""

    def probe(case: Case):
        dims = ParallelDims.from_parallelism(case.cfg.parallelism, 1)
        try:
            device = start_runtime(case.cfg, dims, 0)
        except RuntimeError as e:
            if dist.is_initialized():
                dist.destroy_process_group()
            return type(e).__name__
        try:
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            return {
                "device": device.type,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "timeout_s": backend.options._timeout.total_seconds(),
            }[key]
        finally:
            torch.use_deterministic_algorithms(False)
            dist.destroy_process_group()

    return probe


def first_weights(case: Case) -> float:
    return round(next(real_parts(case)[0].parameters()).flatten()[:8].sum().item(), 6)


def compiled_loss(case: Case) -> bool:
    """Whether the loss `build_run` backpropagates goes through torch.compile."""
    return hasattr(step_loss_fn(case.cfg).token_loss_sum, "_torchdynamo_orig_callable")


def moe_coefficients(case: Case) -> tuple:
    moe = next(m for m in model(case).modules() if hasattr(m, "aux_coeff"))
    return moe.aux_coeff, moe.bias_rate, moe.z_coeff


# -------------------------------------------------------------------------- checkpoint probes
def checkpointed(case: Case, saves: range = range(0), touch: bool = False, close: bool = True):
    """A checkpoint manager over the tiny run's model, optimizer, schedule, loader and state,
    as `build_run` builds it (it resumes from what its folder holds); then `maybe_save` at
    each step of `saves` (`touch`: the weights move first). (manager, state, parts)."""
    parts = real_parts(case)
    opt, sched = build_optimizers(case.cfg, parts, "cpu")
    loader, _ = build_loaders(case.cfg, tokenizer(case), 0, 1)
    state = TrainState()
    dims = ParallelDims.from_parallelism(case.cfg.parallelism, 1)
    manager = build_checkpointer(case.cfg, dims, parts, opt, sched, loader, state)
    if touch:
        with torch.no_grad():
            for p in parts[0].parameters():
                p.add_(1.0)
    for step in saves:
        state.step, state.tokens_seen = step, 100 * step
        manager.maybe_save(step)
    if manager is not None and close:
        manager.close()
    return manager, state, parts


def saved_steps(saves: range) -> Callable[[Case], list[str]]:
    def probe(case: Case):
        checkpointed(case, saves)
        return sorted(str(p.relative_to(case.dump)) for p in case.dump.glob("**/*step-*"))

    return probe


def checkpoint_folder(case: Case) -> str:
    """Where the manager saves and looks for checkpoints, relative to the case's folder."""
    return str(checkpointed(case)[0].folder.relative_to(case.dump))


def async_pending(case: Case) -> tuple[bool, bool]:
    """(whether the save of step 1 was still in flight when `save` returned, whether it is
    complete after `close`)."""
    manager, _, _ = checkpointed(case, close=False)
    manager.save(1)
    pending = manager.pending is not None
    manager.close()
    return pending, (manager.folder / "step-1").is_dir()


def export_dtype(case: Case) -> str:
    checkpointed(case, range(1, 11))
    md = FileSystemReader(str(case.dump / "checkpoint" / "export-step-10")).read_metadata()
    return str(md.state_dict_metadata["model.norm.weight"].properties.dtype)


def hf_export_dtype(case: Case) -> str:
    from safetensors import safe_open

    checkpointed(case, range(1, 11))
    folder = case.dump / "checkpoint" / "hf-step-10"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    fname = index["weight_map"]["model.norm.weight"]
    with safe_open(str(folder / fname), framework="pt") as f:
        return str(f.get_slice("model.norm.weight").get_dtype())


def resumed(case: Case) -> tuple:
    """A first run saves step 2 with its weights moved by +1, in the run's own folder (in the
    folder `checkpoint.initial_load_path` names, when set); the run then starts: (its step,
    whether its weights are the moved ones) or the type of the error it refused with."""
    cfg, path = case.cfg, case.cfg.checkpoint.initial_load_path
    first = dataclasses.replace(
        cfg,
        job=dataclasses.replace(
            cfg.job, dump_folder=str(Path(path).parent) if path else cfg.job.dump_folder
        ),
        checkpoint=dataclasses.replace(
            cfg.checkpoint,
            interval=1,
            load_step=-1,
            initial_load_path="",
            exclude_from_loading=[],
        ),
    )
    checkpointed(Case(first, case.argv, case.dump), range(2, 3), touch=True)
    try:
        manager, state, parts = checkpointed(case)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    moved = torch.cat([p.detach().flatten() for p in parts[0].parameters()]).mean() > 0.5
    return state.step, bool(moved)


def seed_checkpoint_or_dry_run(case: Case) -> tuple:
    """`training.launch.prepare` on the case's command line: (what it returned, what it printed, the
    step folders it wrote); the logging it sets up is undone."""
    root = logging.getLogger("meshtrain")
    handlers, propagate = list(root.handlers), root.propagate
    factory = logging.getLogRecordFactory()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            launch = prepare(case.argv)
    finally:
        root.handlers[:] = handlers
        root.propagate = propagate
        logging.setLogRecordFactory(factory)
    printed = out.getvalue()
    return (
        type(launch).__name__,
        "dry run" in printed,
        "layout: world=2" in printed,
        sorted(p.name for p in case.dump.glob("checkpoint/step-*")),
    )


def save_sleeps(case: Case) -> list[float]:
    """The sleeps (s) of the save at step 2 (debug.checkpoint_save_delay_*)."""
    with mock.patch("checkpoint.manager.time.sleep") as sleep:
        checkpointed(case, range(2, 3))
    return [c.args[0] for c in sleep.call_args_list]


def imported(case: Case) -> bool:
    seed_checkpoint_or_dry_run(case)
    return sys.modules.pop("h_options_probe_module", None) is not None


def injected(case: Case) -> list[tuple[int, str]]:
    """The steps of 1 to 10 at which the loop's fault injection makes the last of 2 ranks
    fail or hang (its hour-long sleep recorded, not slept)."""
    seen = []
    for step in range(1, 11):
        with mock.patch("training.loop.time.sleep") as sleep, mock.patch("signal.signal"):
            try:
                maybe_inject_failure(case.cfg, step, 1, 2)
            except RuntimeError:
                seen.append((step, "fails"))
            if sleep.called:
                seen.append((step, "hangs"))
    return seen


# ------------------------------------------------------------------------------- the table
DIFFERS = object()  # the expected observation: anything but the base's


@dataclass(frozen=True)
class Effect:
    value: str  # the changed value, as typed on the command line ({dump} and `files` filled)
    probe: Callable[[Case], Any]
    expect: Any = DIFFERS  # the changed config's observation, or a function of its Case
    base: tuple[str, ...] = ()  # options the base needs for this one to count
    extra: tuple[str, ...] = ()  # more options the changed config needs with the value


CKPT = ("--checkpoint.enable", "true")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
VAL = (
    "--validation.enable",
    "true",
    "--validation.freq",
    "5",
    "--validation.dataset_path",
    "{docs}",
)
MOE = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel")
# a mixture of docs alone (no dataset or dataset_path beside a mixture)
ONE_SOURCE_MIX = ("--training.dataset", "sample", "--training.dataset_path", "",
                  "--training.mixture", '["jsonl:{docs}:1"]')  # fmt: skip

EFFECTS: dict[str, Effect] = {
    # [job]
    "job.dump_folder": Effect("{dump}/elsewhere", checkpoint_folder, "elsewhere/checkpoint", CKPT),
    "job.custom_import": Effect("{probe_module}", imported, True, ("--job.dry_run", "true")),
    "job.dry_run": Effect("true", seed_checkpoint_or_dry_run, ("NoneType", True, False, [])),
    "job.simulate_world_size": Effect(
        "2", seed_checkpoint_or_dry_run, ("NoneType", True, True, []), ("--job.dry_run", "true")
    ),
    # [model]
    "model.name": Effect("qwen3", lambda c: type(model(c)).__name__, "Qwen3"),
    "model.flavor": Effect("8B", lambda c: model(c).args.use_scaled_rope, True),
    "model.tokenizer_path": Effect(
        "{tok_merge}", lambda c: load_tokenizer(c.cfg).encode("ab", bos=False, eos=False), [256]
    ),
    "model.dim": Effect("32", lambda c: model(c).tok_embeddings.weight.shape[1], 32),
    "model.n_layers": Effect("3", lambda c: len(model(c).layers), 3),
    "model.n_heads": Effect(  # head_dim = dim / n_heads: 8, so the 2 KV heads are 16 wide
        "8", lambda c: model(c).layers["0"].attention.wk.weight.shape[0], 16
    ),
    "model.n_kv_heads": Effect(
        "4", lambda c: model(c).layers["0"].attention.wk.weight.shape[0], 64
    ),
    "model.rope_scaling": Effect(
        "llama3", lambda c: round(model(c).rope.float().abs().sum().item(), 3)
    ),
    # [moe]
    "moe.aux_loss_coeff": Effect("0.5", moe_coefficients, (0.5, 0.0, 0.0), MOE),
    "moe.bias_update_rate": Effect("0.25", moe_coefficients, (0.001, 0.25, 0.0), MOE),
    "moe.z_loss_coeff": Effect("0.125", moe_coefficients, (0.001, 0.0, 0.125), MOE),
    # [optimizer]
    "optimizer.name": Effect("Adam", lambda c: type(optimizer(c)[0]).__name__, "Adam"),
    "optimizer.lr": Effect("0.25", group("initial_lr"), 0.25),
    "optimizer.beta1": Effect("0.5", group("betas"), (0.5, 0.95)),
    "optimizer.beta2": Effect("0.75", group("betas"), (0.9, 0.75)),
    "optimizer.eps": Effect("0.001", group("eps"), 0.001),
    "optimizer.weight_decay": Effect("0.25", group("weight_decay"), 0.25),
    "optimizer.no_decay_patterns": Effect(
        "['tok_embeddings']", no_decay_names, ["tok_embeddings.weight"]
    ),
    "optimizer.implementation": Effect(
        "for-loop", lambda c: (group("fused")(c), group("foreach")(c)), (False, False)
    ),
    # [lr_scheduler]: the base is 10 steps, 2 of warmup, a linear decay to 0
    "lr_scheduler.warmup_steps": Effect("4", lr_factors, (0.2, 0.6, 0.6667, 0.0)),
    "lr_scheduler.decay_ratio": Effect("0.5", lr_factors, (0.3333, 1.0, 0.8, 0.0)),
    "lr_scheduler.decay_type": Effect("cosine", lr_factors, (0.3333, 0.9619, 0.5, 0.0)),
    "lr_scheduler.min_lr_factor": Effect("0.1", lr_factors, (0.3333, 0.8875, 0.55, 0.1)),
    # [training]
    "training.dataset": Effect("text", batch, ((4, 32), stream([PLAIN])[:12])),
    "training.dataset_path": Effect(
        "{docs2}", batch, ((4, 32), stream([d[::-1] for d in DOCS])[:12])
    ),
    "training.dataset_text_field": Effect("body", batch, ((4, 32), stream(BODIES)[:12])),
    # a mixture weighted 1:3 starts with docs2's (its share is the furthest behind)
    "training.mixture": Effect(
        '["jsonl:{docs}:1", "jsonl:{docs2}:3"]',
        batch,
        ((4, 32), stream([d[::-1] for d in DOCS])[:12]),
        ONE_SOURCE_MIX,
    ),
    "training.shuffle": Effect("true", batch, lambda c: ((4, 32), shuffled_row(0))),
    "training.shuffle_seed": Effect(
        "7", batch, lambda c: ((4, 32), shuffled_row(7)), ("--training.shuffle", "true")
    ),
    "training.local_batch_size": Effect("2", lambda c: batch(c)[0], (2, 32)),
    "training.seq_len": Effect("16", lambda c: batch(c)[0], (4, 16)),
    "training.global_batch_size": Effect(
        "12", lambda c: tuple(batch_sizes(c.cfg, 1)), (12, 3, 384)
    ),
    "training.document_mask": Effect(
        "true",
        lambda c: (model_kwargs(c), len(next(iter(build_loaders(c.cfg, tokenizer(c), 0, 1)[0])))),
        (["documents", "positions"], 3),  # the loader adds the documents from the index
    ),
    "training.steps": Effect("20", lr_factors, (0.3333, 0.9444, 0.7778, 0.5556)),
    "training.max_norm": Effect("0.5", clipped_norm, 0.5),
    "training.mixed_precision_param": Effect(
        "bfloat16", layout(2, "mp"), ("torch.bfloat16", "torch.float32")
    ),
    "training.mixed_precision_reduce": Effect(
        "bfloat16", layout(2, "mp"), ("torch.float32", "torch.bfloat16")
    ),
    "training.device": Effect(
        "cuda",
        runtime("device"),
        lambda c: "cuda" if torch.cuda.is_available() else "LaunchError",
        ("--training.device", "cpu"),
    ),
    "training.enable_cpu_offload": Effect("true", layout(2, "offload"), "CPUOffloadPolicy"),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": Effect(
        "2", layout(4, "mesh"), {"dp_replicate": 2, "dp_shard": 2}
    ),
    "parallelism.data_parallel_shard_degree": Effect(  # -1 fills the world; 2 of 4 is refused
        "2", layout(4, "mesh"), "ParallelismError: Parallel degrees multiply to 2, not the "
    ),
    "parallelism.tensor_parallel_degree": Effect("2", layout(4, "mesh"), {"dp_shard": 2, "tp": 2}),
    "parallelism.context_parallel_degree": Effect(
        "2", layout(4, "context_parallel_blocks"), ["0", "1"]
    ),
    "parallelism.context_parallel_method": Effect(
        "ulysses", layout(4, "context_parallel_method"), ["ulysses"], CP2
    ),
    "parallelism.expert_parallel_degree": Effect(
        "2", layout(4, "mesh"), {"dp_shard_mod_ep": 2, "ep": 2}, MOE
    ),
    "parallelism.pipeline_parallel_degree": Effect("2", layout(2, "layers"), ["0"]),
    "parallelism.zero_stage": Effect(
        "1",
        layout(2, "data_parallel"),
        {"kind": "zero", "zero_stage": 1, "mesh": ["dp_shard"]},
    ),
    "parallelism.fsdp_reshard_after_forward": Effect("never", layout(2, "reshard"), [False] * 5),
    "parallelism.disable_loss_parallel": Effect(
        "true", layout(2, "loss_context"), "nullcontext", TP2
    ),
    "parallelism.pipeline_parallel_schedule": Effect(
        "GPipe", layout(2, "schedule"), "ScheduleGPipe", PP2
    ),
    "parallelism.pipeline_parallel_microbatch_size": Effect("2", layout(2, "microbatches"), 2, PP2),
    "parallelism.pipeline_parallel_layers_per_stage": Effect(
        "1",
        layout(2, "stages"),
        4,
        (
            *PP2,
            "--model.n_layers",
            "8",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ),  # fmt: skip
    ),
    "parallelism.pipeline_parallel_split_points": Effect(
        "['layers.1']", layout(2, "layers"), ["0"], (*PP2, "--model.n_layers", "4")
    ),
    # [checkpoint]
    "checkpoint.enable": Effect("true", lambda c: checkpointed(c)[0] is not None, True),
    "checkpoint.folder": Effect("ckpts", checkpoint_folder, "ckpts", CKPT),
    "checkpoint.interval": Effect(
        "5",
        lambda c: [s for s in range(1, 11) if checkpointed(c)[0].due(s)],
        [5, 10],
        CKPT,
    ),
    "checkpoint.keep_latest_k": Effect(
        "1",
        saved_steps(range(1, 3)),
        ["checkpoint/step-2"],
        (*CKPT, "--checkpoint.interval", "1"),
    ),
    "checkpoint.async_mode": Effect("async", async_pending, (True, True), CKPT),
    "checkpoint.load_step": Effect("1", resumed, "CheckpointError", CKPT),  # no step-1
    "checkpoint.model_only": Effect(
        "true",
        saved_steps(range(10, 11)),
        ["checkpoint/export-step-10", "checkpoint/step-10"],
        CKPT,
    ),
    "checkpoint.export_dtype": Effect(
        "bfloat16", export_dtype, "torch.bfloat16", (*CKPT, "--checkpoint.model_only", "true")
    ),
    "checkpoint.hf_export": Effect(
        "true",
        saved_steps(range(10, 11)),
        ["checkpoint/hf-step-10", "checkpoint/step-10"],
        CKPT,
    ),
    "checkpoint.hf_export_interval": Effect(
        "4",
        saved_steps(range(1, 11)),
        [
            "checkpoint/hf-step-10",
            "checkpoint/hf-step-4",
            "checkpoint/hf-step-8",
            "checkpoint/step-10",
        ],
        (*CKPT, "--checkpoint.hf_export", "true"),
    ),
    "checkpoint.hf_export_dtype": Effect(
        "float16", hf_export_dtype, "F16", (*CKPT, "--checkpoint.hf_export", "true")
    ),
    "checkpoint.exclude_from_loading": Effect("['train_state']", resumed, (0, True), CKPT),
    "checkpoint.create_seed_checkpoint": Effect(
        "true", seed_checkpoint_or_dry_run, ("NoneType", False, False, ["step-0"])
    ),
    "checkpoint.initial_load_path": Effect("{dump}/other/checkpoint", resumed, (0, True), CKPT),
    "checkpoint.initial_load_model_only": Effect(
        "false",
        resumed,
        (2, True),
        (*CKPT, "--checkpoint.initial_load_path", "{dump}/other/checkpoint"),  # fmt: skip
    ),
    # [activation_checkpoint], [compile]
    "activation_checkpoint.mode": Effect("full", layout(1, "ac_blocks"), ["0", "1"]),
    "activation_checkpoint.selective_ac_option": Effect(
        "op",
        layout(1, "ac_selective_op_blocks"),
        ["0", "1"],
        ("--activation_checkpoint.mode", "selective"),
    ),
    "compile.enable": Effect(
        "true",
        lambda c: (layout(1, "compiled_blocks")(c), layout(1, "compiled_loss")(c)),
        (["0", "1"], True),
    ),
    "compile.components": Effect(
        "['loss']",
        lambda c: (layout(1, "compiled_blocks")(c), layout(1, "compiled_loss")(c)),
        ([], True),
        ("--compile.enable", "true"),
    ),
    # [metrics]: the log steps are also where the loop checks for NaN and agrees to stop
    "metrics.log_freq": Effect(
        "4",
        lambda c: [
            s
            for s in range(1, 11)
            if is_log_step(SimpleNamespace(cfg=c.cfg, state=SimpleNamespace(step=s), first_step=1))
        ],  # fmt: skip
        [1, 4, 8, 10],
    ),
    # [validation]
    "validation.enable": Effect(
        "true",
        lambda c: build_loaders(c.cfg, tokenizer(c), 0, 1)[1] is not None,
        True,
        extra=VAL[2:],
    ),
    "validation.dataset": Effect(
        "text",
        lambda c: batch(c, "validation")[1],
        stream([PLAIN])[:12],
        VAL,
    ),
    "validation.dataset_path": Effect(
        "{docs2}",
        lambda c: batch(c, "validation")[1],
        stream([d[::-1] for d in DOCS])[:12],
        VAL,
    ),
    # held-out data of each mixture source (here one, docs2's), evaluated apart
    "validation.per_source": Effect(
        '["jsonl:{docs2}"]',
        source_validation,
        {"mix0": stream([d[::-1] for d in DOCS])[:12]},
        (*ONE_SOURCE_MIX, *VAL, "--validation.dataset", "jsonl"),
    ),
    # [comm]
    "comm.init_timeout_seconds": Effect("77", runtime("timeout_s"), 77.0),
    # [debug]
    "debug.seed": Effect("7", first_weights),
    "debug.deterministic": Effect("true", runtime("deterministic"), True),
    "debug.fail_at_step": Effect("3", injected, [(3, "fails")]),
    "debug.hang_at_step": Effect("4", injected, [(4, "hangs")]),
    "debug.checkpoint_save_delay_step": Effect(
        "2", save_sleeps, [60.0], (*CKPT, "--checkpoint.interval", "1")
    ),
    "debug.checkpoint_save_delay_s": Effect(
        "0.25",
        save_sleeps,
        [0.25],
        (*CKPT, "--checkpoint.interval", "1", "--debug.checkpoint_save_delay_step", "2"),
    ),
}

# The effect only a run of several processes shows; the named tests launch one.
ELSEWHERE: dict[str, str] = {
    "comm.train_timeout_seconds": "tests/integration/test_fault_tolerance.py::"
    "test_hung_rank_becomes_an_error_naming_rank_and_step",
    "training.stream_shards": "tests/unit/test_data_loader.py::"
    "test_stream_shards_from_the_config_reach_the_training_loader",
}

LOGGING_ONLY: dict[str, str] = {
    "job.config_file": "records which preset was loaded; its values are the options themselves",
    "job.description": "free text written to the log at start",
    "metrics.enable_tensorboard": "writes TensorBoard event files beside metrics.jsonl",
    "metrics.save_tb_folder": "where the TensorBoard files go",
    "moe.idle_warn_steps": "when a warning about idle experts is logged",
    "profiling.enable_profiling": "records profiler traces; the steps compute the same",
    "profiling.save_traces_folder": "where the traces go",
    "profiling.profile_freq": "which steps are traced",
    "profiling.profiler_warmup": "traced steps discarded before the recorded ones",
    "profiling.profiler_active": "how many steps each trace records",
    "profiling.enable_memory_snapshot": "records CUDA allocator history for a snapshot file",
    "profiling.save_memory_snapshot_folder": "where the snapshot goes",
    "profiling.memory_snapshot_step": "after which step the snapshot is written",
    "validation.freq": "how often the held-out loss is measured (no training state changes)",
    "validation.steps": "how many held-out global batches each measurement averages",
}


def schema_options() -> set[str]:
    return {
        f"{section}.{f.name}"
        for section in config_sections()
        for f in dataclasses.fields(getattr(JobConfig(), section))
    }


def _case(files, root: Path, name: str, argv: list[str]) -> Case:
    dump = root / name
    fill = {**files, "dump": str(dump)}
    argv = [a.format(**fill) for a in argv]
    return Case(parse_args(argv), argv, dump)


@pytest.mark.parametrize("option", sorted(EFFECTS))
def test_option_takes_effect(option, files, tmp_path):
    effect = EFFECTS[option]
    argv = lambda dump: base_argv(files, dump) + list(effect.base)  # noqa: E731
    base = _case(files, tmp_path, "base", argv(tmp_path / "base"))
    changed = _case(
        files,
        tmp_path,
        "changed",
        argv(tmp_path / "changed") + [f"--{option}", effect.value, *effect.extra],
    )
    section, key = option.split(".")
    assert getattr(getattr(base.cfg, section), key) != getattr(getattr(changed.cfg, section), key)
    seen_base, seen = effect.probe(base), effect.probe(changed)
    assert seen != seen_base, f"{option} = {effect.value} changed nothing: {seen!r}"
    if effect.expect is not DIFFERS:
        want = effect.expect(changed) if callable(effect.expect) else effect.expect
        assert seen == want, f"{option} = {effect.value}: observed {seen!r}, expected {want!r}"


def test_every_option_is_accounted_for():
    """A new option fails here until it has an effect test or a logging-only entry; an entry
    for an option the schema no longer has fails too."""
    options = schema_options()
    tables = {
        "EFFECTS": set(EFFECTS),
        "ELSEWHERE": set(ELSEWHERE),
        "LOGGING_ONLY": set(LOGGING_ONLY),
    }
    listed = set().union(*tables.values())
    assert not options - listed, f"options without a proof of effect: {sorted(options - listed)}"
    for name, keys in tables.items():
        assert keys <= options, f"{name} lists options the schema lacks: {sorted(keys - options)}"
    assert sum(map(len, tables.values())) == len(listed), "an option is listed twice"
    assert all(reason.strip() for reason in LOGGING_ONLY.values())


def test_elsewhere_entries_name_existing_tests():
    root = Path(__file__).resolve().parents[2]
    for option, node in ELSEWHERE.items():
        path, _, name = node.partition("::")
        assert f"def {name}(" in (root / path).read_text(), f"{option}: no test {node}"


# --------------------------------------------------------------------------- resume counters
def test_resume_restores_every_counter(files, tmp_path):
    """A run saves after 3 steps of real training; a fresh run built from the same config
    resumes and must hold every saved component as it was (`checkpoint.state.COMPONENTS`):
    weights, optimizer state (step counts, moments), LR schedule position, data loader
    position (its next batch), step and tokens seen, and the RNG streams.

    The launches of tests/integration/test_checkpoint_train.py (test_exact_resume_with_async_saves)
    and tests/integration/test_checkpoint.py (test_resume_continues_bit_identically) show a
    resumed run's losses, gradient norms and weights continue exactly, which needs the model,
    optimizer, schedule, loader position and step; they cannot see tokens_seen (a logged count)
    or the RNG streams (dropout-free training draws nothing after the initialisation)."""
    assert COMPONENTS == ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
    argv = base_argv(files, tmp_path) + [
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
    ]
    case = Case(parse_args(argv), argv, tmp_path)
    parts = real_parts(case)
    opt, sched = build_optimizers(case.cfg, parts, "cpu")
    loader, _ = build_loaders(case.cfg, tokenizer(case), 0, 1)
    data = iter(loader)
    state = TrainState()
    manager = build_checkpointer(case.cfg, None, parts, opt, sched, loader, state)
    for _ in range(3):
        inputs, labels = next(data)
        state.step += 1
        state.tokens_seen += inputs.numel()
        torch.nn.functional.cross_entropy(
            parts[0](inputs).flatten(0, 1), labels.flatten()
        ).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    manager.maybe_save(3)
    manager.close()
    want = {
        "weights": [p.detach().clone() for p in parts[0].parameters()],
        "moments": [opt.state[p]["exp_avg"].clone() for p in parts[0].parameters()],
        "optimizer_steps": [float(opt.state[p]["step"]) for p in parts[0].parameters()],
        "lr": sched.get_last_lr(),
        "schedule_step": sched.last_epoch,
        "next_batch": next(data)[0],
        "counters": (state.step, state.tokens_seen),
        "rng": (random.random(), np.random.rand(), torch.rand(1)),
    }

    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # the resumed run's own seeds
    parts2 = real_parts(Case(parse_args(argv + ["--debug.seed", "5"]), argv, tmp_path))
    opt2, sched2 = build_optimizers(case.cfg, parts2, "cpu")
    loader2, _ = build_loaders(case.cfg, tokenizer(case), 0, 1)
    state2 = TrainState()
    manager2 = build_checkpointer(case.cfg, None, parts2, opt2, sched2, loader2, state2)
    got_rng = (random.random(), np.random.rand(), torch.rand(1))
    manager2.close()
    params2 = list(parts2[0].parameters())
    assert (state2.step, state2.tokens_seen) == want["counters"] == (3, 3 * 4 * 32)
    assert all(torch.equal(a, b) for a, b in zip(params2, want["weights"]))
    assert all(torch.equal(opt2.state[p]["exp_avg"], m) for p, m in zip(params2, want["moments"]))
    assert [float(opt2.state[p]["step"]) for p in params2] == want["optimizer_steps"]
    assert sched2.last_epoch == want["schedule_step"] == 3
    assert sched2.get_last_lr() == want["lr"]
    assert opt2.param_groups[0]["lr"] == want["lr"][0]
    assert torch.equal(next(iter(loader2))[0], want["next_batch"])
    assert got_rng[:2] == want["rng"][:2] and torch.equal(got_rng[2], want["rng"][2])
