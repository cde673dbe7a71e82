#!/usr/bin/env bash
# On a machine with PyPI (the development machine): fetch the wheels that the GPU machine
# lacks into .whl/ (git-ignored), for scripts/gpu-check.sh to install there without network.
# Being git-ignored, .whl/ travels to a lent device machine only when the run carries it.
# The GPU image has torch, numpy, uvloop, rich, pytest and pytest-timeout, but its mpi4py is
# built for Open MPI and it has no mpiexec to match and no pytest-asyncio: the mpich wheel and
# an mpi4py built for its ABI travel instead, as in the development venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "pytest-asyncio>=0.24" "mpi4py>=3.1" mpich 2>&1 | grep -v "^WARNING: Location" || true
ls .whl/*.whl
# The GPU image has no iproute2: `ip` and `tc` (with the libraries they need beyond glibc)
# travel too, for scripts/device-cpu-bench.sh's namespace hosts and shaped links.
mkdir -p .whl/netbin/lib
for tool in ip tc; do
    bin="$(command -v "$tool" || true)"
    [ -n "$bin" ] || { echo "gpu-wheels: no $tool here; the namespace benches will not run there" >&2; continue; }
    cp "$(readlink -f "$bin")" ".whl/netbin/$tool"
    ldd "$bin" | awk '/=> \// {print $3}' | grep -v -E '/lib(c|m|pthread|dl|rt)\.so' \
        | xargs -r -I{} cp -L {} .whl/netbin/lib/
done
ls .whl/netbin
