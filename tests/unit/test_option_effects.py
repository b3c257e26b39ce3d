"""Every option of `job_config/schema.py` is proven to reach the code it configures.

`EFFECTS`: one entry per option that changes training: the option, a changed value, and a probe
that builds what the option configures (with the trainer's own functions) and observes it. The
probe runs on a base config and on the base with the changed value: the two observations must
differ, and the changed one must be the expected one. A bug in which the option silently does
not arrive (AdamW built with `betas=(beta1, beta1)`, say) fails here, where one-process and
parity runs, sharing the bug, agree with each other.
`ELSEWHERE`: options whose effect only a launch observes, with the test that does.
`LOGGING_ONLY`: options that change only what is logged or written, each with the reason.
`test_every_option_is_accounted_for` fails when a schema option is in none of the three (a new
option needs its proof) or when an entry names no option of the schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from option_probes import (
    BODIES,
    DOCS,
    PLAIN,
    Case,
    async_pending,
    base_argv,
    batch,
    checkpoint_folder,
    checkpointed,
    clipped_norm,
    export_dtype,
    first_weights,
    group,
    hf_export_dtype,
    imported,
    injected,
    layout,
    lr_factors,
    model,
    model_kwargs,
    moe_coefficients,
    muon_update,
    no_decay_names,
    optimizer,
    prediction,
    resumed,
    runtime,
    save_sleeps,
    saved_steps,
    seed_checkpoint_or_dry_run,
    shuffled_row,
    source_validation,
    stream,
    tokenizer,
)

from job_config import JobConfig, parse_args
from job_config.schema import config_sections
from training.loop import is_log_step
from training.trainer import (
    batch_sizes,
    build_loaders,
    load_tokenizer,
)

pytestmark = pytest.mark.usefixtures("private_token_cache")


# ------------------------------------------------------------------------------- the table
DIFFERS = object()  # the expected observation: anything but the base's


@dataclass(frozen=True)
class Effect:
    value: str  # the changed value, as typed on the command line ({dump} and `files` filled)
    probe: Callable[[Case], Any]
    expect: Any = DIFFERS  # the changed config's observation, or a function of its Case
    base: tuple[str, ...] = ()  # options the base needs for this one to count
    extra: tuple[str, ...] = ()  # more options the changed config needs with the value


CKPT = ("--checkpoint.enable", "true")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
VAL = (
    "--validation.enable",
    "true",
    "--validation.freq",
    "5",
    "--validation.dataset_path",
    "{docs}",
)
MOE = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel")
MUON = ("--optimizer.name", "Muon")
DEEPSEEK = ("--model.name", "deepseek_v3", "--model.n_kv_heads", "4")
# a mixture of docs alone (no dataset or dataset_path beside a mixture)
ONE_SOURCE_MIX = ("--training.dataset", "sample", "--training.dataset_path", "",
                  "--training.mixture", '["jsonl:{docs}:1"]')  # fmt: skip

EFFECTS: dict[str, Effect] = {
    # [job]
    "job.dump_folder": Effect("{dump}/elsewhere", checkpoint_folder, "elsewhere/checkpoint", CKPT),
    "job.custom_import": Effect("{probe_module}", imported, True, ("--job.dry_run", "true")),
    "job.dry_run": Effect("true", seed_checkpoint_or_dry_run, ("NoneType", True, False, [])),
    "job.simulate_world_size": Effect(
        "2", seed_checkpoint_or_dry_run, ("NoneType", True, True, []), ("--job.dry_run", "true")
    ),
    # [model]
    "model.name": Effect("qwen3", lambda c: type(model(c)).__name__, "Qwen3"),
    "model.flavor": Effect("8B", lambda c: model(c).args.use_scaled_rope, True),
    "model.tokenizer_path": Effect(
        "{tok_merge}", lambda c: load_tokenizer(c.cfg).encode("ab", bos=False, eos=False), [256]
    ),
    "model.dim": Effect("32", lambda c: model(c).tok_embeddings.weight.shape[1], 32),
    "model.n_layers": Effect("3", lambda c: len(model(c).layers), 3),
    "model.n_heads": Effect(  # head_dim = dim / n_heads: 8, so the 2 KV heads are 16 wide
        "8", lambda c: model(c).layers["0"].attention.wk.weight.shape[0], 16
    ),
    "model.n_kv_heads": Effect(
        "4", lambda c: model(c).layers["0"].attention.wk.weight.shape[0], 64
    ),
    "model.rope_scaling": Effect(
        "llama3", lambda c: round(model(c).rope.float().abs().sum().item(), 3)
    ),
    "model.mtp_depth": Effect("2", prediction, (2, [0.15, 0.15], True), DEEPSEEK),
    "model.mtp_loss_weight": Effect(
        "0.5", prediction, (1, [0.5], True), (*DEEPSEEK, "--model.mtp_depth", "1")
    ),
    # [moe]
    "moe.aux_loss_coeff": Effect("0.5", moe_coefficients, (0.5, 0.0, 0.0), MOE),
    "moe.bias_update_rate": Effect("0.25", moe_coefficients, (0.001, 0.25, 0.0), MOE),
    "moe.z_loss_coeff": Effect("0.125", moe_coefficients, (0.001, 0.0, 0.125), MOE),
    # [optimizer]
    "optimizer.name": Effect("Adam", lambda c: type(optimizer(c)[0]).__name__, "Adam"),
    "optimizer.lr": Effect("0.25", group("initial_lr"), 0.25),
    "optimizer.beta1": Effect("0.5", group("betas"), (0.5, 0.95)),
    "optimizer.beta2": Effect("0.75", group("betas"), (0.9, 0.75)),
    "optimizer.eps": Effect("0.001", group("eps"), 0.001),
    "optimizer.weight_decay": Effect("0.25", group("weight_decay"), 0.25),
    "optimizer.no_decay_patterns": Effect(
        "['tok_embeddings']", no_decay_names, ["tok_embeddings.weight"]
    ),
    "optimizer.implementation": Effect(
        "for-loop", lambda c: (group("fused")(c), group("foreach")(c)), (False, False)
    ),
    "optimizer.muon_lr": Effect("0.5", muon_update, DIFFERS, MUON),
    "optimizer.muon_momentum": Effect("0.5", muon_update, DIFFERS, MUON),
    "optimizer.muon_nesterov": Effect("false", muon_update, DIFFERS, MUON),
    "optimizer.muon_ns_steps": Effect("2", muon_update, DIFFERS, MUON),
    "optimizer.muon_ns_coefficients": Effect("[3.0, -3.2, 1.2]", muon_update, DIFFERS, MUON),
    "optimizer.muon_update_scale": Effect("original", muon_update, DIFFERS, MUON),
    "optimizer.muon_ns_dtype": Effect("float32", muon_update, DIFFERS, MUON),
    # [lr_scheduler]: the base is 10 steps, 2 of warmup, a linear decay to 0
    "lr_scheduler.warmup_steps": Effect("4", lr_factors, (0.2, 0.6, 0.6667, 0.0)),
    "lr_scheduler.decay_ratio": Effect("0.5", lr_factors, (0.3333, 1.0, 0.8, 0.0)),
    "lr_scheduler.decay_type": Effect("cosine", lr_factors, (0.3333, 0.9619, 0.5, 0.0)),
    "lr_scheduler.min_lr_factor": Effect("0.1", lr_factors, (0.3333, 0.8875, 0.55, 0.1)),
    # [training]
    "training.dataset": Effect("text", batch, ((4, 32), stream([PLAIN])[:12])),
    "training.dataset_path": Effect(
        "{docs2}", batch, ((4, 32), stream([d[::-1] for d in DOCS])[:12])
    ),
    "training.dataset_text_field": Effect("body", batch, ((4, 32), stream(BODIES)[:12])),
    # a mixture weighted 1:3 starts with docs2's (its share is the furthest behind)
    "training.mixture": Effect(
        '["jsonl:{docs}:1", "jsonl:{docs2}:3"]',
        batch,
        ((4, 32), stream([d[::-1] for d in DOCS])[:12]),
        ONE_SOURCE_MIX,
    ),
    "training.shuffle": Effect("true", batch, lambda c: ((4, 32), shuffled_row(0))),
    "training.shuffle_seed": Effect(
        "7", batch, lambda c: ((4, 32), shuffled_row(7)), ("--training.shuffle", "true")
    ),
    "training.local_batch_size": Effect("2", lambda c: batch(c)[0], (2, 32)),
    "training.seq_len": Effect("16", lambda c: batch(c)[0], (4, 16)),
    "training.global_batch_size": Effect(
        "12", lambda c: tuple(batch_sizes(c.cfg, 1)), (12, 3, 384)
    ),
    "training.document_mask": Effect(
        "true",
        lambda c: (model_kwargs(c), len(next(iter(build_loaders(c.cfg, tokenizer(c), 0, 1)[0])))),
        (["documents", "positions"], 3),  # the loader adds the documents from the index
    ),
    "training.steps": Effect("20", lr_factors, (0.3333, 0.9444, 0.7778, 0.5556)),
    "training.max_norm": Effect("0.5", clipped_norm, 0.5),
    "training.mixed_precision_param": Effect(
        "bfloat16", layout(2, "mp"), ("torch.bfloat16", "torch.float32")
    ),
    "training.mixed_precision_reduce": Effect(
        "bfloat16", layout(2, "mp"), ("torch.float32", "torch.bfloat16")
    ),
    "training.device": Effect(
        "cuda",
        runtime("device"),
        lambda c: "cuda" if torch.cuda.is_available() else "LaunchError",
        ("--training.device", "cpu"),
    ),
    "training.enable_cpu_offload": Effect("true", layout(2, "offload"), "CPUOffloadPolicy"),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": Effect(
        "2", layout(4, "mesh"), {"dp_replicate": 2, "dp_shard": 2}
    ),
    "parallelism.data_parallel_shard_degree": Effect(  # -1 fills the world; 2 of 4 is refused
        "2", layout(4, "mesh"), "ParallelismError: Parallel degrees multiply to 2, not the "
    ),
    "parallelism.tensor_parallel_degree": Effect("2", layout(4, "mesh"), {"dp_shard": 2, "tp": 2}),
    "parallelism.context_parallel_degree": Effect(
        "2", layout(4, "context_parallel_blocks"), ["0", "1"]
    ),
    "parallelism.context_parallel_method": Effect(
        "ulysses", layout(4, "context_parallel_method"), ["ulysses"], CP2
    ),
    "parallelism.expert_parallel_degree": Effect(
        "2", layout(4, "mesh"), {"dp_shard_mod_ep": 2, "ep": 2}, MOE
    ),
    "parallelism.pipeline_parallel_degree": Effect("2", layout(2, "layers"), ["0"]),
    "parallelism.zero_stage": Effect(
        "1",
        layout(2, "data_parallel"),
        {"kind": "zero", "zero_stage": 1, "mesh": ["dp_shard"]},
    ),
    "parallelism.fsdp_reshard_after_forward": Effect("never", layout(2, "reshard"), [False] * 5),
    "parallelism.disable_loss_parallel": Effect(
        "true", layout(2, "loss_context"), "nullcontext", TP2
    ),
    "parallelism.pipeline_parallel_schedule": Effect(
        "GPipe", layout(2, "schedule"), "ScheduleGPipe", PP2
    ),
    "parallelism.pipeline_parallel_microbatch_size": Effect("2", layout(2, "microbatches"), 2, PP2),
    "parallelism.pipeline_parallel_layers_per_stage": Effect(
        "1",
        layout(2, "stages"),
        4,
        (
            *PP2,
            "--model.n_layers",
            "8",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ),  # fmt: skip
    ),
    "parallelism.pipeline_parallel_split_points": Effect(
        "['layers.1']", layout(2, "layers"), ["0"], (*PP2, "--model.n_layers", "4")
    ),
    # [checkpoint]
    "checkpoint.enable": Effect("true", lambda c: checkpointed(c)[0] is not None, True),
    "checkpoint.folder": Effect("ckpts", checkpoint_folder, "ckpts", CKPT),
    "checkpoint.interval": Effect(
        "5",
        lambda c: [s for s in range(1, 11) if checkpointed(c)[0].due(s)],
        [5, 10],
        CKPT,
    ),
    "checkpoint.keep_latest_k": Effect(
        "1",
        saved_steps(range(1, 3)),
        ["checkpoint/step-2"],
        (*CKPT, "--checkpoint.interval", "1"),
    ),
    "checkpoint.async_mode": Effect("async", async_pending, (True, True), CKPT),
    "checkpoint.load_step": Effect("1", resumed, "CheckpointError", CKPT),  # no step-1
    "checkpoint.model_only": Effect(
        "true",
        saved_steps(range(10, 11)),
        ["checkpoint/export-step-10", "checkpoint/step-10"],
        CKPT,
    ),
    "checkpoint.export_dtype": Effect(
        "bfloat16", export_dtype, "torch.bfloat16", (*CKPT, "--checkpoint.model_only", "true")
    ),
    "checkpoint.hf_export": Effect(
        "true",
        saved_steps(range(10, 11)),
        ["checkpoint/hf-step-10", "checkpoint/step-10"],
        CKPT,
    ),
    "checkpoint.hf_export_interval": Effect(
        "4",
        saved_steps(range(1, 11)),
        [
            "checkpoint/hf-step-10",
            "checkpoint/hf-step-4",
            "checkpoint/hf-step-8",
            "checkpoint/step-10",
        ],
        (*CKPT, "--checkpoint.hf_export", "true"),
    ),
    "checkpoint.hf_export_dtype": Effect(
        "float16", hf_export_dtype, "F16", (*CKPT, "--checkpoint.hf_export", "true")
    ),
    "checkpoint.exclude_from_loading": Effect("['train_state']", resumed, (0, True), CKPT),
    "checkpoint.create_seed_checkpoint": Effect(
        "true", seed_checkpoint_or_dry_run, ("NoneType", False, False, ["step-0"])
    ),
    "checkpoint.initial_load_path": Effect("{dump}/other/checkpoint", resumed, (0, True), CKPT),
    "checkpoint.initial_load_model_only": Effect(
        "false",
        resumed,
        (2, True),
        (*CKPT, "--checkpoint.initial_load_path", "{dump}/other/checkpoint"),  # fmt: skip
    ),
    # [activation_checkpoint], [compile]
    "activation_checkpoint.mode": Effect("full", layout(1, "ac_blocks"), ["0", "1"]),
    "activation_checkpoint.selective_ac_option": Effect(
        "op",
        layout(1, "ac_selective_op_blocks"),
        ["0", "1"],
        ("--activation_checkpoint.mode", "selective"),
    ),
    "compile.enable": Effect(
        "true",
        lambda c: (layout(1, "compiled_blocks")(c), layout(1, "compiled_loss")(c)),
        (["0", "1"], True),
    ),
    "compile.components": Effect(
        "['loss']",
        lambda c: (layout(1, "compiled_blocks")(c), layout(1, "compiled_loss")(c)),
        ([], True),
        ("--compile.enable", "true"),
    ),
    # [metrics]: the log steps are also where the loop checks for NaN and agrees to stop
    "metrics.log_freq": Effect(
        "4",
        lambda c: [
            s
            for s in range(1, 11)
            if is_log_step(SimpleNamespace(cfg=c.cfg, state=SimpleNamespace(step=s), first_step=1))
        ],  # fmt: skip
        [1, 4, 8, 10],
    ),
    # [validation]
    "validation.enable": Effect(
        "true",
        lambda c: build_loaders(c.cfg, tokenizer(c), 0, 1)[1] is not None,
        True,
        extra=VAL[2:],
    ),
    "validation.dataset": Effect(
        "text",
        lambda c: batch(c, "validation")[1],
        stream([PLAIN])[:12],
        VAL,
    ),
    "validation.dataset_path": Effect(
        "{docs2}",
        lambda c: batch(c, "validation")[1],
        stream([d[::-1] for d in DOCS])[:12],
        VAL,
    ),
    # held-out data of each mixture source (here one, docs2's), evaluated apart
    "validation.per_source": Effect(
        '["jsonl:{docs2}"]',
        source_validation,
        {"mix0": stream([d[::-1] for d in DOCS])[:12]},
        (*ONE_SOURCE_MIX, *VAL, "--validation.dataset", "jsonl"),
    ),
    # [comm]
    "comm.init_timeout_seconds": Effect("77", runtime("timeout_s"), 77.0),
    # [debug]
    "debug.seed": Effect("7", first_weights),
    "debug.deterministic": Effect("true", runtime("deterministic"), True),
    "debug.fail_at_step": Effect("3", injected, [(3, "fails")]),
    "debug.hang_at_step": Effect("4", injected, [(4, "hangs")]),
    "debug.checkpoint_save_delay_step": Effect(
        "2", save_sleeps, [60.0], (*CKPT, "--checkpoint.interval", "1")
    ),
    "debug.checkpoint_save_delay_s": Effect(
        "0.25",
        save_sleeps,
        [0.25],
        (*CKPT, "--checkpoint.interval", "1", "--debug.checkpoint_save_delay_step", "2"),
    ),
}

# The effect only a run of several processes shows; the named tests launch one.
ELSEWHERE: dict[str, str] = {
    "comm.train_timeout_seconds": "tests/integration/test_fault_tolerance.py::"
    "test_hung_rank_becomes_an_error_naming_rank_and_step",
    "training.stream_shards": "tests/unit/test_data_loader.py::"
    "test_stream_shards_from_the_config_reach_the_training_loader",
}

LOGGING_ONLY: dict[str, str] = {
    "job.config_file": "records which preset was loaded; its values are the options themselves",
    "job.description": "free text written to the log at start",
    "metrics.enable_tensorboard": "writes TensorBoard event files beside metrics.jsonl",
    "metrics.save_tb_folder": "where the TensorBoard files go",
    "moe.idle_warn_steps": "when a warning about idle experts is logged",
    "profiling.enable_profiling": "records profiler traces; the steps compute the same",
    "profiling.save_traces_folder": "where the traces go",
    "profiling.profile_freq": "which steps are traced",
    "profiling.profiler_warmup": "traced steps discarded before the recorded ones",
    "profiling.profiler_active": "how many steps each trace records",
    "profiling.enable_memory_snapshot": "records CUDA allocator history for a snapshot file",
    "profiling.save_memory_snapshot_folder": "where the snapshot goes",
    "profiling.memory_snapshot_step": "after which step the snapshot is written",
    "validation.freq": "how often the held-out loss is measured (no training state changes)",
    "validation.steps": "how many held-out global batches each measurement averages",
}


def schema_options() -> set[str]:
    return {
        f"{section}.{f.name}"
        for section in config_sections()
        for f in dataclasses.fields(getattr(JobConfig(), section))
    }


def _case(files, root: Path, name: str, argv: list[str]) -> Case:
    dump = root / name
    fill = {**files, "dump": str(dump)}
    argv = [a.format(**fill) for a in argv]
    return Case(parse_args(argv), argv, dump)


@pytest.mark.parametrize("option", sorted(EFFECTS))
def test_option_takes_effect(option, option_files, tmp_path):
    effect = EFFECTS[option]
    argv = lambda dump: base_argv(option_files, dump) + list(effect.base)  # noqa: E731
    base = _case(option_files, tmp_path, "base", argv(tmp_path / "base"))
    changed = _case(
        option_files,
        tmp_path,
        "changed",
        argv(tmp_path / "changed") + [f"--{option}", effect.value, *effect.extra],
    )
    section, key = option.split(".")
    assert getattr(getattr(base.cfg, section), key) != getattr(getattr(changed.cfg, section), key)
    seen_base, seen = effect.probe(base), effect.probe(changed)
    assert seen != seen_base, f"{option} = {effect.value} changed nothing: {seen!r}"
    if effect.expect is not DIFFERS:
        want = effect.expect(changed) if callable(effect.expect) else effect.expect
        assert seen == want, f"{option} = {effect.value}: observed {seen!r}, expected {want!r}"


def test_every_option_is_accounted_for():
    """A new option fails here until it has an effect test or a logging-only entry; an entry
    for an option the schema no longer has fails too."""
    options = schema_options()
    tables = {
        "EFFECTS": set(EFFECTS),
        "ELSEWHERE": set(ELSEWHERE),
        "LOGGING_ONLY": set(LOGGING_ONLY),
    }
    listed = set().union(*tables.values())
    assert not options - listed, f"options without a proof of effect: {sorted(options - listed)}"
    for name, keys in tables.items():
        assert keys <= options, f"{name} lists options the schema lacks: {sorted(keys - options)}"
    assert sum(map(len, tables.values())) == len(listed), "an option is listed twice"
    assert all(reason.strip() for reason in LOGGING_ONLY.values())


def test_elsewhere_entries_name_existing_tests():
    root = Path(__file__).resolve().parents[2]
    for option, node in ELSEWHERE.items():
        path, _, name = node.partition("::")
        assert f"def {name}(" in (root / path).read_text(), f"{option}: no test {node}"
