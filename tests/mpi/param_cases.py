"""Collectives and point-to-point ops on ``nn.Parameter`` tensors (leaves that require
grad) under mpiexec: every op, several dtypes, blocking and async, then the same Parameter
again (the ready calls). Prints one JSON line per rank: {"rank", "cases", "failed"}.

Before the forty-eighth session the MPI backend's own in-place writes (AVG's division, a
bfloat16 result copied back, a float max's keys turned back into floats) raised "a leaf
Variable that requires grad is being used in an in-place operation" after MPI had summed
into the tensor, and a reduce failed on its root alone, leaving the other ranks' next
collectives unmatched. The run stops at its first failure (the job timeout bounds a rank
left waiting), so a regression fails in seconds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import overlap
from overlap import comm


def _cases(r: int, w: int) -> list[tuple[str, Callable[[bool], Any], Callable[[], bool]]]:
    out: list[tuple[str, Callable[[bool], Any], Callable[[], bool]]] = []
    mine = float(r + 1)
    total = float(sum(range(1, w + 1)))
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64):
        name = str(dt).removeprefix("torch.")
        p = nn.Parameter(torch.zeros(4, dtype=dt))

        def fresh(p: nn.Parameter = p) -> nn.Parameter:
            with torch.no_grad():
                p.fill_(mine)
            return p

        want = {"sum": total, "avg": total / w, "max": float(w)}
        for op in ("sum", "avg") if dt.is_complex else ("sum", "avg", "max"):
            out.append(
                (
                    f"all_reduce {name} {op}",
                    lambda a, op=op, fresh=fresh: comm.all_reduce(fresh(), op=op, async_op=a),
                    lambda p=p, v=want[op]: bool((p.detach() == v).all()),
                )
            )
            out.append(
                (
                    f"reduce {name} {op}",
                    lambda a, op=op, fresh=fresh: comm.reduce(fresh(), 0, op=op, async_op=a),
                    lambda p=p, v=want[op]: r != 0 or bool((p.detach() == v).all()),
                )
            )
        out.append(
            (
                f"broadcast {name}",
                lambda a, fresh=fresh: comm.broadcast(fresh(), 0, async_op=a),
                lambda p=p: bool((p.detach() == 1.0).all()),
            )
        )
        gathered = nn.Parameter(torch.zeros(4 * w, dtype=dt))
        out.append(
            (
                f"all_gather_into_tensor {name}",
                lambda a, fresh=fresh, o=gathered: comm.all_gather_into_tensor(
                    o, fresh(), async_op=a
                ),
                lambda o=gathered: bool(
                    (o.detach().view(w, 4) == torch.arange(1, w + 1).view(w, 1)).all()
                ),
            )
        )
        shard = nn.Parameter(torch.zeros(4 // w, dtype=dt))
        out.append(
            (
                f"reduce_scatter_tensor {name} avg",
                lambda a, fresh=fresh, o=shard: comm.reduce_scatter_tensor(
                    o, fresh(), op="avg", async_op=a
                ),
                lambda o=shard: bool((o.detach() == total / w).all()),
            )
        )
        got = nn.Parameter(torch.zeros(4, dtype=dt))

        def sendrecv(a: bool, fresh: Callable[[], nn.Parameter] = fresh, got: Any = got) -> Any:
            hs = [comm.irecv(got, src=(r - 1) % w), comm.isend(fresh(), dst=(r + 1) % w)]
            return comm.collect_all(hs) if a else [h.wait() for h in hs]

        out.append(
            (
                f"sendrecv {name}",
                sendrecv,
                lambda got=got: bool((got.detach() == float((r - 1) % w + 1)).all()),
            )
        )
    return out


def main() -> None:
    overlap.init_distributed("mpi", timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 10)
    r, w = comm.get_rank(), comm.get_world_size()
    cases = _cases(r, w)
    failed: list[str] = []
    for name, run, ok in cases:
        try:
            for a in (False, True, False, True):  # the same Parameter again: the ready calls
                h = run(a)
                if a:
                    h.wait()
                if not ok():
                    failed.append(f"{name} (async_op={a}): wrong values")
                    break
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        if failed:
            break
    sys.stdout.write(json.dumps({"rank": r, "cases": len(cases), "failed": failed}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
