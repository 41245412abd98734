#!/usr/bin/env bash
# One command for a machine with one NVIDIA GPU: checks and times every GPU kernel.
# Installs nothing; needs the package importable (pip install -e . done, or run from the repo root).
# PYTHON picks the interpreter (default: python3, the one that holds torch on most GPU images).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
exec timeout 570 "$PY" bench/gpu_check.py "$@"
