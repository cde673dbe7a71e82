"""What an all_to_all of lists costs on gloo: overlap's (one all_to_all_single of the
tensors' bytes) against torch's own ``dist.all_to_all`` on even lists, the only kind
gloo's own takes.

Run: ``.venv/bin/python scripts/gloo_all_to_all_lists.py`` (2 gloo ranks on this host).
Rank 0 prints, per size (floats per tensor, two tensors a rank), the mean microseconds of
one call in each of three rounds, the two ways alternated round by round so the machine's
drift hits them alike (docs/benchmarks.md, "all_to_all of lists on gloo").
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

SIZES = [(1, 500), (1024, 500), (256 * 1024, 100), (4 << 20, 10)]  # (floats, calls)
ROUNDS = 3


def rank_main() -> dict[str, Any]:
    from overlap import comm

    w = comm.get_world_size()
    out: dict[str, Any] = {}
    for n, calls in SIZES:
        ins = [torch.randn(n) for _ in range(w)]
        outs = [torch.empty(n) for _ in range(w)]
        ways = {
            "torch": lambda o=outs, i=ins: dist.all_to_all(o, i),
            "overlap": lambda o=outs, i=ins: comm.all_to_all(o, i),
        }
        got: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(ROUNDS):
            for name, call in ways.items():
                call()  # warm
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                got[name].append(round((time.perf_counter() - t0) / calls * 1e6, 1))
        out[str(n)] = got
    return out


def main() -> None:
    from overlap.testing import spawn_ranks

    sys.stdout.write(json.dumps(spawn_ranks(rank_main, 2, timeout=600)[0], indent=1) + "\n")


if __name__ == "__main__":
    main()
