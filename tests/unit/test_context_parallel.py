"""Context parallelism's sequence split and masks, and the model contract it rests on (global
RoPE positions and an explicit mask give the same attention as one process), without
processes; tests/integration/test_cp_parity.py trains the real layouts."""

from __future__ import annotations

import pytest
import torch
from dist_utils import fake_world
from torch import nn

from models.attention import ScaledDotProductAttention, attend
from models.llama3.model import ModelArgs, Transformer
from models.qwen3.model import Qwen3, Qwen3Args
from parallelisms.context_parallel import (
    apply_context_parallel,
    attention_problems,
    causal_chunks,
    gathered_positions,
    local_positions,
)
from training.inputs import SequenceSplit, attention_mask, document_ids, sequence_inputs


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


def test_documents_end_with_their_end_token():
    eos = 9
    tokens = torch.tensor([[1, 5, eos, 1, 7, 8, eos, 1], [eos, eos, 3, 4, 5, 6, 7, 8]])
    assert document_ids(tokens, eos).tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 2],
        [0, 1, 2, 2, 2, 2, 2, 2],
    ]


def test_masks_are_causal_within_documents():
    pos = torch.arange(4)
    assert torch.equal(attention_mask(pos, pos)[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    docs = torch.tensor([[0, 0, 1, 1]])
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(attention_mask(pos, pos, docs, docs)[0, 0], want)


def test_plain_layouts_keep_the_batch_and_the_default_attention():
    x, y = torch.randint(0, 9, (2, 8)), torch.randint(0, 9, (2, 8))
    got_x, got_y, kwargs = sequence_inputs(SequenceSplit(), x, y)
    assert got_x is x and got_y is y and kwargs == {}


@pytest.mark.parametrize("eos_id", [None, 3])
def test_cp_shard_mask_is_the_full_mask_between_its_queries_and_the_gathered_keys(eos_id):
    cp, seq = 2, 16
    x = torch.randint(0, 6, (3, seq))
    y = torch.roll(x, -1, 1)
    full = attention_mask(torch.arange(seq), torch.arange(seq),
                          *([document_ids(x, eos_id)] * 2 if eos_id else []))  # fmt: skip
    keys = gathered_positions(seq, cp)
    for r in range(cp):
        mine = local_positions(seq, r, cp)
        lx, ly, kw = sequence_inputs(SequenceSplit(r, cp, eos_id), x, y)
        assert torch.equal(lx, x[:, mine]) and torch.equal(ly, y[:, mine])
        assert torch.equal(kw["positions"], mine.expand(3, -1))
        if eos_id is None:  # plain CP: the attention is causal chunk by chunk, no mask
            assert "attention_mask" not in kw
            continue
        assert kw["attention_mask"].shape == (3, 1, seq // cp, seq)
        assert torch.equal(kw["attention_mask"], full[:, :, mine][:, :, :, keys])


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_chunks_equal_full_causal_attention_of_the_ranks_queries(cp):
    """What every CP rank computes from its queries and the gathered (rank-major, KV-head)
    keys and values equals those queries' rows of one process's causal attention."""
    torch.manual_seed(0)
    seq = 16
    q, k, v = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8), torch.randn(2, 2, seq, 8)
    want = attend(q, k, v)  # one process: causal over the whole sequence
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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_permuted_tokens_with_their_positions_and_mask_give_the_same_logits(family):
    """What a CP rank computes, in one process: tokens in the CP order, RoPE at their global
    positions and the mask over the reordered keys give each token the logits it has in the
    plain causal model; an explicit causal mask equals the default."""
    torch.manual_seed(0)
    model = _tiny(family).eval()
    tokens = torch.randint(0, 64, (2, 16))
    order = gathered_positions(16, 2)
    with torch.no_grad():
        want = model(tokens)
        pos = torch.arange(16)
        masked = model(tokens, attention_mask=attention_mask(pos, pos).expand(2, -1, -1, -1))
        got = model(tokens[:, order], positions=order.expand(2, -1),
                    attention_mask=attention_mask(order, order).expand(2, -1, -1, -1))  # fmt: skip
    torch.testing.assert_close(masked, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want[:, order], rtol=1e-5, atol=1e-5)


def test_documents_do_not_see_each_other():
    """With document masking, a document's logits do not depend on the one before it."""
    torch.manual_seed(0)
    model, eos = _tiny("llama").eval(), 63
    a = torch.tensor([[5, 6, eos, 7, 8, 9, 10, 11]])
    b = torch.tensor([[1, 2, eos, 7, 8, 9, 10, 11]])  # another first document
    with torch.no_grad():
        outs = [model(t, **sequence_inputs(SequenceSplit(eos_id=eos), t, t)[2]) for t in (a, b)]
    torch.testing.assert_close(outs[0][:, 3:], outs[1][:, 3:])
    assert not torch.allclose(model(a)[:, 3:], model(b)[:, 3:])  # plain causal: they do


def test_a_model_without_the_shared_attention_core_is_refused():
    with pytest.raises(ValueError, match="no models.attention.ScaledDotProductAttention"):
        apply_context_parallel(nn.Sequential(nn.Linear(2, 2)), cp_mesh=None)


class SoftCappedCore(ScaledDotProductAttention):
    """A family's own attention math on the shared core's hook (what CP must not replace)."""

    def forward(self, q, k, v, mask=None):
        return attend(q, k, v, mask) * 0.5


class OwnCore(nn.Module):
    """Attention a family computes itself (Gemma 3's shape: some layers on their own core)."""

    def forward(self, q, k, v, mask=None):
        return attend(q, k, v, mask)


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

    register(dataclasses.replace(get_model_spec("llama3"), name="own_attention",
                                 model_cls=OwnAttentionLlama))  # fmt: skip
    try:
        argv = ["--config", "debug_model", "--model.name", "own_attention"]
        check_config(parse_args(argv), world_size=2)  # no CP: accepted
        with pytest.raises(ValueError, match=r"layers\.0\.attention\.core calls scaled_dot"):
            check_config(parse_args([*argv, "--parallelism.context_parallel_degree", "2"]), 2)
    finally:
        del MODELS["own_attention"]
