"""Context parallelism (CP): every sequence is split over the "cp" ranks of one data-parallel
replica, and attention gathers the keys and values of the whole sequence.

Sharding, load-balanced for causal attention: the sequence is cut into 2 x cp equal chunks and
CP rank r keeps chunks r and 2cp-1-r (Megatron's and torchtitan's "head-tail" order). Under a
causal mask the work of a query grows with its position, so a plain split in cp pieces would
give the last rank cp times the first's attention work; pairing an early chunk with a late one
gives every rank the same number of (query, visible key) pairs. Each rank gets its tokens'
global positions for RoPE (`local_positions`, which `training.inputs.sequence_inputs` gives the
model).

Attention (`ContextParallelAttention`, swapped in for each attention core of
models/attention.py, keeping its spec): K and V are all-gathered over "cp" in every layer at
their own size (under grouped-query attention n_heads / n_kv_heads times smaller than the
queries; never repeated), and their gradients reduce-scattered back by the all-gather's
backward (functional collectives, so it also runs inside compiled blocks). Plain causal
attention needs no mask: each of the rank's chunks attends to the keys up to its end
(`causal_chunks`). Every other spec (sliding window, soft-capping, document masking) is the
core's own computation over the gathered keys, with the block mask the model builds once per
micro-batch from the rank's query positions and the gathered keys' positions and documents
(`training.inputs.sequence_inputs` gives them): windows cross chunk boundaries in global
positions. This is the all-gather K/V design Llama 3 describes; the gathered K/V of one layer
live only until its backward (or are recomputed with activation checkpointing).

Everything else composes through the mesh: the CP ranks of a replica read the same sequences
(they share one data-parallel coordinate), the weights are identical on them and FSDP shards
over "dp_shard_cp" (ZeRO 0-2 over "dp_cp"), which also averages their gradients; each rank's
loss is its tokens' mean and the average over "dp_cp" is the global token mean, as all ranks
hold as many tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import _get_current_dispatch_mode

from models.attention import (
    AttentionBatch,
    AttentionCore,
    AttentionSpec,
    attend,
    block_mask,
    fused_causal,
)

# torch 2.13 renamed the autograd all-gather (the old name warns); 2.11 has the old one only
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or (
    funcol.all_gather_tensor_autograd
)


def local_positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The positions CP rank `cp_rank` holds: chunks cp_rank and 2cp-1-cp_rank of 2cp."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, last])


def gathered_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Positions of the keys after the all-gather over "cp": rank 0's tokens, rank 1's, ..."""
    return torch.cat([local_positions(seq_len, r, cp, device) for r in range(cp)])


class _ContextParallelCore(nn.Module):
    """What both CP cores share: the "cp" group, the replaced core's spec and its sink logits
    (the same parameter, under the same name), and the core's call, which hands `split` the
    rank's sink logits (a parallelism's, or the parameter)."""

    def __init__(self, cp_mesh: DeviceMesh, spec: AttentionSpec, sinks: nn.Parameter | None = None):
        super().__init__()
        # The group's name (a string) rather than the group: deep copies (pipeline stages
        # are cut from copies of the model) and compiled graphs take it as it is.
        self.group_name = cp_mesh.get_group().group_name
        self.cp_rank, self.cp = cp_mesh.get_local_rank(), cp_mesh.size()
        self.spec = spec
        if spec.sinks:
            self.sinks = sinks

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if sinks is None and self.spec.sinks:
            sinks = self.sinks
        return self.split(q, k, v, batch, sinks)


