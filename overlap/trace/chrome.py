"""Chrome trace event format (what chrome://tracing and ui.perfetto.dev load), both ways.

Export: one process (``pid``) per rank, one track (``tid``) per thread; compute, user, wait
and bucket spans are complete events (``ph: X``); comm ops are async events (``ph: b``/``e``
with an id) so concurrent ops never stack on one track; each bucket's reduction gets a flow
arrow (``ph: s``/``f``) from the moment it became ready. Timestamps are microseconds.

In a multi-rank job every rank calls :func:`export`; the events are gathered to rank 0 with
every rank's clock shifted onto rank 0's (offsets measured at export, see clock.py), and
rank 0 writes one file: to a temporary file beside the target, then an atomic rename, so a
failure never leaves a partial trace. A path ending in ``.gz`` is written gzipped, as
torch.profiler's ``export_chrome_trace`` does; :func:`load_spans` reads either.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

import torch

from overlap.errors import CommError, OverlapError
from overlap.files import cannot_write, write_whole

__all__ = ["TraceFormatError", "events_of", "export", "load_spans"]


class TraceFormatError(OverlapError, ValueError):
    """A file is not a readable overlap/Chrome trace."""


def events_of(tracer: Any, rank: int, offset_ns: int) -> list[dict[str, Any]]:
    """Chrome events for one rank's spans, shifted by -offset_ns."""

    def us(t: int) -> float:
        return (t - offset_ns) / 1000.0

    ev: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": rank,
            "tid": 0,
            "args": {"name": f"rank {rank}"},
        },
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": rank,
            "tid": 0,
            "args": {"sort_index": rank},
        },
    ]
    for tid, tname in tracer.thread_names.items():
        ev.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": tname}}
        )
    for i, (name, cat, t0, t1, tid, args) in enumerate(tracer.spans):
        base = {"name": name, "cat": cat, "pid": rank, "tid": tid, "args": {**args, "rank": rank}}
        if cat == "comm":
            aid = f"{rank}-{i}"
            ev.append({**base, "ph": "b", "id": aid, "ts": us(t0)})
            ev.append({**base, "ph": "e", "id": aid, "ts": us(t1)})
        elif t0 == t1:
            ev.append({**base, "ph": "i", "s": "t", "ts": us(t0)})
        else:
            ev.append({**base, "ph": "X", "ts": us(t0), "dur": (t1 - t0) / 1000.0})
        flow = args.get("flow")
        if cat == "bucket" and flow is not None and "ready_ns" in args:
            fid = f"{rank}-flow-{flow}"
            ev.append(
                {
                    "ph": "s",
                    "id": fid,
                    "name": "ready->reduce",
                    "cat": "flow",
                    "pid": rank,
                    "tid": args.get("ready_tid", tid),
                    "ts": us(args["ready_ns"]),
                }
            )
            ev.append(
                {
                    "ph": "f",
                    "bp": "e",
                    "id": fid,
                    "name": "ready->reduce",
                    "cat": "flow",
                    "pid": rank,
                    "tid": tid,
                    "ts": us(t0),
                }
            )
    return ev


def _gather_bytes(payload: bytes, refuse: bool = False) -> list[bytes] | None:
    """Every rank's payload on rank 0 (None elsewhere). Collective.

    ``refuse`` (rank 0's word: it cannot write the result) travels with the sizes, and then
    no rank sends its payload: every rank raises :class:`_Refused`."""
    from overlap import comm

    w, r = comm.get_world_size(), comm.get_rank()
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.zeros(0, dtype=torch.uint8)
    )
    sizes = comm.all_gather(torch.tensor([data.numel(), int(refuse)], dtype=torch.int64))
    if int(sizes[0][1].item()):
        raise _Refused
    n = max(int(s[0].item()) for s in sizes)
    padded = torch.zeros(max(n, 1), dtype=torch.uint8)
    padded[: data.numel()] = data
    slots = [torch.empty_like(padded) for _ in range(w)] if r == 0 else None
    comm.gather(padded, slots, dst=0)
    if r != 0:
        return None
    assert slots is not None
    return [bytes(slots[i][: int(sizes[i][0].item())].numpy()) for i in range(w)]


def export(tracer: Any, path: str) -> str | None:
    from overlap import comm
    from overlap.trace.clock import clock_offsets

    multi = comm.is_initialized() and comm.get_world_size() > 1
    rank = comm.get_rank() if comm.is_initialized() else 0
    if multi:
        # rank 0 writes: a path it cannot write to is found before the exchange and raised on
        # every rank, not on rank 0 alone (the others returned as if the trace was written)
        refusal = cannot_write(path, "the trace") if rank == 0 else None
        try:
            offsets = clock_offsets()
            mine = events_of(tracer, rank, offsets[rank])
            parts = _gather_bytes(json.dumps(mine).encode(), refusal is not None)
        except _Refused:
            if refusal is not None:
                raise refusal from None
            raise _elsewhere("cannot write to the path it was given; nothing was written") from None
        except CommError as exc:
            # The usual cause is export_chrome called under `if rank == 0:`; the backend's
            # own words ("Timed out waiting 1800000ms for send operation") did not say so.
            raise CommError(
                f"Tracer.export_chrome on rank {rank} failed while the ranks exchanged their "
                "spans: it is collective, every rank of the job calls it (rank 0 writes the "
                "one merged file), so a rank that did not call it (export under `if rank == "
                "0:`), or that died, fails the others. Call it on every rank"
            ) from exc
        if parts is None:
            if _outcome(None):
                raise _elsewhere("failed to write it; the file was left as it was")
            return None
        events = [e for p in parts for e in json.loads(p.decode())]
        try:
            _write_atomic(path, _document(events, offsets))
        except BaseException:
            _outcome(True)  # the others raise too (the file left as it was: files.py)
            raise
        _outcome(False)
        return path
    _write_atomic(path, _document(events_of(tracer, rank, 0), [0]))
    return path


