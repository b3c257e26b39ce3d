"""What goes into a checkpoint and how it comes back out.

Top-level keys of the DCP state dict (DCP flattens nested dicts with dots):

    model.<fqn>                       parameters, sharded DTensors or plain tensors
    optimizer.state.<fqn>.<name>      optimizer state per parameter (flattened, so that any
    optimizer.param_groups.<fqn>.<k>  pipeline split can load any other)
    lr_scheduler.<key>                the LR scheduler's state dict
    dataloader.state                  the loader's state (its global position), pickled
    train_state.step / .tokens_seen   progress counters
    rng.rank<r>                       each rank's Python/NumPy/torch RNG states, pickled

FQNs are those of the plain model, whatever wrappers (FSDP, TP, compile, activation
checkpointing) or pipeline split the run uses, so every layout can load every other.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import random
import warnings
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint.storage import CheckpointError

COMPONENTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_view(model_parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the plain model's, over all local model parts.

    A single part is returned as is. Several parts (virtual pipeline stages on one rank) are
    merged into a container that shares their submodules: same-named children that differ
    (e.g. each stage's `layers` dict) are merged recursively, so the FQNs stay stable."""
    if len(model_parts) == 1:
        return model_parts[0]
    view = nn.Module()
    for part in model_parts:
        _merge_into(view, part)
    return view


def _merge_into(dst: nn.Module, src: nn.Module) -> None:
    for name, p in src._parameters.items():
        if p is not None:
            dst.register_parameter(name, p)
    for name, b in src._buffers.items():
        if b is not None and name not in src._non_persistent_buffers_set:
            dst.register_buffer(name, b)
    for name, child in src._modules.items():
        if child is None:
            continue
        mine = dst._modules.get(name)
        if mine is None:
            dst.add_module(name, child)
        elif mine is not child:
            if type(mine) is not nn.Module:  # first clash: copy the first part's child
                merged = nn.Module()
                _merge_into(merged, mine)
                dst._modules[name] = merged
                mine = merged
            _merge_into(mine, child)


def rng_state() -> bytes:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _optimizers(optimizer) -> tuple:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def build_state(
    components: Iterable[str],
    *,
    model: nn.Module,
    optimizer=None,
    lr_scheduler=None,
    dataloader=None,
    train_state=None,
    rank: int = 0,
    export_dtype: torch.dtype | None = None,
) -> dict:
    """The state dict to save (or the targets to load into) for the given components."""
    components = set(components)
    sd: dict = {}
    if "model" in components:
        msd = get_model_state_dict(model)
        if export_dtype is not None:
            msd = {k: v.to(export_dtype) for k, v in msd.items()}
        sd["model"] = msd
    if "optimizer" in components:
        sd["optimizer"] = get_optimizer_state_dict(
            model, _optimizers(optimizer), options=OPTIM_OPTIONS
        )
    if "lr_scheduler" in components:
        sd["lr_scheduler"] = lr_scheduler.state_dict()
    if "dataloader" in components:
        sd["dataloader"] = {"state": pickle.dumps(dataloader.state_dict())}
    if "train_state" in components:
        sd["train_state"] = dict(train_state.state_dict())
    if "rng" in components:
        sd["rng"] = {f"rank{rank}": rng_state()}
    return sd


def load_schedule(lr_scheduler, optimizer, state: dict) -> None:
    """The schedule's position from `state`; its per-group lists stay this rank's own: the
    saved copy is one rank's, and ranks of different pipeline stages can hold different
    param groups (Muon's matrices and AdamW's vectors are split by what each stage has). The
    last LR is each group's restored one (what the next step uses)."""
    per_group = ("base_lrs", "_last_lr")
    lr_scheduler.load_state_dict({k: v for k, v in state.items() if k not in per_group})
    opt = _optimizers(optimizer)[0] if optimizer is not None else lr_scheduler.optimizer
    lr_scheduler._last_lr = [g["lr"] for g in opt.param_groups]


def apply_state(
    sd: dict,
    *,
    model: nn.Module,
    optimizer=None,
    lr_scheduler=None,
    dataloader=None,
    train_state=None,
    rank: int = 0,
) -> None:
    """Puts loaded values back into the live objects (tensors were loaded in place)."""
    if "model" in sd:
        set_model_state_dict(model, sd["model"])
    if "optimizer" in sd:
        set_optimizer_state_dict(
            model, _optimizers(optimizer), sd["optimizer"], options=OPTIM_OPTIONS
        )
    if "lr_scheduler" in sd:
        load_schedule(lr_scheduler, optimizer, sd["lr_scheduler"])
    if "dataloader" in sd:
        dataloader.load_state_dict(pickle.loads(sd["dataloader"]["state"]))
    if "train_state" in sd:
        train_state.load_state_dict(sd["train_state"])
    if "rng" in sd:
        set_rng_state(sd["rng"][f"rank{rank}"])


def tied_aliases(sd: dict, metadata: dict, tied: dict[str, str]) -> list[tuple[str, str, str]]:
    """(section, key, alias) for each entry of `sd` that belongs to a tied weight's second use
    (`tied`: {copy: parameter}, the model's `tied_parameters()`) and that the checkpoint holds
    only under the parameter's own name: a layout that keeps one tied parameter (FSDP, ZeRO)
    saves its optimizer state once, and a pipeline stage holding the copy reads that."""
    out = []
    for section, prefixes in (("model", ("",)), ("optimizer", ("state.", "param_groups."))):
        for key in sd.get(section, {}):
            for (copy, source), pre in itertools.product(tied.items(), prefixes):
                if key == pre + copy or key.startswith(f"{pre}{copy}."):
                    alias = pre + source + key[len(pre + copy) :]
                    if f"{section}.{key}" not in metadata and f"{section}.{alias}" in metadata:
                        out.append((section, key, alias))
    return out


