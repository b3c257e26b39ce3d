#!/usr/bin/env bash
# Whole test suite: bootstraps the pinned environment, checks lint/format, runs pytest.
# Extra arguments go to pytest: ./run_tests.sh tests/unit runs the fast tier (no process
# launch, well under 2 minutes) while developing; ./run_tests.sh -k config -x a subset.
# ./run_tests.sh --mutants runs the mutation check instead (scripts/mutation_check.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
if [ "${1:-}" = "--mutants" ]; then
  shift
  exec python scripts/mutation_check.py "$@"
fi
ruff check .
ruff format --check .
exec python -m pytest "$@"
