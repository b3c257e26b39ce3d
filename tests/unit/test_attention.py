"""The attention contract's core: every spec (causal or not, sliding window, soft-capping, a
softmax scale, document masking), with or without attention sinks and the log-sum-exp returned,
computed through block masks equals the dense definition in value and gradient, on grouped-query
heads and on keys in any order (context parallelism's gathered chunks); FlexAttention reads the
same block masks; nothing quadratic is kept."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.attention import AttentionBatch, AttentionCore, AttentionSpec, attend, attention_batch
from models.block_attention import block_sparsity
from parallelisms.context_parallel import gathered_positions, local_positions

SPECS = [
    AttentionSpec(),
    AttentionSpec(window=24),
    AttentionSpec(softcap=4.0, scale=0.3),
    AttentionSpec(window=70, softcap=2.5),
    AttentionSpec(causal=False),
    AttentionSpec(document_mask=False, window=9),
]


def _name(spec: AttentionSpec) -> str:
    return f"c{int(spec.causal)}_w{spec.window}_s{spec.softcap}_d{int(spec.document_mask)}"


def seen(spec, q_pos, k_pos, q_doc, k_doc):
    """The visibility rule, stated here apart from the code under test: causal (a key at a
    later position is hidden), a window of w positions ending at the query, one document."""
    ok = (k_pos <= q_pos) if spec.causal else torch.ones_like(k_pos <= q_pos)
    if spec.window is not None:
        ok = ok & (k_pos > q_pos - spec.window)
    return ok if q_doc is None else ok & (q_doc == k_doc)


def dense(spec, q, k, v, q_pos, k_pos, q_doc=None, k_doc=None, sinks=None):
    """The definition: scores over every pair, masked by `seen`, K/V repeated; with `sinks`
    (Hugging Face gpt-oss's definition) a column of each head's sink logit joins the scores and
    is dropped after the softmax. Returns (output, log-sum-exp of the visible scores) when
    `sinks` is given, else the output."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (spec.scale or q.shape[-1] ** -0.5)
    if spec.softcap:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    docs = (q_doc[:, :, None], k_doc[:, None, :]) if q_doc is not None else (None, None)
    mask = seen(spec, q_pos[:, :, None], k_pos[:, None, :], *docs)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    if sinks is None:
        return torch.softmax(s, -1) @ v
    column = sinks[None, :, None, None].expand(*s.shape[:3], 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    return p @ v, torch.logsumexp(s, -1)


def _qkv(batch, heads, kv_heads, q_len, k_len, dim=16, dtype=torch.float64, v_dim=None):
    g = torch.Generator().manual_seed(0)
    shapes = [
        (batch, heads, q_len, dim),
        (batch, kv_heads, k_len, dim),
        (batch, kv_heads, k_len, v_dim or dim),
    ]
    return [torch.randn(s, generator=g, dtype=dtype, requires_grad=True) for s in shapes]


def _documents(batch: int, seq: int, every: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ends = torch.rand(batch, seq, generator=g) < 1 / every
    return torch.cumsum(ends.int(), -1, dtype=torch.int32)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=_name)
def test_every_spec_equals_the_dense_definition_with_its_gradients(spec, documents):
    batch, seq = 2, 384  # three blocks of 128
    q, k, v = _qkv(batch, 4, 2, seq, seq)
    docs = _documents(batch, seq) if documents else None
    ab = attention_batch([spec], batch, seq, q.device, documents=docs)
    got = attend(spec, q, k, v, ab)
    pos = torch.arange(seq).expand(batch, -1)
    want = dense(spec, q, k, v, pos, pos, *((docs, docs) if documents and spec.document_mask
                                            else (None, None)))  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad)):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize(
    "spec", [AttentionSpec(), AttentionSpec(window=70, softcap=2.5)], ids=_name
)
def test_values_of_a_head_size_of_their_own_equal_the_definition(spec, documents):
    """MLA's values are smaller than its queries and keys (128 against 192 in DeepSeek-V3):
    every backend takes them, SDPA (plain causal) and the block kernel, forward and backward."""
    batch, seq = 2, 256
    q, k, v = _qkv(batch, 4, 2, seq, seq, dim=24, v_dim=10)
    docs = _documents(batch, seq) if documents else None
    ab = attention_batch([spec], batch, seq, q.device, documents=docs)
    got = attend(spec, q, k, v, ab)
    assert got.shape == (batch, 4, seq, 10)
    pos = torch.arange(seq).expand(batch, -1)
    want = dense(spec, q, k, v, pos, pos, *((docs, docs) if documents else (None, None)))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad)):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=_name)
