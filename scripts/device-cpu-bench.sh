#!/usr/bin/env bash
# The CPU benchmarks whose goals this 2-core development machine cannot settle (its ranks
# share two cores), run on the lent GPU machine's 16 CPU cores: several namespace hosts
# (issue 14), streaming DiLoCo (issue 21) and the awaited ops on gloo and MPI (issue 15).
# Needs root there and the `ip`/`tc` that scripts/gpu-wheels.sh puts in .whl/netbin (run
# with carry [".whl"]); the MPI ops use the mpich/mpi4py wheels that scripts/gpu-check.sh
# installed (run it first in the same command; without them that bench is skipped).
# Output: a JSON file (and its stderr) per benchmark in $OUT (./device-cpu-out without it).
# DEADLINE (epoch seconds, optional): a benchmark whose time limit would run past it is
# skipped, so a lease-bound run ends with the results it had time for. The benchmarks run
# in the order of what is least settled; about 14 minutes with no deadline.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-$PWD/device-cpu-out}"
mkdir -p "$OUTDIR"
SITE="${TMPDIR:-/tmp}/overlap-gpu-site"
export PATH="$PWD/.whl/netbin:$PATH" LD_LIBRARY_PATH="$PWD/.whl/netbin/lib" PYTHONPATH="$PWD"
PY="${PYTHON:-python3}"
DEADLINE="${DEADLINE:-0}"
past_deadline() {  # seconds: would a run of that long end past DEADLINE?
    [ "$DEADLINE" -gt 0 ] && [ $(( $(date +%s) + $1 )) -gt "$DEADLINE" ]
}
bench() {  # name, seconds, arguments
    local name=$1 secs=$2
    shift 2
    if past_deadline "$secs"; then
        echo "== $name: skipped (its $secs s would pass the deadline)"
        return
    fi
    echo "== $name: overlap bench $* ($(date -u +%H:%M:%S))"
    # JSON keeps every field (per-step times, the buckets' timeline, CPU per thread), which
    # a later session can read without device time; the summary is for the run's output.
    timeout "$secs" "$PY" -m overlap.cli bench "$@" --json >"$OUTDIR/$name.json" \
        2>"$OUTDIR/$name.err" && "$PY" scripts/bench_summary.py "$OUTDIR/$name.json"
}
"$PY" -m overlap.cli env | tee "$OUTDIR/env.txt"  # which CPU codec ran (numba or torch ops)
nproc >> "$OUTDIR/env.txt"
ONEBIT=(--variant compute --variant overlap-onebit-flat --variant overlap-onebit)
# streaming DiLoCo against its own model (`own_compute_ms`, 36th session) and the awaited
# pair handed off together (36th session) first: changed since the last run here
bench diloco-1gbit 140 train --link 1gbit --pin-heap --variant compute --variant diloco \
    --variant diloco-streaming --steps 64 --warmup 8
bench ops 100 ops --op all_reduce --op broadcast --op sendrecv --sizes 4,16MiB --iters 1500
# the same with 3 torch threads a rank (12 of 16 cores): with one thread a rank, compute
# and the codec's CPU fill the step at 1 Gbit/s and node's halving of the bytes between
# hosts has little to show; faster compute may change that (docs/cluster.md, 30th session)
bench hosts-1gbit-threads 150 train --hosts 2 --procs-per-host 2 --link 1gbit --threads 3 \
    --variant compute --variant ddp --variant overlap-onebit-flat --variant overlap-onebit \
    --steps 8 --warmup 3
if [ -x "$SITE/bin/mpiexec" ]; then
    LIBMPI="$(find "$SITE/mpich" -name 'libmpi.so.12' 2>/dev/null | head -1)"
    PYTHONPATH="$SITE:$PWD" OVERLAP_MPIEXEC="$SITE/bin/mpiexec" MPI4PY_LIBMPI="$LIBMPI" \
        PATH="$SITE/bin:$PATH" bench ops-mpi 90 ops --backend mpi --op all_reduce \
        --op sendrecv --sizes 8,1MiB --iters 1500
    # the thinnest Python handles against overlap's, 8 B and 1 MiB (docs/architecture.md,
    # "The floor of a Python handle"): where a core is free for each rank's Python
    for size in 8 1048576; do
        if past_deadline 60; then
            break
        fi
        echo "== p2p-floor $size ($(date -u +%H:%M:%S))"
        PYTHONPATH="$SITE:$PWD" MPI4PY_LIBMPI="$LIBMPI" PATH="$SITE/bin:$PATH" timeout 60 \
            "$SITE/bin/mpiexec" -n 2 "$PY" scripts/mpi_p2p_floor.py "$size" \
            | tee "$OUTDIR/p2p-floor-$size.txt"
    done
fi
bench hosts-1gbit 200 train --hosts 2 --procs-per-host 2 --link 1gbit --variant compute \
    --variant ddp --variant ddp-fp16 --variant overlap-onebit-flat --variant overlap-onebit \
    --steps 8 --warmup 3
bench hosts-1gbit-2 110 train --hosts 2 --procs-per-host 2 --link 1gbit "${ONEBIT[@]}" \
    --steps 8 --warmup 3
# diloco-1gbit with the pseudo-gradient pass inside step(): diloco-1gbit takes it on a thread
# of its own (pass_thread=None picks that with a core to spare per rank), which on 2 cores
# took half of step() off the training thread without a faster step (docs/diloco.md)
bench diloco-1gbit-2 120 train --link 1gbit --pin-heap --variant compute \
    --variant diloco-streaming --steps 64 --warmup 8 --diloco-pass-thread off
# H = 8, the bench's default until the thirty-fifth session (32 since: on 2 cores the median
# step met 1.05x in 9 of 14 runs at 32, in none at 8; docs/diloco.md "H for the link and the
# cores"), with the 16 cores' spare ones
bench diloco-1gbit-h8 120 train --link 1gbit --pin-heap --variant compute \
    --variant diloco-streaming --steps 64 --warmup 8 --diloco-sync-every 8
bench hosts-1gbit-3 110 train --hosts 2 --procs-per-host 2 --link 1gbit "${ONEBIT[@]}" \
    --steps 8 --warmup 3
echo "namespaces left: $(ip netns list | wc -l)"
