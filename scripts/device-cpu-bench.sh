#!/usr/bin/env bash
# The CPU benchmarks whose goals this 2-core development machine cannot settle (its ranks
# share two cores), run on the lent GPU machine's 16 CPU cores: several namespace hosts
# (issue 14), the ops (issue 15) and streaming DiLoCo (issue 21). Needs root there and the
# `ip`/`tc` that scripts/gpu-wheels.sh puts in .whl/netbin (run with carry [".whl"]).
# Output: one file per benchmark in $OUT (./device-cpu-out without it). About 7 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-$PWD/device-cpu-out}"
mkdir -p "$OUTDIR"
export PATH="$PWD/.whl/netbin:$PATH" LD_LIBRARY_PATH="$PWD/.whl/netbin/lib" PYTHONPATH="$PWD"
PY="${PYTHON:-python3}"
bench() {  # name, seconds, arguments
    local name=$1 secs=$2
    shift 2
    echo "== $name: overlap bench $*"
    timeout "$secs" "$PY" -m overlap.cli bench "$@" --markdown 2>"$OUTDIR/$name.err" \
        | tee "$OUTDIR/$name.md" | grep '^|'
}
"$PY" -m overlap.cli env | tee "$OUTDIR/env.txt"  # which CPU codec ran (numba or torch ops)
nproc >> "$OUTDIR/env.txt"
bench hosts-1gbit 240 train --hosts 2 --procs-per-host 2 --link 1gbit --variant compute \
    --variant ddp --variant ddp-fp16 --variant overlap-onebit-flat --variant overlap-onebit \
    --steps 8 --warmup 3
bench ops 170 ops --op all_reduce --op broadcast --op sendrecv --sizes 4,16MiB --iters 1500
bench diloco-1gbit 120 train --link 1gbit --pin-heap --variant compute --variant diloco \
    --variant diloco-streaming --steps 32 --warmup 8
echo "namespaces left: $(ip netns list | wc -l)"