def test_sinks_and_the_log_sum_exp_equal_the_definition_with_their_gradients(spec, documents):
    """Every spec with a sink logit per head and the log-sum-exp returned: both equal the
    definition, and so do the gradients of both with respect to q, k, v and the sinks (the
    kernel's backward takes the log-sum-exp's gradient)."""
    spec = replace(spec, sinks=True, returns_lse=True)
    batch, seq = 2, 256
    q, k, v = _qkv(batch, 4, 2, seq, seq)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    sinks.requires_grad_()
    docs = _documents(batch, seq) if documents else None
    ab = attention_batch([spec], batch, seq, q.device, documents=docs)
    got = attend(spec, q, k, v, ab, sinks)
    pos = torch.arange(seq).expand(batch, -1)
    masked = documents and spec.document_mask
    want = dense(spec, q, k, v, pos, pos, *((docs, docs) if masked else (None, None)), sinks)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    grads = [torch.randn_like(t) for t in got]
    inputs = (q, k, v, sinks)
    for a, b in zip(torch.autograd.grad(got, inputs, grads),
                    torch.autograd.grad(want, inputs, grads)):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_the_core_owns_one_sink_logit_per_query_head():
    spec = AttentionSpec(sinks=True)
    assert not spec.fused_causal and not AttentionSpec(returns_lse=True).fused_causal
    core = AttentionCore(spec, n_heads=6)
    assert [(n, tuple(p.shape)) for n, p in core.named_parameters()] == [("sinks", (6,))]
    assert list(AttentionCore(AttentionSpec(), n_heads=6).parameters()) == []
    with pytest.raises(ValueError, match="n_heads"):
        AttentionCore(spec)
    q, k, v = _qkv(1, 6, 2, 128, 128)
    with pytest.raises(ValueError, match="AttentionBatch"):
        core(q, k, v)  # no batch: SDPA has no sinks, so the run needs the masked backends


@pytest.mark.parametrize("spec", SPECS[:4], ids=_name)
def test_keys_in_context_parallel_order_give_each_ranks_rows(spec):
    """A CP rank's queries (two chunks) against the gathered keys (rank-major) through the
    block mask equal those rows of the attention over the sequence in order, windows crossing
    chunk and rank boundaries included."""
    batch, seq, cp = 1, 512, 2
    q, k, v = _qkv(batch, 4, 1, seq, seq)
    docs = _documents(batch, seq, every=150)
    pos = torch.arange(seq).expand(batch, -1)
    want = dense(spec, q, k, v, pos, pos, docs, docs)
    keys = gathered_positions(seq, cp)
    for r in range(cp):
        mine = local_positions(seq, r, cp)
        ab = attention_batch([spec], batch, seq // cp, q.device, mine.expand(batch, -1),
                             docs[:, mine], keys.expand(batch, -1), docs[:, keys])  # fmt: skip
        got = attend(spec, q[:, :, mine], k[:, :, keys], v[:, :, keys], ab)
        torch.testing.assert_close(got, want[:, :, mine], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=_name)
