"""Config loading: presets, overrides, --help, and every error path names the bad input."""

import re
from pathlib import Path

import pytest

from job_config import ConfigError, JobConfig, config_notes, config_to_toml, help_text, parse_args
from job_config.loader import CONFIGS_DIR
from job_config.schema import config_sections
from models import all_model_specs, get_model_spec

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_preset_by_bare_name():
    cfg = parse_args(["--config", "debug_model"])
    assert cfg.model.flavor == "debugmodel"
    assert cfg.job.config_file.endswith("configs/debug_model.toml")
    assert parse_args(["--config", "debug_model.toml"]).training.seq_len == cfg.training.seq_len
    assert parse_args([]).training.steps == JobConfig().training.steps


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS_DIR.glob("*.toml")))
def test_every_preset_loads(name):
    cfg = parse_args(["--config", name])
    assert cfg.model.flavor in get_model_spec(cfg.model.name).flavors


def test_llama31_presets_scale_rope_unless_told_otherwise():
    from models import model_args_for

    for name in ("llama3_8b", "llama3_70b", "llama3_405b"):
        cfg = parse_args(["--config", name])
        assert model_args_for(cfg, 8192).use_scaled_rope, name  # Meta's 3.1 params.json
        cfg = parse_args(["--config", name, "--model.rope_scaling", "none"])  # Llama 3.0
        assert not model_args_for(cfg, 8192).use_scaled_rope, name
    debug = parse_args(["--config", "debug_model", "--model.rope_scaling", "llama3"])
    assert model_args_for(debug, 256).use_scaled_rope


def test_rope_scaling_is_refused_for_a_family_without_the_args_field():
    """model.rope_scaling sets the args field use_scaled_rope; a family whose args have none
    refuses a value other than 'flavor' in the checks before any process group."""
    from training.preflight import check_config

    for name, spec in ((n, get_model_spec(n)) for n in ("llama3", "qwen3", "qwen3_moe")):
        has_field = any(f == "use_scaled_rope" for f in vars(spec.flavors["debugmodel"]))
        cfg = parse_args(["--model.name", name, "--model.rope_scaling", "none"])
        if has_field:
            check_config(cfg, 1)
            continue
        with pytest.raises(ConfigError) as e:
            check_config(cfg, 1)
        message = str(e.value)
        assert f"model.name = '{name}' has no use_scaled_rope" in message
        assert "model.rope_scaling" in message and "'flavor'" in message
        check_config(parse_args(["--model.name", name]), 1)  # the default is fine


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("model.moe_aux_loss_coeff", "moe.aux_loss_coeff"),
        ("model.moe_bias_update_rate", "moe.bias_update_rate"),
        ("model.moe_z_loss_coeff", "moe.z_loss_coeff"),
        ("metrics.moe_idle_warn_steps", "moe.idle_warn_steps"),
    ],
)
def test_moved_moe_options_name_their_new_key(old, new, tmp_path):
    with pytest.raises(ConfigError, match=f"'{old}' in the command line has moved to '{new}'"):
        parse_args([f"--{old}", "1"])
    section, _, key = old.partition(".")
    preset = tmp_path / "old.toml"
    preset.write_text(f"[{section}]\n{key} = 1\n")
    with pytest.raises(ConfigError, match=f"'{old}' in .*old.toml has moved to '{new}'"):
        parse_args(["--config", str(preset)])
    cfg = parse_args([f"--{new}", "1"])
    assert getattr(cfg.moe, new.partition(".")[2]) == 1


def test_generic_schema_defaults_name_no_model():
    """The no-decay default is the family's (ModelSpec.no_decay), and no option's help names
    a registered family."""
    assert JobConfig().optimizer.no_decay_patterns is None
    families = {"llama", "qwen", *all_model_specs()}
    for line in help_text().lower().splitlines():
        if line.startswith("      "):  # a help line, not an option's name and default
            assert not [f for f in families if f in line], line


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
            "--compile.enable",  # a bare flag; components alone would be ignored (rejected)
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
    assert cfg.compile.enable is True and cfg.compile.components == ["model"]
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
        (
            ["--parallelism.context_parallel_degree", "3"],
            "training.seq_len = 2048 must be a multiple of 2 x parallelism.context_parallel_deg",
        ),
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
    for section in config_sections():  # every section: the provenance is none
        for key, value in vars(getattr(cfg, section)).items():
            assert f"--{section}.{key} " in text
            assert f"default {value!r}" in text


