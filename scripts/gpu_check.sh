#!/usr/bin/env bash
# NOT YET RUN: written on a CPU-only machine for a future session that is lent GPUs.
#
# An 8B-shaped Llama 3 (dim 4096, 32 heads, 8 KV heads, the 8B FFN) with as many layers as
# fit one GPU's share, bf16 parameters with fp32 gradient reduction (FSDP2 mixed precision,
# the GPU default), selective activation checkpointing, seq 8192: tokens/s, MFU (datasheet
# bf16 peak) and peak memory per GPU, eager and compiled, through scripts/bench.py.
#
#   NGPU=8 LAYERS=8 STEPS=12 scripts/gpu_check.sh
#
# Two invocations (eager, then compiled) because bench.py applies overrides to every row;
# results land in benchmarks/gpu_8b_eager/ and benchmarks/gpu_8b_compiled/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
LAYERS=${LAYERS:-8}        # 8B has 32; lower it if the first step runs out of memory
# One GPU: a single process (bf16 by autocast); several: FSDP2 with bf16 mixed precision.
ROW=$([ "$NGPU" -gt 1 ] && echo "zero3_${NGPU}" || echo single_eager)
STEPS=${STEPS:-12}
COMMON=(--config llama3_8b --model.n_layers "$LAYERS" --training.seq_len 8192
        --training.local_batch_size 1 --activation_checkpoint.mode selective
        --rows "$ROW" --baseline "$ROW" --steps "$STEPS" --warmup 4
        --repeats 1 --estimate)
"$PY" scripts/bench.py "${COMMON[@]}" --output benchmarks/gpu_8b_eager \
    --title "8B-shaped, ${LAYERS} layers, ${NGPU} GPUs, eager"
"$PY" scripts/bench.py "${COMMON[@]}" --output benchmarks/gpu_8b_compiled \
    --title "8B-shaped, ${LAYERS} layers, ${NGPU} GPUs, compiled" --compile.enable true
