"""A per-rank timeline PNG (matplotlib, the ``plot`` extra): compute and comm lanes, with the
exposed communication (comm with no compute under it) highlighted."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from overlap.trace.report import intersect

__all__ = ["plot_timeline"]

_LANES = ["compute", "bucket", "comm", "wait"]
_COLORS = {"compute": "#4c72b0", "bucket": "#55a868", "comm": "#8172b2", "wait": "#c44e52"}


def plot_timeline(spans: list[Any], out: str, title: str = "overlap timeline") -> str:
    """Draw ``spans`` (from a Tracer or :func:`load_spans`) to ``out`` (PNG). Returns out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install overlap[plot]") from exc
    by_rank: dict[int, list[Any]] = defaultdict(list)
    for s in spans:
        by_rank[int(s[5].get("rank", 0))].append(s)
    if not spans:
        raise ValueError("the trace holds no spans to plot")
    t0 = min(s[2] for s in spans)
    ranks = sorted(by_rank)
    fig, ax = plt.subplots(figsize=(12, 1 + 1.2 * len(ranks)))
    yticks, ylabels = [], []
    for i, r in enumerate(ranks):
        base = (len(ranks) - 1 - i) * (len(_LANES) + 1)
        for j, lane in enumerate(_LANES):
            y = base + (len(_LANES) - 1 - j)
            iv = [
                ((s[2] - t0) / 1e6, (s[3] - s[2]) / 1e6)
                for s in by_rank[r]
                if s[1] == lane and s[3] > s[2]
            ]
            ax.broken_barh(iv, (y, 0.8), facecolors=_COLORS[lane])
            yticks.append(y + 0.4)
            ylabels.append(f"rank {r} {lane}")
        comm = [(s[2], s[3]) for s in by_rank[r] if s[1] == "comm"]
        comp = [(s[2], s[3]) for s in by_rank[r] if s[1] == "compute"]
        hidden = intersect(comm, comp)
        exposed = _subtract(comm, hidden)
        y = base + len(_LANES) - 1 - _LANES.index("comm")
        ax.broken_barh(
            [((a - t0) / 1e6, (b - a) / 1e6) for a, b in exposed],
            (y, 0.8),
            facecolors="none",
            edgecolors="red",
            linewidth=1.5,
        )
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel("ms (red outline: exposed communication)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _subtract(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> list[tuple[int, int]]:
    from overlap.trace.report import _merge

    out = []
    for a, b in _merge(xs):
        cur = a
        for c, d in ys:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out
