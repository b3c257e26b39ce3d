"""Context parallelism's sequence split, and the model contract it rests on (global RoPE
positions and the keys' positions give the same attention as one process, for every attention
spec), without processes; tests/integration/test_cp_parity.py trains the real layouts."""

from __future__ import annotations

import pytest
import torch
from dist_utils import TINY_CONFIG, fake_world
from torch import nn

from models.attention import AttentionCore, AttentionSpec, attend
from models.llama3.model import ModelArgs, Transformer
from models.qwen3.model import Qwen3, Qwen3Args
from parallelisms.context_parallel import (
    apply_context_parallel,
    attention_problems,
    causal_chunks,
    gathered_positions,
    local_positions,
    mixes_positions_outside_the_core,
)
from training.inputs import SequenceSplit, sequence_inputs


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_hold_head_and_tail_chunks_of_equal_causal_work(cp):
    seq, chunk = 32, 32 // (2 * cp)
    held = [local_positions(seq, r, cp) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))  # each token once
    for r, pos in enumerate(held):
        assert pos.tolist() == [*range(r * chunk, (r + 1) * chunk),
                                *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]  # fmt: skip
    # causal work of a query = the keys it sees = its position + 1: equal on every rank
    work = {int((pos + 1).sum()) for pos in held}
    assert len(work) == 1, work
    assert torch.equal(gathered_positions(seq, cp), torch.cat(held))


def test_plain_layouts_keep_the_batch_and_the_default_attention():
    x, y = torch.randint(0, 9, (2, 8)), torch.randint(0, 9, (2, 8))
    got_x, got_y, kwargs = sequence_inputs(SequenceSplit(), x, y)
    assert got_x is x and got_y is y and kwargs == {}


@pytest.mark.parametrize("document_mask", [False, True])
def test_cp_shard_gives_its_queries_and_the_gathered_keys_positions_and_documents(document_mask):
    cp, seq = 2, 16
    x = torch.randint(0, 6, (3, seq))
    y = torch.roll(x, -1, 1)
    docs = torch.randint(0, 3, (3, seq), dtype=torch.int32).sort(dim=1).values
    keys = gathered_positions(seq, cp)
    for r in range(cp):
        mine = local_positions(seq, r, cp)
        lx, ly, kw = sequence_inputs(SequenceSplit(r, cp, document_mask), x, y, docs)
        assert torch.equal(lx, x[:, mine]) and torch.equal(ly, y[:, mine])
        assert torch.equal(kw["positions"], mine.expand(3, -1))
        assert torch.equal(kw["key_positions"], keys.expand(3, -1))
        if not document_mask:
            assert "documents" not in kw and "key_documents" not in kw
            continue
        assert torch.equal(kw["documents"], docs[:, mine])
        assert torch.equal(kw["key_documents"], docs[:, keys])


def test_pipeline_layouts_give_positions():
    """A stage after the first cannot tell the sequence from its (maybe sequence-sharded)
    input: with `positions` the batch carries them."""
    x = torch.randint(0, 9, (2, 8))
    _, _, kwargs = sequence_inputs(SequenceSplit(positions=True), x, x)
    assert torch.equal(kwargs["positions"], torch.arange(8).expand(2, -1))


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_chunks_equal_full_causal_attention_of_the_ranks_queries(cp):
    """What every CP rank computes from its queries and the gathered (rank-major, KV-head)
    keys and values equals those queries' rows of one process's causal attention."""
    torch.manual_seed(0)
    seq = 16
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    want = attend(AttentionSpec(), q, k, v)  # one process: causal over the whole sequence
    keys = gathered_positions(seq, cp)
    for r in range(cp):
        mine = local_positions(seq, r, cp)
        got = causal_chunks(q[:, :, mine], k[:, :, keys], v[:, :, keys], r, cp)
        torch.testing.assert_close(got, want[:, :, mine], rtol=1e-5, atol=1e-6)


def _tiny(family):
    if family == "llama":
        return Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                     vocab_size=64, max_seq_len=16))  # fmt: skip
    return Qwen3(Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           vocab_size=64, max_seq_len=16, ffn_dim=64))  # fmt: skip


