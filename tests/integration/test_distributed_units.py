"""Parallelism units on 2 real gloo ranks (spawned processes, one spawn for all checks): ZeRO-1/2
state and registration, FSDP2's units, the global gradient norm over mixed meshes, the step's
loss over the global count of labelled tokens, attention sinks split over heads (TP) and over
the sequence (CP, both methods), DeepSeek-V3's latent attention split over heads (TP). Compile turns have a spawn of their own, so that their two
planted bugs run only that check."""

from __future__ import annotations

import dataclasses

import torch
from dist_utils import spawn
from small_model import batch, tiny_model

from models.llama3 import ModelArgs
from training.loss import cross_entropy_sum


def _two_rank_checks(rank: int, world: int) -> None:
    """ZeRO-1/2 state and registration, FSDP2's units, and a mixed-mesh gradient norm, on 2
    ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    args = ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=63, multiple_of=16, max_seq_len=16
    )  # an odd vocabulary: uneven shards
    ref = tiny_model(args)
    _zero_shards_and_masters(rank, world, mesh, args, ref)
    _zero_mixed_precision_gradients(rank, world, mesh, args)
    _fsdp_units(mesh, args, ref)
    _step_loss_over_the_global_token_count(rank, world, mesh, args)
    _sinks_split_over_heads(mesh)
    _latent_attention_split_over_heads(rank, mesh)
    _sinks_split_over_the_sequence(rank, world, mesh)
    _grad_norm_over_a_mix(mesh)


def _zero_shards_and_masters(rank, world, mesh, args, ref) -> None:
    """ZeRO-1 and 2: the state dict holds even Shard(0) DTensors equal to one process's
    weights; outside forward/backward the module holds its master shards; after a step every
    rank's full parameters agree."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, Shard

    from metrics.memory_report import memory_report
    from parallelisms.zero import apply_zero
    from training.step import clip_grad_norm_

    ref_sd = ref.state_dict()
    for stage in (1, 2):
        model = tiny_model(args, lambda m, s=stage: apply_zero(m, mesh, s))
        sd = get_model_state_dict(model)
        assert list(sd) == list(ref_sd)
        for k, v in sd.items():
            assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
            torch.testing.assert_close(v.full_tensor(), ref_sd[k], msg=k)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)  # as the trainer
        x, y = batch(4, seed=rank)
        cross_entropy_sum(model(x), y).backward()
        # Outside forward/backward the module holds its master shards again.
        assert all(isinstance(p, DTensor) for p in model.parameters())
        with torch.no_grad():
            model(x)  # eval forward: also leaves the masters registered
        assert all(isinstance(p, DTensor) for p in model.parameters())
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        held = memory_report([model], opt)
        assert held.params >= 4 * sum(p.numel() for p in ref.parameters())
        opt.zero_grad()
        # After the step every rank's full parameters agree (all-gathered at the next forward).
        with torch.no_grad():
            model(x)
        for p in model._zero.params:
            full = p.compute.detach().clone()
            others = [torch.empty_like(full) for _ in range(world)]
            torch.distributed.all_gather(others, full)
            assert all(torch.equal(o, full) for o in others)


def _zero_mixed_precision_gradients(rank, world, mesh, args) -> None:
    from torch.distributed.tensor import DTensor

    from parallelisms.zero import apply_zero

    # Mixed precision (bf16 compute, fp32 reduction): every stage's fp32 master gradient is
    # the average of the ranks' bf16 gradients, and each bf16 gradient is freed as soon as its
    # fp32 copy exists (not at the end of backward): when the embedding's gradient, the last
    # of backward, arrives, no other bf16 gradient is alive.
    bf16 = torch.bfloat16
    x, y = batch(4, seed=rank)
    low = tiny_model(args)
    for q in low.parameters():  # parameters only, as the compute copies (buffers stay fp32)
        q.data = q.data.to(bf16)
    cross_entropy_sum(low(x), y).backward()
    want = {}
    for name, q in low.named_parameters():
        g = q.grad.float()
        torch.distributed.all_reduce(g)
        want[name] = g / world
    for stage in (0, 1, 2):
        model = tiny_model(args, lambda m, s=stage: apply_zero(m, mesh, s, param_dtype=bf16))
        with torch.no_grad():
            model(x)  # installs the gradient hooks on the compute parameters
        zs = model._zero.params
        emb = next(p for p in zs if p.places[0][0] is model.tok_embeddings)
        alive = []
        others = [p for p in zs if p is not emb]
        emb.compute.register_post_accumulate_grad_hook(
            lambda _, o=others, a=alive: a.append(
                [p.places[0][1] for p in o if p.compute.grad is not None]
            )
        )
        cross_entropy_sum(model(x), y).backward()
        assert alive == [[]], (stage, alive)
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(got, want[name], rtol=0, atol=0, msg=f"{stage} {name}")


