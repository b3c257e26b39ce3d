"""Regional `torch.compile`: each transformer block is compiled on its own (identical blocks
share one compiled graph, so compile time does not grow with depth), and the loss.

Each block's `forward` is replaced by its compiled version in place, so parameter names
(FQNs) do not change, and module hooks (FSDP2's all-gather/reshard) keep running eagerly
around the compiled graph. Applied after tensor parallelism and activation checkpointing
(both are traced into the block's graph) and before FSDP/ZeRO.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import fx, nn

from models import mtp
from parallelisms.parallel_dims import ParallelDims


def _own_input(module: nn.Module, args: tuple):
    """Gives a compiled block its own copy of an input that is a view: under tensor
    parallelism the first block's input is `DTensor.to_local()` of the embedding's output, and
    AOT autograd's handling of view inputs then loses that DTensor backward (torch 2.13 fails
    with "'Tensor' object has no attribute '_local_tensor'")."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x._is_view():
        return (x.clone(), *args[1:])
    return None


def _rng_states_before_opaque_objects(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Moves the RNG states that torch's partitioner saves for recomputed random ops (CPU path
    of `functionalize_rng_ops`) in front of the opaque objects saved for backward, in the
    forward graph's outputs and the backward graph's inputs: where AOT autograd's runtime
    expects them, with the other saved tensors.

    Why: an activation-checkpointed block recomputes attention in backward, and SDPA's CPU
    kernels count as random ops (they take a dropout probability), so the partitioner saves
    the CPU RNG state for the recompute; it appends that state after everything else saved,
    opaque objects included. Under tensor parallelism the compiled block also saves its
    `DeviceMesh` (an opaque object in torch 2.13's graphs, which rebuild the DTensor
    gradients with it), and the runtime, slicing the saved values by kind from the end, then
    takes the mesh for a tensor and the RNG state for the mesh: "expected all
    tensors_saved_with_vc_check to be Tensors". CUDA keeps its RNG states as graph inputs
    instead, which is why the same composition runs on GPUs."""
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    from torch._prims.rng_prims import run_and_save_rng_state

    out = next(iter(fw.graph.find_nodes(op="output")))
    outputs = list(out.args[0])
    rng = [
        i
        for i, n in enumerate(outputs)
        if isinstance(n, fx.Node)
        and n.target is operator.getitem
        and n.args[1] == 0
        and getattr(n.args[0], "target", None) is run_and_save_rng_state
    ]
    if not rng:
        return
    first = start = rng[0]
    while start > 0 and is_opaque_node(outputs[start - 1]):
        start -= 1
    if start == first:
        return  # already in order
    opaque = outputs[start:first]
    states = [outputs[i] for i in rng]
    out.args = (tuple(outputs[:start] + states + opaque + outputs[rng[-1] + 1 :]),)
    names = {n.name for n in opaque}
    inputs = list(bw.graph.find_nodes(op="placeholder"))
    anchor = next(n for n in inputs if n.name in names)
    for node in inputs:
        if node.name.startswith("rng_state_output_"):
            anchor.prepend(node)
    fw.recompile()
    bw.recompile()


def _fix_rng_state_order() -> None:
    """Wraps torch's `functionalize_rng_ops` (once per process) so that its saved RNG states
    sit where the runtime reads them (see `_rng_states_before_opaque_objects`); a torch that
    already orders them so is left as it is by the wrapper."""
    from torch._functorch import partitioners

    original = getattr(partitioners, "functionalize_rng_ops", None)
    if original is None or getattr(original, "_meshtrain_ordered", False):
        return

    @functools.wraps(original)
    def functionalize_rng_ops(joint_module, fw_module, bw_module, num_sym_nodes):
        fw_module, bw_module = original(joint_module, fw_module, bw_module, num_sym_nodes)
        _rng_states_before_opaque_objects(fw_module, bw_module)
        return fw_module, bw_module

    functionalize_rng_ops._meshtrain_ordered = True
    partitioners.functionalize_rng_ops = functionalize_rng_ops


def _graph_key(gm: fx.GraphModule, example_inputs) -> str:
    """What makes two ranks' dynamo graphs one compile: the graph's code, what its inputs
    are (shape, strides, dtype, whether they need a gradient) and the compile caches' tag
    (a rank's own under TP/EP, `key_compile_caches_to_rank`)."""
    parts = [gm.code, str(torch.compiler.config.cache_key_tag)]
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"{type(x).__name__} {tuple(x.shape)} {x.stride()} {x.dtype} "
                         f"{x.requires_grad}")  # fmt: skip
        else:
            parts.append(repr(x))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@contextlib.contextmanager
