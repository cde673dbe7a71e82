"""Per-op bandwidth, as nccl-tests defines it: shared by the trace report and the comms logger.

algbw = size / time, where size is the op's whole buffer: the tensor for all_reduce,
broadcast, reduce, send and recv; world x this rank's input for the all-gathers (their
output); the whole input for reduce_scatter and all_to_all. busbw = algbw x a per-op factor
(all_reduce 2 (n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; barrier 0; the rest 1)
that makes it comparable with the link's own bandwidth
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

Lives in comm, not trace, so the comm layer's logger uses it without importing trace.
"""

from __future__ import annotations

__all__ = ["bandwidths", "busbw_factor", "op_size"]

_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_coalesced", "allgather_fn")
_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all")
_REDUCES = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce")


def _base(op: str) -> str:
    return op.split("[")[0]


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` on ``world`` ranks."""
    n = max(world, 1)
    base = _base(op)
    if base in _REDUCES:
        return 2 * (n - 1) / n
    if base in _GATHERS or base in _SCATTERS or base == "all_to_all_single":
        return (n - 1) / n
    if base in ("barrier", "monitored_barrier"):
        return 0.0
    return 1.0


def op_size(op: str, nbytes: int, world: int) -> int:
    """The op's whole buffer in bytes, from the bytes this rank contributes (``nbytes``)."""
    return nbytes * max(world, 1) if _base(op) in _GATHERS else nbytes


def bandwidths(op: str, nbytes: int, world: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second; 0 for a zero duration."""
    if seconds <= 0:
        return 0.0, 0.0
    alg = op_size(op, nbytes, world) / seconds
    return alg, alg * busbw_factor(op, world)