# --- options the rest of the config ignores are errors ----------------------------------------

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.dataset_path", "/my/corpus"],
         "training.dataset_path = '/my/corpus' set but training.dataset = 'sample'"),
        (["--training.dataset", "sample", "--training.dataset_path", "a.jsonl"],
         "set training.dataset to one of text, jsonl, parquet, huggingface"),
        (["--training.dataset_text_field", "body"], "training.dataset_text_field set but"),
        (["--validation.freq", "5"], "validation.freq set but validation.enable = false"),
        (["--validation.enable", "--validation.dataset_path", "/my/held_out"],
         "validation.dataset_path = '/my/held_out' set but validation.dataset = '', as "
         "training.dataset = 'sample'"),
        (["--validation.enable", "--training.steps", "50"],
         "validation.enable set but validation.freq = 100 > training.steps = 50"),
        (["--parallelism.pipeline_parallel_schedule", "GPipe"],
         "parallelism.pipeline_parallel_schedule set but parallelism.pipeline_parallel_degree "
         "= 1, so it has no effect: set pipeline_parallel_degree > 1 (or drop it)"),
        (["--parallelism.pipeline_parallel_microbatch_size", "2",
          "--parallelism.pipeline_parallel_split_points", "layers.1"],
         "parallelism.pipeline_parallel_microbatch_size, "
         "parallelism.pipeline_parallel_split_points set but"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"], "layers_per_stage set but"),
        (["--parallelism.disable_loss_parallel"],
         "parallelism.disable_loss_parallel set but parallelism.tensor_parallel_degree = 1"),
        (["--parallelism.zero_stage", "2", "--parallelism.fsdp_reshard_after_forward", "never"],
         "parallelism.fsdp_reshard_after_forward set but parallelism.zero_stage = 2"),
        (["--compile.components", "loss"], "compile.components set but compile.enable = false"),
        (["--activation_checkpoint.mode", "full", "--activation_checkpoint.selective_ac_option",
          "op"], "activation_checkpoint.selective_ac_option set but activation_checkpoint.mode"),
        (["--checkpoint.interval", "5", "--checkpoint.folder", "ck"],
         "checkpoint.folder, checkpoint.interval set but checkpoint.enable = false"),
        (["--checkpoint.initial_load_model_only", "false"],
         "checkpoint.initial_load_model_only set but checkpoint.enable = false, so nothing "
         "would be loaded"),
        (["--checkpoint.enable", "--checkpoint.export_dtype", "bfloat16"],
         "checkpoint.export_dtype set but checkpoint.model_only = false"),
        (["--checkpoint.enable", "--checkpoint.hf_export_dtype", "float32"],
         "checkpoint.hf_export_dtype set but checkpoint.hf_export = false"),
        (["--checkpoint.enable", "--checkpoint.hf_export", "--checkpoint.hf_export_interval",
          "-2"], "checkpoint.hf_export_interval = -2: use 0"),
        (["--checkpoint.enable", "--checkpoint.load_step", "5", "--checkpoint.initial_load_path",
          "x"], "checkpoint.initial_load_path set but checkpoint.load_step = 5"),
        (["--checkpoint.enable", "--checkpoint.initial_load_model_only", "false"],
         "checkpoint.initial_load_model_only set but checkpoint.initial_load_path = ''"),
        (["--lr_scheduler.decay_type", "constant", "--lr_scheduler.min_lr_factor", "0.1"],
         "lr_scheduler.min_lr_factor set but lr_scheduler.decay_type = 'constant'"),
        (["--optimizer.name", "Adam", "--optimizer.weight_decay", "0.05"],
         "optimizer.weight_decay set but optimizer.name = 'Adam'"),
        (["--optimizer.weight_decay", "0", "--optimizer.no_decay_patterns", "bias"],
         "optimizer.no_decay_patterns set but optimizer.weight_decay = 0"),
        (["--metrics.enable_tensorboard", "false", "--metrics.save_tb_folder", "x"],
         "metrics.save_tb_folder set but metrics.enable_tensorboard = false"),
        (["--profiling.profile_freq", "10"],
         "profiling.profile_freq set but profiling.enable_profiling = false"),
        (["--profiling.enable_profiling", "--training.steps", "50"],
         "profiling.enable_profiling set but profiling.profile_freq = 100 > training.steps"),
        (["--profiling.memory_snapshot_step", "3"],
         "profiling.memory_snapshot_step set but profiling.enable_memory_snapshot = false"),
        (["--profiling.enable_memory_snapshot", "--profiling.memory_snapshot_step", "20",
          "--training.steps", "10"], "profiling.memory_snapshot_step set but training.steps"),
        (["--job.simulate_world_size", "8"], "job.simulate_world_size set but job.dry_run"),
        (["--debug.fail_at_step", "20", "--training.steps", "10"],
         "debug.fail_at_step set but training.steps = 10 ends the run first"),
        (["--debug.hang_at_step", "20", "--training.steps", "10"],
         "debug.hang_at_step set but training.steps = 10 ends the run first"),
        (["--debug.checkpoint_save_delay_s", "5"],
         "debug.checkpoint_save_delay_s set but debug.checkpoint_save_delay_step = 0"),
        (["--debug.checkpoint_save_delay_step", "5"],
         "debug.checkpoint_save_delay_step set but checkpoint.enable = false"),
    ],
)  # fmt: skip
def test_ignored_options_are_rejected_naming_both_keys(argv, expected):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert expected in str(e.value)


