#!/usr/bin/env bash
# The wheels a torch node without a package index needs for scripts/gpu_check.sh and
# scripts/smoke_8gpu.sh (their --wheels DIR): the stages' measured import closure less what the
# node has (torch, triton, numpy, safetensors and torch's own requirements), pinned to the
# project's versions; scripts/gpu_closure.py holds the list and says how it was measured and how
# to measure it again. For CPython 3.11 and 3.12 on x86-64 Linux (manylinux2014 / manylinux_2_28),
# binary wheels only (a pure-Python package's one py3-none-any wheel serves both): 13.1 MiB, at
# most 32 MiB (no matplotlib: the benchmarks leave their plots out without it). --pipeline adds
# what only smoke_8gpu.sh's pipeline stages import (datasets, pyarrow, pandas, ...: 145 MiB in all).
#   bash scripts/gpu_wheels.sh DIR [--pipeline]   # on a machine that reaches PyPI; then carry DIR to the node
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] && { [ $# -eq 1 ] || [ "$2" = --pipeline ]; } || {
    echo "usage: bash scripts/gpu_wheels.sh DIR [--pipeline]" >&2; exit 2; }
DIR=$(realpath -m -- "$1")
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mapfile -t PINS < <("$PYTHON" scripts/gpu_closure.py ${2:-})
mkdir -p "$DIR"
for version in 3.11 3.12; do
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$DIR" \
        --implementation cp --python-version "$version" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 "${PINS[@]}"
done
echo "$(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l) wheels for ${#PINS[@]} distributions," \
     "$(du -sb "$DIR" | awk '{printf "%.1f", $1 / 1048576}') MiB, in $DIR"
