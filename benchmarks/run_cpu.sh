#!/usr/bin/env bash
# The CPU benchmark set whose folders docs/performance.md links (about an hour on 2 cores).
#   benchmarks/run_cpu.sh [part ...]
# parts (default: all): debug m50 m50_bf16 dp dp4 memory breakdown memory_bf16 layouts moe cp
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# the ~50M model: dim 512, 8 layers, seq 512 has 27.3M parameters in its blocks; a 22,016-token
# vocabulary (a synthetic tokenizer of that size; speed does not depend on which tokens) puts
# 22.5M in the embeddings and output, 49.8M in all. The bundled 4,096-token one gives 31.5M.
SHAPED=${SHAPED_TOKENIZER:-${TMPDIR:-/tmp}/meshtrain_shaped_22016.tiktoken}
"$PY" scripts/make_shaped_tokenizer.py "$SHAPED" 21760 >/dev/null
M50_SHAPE=(--model.dim 512 --model.n_layers 8 --model.n_heads 8 --model.n_kv_heads 8
           --training.seq_len 512 --model.tokenizer_path "$SHAPED")
M50=("${M50_SHAPE[@]}" --training.local_batch_size 2)
# the same model at 4 sequences per rank: ZeRO-3's extra traffic is fixed per step, so its
# cost relative to DDP falls as the tokens per rank and step rise
M50_B4=("${M50_SHAPE[@]}" --training.local_batch_size 4)
# model states dominate: 109M parameters in 32 thin layers (1.6 GiB of fp32 states under
# DDP; one layer's gathered weights and gradients are 3% of that), 64-token sequences
BIG=(--model.dim 512 --model.n_layers 32 --model.n_heads 8 --model.n_kv_heads 8
     --training.seq_len 64 --training.local_batch_size 1)
BF16=(--training.mixed_precision_param bfloat16)
SINGLE=bare,single_eager,single_foreach_adamw,single_compiled
SINGLE_BF16=bare,single_eager,single_compiled

# glibc keeps freed heap pages it cannot trim (fragmentation); tensors of 128 KiB and more
# mmapped straight from the OS are returned on free, so the RSS tracks what each layout
# really holds (costs page faults, i.e. speed: a measuring setting only)
memory() {  # output folder, precision words, extra overrides
  local out=$1 precision=$2; shift 2
  MALLOC_MMAP_THRESHOLD_=131072 "$PY" scripts/bench.py --rows ddp_4,zero3_4 --baseline ddp_4 \
    --estimate --repeats 1 --steps 3 --warmup 1 "${BIG[@]}" "$@" --output "$out" \
    --title "Memory per rank, DDP vs ZeRO-3, 4 ranks, $precision"
}

# the same two layouts' live-tensor peak by kind (what CUDA's max_memory_allocated counts;
# no glibc heap, no runtime): scripts/memory_breakdown.py
breakdown() {  # output folder, precision words, extra overrides
  local out=$1/breakdown.md precision=$2 stage; shift 2
  mkdir -p "$(dirname "$out")"
  { echo "# Live-tensor peak per rank by kind, DDP vs ZeRO-3, 4 ranks, $precision"; echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- machine: $(uname -srm), $(nproc) cores; torch $("$PY" -c 'import torch; print(torch.__version__)')"
    for stage in 0 3; do
      echo "- command: \`torchrun --standalone --nproc_per_node 4 scripts/memory_breakdown.py ${BIG[*]} $* --parallelism.zero_stage $stage\`"
    done; echo
    for stage in 0 3; do
      "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 scripts/memory_breakdown.py \
        "${BIG[@]}" "$@" --parallelism.zero_stage $stage 2>/dev/null; echo
    done; } > "$out.tmp" && mv "$out.tmp" "$out" && cat "$out"
}

# context parallelism where activations dominate: 4 layers of dim 256 on 4,096-token sequences
# (0.6M block parameters), bf16 compute (the estimator counts 16-bit activations); 4 ranks at
# CP 1 (FSDP 4), CP 2 x FSDP 2 and CP 4: the weights are sharded over 4 ranks in all three
CP_SHAPE=(--model.dim 256 --model.n_layers 4 --model.n_heads 4 --model.n_kv_heads 2
          --training.seq_len 4096 --training.local_batch_size 1 "${BF16[@]}")
