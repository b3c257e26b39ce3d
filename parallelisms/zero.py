"""ZeRO stages 0-2 over replicated parameters (stage 3 is FSDP2, in `parallelisms/fsdp.py`).

Each parameter has two views:

* the *compute* parameter: the full tensor (in the compute dtype) that forward and backward
  use, replicated on every data-parallel rank;
* the *master* parameter: what the optimizer, gradient clipping and checkpoints see.
  Stage 0 (DDP): the full tensor itself. Stages 1-2: a `DTensor` sharded along dim 0 over the
  data-parallel mesh (`Shard(0)`, torch.chunk sizes: the same layout FSDP2 uses, so
  checkpoints move between stages 1, 2 and 3), whose local tensor is *a view into the compute
  parameter's storage* when the dtypes agree (fp32): no second copy of the weights.

Optimizer state is created by the optimizer from the master parameters, so stages 1-2 hold
only this rank's shard of it. Gradients: stage 0 all-reduces them (averaged) and keeps them
whole; stage 1 all-reduces them too and the master gradient is this rank's rows of the full
gradient (a view: the full gradient stays allocated, as the ZeRO paper's stage 1 says);
stage 2 reduce-scatters each gradient as soon as backward has produced it and frees the full
one, keeping only this rank's shard. Once the optimizer has updated the shards (a global
optimizer step hook says so; version counters catch other writes), stages 1-2 all-gather them
into the full parameters at the next forward: the same traffic as DDP's all-reduce, in two.

Memory per rank in fp32 (Psi parameters, N data-parallel ranks, Adam): stage 0 16 Psi;
stage 1 4 Psi + 4 Psi + 8 Psi / N; stage 2 4 Psi + 12 Psi / N (plus padding to N rows).
With a lower compute dtype (bf16) the full parameters are bf16 and the masters separate fp32
shards (the paper's fp32 master weights, 4 Psi / N); gradients are reduced in the reduce dtype
and, being cast copies anyway, only their fp32 shards are kept (stages 1 and 2 alike).

Under tensor parallelism the compute parameter is the TP shard (a DTensor on "tp"), and stages
1-2 split its local tensor's rows over the data-parallel ranks: the master is a DTensor on the
2-D (dp, tp) mesh with placements (dp split, *TP placements), the split a `_StridedShard` of
dim 0 where TP shards dim 0 too: the layout FSDP2 gives its shards of TP parameters, so
checkpoints, gradient clipping and initialisation see the same tensors as under FSDP x TP.
Gradients are reduced over the data-parallel ranks only (TP has already completed them).

The master parameters are registered in the module except during forward and backward, when
the compute parameters are (activation-checkpoint recomputation runs during backward and
must see them). Gradients are reduced on the micro-steps with `set_requires_gradient_sync`
on (the trainer turns it off for all but the last of an accumulation window); reductions are
issued asynchronously from per-parameter hooks as backward produces the gradients, averaged
with SUM then a division (gloo has no AVG), and waited on at the end of backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.optim.optimizer import register_optimizer_step_post_hook

# torch >= 2.13 renames the tensor collectives (the old names warn); 2.11 has only the old.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

# Stage 2 waits for older reduce-scatters once this many are in flight, so only a few full
# gradients exist at a time while communication still overlaps backward.
_MAX_IN_FLIGHT = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ZeroError(ValueError):
    """An unsupported ZeRO configuration, reported before any collective."""


@dataclass(frozen=True)
class _Layout:
    """Stages 1-2: how a parameter is laid out. `local_shape`: the compute parameter's tensor
    on this rank (the whole parameter, or its TP shard), whose dim-0 rows are split over the
    data-parallel ranks. For a TP-sharded parameter (a DTensor on the "tp" mesh) `tp` holds
    that DTensor's mesh, placements, shape and stride; its master lives on the 2-D
    (dp, tp) mesh with the data-parallel split of the TP shard as the first placement, the
    layout FSDP2 gives TP shards (so checkpoints move between ZeRO-1/2 and FSDP over TP)."""

    local_shape: torch.Size
    shape: torch.Size  # the whole parameter's
    stride: tuple[int, ...]
    mesh: DeviceMesh  # of the master: dp, or (dp, tp)
    placements: tuple[Placement, ...]  # of the master
    tp: tuple | None = None  # (mesh, placements) of the TP compute parameter

    @classmethod
    def of(cls, param: torch.Tensor, dp_mesh: DeviceMesh, dp_tp_mesh: DeviceMesh | None):
        stride = torch.empty(param.shape, device="meta").stride()
        if not isinstance(param, DTensor):
            return cls(param.shape, param.shape, stride, dp_mesh, (Shard(0),))
        tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
        if dp_tp_mesh is None or tp_mesh.mesh_dim_names != dp_tp_mesh.mesh_dim_names[1:]:
            raise ZeroError(
                f"ZeRO stages 1-2 shard plain parameters, or TP / EP shards given the (dp, tp) "
                f"or (dp, ep) mesh; this one is a DTensor on {tp_mesh.mesh_dim_names}."
            )
        # the TP shards of dim 0 that the data-parallel split interleaves with (FSDP2's rule)
        split = 1
        for size, pl in zip(tp_mesh.shape, tp_placements):
            split *= size if isinstance(pl, Shard) and pl.dim == 0 else 1
        dp = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
        local = param.to_local().shape
        return cls(local, param.shape, stride, dp_tp_mesh, (dp, *tp_placements),
                   (tp_mesh, tp_placements))  # fmt: skip

    def compute(self, local: torch.Tensor) -> torch.Tensor:
        """The compute parameter's value around its local tensor `local` (no copy)."""
        if self.tp is None:
            return local
        mesh, placements = self.tp
        return DTensor.from_local(local, mesh, placements, shape=self.shape, stride=self.stride)

    def master(self, local: torch.Tensor) -> DTensor:
        """A master (parameter or gradient) DTensor around this rank's rows `local`."""
        return DTensor.from_local(
            local, self.mesh, self.placements, shape=self.shape, stride=self.stride
        )


