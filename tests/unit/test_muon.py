"""Muon (training/muon.py) in one process: the same steps as torch.optim.Muon on the hidden
matrices beside torch.optim.AdamW on the rest, each `[optimizer]` muon_* key changing the
update, stacked experts and interleaved matrices orthogonalised one logical matrix at a time,
and the config checks. Every layout equal to one process: tests/integration/test_muon_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from job_config import ConfigError, parse_args
from models import get_model_spec
from models.contract import MatrixLayout, is_muon_matrix
from models.init_weights import init_weights
from models.llama3 import ModelArgs, Transformer
from training.loss import cross_entropy_sum
from training.muon import newton_schulz, orthogonalise, update_scale
from training.muon_exchange import Piece, ShardGroup
from training.optimizer import build_optimizer, no_decay_patterns

COEF = (3.4445, -4.7750, 2.0315)


def _model(seed=0):
    with torch.device("meta"):
        m = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                  multiple_of=16, max_seq_len=16))  # fmt: skip
    m.to_empty(device="cpu")
    init_weights(m, seed)
    m.init_buffers("cpu")
    return m


def _train(model, optimizers, steps=4):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 17))
        (cross_entropy_sum(model(x[:, :-1]), x[:, 1:]) / x[:, 1:].numel()).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def _muon(model, *args):
    cfg = parse_args(["--optimizer.name", "Muon", "--optimizer.lr", "0.01", *args])
    spec = get_model_spec("llama3")
    return build_optimizer([model], cfg.optimizer, "cpu", no_decay_patterns(cfg), spec=spec), cfg


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
def test_one_process_equals_torch_muon_beside_adamw(scale):
    """The block matrices take torch.optim.Muon's steps (bfloat16 Newton-Schulz, Nesterov),
    the embeddings, output layer and norms torch.optim.AdamW's with the no-decay groups."""
    model, ref = _model(), _model()
    opt, cfg = _muon(model, "--optimizer.muon_update_scale", scale,
                     "--optimizer.muon_lr", "0.02")  # fmt: skip
    spec, o = get_model_spec("llama3"), cfg.optimizer
    named = list(ref.named_parameters())
    mats = [p for n, p in named if is_muon_matrix(spec, n, p.ndim)]
    muon_names = [n for n, p in named if is_muon_matrix(spec, n, p.ndim)]
    assert len(mats) == 2 * 7 and all(n.startswith("layers.") for n in muon_names)
    rest = [(n, p) for n, p in named if n not in muon_names]
    no_decay = no_decay_patterns(cfg)
    groups = [{"params": [p for n, p in rest if not any(s in n for s in no_decay)]},
              {"params": [p for n, p in rest if any(s in n for s in no_decay)],
               "weight_decay": 0.0}]  # fmt: skip
    torch_opts = [
        torch.optim.Muon(mats, lr=0.02, weight_decay=o.weight_decay, adjust_lr_fn=scale),
        torch.optim.AdamW(groups, lr=0.01, betas=(o.beta1, o.beta2), eps=o.eps,
                          weight_decay=o.weight_decay, fused=True),
    ]  # fmt: skip
    _train(model, [opt])
    _train(ref, torch_opts)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert "Muon on 14 matrices" in opt.describe()


# key -> a value other than the default: each must change the trained weights
OPTION_VALUES = {
    "muon_lr": "0.05",
    "muon_momentum": "0.5",
    "muon_nesterov": "false",
    "muon_ns_steps": "2",
    "muon_ns_coefficients": "[3.0, -3.2, 1.2]",
    "muon_update_scale": "original",
    "muon_ns_dtype": "float32",
}


@pytest.mark.parametrize("key", list(OPTION_VALUES))
def test_each_muon_option_changes_the_update(key):
    base, changed = _model(), _model()
    _train(base, [_muon(base)[0]])
    _train(changed, [_muon(changed, f"--optimizer.{key}", OPTION_VALUES[key])[0]])
    diff = max((a - b).abs().max().item()
               for a, b in zip(base.parameters(), changed.parameters()))  # fmt: skip
    assert diff > 1e-6, f"optimizer.{key} changed nothing"


def test_each_expert_and_interleaved_matrix_alone():
    """A stack [E, a, b] is E matrices; an interleaved weight (gpt-oss's gate_up_proj, gate and
    up columns alternating) is two per expert: each equals Newton-Schulz of that matrix alone."""
    u = torch.randn(3, 8, 12, dtype=torch.float64)
    stacked = orthogonalise(u, MatrixLayout(), COEF, 5, torch.float64)
    for e in range(3):
        torch.testing.assert_close(stacked[e], newton_schulz(u[e], COEF, 5, torch.float64))
    both = orthogonalise(u, MatrixLayout(interleaved=2), COEF, 5, torch.float64)
    for e in range(3):
        for j in range(2):
            alone = newton_schulz(u[e][:, j::2], COEF, 5, torch.float64)
            torch.testing.assert_close(both[e][:, j::2], alone)
    # orthogonal (up to NS's own approximation): singular values near 1, unlike the input's
    s = torch.linalg.svdvals(stacked[0])
    assert s.min() > 0.5 and s.max() < 1.5 and torch.linalg.svdvals(u[0]).max() > 2


def test_update_scale_reads_the_logical_matrix():
    """gpt-oss's gate_up_proj [E, in 4, out 2 x 6]: two [6 out, 4 in] matrices."""
    layout = MatrixLayout(interleaved=2, rows_last=True)
    assert update_scale(torch.Size([2, 4, 12]), layout, "original") == math.sqrt(6 / 4)
    assert update_scale(torch.Size([2, 4, 12]), MatrixLayout(), "original") == 1.0
    assert update_scale(torch.Size([6, 4]), MatrixLayout(), "match_rms_adamw") == 0.2 * math.sqrt(6)
    spec = get_model_spec("gpt_oss")
    assert spec.matrix_layouts["gate_up_proj"] == layout


def test_muon_keys_are_refused_without_muon_and_coefficients_need_three():
    with pytest.raises(ConfigError, match="optimizer.muon_momentum"):
        parse_args(["--optimizer.muon_momentum", "0.9"])
    with pytest.raises(ConfigError, match="muon_ns_coefficients"):
        parse_args(["--optimizer.name", "Muon", "--optimizer.muon_ns_coefficients", "[1.0, 2.0]"])


def test_state_is_one_buffer_per_matrix_and_adamw_states_for_the_rest():
    model = _model()
    opt = _muon(model)[0]
    _train(model, [opt], steps=1)
    state = opt.state_dict()["state"].values()
    bufs = [s for s in state if set(s) == {"momentum_buffer"}]
    adam = [s for s in state if set(s) == {"step", "exp_avg", "exp_avg_sq"}]
    assert len(bufs) == 14 and len(adam) == len(list(model.parameters())) - 14


def test_owner_computes_receives_two_over_w_of_gathering_everywhere():
    """Per rank and step: its owned matrices' other pieces plus its own pieces of the others'
    results. Two [8, 6] matrices over 2 ranks move what an all-gather would; four over 4 half."""
    for w in (2, 4):
        rows = 8 // w
        pieces = [[Piece((rows, 6), (r * rows, 0)) for r in range(w)] for _ in range(w)]
        g = ShardGroup(None, 0, w, params=[torch.empty(8, 6)] * w, owners=list(range(w)),
                       pieces=pieces)  # fmt: skip
        ours, everywhere = g.received()
        assert everywhere == w * (48 - 6 * rows)
        assert ours == (w - 1) * 6 * rows + (w - 1) * 6 * rows
        assert ours / everywhere == 2 / w
