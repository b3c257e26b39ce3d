"""CheckpointManager in one process: exact round trips (sync and async), atomic commits,
discovery, keep_latest_k, mismatch messages, exclusions, several model parts, checkpoint_info."""

import copy
import dataclasses
import importlib.util
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from checkpoint.manager import CheckpointManager
from checkpoint.storage import (
    CheckpointError,
    commit,
    list_checkpoints,
    prepare_tmp,
    read_layout,
    step_dir,
)
from job_config import JobConfig
from models.init_weights import init_weights
from models.llama3.model import ModelArgs, Transformer
from training.optimizer import build_lr_scheduler, build_optimizer, no_decay_patterns

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@dataclass
class Progress:
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, s):
        self.step, self.tokens_seen = s["step"], s["tokens_seen"]


class Loader:
    """Stands in for the data loader: its state is a global position plus a cursor dict."""

    def __init__(self):
        self.position, self.cursor = 0, {}

    def state_dict(self):
        return {"consumed_sequences": self.position, "cursor": dict(self.cursor)}

    def load_state_dict(self, s):
        self.position, self.cursor = s["consumed_sequences"], s["cursor"]


def make_cfg(dump: Path, **ckpt) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump)
    cfg.training.steps = 6
    cfg.lr_scheduler.warmup_steps = 2
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = 2
    for k, v in ckpt.items():
        setattr(cfg.checkpoint, k, v)
    return cfg


def make_model(n_layers=2, dim=64, seed=1):
    args = ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=64,
        max_seq_len=16,
    )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    model.init_buffers("cpu")
    return model


class Run:
    """A model with optimizer, schedule, loader and progress, driven like the trainer."""

    def __init__(self, cfg, parts=None, **model_kw):
        self.cfg = cfg
        self.parts = parts or [make_model(**model_kw)]
        self.opt = build_optimizer(self.parts, cfg.optimizer, "cpu", no_decay_patterns(cfg))
        self.sched = build_lr_scheduler(self.opt, cfg.lr_scheduler, cfg.training.steps)
        self.loader, self.progress = Loader(), Progress()
        self.ckpt = CheckpointManager(
            cfg,
            model_parts=self.parts,
            optimizer=self.opt,
            lr_scheduler=self.sched,
            dataloader=self.loader,
            train_state=self.progress,
        )

    def forward(self, tokens):
        h = tokens
        for part in self.parts:
            h = part(h)
        return h

    def train(self, until: int, save: bool = True) -> list[float]:
        losses = []
        while self.progress.step < until:
            self.progress.step += 1
            gen = torch.Generator().manual_seed(self.progress.step)
            tokens = torch.randint(0, 96, (2, 16), generator=gen)
            loss = self.forward(tokens).float().square().mean()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.loader.position += 2
            self.loader.cursor = {"epoch": 0, "offset": self.loader.position * 16}
            self.progress.tokens_seen += 32
            losses.append(loss.item())
            if save:
                self.ckpt.maybe_save(self.progress.step)
        return losses


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_exact_round_trip_and_keep_latest_k(tmp_path, mode):
    cfg = make_cfg(tmp_path, async_mode=mode, keep_latest_k=2)
    ref = Run(cfg)
    assert ref.ckpt.load() is False
    ref.train(6)
    ref.ckpt.close()
    folder = tmp_path / "checkpoint"
    assert [s for s, _ in list_checkpoints(folder)] == [4, 6]
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-6"]
    layout = read_layout(folder / "step-6")
    assert layout["async_mode"] == mode and layout["train_state"]["step"] == 6

    again = Run(cfg)
    assert again.ckpt.load() is True
    assert again.progress.state_dict() == ref.progress.state_dict()
    assert again.loader.state_dict() == ref.loader.state_dict()
    assert again.sched.state_dict() == ref.sched.state_dict()
    for k, v in params(ref.parts[0]).items():
        assert torch.equal(v, params(again.parts[0])[k]), k
    a, b = ref.opt.state_dict(), again.opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, st in a["state"].items():
        for name, t in st.items():
            assert torch.equal(t, b["state"][i][name]), (i, name)


def test_resume_continues_bit_identically(tmp_path):
    cfg = make_cfg(tmp_path / "a", async_mode="async")
    cfg.training.steps = 8
    full = Run(cfg)
    full.ckpt.load()
    losses = full.train(8, save=False)
    first = Run(cfg)
    first.ckpt.load()
    assert first.train(4) == losses[:4]
    first.ckpt.close()
    second = Run(cfg)
    assert second.ckpt.load() and second.progress.step == 4
    assert second.train(8) == losses[4:]
    second.ckpt.close()