@dataclass
class _Param:
    """One parameter's compute/master pair and where it is registered: (module, name) places,
    two for a weight two modules share (tied embeddings: one gradient hook, autograd sums
    both uses), swapped together."""

    places: list[tuple[nn.Module, str]]
    master: nn.Parameter
    compute: nn.Parameter | None = None
    buffer: torch.Tensor | None = None  # stages 1-2: padded flat storage of `compute`
    rows_per_rank: int = 0  # stages 1-2: padded rows of dim 0 each rank owns
    layout: _Layout | None = None  # stages 1-2
    hook: object | None = None
    pending: tuple | None = None  # in-flight reduction: (work, result, its input, result is a copy)

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.places:
            module._parameters[name] = tensor

    @property
    def aliased(self) -> bool:
        return self.master is self.compute or (
            isinstance(self.master, DTensor)
            and self.buffer is not None
            and self.master.to_local().untyped_storage().data_ptr()
            == self.buffer.untyped_storage().data_ptr()
        )


@dataclass(eq=False)  # hashed by identity: kept in a WeakSet
class ZeroState:
    """Runtime state of one ZeRO-wrapped module (one model or pipeline stage)."""

    stage: int
    mesh: DeviceMesh
    dp_tp_mesh: DeviceMesh | None  # stages 1-2 under TP: the 2-D mesh of the TP masters
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    divide: int  # the reduced gradients' divisor (the mesh size, unless told otherwise)
    params: list[_Param] = field(default_factory=list)
    sync: bool = True  # reduce gradients in this backward (off for accumulation micro-steps)
    dirty: bool = True  # rebuilt: refresh the compute parameters at the next forward
    versions: tuple = ()  # masters' version counters at the last refresh
    pending_backwards: int = 0  # forwards with autograd whose backward has not finished
    callback_queued: bool = False
    hooks_installed: bool = False
    in_flight: list[_Param] = field(default_factory=list)  # reductions not yet waited on

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def world(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    # --- building ---------------------------------------------------------------------------

    def materialize(self) -> None:
        """(Re)builds compute parameters and shard views from the registered masters; runs at
        wrap time and after every `_apply` (e.g. `to_empty` off the meta device), which makes
        new master objects: build the optimizer after moving the model, never before."""
        self.hooks_installed = False
        for p in self.params:
            master = p.places[0][0]._parameters[p.places[0][1]]
            if p.hook is not None:
                p.hook.remove()
                p.hook = None
            if self.stage == 0:
                p.master = master
                p.compute = master
                if master.dtype != self.param_dtype:
                    p.compute = nn.Parameter(master.detach().to(self.param_dtype))
            else:
                self._build_sharded(p, master)
        self.dirty = True

    def _install_hooks(self) -> None:
        """Gradient hooks go on the final compute parameters at the first forward: `_apply`
        may swap a DTensor parameter's contents (`swap_tensors`), which drops its hooks."""
        for p in self.params:
            p.hook = p.compute.register_post_accumulate_grad_hook(self._make_grad_hook(p))
        self.hooks_installed = True

    def _build_sharded(self, p: _Param, master: torch.Tensor) -> None:
        """Padded full buffer for the compute parameter (its TP shard under TP); the master is
        rank's rows of it (a view) when dtypes agree, else a separate fp32 shard (mixed
        precision master weights)."""
        if p.layout is None:  # first wrap: this rank's rows of the parameter (its TP shard)
            p.layout = _Layout.of(master, self.mesh, self.dp_tp_mesh)
        full_shape = p.layout.local_shape
        rows, rest = full_shape[0], full_shape[1:]
        per_rank = -(-rows // self.world)
        row_numel = int(torch.Size(rest).numel())
        if p.compute is not None:
            local = master.to_local()
        else:
            flat = _local(master).detach().reshape(-1)
            local = self._own_rows(flat, per_rank, rows, rest).clone()
        buffer = torch.empty(
            per_rank * self.world * row_numel, dtype=self.param_dtype, device=local.device
        )
        own = self._own_rows(buffer, per_rank, rows, rest)
        with torch.no_grad():
            own.copy_(local)
        p.buffer, p.rows_per_rank = buffer, per_rank
        p.compute = nn.Parameter(p.layout.compute(buffer[: rows * row_numel].view(full_shape)))
        if master.dtype == self.param_dtype:
            local = own
        p.master = nn.Parameter(p.layout.master(local))
        p.register(p.master)

    def _own_rows(self, flat: torch.Tensor, per_rank: int, rows: int, rest) -> torch.Tensor:
        """This rank's rows [r*c, min((r+1)*c, rows)) of a flat buffer, shaped."""
        row_numel = int(torch.Size(rest).numel())
        start = min(self.rank * per_rank, rows)
        valid = self._valid_rows(per_rank, rows)
        return flat[start * row_numel : (start + valid) * row_numel].view(valid, *rest)

    def _valid_rows(self, per_rank: int, rows: int) -> int:
        return max(0, min(per_rank, rows - self.rank * per_rank))

    # --- forward ----------------------------------------------------------------------------

    def pre_forward(self, module, args) -> None:
        if not self.hooks_installed:
            self._install_hooks()
        if self.dirty or self._master_versions() != self.versions:
            self._refresh_compute()
        if torch.is_grad_enabled():
            self.pending_backwards += 1
        self._register(compute=True)

    def post_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            self._register(compute=self.pending_backwards > 0)

    def _register(self, compute: bool) -> None:
        for p in self.params:
            p.register(p.compute if compute else p.master)

    @torch.no_grad()
    def _refresh_compute(self) -> None:
        """Copies updated masters into the compute parameters; stages 1-2 all-gather."""
        works = []
        for p in self.params:
            if p.aliased:
                pass
            elif self.stage == 0:
                p.compute.copy_(p.master)
            else:
                rows, rest = p.layout.local_shape[0], p.layout.local_shape[1:]
                self._own_rows(p.buffer, p.rows_per_rank, rows, rest).copy_(p.master.to_local())
            if self.stage > 0:
                chunk = p.buffer.numel() // self.world
                own = p.buffer[self.rank * chunk : (self.rank + 1) * chunk]
                works.append(_all_gather(p.buffer, own, group=self.group, async_op=True))
        for w in works:
            w.wait()
        self.dirty = False
        self.versions = self._master_versions()

    def _master_versions(self) -> tuple:
        """In-place writes to a master outside the optimizer (checkpoint load, `init_weights`)
        bump its version counter; a changed tuple means the compute parameters are stale."""
        if self.stage == 0 and all(p.compute is p.master for p in self.params):
            return ()
        # A DTensor's in-place ops bump the wrapper's counter (its local one is bumped only by
        # direct writes to the local tensor, e.g. by `init_weights`): watch both.
        return tuple((p.master._version, _local(p.master)._version) for p in self.params)

    # --- backward ---------------------------------------------------------------------------

    def _make_grad_hook(self, p: _Param):
        def hook(param: torch.Tensor) -> None:
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if self.sync:
                self._reduce(p)

        return hook

    @torch.no_grad()
    def _reduce(self, p: _Param) -> None:
        """Starts the averaging reduction of one gradient (SUM then divide: gloo has no AVG)."""
        grad = p.compute.grad
        if isinstance(grad, DTensor) and p.compute is not p.master:
            # a TP gradient in another placement than its weight's (the TP embedding's comes
            # back Replicate): the master's placement is what its local gradient must be in
            # (stages 1-2 split its rows; stage 0 with bf16 compute wraps it in the master's)
            want = p.layout.tp[1] if self.stage > 0 else p.master.placements
            if grad.placements != want:
                grad = grad.redistribute(placements=want)
        local = _local(grad)
        if self.stage == 2:
            rows = local.shape[0]
            padded = p.rows_per_rank * self.world
            if padded != rows or local.dtype != self.reduce_dtype:
                full = local.new_zeros((padded, *local.shape[1:]), dtype=self.reduce_dtype)
                full[:rows].copy_(local)
                local = full
            p.compute.grad = None  # the full gradient is not kept (ZeRO-2)
            out = local.new_empty((p.rows_per_rank, *local.shape[1:]))
            work = _reduce_scatter(out, local, group=self.group, async_op=True)
            p.pending = (work, out, local, True)
            self.in_flight.append(p)
            while len(self.in_flight) > _MAX_IN_FLIGHT:  # bounds the full gradients alive
                self._complete(self.in_flight.pop(0))
            return
        copied = local.dtype != self.reduce_dtype
        if copied:
            local = local.to(self.reduce_dtype)
            # the reduction works on the cast copy: free the compute-dtype gradient now, not
            # at the end of backward (bf16 compute: 2 bytes per parameter less at the peak)
            p.compute.grad = None
        work = dist.all_reduce(local, group=self.group, async_op=True)
        p.pending = (work, local, None, copied)
        self.in_flight.append(p)

    def _complete(self, p: _Param) -> None:
        work, reduced, _, copied = p.pending
        p.pending = None
        work.wait()
        reduced.div_(self.divide)
        self._set_master_grad(p, reduced, copied)

    @torch.no_grad()
    def _finish_backward(self, waiting: int | None = None) -> None:
        """Completes the reductions in flight; `waiting`: the forwards still waiting for their
        backward (default: one fewer than before). The masters are registered when none is."""
        for p in self.in_flight:
            self._complete(p)
        self.in_flight.clear()
        self.callback_queued = False
        if waiting is None:
            waiting = self.pending_backwards - 1
        self.pending_backwards = max(0, waiting)
        if self.pending_backwards == 0:
            self._register(compute=False)

    @torch.no_grad()
    def reduce_local_gradients(self) -> None:
        """Reduces the gradients that backward accumulated locally with gradient sync off,
        as the hooks would have with it on, and registers the masters. A pipeline schedule
        runs its backward passes so: reducing once per schedule step, not per microbatch,
        keeps a stage-0 gradient from being averaged again with the next microbatch's added
        (wrong where the divisor is not the group size: experts under EP), and torch's
        split backward (the zero-bubble schedules' weight pass) assigns `param.grad` itself,
        firing no hook at all. A no-op while sync is off (an accumulation micro-step)."""
        if not self.sync:
            return
        for p in self.params:
            if p.compute.grad is not None and p.pending is None:
                self._reduce(p)
        self._finish_backward(waiting=0)

    def _set_master_grad(self, p: _Param, reduced: torch.Tensor, copied: bool) -> None:
        """Moves a reduced gradient onto the master parameter (accumulating if one is there).
        `copied`: `reduced` is not the compute parameter's own gradient (a dtype cast)."""
        master = p.master
        if self.stage == 0:
            if master is p.compute and reduced.dtype == master.dtype:
                return  # reduced in place in master.grad
            local = reduced.to(master.dtype)
            p.compute.grad = None
            if isinstance(master, DTensor):
                local = DTensor.from_local(local, master.device_mesh, master.placements,
                                           shape=master.shape, stride=master.stride())  # fmt: skip
        else:
            if self.stage == 1:  # this rank's rows of the full all-reduced gradient
                rows, rest = p.layout.local_shape[0], p.layout.local_shape[1:]
                local = self._own_rows(reduced.reshape(-1), p.rows_per_rank, rows, rest)
                if copied or reduced.dtype != master.dtype:
                    local = local.clone()  # a cast: keep only the shard, free the full copy
                # else `local` is a view that keeps the full gradient alive (ZeRO-1)
                p.compute.grad = None
            else:
                local = reduced[: self._valid_rows(p.rows_per_rank, p.layout.local_shape[0])]
            local = p.layout.master(local.to(master.dtype))
        if master.grad is None:
            master.grad = local
        else:
            master.grad += local


class ZeroModule:
    """Mixed into the class of a ZeRO-wrapped module: the trainer's hooks and `_apply`."""

    _zero: ZeroState

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Off: backward accumulates full local gradients without communication; for this
        module and the ZeRO-wrapped modules inside it (the experts), as FSDP2's does."""
        for module in self.modules():
            if isinstance(module, ZeroModule):
                module._zero.sync = requires_gradient_sync

    def reduce_local_gradients(self) -> None:
        """After backward passes run with gradient sync off (a pipeline schedule step), with
        it on again: reduces what they accumulated (`ZeroState.reduce_local_gradients`)."""
        self._zero.reduce_local_gradients()

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self._zero.materialize()
        return out


_LIVE: weakref.WeakSet[ZeroState] = weakref.WeakSet()


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Runs after every `optimizer.step()` (a global hook): the masters it updated make the
    compute parameters stale, and no forward is waiting for its backward any more, so the
    masters are registered again (a pipeline's shape-inference forward has no backward)."""
    if not _LIVE:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for state in list(_LIVE):
        if any(id(p.master) in stepped for p in state.params):
            state.dirty = True
            state.pending_backwards = 0
            state._register(compute=False)


# Foreach/fused optimizer kernels on DTensors bump no version counter, so an explicit hook
# is what tells ZeRO that the masters changed.
register_optimizer_step_post_hook(_after_optimizer_step)


def apply_zero(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    stage: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    dp_tp_mesh: DeviceMesh | None = None,
    divide_by: int | None = None,
) -> nn.Module:
    """Data parallelism with ZeRO stage 0 (DDP), 1 or 2 over the 1-D `dp_mesh`. Under TP,
    `dp_tp_mesh` is the 2-D (dp, tp) mesh: stages 1-2 split each TP shard over the
    data-parallel ranks, their masters DTensors on it (stage 0 keeps the TP parameters); the
    same holds for expert-parallel experts on (dp, "ep"). `divide_by`: the gradients' divisor
    instead of the `dp_mesh` size. A ZeRO-wrapped submodule (experts wrapped first) keeps its
    own parameters."""
    if stage not in (0, 1, 2):
        raise ZeroError(f"apply_zero handles ZeRO stages 0-2, not {stage} (stage 3 is FSDP).")
    if dp_mesh.ndim != 1:
        raise ZeroError("ZeRO stages 0-2 need a 1-D data-parallel mesh (no HSDP).")
    state = ZeroState(
        stage, dp_mesh, dp_tp_mesh, param_dtype, reduce_dtype, divide_by or dp_mesh.size()
    )
    _LIVE.add(state)
    seen: dict[int, _Param] = {}
    inner = {id(m) for sub in model.modules() if isinstance(sub, ZeroModule) for m in sub.modules()}
    for module in model.modules():
        if id(module) in inner:
            continue
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) in seen:  # shared (tied): one master, one compute, both places
                seen[id(param)].places.append((module, name))
                continue
            seen[id(param)] = _Param([(module, name)], param)
            state.params.append(seen[id(param)])
    cls = type(model)
    model.__class__ = type(f"ZeRO{stage}{cls.__name__}", (ZeroModule, cls), {})
    model._zero = state
    state.materialize()
    # first: other pre-forward hooks (expert parallelism's dispatch) see the compute parameters
    model.register_forward_pre_hook(state.pre_forward, prepend=True)
    model.register_forward_hook(state.post_forward)
    return model