def _turn_at(key: str):
    """Held while this process compiles the graph `key`: a file lock in the inductor cache
    folder, which the ranks of one host share (the OS frees it if the holder dies)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older torch
        from torch._inductor.utils import cache_dir
    from torch.utils._filelock import FileLock

    folder = os.path.join(cache_dir(), "meshtrain_compile_turns")
    os.makedirs(folder, exist_ok=True)
    with FileLock(os.path.join(folder, f"{key}.lock")):
        yield


def inductor_in_turns(gm: fx.GraphModule, example_inputs):
    """The inductor backend, with the ranks that compile the same graph into one cache
    folder taking turns: the first compiles it, forward and backward (the backward now, not
    at its first call, so that it is inside the turn too), and the others then find both in
    the FX graph and AOT autograd caches instead of compiling them again at the same time.

    Why: every rank of a data-parallel layout compiles the same block graphs. Where ranks
    share a host's CPUs (all CPU runs; a GPU host's ranks for inductor's own CPU work) the
    concurrent compiles multiply the CPU work by the ranks per host, and none of them can
    use another's result. Measured on a 2-core machine (benchmarks/compile_cache), a cold
    4-rank compiled HSDP run: 109-112 CPU-seconds concurrently, 88 in turns.
    Graphs a rank keys to itself (TP/EP) never wait for another rank's."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    eager_backward = {}
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        eager_backward["force_non_lazy_backward_lowering"] = True
    with _turn_at(_graph_key(gm, example_inputs)), functorch_config.patch(**eager_backward):
        return compile_fx(gm, example_inputs)


def apply_compile(model: nn.Module, part: str | None = None) -> nn.Module:
    """Compiles the forward of every entry of `model.layers` and of every multi-token-prediction
    module's block (`fullgraph`: a graph break is
    an error, not a silent slowdown); with `part`, of that submodule of every block instead
    (a family whose blocks hold data-dependent code, such as MoE routing, compiles the rest)."""
    _fix_rng_state_order()
    for block in [*model.layers.values(), *mtp.blocks(model).values()]:
        target = getattr(block, part) if part else block
        target.forward = torch.compile(target.forward, fullgraph=True, backend=inductor_in_turns)
        target.register_forward_pre_hook(_own_input)
    return model


def key_compile_caches_to_rank(parallel_dims: ParallelDims) -> str:
    """Where a compiled graph can hold a DTensor (TP or EP shards the block weights): makes
    this rank's entries in the on-disk compile caches (FX graph and AOT autograd, under
    TORCHINDUCTOR_CACHE_DIR) its own by adding its global rank and the names of its process
    groups, one per mesh dimension, to `torch.compiler.config.cache_key_tag` (after any tag
    set by TORCH_COMPILE_CACHE_KEY_TAG). Returns the tag; none elsewhere.

    Why: a graph compiled under TP (the blocks, the loss-parallel loss) bakes in what the
    DTensors' mesh says on this rank: the name of the process group its collectives run on
    and the rank's coordinates. The AOT autograd cache key hashes a DeviceMesh by its type
    only, so every TP group's ranks compute one key; a rerun on a warm cache then hands one
    TP group's graph to the other's ranks ("Could not resolve the process group registered
    under the name 3"), or one rank's coordinates to another. With the tag a rerun of the
    same layout still finds all its graphs (each rank its own), and the compiled kernels
    themselves (keyed by their source) stay shared between ranks and runs.

    Without a DTensor in the graph (FSDP, HSDP, DDP, ZeRO, CP, PP: FSDP2 and ZeRO hand the
    block its full weights as plain tensors, and CP's collectives name their group in the
    graph itself) the key is the graph's content, so every rank of every layout that compiles
    the same graph finds it: a restart at another data-parallel size compiles nothing again."""
    mesh = parallel_dims.mesh
    if mesh is None or not (parallel_dims.tp_enabled or parallel_dims.ep_enabled):
        return ""
    groups = ",".join(f"{d}={g}" for d, g in sorted(parallel_dims.group_names().items()))
    ours = f"meshtrain rank {dist.get_rank()} groups {groups}"
    base = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "")
    torch.compiler.config.cache_key_tag = f"{base} {ours}".strip()
    return torch.compiler.config.cache_key_tag


def maybe_compile_loss(loss_fn: Callable, compile_cfg) -> Callable:
    """`torch.compile(loss_fn)` when compile is enabled with "loss" among its components."""
    if compile_cfg.enable and "loss" in compile_cfg.components:
        return torch.compile(loss_fn, backend=inductor_in_turns)
    return loss_fn