class ContextParallelAttention(_ContextParallelCore):
    """The attention core under CP: the local queries attend to the keys and values of the
    whole sequence, all-gathered over "cp" (see the module doc), as the replaced core's `spec`
    says. Plain causal attention: each of the rank's two chunks attends causally to the keys up
    to its end (a lower-right causal bias: the fused kernels on CUDA build no mask, and none
    over the whole sequence is kept for backward); any other spec through its block mask. The
    sinks and the log-sum-exp are then over the whole sequence's keys."""

    def split(self, q, k, v, batch, sinks):
        # K and V in one all-gather (side by side: V's head size may differ, MLA): one
        # collective per layer, and one saved output under per-op AC (two same-shaped gathers
        # were replayed swapped in a compiled recompute)
        k, v = self._gather(torch.cat([k, v], dim=-1)).split([k.shape[-1], v.shape[-1]], -1)
        spec = self.spec
        plain = spec.fused_causal and (batch is None or not batch.documents_apply(spec))
        # Compiled blocks and dispatch modes (memory tracker, FLOP counter) cannot build torch's
        # lower-right causal bias: they take the block mask instead of a [chunk, seq] one.
        traced = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
        if plain and (batch is None or not traced):
            return causal_chunks(q, k, v, self.cp_rank, self.cp, spec.scale)
        return attend(spec, q, k, v, batch, sinks)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, seq/cp, dim] -> [batch, heads, seq, dim], the ranks' shards in rank
        order; the backward reduce-scatters the gradient. Gathered along dim 0 (the one
        dimension every torch version's functional all-gather supports)."""
        gathered = _all_gather_autograd(x.transpose(0, 2).contiguous(), 0, self.group_name)
        return gathered.transpose(0, 2)


class UlyssesAttention(_ContextParallelCore):
    """The attention core under Ulysses CP (DeepSpeed-Ulysses; `parallelism.
    context_parallel_method = "ulysses"`): one all-to-all over "cp" turns q, k and v from
    sequence shards into head shards (each rank then holds 1/cp of the heads, n_kv_heads too,
    or, with fewer KV heads than ranks, a copy of the one its heads read, for the whole
    sequence, in the ranks' order), the replaced core's spec is computed there
    over the whole sequence, through its block mask over the gathered positions and documents,
    and the reverse all-to-all returns the output (and a returned log-sum-exp) to sequence
    shards. Sinks: the logits of this rank's heads (the same parameter as the replaced core's).
    Per layer each rank sends (cp - 1)/cp of its own q, k, v and output (falling as 1/cp as
    cp grows), against the all-gather's (cp - 1)/cp of the whole sequence's K/V (growing
    toward it): Ulysses for many heads, the all-gather for long K/V and few (KV) heads. Each
    layer builds the whole sequence's block mask (the decoder's masks are the rank's queries')."""

    def split(self, q, k, v, batch, sinks):
        if batch is None or not batch.keys_given:
            raise ValueError("Ulysses attention needs the micro-batch's gathered positions")
        q = self._to_heads(q)
        if k.shape[1] % self.cp:  # fewer KV heads than ranks: each head group gets its own copy
            k, v = (t.repeat_interleave(self.cp // k.shape[1], dim=1) for t in (k, v))
        kv = self._to_heads(torch.cat([k, v], dim=-1))  # one all-to-all for both
        k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        # the whole sequence as queries too: the mask over the gathered positions and documents
        docs = batch.key_documents
        whole = AttentionBatch(batch.key_positions, batch.key_positions, docs, docs, True)
        whole.masks[self.spec.key] = block_mask(self.spec, whole)
        if sinks is not None:
            heads = q.shape[1]
            sinks = sinks[self.cp_rank * heads : (self.cp_rank + 1) * heads]
        out = attend(self.spec, q, k, v, whole, sinks)
        if not self.spec.returns_lse:
            return self._to_sequence(out)
        out, lse = out
        return self._to_sequence(out), self._to_sequence(lse[..., None])[..., 0]

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """All-to-all over "cp" along dim 0 (one slice per rank, in rank order)."""
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, self.group_name)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[..., heads, seq/cp, dim] -> [..., heads/cp, seq, dim] (rank r keeps head group r;
        the sequence in the ranks' order, as `gathered_positions`)."""
        x = x.unflatten(-3, (self.cp, -1)).movedim(-4, 0)  # [cp, ..., heads/cp, seq/cp, dim]
        return self._exchange(x).movedim(0, -3).flatten(-3, -2)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[..., heads/cp, seq, dim] -> [..., heads, seq/cp, dim], the inverse of `_to_heads`."""
        x = x.unflatten(-2, (self.cp, -1)).movedim(-3, 0)  # [cp, ..., heads/cp, seq/cp, dim]
        return self._exchange(x).movedim(0, -4).flatten(-4, -3)


CP_CORES = {"allgather": ContextParallelAttention, "ulysses": UlyssesAttention}


def causal_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_rank: int,
    cp: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of CP rank `cp_rank`'s queries (its chunks cp_rank and 2cp-1-cp_rank,
    [batch, heads, 2 x chunk, head_dim]) over the gathered keys and values (rank-major, KV
    heads, not repeated): the keys put back in position order, each chunk attends to the keys
    before it and, causally, to its own."""
    chunk = k.shape[2] // (2 * cp)
    k, v = _in_position_order(k, cp, chunk), _in_position_order(v, cp, chunk)
    outs = []
    for q_chunk, index in zip(q.split(chunk, dim=2), (cp_rank, 2 * cp - 1 - cp_rank)):
        end = (index + 1) * chunk
        mask = _lower_right_causal(chunk, end, q.device)
        outs.append(fused_causal(q_chunk, k[:, :, :end], v[:, :, :end], scale, mask))
    return torch.cat(outs, dim=2)


def _in_position_order(x: torch.Tensor, cp: int, chunk: int) -> torch.Tensor:
    """[batch, heads, seq, dim] gathered rank-major (rank r's chunks r and 2cp-1-r) -> in
    position order: the ranks' first chunks in rank order, then their second chunks in
    reverse rank order (views and one copy, no index tensor)."""
    by_rank = x.unflatten(2, (cp, 2, chunk))  # [batch, heads, rank, first/second, chunk, dim]
    ordered = torch.cat([by_rank[:, :, :, 0], by_rank[:, :, :, 1].flip(2)], dim=2)
    return ordered.flatten(2, 3)


def _lower_right_causal(queries: int, keys: int, device: torch.device):
    """Query i of the last `queries` positions sees keys 0..keys-queries+i: torch's causal bias,
    which CUDA's fused kernels apply without building a mask (CPU SDPA builds it per chunk).
    Eager only (`ContextParallelAttention` gives traced runs the block mask)."""
    return causal_lower_right(queries, keys)


_ATTENTION_FUNCTIONS = (F.scaled_dot_product_attention, flex_attention)


def _own_attention(model: nn.Module, seq_len: int) -> dict[str, str]:
    """{module name: what it does} for attention computed outside the shared core, found by
    one forward of `model` (on the meta device: shapes only) that records each attention call
    (SDPA, FlexAttention) and the innermost module it came from. Where a module cannot run on
    meta tensors (data-dependent shapes, such as MoE routing's expert counts), the check goes
    on with the failing block's later siblings (the decoder's next layers), each given the
    inputs the failing one got; a sibling that fails too has been checked up to that point."""
    stack: list[str] = []
    found: dict[str, str] = {}
    inputs: dict[str, tuple] = {}

    class Recorder(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in _ATTENTION_FUNCTIONS and stack:
                owner = stack[-1]
                if not isinstance(model.get_submodule(owner), AttentionCore):
                    found.setdefault(owner, f"calls {func.__name__} itself")
            return func(*args, **(kwargs or {}))

    def enter(name: str):
        def hook(module, args, kwargs):
            stack.append(name)
            inputs[name] = (args, kwargs)

        return hook

    def leave(module, args, output) -> None:
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name), with_kwargs=True))
        handles.append(module.register_forward_hook(leave))
    try:
        with Recorder():
            tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
            if not _ran(lambda: model(tokens)):
                for sibling, args, kwargs in _later_siblings(model, list(stack), inputs):
                    stack.clear()
                    _ran(functools.partial(sibling, *args, **kwargs))
    finally:
        for handle in handles:
            handle.remove()
    return found


def _ran(forward) -> bool:
    """Whether `forward()` ran on meta tensors (False: an op without a meta kernel)."""
    try:
        forward()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _later_siblings(model: nn.Module, failed: list[str], inputs: dict[str, tuple]):
    """(module, args, kwargs) for the siblings after the innermost module of `failed` (the
    modules entered and not left when a forward raised) that sits in a ModuleDict/ModuleList,
    each with that module's inputs (a decoder's blocks take one another's)."""
    for name in reversed(failed):
        parent_name, _, _ = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if name and isinstance(parent, (nn.ModuleDict, nn.ModuleList)):
            names = [f"{parent_name}.{n}" if parent_name else n for n, _ in parent.named_children()]
            args, kwargs = inputs[name]
            return [(model.get_submodule(n), args, kwargs) for n in names[names.index(name) + 1 :]]
    return []


class _PerPositionCore(nn.Module):
    """Stands in for every attention core in `mixes_positions_outside_the_core`: each query
    position gets its own value row (query head i its kv head's), and its own query's sum as
    the log-sum-exp where the spec returns one, so no information crosses positions inside the
    core."""

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = spec

    def forward(self, q, k, v, batch=None, sinks=None):
        out = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return (out, q.sum(-1)) if self.spec.returns_lse else out


def mixes_positions_outside_the_core(model: nn.Module, embeddings: str, seq_len: int) -> bool:
    """Whether `model` (real weights, any values) mixes information across sequence positions
    anywhere but in its attention cores: the cores are swapped for `_PerPositionCore`, and
    the gradient of one position's logits with respect to the output of the `embeddings`
    module must be exactly zero at every other position. Anything a layer computes over the
    sequence itself (its own q.k scores, a log-sum-exp over keys, a cumulative sum) would see
    only the rank's tokens under CP. Evaluation mode: auxiliary losses, which are sums over
    the tokens of every rank by design, are not part of it. Changes `model`."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, AttentionCore):
                setattr(module, name, _PerPositionCore(child.spec))
    seen = []

    def leaf(module, args, output):
        seen.append(output.detach().requires_grad_())
        return seen[-1]

    handle = model.get_submodule(embeddings).register_forward_hook(leaf)
    try:
        model.eval()
        tokens = torch.arange(seq_len).remainder(model.args.vocab_size)[None]
        model(tokens)[0, seq_len // 2].float().sum().backward()
    finally:
        handle.remove()
    others = torch.ones(seq_len, dtype=torch.bool)
    others[seq_len // 2] = False
    return bool(seen[0].grad[0, others].ne(0).any())


def attention_problems(model: nn.Module, seq_len: int) -> list[str]:
    """What context parallelism cannot honour in `model` (on the meta device), by module name:
    a subclass of the shared core (its own math, which the CP core would replace: the run would
    train another model), and attention computed outside the shared core (it would see only
    the rank's tokens). Checked with the config, before any process group."""
    problems = [
        f"{name} ({type(m).__name__}) subclasses models.attention.AttentionCore "
        "with attention math of its own, which the context-parallel core would replace"
        for name, m in model.named_modules()
        if isinstance(m, AttentionCore) and type(m) is not AttentionCore
    ]
    problems += [f"{name} {what}" for name, what in _own_attention(model, seq_len).items()]
    cores = [m for m in model.modules() if type(m) is AttentionCore]
    if not cores and not problems:
        problems.append(f"{type(model).__name__} has no models.attention.AttentionCore")
    if not problems:
        return []
    return [
        "parallelism.context_parallel_degree > 1 cannot honour this model's attention: "
        + "; ".join(problems)
        + ". Only the shared core, which computes a declared AttentionSpec, is split over the "
        "CP ranks: route every attention layer through models.attention.AttentionCore itself "
        "with its spec (docs/adding_a_model.md), or set parallelism.context_parallel_degree = 1."
    ]


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, method: str = "allgather") -> int:
    """Swaps every attention core (exactly `models.attention.AttentionCore`: a subclass has
    math of its own, refused by `attention_problems`) of `model` for the CP core of `method`
    (`CP_CORES`: the K/V all-gather or Ulysses' all-to-all) with the core's spec and sinks;
    returns how many. A model without one cannot run CP: its attention would silently see
    only the rank's tokens."""
    swapped, core = 0, CP_CORES[method]
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is AttentionCore:
                sinks = getattr(child, "sinks", None)
                setattr(module, name, core(cp_mesh, child.spec, sinks))
                swapped += 1
    if swapped == 0:
        raise ValueError(
            f"context parallelism: {type(model).__name__} has no "
            "models.attention.AttentionCore module, so its attention cannot see the "
            "other CP ranks' tokens. Route the family's attention through it (see "
            "docs/adding_a_model.md), or set parallelism.context_parallel_degree = 1."
        )
    return swapped


def ulysses_problems(parallelism, args) -> list[str]:
    """What `context_parallel_method = "ulysses"` cannot do: without CP it would be ignored;
    each TP x CP rank must hold whole query heads, and a TP rank's KV heads must split over
    the CP ranks or be a divisor of them (then each head group gets a copy of its KV head)."""
    if parallelism.context_parallel_method != "ulysses":
        return []
    cp, tp = parallelism.context_parallel_degree, parallelism.tensor_parallel_degree
    if cp == 1:
        return [
            "parallelism.context_parallel_method = 'ulysses' needs context_parallel_degree > 1 "
            "(it chooses how CP splits attention): set the degree, or leave the method at "
            "'allgather'."
        ]
    problems = []
    if args.n_heads % (tp * cp):
        problems.append(f"TP x CP = {tp * cp} ranks do not divide n_heads = {args.n_heads}")
    kv = args.n_kv_heads // tp
    if kv % cp and cp % kv:
        problems.append(
            f"the {kv} KV heads of a TP rank are neither split by nor a divisor of CP = {cp}"
        )
    if not problems:
        return []
    return [
        "parallelism.context_parallel_method = 'ulysses' gives each CP rank whole heads: "
        + "; ".join(problems)
        + ". Use context_parallel_method = 'allgather', or TP and CP degrees that fit the heads."
    ]