SPECS = [AttentionSpec(), AttentionSpec(window=5), AttentionSpec(softcap=2.0, scale=0.3),
         AttentionSpec(window=3, softcap=1.5)]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"window{s.window}_softcap{s.softcap}")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_permuted_tokens_with_their_positions_give_the_same_logits(family, spec):
    """What a CP rank computes, in one process, for every attention spec: tokens in the CP
    order, RoPE and masks at their global positions (the keys' given as well) give each token
    the logits it has in the model over the sequence in order; windows cross the chunks."""
    torch.manual_seed(0)
    model = _tiny(family).eval()
    for core in [m for m in model.modules() if isinstance(m, AttentionCore)]:
        core.spec = spec
    model.attention_specs = [spec]
    tokens = torch.randint(0, 64, (2, 16))
    order = gathered_positions(16, 2).expand(2, -1)
    with torch.no_grad():
        want = model(tokens)
        got = model(tokens[:, order[0]], positions=order, key_positions=order)
        explicit = model(tokens, positions=torch.arange(16).expand(2, -1))
    torch.testing.assert_close(explicit, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want[:, order[0]], rtol=1e-5, atol=1e-5)


def test_documents_do_not_see_each_other():
    """With document masking, a document's logits do not depend on the one before it."""
    torch.manual_seed(0)
    model, eos = _tiny("llama").eval(), 63
    a = torch.tensor([[5, 6, eos, 7, 8, 9, 10, 11]])
    b = torch.tensor([[1, 2, eos, 7, 8, 9, 10, 11]])  # another first document
    with torch.no_grad():
        docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
        split = SequenceSplit(document_mask=True)
        outs = [model(t, **sequence_inputs(split, t, t, docs)[2]) for t in (a, b)]
    torch.testing.assert_close(outs[0][:, 3:], outs[1][:, 3:])
    assert not torch.allclose(model(a)[:, 3:], model(b)[:, 3:])  # plain causal: they do


def test_a_model_without_the_shared_attention_core_is_refused():
    with pytest.raises(ValueError, match="no models.attention.AttentionCore"):
        apply_context_parallel(nn.Sequential(nn.Linear(2, 2)), cp_mesh=None)


class SoftCappedCore(AttentionCore):
    """A family's own attention math on the shared core's hook (what CP must not replace)."""

    def forward(self, q, k, v, batch=None):
        return attend(self.spec, q, k, v, batch) * 0.5


class OwnCore(nn.Module):
    """Attention a family computes itself (Gemma 3's shape: some layers on their own core)."""

    def forward(self, q, k, v, batch=None):
        return attend(AttentionSpec(), q, k, v, batch)


def _tiny_llama(core_of_layer_1=None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      vocab_size=64, multiple_of=16, max_seq_len=16))  # fmt: skip
    if core_of_layer_1 is not None:
        model.layers["1"].attention.core = core_of_layer_1
    return model


def test_cp_refuses_attention_it_cannot_honour_naming_the_module():
    """The shared core alone is split over CP ranks. A subclass of it (its own math) was
    silently replaced by the plain CP core, and a layer on its own core silently saw only the
    rank's tokens: both are refused by name before any process group; the subclass is left
    unswapped."""
    assert attention_problems(_tiny_llama(), 16) == []
    (capped,) = attention_problems(_tiny_llama(SoftCappedCore()), 16)
    assert "layers.1.attention.core (SoftCappedCore) subclasses" in capped
    (own,) = attention_problems(_tiny_llama(OwnCore()), 16)
    assert "layers.1.attention.core calls scaled_dot_product_attention itself" in own
    assert "context_parallel_degree = 1" in own
    model = _tiny_llama(SoftCappedCore())
    with fake_world(2):
        from torch.distributed.device_mesh import init_device_mesh

        assert apply_context_parallel(model, init_device_mesh("cpu", (2,))) == 1
    assert type(model.layers["1"].attention.core) is SoftCappedCore


def test_the_check_reaches_the_layers_after_a_routing_layer():
    """MoE routing has no meta kernel (its expert counts): the check's forward stops in layer
    0's experts, and goes on with layers 1-3, each given layer 0's inputs. A probe whose later
    layers compute attention themselves was accepted when the check stopped there."""
    from models.qwen3_moe import flavors
    from models.qwen3_moe.model import Qwen3MoE

    with torch.device("meta"):
        model = Qwen3MoE(flavors["debugmodel"])
    assert attention_problems(model, 16) == []
    for i in ("1", "2", "3"):
        model.layers[i].attention.core = OwnCore()
    (own,) = attention_problems(model, 16)
    for i in ("1", "2", "3"):
        assert f"layers.{i}.attention.core calls scaled_dot_product_attention itself" in own


