"""Run under ``mpiexec -n 4``: the sub-group checks that need 4 ranks (a scheduler per
data-parallel group, hierarchical DiLoCo, a grid's groups under every op).

Prints one line per rank, ``RESULT {json}``: {check: "ok" | traceback}."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import overlap
from overlap import comm
from tests.gloo import diloco_cases as dl
from tests.gloo import scheduler_cases as sc
from tests.gloo import topology_cases as tc


def _schedulers() -> None:
    out = sc.schedulers_per_subgroup("onebit")
    assert out["disagree"].startswith("ValueError: BucketScheduler: the ranks disagree"), out


def _workers() -> None:
    out = dl.workers_of_several_ranks()
    assert out["syncs"] == 2 and out["same_ranks"].startswith("ValueError: this model's"), out


def _grid() -> None:
    r = comm.get_rank()
    got = tc.grid_groups_take_every_op()
    assert got[0] == (1.0 if r < 2 else 5.0) and got[1] == (1.5 if r < 2 else 3.5), got
    assert got[3], got


CHECKS: dict[str, Callable[[], Any]] = {
    "schedulers_per_subgroup": _schedulers,
    "workers_of_several_ranks": _workers,
    "grid_groups_take_every_op": _grid,
}


def main() -> None:
    overlap.init_distributed(dist_backend="mpi", timeout=60)
    results: dict[str, Any] = {"rank": comm.get_rank(), "world": comm.get_world_size()}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
        comm.barrier()
    sys.stdout.write("RESULT " + json.dumps(results) + "\n")
    sys.stdout.flush()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
