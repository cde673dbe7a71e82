#!/usr/bin/env bash
# Create .venv and install overlap.
#   setup.sh        everything the tests need (the dev extra), bytecode compiled
#   setup.sh demo   only what the demo needs (the plot extra), in one pip call without
#                   byte-compiling: the demo's set-up is then about half as long (measured
#                   31 s against 63 s here); a later `setup.sh` compiles what it skipped
# Development and CI pin torch==2.13.0 (the CPU build); the library itself needs torch>=2.2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
MODE="${1:-dev}"
if [ "$MODE" != dev ] && [ "$MODE" != demo ]; then
    echo "usage: scripts/setup.sh [dev|demo]" >&2
    exit 2
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
quiet() { "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if [ "$MODE" = demo ]; then
    quiet .venv/bin/python -m pip install -q --no-compile "torch==2.13.0" -e ".[plot]"
    # Import what the demo's processes import, writing the bytecode of just those modules
    # (even where PYTHONDONTWRITEBYTECODE is set: this is our own .venv), and build the 1-bit
    # kernels into numba's cache: each of the demo's four processes then starts in ~2 s, not ~6.
    PYTHONDONTWRITEBYTECODE= .venv/bin/python -c "
import torch, torch.distributed, torch.distributed.launcher.api, torch.nn.parallel
import torch.distributed.algorithms.ddp_comm_hooks, matplotlib.pyplot, rich.progress
import overlap, overlap.cli, overlap.demo, overlap.trace.plot
from overlap.compression import OneBit, PowerSGD
OneBit()
print('overlap', overlap.__version__, 'torch', torch.__version__)"
    exit 0
fi
quiet .venv/bin/python -m pip install -q --upgrade pip
quiet .venv/bin/python -m pip install -q "torch==2.13.0" -e ".[dev]"
# bytecode for what a demo set-up installed without it (a pass with nothing to do: ~6 s)
.venv/bin/python -m compileall -q -j0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true
.venv/bin/python -c "import torch, overlap, mpi4py; print('overlap', overlap.__version__, 'torch', torch.__version__)"
