"""Llama 3 components against plain reference implementations written here."""

import math

import pytest
import torch

from metrics import count_params
from models import build_model_args
from models.init_weights import init_weights
from models.llama3 import ModelArgs, Transformer, flavors
from models.llama3.model import Attention, FeedForward, rope_frequencies, rope_table
from models.rope import apply_interleaved as apply_rope


def ref_rope(x, theta):
    """Complex-number RoPE on adjacent pairs, as Meta's reference code does it."""
    b, s, h, d = x.shape
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.double().reshape(b, s, h, d // 2, 2))
    return torch.view_as_real(xc * rot[None, :, None, :]).reshape(b, s, h, d)


def test_rope_matches_complex_reference():
    args = ModelArgs(dim=64, n_heads=4, max_seq_len=16, rope_theta=10000.0)
    x = torch.randn(2, 16, 4, 16)
    torch.testing.assert_close(
        apply_rope(x, rope_table(args)), ref_rope(x, 10000.0).float(), rtol=1e-5, atol=1e-5
    )


def test_llama31_rope_scaling_only_touches_low_frequencies():
    plain = rope_frequencies(ModelArgs(dim=512, n_heads=4, rope_theta=500000.0))
    scaled = rope_frequencies(
        ModelArgs(dim=512, n_heads=4, rope_theta=500000.0, use_scaled_rope=True)
    )
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4  # short wavelengths are kept
    low = wavelen > 8192  # long ones are divided by the scale factor 8
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    assert high.any() and low.any()


def test_gqa_attention_matches_explicit_reference():
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=8)
    attn = Attention(args)
    x = torch.randn(2, 8, 32)
    table = rope_table(args)
    out = attn(x, table)
    # Reference: explicit softmax(QK^T / sqrt(d) + causal mask) V with shared KV heads.
    q = attn.wq(x).view(2, 8, 4, 8)
    k = attn.wk(x).view(2, 8, 2, 8)
    v = attn.wv(x).view(2, 8, 2, 8)
    q, k = ref_rope(q, args.rope_theta).float(), ref_rope(k, args.rope_theta).float()
    k = k[:, :, [0, 0, 1, 1]]  # query heads 0,1 share kv head 0; 2,3 share kv head 1
    v = v[:, :, [0, 0, 1, 1]]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(2, 8, 32)
    torch.testing.assert_close(out, attn.wo(ref), rtol=1e-5, atol=1e-5)


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight in float64, eps = 1e-5 as in Llama 3's params.json."""
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()


def test_model_rmsnorms_match_reference():
    torch.manual_seed(0)
    model = Transformer(_tiny_args())
    block = model.layers["0"]
    # Inputs of RMS ~3e-3, where eps = 1e-5 moves the result by ~50%, and of RMS ~1.
    for scale in (3e-3, 1.0):
        x = torch.randn(3, 5, 32) * scale
        for norm in (model.norm, block.attention_norm, block.ffn_norm):
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
            ref = ref_rmsnorm(x, norm.weight)
            torch.testing.assert_close(norm(x).double(), ref, rtol=1e-5, atol=1e-7)
    # The block is pre-norm: h = x + attention(rmsnorm(x)); out = h + feed_forward(rmsnorm(h)).
    x = torch.randn(2, 8, 32) * 3e-3
    h = x + block.attention(ref_rmsnorm(x, block.attention_norm.weight).float(), model.rope)
    ref = h + block.feed_forward(ref_rmsnorm(h, block.ffn_norm.weight).float())
    torch.testing.assert_close(block(x, model.rope), ref, rtol=1e-5, atol=1e-6)


def test_swiglu_sizing_and_output():
    # Llama 3 8B: dim 4096, multiplier 1.3, multiple_of 1024 -> 14336 (published).
    assert flavors["8B"].ffn_hidden_dim == 14336
    assert flavors["70B"].ffn_hidden_dim == 28672
    assert flavors["405B"].ffn_hidden_dim == 53248
    assert ModelArgs(dim=256, multiple_of=256).ffn_hidden_dim == 768  # int(2*1024/3)=682 -> 768
    ff = FeedForward(8, 16)
    x = torch.randn(4, 8)
    ref = ff.w2(torch.nn.functional.silu(ff.w1(x)) * ff.w3(x))
    torch.testing.assert_close(ff(x), ref)


