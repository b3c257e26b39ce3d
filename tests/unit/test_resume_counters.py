"""What `checkpoint/state.py` saves comes back on resume: every component, checked on one
process against the state the saving run held."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from option_probes import (
    Case,
    base_argv,
    real_parts,
    tokenizer,
)

from checkpoint.state import COMPONENTS
from job_config import parse_args
from training.loop import TrainState
from training.trainer import (
    build_checkpointer,
    build_loaders,
    build_optimizers,
)

pytestmark = pytest.mark.usefixtures("private_token_cache")


def test_resume_restores_every_counter(option_files, tmp_path):
    """A run saves after 3 steps of real training; a fresh run built from the same config
    resumes and must hold every saved component as it was (`checkpoint.state.COMPONENTS`):
    weights, optimizer state (step counts, moments), LR schedule position, data loader
    position (its next batch), step and tokens seen, and the RNG streams.

    The launches of tests/integration/test_checkpoint_train.py (test_exact_resume_with_async_saves)
    and tests/integration/test_checkpoint.py (test_resume_continues_bit_identically) show a
    resumed run's losses, gradient norms and weights continue exactly, which needs the model,
    optimizer, schedule, loader position and step; they cannot see tokens_seen (a logged count)
    or the RNG streams (dropout-free training draws nothing after the initialisation)."""
    assert COMPONENTS == ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
    argv = base_argv(option_files, tmp_path) + [
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
    ]
    case = Case(parse_args(argv), argv, tmp_path)
    want = _train_three_steps_and_save(case)

    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # the resumed run's own seeds
    parts2 = real_parts(Case(parse_args(argv + ["--debug.seed", "5"]), argv, tmp_path))
    opt2, sched2 = build_optimizers(case.cfg, parts2, "cpu")
    loader2, _ = build_loaders(case.cfg, tokenizer(case), 0, 1)
    state2 = TrainState()
    manager2 = build_checkpointer(case.cfg, None, parts2, opt2, sched2, loader2, state2)
    got_rng = (random.random(), np.random.rand(), torch.rand(1))
    manager2.close()
    params2 = list(parts2[0].parameters())
    assert (state2.step, state2.tokens_seen) == want["counters"] == (3, 3 * 4 * 32)
    assert all(torch.equal(a, b) for a, b in zip(params2, want["weights"]))
    assert all(torch.equal(opt2.state[p]["exp_avg"], m) for p, m in zip(params2, want["moments"]))
    assert [float(opt2.state[p]["step"]) for p in params2] == want["optimizer_steps"]
    assert sched2.last_epoch == want["schedule_step"] == 3
    assert sched2.get_last_lr() == want["lr"]
    assert opt2.param_groups[0]["lr"] == want["lr"][0]
    assert torch.equal(next(iter(loader2))[0], want["next_batch"])
    assert got_rng[:2] == want["rng"][:2] and torch.equal(got_rng[2], want["rng"][2])


def _train_three_steps_and_save(case: Case) -> dict:
    """Three steps of real training, a save at step 3, and what the resumed run must hold."""
    parts = real_parts(case)
    opt, sched = build_optimizers(case.cfg, parts, "cpu")
    loader, _ = build_loaders(case.cfg, tokenizer(case), 0, 1)
    data = iter(loader)
    state = TrainState()
    manager = build_checkpointer(case.cfg, None, parts, opt, sched, loader, state)
    for _ in range(3):
        inputs, labels = next(data)
        state.step += 1
        state.tokens_seen += inputs.numel()
        torch.nn.functional.cross_entropy(
            parts[0](inputs).flatten(0, 1), labels.flatten()
        ).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    manager.maybe_save(3)
    manager.close()
    want = {
        "weights": [p.detach().clone() for p in parts[0].parameters()],
        "moments": [opt.state[p]["exp_avg"].clone() for p in parts[0].parameters()],
        "optimizer_steps": [float(opt.state[p]["step"]) for p in parts[0].parameters()],
        "lr": sched.get_last_lr(),
        "schedule_step": sched.last_epoch,
        "next_batch": next(data)[0],
        "counters": (state.step, state.tokens_seen),
        "rng": (random.random(), np.random.rand(), torch.rand(1)),
    }
    return want
