#!/usr/bin/env bash
# Whole test suite: bootstraps the pinned environment, checks lint/format, runs pytest.
# Extra arguments go to pytest: ./run_tests.sh tests/unit runs the fast tier (no process
# launch, well under 2 minutes) while developing; ./run_tests.sh -k config -x a subset.
# ./run_tests.sh --mutants runs the mutation check instead (tests/mutation/run.py).
# ./run_tests.sh --matrix SEED draws the combination matrix's all-pairs design with another
# seed and runs it (tests/matrix.py; a table of every row at the end); ./run_tests.sh --design
# ARGS runs tests/matrix.py alone (--seed 7 prints a design; --help lists its options).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
if [ "${1:-}" = "--mutants" ]; then
  shift
  exec python tests/mutation/run.py "$@"
fi
# the matrix's generator imports the parity modules, which import `scripts.*` from the root
# (tests/, the script's own folder, is on the path already)
MATRIX_PATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--design" ]; then
  shift
  PYTHONPATH="$MATRIX_PATH" exec python tests/matrix.py "$@"
fi
if [ "${1:-}" = "--matrix" ]; then
  SEED=${2:?usage: ./run_tests.sh --matrix SEED [pytest arguments]}
  shift 2
  OUT=$(mktemp -d)
  PYTHONPATH="$MATRIX_PATH" python tests/matrix.py --seed "$SEED" --write "$OUT/design.json"
  status=0
  MESHTRAIN_MATRIX_DESIGN="$OUT/design.json" MESHTRAIN_MATRIX_REPORT="$OUT/report.jsonl" \
    python -m pytest tests/integration/test_combination_matrix.py "$@" || status=$?
  [ -f "$OUT/report.jsonl" ] && PYTHONPATH="$MATRIX_PATH" python tests/matrix.py --table "$OUT/report.jsonl"
  echo "design, report: $OUT"
  exit "$status"
fi
ruff check .
ruff format --check .
exec python -m pytest "$@"
