#!/usr/bin/env bash
# Creates (once) the project's virtual environment in .venv with the pinned requirements and
# meshtrain's packages installed in editable mode (importable from any folder, no sys.path
# edits). Idempotent and quick when nothing changed: reinstalls only when requirements.txt,
# pyproject.toml or the project's location changes.
# Sourced by run_train.sh and run_tests.sh; set MESHTRAIN_VENV to use another location.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MESHTRAIN_VENV:-$ROOT/.venv}"
STAMP="$VENV/.requirements.sha256"
WANT="$( (cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml"; echo "$ROOT") | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtual environment in $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[bootstrap] installing pinned requirements (first run takes a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/requirements.txt"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
