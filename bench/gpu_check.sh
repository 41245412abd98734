#!/usr/bin/env bash
# One command for a machine with one NVIDIA GPU: checks and times every GPU kernel.
# Installs nothing; needs the package importable (pip install -e . done, or run from the repo root).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 570 python bench/gpu_check.py "$@"
