#!/usr/bin/env bash
# Whole test suite: bootstraps the pinned environment, checks lint/format, runs pytest.
# Extra arguments go to pytest (e.g. ./run_tests.sh -k config -x).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$ROOT/scripts/bootstrap_env.sh"
cd "$ROOT"
ruff check .
ruff format --check .
exec python -m pytest "$@"
