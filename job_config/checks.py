"""Cross-field config checks that need no process group: the options the rest of the config
would silently ignore (`job_config.unused`), then batch, data, layout and feature checks.
`validate` runs them all after loading; `training.preflight.check_config` adds the world-size
checks. Every independent problem is reported in one ConfigError."""

from __future__ import annotations

from job_config.problems import Problems
from job_config.schema import JobConfig
from job_config.unused import check_unused


def config_notes(cfg: JobConfig) -> list[str]:
    """What validation inferred (e.g. a dataset kind from a path's suffix), for the run log."""
    return list(cfg.provenance.notes)


def _check_mixture(cfg: JobConfig, problems: Problems) -> set[str]:
    """training.mixture and the validation it needs; returns the dataset kinds it names."""
    from data.dataloader import SUPPORTED_DATASETS
    from data.mixture import parse_mixture

    t, kinds = cfg.training, set()
    try:
        kinds = {kind for kind, _, _ in parse_mixture(t.mixture)}
    except ValueError as e:
        problems.add(f"training.mixture: {e}.")
    if not kinds <= set(SUPPORTED_DATASETS):
        problems.add(
            f"training.mixture names unknown dataset kinds {sorted(kinds - set(SUPPORTED_DATASETS))}"
            f"; choose from {', '.join(SUPPORTED_DATASETS)}."
        )
    per_source = cfg.validation.per_source
    if per_source and len(per_source) != len(t.mixture):
        problems.add(
            f"validation.per_source has {len(per_source)} entries for the "
            f"{len(t.mixture)} sources of training.mixture: give one KIND:PATH per source."
        )
    bad = [e for e in per_source if e.partition(":")[0] not in SUPPORTED_DATASETS]
    if bad or any(not e.partition(":")[2] for e in per_source):
        problems.add(f"validation.per_source entries must be KIND:PATH, got {per_source}.")
    if cfg.validation.enable and not cfg.validation.dataset:
        problems.add(
            "validation.enable with training.mixture needs validation.dataset (and its "
            "dataset_path): a mixture has no one held-out split."
        )
    return kinds


def _check_batch_and_data(cfg: JobConfig, problems: Problems) -> None:
    """The batch sizes, the training data and the validation data."""
    t = cfg.training
    if t.global_batch_size == 0:
        problems.add(
            "training.global_batch_size = 0: use -1 (local_batch_size x DP degree) or a "
            "positive multiple of local_batch_size x DP degree."
        )
    if t.global_batch_size != -1 and t.global_batch_size % t.local_batch_size:
        problems.add(
            f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
            f"training.local_batch_size = {t.local_batch_size} (or -1)."
        )
    if t.dataset != "sample" and not t.dataset_path and not t.mixture:
        problems.add(
            f"training.dataset = '{t.dataset}' needs training.dataset_path (a file, glob or "
            "folder, or the Hugging Face dataset name); or use dataset = 'sample'."
        )
    kinds = _check_mixture(cfg, problems) if t.mixture else {t.dataset}
    if t.shuffle and "huggingface" in kinds:
        problems.add(
            "training.shuffle = true needs random access to the sequences, but training.dataset "
            "= 'huggingface' is streamed: set training.shuffle = false (or pre-tokenise the "
            "dataset and read it as dataset = 'megatron')."
        )
    v = cfg.validation
    local = ("text", "jsonl", "parquet", "megatron")
    if v.enable and (v.dataset or t.dataset) in local and not v.dataset_path:
        problems.add(
            f"validation.enable with {v.dataset or t.dataset} files needs "
            "validation.dataset_path: local files have no held-out split, so validating on "
            "training.dataset_path would measure the training data. Point it at held-out "
            "files, or set validation.enable = false."
        )


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that need no process group (the world-size checks: training.preflight).

    Every independent problem is collected and reported in one ConfigError."""
    problems = Problems()
    check_unused(cfg, problems)
    _check_batch_and_data(cfg, problems)
    if cfg.parallelism.pipeline_parallel_layers_per_stage == 0:
        problems.add(
            "parallelism.pipeline_parallel_layers_per_stage = 0: use -1 (split the layers "
            "evenly) or a positive number of layers per stage."
        )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            problems.add(
                f"activation_checkpoint.selective_ac_option = '{ac.selective_ac_option}' is "
                "invalid: expected 'op' or a positive integer N (checkpoint every N-th block)."
            )
    for comp in cfg.compile.components:
        if comp not in ("model", "loss"):
            problems.add(
                f"compile.components contains '{comp}': allowed entries are 'model' and 'loss'."
            )
    for key in ("aux_loss_coeff", "bias_update_rate", "z_loss_coeff"):
        value = getattr(cfg.moe, key)
        if -1 < value < 0:
            problems.add(
                f"moe.{key} = {value}: use -1 (the flavor's value), 0 (off) or a positive weight."
            )
    if cfg.checkpoint.hf_export_interval < 0:
        problems.add(
            f"checkpoint.hf_export_interval = {cfg.checkpoint.hf_export_interval}: use 0 (the "
            "last step only) or a positive number of steps."
        )
    if len(cfg.optimizer.muon_ns_coefficients) != 3:
        problems.add(
            f"optimizer.muon_ns_coefficients = {cfg.optimizer.muon_ns_coefficients}: give the "
            "three coefficients (a, b, c) of the quintic Newton-Schulz iteration."
        )
    cp = cfg.parallelism.context_parallel_degree
    if cp > 1 and cfg.training.seq_len % (2 * cp):
        problems.add(
            f"training.seq_len = {cfg.training.seq_len} must be a multiple of 2 x "
            f"parallelism.context_parallel_degree = {2 * cp}: each CP rank holds two of 2 x "
            "context_parallel_degree equal chunks of every sequence."
        )
    prof = cfg.profiling
    if prof.enable_profiling and prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
        problems.add(
            f"profiling.profiler_warmup ({prof.profiler_warmup}) + profiler_active "
            f"({prof.profiler_active}) must not exceed profiling.profile_freq "
            f"({prof.profile_freq}): each window ends at a multiple of profile_freq."
        )
    problems.raise_any()
