#!/usr/bin/env bash
# Install zoff (editable) into the active Python environment: `bash scripts/setup.sh` for the package,
# `bash scripts/setup.sh test` for the test extra as well.
# An installed torch is left alone. With none, a machine without an NVIDIA GPU gets the CPU build
# (torch==2.13.0, which this project's machines serve quickly) instead of the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install torch
  else
    "$PY" -m pip install "torch==2.13.0" || "$PY" -m pip install torch
  fi
fi

extra=""
[ "${1:-}" = "test" ] && extra="[test]"
"$PY" -m pip install -e ".${extra}"
