"""Every check before a launch, in one place, and the dry run that stands in for one.

`check_config` runs all the checks that need only the config and the world size, before any
process group, model or data work: the cross-field checks (`job_config.checks.validate`), the
layout rules that `ParallelDims` owns (the degrees multiply to the world size, divisibility,
which dimensions combine, the batch over the data-parallel ranks), the options the layout
ignores, the pipeline split (`validate_pipeline_config`) and the model family's own checks (its
`validate`, reached through the registry). Every independent problem is reported in one error.
`check_data_files` follows for a real launch; `dry_run` builds the model on the meta device
and reports its size (`param_counts`) instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from checkpoint.hf import hf_load_problems, is_hf_folder, tensor_map
from checkpoint.storage import CheckpointError
from job_config.checks import validate
from job_config.loader import parse_args
from job_config.problems import ConfigError, Problems
from job_config.schema import JobConfig
from job_config.unused import report_unused
from models import get_model_spec, import_families, meta_model_for, model_args_for, mtp
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.pipeline import validate_pipeline_config
from training.distributed import device_type


def load_config(argv: list[str]) -> JobConfig:
    """The config of a command line with the families `job.custom_import` names imported first
    (so a family registered outside the tree is known by name), then validated: what every
    entry point (train.py, the estimator, the memory breakdown) starts from."""
    cfg = parse_args(argv, check=False)
    import_custom_families(cfg.job.custom_import)
    validate(cfg)
    return cfg


def import_custom_families(target: str) -> None:
    """`models.import_families`, its failure as a ConfigError."""
    try:
        import_families(target)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_config(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Every check that needs only the config and the world size, before any real work; the
    independent problems are all reported in one error."""
    problems = Problems(ConfigError, ParallelismError)
    problems.run(validate, cfg)  # again after parse_args: cheap, and the launch skips it there
    try:  # an unknown model name or flavor
        args = model_args_for(cfg, cfg.training.seq_len, None)
    except ValueError as e:
        problems.add(str(e))
        args = None
    dims = problems.run(ParallelDims.from_parallelism, cfg.parallelism, world_size)
    if dims is not None:
        _check_layout(cfg, dims, problems)
    if args is not None:
        _check_model(cfg, args, problems)
    problems.raise_any()
    return dims


def _check_layout(cfg: JobConfig, dims: ParallelDims, problems: Problems) -> None:
    """What the resolved layout allows of the rest of the config."""
    t = cfg.training
    for problem in dims.batch_problems(t.global_batch_size, t.local_batch_size):
        problems.add(problem)
    if t.enable_cpu_offload and not dims.fsdp_enabled:
        problems.add(
            "training.enable_cpu_offload = true needs FSDP: zero_stage = 3 and a "
            "data-parallel (x context_parallel) degree > 1 (got zero_stage "
            f"{dims.zero_stage}, data-parallel degree {dims.dp_cp})."
        )
    # CP ranks hold other tokens: their gradients are reduced and their weights sharded
    check_layout_options(cfg, dims.dp_cp, problems)


def check_layout_options(cfg: JobConfig, dp: int, problems: Problems) -> None:
    """Options that the data-parallel layout, known once the world size is, ignores. (With
    replicas only, data_parallel_shard_degree = 1, zero_stage 3 is still FSDP2: HSDP.)"""
    degrees = (
        "data_parallel_shard",
        "data_parallel_replicate",
        "context_parallel",
        "tensor_parallel",
        "pipeline_parallel",
    )
    layout = ["parallelism.zero_stage"] + [f"parallelism.{k}_degree" for k in degrees]
    fsdp = ["parallelism.fsdp_reshard_after_forward"] if cfg.parallelism.zero_stage == 3 else []
    if dp == 1:
        report_unused(
            problems,
            cfg,
            ["parallelism.zero_stage", "training.mixed_precision_reduce", *fsdp],
            layout,
            "the data-parallel degree is 1 (no gradient reduction, nothing to shard)",
            "use more ranks or a data_parallel_shard_degree > 1 (or drop them)",
        )


def _moe_families() -> str:
    from models import all_model_specs

    return ", ".join(n for n, s in all_model_specs().items() if s.routing is not None) or "none"


