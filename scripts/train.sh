#!/usr/bin/env bash
# Run the main job (creates/refreshes .venv first).
#   bash scripts/train.sh [--job.config_file F] [--section.key value ...]
# NPROC (default 2) processes on this machine; the embedded default config runs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The config checked once, in one process, before the ranks start: a bad key prints one message.
.venv/bin/python -m titan_cotrain.config.check --world-size "${NPROC:-2}" "$@" || exit $?
exec .venv/bin/torchrun --standalone --nproc_per_node "${NPROC:-2}" -m titan_cotrain.train "$@"
