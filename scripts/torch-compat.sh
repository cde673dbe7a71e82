#!/usr/bin/env bash
# Run the tests against another torch release than the pinned one, in a venv of its own.
#   scripts/torch-compat.sh 2.2.2 [pytest args]      default args: tests/unit tests/gloo tests/faults
# overlap declares torch>=2.2 and CI pins torch==2.13.0; this is how the other ends of that
# range were checked (docs/architecture.md, "torch releases"). The venv is .venv-torch-VERSION
# (git-ignored). torch 2.13.0 and 2.14.1 lie on this machine's disk; others come from PyPI
# (a CUDA build, several GB; it runs on the CPU). torch before 2.3 was built against NumPy 1,
# so numpy<2 is installed with it.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: scripts/torch-compat.sh TORCH_VERSION [pytest args]}"
shift
PY="${PYTHON:-python3}"
VENV=".venv-torch-$VERSION"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
NUMPY=numpy
case "$VERSION" in 2.2.*) NUMPY="numpy<2" ;; esac
"$VENV/bin/python" -m pip install -q "torch==$VERSION" "$NUMPY" -e ".[dev]" 2>&1 \
    | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch, overlap; print('overlap', overlap.__version__, 'torch', torch.__version__)"
if [ "$#" -eq 0 ]; then set -- tests/unit tests/gloo tests/faults; fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
