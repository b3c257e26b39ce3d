"""Tests for the metrics package (CPU only, fast)."""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from metrics import (
    MetricsLogger,
    count_params,
    device_peak_flops,
    flops_per_token,
    format_record,
    lookup_gpu_peak,
    measure_matmul_flops,
    peak_memory_gib,
    reset_peak_memory,
    throughput,
)
from metrics import peak_flops as peak_flops_module
from metrics.flops import attention_span
from models import build_model_args, get_model_spec
from planning.memory import layer_attention_specs


class TinyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)


class TinyModel(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 4, tie: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([TinyBlock(dim), TinyBlock(dim)])
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


# vocab 11, dim 4: embedding 44; per block wq 16 + norm (4 + 4) = 24, two blocks 48; output 44.
EMBED, BLOCKS, OUTPUT = 11 * 4, 2 * (4 * 4 + 4 + 4), 4 * 11


def test_count_params_matches_hand_count() -> None:
    model = TinyModel()
    assert count_params(model) == EMBED + BLOCKS + OUTPUT
    assert count_params(model, ("tok_embeddings",)) == BLOCKS + OUTPUT


def test_count_params_on_meta_device() -> None:
    with torch.device("meta"):
        model = TinyModel()
    assert next(model.parameters()).is_meta
    assert count_params(model) == EMBED + BLOCKS + OUTPUT
    assert count_params(model, ("tok_embeddings",)) == BLOCKS + OUTPUT


def test_count_params_tied_weights_counted_once() -> None:
    model = TinyModel(tie=True)
    assert count_params(model) == EMBED + BLOCKS
    # The tied weight is still used by the output projection, so it stays in.
    assert count_params(model, ("tok_embeddings",)) == EMBED + BLOCKS


def test_count_params_dtensor_counts_global_numel(tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(3, 4, bias=False)
        # Pretend this rank holds one of 4 row shards of a (16, 3) weight.
        local = torch.zeros(4, 3)
        sharded = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size([16, 3]), stride=(3, 1)
        )
        model.weight = nn.Parameter(sharded)
        assert count_params(model) == 16 * 3
    finally:
        dist.destroy_process_group()


def test_flops_per_token_by_hand() -> None:
    # 6 * 1000 = 6000; causal: a query sees (16 + 1) / 2 keys on average, so
    # 12 * 4 heads * 8 head_dim * 2 layers * 8.5 = 6528.
    assert flops_per_token(1000, n_layers=2, n_heads=4, head_dim=8, seq_len=16) == 12528.0


def test_flops_per_token_counts_each_layer_at_its_span() -> None:
    """Per layer the keys a query sees on average: causal (S + 1) / 2, a causal window of 4
    at 16 tokens (1 + 2 + 3 + 13 x 4) / 16 = 3.625, non-causal all 16; the default is every
    layer plain causal, which is what a Llama model's cores declare."""
    from models.attention import AttentionSpec

    causal, window, full = AttentionSpec(), AttentionSpec(window=4), AttentionSpec(causal=False)
    assert [attention_span(x, 16) for x in (causal, window, full)] == [8.5, 3.625, 16.0]
    assert attention_span(AttentionSpec(window=64), 16) == 8.5  # a window past the sequence
    per_head = 12 * 4 * 8
    fpt = flops_per_token(1000, 3, 4, 8, 16, [window, causal, window])
    assert fpt == 6000 + per_head * (3.625 + 8.5 + 3.625)
    args = build_model_args("llama3", "debugmodel", 64)
    with torch.device("meta"):
        specs = layer_attention_specs(get_model_spec("llama3").model_cls(args))
    assert specs == [causal] * args.n_layers
    assert flops_per_token(1000, 6, 4, 8, 64, specs) == flops_per_token(1000, 6, 4, 8, 64)
    # a family that computes attention itself in some layers (no core to read a spec from):
    # those layers count as plain causal, not as free (a fork of gpt-oss counted 6N only)
    assert flops_per_token(1000, 3, 4, 8, 16, []) == flops_per_token(1000, 3, 4, 8, 16)
    assert flops_per_token(1000, 3, 4, 8, 16, [window]) == 6000 + per_head * (3.625 + 2 * 8.5)


def test_flops_per_token_llama3_8b_magnitude() -> None:
    n = 8_030_261_248 - 128_256 * 4096  # Llama 3 8B without its token embedding
    fpt = flops_per_token(n, n_layers=32, n_heads=32, head_dim=128, seq_len=8192)
    # 12 x 32 layers x 32 heads x 128 x (8192 + 1) / 2: causal attention at about half the keys
    assert fpt == 6 * 7_504_924_672 + 6_443_237_376  # about 51.5 GFLOP per token
    assert 5.14e10 < fpt < 5.16e10


def test_throughput_arithmetic() -> None:
    out = throughput(tokens=1000, seconds=2.0, flops_per_token=1e9, peak_flops=1e12)
    assert out["tokens_per_sec"] == pytest.approx(500.0)
    assert out["tflops"] == pytest.approx(0.5)  # 500 tok/s * 1e9 FLOP/tok = 5e11 FLOP/s
    assert out["mfu"] == pytest.approx(50.0)
    assert throughput(10, 0.0, 1e9, 1e12) == {"tokens_per_sec": 0.0, "tflops": 0.0, "mfu": 0.0}
    assert throughput(10, 1.0, 1e9, 0.0)["mfu"] == 0.0


def test_measure_matmul_flops_positive_and_keeps_rng_state() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    assert measure_matmul_flops(torch.device("cpu"), torch.float32, size=128, iters=2) > 0
    assert torch.equal(torch.rand(3), expected)


def test_cpu_calibration_is_cached(tmp_path) -> None:
    cache_dir = str(tmp_path / "cache")
    flops, source = device_peak_flops(torch.device("cpu"), torch.float32, cache_dir=cache_dir)
    assert flops > 0 and math.isfinite(flops)
    assert source.startswith("measured")
    cache_file = os.path.join(cache_dir, peak_flops_module.CACHE_FILE_NAME)
    assert os.path.isfile(cache_file)
    with open(cache_file) as f:
        (key,) = json.load(f)
    assert f"threads={torch.get_num_threads()}" in key and "float32" in key
    assert torch.__version__ in key

    again, cached_source = device_peak_flops(torch.device("cpu"), torch.float32, cache_dir)
    assert again >= flops  # the best rate seen is kept


def test_cpu_cache_keeps_the_best_rate_seen(tmp_path, monkeypatch) -> None:
    """A calibration taken while the machine was busy must not stick: later runs re-measure
    and a higher rate replaces it, a lower one does not."""
    rates = iter([1e11, 5e10, 2e11, 1.5e11])
    monkeypatch.setattr(peak_flops_module, "_calibrate_cpu", lambda dtype: (next(rates), 256))
    monkeypatch.setattr(peak_flops_module, "measure_matmul_flops", lambda *a, **k: next(rates))
    cpu, cache = torch.device("cpu"), str(tmp_path)
    assert device_peak_flops(cpu, torch.float32, cache)[0] == 1e11  # first run calibrates
    peak, source = device_peak_flops(cpu, torch.float32, cache)  # busy now: keep the cache
    assert peak == 1e11 and "best cached" in source and "0.050 TFLOP/s now" in source
    assert device_peak_flops(cpu, torch.float32, cache)[0] == 2e11  # quieter: raises it
    assert device_peak_flops(cpu, torch.float32, cache)[0] == 2e11
    with open(tmp_path / peak_flops_module.CACHE_FILE_NAME) as f:
        (entry,) = json.load(f).values()
    assert entry["flops"] == 2e11


def test_cpu_cache_is_refreshed_only_where_asked(tmp_path, monkeypatch) -> None:
    """A host's other ranks (refresh=False) take the cached rate without measuring; with no
    cache they still calibrate."""
    rates = iter([1e11, 3e11])
    monkeypatch.setattr(peak_flops_module, "_calibrate_cpu", lambda dtype: (next(rates), 256))
    monkeypatch.setattr(peak_flops_module, "measure_matmul_flops", lambda *a, **k: next(rates))
    cpu, cache = torch.device("cpu"), str(tmp_path)
    assert device_peak_flops(cpu, torch.float32, cache, refresh=False)[0] == 1e11
    peak, source = device_peak_flops(cpu, torch.float32, cache, refresh=False)
    assert peak == 1e11 and source.startswith("cached measurement"), source
    assert device_peak_flops(cpu, torch.float32, cache)[0] == 3e11  # refresh: measures


def test_cpu_cache_key_depends_on_cpu_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(peak_flops_module, "_CPU_MAX_SIZE", 256)
    cpu = torch.device("cpu")
    device_peak_flops(cpu, torch.float32, str(tmp_path))
    monkeypatch.setattr(peak_flops_module, "cpu_model_name", lambda: "Other CPU 9000")
    _, source = device_peak_flops(cpu, torch.float32, str(tmp_path))
    assert source.startswith("measured") and "Other CPU 9000" in source
    with open(tmp_path / peak_flops_module.CACHE_FILE_NAME) as f:
        assert len(json.load(f)) == 2


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H100 NVL", torch.bfloat16, 835e12),
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA H20", torch.bfloat16, 148e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A100 80GB PCIe", torch.float16, 312e12),
        ("NVIDIA A100-SXM4-40GB", torch.float32, 156e12),
        ("NVIDIA A10G", torch.bfloat16, 70e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("NVIDIA L40", torch.bfloat16, 181e12),
        ("NVIDIA B200", torch.bfloat16, 2.25e15),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4e12),
        ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, 1979e12),
        ("Tesla V100-SXM2-32GB", torch.bfloat16, None),
        ("Some Future GPU", torch.bfloat16, None),
        ("NVIDIA H100 80GB HBM3", torch.int8, None),
    ],
)
def test_lookup_gpu_peak(name: str, dtype: torch.dtype, expected: float | None) -> None:
    assert lookup_gpu_peak(name, dtype) == expected


