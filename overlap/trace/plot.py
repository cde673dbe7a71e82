"""Pictures of a trace (matplotlib, the ``plot`` extra).

* :func:`plot_timeline`: per rank, four lanes (compute; compress/decompress; collective;
  wait) over the chosen steps, exposed communication (a collective with no compute under
  it) outlined in red. By default the last two complete steps: warm-up and compile steps
  are left out, and two steps are wide enough to see each bucket.
* :func:`plot_compare`: the same lanes for several runs (e.g. one DDP step and one overlap
  step), each from its own start, on one time scale, so the hidden part can be compared.
* :func:`plot_step_bars`: step time per variant as bars, the compute-only floor drawn.

Steps are delimited by the ``step`` marks the BucketScheduler records at the end of each
``synchronize()``: step k runs from mark k-1 to mark k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from overlap.pictures import pyplot, save
from overlap.trace.report import _merge, intersect, spans_by_rank

__all__ = ["parse_steps", "plot_compare", "plot_step_bars", "plot_timeline", "select_steps"]

LANES = ["compute", "compress / decompress", "collective", "wait"]
_COLORS = ["#4c72b0", "#dd8452", "#8172b2", "#c44e52"]
_CODEC = ("compress", "server step", "decompress")


def parse_steps(text: str) -> slice:
    """``"10:12"`` (steps 10 and 11), ``"5"`` (step 5), ``"-2:"`` (the last two), ``":"``
    (all): Python slice syntax over the complete steps."""
    try:
        if ":" not in text:
            k = int(text)
            return slice(k, k + 1 if k != -1 else None)
        a, b = text.split(":", 1)
        return slice(int(a) if a.strip() else None, int(b) if b.strip() else None)
    except ValueError:
        raise ValueError(
            f"--steps {text!r}: write a step or a range in slice syntax, e.g. 10:12, 5, -2: or :"
        ) from None


def select_steps(spans: Sequence[Any], steps: slice | None = slice(-2, None)) -> list[Any]:
    """The spans that start inside the chosen complete steps, rank by rank (None: all)."""
    if steps is None:
        return list(spans)
    out: list[Any] = []
    for rank_spans in spans_by_rank(spans).values():
        marks = sorted(s[2] for s in rank_spans if s[1] == "step")
        if not marks:
            out += rank_spans  # no step marks: nothing to choose between
            continue
        bounds = [-(1 << 62), *marks]
        windows = [(bounds[k], bounds[k + 1]) for k in range(len(marks))][steps]
        if not windows:
            continue
        lo, hi = windows[0][0], windows[-1][1]
        if lo == -(1 << 62):  # step 0 starts at the first span
            lo = min(s[2] for s in rank_spans)
        out += [s for s in rank_spans if lo <= s[2] < hi and s[1] != "step"]
    return out


def _lane(s: Any) -> int | None:
    cat, name = s[1], s[0]
    if cat == "compute":
        return 0
    if cat == "user" and name.startswith(_CODEC):
        return 1
    if cat == "comm":
        return 2
    if cat == "wait":
        return 3
    return None


def _subtract(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> list[tuple[int, int]]:
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


def _draw(ax: Any, spans: list[Any], t0: int, base: float) -> list[tuple[float, str]]:
    """One rank's four lanes from y=base up; returns (y, lane) tick positions."""
    ticks = []
    for j, lane in enumerate(LANES):
        y = base + (len(LANES) - 1 - j)
        bars = [
            ((s[2] - t0) / 1e6, max(s[3] - s[2], 1) / 1e6)
            for s in spans
            if _lane(s) == j and s[3] >= s[2]
        ]
        ax.broken_barh(bars, (y, 0.8), facecolors=_COLORS[j])
        ticks.append((y + 0.4, lane))
        if lane == "collective":  # bucket numbers on bars wide enough to hold them
            xmax = max(((s[3] - t0) / 1e6 for s in spans), default=1.0)
            for s in spans:
                b = s[5].get("bucket")
                if _lane(s) == 2 and b is not None and (s[3] - s[2]) / 1e6 > 0.04 * xmax:
                    ax.text(
                        (s[2] + s[3] - 2 * t0) / 2e6, y + 0.4, f"b{b}", ha="center",
                        va="center", fontsize=6, color="white",
                    )  # fmt: skip
    comm = [(s[2], s[3]) for s in spans if s[1] == "comm"]
    comp = [(s[2], s[3]) for s in spans if s[1] == "compute"]
    exposed = _subtract(comm, intersect(comm, comp))
    ax.broken_barh(
        [((a - t0) / 1e6, (b - a) / 1e6) for a, b in exposed],
        (base + len(LANES) - 1 - 2, 0.8),
        facecolors="none",
        edgecolors="red",
        linewidth=1.5,
    )
    return ticks