def _fsdp_units(mesh, args, ref) -> None:
    from torch.distributed.tensor import DTensor

    # FSDP2 units: the embeddings are gathered only around their own forward (their backward
    # needs no weights), the final norm + output stay gathered from their forward into their
    # backward, and the gradients equal one process's.
    from models.llama3 import SPEC
    from parallelisms.decoder import decoder_fsdp_units
    from parallelisms.fsdp import apply_fsdp

    f32 = torch.float32
    model = tiny_model(
        args,
        lambda m: apply_fsdp(
            m, mesh, decoder_fsdp_units(m, SPEC, None), param_dtype=f32, reduce_dtype=f32
        ),
    )

    def gathered(module) -> bool:  # FSDP2 registers plain tensors while a unit is gathered
        return not any(isinstance(p, DTensor) for p in module.parameters())

    seen = {}
    model.layers["1"].register_forward_hook(
        lambda *_: seen.update(emb=gathered(model.tok_embeddings), head=gathered(model.output))
    )

    def watch_embedding_backward(module, inputs, out) -> None:  # when its backward starts
        out.register_hook(lambda grad: seen.update(emb_backward=gathered(module)))

    model.tok_embeddings.register_forward_hook(watch_embedding_backward)
    x, y = batch(4, seed=0)
    loss = cross_entropy_sum(model(x), y)
    assert seen == {"emb": False, "head": False}, seen  # during the blocks' forward
    assert not gathered(model.tok_embeddings) and gathered(model.output)
    assert gathered(model.norm) and gathered(model.layers["1"]) and not gathered(model.layers["0"])
    loss.backward()
    assert seen["emb_backward"] is False, seen
    assert not any(
        gathered(m) for m in (model.tok_embeddings, model.output, *model.layers.values())
    )
    ref.zero_grad()
    cross_entropy_sum(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def _grad_norm_over_a_mix(mesh) -> None:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from training.step import clip_grad_norm_

    # Gradient norm over a mix: plain tensors, DTensor shards, and replicated DTensors.
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(6, 3, generator=g) for _ in range(3)]
    params = [torch.nn.Parameter(torch.zeros(6, 3))]
    params[0].grad = fulls[0].clone()
    for full, placement in zip(fulls[1:], ("shard", "replicate")):
        from torch.distributed.tensor import Replicate

        pl = [Shard(0)] if placement == "shard" else [Replicate()]
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 3), mesh, pl))
        p.grad = distribute_tensor(full.clone(), mesh, pl)
        params.append(p)
    norm = clip_grad_norm_(params, 0.5)
    want = torch.linalg.vector_norm(torch.stack([f.norm() for f in fulls]))
    torch.testing.assert_close(norm, want)
    clipped = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    total = torch.linalg.vector_norm(torch.stack([c.norm() for c in clipped]))
    torch.testing.assert_close(total, torch.tensor(0.5), rtol=1e-4, atol=0)