def test_flex_attention_reads_the_same_block_masks(spec):
    """The CUDA backend's input: torch's FlexAttention (forward; CPU has no backward) over the
    BlockMask the model builds, with the spec's score modification, equals the CPU kernel."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    batch, seq = 2, 256
    q, k, v = (t.detach().float() for t in _qkv(batch, 4, 2, seq, seq))
    docs = _documents(batch, seq)
    ab = attention_batch([spec], batch, seq, q.device, documents=docs)
    ab = ab if ab is not None and spec.key in ab.masks else _with_mask(spec, ab, batch, seq)
    cap = spec.softcap
    with torch.no_grad():
        got, aux = flex_attention(
            q, k, v, block_mask=ab.masks[spec.key], scale=spec.scale, enable_gqa=True,
            score_mod=None if cap is None else (lambda s, b, h, i, j: cap * torch.tanh(s / cap)),
            return_aux=AuxRequest(lse=True),
        )  # fmt: skip
        want, lse = attend(replace(spec, returns_lse=True), q, k, v, ab)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse, lse, rtol=1e-5, atol=1e-5)  # natural log, as the kernel


def _with_mask(spec, ab, batch, seq) -> AttentionBatch:
    """A batch forced onto the block-mask path (a plain spec needs none on its own)."""
    from models.attention import block_mask

    pos = torch.arange(seq).expand(batch, -1)
    forced = AttentionBatch(pos, pos, ab.documents if ab else None,
                            ab.key_documents if ab else None, keys_given=True)  # fmt: skip
    forced.masks[spec.key] = block_mask(spec, forced)
    return forced


def test_plain_causal_attention_needs_no_batch_and_uses_sdpa():
    specs = [AttentionSpec(), AttentionSpec(scale=0.5)]
    assert attention_batch(specs, 2, 256, torch.device("cpu")) is None
    windowed = attention_batch([AttentionSpec(window=8)], 2, 256, torch.device("cpu"))
    assert list(windowed.masks) == [AttentionSpec(window=8).key]


def test_block_sparsity_skips_blocks_no_pair_of_which_is_visible():
    """Documents of 128 tokens aligned with the blocks: each query block reads its own block
    only, as a partial (causal) block; a window of one block reads the diagonal too."""
    seq, size = 1024, 128
    pos = torch.arange(seq)[None]
    docs = (torch.arange(seq) // 128)[None]
    num, idx, full_num, full_idx = block_sparsity(pos, pos, docs, docs, size, True, None)
    assert num.tolist() == [[[1] * 8]] and full_num.tolist() == [[[0] * 8]]
    assert idx[0, 0, :, 0].tolist() == list(range(8))
    num, idx, full_num, full_idx = block_sparsity(pos, pos, None, None, size, True, None)
    assert num.sum() == 8 and full_num[0, 0].tolist() == list(range(8))  # causal: full below
    num, _, full_num, _ = block_sparsity(pos, pos, None, None, size, True, 128)
    assert num[0, 0].tolist() == [1] + [2] * 7 and full_num.sum() == 0


def _saved_bytes(spec, seq, documents_every=64) -> int:
    batch = 1
    q, k, v = _qkv(batch, 4, 1, seq, seq, dtype=torch.float32)
    docs = (torch.arange(seq) // documents_every)[None].int()
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ab = attention_batch([spec], batch, seq, q.device, documents=docs)
        attend(spec, q, k, v, ab)
    return total


@pytest.mark.parametrize("spec", [AttentionSpec(), AttentionSpec(window=64, softcap=3.0)],
                         ids=_name)  # fmt: skip
def test_what_attention_keeps_for_backward_grows_linearly_with_the_sequence(spec):
    """Documents of 64 tokens: 4x the sequence keeps 4x the bytes (the old dense document mask
    kept 16x), whatever the spec."""
    small, large = _saved_bytes(spec, 512), _saved_bytes(spec, 2048)
    assert large <= 4 * small * 1.01, (small, large)


def test_a_compiled_block_keeps_the_kernel_one_node():
    """fullgraph compile (what regional compile does) traces through the custom op."""
    spec = AttentionSpec(window=40, softcap=3.0)
    batch, seq = 1, 256
    q, k, v = _qkv(batch, 4, 2, seq, seq, dtype=torch.float32)
    docs = _documents(batch, seq)
    ab = attention_batch([spec], batch, seq, q.device, documents=docs)
    compiled = torch.compile(lambda *a: attend(spec, *a, ab), fullgraph=True, backend="eager")
    got, want = compiled(q, k, v), attend(spec, q, k, v, ab)
    torch.testing.assert_close(got, want)
    torch.autograd.grad(got.sum(), (q, k, v))


@pytest.mark.parametrize("v_dim", [16, 12])
def test_the_kernels_fake_outputs_have_the_real_ones_strides(v_dim):
    """What compile sees of the custom ops (their fake kernels) is what they return, also for a
    transposed q (as attention layers pass it, [batch, seq, heads, dim] transposed): results in
    the inputs' memory order (the output projection then reads the output without a copy). A
    fake that disagreed with the kernel failed every compiled windowed, soft-capped or
    document-masked layer at run time (inductor asserts the strides)."""
    spec = AttentionSpec(window=40, softcap=3.0)
    batch, seq = 1, 256
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in
               _qkv(batch, 4, 2, seq, seq, dtype=torch.float32, v_dim=v_dim))  # fmt: skip
    ab = attention_batch([spec], batch, seq, q.device, documents=_documents(batch, seq))
    mask = ab.masks[spec.key]
    args = (q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
            mask.full_kv_indices, ab.positions, ab.key_positions, ab.documents,
            ab.key_documents, True, 40, 3.0, 0.25, mask.BLOCK_SIZE[0])  # fmt: skip
    torch.library.opcheck(torch.ops.meshtrain.block_attention.default, args,
                          test_utils=("test_faketensor",))  # fmt: skip
    out, lse = torch.ops.meshtrain.block_attention.default(*args)
    grad_args = (out.detach(), lse.detach(), q, k, v, out, lse, *args[3:])
    torch.library.opcheck(torch.ops.meshtrain.block_attention_backward.default, grad_args,
                          test_utils=("test_faketensor",))  # fmt: skip
