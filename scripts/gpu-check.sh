#!/usr/bin/env bash
# Verify every CUDA path on one GPU, then run a short GPU benchmark; write a report.
#
# Runs on the lent GPU machine (no network): it uses that machine's torch, installs overlap
# without dependencies, and installs the wheels in .whl/ (made by scripts/gpu-wheels.sh on a
# machine with PyPI). Output: gpu-report.md, gpu-report.json, onebit-profile.txt and raw.tgz
# (the raw pieces) in $OUT, or ./gpu-check-out without it. Exits non-zero if any GPU test
# failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUTDIR="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
SITE="${TMPDIR:-/tmp}/overlap-gpu-site"
export PYTHONUNBUFFERED=1
t_start=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"
    # pip --target installs the mpich wheel's bin/ but drops its lib/: unpack that by hand.
    "$PY" - "$SITE/mpich" <<'PYEOF'
import glob, sys, zipfile
for whl in glob.glob(".whl/mpich-*.whl"):
    with zipfile.ZipFile(whl) as z:
        for m in z.namelist():
            if "/data/lib/" in m and not m.endswith("/"):
                z.extract(m, sys.argv[1])
PYEOF
    LIBMPI="$(find "$SITE/mpich" -name 'libmpi.so.12' 2>/dev/null | head -1)"
    if [ -x "$SITE/bin/mpiexec" ] && [ -n "$LIBMPI" ]; then
        # mpi4py's wheel holds builds for several MPI ABIs and picks the first libmpi.so it
        # can dlopen: on the GPU image that is the system Open MPI, which the mpich wheel's
        # mpiexec cannot launch (measured: segfault in PMPI_Iallreduce). Name the library:
        # mpi4py dlopens it globally and detects its ABI (MPI4PY_MPIABI would skip that load
        # and leave libmpi.so.12 to the loader, which does not look in $SITE).
        export OVERLAP_MPIEXEC="$SITE/bin/mpiexec"
        export MPI4PY_LIBMPI="$LIBMPI"
    fi
else
    echo "gpu-check: no .whl/ (run scripts/gpu-wheels.sh where PyPI is reachable); MPI cases" \
        "may skip" >&2
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || echo "gpu-check: editable install failed; using PYTHONPATH=$ROOT" >&2
"$PY" -m overlap.cli env > "$OUTDIR/env.txt" 2>&1
nvidia-smi -L >> "$OUTDIR/env.txt" 2>&1

echo "== tests/gpu"
"$PY" -m pytest tests/gpu -p no:cacheprovider -q -rA --timeout 300 \
    --junitxml="$OUTDIR/gpu-junit.xml" 2>&1 | tee "$OUTDIR/pytest.log"
tests_rc=${PIPESTATUS[0]}

echo "== overlap bench compress --device cuda"
timeout 240 "$PY" -m overlap.cli bench compress --device cuda --sizes 4MiB,64MiB,256MiB \
    --allreduce-size "" --reps 20 --json > "$OUTDIR/bench-compress.json" 2>"$OUTDIR/bench-compress.err"
echo "== overlap bench train --device cuda"
timeout 300 "$PY" -m overlap.cli bench train --device cuda --steps 20 --warmup 5 --json \
    > "$OUTDIR/bench-train.json" 2>"$OUTDIR/bench-train.err"

# where the one-rank 1-bit step's host time goes (20 ms of worker CPU a step on an H100 in
# the thirty-seventh session, against about 1 ms of codec GPU time): blocking CUDA calls and
# the top operators of every thread, with Chrome traces
echo "== scripts/gpu_onebit_profile.py"
OUT="$OUTDIR" timeout 150 "$PY" scripts/gpu_onebit_profile.py > "$OUTDIR/onebit-profile.txt" 2>&1
"$PY" scripts/gpu_report.py "$OUTDIR" "$tests_rc" "$(( $(date +%s) - t_start ))"
cat "$OUTDIR/gpu-report.md"
# The device tool brings back at most 8 files from $OUT: the report, the profile's text and
# one archive of the raw pieces (pytest log, junit, bench JSON, Chrome traces, env)
(cd "$OUTDIR" && find . -maxdepth 1 -type f ! -name gpu-report.md ! -name gpu-report.json \
    ! -name onebit-profile.txt ! -name raw.tgz -printf '%P\n' | tar czf raw.tgz -T - \
    --remove-files)
exit "$tests_rc"