def _step_loss_over_the_global_token_count(rank, world, mesh, args) -> None:
    """`train_step` on ZeRO-2 (its gradients averaged over the ranks), two micro-batches per
    rank with unequal numbers of ignored labels: the logged loss and the gradients are those of
    one process's mean over every labelled token of both ranks. Dividing by the micro-batch's,
    this rank's or all (ignored too) tokens weighs tokens unequally."""
    import torch.nn.functional as F

    from parallelisms.zero import apply_zero
    from training.loss import IGNORE_INDEX, StepLoss
    from training.step import StepSetup, global_mean, train_step

    xs, ys = zip(*(batch(2, seed=10 + r) for r in range(world)))
    ys[0][1, -2:] = IGNORE_INDEX
    ys[1][0, 3:] = IGNORE_INDEX
    ys[1][1, :5] = IGNORE_INDEX
    ref = tiny_model(args)
    logits = torch.cat([ref(x) for x in xs]).flatten(0, 1)
    want_loss = F.cross_entropy(logits, torch.cat(ys).flatten(), ignore_index=IGNORE_INDEX)
    want_loss.backward()
    model = tiny_model(args, lambda m: apply_zero(m, mesh, 2))
    micro = [(xs[rank][i : i + 1], ys[rank][i : i + 1], {}) for i in range(2)]
    loss = train_step(StepSetup([model], StepLoss(cross_entropy_sum)), micro)
    torch.testing.assert_close(global_mean(loss, world), want_loss.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def _sinks_split_over_heads(mesh) -> None:
    """Attention sinks under TP 2 (the decoder plan's styles: q/k/v by heads, the sink logits
    sharded with them): output and every gradient equal one process's (float64)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from models.attention import AttentionSpec, attention_batch
    from models.blocks import GroupedQueryAttention
    from models.tp_plan import ShardSinksWithHeads

    spec = AttentionSpec(window=24, sinks=True)

    def make():
        torch.manual_seed(0)
        m = GroupedQueryAttention(32, 4, 2, 8, lambda x, table: x, spec=spec).double()
        torch.nn.init.normal_(m.core.sinks)
        return m

    ref, tp = make(), make()
    styles = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
              "wo": RowwiseParallel(), "core": ShardSinksWithHeads()}  # fmt: skip
    parallelize_module(tp, mesh, styles)
    sinks = tp.core.sinks
    assert isinstance(sinks, DTensor) and sinks.placements == (Shard(0),), sinks
    assert sinks.to_local().shape == (2,)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 128, 32, generator=g, dtype=torch.float64)
    ab = attention_batch([spec], 2, 128, x.device)
    got, want = tp(x, None, ab), ref(x, None, ab)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (got * grad).sum().backward()
    (want * grad).sum().backward()
    for (name, p), q in zip(tp.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=1e-12, msg=name)


def _latent_attention_split_over_heads(rank, mesh) -> None:
    """DeepSeek-V3's latent attention under TP 2 by its plan's attention entries, with and
    without the query bottleneck: each rank's sequence shard of the output and every weight's
    gradient equal one process's (float64); the shared rotated key's gradient is the one
    summed over the ranks."""
    from torch import nn

    from models.attention import attention_batch
    from models.deepseek_v3 import flavors
    from models.deepseek_v3.model import LatentAttention, rope_table
    from models.deepseek_v3.plan import deepseek_v3_tp_plan
    from parallelisms.tensor_parallel import _apply

    plan = {k: v for k, v in deepseek_v3_tp_plan(False).block.items() if k.startswith("attention")}
    for q_lora_rank in (16, 0):
        args = dataclasses.replace(
            flavors["debugmodel"], dim=32, n_heads=4, n_kv_heads=4, q_lora_rank=q_lora_rank,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=12, v_head_dim=6,
            max_seq_len=64, rope_old_context=16,
        )  # fmt: skip

        def make(args=args):
            torch.manual_seed(0)
            holder = nn.Module()
            holder.attention = LatentAttention(args).double()
            return holder

        ref, tp = make(), make()
        _apply(tp, mesh, plan)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, 32, 32, generator=g, dtype=torch.float64)
        rope = rope_table(args, dtype=torch.float64)
        ab = attention_batch([ref.attention.core.spec], 2, 32, x.device)
        want = ref.attention(x, rope, ab)
        got = tp.attention(x.chunk(2, dim=1)[rank], rope, ab)  # this rank's sequence shard
        torch.testing.assert_close(got, want.chunk(2, dim=1)[rank], rtol=1e-12, atol=1e-12)
        grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (got * grad.chunk(2, dim=1)[rank]).sum().backward()
        (want * grad).sum().backward()
        for (name, p), q in zip(tp.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad, rtol=1e-10, atol=1e-12, msg=f"{q_lora_rank} {name}"
            )


def _sinks_split_over_the_sequence(rank, world, mesh) -> None:
    """Attention sinks and the returned log-sum-exp under CP 2 by both methods (a window and
    documents crossing the ranks' chunks): the CP core keeps the core's sink parameter, and
    each rank's rows of the output and log-sum-exp, its queries' and keys' gradients and the
    sum of the ranks' sink gradients equal one process's (float64). Also with values of a head
    size of their own (MLA's)."""
    from parallelisms.context_parallel import CP_CORES

    for method in CP_CORES:
        # Ulysses with 1 KV head: each rank's head group gets a copy
        for kv_heads, v_dim in ((2, 8), (1, 8), (2, 6)):
            _sinks_split_over_the_sequence_by(method, kv_heads, v_dim, rank, world, mesh)


def _sinks_split_over_the_sequence_by(method, kv_heads, v_dim, rank, world, mesh) -> None:
    import copy

    from models.attention import AttentionCore, AttentionSpec, attention_batch
    from parallelisms.context_parallel import (
        CP_CORES,
        apply_context_parallel,
        gathered_positions,
        local_positions,
    )

    spec = AttentionSpec(window=100, sinks=True, returns_lse=True)
    holder = torch.nn.Module()
    holder.core = AttentionCore(spec, n_heads=4).double()
    torch.nn.init.normal_(holder.core.sinks, generator=torch.Generator().manual_seed(2))
    ref, sinks = copy.deepcopy(holder.core), holder.core.sinks
    apply_context_parallel(holder, mesh, method)
    assert type(holder.core) is CP_CORES[method] and holder.core.sinks is sinks
    b, seq = 2, 256
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(b, h, seq, d, generator=g, dtype=torch.float64, requires_grad=True)
               for h, d in ((4, 8), (kv_heads, 8), (kv_heads, v_dim)))  # fmt: skip
    docs = torch.cumsum(torch.rand(b, seq, generator=g) < 1 / 70, -1, dtype=torch.int32)
    grads = [torch.randn(b, 4, seq, *d, generator=g, dtype=torch.float64) for d in ((v_dim,), ())]
    want = ref(q, k, v, attention_batch([spec], b, seq, q.device, documents=docs))
    torch.autograd.backward(want, grads)
    mine, keys = local_positions(seq, rank, world), gathered_positions(seq, world)
    ab = attention_batch([spec], b, seq // world, q.device, mine.expand(b, -1), docs[:, mine],
                         keys.expand(b, -1), docs[:, keys])  # fmt: skip
    local = [t.detach()[:, :, mine].requires_grad_() for t in (q, k, v)]
    got = holder.core(*local, ab)
    torch.autograd.backward(got, [t[:, :, mine] for t in grads])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w[:, :, mine], rtol=1e-12, atol=1e-12)
    for a, w in zip(local, (q, k, v)):
        torch.testing.assert_close(a.grad, w.grad[:, :, mine], rtol=1e-11, atol=1e-11)
    total = sinks.grad.clone()
    torch.distributed.all_reduce(total)
    torch.testing.assert_close(total, ref.sinks.grad, rtol=1e-11, atol=1e-11)


def test_distributed_units_two_ranks():
    spawn(_two_rank_checks, 2)


def _compile_in_turns(rank: int, world: int, cache: str) -> None:
    """Both ranks compile one graph into one cache folder at the same moment."""
    import os

    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from parallelisms.compile import inductor_in_turns

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda x: (x.sin() * x).sum(), backend=inductor_in_turns)
    x = torch.randn(8, requires_grad=True)
    dist.barrier()
    loss = fn(x)
    dist.barrier()  # the backward of both at once
    loss.backward()
    assert torch.allclose(x.grad, x.cos() * x + x.sin())
    mine = [counters["inductor"][k] for k in ("fxgraph_cache_miss", "fxgraph_cache_hit")]
    both = [None] * world
    dist.all_gather_object(both, mine)
    print(f"rank {rank}: FX graph cache misses, hits {both}", flush=True)
    assert sorted(both) == [[0, 2], [2, 0]], both


def test_ranks_compiling_one_graph_take_turns(tmp_path):
    """Ranks that compile the same graph take turns (`parallelisms.compile.inductor_in_turns`):
    one compiles its forward and backward, the other then finds both in the FX graph cache
    (concurrently, both would compile both; a backward compiled at its first call, outside
    the turn, would be compiled by both)."""
    spawn(_compile_in_turns, 2, str(tmp_path / "inductor"))