def test_options_count_only_when_set_to_a_non_default_value():
    cfg = parse_args(["--checkpoint.interval", "500", "--parallelism.pipeline_parallel_schedule",
                      "1F1B", "--validation.freq", "100"])  # the defaults  # fmt: skip
    assert cfg.checkpoint.enable is False


def test_a_preset_option_switched_off_on_the_command_line_is_not_an_error(tmp_path):
    # debug_model sets validation.freq/steps and a cosine min_lr_factor
    cfg = parse_args(["--config", "debug_model", "--validation.enable", "false",
                      "--lr_scheduler.decay_type", "constant"])  # fmt: skip
    assert cfg.validation.freq == 50
    # but a preset that sets an option its own settings ignore is rejected
    preset = tmp_path / "p.toml"
    preset.write_text("[checkpoint]\nenable = false\ninterval = 50\n")
    with pytest.raises(ConfigError, match="checkpoint.interval set but checkpoint.enable"):
        parse_args(["--config", str(preset)])
    # and so is a command-line option whose feature the command line switched off
    with pytest.raises(ConfigError, match="validation.freq set but validation.enable"):
        parse_args(["--config", "debug_model", "--validation.enable", "false",
                    "--validation.freq", "10"])  # fmt: skip


def test_resolved_config_comments_out_what_has_no_effect(tmp_path):
    cfg = parse_args(["--config", "debug_model", "--validation.enable", "false"])
    text = config_to_toml(cfg)
    assert "# freq = 50  # no effect in this config" in text
    out = tmp_path / "resolved.toml"
    out.write_text(text)
    assert parse_args(["--config", str(out)]).validation.enable is False


@pytest.mark.parametrize(
    "path, kind", [("/data/c4.jsonl", "jsonl"), ("/data/*.parquet", "parquet"), ("a.txt", "text")]
)
def test_a_file_suffix_names_the_dataset_and_the_log_says_so(path, kind):
    cfg = parse_args(["--config", "debug_model", "--validation.enable", "false",
                      "--training.dataset_path", path])  # fmt: skip
    assert cfg.training.dataset == kind
    assert config_notes(cfg) == [
        f"training.dataset = '{kind}' inferred from training.dataset_path = '{path}' (the "
        "sample dataset reads no path)"
    ]
    cfg = parse_args(["--validation.enable", "--validation.dataset_path", path])
    assert (cfg.training.dataset, cfg.validation.dataset) == ("sample", kind)


