"""What every benchmark shares: medians, byte formatting, a plain-text table and JSON.

Methods compared in one run are interleaved round-robin, iteration by iteration, so a burst
of noise on this shared machine hits all of them alike; ratios are taken between medians of
the same run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Progress",
    "Table",
    "human_bytes",
    "interval_cell",
    "median",
    "parse_size",
    "ratio_interval",
]


class Progress:
    """A progress bar on rank 0 of a benchmark or the demo; silent when disabled.

    A benchmark's bar (the default) is transient, on stderr, so that only the table stays
    on stdout; the demo's (``transient=False, stderr=False``) stays where its report is.

    It redraws only when it advances, never from a thread of its own: rich's default
    refresh thread wakes ten times a second and takes the GIL to rebuild the bar, on rank
    0, the rank whose timings are reported, in the middle of the ops it times (measured in
    a terminal: a busy thread stalled by up to 19.7 ms in 3 s with it, 0.3 ms without).
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        label: str = "benchmark",
        transient: bool = True,
        stderr: bool = True,
    ) -> None:
        self._p: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._p = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=stderr),
            transient=transient,
            auto_refresh=False,
        )
        self._task = self._p.add_task(label, total=total)
        self._p.start()

    def advance(self, what: str) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, description=what, refresh=True)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def ratio_interval(
    a: Sequence[float],
    b: Sequence[float],
    level: float = 0.9,
    resamples: int = 2000,
    paired: bool | None = None,
) -> tuple[float, float]:
    """A ``level`` bootstrap interval of ``median(a) / median(b)``: how far the ratio a run
    reports could move on this machine's noise alone.

    ``paired`` (default: when ``a`` and ``b`` are as long as each other): sample i of each
    comes from the same round of an interleaving, so one resample keeps both (a burst of
    noise that slowed a round slowed both); else each is resampled on its own. The
    percentile interval of ``resamples`` resamples, seeded, so the same timings give the
    same interval.

    Why: a ratio of medians from one noisy run is not a verdict (two identical calls read
    up to 1.05x apart at 16 MiB here, docs/benchmarks.md); the interval says whether a
    goal's threshold is inside what the run can tell apart. (nan, nan) with fewer than 2
    samples.
    """
    import torch

    n, m = len(a), len(b)
    if n < 2 or m < 2:
        return float("nan"), float("nan")
    g = torch.Generator().manual_seed(0)
    ta = torch.tensor(list(a), dtype=torch.float64)
    tb = torch.tensor(list(b), dtype=torch.float64)
    ia = torch.randint(n, (resamples, n), generator=g)
    pair = (n == m) if paired is None else paired and n == m
    ib = ia if pair else torch.randint(m, (resamples, m), generator=g)
    # statistics.median's (torch's median is the lower one for even n)
    sa, sb = ta[ia].sort(dim=1).values, tb[ib].sort(dim=1).values
    ma = (sa[:, (n - 1) // 2] + sa[:, n // 2]) / 2
    mb = (sb[:, (m - 1) // 2] + sb[:, m // 2]) / 2
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(ma / mb, q).tolist()
    return float(lo), float(hi)


def interval_cell(pair: Sequence[float] | None) -> str:
    """A ratio's interval as a table cell, ``0.97-1.06``; blank where a row has none (a
    row of an older run's JSON, a ratio of fewer than 2 samples)."""
    if not pair or any(x != x for x in pair):
        return ""
    return f"{pair[0]:.2f}-{pair[1]:.2f}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def parse_size(text: str) -> int:
    """``"4"``, ``"64KiB"``, ``"1M"``, ``"64MiB"`` -> bytes."""
    s = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise ValueError(f"cannot read size {text!r}; write e.g. 4, 64KiB, 1MiB") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


@dataclass
class Table:
    """Rows of dicts with a fixed column order; renders as aligned text or JSON."""

    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    title: str = ""

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    @staticmethod
    def fmt(v: Any) -> str:
        """A cell: floats rounded for reading (2 decimals, none from 100 up)."""
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    def render(self) -> str:
        cells = [[self.fmt(r.get(c, "")) for c in self.columns] for r in self.rows]
        widths = [
            max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)
        ]
        lines = [self.title] if self.title else []
        lines.append("  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
        return "\n".join(lines)

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        sep = "|" + "|".join("---" for _ in self.columns) + "|"
        body = [
            "| " + " | ".join(self.fmt(r.get(c, "")) for c in self.columns) + " |"
            for r in self.rows
        ]
        return "\n".join([head, sep, *body])

    def to_json(self) -> str:
        return json.dumps(
            {"title": self.title, "columns": self.columns, "rows": self.rows}, indent=2
        )