# Published totals of Llama 3.1 (128,256-token vocabulary, untied output layer) and Llama 3.2
# (1B and 3B: the output layer is the embedding matrix, counted once).
@pytest.mark.parametrize(
    "flavor, expected",
    [
        ("1B", 1_235_814_400),
        ("3B", 3_212_749_824),
        ("8B", 8_030_261_248),
        ("70B", 70_553_706_496),
        ("405B", 405_853_388_800),
    ],
)
def test_flavor_parameter_counts_on_meta(flavor, expected):
    args = flavors[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected
    assert count_params(model) == expected  # what train.py reports
    # matmul parameters: a tied embedding still does the output projection's work
    embedding = 0 if args.tie_embeddings else 128_256 * args.dim
    assert count_params(model, ("tok_embeddings",)) == expected - embedding
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor in ("1B", "3B"))


def test_debugmodel_parameter_count_by_hand():
    # dim 256, 6 layers, 16 heads of 16, 8 KV heads, vocabulary 4096, SwiGLU hidden
    # int(2 * 4 * 256 / 3) = 682 rounded up to a multiple of 256 = 768.
    dim, layers, kv_dim, vocab, hidden = 256, 6, 8 * 16, 4096, 768
    attention = dim * dim + 2 * dim * kv_dim + dim * dim  # wq, wk + wv, wo
    feed_forward = 3 * dim * hidden  # w1, w2, w3
    norms = 2 * dim  # attention_norm, ffn_norm
    per_layer = attention + feed_forward + norms  # 196,608 + 589,824 + 512 = 786,944
    total = vocab * dim + layers * per_layer + dim + dim * vocab  # + final norm + output
    assert total == 6_819_072  # what the README and `--job.dry_run` say
    with torch.device("meta"):
        model = Transformer(flavors["debugmodel"])
    assert sum(p.numel() for p in model.parameters()) == total
    assert count_params(model) == total
    assert count_params(model, ("tok_embeddings",)) == total - vocab * dim


def test_build_model_args_uses_tokenizer_vocab_and_seq_len():
    args = build_model_args("llama3", "8B", seq_len=4096, vocab_size=1000)
    assert (args.vocab_size, args.max_seq_len, args.dim) == (1000, 4096, 4096)
    with pytest.raises(ValueError, match="not a flavor"):
        build_model_args("llama3", "7B", seq_len=8)


def _tiny_args():
    return ModelArgs(
        dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16, max_seq_len=16
    )


def test_meta_init_is_deterministic_and_follows_the_rules():
    def build(seed):
        with torch.device("meta"):
            m = Transformer(_tiny_args())
        m.to_empty(device="cpu")
        init_weights(m, seed)
        m.init_buffers("cpu")
        return m

    a, b, c = build(1), build(1), build(2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.layers["0"].attention_norm.weight, torch.ones(32))
    # Depth-scaled std for residual projections, 3-std truncation.
    wo0, wo2 = a.layers["0"].attention.wo.weight, a.layers["2"].attention.wo.weight
    assert wo2.std() < wo0.std()
    assert wo0.abs().max() <= 3 * 0.02 / math.sqrt(2) + 1e-6
    torch.testing.assert_close(a.rope, rope_table(_tiny_args()))
    logits = a(torch.randint(0, 50, (2, 16)))
    assert logits.shape == (2, 16, 50) and torch.isfinite(logits).all()


def test_pipeline_stage_style_model_without_embeddings():
    torch.manual_seed(0)
    full = Transformer(_tiny_args())
    tokens = torch.randint(0, 50, (1, 8))
    h = full.tok_embeddings(tokens)
    for key in ("0", "1"):
        h = full.layers[key](h, full.rope)
    # A last stage: embeddings removed, first layers deleted, keys stay stable.
    full_logits = full(tokens)
    del full.layers["0"], full.layers["1"]
    full.tok_embeddings = None
    assert list(full.layers.keys()) == ["2"]
    torch.testing.assert_close(full(h), full_logits)