def test_provenance_is_a_typed_field_kept_out_of_the_toml_and_the_help():
    given = ["--training.steps", "7", "--training.dataset_path", "a.txt"]
    cfg = parse_args(["--config", "debug_model", *given, "--validation.enable", "false"])
    assert cfg.provenance.cli_keys == {
        "training.steps",
        "training.dataset_path",
        "validation.enable",
    }
    assert cfg.provenance.notes == config_notes(cfg) and len(config_notes(cfg)) == 1
    assert "provenance" not in config_to_toml(cfg) and "provenance" not in help_text()
    # == compares the options only: the same values given another way are the same config
    same = parse_args(["--config", "debug_model", *given, "--training.dataset", "text",
                       "--validation.enable", "false"])  # fmt: skip
    assert same == cfg and same.provenance != cfg.provenance
    assert JobConfig().provenance.cli_keys == set()  # built in code: nothing given
    with pytest.raises(ConfigError, match="Unknown config section"):
        parse_args(["--provenance.notes", "x"])


def test_suffixes_match_the_data_readers():
    from data.indexed import SUFFIXES
    from data.sources import FILE_EXTENSIONS
    from job_config.unused import _SUFFIX_DATASETS

    readers = {s: k for k, suffixes in FILE_EXTENSIONS.items() for s in suffixes}
    assert readers | dict.fromkeys(SUFFIXES, "megatron") == _SUFFIX_DATASETS


def test_several_errors_are_reported_in_one_numbered_message():
    argv = ["--training.dataset", "jsonl", "--parallelism.context_parallel_degree", "3",
            "--compile.components", "loss"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    text = str(e.value)
    assert text.startswith("3 config errors:\n")
    assert "\n  1. compile.components set but" in text
    assert "\n  2. training.dataset = 'jsonl' needs training.dataset_path" in text
    assert "\n  3. training.seq_len = 2048 must be a multiple of 2 x" in text


def test_layout_errors_are_reported_together_with_the_config_errors():
    from training.preflight import check_config

    cfg = parse_args(["--config", "tests/tiny_model.toml", *PP2,
                      "--parallelism.pipeline_parallel_schedule", "Nope",
                      "--parallelism.tensor_parallel_degree", "2", "--model.n_kv_heads", "1",
                      "--profiling.profile_freq", "3"], check=False)  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_config(cfg, world_size=3)
    text = str(e.value)
    assert text.startswith("4 config errors:\n")
    for part in ("profiling.profile_freq set but", "World size 3 is not divisible",
                 "must divide n_kv_heads = 1", "Unknown schedule name"):  # fmt: skip
        assert part in text
    cfg = parse_args(["--config", "tests/tiny_model.toml", *PP2, "--model.n_layers", "4",
                      "--parallelism.pipeline_parallel_microbatch_size", "3",
                      "--parallelism.pipeline_parallel_layers_per_stage", "1",
                      "--parallelism.zero_stage", "1",
                      "--parallelism.data_parallel_replicate_degree", "2"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_config(cfg, world_size=5)
    text = str(e.value)
    assert text.startswith("4 config errors:\n")
    for part in ("World size 5 is not divisible", "HSDP (replicate x "
                 "shard) is ZeRO-3 only", "exactly 2 stages", "does not divide"):  # fmt: skip
        assert part in text


@pytest.mark.parametrize(
    "world, argv, expected",
    [
        (1, ["--parallelism.zero_stage", "1"], "parallelism.zero_stage set but the "
         "data-parallel degree is 1"),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_reduce",
             "bfloat16"], "training.mixed_precision_reduce set but the data-parallel degree"),
    ],
)  # fmt: skip
def test_options_the_layout_ignores_are_rejected(world, argv, expected):
    from training.preflight import check_config

    cfg = parse_args(["--config", "tests/tiny_model.toml", *argv])
    check_config(cfg, world_size=2 * world)  # a layout that uses them
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_config(cfg, world_size=world)


def test_replicas_only_hsdp_is_fsdp_and_takes_its_options():
    """data_parallel_shard_degree 1 under replicas is still FSDP2 (HSDP on a (2, 1) mesh), so
    its FSDP options apply, and a tied flavor (one FSDP unit for the shared weight) passes."""
    from training.preflight import check_config

    for argv in (["--parallelism.fsdp_reshard_after_forward", "always"],
                 ["--model.name", "qwen3", "--model.flavor", "debugmodel"]):  # fmt: skip
        cfg = parse_args(["--config", "tests/tiny_model.toml",
                          "--parallelism.data_parallel_replicate_degree", "2", *argv])  # fmt: skip
        check_config(cfg, world_size=2)
