#!/usr/bin/env bash
# NOT YET RUN ON A GPU. Its arguments pass train.py's
# config checks on CPU (`CHECK_ONLY=1`, run by tests/integration/test_gpu_check.py).
#
# A Llama 3 8B-shaped model (dim 4096, 32 heads, 8 KV heads, the 8B FFN, a 128,256-token
# vocabulary) with as many layers as fit: bf16 compute (one GPU: autocast over fp32 params;
# several: FSDP2 with bf16 params and fp32 gradient reduction), selective activation
# checkpointing, seq 8192. Reports tokens/s, MFU (datasheet bf16 peak, measured matmul rate
# beside it) and peak memory per GPU, eager and compiled, through scripts/bench.py.
#
#   scripts/gpu_check.sh                 # one H200: 20 layers (scripts/estimate.py: 108 GiB)
#   NGPU=8 LAYERS=32 scripts/gpu_check.sh
#   OUT=/some/folder scripts/gpu_check.sh   # also copies the tables and run logs there
#
# First, scripts/attention_check.py: the attention backends on CUDA in bf16 (SDPA's causal
# kernels, FlexAttention over the block masks: document mask, sliding window, soft-cap, sinks
# through FlexAttention's log-sum-exp),
# forward and backward against float64, into benchmarks/gpu_attention/check.md.
#
# Offline by design (GPU machines here reach no network): the bundled sample corpus, and a
# synthetic tiktoken file with Llama 3's vocabulary size, so the embedding and output layers
# have the 8B shape (token statistics do not matter for speed). Results land in
# benchmarks/gpu_8b_eager/ and benchmarks/gpu_8b_compiled/ (two invocations: bench.py applies
# overrides to every row). Uses the machine's own python3 with its CUDA torch (>= 2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NGPU=${NGPU:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
LAYERS=${LAYERS:-20}
STEPS=${STEPS:-12}
TOKENIZER=${TOKENIZER:-/tmp/meshtrain_llama3_shaped.tiktoken}
"$PY" scripts/make_shaped_tokenizer.py "$TOKENIZER" 128000
TRAIN=(--config llama3_8b --model.n_layers "$LAYERS" --model.tokenizer_path "$TOKENIZER"
       --training.dataset sample --training.dataset_path "" --checkpoint.enable false
       --training.seq_len 8192 --training.local_batch_size 1
       --activation_checkpoint.mode selective)
if [ -n "${CHECK_ONLY:-}" ]; then  # config checks and model size only, no GPU needed
  exec "$PY" train.py "${TRAIN[@]}" --job.dry_run true
fi
[ "$NGPU" -ge 1 ] || { echo "gpu_check.sh: no GPU found (nvidia-smi -L); set NGPU" >&2; exit 2; }
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
status=0
mkdir -p benchmarks/gpu_attention
"$PY" scripts/attention_check.py --device cuda --dtype bfloat16 --seq 4096 \
    --output benchmarks/gpu_attention/check.md || status=$?
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/gpu_attention"; cp benchmarks/gpu_attention/check.md "$OUT/gpu_attention/" || true; fi
if [ "$NGPU" -gt 1 ]; then EAGER=("zero3_${NGPU}") COMPILED=("zero3_${NGPU}" --compile.enable true)
else EAGER=(single_eager) COMPILED=(single_compiled); fi
# Both invocations run even if one fails; with OUT set (a folder to collect results) each one's
# table (bench.md, bench.json) and its run's log (every logged step) are copied there, since
# OUT is what a remote run returns: 7 files in all with the attention check.
for kind in eager compiled; do
  [ "$kind" = eager ] && set -- "${EAGER[@]}" || set -- "${COMPILED[@]}"
  row=$1; shift
  folder=benchmarks/gpu_8b_$kind
  "$PY" scripts/bench.py "${TRAIN[@]}" "$@" --rows "$row" --baseline "$row" --steps "$STEPS" \
      --warmup 4 --repeats 1 --estimate --output "$folder" \
      --title "8B-shaped, ${LAYERS} layers, ${NGPU} GPUs, $kind" || status=$?
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/gpu_8b_$kind"
    cp "$folder"/bench.md "$folder"/bench.json "$OUT/gpu_8b_$kind/" 2>/dev/null || true
    cp "$folder/runs/$row.0/stdout.txt" "$OUT/gpu_8b_$kind/" 2>/dev/null || true
  fi
done
exit "$status"
