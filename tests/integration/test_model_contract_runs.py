"""The model contract in real processes: TP plan gaps are named at parallelize time on 2
ranks, and a family registered outside the tree (`job.custom_import`) trains through
train.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from dist_utils import ROOT, TINY_CONFIG, Run, spawn

from models.qwen3 import Qwen3, Qwen3Args


def _tp_gap(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from models.qwen3.plan import qwen3_tp_plan
    from models.tp_plan import TPPlan
    from parallelisms.parallel_dims import ParallelismError
    from parallelisms.tensor_parallel import apply_tp

    mesh = init_device_mesh("cpu", (world,))
    args = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
                     vocab_size=256)  # fmt: skip
    full = qwen3_tp_plan(loss_parallel=True)
    block = {k: v for k, v in full.block.items() if not k.endswith("_norm")}
    with torch.device("meta"):
        model = Qwen3(args)
    with pytest.raises(ParallelismError) as e:
        apply_tp(model, mesh, TPPlan(full.root, block))
    for name in ("layers.0.attention.q_norm.weight", "layers.1.ffn_norm.weight"):
        assert name in str(e.value)
    with torch.device("meta"):
        model = Qwen3(args)
    apply_tp(model, mesh, full)  # the family's plan covers every parameter


def test_tp_plan_gaps_are_named_at_parallelize_time():
    spawn(_tp_gap, 2)


FAMILY = '''
"""A family outside the meshtrain tree: Llama's model under another name and flavor."""
from models import ModelSpec, register
from models.llama3 import ModelArgs, Transformer
from models.llama3.plan import llama_tp_plan

register(ModelSpec("outside", Transformer, {"small": ModelArgs(dim=64, n_layers=2, n_heads=4,
         n_kv_heads=2, vocab_size=4096)}, tp_plan=llama_tp_plan))
'''


def test_a_family_registered_outside_the_tree_trains(tmp_path, pool):
    package = tmp_path / "elsewhere" / "outside_family"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAMILY))
    family = ["--job.custom_import", str(package), "--model.name", "outside",
              "--model.flavor", "small"]  # fmt: skip
    trains = Run("outside", 2, [*family, "--training.steps", "3", "--training.local_batch_size",
                                "4", "--checkpoint.enable", "--checkpoint.interval", "3"])  # fmt: skip
    bad = Run("bad", 1, ["--job.custom_import", str(tmp_path / "nowhere.py"), "--model.name",
                         "outside"])  # fmt: skip
    done = pool.launch(__name__, [trains, bad])
    run = done["outside"].check()
    log = (run.folder / "logs" / "rank_0.log").read_text()
    assert "model outside small:" in log and "step 3 |" in log
    # the scripts honour job.custom_import too: the estimator plans the family, and the
    # conversion finds it (and refuses it by name: it gives no Hugging Face adapter)
    plan = subprocess.run(
        [sys.executable, "scripts/estimate.py", "--config", str(TINY_CONFIG), *family,
         "--world-size", "2", "--device-type", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0 and "rank" in plan.stdout, plan.stdout[-2000:] + plan.stderr
    ckpt = next((run.folder / "checkpoint").glob("step-*"))
    export = subprocess.run(
        [sys.executable, "scripts/convert_to_hf.py", str(ckpt), str(tmp_path / "hf"),
         "--job.custom_import", str(package)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "model family 'outside' has no Hugging Face adapter" in export.stderr, export.stderr
    assert done["bad"].returncode == 2 and "job.custom_import" in done["bad"].output


def test_importing_the_contract_or_a_parallelism_registers_no_family():
    """Each family registers itself from its own package, when first asked for: importing the
    contract, the registry or a parallelism imports none of them, nor the config loader."""
    code = (
        "import sys, models, models.contract, parallelisms.decoder, parallelisms.fsdp\n"
        "from models.contract import MODELS\n"
        "loaded = [m for m in sys.modules if m.split('.')[:2] in "
        "[['models', f] for f in models.builtin_families()]]\n"
        "assert not MODELS and not loaded, (MODELS, loaded)\n"
        "assert 'job_config.loader' not in sys.modules, 'a parallelism loaded the config loader'\n"
        "assert models.get_model_spec('qwen3_moe').routing is not None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
