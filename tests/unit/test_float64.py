"""The float64 mode (`training.mixed_precision_param = "float64"`, docs/parity.md), in this
process: the dtypes it resolves to, and that a float64 model of every family computes its
forward, loss, backward and gradient norm in float64 throughout (one float32 rounding
anywhere would put 1e-7 noise back into the layouts' comparison). The parity of layouts in
float64 is tests/integration/test_fp64_parity.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from job_config import parse_args
from models import get_model_spec, model_args_for
from models.init_weights import materialize
from models.mixed_precision import in_weight_dtype, mixed_precision_dtypes, weight_dtype
from training.loss import StepLoss, cross_entropy_sum
from training.step import StepSetup, clip_grad_norm_, train_step

F64 = ["--training.mixed_precision_param", "float64"]
TINY = ["--config", "tests/tiny_model.toml", "--training.seq_len", "16"]
FAMILIES = {
    "llama3": [],
    "qwen3": ["--model.name", "qwen3"],
    "gemma2": ["--model.name", "gemma2"],  # soft-caps, a window (12) inside the 16 tokens
    "qwen3_moe": ["--model.name", "qwen3_moe", "--moe.aux_loss_coeff", "0.01",
                  "--moe.z_loss_coeff", "0.001", "--moe.bias_update_rate", "0.001"],
}  # fmt: skip


@pytest.mark.parametrize(
    "args,want",
    [
        ([], (torch.float32, torch.float32)),  # auto on CPU
        (F64, (torch.float64, torch.float64)),  # the reduction follows the weights
        ([*F64, "--training.mixed_precision_reduce", "float32"], (torch.float64, torch.float32)),
        (["--training.mixed_precision_param", "bfloat16"], (torch.bfloat16, torch.float32)),
    ],
)
def test_float64_mode_dtypes(args, want):
    cfg = parse_args([*TINY, "--training.mixed_precision_param", "auto", *args])
    assert mixed_precision_dtypes(cfg.training, "cpu") == want
    assert weight_dtype(cfg.training) == max(want[0], torch.float32, key=lambda d: d.itemsize)


class _FloatDtypes(TorchDispatchMode):
    """Records the floating-point dtypes of every tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.seen: dict[torch.dtype, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen.setdefault(t.dtype, set()).add(str(func))
        return out


def _model(cfg):
    args = model_args_for(cfg, cfg.training.seq_len, 256)
    with torch.device("meta"):
        model = in_weight_dtype(get_model_spec(cfg.model.name).model_cls(args), cfg.training)
    return materialize(model, cfg.debug.seed, "cpu").train()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_model_computes_in_float64_only(family):
    cfg = parse_args([*TINY, *FAMILIES[family], *F64])
    model = _model(cfg)
    # initialised in float32, then cast: the float32 run's weights exactly
    fp32 = _model(parse_args([*TINY, *FAMILIES[family]]))
    for (name, p), q in zip(model.named_parameters(), fp32.parameters()):
        assert p.dtype == torch.float64 and torch.equal(p, q.double()), name
    assert all(b.dtype == torch.float64 for b in model.buffers() if b.is_floating_point())
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    with _FloatDtypes() as mode:
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norm = clip_grad_norm_(list(model.parameters()), 1.0)
    assert set(mode.seen) == {torch.float64}, {d: sorted(f)[:5] for d, f in mode.seen.items()}
    assert loss.dtype == norm.dtype == torch.float64


def test_train_step_returns_the_float64_loss():
    """The step's loss is summed over micro-steps in the loss's dtype (an in-place sum into a
    float32 zero would round the logged float64 loss)."""
    model = _model(parse_args([*TINY, *F64]))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    micro = [(tokens[:1, :-1], tokens[:1, 1:], {}), (tokens[1:, :-1], tokens[1:, 1:], {})]
    loss = train_step(StepSetup([model], StepLoss(cross_entropy_sum)), micro)
    want = sum(cross_entropy_sum(model(x), y).detach() for x, y, _ in micro) / 32  # exact: 2^5
    assert loss.dtype == torch.float64 and loss.item() == want.item()
