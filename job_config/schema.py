"""The typed configuration schema: one dataclass per TOML section.

Every option is declared with `opt(default, help, ...)`, which records its one-line help and
its allowed range; `job_config.loader` reads these to parse TOML and command-line overrides,
validate them and print `--help`. Names follow torchtitan's TOML where the same setting exists
there, so configs carry over. `JobConfig.provenance` is no section: it records where the values
came from (see `Provenance`), and `config_sections` leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal


def opt(
    default: Any,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> Any:
    """Declares one config option with its help text and optional numeric bounds."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = opt("", "TOML preset that was loaded (set by --config)")
    dump_folder: str = opt("./outputs", "Output folder: resolved config, logs, metrics, TB")
    description: str = opt("", "Free-text description of the run, logged at start")
    custom_import: str = opt(
        "",
        "A module to import first (a dotted name on the Python path, or a .py file or package "
        "folder): it may register model families with models.register",
    )
    dry_run: bool = opt(False, "Build the model on the meta device, report its size and exit")
    simulate_world_size: int = opt(
        0,
        "With dry_run: simulate this many ranks (fake process group, real mesh and "
        "parallelize functions) and report per-rank memory (0 = off)",
        ge=0,
    )


@dataclass
class Model:
    name: str = opt("llama3", "Model family, a key of the registry in models/__init__.py")
    flavor: str = opt("debugmodel", "Model size, a key of the family's flavors")
    tokenizer_path: str = opt(
        "",
        "Tokenizer file (tiktoken BPE or sentencepiece); '' = the "
        "bundled sample tokenizer, built on first use",
    )
    # Shape overrides (0 = the flavor's value): tiny models for tests and quick experiments.
    dim: int = opt(0, "Override the flavor's model width (0 = the flavor's)", ge=0)
    n_layers: int = opt(0, "Override the flavor's number of layers (0 = the flavor's)", ge=0)
    n_heads: int = opt(0, "Override the flavor's attention heads (0 = the flavor's)", ge=0)
    n_kv_heads: int = opt(0, "Override the flavor's key/value heads (0 = the flavor's)", ge=0)
    mtp_depth: int = opt(
        -1,
        "Multi-token-prediction modules after the blocks (models/mtp.py), for families whose "
        "args have an mtp_depth field (DeepSeek-V3); -1 = the flavor's, 0 = off",
        ge=-1,
    )
    mtp_loss_weight: float = opt(
        -1.0,
        "Weight of the multi-token-prediction modules' mean loss in training (DeepSeek-V3's "
        "lambda); -1 = the flavor's",
        ge=-1,
    )
    rope_scaling: Literal["flavor", "none", "llama3"] = opt(
        "flavor",
        "RoPE frequency scaling, for families whose args have a use_scaled_rope field (the "
        "others refuse any value but flavor): flavor = the flavor's, none = unscaled, else "
        "the low-frequency scaling of that name (Hugging Face's rope_type)",
    )


