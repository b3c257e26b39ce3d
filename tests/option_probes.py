"""What `tests/unit/test_option_effects.py`'s table observes: the files every probe reads
(`write_option_files`), the base command line, and one probe per kind of effect, each building
what an option configures with the trainer's own functions (optimizer, schedule, batches,
model, layout on a fake process group, checkpoint manager ...) and returning what it sees.
`tests/unit/test_resume_counters.py` trains and resumes with the same pieces."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from dist_utils import TINY_SHAPE, fake_world
from torch.distributed.checkpoint import FileSystemReader

from data.shuffle import permuted
from job_config import JobConfig
from models import get_model_spec, model_args_for
from parallelisms.layout_record import _rank_view
from parallelisms.parallel_dims import ParallelDims
from training.inputs import sequence_inputs
from training.launch import prepare
from training.loop import TrainState, maybe_inject_failure, optimizer_step
from training.trainer import (
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


def write_option_files(root: Path) -> dict[str, str]:
    """A byte-level tokenizer (ids = UTF-8 bytes), the same with one merge ("ab"), and two
    corpus folders: `docs` (JSON lines with a `text` and a `body` field, and a text file, the
    one the text reader takes there) and `docs2` (other JSON lines); a module to import."""

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


def muon_update(case: Case) -> list[float]:
    """A hidden [3, 6] matrix after two optimizer steps on fixed gradients (Muon's keys: the
    momentum carries into the second), to 6 digits."""
    part = torch.nn.Module()
    part.tok_embeddings = torch.nn.Embedding(4, 6)
    part.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(6, 3, bias=False)})
    part.norm = torch.nn.RMSNorm(6)
    part.output = torch.nn.Linear(6, 4, bias=False)
    weight = part.layers["0"].weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight.copy_(torch.randn(3, 6, generator=gen))
    opt, _ = build_optimizers(case.cfg, [part], "cpu")
    for _ in range(2):
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
        weight.grad = torch.randn(3, 6, generator=gen)
        opt.step()
    return [round(v, 6) for v in weight.flatten().tolist()]


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
        split = sequence_split(case.cfg, dims, model_args_for(case.cfg, case.cfg.training.seq_len))
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


def prediction(case: Case) -> tuple:
    """The multi-token prediction `build_run` trains: (modules, each one's loss weight as the
    trainer sets it, whether the batches bring the later labels)."""
    from models import mtp
    from training.loss import StepLoss, cross_entropy_sum
    from training.trainer import multi_token_prediction

    m = model(case)
    multi_token_prediction(m.args, [m], StepLoss(cross_entropy_sum))
    found = mtp.modules(m)
    return len(found), [x.weight for x in found], "mtp_labels" in model_kwargs(case)


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