class _Refused(Exception):
    """Rank 0 said, in the size exchange, that it cannot write the trace."""


def _elsewhere(what: str) -> OSError:
    return OSError(
        f"Tracer.export_chrome: rank 0, which writes the merged trace, {what} (rank 0's "
        "error says why). Pass a path that rank 0 can write to"
    )


def _outcome(failed: bool | None) -> bool:
    """Rank 0's write failed (True) or not, from rank 0 to every rank (``failed`` None
    elsewhere). Collective: the ranks that sent their spans learn whether they were written."""
    from overlap import comm

    flag = torch.tensor([int(bool(failed))], dtype=torch.int64)
    comm.broadcast(flag, src=0)
    return bool(flag.item())


def _document(events: list[Any], offsets: list[int]) -> str:
    return json.dumps(
        {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "overlap",
                "world_size": len(offsets),
                "clock_offsets_ns": offsets,
            },
        }
    )


def _write_atomic(path: str, text: str) -> None:
    refusal = cannot_write(path, "the trace")
    if refusal is not None:
        raise refusal
    target = os.path.abspath(path)
    data = text.encode()
    if target.endswith(".gz"):
        # as torch.profiler's export_chrome_trace: a .gz path gets gzip, which Perfetto
        # and chrome://tracing open as they are (a trace's JSON shrinks about tenfold);
        # mtime=0: the same trace gives the same bytes
        data = gzip.compress(data, compresslevel=6, mtime=0)
    write_whole(target, lambda f: f.write(data), "the trace")


def _read_text(path: str) -> str:
    """The file's text; gunzipped first where it starts with gzip's magic bytes (a
    ``.gz`` export, or any gzipped trace), whatever its name."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise TraceFormatError(
                f"{path} is gzip but cannot be unpacked ({exc}); the file may be truncated: "
                "export it again"
            ) from None
    return raw.decode()


def load_spans(path: str) -> tuple[list[Any], int]:
    """Spans (per rank) back from a trace file written by :func:`export`; (spans, world)."""
    try:
        doc = json.loads(_read_text(path))
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(
            f"{path} is a directory: pass the trace file (Tracer.export_chrome's path)"
        ) from None
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TraceFormatError(
            f"{path} is not a text file, so not a trace (Tracer.export_chrome writes JSON)"
        ) from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); the file may be "
            "truncated: export it again"
        ) from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise TraceFormatError(f"{path} is JSON but not a Chrome trace (no traceEvents list)")
    ours = isinstance(doc, dict) and (doc.get("otherData") or {}).get("producer") == "overlap"
    cats = {e.get("cat") for e in events if isinstance(e, dict)}
    if not ours and not cats & _REPORTED:
        # a torch.profiler or other tool's trace: before, a table of zeros and no word why
        named = ", ".join(sorted(str(c) for c in cats if c is not None)[:6]) or "none"
        raise TraceFormatError(
            f"{path} holds no overlap spans (no 'comm', 'compute' or 'bucket' events; its "
            f"categories: {named}) and was not written by overlap: `overlap trace` reads "
            "the files of Tracer.export_chrome. Open this one in Perfetto "
            "(https://ui.perfetto.dev)"
        )
    try:
        spans, ranks = _spans_of(path, events)
    except TraceFormatError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise TraceFormatError(
            f"{path}: an event it cannot read ({type(exc).__name__}: {exc}); the file was "
            "changed after Tracer.export_chrome wrote it: export it again"
        ) from None
    world = (
        int(doc.get("otherData", {}).get("world_size", len(ranks) or 1))
        if isinstance(doc, dict)
        else max(len(ranks), 1)
    )
    return spans, world


_REPORTED = {"comm", "compute", "bucket"}  # what the report is made of


def _spans_of(path: str, events: list[Any]) -> tuple[list[Any], set[int]]:
    """(spans, ranks) of a trace's events."""
    spans: list[Any] = []
    opened: dict[str, dict[str, Any]] = {}
    ranks = set()
    for e in events:
        if not isinstance(e, dict) or "ph" not in e:
            raise TraceFormatError(f"{path}: an event without 'ph': {str(e)[:80]}")
        ph = e["ph"]
        pid = int(e.get("pid", 0))
        ranks.add(pid)
        args = dict(e.get("args", {}))
        if ph == "X":
            t0 = int(float(e["ts"]) * 1000)
            spans.append(
                (
                    e["name"],
                    e.get("cat", "user"),
                    t0,
                    t0 + int(float(e.get("dur", 0)) * 1000),
                    e.get("tid", 0),
                    args,
                )
            )
        elif ph == "b":
            opened[str(e["id"])] = e
        elif ph == "e":
            b = opened.pop(str(e["id"]), None)
            if b is not None:
                spans.append(
                    (
                        b["name"],
                        b.get("cat", "comm"),
                        int(float(b["ts"]) * 1000),
                        int(float(e["ts"]) * 1000),
                        b.get("tid", 0),
                        dict(b.get("args", {})),
                    )
                )
        elif ph == "i":
            t = int(float(e["ts"]) * 1000)
            spans.append((e["name"], e.get("cat", "user"), t, t, e.get("tid", 0), args))
    return spans, ranks
