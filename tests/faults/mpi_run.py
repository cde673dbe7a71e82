"""Under mpiexec: the fault scenarios that leave every rank alive, on the MPI backend.
Prints ``RESULT {json}`` per rank. (Kill and stop are covered on MPI by tests/mpi's
peer-death tests, where Hydra's own teardown is part of what is checked.)"""

from __future__ import annotations

import json
import sys

import overlap
from overlap import comm
from tests.faults import scenarios as sc

if __name__ == "__main__":
    overlap.init_distributed("mpi", timeout=60)
    res = {
        "rank": comm.get_rank(),
        "raise": sc.injected_raise_on_one_rank(),
        "bad_root": sc.bad_argument_on_the_root_only(),
        "closed_loop": sc.loop_closed_under_an_await(),
    }
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()
    comm.destroy_process_group()