def plot_compare(
    panels: Sequence[tuple[str, Sequence[Any]]], out: str, title: str = "overlap timeline"
) -> str:
    """Draw each ``(label, spans)`` panel, every rank from the panel's own first span, on one
    shared time axis, to ``out`` (PNG). Returns ``out``."""
    plt = pyplot()
    panels = [(label, list(sp)) for label, sp in panels if sp]
    if not panels:
        raise ValueError("the trace holds no spans to plot (in the chosen steps)")
    rows = sum(len(spans_by_rank(sp)) for _, sp in panels)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.15 * rows))
    yticks: list[float] = []
    ylabels: list[str] = []
    base = 0.0
    for label, sp in reversed(panels):
        ranks = spans_by_rank(sp)
        for r in sorted(ranks, reverse=True):
            t0 = min(s[2] for s in sp)
            for y, lane in _draw(ax, ranks[r], t0, base):
                yticks.append(y)
                head = f"{label} rank {r}" if label else f"rank {r}"
                ylabels.append(f"{head}: {lane}" if lane == "compute" else lane)
            base += len(LANES) + 1
        ax.axhline(base - 0.6, color="#999999", linewidth=0.6)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=7)
    ax.set_ylim(-0.5, base - 0.5)
    ax.set_xlabel("ms from the start of the step (red outline: exposed communication)")
    ax.set_title(title)
    fig.tight_layout()
    return save(fig, out)


def plot_timeline(
    spans: Sequence[Any],
    out: str,
    title: str = "overlap timeline",
    steps: slice | None = slice(-2, None),
) -> str:
    """Draw ``spans`` (from a Tracer or :func:`load_spans`) of the chosen ``steps`` (default
    the last two complete ones; None: all) to ``out`` (PNG). Returns out."""
    if not spans:
        raise ValueError("the trace holds no spans to plot")
    chosen = select_steps(spans, steps)
    if not chosen:
        raise ValueError(f"no spans in steps {steps.start}:{steps.stop} of this trace")  # type: ignore[union-attr]
    return plot_compare([("", chosen)], out, title)


def plot_step_bars(
    bars: Sequence[tuple[str, float]],
    out: str,
    floor_ms: float | None = None,
    title: str = "step time",
) -> str:
    """Step time (ms) per variant as horizontal bars, the compute-only floor as a line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.45 * len(bars)))
    names = [n for n, _ in bars][::-1]
    vals = [v for _, v in bars][::-1]
    colors = ["#8c8c8c" if n.startswith("ddp") else "#4c72b0" for n in names]
    ax.barh(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f} ms", va="center", fontsize=8)
    if floor_ms is not None:
        ax.axvline(floor_ms, color="#c44e52", linestyle="--", linewidth=1.2)
        ax.text(floor_ms, -0.45, " compute only", color="#c44e52", fontsize=8, va="bottom")
    ax.set_xlabel("median step time, ms (shorter is better)")
    ax.set_xlim(0, max(vals) * 1.18)
    ax.set_title(title)
    fig.tight_layout()
    return save(fig, out)
