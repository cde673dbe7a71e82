"""OverlapReport: how much communication was hidden behind compute, per step and in total.

Definitions (HTA's, applied to any device):

* compute time: the union of ``compute`` spans; comm time: the union of ``comm`` spans;
* hidden comm: the part of comm time that coincides with compute time;
* exposed comm = comm - hidden: communication nothing was computed under;
* overlap ratio = hidden / comm (1.0: all communication was hidden; 0.0: none was).

Several comm streams overlapping each other count once (unions), so two concurrent ops of
10 ms each under 10 ms of compute give comm 10 ms, hidden 10 ms, ratio 1.0.

Per op: algbw = size / time and busbw = algbw x the nccl-tests factor (all_reduce
2 (n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce, send, recv 1),
where size is the op's whole buffer (for all_gather: world x the input).
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from overlap.comm.bandwidth import busbw_factor, op_size

__all__ = ["OverlapReport", "busbw_factor", "intersect", "spans_by_rank", "union_length"]

# re-exported: the factor lives with the comm layer (overlap.comm.bandwidth)

Interval = tuple[int, int]


def _merge(intervals: Sequence[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def union_length(intervals: Sequence[Interval]) -> int:
    return sum(b - a for a, b in _merge(intervals))


def spans_by_rank(spans: Sequence[Any]) -> dict[int, list[Any]]:
    """The spans of each rank (a span's ``rank`` arg; 0 when it has none), in order."""
    out: dict[int, list[Any]] = defaultdict(list)
    for s in spans:
        out[int(s[5].get("rank", 0))].append(s)
    return out


def intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """The intersection of two interval sets (as merged intervals)."""
    a, b = _merge(xs), _merge(ys)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass
class StepStats:
    step: int
    compute_ms: float
    comm_ms: float
    hidden_ms: float
    exposed_ms: float
    overlap_ratio: float
    wait_ms: float


@dataclass
class OverlapReport:
    """Totals, per-step figures, a per-bucket table and per-op bandwidths (ms, bytes, GB/s)."""

    world: int
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    hidden_ms: float = 0.0
    exposed_ms: float = 0.0
    overlap_ratio: float = 0.0
    wait_ms: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    buckets: list[dict[str, Any]] = field(default_factory=list)
    ops: list[dict[str, Any]] = field(default_factory=list)
    ranks: int = 1

    @classmethod
    def from_spans(cls, spans: Sequence[Any], world: int = 1) -> OverlapReport:
        by_rank = spans_by_rank(spans)
        rep = cls(world=world, ranks=max(len(by_rank), 1))
        step_rows: dict[int, list[StepStats]] = defaultdict(list)
        totals: defaultdict[str, float] = defaultdict(float)
        for rank_spans in by_rank.values():
            marks = sorted(s[2] for s in rank_spans if s[1] == "step")
            bounds = [-(1 << 62), *marks, 1 << 62]
            for k in range(len(bounds) - 1):
                lo, hi = bounds[k], bounds[k + 1]
                part = [s for s in rank_spans if lo <= s[2] < hi]
                st = _stats(k, part)
                if st.comm_ms or st.compute_ms:
                    step_rows[k].append(st)
            whole = _stats(-1, rank_spans)
            for f in ("compute_ms", "comm_ms", "hidden_ms", "exposed_ms", "wait_ms"):
                totals[f] += getattr(whole, f)
        n = rep.ranks
        rep.compute_ms = totals["compute_ms"] / n
        rep.comm_ms = totals["comm_ms"] / n
        rep.hidden_ms = totals["hidden_ms"] / n
        rep.exposed_ms = totals["exposed_ms"] / n
        rep.wait_ms = totals["wait_ms"] / n
        rep.overlap_ratio = rep.hidden_ms / rep.comm_ms if rep.comm_ms else 0.0
        for k in sorted(step_rows):
            rows = step_rows[k]
            comm = sum(r.comm_ms for r in rows) / len(rows)
            hidden = sum(r.hidden_ms for r in rows) / len(rows)
            rep.steps.append(
                StepStats(
                    step=len(rep.steps),
                    compute_ms=sum(r.compute_ms for r in rows) / len(rows),
                    comm_ms=comm,
                    hidden_ms=hidden,
                    exposed_ms=comm - hidden,
                    overlap_ratio=hidden / comm if comm else 0.0,
                    wait_ms=sum(r.wait_ms for r in rows) / len(rows),
                )
            )
        rep.buckets = _buckets(spans)
        rep.ops = _ops(spans, world)
        return rep

    def to_dict(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "ranks": self.ranks,
            "compute_ms": self.compute_ms,
            "comm_ms": self.comm_ms,
            "hidden_ms": self.hidden_ms,
            "exposed_ms": self.exposed_ms,
            "overlap_ratio": self.overlap_ratio,
            "wait_ms": self.wait_ms,
            "steps": [vars(s) for s in self.steps],
            "buckets": self.buckets,
            "ops": self.ops,
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kw))

    def render(self, width: int = 110) -> str:
        """The report as rich tables, rendered to text."""
        from rich.console import Console
        from rich.table import Table

        con = Console(width=width, record=True, file=io.StringIO(), color_system=None)
        head = Table(
            title=f"overlap report ({self.ranks} rank(s) in the trace, world {self.world})"
        )
        for c in ("compute ms", "comm ms", "hidden ms", "exposed ms", "overlap ratio", "waited ms"):
            head.add_column(c, justify="right")
        head.add_row(
            *(
                f"{v:.2f}"
                for v in (
                    self.compute_ms,
                    self.comm_ms,
                    self.hidden_ms,
                    self.exposed_ms,
                    self.overlap_ratio,
                    self.wait_ms,
                )
            )
        )
        con.print(head)
        if self.steps:
            t = Table(title="per step (mean over ranks)")
            for c in ("step", "compute ms", "comm ms", "exposed ms", "overlap ratio"):
                t.add_column(c, justify="right")
            for s in self.steps:
                t.add_row(
                    str(s.step),
                    f"{s.compute_ms:.2f}",
                    f"{s.comm_ms:.2f}",
                    f"{s.exposed_ms:.2f}",
                    f"{s.overlap_ratio:.2f}",
                )
            con.print(t)
        if self.buckets:
            t = Table(title="per bucket (mean over steps and ranks)")
            for c in ("bucket", "bytes", "count", "ready->start ms", "reduce ms", "hidden frac"):
                t.add_column(c, justify="right")
            for b in self.buckets:
                t.add_row(
                    str(b["bucket"]),
                    str(b["bytes"]),
                    str(b["count"]),
                    f"{b['queue_ms']:.2f}",
                    f"{b['reduce_ms']:.2f}",
                    f"{b['hidden_fraction']:.2f}",
                )
            con.print(t)
        if self.ops:
            t = Table(title="per op (nccl-tests bandwidths)")
            for c in ("op", "count", "bytes", "mean ms", "algbw GB/s", "busbw GB/s"):
                t.add_column(c, justify="right")
            for o in self.ops:
                t.add_row(
                    o["op"],
                    str(o["count"]),
                    str(o["bytes"]),
                    f"{o['mean_ms']:.3f}",
                    f"{o['algbw_GBps']:.3f}",
                    f"{o['busbw_GBps']:.3f}",
                )
            con.print(t)
        text: str = con.export_text()
        return text

    def __str__(self) -> str:
        return self.render()