@dataclass
class MoE:
    """Mixture-of-experts options: families with experts only (a set value is refused for a
    family without); -1 = the flavor's value."""

    aux_loss_coeff: float = opt(
        -1.0,
        "Load-balancing loss weight over the global micro-batch (-1 = the flavor's, 0 = off)",
        ge=-1,
    )
    bias_update_rate: float = opt(
        -1.0,
        "Aux-loss-free balancing: per-step router bias change (DeepSeek-V3; -1 = the "
        "flavor's, 0 = off)",
        ge=-1,
    )
    z_loss_coeff: float = opt(-1.0, "Router z-loss weight (-1 = the flavor's, 0 = off)", ge=-1)
    idle_warn_steps: int = opt(
        100, "Warn when an expert has received no token for this many steps", ge=1
    )


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = opt(
        "AdamW",
        "Optimizer. Muon: Muon on the hidden matrices, AdamW (lr, betas, eps, weight decay "
        "below) on embeddings, the output layer, norms and biases (docs/muon.md)",
    )
    lr: float = opt(8e-4, "Peak learning rate", gt=0)
    beta1: float = opt(0.9, "Adam beta1", ge=0, le=1)
    beta2: float = opt(0.95, "Adam beta2", ge=0, le=1)
    eps: float = opt(1e-8, "Adam epsilon", gt=0)
    weight_decay: float = opt(0.1, "Decoupled weight decay", ge=0)
    no_decay_patterns: list[str] | None = opt(
        None,
        "Parameters whose name contains one of these get no weight decay (None = the model "
        "family's list, its ModelSpec.no_decay; [] = decay every parameter)",
    )
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = opt(
        "auto", "AdamW kernel: auto = fused where torch has the kernel (CUDA, CPU), else foreach"
    )
    muon_lr: float | None = opt(None, "Muon's peak learning rate (None = optimizer.lr)", gt=0)
    muon_momentum: float = opt(0.95, "Muon's momentum (torch.optim.Muon's lerp form)", ge=0, le=1)
    muon_nesterov: bool = opt(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations", ge=1, le=99)
    muon_ns_coefficients: list[float] = opt(
        [3.4445, -4.7750, 2.0315], "Muon: the quintic Newton-Schulz coefficients (a, b, c)"
    )
    muon_update_scale: Literal["match_rms_adamw", "original"] = opt(
        "match_rms_adamw",
        "Muon's per-matrix LR factor: match_rms_adamw 0.2 sqrt(max(rows, cols)) (AdamW's lr "
        "and weight decay carry over), original sqrt(max(1, rows / cols))",
    )
    muon_ns_dtype: Literal["bfloat16", "float32", "param"] = opt(
        "bfloat16", "Muon: the Newton-Schulz dtype (param = the weight's, float64 in parity mode)"
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Linear warmup steps from ~0 to the peak LR", ge=0)
    decay_ratio: float | None = opt(
        None,
        "Fraction of steps spent decaying at the end (None = all steps after warmup)",
        ge=0,
        le=1,
    )
    decay_type: Literal["linear", "sqrt", "cosine", "constant"] = opt(
        "linear", "Shape of the decay after warmup"
    )
    min_lr_factor: float = opt(0.0, "Final LR as a fraction of the peak LR", ge=0, le=1)


@dataclass
class Training:
    dataset: Literal["sample", "text", "jsonl", "parquet", "huggingface", "megatron"] = opt(
        "sample",
        "Data source: sample (bundled corpus), text, jsonl, parquet, huggingface, megatron "
        "(pre-tokenised Megatron .bin/.idx)",
    )
    dataset_path: str = opt(
        "",
        "File, glob or folder (text/jsonl/parquet), HF dataset name, or megatron prefixes / "
        ".idx files / folders / globs (comma-separated)",
    )
    dataset_text_field: str = opt("text", "Field holding the text in jsonl/parquet/HF records")
    mixture: list[str] = opt(
        [],
        "Weighted mixture instead of dataset/dataset_path: KIND:PATH:WEIGHT entries, e.g. "
        "['megatron:/data/web:0.7', 'jsonl:/data/code:0.3'] (data/mixture.py); per-source "
        "tokens in metrics.jsonl as tokens_mix<i>",
    )
    shuffle: bool = opt(
        True,
        "Read each epoch's sequences in a seeded order (data/shuffle.py; the same on every "
        "layout, O(1) per sequence); false = the corpus order. Streamed datasets need false",
    )
    shuffle_seed: int = opt(0, "Seed of the shuffled order (each epoch its own order)", ge=0)
    stream_shards: int = opt(
        1,
        "dataset = huggingface: split the streamed dataset's files into this many virtual "
        "shards, each packed on its own (sequence g from shard g mod S); with a multiple of the "
        "DP degree each rank tokenises only its own rows. 1 = one stream that every rank reads "
        "whole. Part of the data order: keep it when resuming",
        ge=1,
    )
    local_batch_size: int = opt(8, "Sequences per rank per micro-step", ge=1)
    global_batch_size: int = opt(
        -1,
        "Sequences per optimizer step over all ranks (-1 = local_batch_size x DP degree); "
        "a multiple of local_batch_size x DP degree enables gradient accumulation",
        ge=-1,
    )
    seq_len: int = opt(2048, "Tokens per sequence", ge=2)
    document_mask: bool = opt(
        False,
        "Packed documents do not attend to each other (boundaries: the token files' index, a "
        "stream's packing)",
    )
    steps: int = opt(10000, "Optimizer steps to train", ge=1)
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm (0 = no clipping)", ge=0)
    mixed_precision_param: Literal["auto", "bfloat16", "float32", "float64"] = opt(
        "auto",
        "Compute/parameter dtype under FSDP: auto = bfloat16 on CUDA, float32 on CPU; float64 "
        "= the exact-arithmetic parity mode (weights, compute, optimizer state in float64)",
    )
    mixed_precision_reduce: Literal["auto", "float32", "bfloat16", "float64"] = opt(
        "auto",
        "Gradient reduction dtype under FSDP/ZeRO: auto = float64 with float64 "
        "parameters, else float32",
    )
    device: Literal["auto", "cuda", "cpu"] = opt("auto", "auto = CUDA when present, else CPU")
    enable_cpu_offload: bool = opt(False, "Keep FSDP parameters/grads/optimizer state on host")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "HSDP replica groups (DDP across them)", ge=1)
    data_parallel_shard_degree: int = opt(
        -1, "FSDP shard group size (-1 = whatever is left)", ge=-1
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree", ge=1)
    context_parallel_degree: int = opt(
        1, "Context-parallel degree: every sequence split over this many ranks (ZeRO-3)", ge=1
    )
    context_parallel_method: Literal["allgather", "ulysses"] = opt(
        "allgather",
        "CP attention: allgather = K/V all-gathered per layer (long K/V, few heads); ulysses = "
        "all-to-all from sequence to head shards (many heads: heads divisible by TP x CP)",
    )
    expert_parallel_degree: int = opt(
        1, "Expert-parallel degree: MoE experts split over this many FSDP shard ranks", ge=1
    )
    pipeline_parallel_degree: int = opt(1, "Pipeline-parallel degree", ge=1)
    zero_stage: int = opt(
        3,
        "ZeRO stage for data parallelism: 0 DDP, 1 optimizer state "
        "sharded, 2 + gradients, 3 + parameters (FSDP2)",
        ge=0,
        le=3,
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default",
        "Free gathered params after forward (default: not the last block, output; none with PP)",
    )
    disable_loss_parallel: bool = opt(False, "Gather full-vocabulary logits under TP")
    pipeline_parallel_schedule: str = opt("1F1B", "PP schedule name")
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline microbatch", ge=1)
    pipeline_parallel_layers_per_stage: int = opt(
        -1, "Transformer layers per (virtual) stage (-1 = split evenly)", ge=-1
    )
    pipeline_parallel_split_points: list[str] = opt(
        [], "Module names starting each stage after the first, e.g. ['layers.4']"
    )


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from the latest one")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder")
    interval: int = opt(500, "Save every this many steps (and at the last step)", ge=1)
    keep_latest_k: int = opt(
        0,
        "Keep only the newest k checkpoints (0 = keep all); older ones are deleted only "
        "after a newer one is complete",
        ge=0,
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled",
        "disabled: save blocks training; async: stage a CPU copy, write in the "
        "background; async_with_pinned_mem: the copy also runs in the background (into "
        "pinned memory on CUDA), awaited before the next optimizer step",
    )
    load_step: int = opt(-1, "Resume from this step's checkpoint (-1 = the latest)", ge=-1)
    model_only: bool = opt(
        False,
        "At the last step also export the weights only, in export_dtype, to <folder>/export-step-N",
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "Dtype of the model_only export"
    )
    hf_export: bool = opt(
        False,
        "At the last step also save the weights in Hugging Face format (config.json, sharded "
        "safetensors with an index, the tokenizer's files) to <folder>/hf-step-N: loads in "
        "transformers as it is; the family needs a Hugging Face adapter",
    )
    hf_export_interval: int = opt(
        0, "With hf_export: also every this many steps (0: the last step only)"
    )
    hf_export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "bfloat16", "Dtype of the Hugging Face export's weights"
    )
    exclude_from_loading: list[
        Literal["model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"]
    ] = opt([], "Components not restored on resume, e.g. ['dataloader', 'lr_scheduler']")
    create_seed_checkpoint: bool = opt(
        False,
        "Initialise the full model once (one process, CPU), save it as the step-0 "
        "model-only checkpoint in the folder, and exit",
    )
    initial_load_path: str = opt(
        "",
        "Checkpoint (or folder of step-N checkpoints) to start from when the run's own "
        "folder has none, e.g. a model converted by scripts/convert_from_hf.py (needs "
        "checkpoint.enable)",
    )
    initial_load_model_only: bool = opt(
        True, "Load only the weights from initial_load_path (not optimizer, data, step)"
    )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = opt("none", "Activation checkpointing mode")
    selective_ac_option: str = opt("2", "selective: 'op' (per-op policy) or N (every N-th block)")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block and the loss")
    components: list[str] = opt(["model", "loss"], "What to compile: model, loss")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every this many steps", ge=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard event files")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler traces (Chrome JSON per rank)")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder")
    profile_freq: int = opt(100, "Profile one window every this many steps", ge=1)
    profiler_warmup: int = opt(1, "Steps traced but discarded before the active ones", ge=0)
    profiler_active: int = opt(2, "Steps recorded per window (end at a multiple of freq)", ge=1)
    enable_memory_snapshot: bool = opt(
        False, "CUDA: record allocator history and dump a snapshot at a step and on OOM"
    )
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Memory snapshot folder, relative to job.dump_folder"
    )
    memory_snapshot_step: int = opt(2, "Step after which the memory snapshot is dumped", ge=1)


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate on the held-out split during training")
    dataset: Literal["", "sample", "text", "jsonl", "parquet", "huggingface", "megatron"] = opt(
        "", "Validation data source ('' = validation split of training.dataset)"
    )
    dataset_path: str = opt("", "Validation file/glob/folder or HF name ('' = as training)")
    freq: int = opt(100, "Validate every this many steps", ge=1)
    steps: int = opt(
        -1,
        "Global batches (training.global_batch_size sequences, as a training step reads them) "
        "per evaluation; -1 = the whole split less its last incomplete global batch. The same "
        "sequences under every layout and accumulation",
        ge=-1,
    )
    per_source: list[str] = opt(
        [],
        "With training.mixture: held-out data of each source, KIND:PATH in the mixture's order; "
        "each evaluation also logs loss_mix<i> (the validation record)",
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout for process-group setup", ge=1)
    train_timeout_seconds: int = opt(300, "Timeout of collectives once training runs", ge=1)


@dataclass
class Debug:
    seed: int = opt(42, "Random seed for weight init and dropout-free determinism", ge=0)
    deterministic: bool = opt(False, "Use deterministic algorithms (bit-identical CPU reruns)")
    fail_at_step: int = opt(
        0,
        "Fault-injection test: the last rank exits with an error at this step, on the first "
        "torchrun attempt only (TORCHELASTIC_RESTART_COUNT = 0); 0 = off",
        ge=0,
    )
    hang_at_step: int = opt(
        0,
        "Fault-injection test: the last rank stops answering at this step (first torchrun "
        "attempt only), so the others' next collective runs into comm.train_timeout_seconds; "
        "0 = off",
        ge=0,
    )
    checkpoint_save_delay_step: int = opt(
        0,
        "Fault-injection test: every rank sleeps debug.checkpoint_save_delay_s inside the "
        "full save of this step, after writing its shards and before the commit (a window "
        "to kill a save in); 0 = off",
        ge=0,
    )
    checkpoint_save_delay_s: float = opt(
        60.0, "Seconds of the sleep debug.checkpoint_save_delay_step asks for", ge=0
    )


@dataclass
class Provenance:
    """Where a config's values came from: not an option, so never written by config_to_toml,
    listed by `--help` or compared by `==`.

    cli_keys: the "section.key" names given on the command line (parse_args), or chosen as if
        there (planning.advise): a check excuses a preset's value that one of them makes moot.
        Empty for a config built in code, whose every non-default value then counts as given.
    notes: what validation inferred (e.g. a dataset kind from a path's suffix), for the run log.
    """

    cli_keys: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: MoE = field(default_factory=MoE)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
    provenance: Provenance = field(
        default_factory=Provenance, repr=False, compare=False, metadata={"section": False}
    )


# Options that moved: the old name -> the new one (the loader names the new one).
MOVED_OPTIONS = {
    "model.moe_aux_loss_coeff": "moe.aux_loss_coeff",
    "model.moe_bias_update_rate": "moe.bias_update_rate",
    "model.moe_z_loss_coeff": "moe.z_loss_coeff",
    "metrics.moe_idle_warn_steps": "moe.idle_warn_steps",
}


def config_sections() -> tuple[str, ...]:
    """The names of JobConfig's TOML sections, in order (`provenance` is not one)."""
    return tuple(f.name for f in fields(JobConfig) if f.metadata.get("section", True))