class Captured(logging.Handler):
    """Collects the meshtrain logger's messages (it may not propagate to pytest's capture)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("meshtrain").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("meshtrain").removeHandler(self)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def test_incomplete_checkpoints_are_ignored_with_a_warning(tmp_path):
    cfg = make_cfg(tmp_path)
    run = Run(cfg)
    run.train(4)  # step-2, step-4
    folder = tmp_path / "checkpoint"
    (folder / "step-6.tmp").mkdir()  # a killed save
    (folder / "step-6.tmp" / "__0_0.distcp").write_bytes(b"partial")
    broken = folder / "step-8"  # a folder without the layout file: never committed
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"x")
    with Captured() as log:
        again = Run(cfg)
        assert again.ckpt.load() and again.progress.step == 4
    text = log.text
    assert "step-6.tmp" in text and "step-8" in text and "incomplete" in text
    # the next successful save removes leftovers of interrupted saves
    again.train(6)
    assert not (folder / "step-6.tmp").exists()


def test_commit_never_replaces_a_saved_checkpoint(tmp_path):
    final = step_dir(tmp_path, 3)
    for marker in ("old", "new"):
        tmp = prepare_tmp(final)
        (tmp / ".metadata").write_text(marker)
        commit(tmp, final, {"step": 3})
    assert (final / ".metadata").read_text() == "new"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("step-3.replaced-")]
    assert len(kept) == 1 and (kept[0] / ".metadata").read_text() == "old"
    with pytest.raises(CheckpointError, match="did not finish"):
        commit(prepare_tmp(step_dir(tmp_path, 5)), step_dir(tmp_path, 5), {"step": 5})
    assert not step_dir(tmp_path, 5).exists()


def test_mismatch_is_one_message_listing_everything(tmp_path):
    cfg = make_cfg(tmp_path)
    Run(cfg).train(2)
    bigger = Run(cfg, n_layers=3)
    with pytest.raises(CheckpointError) as e:
        bigger.ckpt.load()
    msg = str(e.value)
    assert "does not fit" in msg and "9 missing from the checkpoint" in msg
    assert "model.layers.2.attention.wq.weight" in msg
    assert "optimizer.state" not in msg  # implied by the missing weights
    smaller = Run(cfg, n_layers=1, dim=32)
    with pytest.raises(CheckpointError) as e:
        smaller.ckpt.load()
    msg = str(e.value)
    assert "in the checkpoint but not in the model" in msg and "model.layers.1." in msg
    assert "model.tok_embeddings.weight: checkpoint [96, 64] vs model [96, 32]" in msg
    assert smaller.progress.step == 0


def test_weights_of_a_differently_computing_model_are_refused(tmp_path):
    """Same shapes, other RoPE: Llama 3.1 weights loaded without their frequency scaling."""
    cfg = make_cfg(tmp_path)
    Run(cfg).train(2)
    other = Run(cfg)
    other.parts[0].args = dataclasses.replace(other.parts[0].args, use_scaled_rope=True)
    with pytest.raises(CheckpointError, match="use_scaled_rope: checkpoint False vs model True"):
        other.ckpt.load()
    assert other.progress.step == 0
    assert Run(cfg).ckpt.load()  # the same arguments load


def test_load_step_exclusions_and_initial_load(tmp_path):
    cfg = make_cfg(tmp_path / "src")
    src = Run(cfg)
    src.train(4)
    at4 = Run(make_cfg(tmp_path / "src", load_step=4))
    at4.ckpt.load()
    assert at4.progress.step == 4 and at4.loader.position == 8
    with pytest.raises(CheckpointError, match="no complete checkpoint step-3.*2, 4"):
        Run(make_cfg(tmp_path / "src", load_step=3)).ckpt.load()
    # rolling back below the newest would mix two histories in one folder: refused, with
    # the two ways out; once the later ones are moved aside, load_step 2 resumes there
    with pytest.raises(CheckpointError, match=r"later checkpoints \(step-4\).*step-4.abandoned"):
        Run(make_cfg(tmp_path / "src", load_step=2)).ckpt.load()
    assert sorted(p.name for p in (tmp_path / "src/checkpoint").iterdir()) == ["step-2", "step-4"]
    shutil.copytree(tmp_path / "src/checkpoint", tmp_path / "keep")
    (tmp_path / "src/checkpoint/step-4").rename(tmp_path / "src/checkpoint/step-4.abandoned")
    at2 = Run(make_cfg(tmp_path / "src", load_step=2))
    at2.ckpt.load()
    assert at2.progress.step == 2 and at2.loader.position == 4
    shutil.rmtree(tmp_path / "src/checkpoint")
    (tmp_path / "keep").rename(tmp_path / "src/checkpoint")

    partial = Run(make_cfg(tmp_path / "src", exclude_from_loading=["dataloader", "optimizer"]))
    partial.ckpt.load()
    assert partial.progress.step == 4 and partial.loader.position == 0
    assert not partial.opt.state  # optimizer left fresh
    for k, v in params(src.parts[0]).items():
        assert torch.equal(v, params(partial.parts[0])[k])

    # a new run folder with no checkpoint starts from the weights of initial_load_path only
    fresh = Run(make_cfg(tmp_path / "new", initial_load_path=str(tmp_path / "src/checkpoint")))
    assert fresh.ckpt.load()
    assert fresh.progress.step == 0 and not fresh.opt.state
    for k, v in params(src.parts[0]).items():
        assert torch.equal(v, params(fresh.parts[0])[k])
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        Run(make_cfg(tmp_path / "new2", initial_load_path=str(tmp_path / "nowhere"))).ckpt.load()


def split_in_two(model):
    """Two pipeline-stage-like parts of one model: FQNs stay those of the full model."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    del a.layers["1"]
    a.norm = a.output = None
    del b.layers["0"]
    b.tok_embeddings = None
    return [a, b]


