"""CheckpointManager: periodic sharded saves (sync or async), atomic commits, automatic resume.

Every rank writes its own shards of one DCP checkpoint per interval into `step-N.tmp/`; rank 0
commits it by renaming it to `step-N/` once DCP's final gather says all ranks finished (see
`checkpoint.storage`). In async mode `dcp.async_save` first stages a CPU copy of the state
(training waits only for that), then a background thread writes it over a separate gloo
process group; rank 0 commits when its write future completes, checked at every step, before
the next save and at `close()`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from checkpoint.hf import check_hf_config, fill_from_hf, is_hf_folder
from checkpoint.hf_write import save_hf
from checkpoint.staging import HostCopyStager
from checkpoint.state import (
    COMPONENTS,
    DTYPES,
    apply_state,
    build_state,
    check_fits,
    check_model_args,
    model_view,
    read_metadata,
    reading_aliases,
    single_process,
    tied_aliases,
)
from checkpoint.storage import (
    CheckpointError,
    commit,
    is_complete,
    list_checkpoints,
    prepare_tmp,
    purge,
    read_layout,
    resolve_load_path,
    step_dir,
    tmp_path,
)
from models import get_model_spec

logger = logging.getLogger("meshtrain")


class _Writer(FileSystemWriter):
    """FileSystemWriter with the optional delay after this rank's shards are written, before
    DCP's metadata and the commit (`debug.checkpoint_save_delay_step`: a kill window)."""

    def __init__(self, path: Path, delay_s: float = 0.0, label: str = ""):
        super().__init__(str(path), overwrite=False)
        self.delay_s = delay_s
        self.label = label

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        if self.delay_s > 0:
            logger.warning(
                "debug.checkpoint_save_delay_step: sleeping %.0f s inside the save of %s "
                "(shards written, not committed)",
                self.delay_s,
                self.label,
            )
            time.sleep(self.delay_s)
        return fut


@dataclass
class _Pending:
    """An async save in flight."""

    step: int
    tmp: Path
    final: Path
    layout: dict
    upload: Future
    staging: Future | None
    started: float


