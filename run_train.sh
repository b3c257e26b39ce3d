#!/usr/bin/env bash
# Main job: trains the model of CONFIG (default: the debug model on the bundled corpus).
#   ./run_train.sh                               # all local GPUs, else 2 CPU ranks (gloo)
#   NGPU=4 CONFIG=llama3_8b ./run_train.sh --training.steps 50
# Environment: NGPU (ranks on this node), CONFIG (name in configs/ or a path),
# LOG_RANK (comma-separated ranks whose output is shown, default 0); extra args go to train.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
CONFIG="${CONFIG:-debug_model}"
if [ -z "${NGPU:-}" ]; then
  NGPU="$(python -c 'import torch; print(torch.cuda.device_count())')"
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
LOG_RANK="${LOG_RANK:-0}"
[ "$LOG_RANK" = 0 ] || export LOG_ALL_RANKS=1  # ranks other than 0 log to the console too
exec torchrun --standalone --nproc_per_node "$NGPU" --local-ranks-filter "$LOG_RANK" \
  train.py --config "$CONFIG" "$@"