def _check_model(cfg: JobConfig, args, problems: Problems) -> None:
    """The decoder checks every family needs and the family's own (its `validate`), experts for
    EP, and the pipeline split."""
    from parallelisms.decoder import decoder_problems

    p, spec = cfg.parallelism, get_model_spec(cfg.model.name)
    for problem in decoder_problems(spec, cfg, args):
        problems.add(ParallelismError(problem))
    if p.expert_parallel_degree > 1 and spec.routing is None:
        problems.add(
            f"parallelism.expert_parallel_degree = {p.expert_parallel_degree}: model.name = "
            f"'{cfg.model.name}' has no experts. Use a mixture-of-experts family (one whose "
            f"ModelSpec has routing hooks: {_moe_families()}) or expert_parallel_degree = 1."
        )
    if spec.routing is None:  # the [moe] options the args take are refused by model_args_for
        report_unused(
            problems,
            cfg,
            ["moe.idle_warn_steps"],
            ["model.name"],
            f"model.name = '{cfg.model.name}' has no experts",
            "use a family with experts",
        )
    ck = cfg.checkpoint
    if (
        ck.enable
        and ck.load_step < 0
        and ck.initial_load_path
        and is_hf_folder(Path(ck.initial_load_path))
    ):
        for problem in hf_load_problems(
            Path(ck.initial_load_path), spec, args, ck.initial_load_model_only
        ):
            problems.add(problem)
    if ck.enable and ck.hf_export:
        try:
            tensor_map(spec, args)
        except CheckpointError as e:
            problems.add(f"checkpoint.hf_export = true: {e}")
    ac = cfg.activation_checkpoint
    problems.run(
        validate_pipeline_config,
        p,
        cfg.training.local_batch_size,
        args.n_layers,
        device_type=device_type(cfg.training.device),
        per_op_ac=ac.mode == "selective" and ac.selective_ac_option == "op",
    )


def check_data_files(cfg: JobConfig) -> None:
    """Local dataset paths must match files before the model is built."""
    from data.indexed import resolve_prefixes
    from data.sources import FILE_EXTENSIONS, resolve_files

    t, v = cfg.training, cfg.validation
    sources = [("training", t.dataset, t.dataset_path)]
    if v.enable:
        sources.append(("validation", v.dataset or t.dataset, v.dataset_path or t.dataset_path))
    for section, kind, path in sources:
        try:
            if kind in FILE_EXTENSIONS:
                resolve_files(kind, path)
            elif kind == "megatron":
                resolve_prefixes(path)
        except ValueError as e:
            raise ConfigError(f"{section}.dataset_path: {e}") from None


@dataclass(frozen=True)
class ParamCounts:
    """A whole model's parameter counts (tied weights once); for a mixture of experts also
    those one token uses (`active`), which its FLOPs count. Written to the run's layout.json."""

    total: int
    non_embedding: int
    active: int | None = None
    active_non_embedding: int | None = None
    # the output head's parameters again for each multi-token-prediction depth (models/mtp.py)
    head_reuse: int | None = None

    @property
    def flops_params(self) -> int:
        """The non-embedding parameters a token uses, each as often as it multiplies: what the
        FLOPs per token count."""
        used = (
            self.non_embedding if self.active_non_embedding is None else self.active_non_embedding
        )
        return used + (self.head_reuse or 0)

    def as_dict(self) -> dict[str, int]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def describe(self) -> str:
        n, n_no_emb = self.total, self.non_embedding
        text = f"{n:,} parameters ({n / 1e9:.2f}B; {n_no_emb:,} without embeddings)"
        if self.active is not None:
            active, active_no_emb = self.active, self.active_non_embedding
            text += f", {active:,} active per token ({active / 1e9:.2f}B; {active_no_emb:,} "
            text += "without embeddings)"
        return text


def param_counts(spec, model) -> ParamCounts:
    """The counts of `model` (whole, e.g. on the meta device), the active ones as the trainer's
    MFU counts them (`spec.routing`)."""
    from metrics.flops import count_params

    n = count_params(model)
    n_no_emb = count_params(model, spec.embeddings)
    depth = len(mtp.modules(model))
    head = getattr(model, spec.head[-1], None)
    reuse = depth * sum(p.numel() for p in head.parameters()) if depth and head else None
    if spec.routing is None:
        return ParamCounts(n, n_no_emb, head_reuse=reuse)
    active_no_emb = spec.routing.active_params(model)
    return ParamCounts(n, n_no_emb, active_no_emb + n - n_no_emb, active_no_emb, reuse)


def dry_run(cfg: JobConfig) -> None:
    """Builds the model on the meta device (allocating nothing) and reports its size."""
    from metrics.flops import flops_per_token

    vocab = None  # the flavor's vocabulary unless the tokenizer file is at hand
    if cfg.model.tokenizer_path and Path(cfg.model.tokenizer_path).is_file():
        from data.tokenizer import build_tokenizer

        vocab = build_tokenizer(cfg.model.tokenizer_path).vocab_size
    spec, args, model = meta_model_for(cfg, cfg.training.seq_len, vocab, ConfigError)
    counts = param_counts(spec, model)
    from planning.memory import layer_attention_specs

    fpt = flops_per_token(
        counts.flops_params, args.n_layers, args.n_heads, args.head_dim, args.max_seq_len,
        layer_attention_specs(model),
    )  # fmt: skip
    print(
        f"dry run: {cfg.model.name} {cfg.model.flavor}: {counts.describe()}, "
        f"{fpt / 1e9:.2f} GFLOP per token at seq_len {args.max_seq_len}"
    )
    if cfg.job.simulate_world_size:  # per-rank memory of the configured layout at that scale
        from planning.simulate import format_plan, simulate

        world = cfg.job.simulate_world_size
        check_config(cfg, world)
        gib = 80.0
        if torch.cuda.is_available():
            gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        print(format_plan(simulate(spec, args, cfg, world), gib))