def layout_info(parallel_dims) -> dict:
    """The parallel degrees a checkpoint was saved with (for checkpoint_info and logs)."""
    if parallel_dims is None:
        return {"world_size": 1, "parallelism": {}}
    degrees = {
        k: getattr(parallel_dims, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
    }
    degrees["zero_stage"] = parallel_dims.zero_stage
    return {"world_size": parallel_dims.world_size, "parallelism": degrees}


def model_info(cfg, model_parts) -> dict:
    args = getattr(model_parts[0], "args", None)
    info = {"name": cfg.model.name, "flavor": cfg.model.flavor}
    if dataclasses.is_dataclass(args):
        info["args"] = dataclasses.asdict(args)
    return info


class CheckpointManager:
    """Owns the checkpoint folder of one run: `load()` once, `maybe_save()` every step,
    `close()` at the end (waits for an async save and commits it)."""

    def __init__(
        self,
        cfg,
        *,
        model_parts,
        optimizer,
        lr_scheduler,
        dataloader,
        train_state,
        parallel_dims=None,
    ):
        self.cfg = cfg
        self.ckpt = cfg.checkpoint
        self.folder = Path(cfg.job.dump_folder) / self.ckpt.folder
        self.model_parts = model_parts
        self.model = model_view(model_parts)
        self.objects = {
            "model": self.model,
            "optimizer": optimizer,
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
        }
        self.parallel_dims = parallel_dims
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        # A separate gloo group: async writes run collectives in a background thread, which
        # must never interleave with training's collectives on the default group.
        self.pg = dist.new_group(backend="gloo") if self.distributed else None
        self.async_mode = self.ckpt.async_mode
        self.stager = None
        if self.async_mode != "disabled":
            # async: the host copy is made before training goes on; async_with_pinned_mem: it
            # runs in the background too (into pinned memory on CUDA), awaited before the next
            # optimizer step.
            cuda = next(self.model.parameters()).device.type == "cuda"
            self.stager = HostCopyStager(
                background=self.async_mode == "async_with_pinned_mem", pin_memory=cuda
            )
        self.pending: _Pending | None = None
        # The optimizer must not change the weights while a save still copies them: the wait
        # is tied to the optimizer's step itself, so no training loop can forget it.
        self._wait_before_step = optimizer.register_step_pre_hook(
            lambda *_: self.maybe_wait_for_staging()
        )

    # ----------------------------------------------------------------------------- helpers
    def _log(self, level: int, msg: str, *args) -> None:
        if self.rank == 0:
            logger.log(level, msg, *args)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    def _broadcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def _state(self, components, export_dtype=None) -> dict:
        return build_state(components, rank=self.rank, export_dtype=export_dtype, **self.objects)

    # ---------------------------------------------------------------------------- loading
    def _choose(self):
        """Rank 0: (path, components, source) to load, None for a fresh start, or an error
        message (str) that every rank raises."""
        c = self.ckpt
        try:
            found = list_checkpoints(self.folder)
            model_only = False
            if c.load_step >= 0:
                path = step_dir(self.folder, c.load_step)
                if not is_complete(path):
                    steps = ", ".join(str(s) for s, _ in found) or "none"
                    return (
                        f"checkpoint.load_step = {c.load_step} but {self.folder} has no "
                        f"complete checkpoint step-{c.load_step} (complete ones: {steps})."
                    )
                later = [p.name for s, p in found if s > c.load_step]
                if later:
                    # Resuming here would leave those as the folder's newest: keep_latest_k
                    # would delete this run's own new checkpoints first, and a restart
                    # without load_step would jump to them (with it: back to load_step).
                    return (
                        f"checkpoint.load_step = {c.load_step} but {self.folder} also holds "
                        f"later checkpoints ({', '.join(later)}); a run continuing from step "
                        f"{c.load_step} in this folder would mix two histories. To roll back, "
                        f"move the later ones out of the folder (e.g. rename {later[0]} to "
                        f"{later[0]}.abandoned) and resume without load_step; or start a new "
                        f"job.dump_folder with checkpoint.initial_load_path = "
                        f"{path} and checkpoint.initial_load_model_only = false."
                    )
                source = f"checkpoint.load_step = {c.load_step}"
            elif found:
                path, source = found[-1][1], "latest checkpoint in the run folder"
            elif c.initial_load_path and is_hf_folder(Path(c.initial_load_path)):
                # a Hugging Face folder: each rank reads its slices of it (checkpoint/hf.py)
                layout = {"format": "huggingface", "step": 0, "contents": ["model"]}
                return c.initial_load_path, ["model"], "checkpoint.initial_load_path", layout
            elif c.initial_load_path:
                path = resolve_load_path(Path(c.initial_load_path))
                source = "checkpoint.initial_load_path"
                model_only = c.initial_load_model_only
            else:
                return None
            layout = read_layout(path)
        except CheckpointError as e:
            return str(e)
        contents = set(layout.get("contents", ["model"]))
        wanted = set(COMPONENTS) - set(c.exclude_from_loading)
        if "train_state" in c.exclude_from_loading:
            wanted.discard("rng")
        if model_only:
            wanted = {"model"}
        components = sorted(contents & wanted, key=COMPONENTS.index)
        return str(path), components, source, layout

    def load(self) -> bool:
        """Resumes from the latest complete checkpoint of the run folder (or load_step, or
        initial_load_path); returns whether anything was loaded. Fails before any training
        step, with one message, when the checkpoint does not fit the model."""
        choice = self._broadcast(self._choose() if self.rank == 0 else None)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        if choice is None:
            self._log(
                logging.INFO,
                "checkpoint: nothing to resume in %s; starting from step 0",
                self.folder,
            )
            return False
        path, components, source, layout = choice
        t0 = time.perf_counter()
        if layout.get("format") == "huggingface":
            return self._load_hf(path, t0)
        world = self.parallel_dims.world_size if self.parallel_dims is not None else 1
        components = self._load_dcp(path, components, layout, world)
        self._log(
            logging.INFO,
            "checkpoint: loaded %s (%s) step %s: %s in %.1f s; saved with %s, now %s",
            path,
            source,
            layout.get("step"),
            ", ".join(components),
            time.perf_counter() - t0,
            layout_info_text(layout),
            layout_info_text(layout_info(self.parallel_dims)),
        )
        if "rng" in layout.get("contents", []) and layout.get("world_size") != world:
            self._log(
                logging.INFO,
                "checkpoint: RNG states not restored (saved with world size %s, now %s); the "
                "run's seeding stays in effect",
                layout.get("world_size"),
                world,
            )
        return True

    def _load_dcp(self, path: str, components: list[str], layout: dict, world: int) -> list[str]:
        """Reads `components` of a DCP checkpoint into this rank's objects (the RNG states only
        at the world size that saved them), after checking that they fit; returns what it
        read."""
        metadata = read_metadata(path)
        if layout.get("world_size") != world or f"rng.rank{self.rank}" not in metadata:
            components = [c for c in components if c != "rng"]  # per-rank: same world only
        sd = self._state(components)
        if "model" in components:
            function_args = get_model_spec(self.cfg.model.name).function_args
            check_model_args(
                path, layout, getattr(self.model_parts[0], "args", None), function_args
            )
        tied = getattr(self.model_parts[0], "tied_parameters", dict)()
        aliases = tied_aliases(sd, metadata, tied)
        check_fits(path, sd, metadata, self.pg, aliases)
        with single_process(), reading_aliases(sd, aliases):
            dcp.load(
                sd,
                storage_reader=FileSystemReader(path),
                process_group=self.pg,
                no_dist=not self.distributed,
            )
        try:
            apply_state(sd, rank=self.rank, **self.objects)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"Loading {path} failed: {e}") from e
        return components

    def _load_hf(self, path: str, t0: float) -> bool:
        """The weights only, from a Hugging Face folder, each rank reading its own slices."""
        spec = get_model_spec(self.cfg.model.name)
        args = getattr(self.model_parts[0], "args", None)
        check_hf_config(Path(path), spec, args, spec.function_args)
        sd = self._state(["model"])
        fill_from_hf(sd["model"], Path(path), spec, args)
        apply_state(sd, rank=self.rank, **self.objects)
        self._log(
            logging.INFO,
            "checkpoint: loaded the weights of Hugging Face folder %s (checkpoint."
            "initial_load_path) in %.1f s, now %s",
            path,
            time.perf_counter() - t0,
            layout_info_text(layout_info(self.parallel_dims)),
        )
        return True

    # ----------------------------------------------------------------------------- saving
    def due(self, step: int) -> bool:
        """Whether `maybe_save(step)` writes a checkpoint at this step: every interval and at
        the run's last step."""
        return step % self.ckpt.interval == 0 or step == self.cfg.training.steps

    def maybe_save(self, step: int) -> None:
        self._poll()
        ck = self.ckpt
        last = step == self.cfg.training.steps
        if ck.hf_export and (last or (ck.hf_export_interval and step % ck.hf_export_interval == 0)):
            self.save_hf(step)
        if not self.due(step):
            return
        last_step = step == self.cfg.training.steps
        self._save(
            step, kind="full", components=COMPONENTS, use_async=self.async_mode != "disabled"
        )
        if last_step and self.ckpt.model_only:
            self._save(
                step,
                kind="export",
                components=("model",),
                prefix="export-step",
                export_dtype=DTYPES[self.ckpt.export_dtype],
                use_async=False,
            )

    def save_hf(self, step: int) -> Path:
        """The weights in Hugging Face format in <folder>/hf-step-N (checkpoint.hf_export),
        one tensor gathered at a time (checkpoint/hf.py `save_hf`); synchronous."""
        t0 = time.perf_counter()
        spec = get_model_spec(self.cfg.model.name)
        final = save_hf(
            self._state(["model"])["model"],
            self.folder / f"hf-step-{step}",
            spec,
            getattr(self.model_parts[0], "args", None),
            DTYPES[self.ckpt.hf_export_dtype],
            group=self.pg if self.distributed else None,
            tokenizer_path=self.cfg.model.tokenizer_path,
        )
        self._log(
            logging.INFO,
            "checkpoint: Hugging Face export of step %s in %s (%s) in %.1f s",
            step,
            final,
            self.ckpt.hf_export_dtype,
            time.perf_counter() - t0,
        )
        return final

    def save(self, step: int) -> None:
        """A full checkpoint at `step` now, off the interval (e.g. when a stop is requested);
        asynchronous in the async modes (`close()` waits for it)."""
        self._poll()
        self._save(
            step, kind="full", components=COMPONENTS, use_async=self.async_mode != "disabled"
        )

    def maybe_wait_for_staging(self) -> None:
        """Runs before every optimizer step (a step pre-hook): with async staging the copy of
        the last save's weights to host memory may still be running."""
        if self.pending is not None and self.pending.staging is not None:
            self.pending.staging.result()
            self.pending.staging = None

    def _layout(self, step: int, kind: str, components, export_dtype) -> dict:
        ts = self.objects["train_state"]
        return {
            "step": step,
            "kind": kind,
            "contents": list(components),
            **layout_info(self.parallel_dims),
            "model": model_info(self.cfg, self.model_parts),
            "dtype": str(export_dtype).removeprefix("torch.") if export_dtype else "as trained",
            "train_state": ts.state_dict() if ts is not None else {},
            "async_mode": self.async_mode if kind == "full" else "disabled",
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "torch_version": torch.__version__,
        }

    def _save(
        self,
        step: int,
        *,
        kind: str,
        components,
        use_async: bool,
        prefix: str = "step",
        export_dtype=None,
    ) -> None:
        self.wait()  # one save at a time
        t0 = time.perf_counter()
        final = step_dir(self.folder, step, prefix)
        tmp = tmp_path(final)
        if self.rank == 0:
            prepare_tmp(final)
        self._barrier()
        layout = self._layout(step, kind, components, export_dtype)
        sd = self._state(components, export_dtype)
        debug = self.cfg.debug
        delay = debug.checkpoint_save_delay_s if debug.checkpoint_save_delay_step == step else 0.0
        writer = _Writer(tmp, delay if kind == "full" else 0.0, final.name)
        if not use_async:
            with single_process():
                dcp.save(
                    sd, storage_writer=writer, process_group=self.pg, no_dist=not self.distributed
                )
            if self.rank == 0:
                commit(tmp, final, layout)
                purge(self.folder, self.ckpt.keep_latest_k, final)
            self._log(
                logging.INFO, "checkpoint: saved %s in %.2f s", final, time.perf_counter() - t0
            )
            return
        with single_process():
            result = dcp.async_save(
                sd,
                storage_writer=writer,
                process_group=self.pg,
                async_stager=self.stager,
                no_dist=not self.distributed,
            )
        staging = None
        if hasattr(result, "upload_completion"):  # AsyncSaveResponse (async staging)
            upload, staging = result.upload_completion, result.staging_completion
        else:
            upload = result
        self.pending = _Pending(step, tmp, final, layout, upload, staging, t0)
        self._log(
            logging.INFO,
            "checkpoint: %s staged in %.2f s; writing in the background",
            final.name,
            time.perf_counter() - t0,
        )

    def _poll(self) -> None:
        if self.pending is not None and self.pending.upload.done():
            self.wait()

    def wait(self) -> None:
        """Blocks until the async save in flight (if any) is written, then commits it."""
        p, self.pending = self.pending, None
        if p is None:
            return
        try:
            p.upload.result()
        except Exception as e:
            raise CheckpointError(f"async checkpoint save of {p.final.name} failed: {e}") from e
        if self.rank == 0:
            commit(p.tmp, p.final, p.layout)
            purge(self.folder, self.ckpt.keep_latest_k, p.final)
        self._log(
            logging.INFO,
            "checkpoint: saved %s (async, %.2f s after staging began)",
            p.final,
            time.perf_counter() - p.started,
        )

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._wait_before_step.remove()
            if self.stager is not None:
                self.stager.close()
                self.stager = None


def layout_info_text(layout: dict) -> str:
    p = layout.get("parallelism") or {}
    degrees = " ".join(f"{k}={v}" for k, v in p.items())
    return f"world={layout.get('world_size', '?')} {degrees}".strip()
