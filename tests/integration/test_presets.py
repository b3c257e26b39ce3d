"""Every preset in `configs/` trains as it ships: its exact feature set (family and tied or
untied output, TP / PP and its schedule / CP / EP, ZeRO stage, AC mode and option, compile
components, mixed precision, document masking, checkpointing) on the smallest degrees that
keep each feature on and a tiny shape (`scripts/scaled_preset.py`), 6 steps: the loss is
finite and falls, and the run built the layout the preset asks for. A preset added later is
picked up here by its file.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from dist_utils import ROOT, Run
from parity import assert_layout, moe_local_blocks

from scripts.scaled_preset import STEPS, scaled_preset

PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))


def _layers(args: list[str]) -> int:
    return int(args[args.index("--model.n_layers") + 1])


def pool_runs(selected):
    todo = []
    wanted = {item.callspec.params["name"] for item in selected if hasattr(item, "callspec")}
    for name in sorted(wanted):
        nproc, args = scaled_preset(name)
        assert args[:2] == ["--config", name]
        todo.append(Run(name, nproc, args[2:], config=name))
    return todo


def test_every_family_ships_a_preset():
    from models import all_model_specs

    names = {_preset(p).model.name for p in PRESETS}
    families = set(all_model_specs())
    assert families <= names, f"families without a preset: {sorted(families - names)}"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_as_it_ships(runs, name):
    run = runs[name].check()
    args = ["--config", name, *run.args]
    layers = _layers(args)
    assert_layout(run.folder, run.nproc, args, layers, moe_local_blocks(run.nproc, args, layers))
    losses = run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[STEPS] < losses[1] - 0.1, f"the loss does not fall: {losses}"
    saved = Path(run.folder, "checkpoint", f"step-{STEPS}").is_dir()
    assert saved == _preset(name).checkpoint.enable, "checkpointing as the preset sets it"


def _preset(name: str):
    from job_config import parse_args

    return parse_args(["--config", name], check=False)
