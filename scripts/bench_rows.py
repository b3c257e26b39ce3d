"""The rows of scripts/bench.py: what each one runs (train.py overrides, ranks, the bare
loop) and the data-parallel rows at any rank count (ddp_N, zero1_N, zero2_N, zero3_N)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PP_SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]
PP_SCHEDULES += ["ZBVZeroBubble", "DualPipeV"]  # V schedules: on CPU, torch >= 2.13


@dataclass
class Row:
    name: str
    nproc: int = 1
    args: list[str] = field(default_factory=list)
    bare: bool = False
    note: str = ""


def _rows() -> dict[str, Row]:
    z = "--parallelism.zero_stage"
    rows = [
        Row("bare", bare=True, note="hand-written PyTorch loop, same model"),
        Row("single_eager", note="train.py, 1 process"),
        Row("single_compiled", args=["--compile.enable", "true"], note="regional compile"),
        Row(
            "single_foreach_adamw",
            args=["--optimizer.implementation", "foreach"],
            note="foreach AdamW (the bare loop's kernel; auto takes fused)",
        ),
        Row("single_ac_full", args=["--activation_checkpoint.mode", "full"]),
        Row("single_ac_selective", args=["--activation_checkpoint.mode", "selective"]),
        Row("ddp_2", 2, [z, "0"], note="DDP"),
        Row("zero1_2", 2, [z, "1"], note="ZeRO-1"),
        Row("zero2_2", 2, [z, "2"], note="ZeRO-2"),
        Row("zero3_2", 2, [z, "3"], note="FSDP2 (ZeRO-3)"),
        Row("zero3_offload_2", 2, [z, "3", "--training.enable_cpu_offload", "true"]),
        Row(
            "ep2_2",
            2,
            [z, "3", "--parallelism.expert_parallel_degree", "2"],
            note="MoE: EP 2 (experts split, all-to-all), FSDP2 over the rest",
        ),
        Row("ddp_4", 4, [z, "0"], note="DDP"),
        Row("zero3_4", 4, [z, "3"], note="FSDP2 (ZeRO-3)"),
        Row(
            "tp_2",
            2,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            note="TP 2 + loss parallel",
        ),
    ]
    for s in PP_SCHEDULES:
        rows.append(
            Row(
                f"pp_2_{s}",
                2,
                [
                    "--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1",
                    "--parallelism.pipeline_parallel_schedule", s,
                ],
                note=f"PP 2, {s}",
            )
        )  # fmt: skip
    return {r.name: r for r in rows}


ROWS = _rows()
DEFAULT_ROWS = "bare,single_eager,single_compiled"
DP_ROW = re.compile(r"^(ddp|zero1|zero2|zero3)_(\d+)$")
DP_NOTES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "FSDP2 (ZeRO-3)"}


def get_row(name: str) -> Row | None:
    """A named row, or a data-parallel row at any rank count: ddp_N, zero1_N, zero2_N, zero3_N."""
    if name in ROWS:
        return ROWS[name]
    m = DP_ROW.match(name)
    if not m:
        return None
    stage = "0" if m[1] == "ddp" else m[1][-1]
    return Row(name, int(m[2]), ["--parallelism.zero_stage", stage], note=DP_NOTES[m[1]])