def _stats(step: int, spans: Sequence[Any]) -> StepStats:
    compute = [(s[2], s[3]) for s in spans if s[1] == "compute"]
    comm = [(s[2], s[3]) for s in spans if s[1] == "comm"]
    wait = [(s[2], s[3]) for s in spans if s[1] == "wait"]
    c = union_length(comm)
    h = union_length(intersect(comm, compute))
    return StepStats(
        step,
        union_length(compute) / 1e6,
        c / 1e6,
        h / 1e6,
        (c - h) / 1e6,
        h / c if c else 0.0,
        union_length(wait) / 1e6,
    )


def _buckets(spans: Sequence[Any]) -> list[dict[str, Any]]:
    compute_by_rank: dict[int, list[Interval]] = defaultdict(list)
    for s in spans:
        if s[1] == "compute":
            compute_by_rank[int(s[5].get("rank", 0))].append((s[2], s[3]))
    acc: dict[int, dict[str, Any]] = {}
    for s in spans:
        if s[1] != "bucket":
            continue
        a = s[5]
        b = acc.setdefault(
            int(a.get("bucket", -1)),
            {
                "bucket": int(a.get("bucket", -1)),
                "bytes": int(a.get("bytes", 0)),
                "count": 0,
                "queue": 0.0,
                "reduce": 0.0,
                "hidden": 0.0,
            },
        )
        b["count"] += 1
        b["reduce"] += (s[3] - s[2]) / 1e6
        if "ready_ns" in a:
            b["queue"] += max(s[2] - int(a["ready_ns"]), 0) / 1e6
        dur = s[3] - s[2]
        cover = union_length(intersect([(s[2], s[3])], compute_by_rank[int(a.get("rank", 0))]))
        b["hidden"] += cover / dur if dur else 0.0
    out = []
    for k in sorted(acc):
        b = acc[k]
        n = b["count"]
        out.append(
            {
                "bucket": k,
                "bytes": b["bytes"],
                "count": n,
                "queue_ms": b["queue"] / n,
                "reduce_ms": b["reduce"] / n,
                "hidden_fraction": b["hidden"] / n,
            }
        )
    return out


def _ops(spans: Sequence[Any], world: int) -> list[dict[str, Any]]:
    acc: dict[tuple[str, int], list[float]] = defaultdict(list)
    worlds: dict[tuple[str, int], int] = {}
    for s in spans:
        if s[1] != "comm":
            continue
        a = s[5]
        op = str(a.get("op", s[0]))
        w = int(a.get("world", world))
        size = op_size(op, int(a.get("bytes", 0)), w)
        acc[(op, size)].append((s[3] - s[2]) / 1e9)
        worlds[(op, size)] = w
    out = []
    for (op, size), ts in sorted(acc.items()):
        mean = sum(ts) / len(ts)
        alg = size / mean / 1e9 if mean > 0 else 0.0
        out.append(
            {
                "op": op,
                "bytes": size,
                "count": len(ts),
                "mean_ms": mean * 1e3,
                "algbw_GBps": alg,
                "busbw_GBps": alg * busbw_factor(op, worlds[(op, size)]),
            }
        )
    return out
