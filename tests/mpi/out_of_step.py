"""Under ``mpiexec -n 2``: the one-rank-failure cases of tests/gloo on MPI, with a 5 s job
timeout, and the every-rank-fails-alike one. Rank 0 prints ``RESULT <json>``: per rank,
what each step (scheduler) and each async multi-phase op (driver) did."""

from __future__ import annotations

import json

import overlap
from overlap import comm
from tests.gloo.hardening_cases import async_multiphase_failure_on_one_rank
from tests.gloo.scheduler_cases import every_rank_fails_alike, one_rank_failure_stops_every_rank

TIMEOUT = 5.0


def main() -> None:
    overlap.init_distributed("mpi", timeout=TIMEOUT)
    out = {
        "rank": comm.get_rank(),
        "start": one_rank_failure_stops_every_rank("start", TIMEOUT),
        "between": one_rank_failure_stops_every_rank("between", TIMEOUT),
        "driver": async_multiphase_failure_on_one_rank(TIMEOUT),
        "alike": every_rank_fails_alike(12),
    }
    everyone: list[object] = [None, None]
    comm.all_gather_object(everyone, out)  # one line from rank 0: the ranks' own interleave
    if comm.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