def test_several_model_parts_share_the_plain_model_fqns(tmp_path):
    cfg = make_cfg(tmp_path)
    staged = Run(cfg, parts=split_in_two(make_model()))
    staged.train(2)  # step-2 saved from two parts with one optimizer
    whole = Run(make_cfg(tmp_path))
    assert whole.ckpt.load() and whole.progress.step == 2
    merged = {**params(staged.parts[0]), **params(staged.parts[1])}
    assert merged.keys() == params(whole.parts[0]).keys()
    for k, v in merged.items():
        assert torch.equal(v, params(whole.parts[0])[k]), k
    # and back: a whole-model checkpoint loads into two parts, training continues identically
    back = Run(make_cfg(tmp_path), parts=split_in_two(make_model(seed=7)))
    back.ckpt.load()
    assert back.train(4, save=False) == whole.train(4, save=False)


def test_checkpoint_info_describes_a_checkpoint(tmp_path, capsys):
    run = Run(make_cfg(tmp_path))
    run.train(2)
    spec = importlib.util.spec_from_file_location("ci", ROOT / "scripts" / "checkpoint_info.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path / "checkpoint")]) == 0
    out = capsys.readouterr().out
    assert "step: 2" in out and "saved with: world_size=1" in out
    assert "model.layers.0.attention.wq.weight" in out and "[64, 64]" in out and "float32" in out
    assert "train state: step=2, tokens_seen=64" in out
    assert "consumed_sequences': 4" in out
    total = sum(p.numel() * 4 for p in run.parts[0].parameters()) * 3  # weights + 2 Adam moments
    assert f"{total + 4 * len(list(run.parts[0].parameters()))} bytes" in out  # + Adam steps


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_save_off_the_interval(tmp_path, mode):
    """`save(step)` (used when a stop is requested) writes a full checkpoint at any step."""
    run = Run(make_cfg(tmp_path, async_mode=mode, interval=100))
    run.train(3)
    assert not (tmp_path / "checkpoint").exists()
    run.ckpt.save(3)
    run.ckpt.close()
    again = Run(make_cfg(tmp_path))
    assert again.ckpt.load() and again.progress.step == 3 and again.loader.position == 6


def test_keep_latest_k_never_deletes_the_checkpoint_just_saved(tmp_path):
    Run(make_cfg(tmp_path)).train(6)  # step-2, step-4, step-6
    # a step-2 copy resumed into a folder whose newer checkpoints were left there by hand
    shutil.copytree(tmp_path / "checkpoint/step-2", tmp_path / "copy/checkpoint/step-2")
    older = Run(make_cfg(tmp_path / "copy", keep_latest_k=2, interval=3))
    older.ckpt.load()
    for step in (4, 6):
        shutil.copytree(
            tmp_path / f"checkpoint/step-{step}", tmp_path / f"copy/checkpoint/step-{step}"
        )
    older.train(3)  # saves step-3, older than the two newest
    names = sorted(p.name for p in (tmp_path / "copy/checkpoint").iterdir())
    assert names == ["step-3", "step-4", "step-6"]


def test_optimizer_step_waits_for_the_async_copy(tmp_path, monkeypatch):
    """With async staging the copy of the weights runs in the background; the optimizer's next
    step waits for it (the checkpointer's step pre-hook), so a checkpoint holds the weights of
    the step it names even when the copy is slower than a training step."""
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor

    from checkpoint.hf import read_dcp_model

    run = Run(make_cfg(tmp_path, async_mode="async_with_pinned_mem", interval=100))
    run.train(1, save=False)
    real_stage, pool = run.ckpt.stager.stage, ThreadPoolExecutor(1)
    stepped = threading.Event()
    run.opt.register_step_post_hook(lambda *_: stepped.set())

    def slow_stage(state_dict, **kwargs):
        # The copy starts once an optimizer step has finished, or after 2 s: a step that does
        # not wait for the copy then always lands in it, whatever the machine's speed.
        def copy_later():
            stepped.wait(timeout=2.0)
            out = real_stage(state_dict, **kwargs)
            return out.result() if isinstance(out, Future) else out

        return pool.submit(copy_later)

    monkeypatch.setattr(run.ckpt.stager, "stage", slow_stage)
    before = params(run.parts[0])
    stepped.clear()
    run.ckpt.save(1)
    run.train(2, save=False)
    run.ckpt.close()
    pool.shutdown()
    saved = read_dcp_model(tmp_path / "checkpoint" / "step-1")
    assert sorted(saved) == sorted(before)
    changed = [k for k, v in params(run.parts[0]).items() if not torch.equal(v, before[k])]
    assert changed, "training did not change the weights: the test would prove nothing"
    for name, value in before.items():
        assert torch.equal(saved[name], value), f"{name} was saved after the optimizer changed it"