@contextlib.contextmanager
def reading_aliases(sd: dict, aliases: list[tuple[str, str, str]]):
    """Around a DCP load into `sd`: each aliased entry is read under its alias (or, where this
    rank holds the alias too, copied from it after the load)."""
    moved = [(s, k, a) for s, k, a in aliases if a not in sd[s]]
    for section, key, alias in moved:
        sd[section][alias] = sd[section].pop(key)
    yield
    for section, key, alias in moved:
        sd[section][key] = sd[section].pop(alias)
    for section, key, alias in aliases:
        if (section, key, alias) not in moved:
            value, target = sd[section][alias], sd[section][key]
            if isinstance(target, torch.Tensor):
                target.copy_(value)
            else:
                sd[section][key] = value


@contextlib.contextmanager
def single_process():
    """Silences DCP's warning that a one-process save/load runs without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_metadata(path) -> dict:
    """{flattened key: TensorStorageMetadata | BytesStorageMetadata} of a checkpoint."""
    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # a truncated or foreign .metadata file
        raise CheckpointError(f"Cannot read the DCP metadata of {path}: {e}") from None


def _shape(v) -> tuple[int, ...] | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def gather_objects(obj, group=None) -> list:
    """`obj` from every rank of `group` (a collective: all call it together); [obj] alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _listing(title: str, items: list[str], limit: int = 12) -> str:
    more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{len(items)} {title}: " + ", ".join(items[:limit]) + more


def _of_param(key: str, fqns: set[str]) -> bool:
    return key.startswith("optimizer.") and any(f".{f}." in key for f in fqns)


# Dtype names of exports and conversions (checkpoint.export_dtype, the convert scripts' --dtype)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_args(path, layout: dict, args, function_args: tuple[str, ...]) -> None:
    """Raises when the checkpoint's recorded model arguments (layout.json) differ from the
    run's in `function_args` (the family's `ModelSpec.function_args`: arguments that change
    what the weights compute without changing any tensor's shape, which is check_fits' job),
    e.g. Llama 3.1 weights loaded without their RoPE scaling."""
    saved = (layout.get("model") or {}).get("args") or {}
    diffs = [
        f"{k}: checkpoint {saved[k]!r} vs model {getattr(args, k)!r}"
        for k in function_args
        if k in saved and hasattr(args, k) and saved[k] != getattr(args, k)
    ]
    if diffs:
        raise CheckpointError(
            f"{path} was saved by a model that computes differently from this run's ("
            + "; ".join(diffs)
            + "). Configure the run like the checkpoint: its model.flavor, and the [model] "
            "options that set these arguments (model.rope_scaling sets use_scaled_rope)."
        )


def check_fits(path, sd: dict, metadata: dict, group=None, aliases=()) -> None:
    """Raises one CheckpointError listing every key of `sd` missing from the checkpoint,
    every shape that differs, and every model key of the checkpoint that no rank's model has.
    `aliases` (`tied_aliases`): entries read under another name. A collective: all ranks call
    it and all raise the same message."""
    flat, _ = flatten_state_dict(sd)
    read_as = {f"{s}.{k}": f"{s}.{a}" for s, k, a in aliases}
    missing, mismatched = [], []
    for key, value in flat.items():
        md = metadata.get(read_as.get(key, key))
        if md is None:
            missing.append(key)
            continue
        want = _shape(value)
        if isinstance(md, TensorStorageMetadata):
            have = tuple(md.size)
            if want is None:
                mismatched.append(f"{key}: a tensor {list(have)} in the checkpoint, not one here")
            elif want != have:
                mismatched.append(f"{key}: checkpoint {list(have)} vs model {list(want)}")
        elif want is not None:
            mismatched.append(f"{key}: not a tensor in the checkpoint, model {list(want)}")
    model_keys = {k for k in flat if k.startswith("model.")}
    gathered = gather_objects((sorted(missing), sorted(mismatched), sorted(model_keys)), group)
    missing = sorted({k for g in gathered for k in g[0]})
    mismatched = sorted({k for g in gathered for k in g[1]})
    # an optimizer entry of a parameter already reported adds nothing
    bad = {k.split(":")[0][len("model.") :] for k in missing + mismatched if k.startswith("model.")}
    if bad:
        missing = [k for k in missing if not _of_param(k, bad)]
        mismatched = [k for k in mismatched if not _of_param(k.split(":")[0], bad)]
    unexpected = []
    if "model" in sd:
        all_model = {k for g in gathered for k in g[2]}
        unexpected = sorted(k for k in metadata if k.startswith("model.") and k not in all_model)
    if not (missing or mismatched or unexpected):
        return
    parts = []
    if missing:
        parts.append(_listing("missing from the checkpoint", missing))
    if unexpected:
        parts.append(_listing("in the checkpoint but not in the model", unexpected))
    if mismatched:
        parts.append(_listing("with a different shape", mismatched))
    raise CheckpointError(
        f"Checkpoint {path} does not fit this model (another flavor or model?): "
        + "; ".join(parts)
        + ". Load a checkpoint of the same model and flavor, or list components to skip in "
        "checkpoint.exclude_from_loading."
    )