cp_memory() {  # output folder
  local out=$1/breakdown.md cp; mkdir -p "$1"
  { echo "# Live-tensor peak per rank by kind at CP 1 / 2 / 4, 4 ranks, bf16 compute"; echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- machine: $(uname -srm), $(nproc) cores; torch $("$PY" -c 'import torch; print(torch.__version__)')"
    echo "- command: \`torchrun --standalone --nproc_per_node 4 scripts/memory_breakdown.py ${CP_SHAPE[*]} --parallelism.context_parallel_degree C\`"
    echo
    for cp in 1 2 4; do
      "$PY" -m torch.distributed.run --standalone --nproc_per_node 4 scripts/memory_breakdown.py \
        "${CP_SHAPE[@]}" --parallelism.context_parallel_degree $cp \
        --output "$1/cp$cp.json" 2>/dev/null; echo
    done; } > "$out.tmp" && mv "$out.tmp" "$out" && cat "$out"
}

# the MoE debug flavor (8 experts, top-2) at its own width, EP 1 (FSDP 2) vs EP 2
MOE=(--model.name qwen3_moe --model.flavor debugmodel)

for part in "${@:-debug m50 m50_bf16 dp dp4 memory breakdown memory_bf16 layouts moe cp}"; do
  for p in $part; do
    case $p in
      cp) cp_memory benchmarks/cpu_cp_memory ;;
      moe) "$PY" scripts/bench.py --rows zero3_2,ep2_2 --baseline zero3_2 --repeats 3 --steps 10 \
               --warmup 3 "${MOE[@]}" --output benchmarks/cpu_moe_ep2 \
               --title "Qwen3-MoE debug model, EP 1 (FSDP 2) vs EP 2, 2 ranks" ;;
      debug) "$PY" scripts/bench.py --rows $SINGLE --repeats 8 --steps 10 --warmup 4 \
               --output benchmarks/cpu_debug_single --title "Single process, debug model" ;;
      m50) "$PY" scripts/bench.py --rows $SINGLE --repeats 6 --steps 10 --warmup 4 "${M50[@]}" \
               --output benchmarks/cpu_m50_single --title "Single process, ~50M model" ;;
      # bf16 compute (this CPU has avx512_bf16: its bf16 matmuls run about 2x its fp32 ones);
      # the bare loop runs under torch.autocast, MFU is against the measured bf16 matmul rate
      m50_bf16) "$PY" scripts/bench.py --rows $SINGLE_BF16 --repeats 4 --steps 10 --warmup 4 \
               "${M50[@]}" "${BF16[@]}" --output benchmarks/cpu_m50_single_bf16 \
               --title "Single process, ~50M model, bf16 compute" ;;
      dp) "$PY" scripts/bench.py --rows ddp_2,zero1_2,zero2_2,zero3_2 --baseline ddp_2 \
               --estimate --repeats 4 --steps 7 --warmup 3 "${M50[@]}" \
               --output benchmarks/cpu_m50_dp2 --title "DDP vs ZeRO-1/2/3, 2 ranks, ~50M model" ;;
      dp4) "$PY" scripts/bench.py --rows ddp_2,zero1_2,zero2_2,zero3_2 --baseline ddp_2 \
               --estimate --repeats 4 --steps 7 --warmup 3 "${M50_B4[@]}" \
               --output benchmarks/cpu_m50_dp2_b4 \
               --title "DDP vs ZeRO-1/2/3, 2 ranks, ~50M model, 4 sequences per rank" ;;
      memory) memory benchmarks/cpu_memory_4 "fp32" ;;
      breakdown) breakdown benchmarks/cpu_memory_4 "fp32" ;;
      # the GPU default precision: bf16 compute weights, fp32 master weights and reduction
      memory_bf16) memory benchmarks/cpu_memory_4_bf16 "bf16 compute, fp32 reduction" "${BF16[@]}"
                   breakdown benchmarks/cpu_memory_4_bf16 "bf16 compute, fp32 reduction" "${BF16[@]}" ;;
      layouts) "$PY" scripts/bench.py --rows bare,single_eager,single_ac_full,single_ac_selective,ddp_2,zero3_2,zero3_offload_2,tp_2,pp_2_1F1B,pp_2_GPipe,pp_2_Interleaved1F1B,pp_2_LoopedBFS,pp_2_InterleavedZeroBubble,pp_2_ZBVZeroBubble,pp_2_DualPipeV \
               --repeats 1 --steps 6 --warmup 2 \
               --output benchmarks/cpu_debug_layouts --title "Every layout, debug model" ;;
      *) echo "unknown part $p" >&2; exit 2 ;;
    esac
  done
done
