"""Profiling in a real 2-rank run: traces, the communication breakdown, CPU memory snapshots
declined."""

import json

from dist_utils import Run


def pool_runs(selected) -> list[Run]:
    return [Run("profiled", 2, ["--training.steps", "4", "--training.local_batch_size", "4",
                                "--profiling.enable_profiling", "true",
                                "--profiling.profile_freq", "4", "--profiling.profiler_warmup",
                                "1", "--profiling.profiler_active", "2",
                                "--profiling.enable_memory_snapshot", "true"])]  # fmt: skip


def test_two_rank_run_writes_traces_breakdown_and_declines_cpu_snapshots(runs):
    dump = runs["profiled"].check().folder
    for rank in (0, 1):
        trace = dump / "profile_traces" / "iteration_4" / f"rank{rank}_trace.json"
        names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
        assert "ProfilerStep#3" in names and "ProfilerStep#4" not in names
        assert any("allgather" in n or "all_gather" in n for n in names)  # FSDP's collectives
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    prof = [r for r in records if r["kind"] == "profile"]
    assert [r["step"] for r in prof] == [4]
    assert 0 < prof[0]["exposed_comm_s"] == prof[0]["comm_s"] and prof[0]["compute_s"] > 0
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["forward_backward_time_s"] > 0 for r in train)
    assert all(0 < r["optimizer_time_s"] < r["step_time_s"] for r in train)
    log = (dump / "logs" / "rank_0.log").read_text()
    assert log.count("memory snapshots record the CUDA caching allocator and are not") == 1
    assert not (dump / "memory_snapshot").exists()
