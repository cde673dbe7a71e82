"""Tracer, report and Chrome export, single process."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from overlap.trace import OverlapReport, TraceFormatError, Tracer, load_spans
from overlap.trace.report import busbw_factor

MS = 1_000_000


def spans(*items: tuple[str, int, int]) -> list[tuple]:
    return [(cat, cat, a * MS, b * MS, 1, {}) for cat, a, b in items]


@pytest.mark.parametrize(
    ("items", "comm", "hidden", "ratio"),
    [
        ([("compute", 0, 100), ("comm", 10, 60)], 50, 50, 1.0),  # full overlap
        ([("compute", 0, 50), ("comm", 60, 100)], 40, 0, 0.0),  # none
        ([("compute", 0, 100), ("comm", 80, 140)], 60, 20, 1 / 3),  # partial
        # two comm streams overlapping each other count once
        ([("compute", 0, 60), ("comm", 10, 50), ("comm", 30, 90)], 80, 50, 50 / 80),
        # several compute spans, one comm across them
        ([("compute", 0, 10), ("compute", 20, 30), ("comm", 5, 25)], 20, 10, 0.5),
    ],
)
def test_overlap_ratio_on_known_answers(
    items: list[tuple[str, int, int]], comm: float, hidden: float, ratio: float
) -> None:
    rep = OverlapReport.from_spans(spans(*items))
    assert rep.comm_ms == pytest.approx(comm)
    assert rep.hidden_ms == pytest.approx(hidden)
    assert rep.exposed_ms == pytest.approx(comm - hidden)
    assert rep.overlap_ratio == pytest.approx(ratio)


def test_report_splits_steps_at_marks() -> None:
    s = spans(
        ("compute", 0, 10), ("comm", 5, 20), ("step", 25, 25), ("compute", 30, 40), ("comm", 30, 35)
    )
    rep = OverlapReport.from_spans(s)
    assert [round(x.overlap_ratio, 3) for x in rep.steps] == [round(5 / 15, 3), 1.0]
    d = rep.to_dict()
    assert json.loads(rep.to_json())["steps"][1]["comm_ms"] == pytest.approx(5)
    assert d["overlap_ratio"] == pytest.approx(10 / 20)
    text = rep.render()
    assert "overlap report" in text and "per step" in text


def test_busbw_factors_are_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert busbw_factor("all_gather_into_tensor", 4) == pytest.approx(0.75)
    assert busbw_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert busbw_factor("broadcast", 8) == 1.0


def make_trace() -> Tracer:
    t = Tracer()
    with t.span("forward"):
        torch.ones(100).sum()
    t.record("all_reduce", "comm", 1000, 5000, op="all_reduce", bytes=4096, world=2)
    t.record("all_reduce", "comm", 2000, 9000, op="all_reduce", bytes=4096, world=2)
    t.record("reduce bucket 0", "bucket", 3000, 4000, bucket=0, bytes=10, flow=1, ready_ns=2500)
    t.step()
    return t


def test_chrome_export_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    assert make_trace().export_chrome(str(path)) == str(path)
    assert path.stat().st_mode & 0o044  # readable by others, like any file the user writes
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    open_async: dict[str, dict] = {}
    for e in events:
        assert e["ph"] in {"X", "b", "e", "i", "M", "s", "f"}
        assert {"ph", "pid", "name"} <= set(e)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int) and "tid" in e
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "b":
            assert e["id"] not in open_async
            open_async[e["id"]] = e
        if e["ph"] == "e":
            b = open_async.pop(e["id"])
            assert b["name"] == e["name"] and e["ts"] >= b["ts"]
    assert not open_async  # every async begin has its end
    names = {e["name"] for e in events if e["ph"] == "M"}
    assert {"process_name", "thread_name"} <= names
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)
    spans_back, world = load_spans(str(path))
    assert sum(1 for s in spans_back if s[1] == "comm") == 2
    rep = OverlapReport.from_spans(spans_back, world=world)
    assert rep.ops and rep.ops[0]["busbw_GBps"] > 0


def test_truncated_and_foreign_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    make_trace().export_chrome(str(path))
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[:200])
    with pytest.raises(TraceFormatError, match="truncated"):
        load_spans(str(cut))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(TraceFormatError, match="not a Chrome trace"):
        load_spans(str(other))
    with pytest.raises(TraceFormatError, match="no such file"):
        load_spans(str(tmp_path / "missing.json"))
    # before: IsADirectoryError and UnicodeDecodeError tracebacks from `overlap trace`
    with pytest.raises(TraceFormatError, match="is a directory: pass the trace file"):
        load_spans(str(tmp_path))
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(TraceFormatError, match="is not a text file, so not a trace"):
        load_spans(str(binary))
    # a torch.profiler trace: before, `overlap trace summarize` printed a table of zeros
    prof = tmp_path / "prof.json"
    prof.write_text(
        json.dumps(
            {"traceEvents": [{"name": "aten::mm", "cat": "cpu_op", "ph": "X", "ts": 1, "dur": 5}]}
        )
    )
    with pytest.raises(TraceFormatError, match=r"no overlap spans .* categories: cpu_op\)"):
        load_spans(str(prof))
    # an event edited by hand: before, a KeyError or ValueError traceback
    doc = json.loads(path.read_text())
    next(e for e in doc["traceEvents"] if e.get("ph") == "X").pop("ts")
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError, match="an event it cannot read \\(KeyError: 'ts'\\)"):
        load_spans(str(edited))


def test_a_gz_path_is_written_gzipped_and_read_back(tmp_path: Path) -> None:
    """As torch.profiler's export_chrome_trace: a ``.gz`` path gets gzip (before, plain JSON
    under a .gz name), and ``overlap trace`` reads a gzipped trace by its magic bytes."""
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    tracer = make_trace()
    tracer.export_chrome(str(plain))
    tracer.export_chrome(str(packed))
    raw = packed.read_bytes()
    assert raw[:2] == b"\x1f\x8b" and len(raw) < plain.stat().st_size
    assert json.loads(gzip.decompress(raw)) == json.loads(plain.read_text())
    assert load_spans(str(packed)) == load_spans(str(plain))
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TraceFormatError, match="is gzip but cannot be unpacked"):
        load_spans(str(cut))


def test_unwritable_path_errors_and_leaves_nothing(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: use a missing dir instead
            target = tmp_path / "no" / "such" / "dir" / "t.json"
        else:
            target = locked / "t.json"
        with pytest.raises(OSError, match="cannot write the trace"):
            make_trace().export_chrome(str(target))
        assert not target.exists()
        assert list(locked.iterdir()) == []
        with pytest.raises(IsADirectoryError, match="it is a directory; pass a file path"):
            make_trace().export_chrome(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["locked"]
    finally:
        os.chmod(locked, 0o700)


def test_user_spans_reach_torch_profiler() -> None:
    t = Tracer()
    with torch.profiler.profile() as prof, t.span("my-forward"):
        torch.ones(10).sum()
    assert any(e.name == "my-forward" for e in prof.events())
    assert t.spans[0][0] == "my-forward"


def test_cli_summarize_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """summarize and plot as a user runs them (a process each); their refusals of bad input
    in this process (each process costs a torch import)."""
    from tests.unit.test_cli import assert_cli_refuses

    path = tmp_path / "t.json"
    make_trace().export_chrome(str(path))
    out = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "trace", "summarize", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "overlap report" in out.stdout, out.stderr
    png = tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "trace", "plot", str(path), "-o", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args, says in (
        (["trace", "summarize", str(bad)], "not valid JSON"),
        (["trace", "plot", str(path), "--steps", "x"], "slice syntax"),
    ):
        assert_cli_refuses(capsys, args, says)


def test_tracer_keeps_at_most_max_spans() -> None:
    t = Tracer(max_spans=5)
    for i in range(12):
        t.record(f"s{i}", "user", i, i + 1)
    assert len(t.spans) == 5 and t.dropped == 7
    assert [s[0] for s in t.spans] == ["s7", "s8", "s9", "s10", "s11"]  # the newest kept
    t.clear()
    assert t.dropped == 0
    with pytest.raises(ValueError, match="max_spans"):
        Tracer(max_spans=0)


def _stepped_spans() -> list[tuple[str, str, int, int, int, dict[str, int]]]:
    """Two ranks, four steps each: a compute span and a comm span per step, then a mark."""
    spans = []
    for rank in (0, 1):
        for k in range(4):
            t = k * 1000
            spans.append((f"bwd {k}", "compute", t + 10, t + 500, 1, {"rank": rank}))
            spans.append((f"ar {k}", "comm", t + 400, t + 700, 1, {"rank": rank}))
            spans.append(("step", "step", t + 900, t + 900, 1, {"rank": rank}))
    return spans


def test_steps_are_chosen_by_marks_in_slice_syntax() -> None:
    from overlap.trace.plot import parse_steps, select_steps

    assert parse_steps("10:12") == slice(10, 12)
    assert parse_steps("5") == slice(5, 6)
    assert parse_steps("-1") == slice(-1, None)
    assert parse_steps("-2:") == slice(-2, None)
    assert parse_steps(":") == slice(None, None)
    with pytest.raises(ValueError, match="slice syntax"):
        parse_steps("a:b")
    spans = _stepped_spans()

    def names(sl: slice | None) -> set[str]:
        return {s[0] for s in select_steps(spans, sl)}

    assert names(slice(-2, None)) == {"bwd 2", "ar 2", "bwd 3", "ar 3"}  # the default
    assert names(slice(0, 1)) == {"bwd 0", "ar 0"}
    assert names(slice(1, 3)) == {"bwd 1", "ar 1", "bwd 2", "ar 2"}
    assert names(slice(7, 9)) == set()
    assert len(select_steps(spans, slice(1, 2))) == 4  # both ranks
    assert len(select_steps(spans, None)) == len(spans)


def test_plots_write_pngs_and_refuse_empty_steps(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from overlap.trace.plot import plot_compare, plot_step_bars, plot_timeline

    spans = _stepped_spans()
    png = plot_timeline(spans, str(tmp_path / "t.png"), steps=slice(1, 3))
    assert Path(png).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no spans in steps 7:9"):
        plot_timeline(spans, str(tmp_path / "none.png"), steps=slice(7, 9))
    assert not (tmp_path / "none.png").exists()
    both = plot_compare([("a", spans[:3]), ("b", spans[3:6])], str(tmp_path / "c.png"))
    assert Path(both).read_bytes()[:4] == b"\x89PNG"
    bars = plot_step_bars([("ddp", 300.0), ("overlap", 120.0)], str(tmp_path / "b.png"), 100.0)
    assert Path(bars).read_bytes()[:4] == b"\x89PNG"


def test_a_traced_reduction_sees_an_error_thrown_into_it() -> None:
    """The scheduler's tracing wrapper forwards a failed handle's error into the reduction
    (as the untraced path does), so the reduction's own handling and cleanup run at once;
    before, the error stopped at the wrapper and the reduction stayed suspended."""
    from overlap.scheduler.scheduler import _traced

    seen: list[BaseException] = []
    closed: list[bool] = []

    def reduction() -> Iterator[list[str]]:
        try:
            yield ["phase 1"]
            yield ["phase 2"]
        except RuntimeError as exc:
            seen.append(exc)
            raise
        finally:
            closed.append(True)

    steps = _traced(reduction(), Tracer(), 0)
    assert next(steps) == ["phase 1"]
    boom = RuntimeError("a handle failed")
    with pytest.raises(RuntimeError, match="a handle failed"):
        steps.throw(boom)
    assert seen == [boom] and closed == [True]


def test_attaching_a_second_tracer_warns_that_the_first_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, second = Tracer(name="first"), Tracer(name="second")
    first.attach()
    first.attach()  # again: no warning
    assert not caplog.records
    try:
        with caplog.at_level("WARNING", logger="overlap.trace.recorder"):
            second.attach()
        assert len(caplog.records) == 1, caplog.records
        msg = caplog.records[0].getMessage()
        assert "'second' replaces the attached Tracer 'first'" in msg, msg
    finally:
        second.detach()
        first.detach()