class SinkOutsideTheCore(nn.Module):
    """The walk-around of issue 33: the shared core (an exact AttentionCore, which CP swaps)
    for softmax(qk)v, and an attention sink applied outside it, out x sigmoid(lse - sink), with
    the log-sum-exp computed from the layer's own q and k: under CP it sees the rank's keys
    only, yet no SDPA call is made outside the core."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.core = AttentionCore()
        self.sink = nn.Parameter(torch.zeros(n_heads))

    def forward(self, q, k, v, batch=None):
        out = self.core(q, k, v, batch)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        lse = scores.masked_fill(~causal, float("-inf")).logsumexp(-1, keepdim=True)
        return out * torch.sigmoid(lse - self.sink[:, None, None])


def test_mixing_positions_outside_the_core_is_found_on_a_real_instance():
    """With every core made per-position, one position's logits depend on no other position's
    embedding in a plain decoder, and on earlier ones when a layer computes a log-sum-exp over
    its own q and k (the sink walk-around, which the meta-device check cannot see)."""

    def tiny(core_of_layer_1=None) -> Transformer:
        torch.manual_seed(0)
        model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      vocab_size=64, multiple_of=16, max_seq_len=16))  # fmt: skip
        model.init_buffers("cpu")
        if core_of_layer_1 is not None:
            model.layers["1"].attention.core = core_of_layer_1
        return model

    assert not mixes_positions_outside_the_core(tiny(), "tok_embeddings", 16)
    walk_around = tiny(SinkOutsideTheCore(4))
    with torch.device("meta"):
        on_meta = SinkOutsideTheCore(4)
    assert attention_problems(_tiny_llama(on_meta), 16) == []  # no SDPA call outside a core
    assert mixes_positions_outside_the_core(walk_around, "tok_embeddings", 16)


def test_the_config_check_refuses_cp_for_a_family_with_its_own_attention():
    import dataclasses

    from job_config import parse_args
    from models import get_model_spec, register
    from models.contract import MODELS
    from training.preflight import check_config

    class OwnAttentionLlama(Transformer):
        def __init__(self, args):
            super().__init__(args)
            self.layers["0"].attention.core = OwnCore()

    class SinkWalkAroundLlama(Transformer):
        def __init__(self, args):
            super().__init__(args)
            self.layers["1"].attention.core = SinkOutsideTheCore(args.n_heads)

        def init_param(self, name, tensor, generator):
            if name.endswith(".sink"):
                return tensor.zero_()
            return super().init_param(name, tensor, generator)

    llama = get_model_spec("llama3")
    register(dataclasses.replace(llama, name="own_attention", model_cls=OwnAttentionLlama))
    register(dataclasses.replace(llama, name="sink_walk_around", model_cls=SinkWalkAroundLlama))
    cases = (("own_attention", r"layers\.0\.attention\.core calls scaled_dot"),
             ("sink_walk_around", "mixes information across sequence positions outside"))  # fmt: skip
    try:
        for name, refusal in cases:
            argv = ["--config", "debug_model", "--model.name", name]
            check_config(parse_args(argv), world_size=2)  # no CP: accepted
            with pytest.raises(ValueError, match=refusal):
                check_config(parse_args([*argv, "--parallelism.context_parallel_degree", "2"]), 2)
    finally:
        del MODELS["own_attention"], MODELS["sink_walk_around"]


@pytest.mark.parametrize(
    ("world", "extra", "refusal"),
    [
        (2, (), None),  # 4 heads, 2 KV heads: Ulysses CP 2 accepted
        (4, ("--parallelism.tensor_parallel_degree", "2"), None),  # 1 KV head per TP rank, copied
        (1, ("--parallelism.context_parallel_degree", "1"), "needs context_parallel_degree > 1"),
        (8, ("--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree",
             "4"), "TP x CP = 8 ranks do not divide n_heads = 4"),
        (4, ("--model.dim", "96", "--model.n_heads", "12", "--model.n_kv_heads", "6",
             "--parallelism.context_parallel_degree", "4"),
         "the 6 KV heads of a TP rank are neither split by nor a divisor of CP = 4"),
    ],
)  # fmt: skip
def test_ulysses_is_refused_where_the_heads_do_not_split(world, extra, refusal):
    """Ulysses gives each TP x CP rank whole query heads and its KV heads, or a copy of the one
    its heads read: the config check refuses a split that would cut them, and the method
    without CP (it would be ignored)."""
    from job_config import parse_args
    from training.preflight import check_config

    argv = ["--config", str(TINY_CONFIG), "--parallelism.context_parallel_degree", "2",
            "--parallelism.context_parallel_method", "ulysses", *extra]  # fmt: skip
    if refusal is None:
        check_config(parse_args(argv), world_size=world)
        return
    with pytest.raises(ValueError, match=refusal):
        check_config(parse_args(argv), world_size=world)
