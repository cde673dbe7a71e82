#!/usr/bin/env bash
# Create .venv and install overlap with everything the tests and demo need.
# Development and CI pin torch==2.13.0 (the CPU build); the library itself needs torch>=2.2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, overlap, mpi4py; print('overlap', overlap.__version__, 'torch', torch.__version__)"
