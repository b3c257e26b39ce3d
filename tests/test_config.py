"""Config loading: presets, overrides, --help, and every error path names the bad input."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import ConfigError, JobConfig, config_to_toml, help_text, parse_args
from config.loader import CONFIGS_DIR

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_preset_by_bare_name():
    cfg = parse_args(["--config", "debug_model"])
    assert cfg.model.flavor == "debugmodel"
    assert cfg.job.config_file.endswith("configs/debug_model.toml")
    assert parse_args(["--config", "debug_model.toml"]).training.seq_len == cfg.training.seq_len
    assert parse_args([]).training.steps == JobConfig().training.steps


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")))
def test_every_preset_loads(name):
    cfg = parse_args(["--config", name])
    assert cfg.model.name == "llama3"


def test_llama31_presets_scale_rope_unless_told_otherwise():
    from models import model_args_for

    for name in ("llama3_8b", "llama3_70b", "llama3_405b"):
        cfg = parse_args(["--config", name])
        assert model_args_for(cfg.model, 8192).use_scaled_rope, name  # Meta's 3.1 params.json
        cfg = parse_args(["--config", name, "--model.rope_scaling", "none"])  # Llama 3.0
        assert not model_args_for(cfg.model, 8192).use_scaled_rope, name
    debug = parse_args(["--config", "debug_model", "--model.rope_scaling", "llama3"])
    assert model_args_for(debug.model, 256).use_scaled_rope


def test_overrides_of_every_type():
    cfg = parse_args(
        [
            "--config",
            "debug_model",
            "--training.steps",
            "7",
            "--optimizer.lr=0.01",
            "--metrics.enable_tensorboard",
            "false",
            "--job.dry_run",
            "--compile.components",
            "model",
            "--optimizer.no_decay_patterns",
            '["norm", "bias"]',
            "--lr_scheduler.decay_ratio",
            "none",
        ]
    )
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == 0.01
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.job.dry_run is True
    assert cfg.compile.components == ["model"]
    assert cfg.optimizer.no_decay_patterns == ["norm", "bias"]
    assert cfg.lr_scheduler.decay_ratio is None


def test_int_is_accepted_for_float():
    assert parse_args(["--optimizer.lr", "1"]).optimizer.lr == 1.0


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--trainig.steps", "3"], "Did you mean 'training'"),
        (["--training.step", "3"], "Did you mean 'training.steps'"),
        (["--training.steps", "three"], "training.steps = 'three' is invalid: expected int"),
        (["--training.steps", "0"], "training.steps = 0 is out of range: must be >= 1"),
        (["--optimizer.lr", "-1"], "optimizer.lr = -1.0 is out of range: must be > 0"),
        (["--lr_scheduler.decay_type", "cosin"], "Did you mean 'cosine'"),
        (["--training.enable_cpu_offload", "maybe"], "expected bool"),
        (["--config", "nope_model"], "Config 'nope_model' not found"),
        (["--steps", "3"], "must name a section and a key"),
        (["steps"], "Unexpected argument 'steps'"),
        (
            ["--training.global_batch_size", "12", "--training.local_batch_size", "8"],
            "must be a multiple of training.local_batch_size",
        ),
        (
            [
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "x",
            ],
            "expected 'op' or a positive",
        ),
        (["--parallelism.context_parallel_degree", "2"], "context parallelism is reserved"),
        (["--training.dataset", "c4"], "training.dataset = 'c4' is invalid: expected one of"),
        (["--training.dataset", "jsonl"], "needs training.dataset_path"),
        (["--training.global_batch_size", "0"], "training.global_batch_size = 0: use -1"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "0"], "layers_per_stage = 0"),
        (
            ["--checkpoint.initial_load_path", "x", "--checkpoint.load_step", "3"],
            "checkpoint.initial_load_path, checkpoint.load_step set but checkpoint.enable = "
            "false, so nothing would be loaded",
        ),
        (
            ["--training.dataset", "jsonl", "--training.dataset_path", "a.jsonl"]
            + ["--validation.enable", "true"],
            "validation.enable with jsonl files needs validation.dataset_path",
        ),
        (
            ["--validation.enable", "true", "--validation.dataset", "text"],
            "validation.enable with text files needs validation.dataset_path",
        ),
    ],
)
def test_errors_name_the_key_and_value(argv, expected):
    with pytest.raises(ConfigError, match=None) as e:
        parse_args(argv)
    assert expected in str(e.value)


def test_toml_errors(tmp_path):
    bad_key = tmp_path / "bad.toml"
    bad_key.write_text("[training]\nbatch = 3\n")
    with pytest.raises(ConfigError, match=r"Unknown config key 'training.batch' in .*bad.toml"):
        parse_args(["--config", str(bad_key)])
    bad_type = tmp_path / "type.toml"
    bad_type.write_text('[training]\nsteps = "10"\n')
    with pytest.raises(ConfigError, match="training.steps = '10' is invalid"):
        parse_args(["--config", str(bad_type)])
    not_toml = tmp_path / "broken.toml"
    not_toml.write_text("[training\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_args(["--config", str(not_toml)])
    flat = tmp_path / "flat.toml"
    flat.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        parse_args(["--config", str(flat)])


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_args(["--config", "debug_model", "--training.steps", "11"])
    out = tmp_path / "resolved.toml"
    out.write_text(config_to_toml(cfg))
    again = parse_args(["--config", str(out)])
    assert again.training == cfg.training
    assert again.optimizer == cfg.optimizer
    assert again.lr_scheduler == cfg.lr_scheduler


def test_help_lists_every_option_with_default():
    text = help_text()
    cfg = JobConfig()
    for section in vars(cfg):
        for key, value in vars(getattr(cfg, section)).items():
            assert f"--{section}.{key} " in text
            assert f"default {value!r}" in text


def _train(*args, **kw):
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def test_train_cli_help_and_errors_before_any_work():
    out = _train("--help")
    assert out.returncode == 0 and "--training.local_batch_size" in out.stdout
    out = _train("--model.flavor", "9B")
    assert out.returncode == 2
    assert "model.flavor = '9B' is not a flavor of 'llama3'" in out.stderr
    out = _train("--model.dim", "100")
    assert out.returncode == 2
    assert "model shape: dim = 100 is not a multiple of n_heads = 16" in out.stderr
    out = _train("--training.dataset", "text", "--training.dataset_path", "/nonexistent/*.txt")
    assert out.returncode == 2
    assert "training.dataset_path: dataset_path '/nonexistent/*.txt' matches no text" in out.stderr
    if not torch.cuda.is_available():
        out = _train("--training.device", "cuda")
        assert out.returncode == 2 and "no CUDA device is visible" in out.stderr
    env = {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "localhost", "PATH": ""}
    out = _train("--parallelism.tensor_parallel_degree", "2", env=env)
    assert out.returncode == 2
    assert "World size 3 is not divisible" in out.stderr


def test_dry_run_405b_counts_parameters_in_seconds():
    out = _train("--config", "llama3_405b", "--job.dry_run", "true")
    assert out.returncode == 0, out.stderr
    count = int(out.stdout.split("parameters")[0].split(":")[-1].replace(",", "").strip())
    assert abs(count - 405.8e9) / 405.8e9 < 0.01