def test_lookup_gpu_peak_fp32_without_tf32() -> None:
    assert lookup_gpu_peak("NVIDIA H100 80GB HBM3", torch.float32) == 494.7e12
    assert lookup_gpu_peak("NVIDIA H100 80GB HBM3", torch.float32, allow_tf32=False) == 66.9e12


def test_device_peak_flops_cuda_uses_table(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak, source = device_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == 989e12
    assert "datasheet" in source and "H200" in source


def test_device_peak_flops_unknown_gpu_measures_and_warns(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    monkeypatch.setattr(peak_flops_module, "measure_matmul_flops", lambda *a, **k: 4.2e14)
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        peak, source = device_peak_flops(torch.device("cuda"), torch.bfloat16, str(tmp_path))
    assert peak == 4.2e14 and source.startswith("measured")
    assert "Mystery GPU" in caplog.text
    _, source = device_peak_flops(torch.device("cuda"), torch.bfloat16, str(tmp_path))
    assert "cached" in source


def test_memory_readings_on_cpu() -> None:
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)  # a no-op on CPU, must not raise
    peak = peak_memory_gib(cpu)
    assert 0 < peak < 1024


TRAIN = {
    "loss": 7.1234,
    "grad_norm": 1.23,
    "lr": 8e-4,
    "tokens_per_sec": 1234.4,
    "tflops": 0.12,
    "mfu": 3.4,
    "memory_gib": 1.23,
    "step_time_s": 0.45,
    "data_time_s": 0.01,
}


def test_format_record_lines() -> None:
    assert format_record(10, TRAIN) == (
        "step 10 | loss 7.1234 | grad_norm 1.23 | lr 8.0e-04 | tok/s/dev 1,234 | tflops 0.12"
        " | mfu 3.4% | mem 1.23GiB | step 0.45s | data 0.010s"
    )
    assert format_record(20, {"loss": 2.0}, kind="validation") == (
        f"validation step 20 | loss 2.0000 | ppl {math.exp(2.0):.2f}"
    )


def test_metrics_logger_jsonl_tensorboard_console(tmp_path, caplog) -> None:
    dump = str(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        with MetricsLogger(dump, rank=0) as metrics:
            metrics.log(10, {**TRAIN, "extra": np.float32(0.5)})
            metrics.log(20, {**TRAIN, "loss": torch.tensor(6.5), "extra": 0.25})
            metrics.log(20, {"loss": 6.75}, kind="validation")
    assert "step 10 | loss 7.1234 |" in caplog.text
    assert "validation step 20 | loss 6.7500 | ppl" in caplog.text

    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [(r["step"], r["kind"]) for r in records] == [
        (10, "train"),
        (20, "train"),
        (20, "validation"),
    ]
    for key, value in TRAIN.items():
        assert records[0][key] == pytest.approx(value)
    assert records[0]["extra"] == 0.5
    assert records[1]["loss"] == 6.5
    assert records[2]["loss"] == 6.75

    acc = EventAccumulator(os.path.join(dump, "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/mfu", "train/extra", "validation/loss"} <= set(tags)
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(10, pytest.approx(7.1234)), (20, pytest.approx(6.5))]
    assert [(e.step, e.value) for e in acc.Scalars("validation/loss")] == [(20, 6.75)]


def test_metrics_logger_appends_and_flushes_each_line(tmp_path) -> None:
    dump = str(tmp_path)
    path = os.path.join(dump, "metrics.jsonl")
    first = MetricsLogger(dump, rank=0, enable_tensorboard=False, console=False)
    first.log(1, {"loss": 3.0})
    with open(path) as f:  # readable before close: a crashed run keeps its records
        assert json.loads(f.readline())["loss"] == 3.0
    first.close()
    first.close()
    with pytest.raises(RuntimeError, match=r"log\(\) called after close\(\)"):
        first.log(2, {"loss": 2.0})
    with MetricsLogger(dump, rank=0, enable_tensorboard=False, console=False) as resumed:
        resumed.log(2, {"loss": 2.0})
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert not os.path.exists(os.path.join(dump, "tb"))


def test_metrics_logger_rejects_bad_values(tmp_path) -> None:
    with MetricsLogger(str(tmp_path), rank=0, enable_tensorboard=False) as metrics:
        with pytest.raises(ValueError, match=r"metric names \['step'\] are reserved"):
            metrics.log(1, {"step": 3.0})
        with pytest.raises(TypeError, match="metric 'loss' must be a number, got str"):
            metrics.log(1, {"loss": "high"})


def test_metrics_logger_disabled_on_other_ranks(tmp_path) -> None:
    dump = tmp_path / "run"
    with MetricsLogger(str(dump), rank=1) as metrics:
        assert not metrics.enabled
        metrics.log(1, {"loss": 1.0})
    with MetricsLogger(str(dump), rank=0, enabled=False) as metrics:
        metrics.log(1, {"loss": 1.0})
    assert not dump.exists()


@pytest.mark.parametrize(
    "text, want",
    [
        ("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n", ["avx512_bf16"]),
        ("flags\t\t: fpu amx_bf16 amx_tile avx512_bf16\n", ["avx512_bf16", "amx_bf16"]),
        ("Features\t: fp asimd bf16 i8mm\n", ["bf16"]),
        ("flags\t\t: fpu avx2 avx512f\n", []),
    ],
)
def test_cpu_bf16_flags_read_from_cpuinfo(tmp_path, text, want):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert peak_flops_module.cpu_bf16_flags(str(cpuinfo)) == want
    assert peak_flops_module.cpu_bf16_flags(str(tmp_path / "missing")) == []
