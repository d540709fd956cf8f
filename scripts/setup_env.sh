#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent).
# Reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.titan_cotrain-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[test,bench]"
    echo "$want" > "$stamp"
fi
