"""The options the rest of the config would silently ignore: each rule names the keys that have
no effect when a condition holds, why, and the fix (`_RULES`); `check_unused` reports the ones
the user set as one error each, `ignored_options` lists them whoever set them, and
`report_unused` serves the world-size checks in `training.preflight` the same way. A key set
in a preset but made moot by a command-line switch is excused (`_given`)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from job_config.problems import ConfigError, Problems
from job_config.schema import JobConfig, config_sections

_DEFAULTS = JobConfig()
# The suffixes that name one file dataset (as data.sources.FILE_EXTENSIONS reads them).
_SUFFIX_DATASETS = {
    ".txt": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".idx": "megatron",
    ".bin": "megatron",
}
_PIPELINE_KEYS = [
    f"parallelism.pipeline_parallel_{k}"
    for k in ("schedule", "microbatch_size", "layers_per_stage", "split_points")
]


def _value(cfg: JobConfig, name: str) -> Any:
    section, _, key = name.partition(".")
    return getattr(getattr(cfg, section), key)


def _given(cfg: JobConfig, keys: list[str], because: list[str]) -> list[str]:
    """The `keys` the user set to a non-default value (in the preset or on the command line).

    Left out: preset values whose feature the command line switched off, i.e. a key in
    `because` (the options that make `keys` moot) was given there: `--validation.enable false`
    on a preset that sets validation.freq says what the user wants. A config built in code
    (empty `provenance.cli_keys`) counts every non-default value as given.
    """
    cli = cfg.provenance.cli_keys
    excused = any(k in cli for k in because)
    return [k for k in keys if _value(cfg, k) != _value(_DEFAULTS, k) and (k in cli or not excused)]


def report_unused(problems: Problems, cfg, keys, because, reason: str, fix: str) -> None:
    """One error naming the given `keys` that have no effect because of `reason`."""
    names = _given(cfg, keys, because)
    if names:
        one = len(names) == 1
        effect, drop = ("it has", "it") if one else ("they have", "them")
        message = (
            f"{', '.join(names)} set but {reason}, so {effect} no effect: {fix} (or drop {drop})."
        )
        _add_ignored(problems, names, message)


def _add_ignored(problems: Problems, names: list[str], message: str) -> None:
    error = ConfigError(message)
    error.ignored = names  # for ignored_options
    problems.add(error)


def ignored_options(cfg: JobConfig) -> set[str]:
    """The non-default options that have no effect in `cfg`, whoever set them (validate
    excuses a preset's, see _given): as if every value had been typed on the command line.
    Repeated with those at their defaults until none is left, since one (validation.enable,
    say) can be what made others count."""
    probe = copy.deepcopy(cfg)
    probe.provenance.cli_keys = {
        f"{s}.{f.name}" for s in config_sections() for f in dataclasses.fields(getattr(cfg, s))
    }
    ignored: set[str] = set()
    while True:
        problems = Problems()
        check_unused(probe, problems)
        new = {name for e in problems.errors for name in getattr(e, "ignored", ())} - ignored
        if not new:
            return ignored
        ignored |= new
        for name in new:
            section, _, key = name.partition(".")
            setattr(getattr(probe, section), key, copy.deepcopy(_value(_DEFAULTS, name)))


def _check_dataset_path(cfg: JobConfig, problems: Problems, section: str) -> None:
    """A dataset_path given with the sample dataset, which reads no path: infer the file kind
    from an unambiguous suffix unless the command line chose 'sample', else reject."""
    sec = getattr(cfg, section)
    kind_key, path_key = f"{section}.dataset", f"{section}.dataset_path"
    if (sec.dataset or cfg.training.dataset) != "sample":
        return
    if not _given(cfg, [path_key], [kind_key, "training.dataset"]):
        return
    path = sec.dataset_path
    kind = _SUFFIX_DATASETS.get(Path(path).suffix.lower())
    if kind and kind_key not in cfg.provenance.cli_keys:
        sec.dataset = kind
        cfg.provenance.notes.append(
            f"{kind_key} = '{kind}' inferred from {path_key} = '{path}' (the sample "
            "dataset reads no path)"
        )
        return
    why = "" if kind else f" (the path does not say which: {', '.join(_SUFFIX_DATASETS)} do)"
    as_training = "" if sec.dataset else ", as training.dataset = 'sample'"
    _add_ignored(
        problems,
        [path_key],
        f"{path_key} = '{path}' set but {kind_key} = '{sec.dataset}'{as_training} (the "
        f"bundled sample corpus), so the path is ignored: set {kind_key} to one of text, "
        f"jsonl, parquet, huggingface, megatron{why}, or drop {path_key}.",
    )


# A rule of _check_unused: (when, the keys then ignored, the keys that make them so, why, fix).
_Rule = tuple[bool, str, str, str, str]


def _ends_first(cfg: JobConfig) -> str:
    return f"training.steps = {cfg.training.steps} ends the run first"


def _data_rules(cfg: JobConfig) -> list[_Rule]:
    t, v = cfg.training, cfg.validation
    kinds = {t.dataset} | ({v.dataset or t.dataset} if v.enable else set())
    # fmt: off
    return [
        (not v.enable, "validation.dataset validation.dataset_path validation.freq "
         "validation.steps", "validation.enable", "validation.enable = false",
         "set validation.enable = true"),
        (v.enable and v.freq > t.steps, "validation.enable validation.freq", "training.steps",
         f"validation.freq = {v.freq} > {_ends_first(cfg)}", "lower validation.freq"),
        (not t.mixture, "validation.per_source", "training.mixture",
         "training.mixture is empty (no sources to validate apart)", "set training.mixture"),
        (bool(t.mixture), "training.dataset training.dataset_path", "training.mixture",
         "training.mixture is set (it names the data)", "drop them"),
        (not t.shuffle, "training.shuffle_seed", "training.shuffle",
         "training.shuffle = false", "set training.shuffle = true"),
        (t.stream_shards > 1 and (t.dataset != "huggingface" or bool(t.mixture)),
         "training.stream_shards", "training.dataset training.mixture",
         f"training.dataset = '{t.dataset}'" + (" in a mixture" if t.mixture else "")
         + " is not one streamed dataset", "set stream_shards = 1 or dataset = 'huggingface'"),
        (not kinds & {"jsonl", "parquet", "huggingface"}, "training.dataset_text_field",
         "training.dataset validation.dataset validation.enable",
         f"training.dataset = '{t.dataset}' (no records)", "use jsonl, parquet or huggingface"),
    ]
    # fmt: on


def _layout_rules(cfg: JobConfig) -> list[_Rule]:
    p, ac_mode = cfg.parallelism, cfg.activation_checkpoint.mode
    # fmt: off
    return [
        (p.pipeline_parallel_degree == 1, " ".join(_PIPELINE_KEYS),
         "parallelism.pipeline_parallel_degree", "parallelism.pipeline_parallel_degree = 1",
         "set pipeline_parallel_degree > 1"),
        (p.tensor_parallel_degree == 1, "parallelism.disable_loss_parallel",
         "parallelism.tensor_parallel_degree", "parallelism.tensor_parallel_degree = 1 "
         "(loss parallelism is TP's)", "set tensor_parallel_degree > 1"),
        (p.zero_stage < 3, "parallelism.fsdp_reshard_after_forward", "parallelism.zero_stage",
         f"parallelism.zero_stage = {p.zero_stage} (no FSDP)", "set zero_stage = 3"),
        (not cfg.compile.enable, "compile.components", "compile.enable",
         "compile.enable = false", "set compile.enable = true"),
        (ac_mode != "selective", "activation_checkpoint.selective_ac_option",
         "activation_checkpoint.mode", f"activation_checkpoint.mode = '{ac_mode}'",
         "set activation_checkpoint.mode = 'selective'"),
    ]
    # fmt: on


def _checkpoint_rules(cfg: JobConfig) -> list[_Rule]:
    ck = cfg.checkpoint
    seed_folder = "" if ck.create_seed_checkpoint else "checkpoint.folder "  # the seed's folder
    # fmt: off
    return [
        (not ck.enable, f"{seed_folder}checkpoint.interval checkpoint.keep_latest_k "
         "checkpoint.async_mode checkpoint.model_only checkpoint.export_dtype "
         "checkpoint.hf_export checkpoint.hf_export_interval checkpoint.hf_export_dtype",
         "checkpoint.enable", "checkpoint.enable = false (nothing is saved)",
         "set checkpoint.enable = true"),
        (ck.enable and not ck.model_only, "checkpoint.export_dtype", "checkpoint.model_only",
         "checkpoint.model_only = false (no export)", "set checkpoint.model_only = true"),
        (ck.enable and not ck.hf_export, "checkpoint.hf_export_interval checkpoint.hf_export_dtype",
         "checkpoint.hf_export", "checkpoint.hf_export = false (no Hugging Face export)",
         "set checkpoint.hf_export = true"),
        (ck.enable and ck.load_step >= 0, "checkpoint.initial_load_path", "checkpoint.load_step",
         f"checkpoint.load_step = {ck.load_step} (it resumes from the run's own folder)",
         "unset load_step to start from the path"),
        (ck.enable and ck.load_step < 0 and not ck.initial_load_path,
         "checkpoint.initial_load_model_only", "checkpoint.initial_load_path",
         "checkpoint.initial_load_path = ''", "set checkpoint.initial_load_path"),
    ]
    # fmt: on


def _optimizer_rules(cfg: JobConfig) -> list[_Rule]:
    lr, opt = cfg.lr_scheduler, cfg.optimizer
    # fmt: off
    return [
        (lr.decay_type == "constant", "lr_scheduler.decay_ratio lr_scheduler.min_lr_factor",
         "lr_scheduler.decay_type", "lr_scheduler.decay_type = 'constant'",
         "choose linear, sqrt or cosine"),
        (opt.name == "Adam", "optimizer.weight_decay optimizer.no_decay_patterns",
         "optimizer.name", "optimizer.name = 'Adam' (no weight decay)", "use 'AdamW'"),
        (opt.name == "AdamW" and opt.weight_decay == 0, "optimizer.no_decay_patterns",
         "optimizer.weight_decay", "optimizer.weight_decay = 0", "set a weight decay"),
        (opt.name != "Muon", "optimizer.muon_lr optimizer.muon_momentum "
         "optimizer.muon_nesterov optimizer.muon_ns_steps optimizer.muon_ns_coefficients "
         "optimizer.muon_update_scale optimizer.muon_ns_dtype", "optimizer.name",
         f"optimizer.name = '{opt.name}'", "set optimizer.name = 'Muon'"),
    ]
    # fmt: on


def _observability_rules(cfg: JobConfig) -> list[_Rule]:
    prof, steps, last = cfg.profiling, _ends_first(cfg), cfg.training.steps
    # fmt: off
    return [
        (not cfg.metrics.enable_tensorboard, "metrics.save_tb_folder",
         "metrics.enable_tensorboard", "metrics.enable_tensorboard = false",
         "set metrics.enable_tensorboard = true"),
        (not prof.enable_profiling, "profiling.save_traces_folder profiling.profile_freq "
         "profiling.profiler_warmup profiling.profiler_active", "profiling.enable_profiling",
         "profiling.enable_profiling = false", "set profiling.enable_profiling = true"),
        (prof.enable_profiling and prof.profile_freq > last,
         "profiling.enable_profiling profiling.profile_freq", "training.steps",
         f"profiling.profile_freq = {prof.profile_freq} > {steps}", "lower profile_freq"),
        (not prof.enable_memory_snapshot, "profiling.save_memory_snapshot_folder "
         "profiling.memory_snapshot_step", "profiling.enable_memory_snapshot",
         "profiling.enable_memory_snapshot = false",
         "set profiling.enable_memory_snapshot = true"),
        (prof.enable_memory_snapshot and prof.memory_snapshot_step > last,
         "profiling.memory_snapshot_step", "training.steps", steps, "lower it"),
    ]
    # fmt: on


def _debug_rules(cfg: JobConfig) -> list[_Rule]:
    debug, steps, last = cfg.debug, _ends_first(cfg), cfg.training.steps
    # fmt: off
    return [
        (not cfg.job.dry_run, "job.simulate_world_size", "job.dry_run", "job.dry_run = false",
         "add --job.dry_run"),
        (debug.fail_at_step > last, "debug.fail_at_step", "training.steps", steps, "lower it"),
        (debug.hang_at_step > last, "debug.hang_at_step", "training.steps", steps, "lower it"),
        (debug.checkpoint_save_delay_step == 0, "debug.checkpoint_save_delay_s",
         "debug.checkpoint_save_delay_step", "debug.checkpoint_save_delay_step = 0",
         "set the step whose save sleeps"),
        (not cfg.checkpoint.enable, "debug.checkpoint_save_delay_step", "checkpoint.enable",
         "checkpoint.enable = false", "set checkpoint.enable = true"),
    ]
    # fmt: on


def _check_loads_without_checkpointing(cfg: JobConfig, problems: Problems) -> None:
    """Load options given with checkpoint.enable = false (this wording is older than
    report_unused's)."""
    if cfg.checkpoint.enable:
        return
    loads = "initial_load_path initial_load_model_only load_step exclude_from_loading"
    names = _given(cfg, [f"checkpoint.{k}" for k in loads.split()], ["checkpoint.enable"])
    if names:
        _add_ignored(
            problems,
            names,
            f"{', '.join(names)} set but checkpoint.enable = false, so nothing would be "
            "loaded: set checkpoint.enable = true (or drop the option).",
        )


# In this order: it is the order of the numbered errors the user reads.
_RULES = (
    _data_rules,
    _layout_rules,
    _checkpoint_rules,
    _optimizer_rules,
    _observability_rules,
    _debug_rules,
)


def check_unused(cfg: JobConfig, problems: Problems) -> None:
    """Options set by the user that the rest of the config ignores (see _given)."""
    _check_dataset_path(cfg, problems, "training")
    if cfg.validation.enable:
        _check_dataset_path(cfg, problems, "validation")
    for rules in _RULES:
        for when, keys, because, reason, fix in rules(cfg):
            if when:
                report_unused(problems, cfg, keys.split(), because.split(), reason, fix)
    _check_loads_without_checkpointing(cfg, problems)
