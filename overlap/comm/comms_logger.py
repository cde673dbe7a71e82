"""The comms logger: deepspeed.comm's ``configure``, ``prof=`` / ``log_name=`` and
``log_summary``, on overlap's ops.

Off by default, and then an op pays one attribute read for it. When enabled, an op is
timed if ``prof=True`` was passed, or ``prof_all`` is set, or its ``log_name`` (by default
the op's own name) is in ``prof_ops``. A blocking op is timed to its return; an awaitable one
(``async_op=True``, ``isend``/``irecv``) from issue to *completion*, by a done-callback on
its Handle, not to the moment the call returned (DeepSpeed's ``timed_op`` stops its timer when
the call returns, after a device synchronize, so its async timings measure the issue).

Records are kept per log name and message size: count, latencies (ms), algbw and busbw
(Gbps) with nccl-tests' factors (:mod:`overlap.comm.bandwidth`). Message size is the op's
whole buffer as nccl-tests counts it (for an all-gather, world x this rank's input), so
busbw is comparable with the link. ``log_summary()`` prints DeepSpeed's table on rank 0 and
returns DeepSpeed's dictionary with ``return_dict=True``; ``show_straggler=True`` adds the
straggler breakdown (each op's latency minus the fastest rank's).
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import IO, Any, TypeVar

from overlap.comm import constants as C
from overlap.comm.bandwidth import bandwidths, op_size
from overlap.comm.handle import Handle

__all__ = [
    "BYPASS",
    "LOGGER",
    "CommsLogger",
    "calc_bw_log",
    "configure",
    "convert_size",
    "get_comm_operation_count",
    "get_logged_comm_ops",
    "has_comm_data",
    "log_summary",
    "reset_log",
    "timed_op",
    "trim_mean",
]

log = logging.getLogger(__name__)

# The log_name an op passes to itself when the logger already times the call: not timed again.
BYPASS = "\x00overlap-comms-logger-bypass"

F = TypeVar("F", bound=Callable[..., Any])


def convert_size(size_bytes: int) -> str:
    """A byte count as DeepSpeed prints it: ``"0B"``, ``"4.0 KB"``, ``"678.86 MB"``."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = min(math.floor(math.log(size_bytes, 1024)), len(names) - 1)
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def trim_mean(data: list[float], trim_percent: float) -> float:
    """The mean without the ``trim_percent`` smallest and largest values (DeepSpeed's)."""
    if not data:
        return 0.0
    xs = sorted(data)
    k = round(len(xs) * trim_percent)
    kept = xs[k : len(xs) - k] or xs
    return sum(kept) / len(kept)


def calc_bw_log(comm_op: str, size: int, duration_ms: float, world: int = 1) -> tuple[float, float]:
    """(algbw, busbw) in Gbps of an op that moved ``size`` bytes (this rank's contribution)
    in ``duration_ms`` on ``world`` ranks: nccl-tests' definitions (module docstring)."""
    alg, bus = bandwidths(comm_op, size, world, duration_ms / 1e3)
    return alg * 8 / 1e9, bus * 8 / 1e9


def _get(cfg: Any, key: str, default: Any) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


class CommsLogger:
    """Per-op timing records (module docstring). Thread-safe: awaited ops finish on backend
    threads."""

    def __init__(self) -> None:
        self.enabled = C.COMMS_LOGGER_ENABLED_DEFAULT
        self.verbose = C.COMMS_LOGGER_VERBOSE_DEFAULT
        self.debug = C.COMMS_LOGGER_DEBUG_DEFAULT
        self.prof_all = C.COMMS_LOGGER_PROF_ALL_DEFAULT
        self.prof_ops: list[str] = list(C.COMMS_LOGGER_PROF_OPS_DEFAULT)
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self._worlds: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ configuration
    def configure(self, comms_config: Any) -> None:
        """From a ds_config's comms section: an object with ``comms_logger_enabled`` and
        ``comms_logger`` (DeepSpeed's DeepSpeedCommsConfig), or the JSON form
        ``{"comms_logger": {"enabled": ..., "verbose": ..., ...}}``."""
        section = _get(comms_config, C.COMMS_LOGGER, None)
        enabled = _get(comms_config, "comms_logger_enabled", None)
        if enabled is None:
            enabled = _get(section, C.COMMS_LOGGER_ENABLED, False) if section is not None else False
        self.enabled = bool(enabled)
        if self.enabled and section is not None:
            self.verbose = bool(_get(section, C.COMMS_LOGGER_VERBOSE, self.verbose))
            self.debug = bool(_get(section, C.COMMS_LOGGER_DEBUG, self.debug))
            self.prof_ops = list(_get(section, C.COMMS_LOGGER_PROF_OPS, self.prof_ops))
            self.prof_all = bool(_get(section, C.COMMS_LOGGER_PROF_ALL, self.prof_all))

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def wants(self, prof: Any, log_name: Any) -> bool:
        """Whether a call with these ``prof`` / ``log_name`` arguments is timed."""
        if log_name == BYPASS:
            return False
        return bool(prof) or self.prof_all or log_name in self.prof_ops

    def record_name(self, log_name: str, debug: str | None, depth: int = 3) -> str:
        if not self.debug:
            return log_name
        caller = debug or sys._getframe(depth).f_code.co_name
        return f"{log_name} | [Caller Func: {caller}]"

    # ------------------------------------------------------------------ recording
    def append(
        self, raw_name: str, record_name: str, latency: float, msg_size: int, world: int = 1
    ) -> None:
        """Add one op: ``latency`` in ms, ``msg_size`` the bytes this rank contributed."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency, world)
        size = op_size(raw_name, msg_size, world)
        with self._lock:
            rec = self.comms_dict.setdefault(record_name, {})
            vals = rec.get(size)
            if vals is None:
                rec[size] = [1, [latency], [algbw], [busbw]]
            else:
                vals[0] += 1
                vals[1].append(latency)
                vals[2].append(algbw)
                vals[3].append(busbw)
        if self.verbose:
            log.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                "busbw (Gbps): %.2f",
                record_name,
                latency,
                convert_size(size),
                algbw,
                busbw,
            )

    def time_handle(self, raw_name: str, record_name: str, handle: Handle) -> Handle:
        """Record ``handle``'s op when it completes (issue to completion); a failed op is not
        recorded."""

        def done(h: Handle) -> None:
            if h.end_ns is not None and h.exception() is None:
                ms = (h.end_ns - h.start_ns) / 1e6
                self.append(raw_name, record_name, ms, h.nbytes, h.world)

        handle.add_done_callback(done)
        return handle

    def timed(
        self,
        raw_name: str,
        log_name: str,
        debug: str | None,
        issue: Callable[[bool], Any],
        async_op: bool,
    ) -> Any:
        """Run an op that can be async: issue it async (``issue(True)``), time the Handle to
        completion, and for a blocking call wait and return what the blocking call returns."""
        record = self.record_name(log_name, debug)
        h = self.time_handle(raw_name, record, issue(True))
        return h if async_op else h.wait()

    def timed_call(
        self,
        raw_name: str,
        log_name: str,
        debug: str | None,
        call: Callable[[], Any],
        nbytes: int,
        world: int,
        depth: int = 3,
    ) -> Any:
        """Time a blocking call (send, recv, monitored_barrier, the object collectives);
        ``depth``: frames from here to the user's call, for the debug caller name."""
        record = self.record_name(log_name, debug, depth)
        t0 = time.perf_counter_ns()
        out = call()
        self.append(raw_name, record, (time.perf_counter_ns() - t0) / 1e6, nbytes, world)
        return out

    # ------------------------------------------------------------------ reading
    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        with self._lock:
            return {k: {s: [v[0], *[list(x) for x in v[1:]]] for s, v in d.items()}
                    for k, d in self.comms_dict.items()}  # fmt: skip

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        with self._lock:
            self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        with self._lock:
            return sum(v[0] for d in self.comms_dict.values() for v in d.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        data = self.get_raw_data().get(operation_name)
        if data is None:
            return None
        return {size: _summary(size, vals) for size, vals in data.items()}

    def log_all(
        self,
        print_log: bool = True,
        show_straggler: bool = False,
        return_dict: bool = False,
        file: IO[str] | None = None,
    ) -> dict[str, Any] | None:
        """Write the summary table to ``file`` (stdout) if ``print_log``; return DeepSpeed's
        dictionary if ``return_dict``. ``show_straggler`` is collective: every rank calls."""
        from overlap import comm

        data = self.get_raw_data()
        init = comm.is_initialized()
        result: dict[str, Any] = {
            "summary": {},
            "straggler_analysis": None,
            "metadata": {
                "world_size": comm.get_world_size() if init else 1,
                "rank": comm.get_rank() if init else 0,
                "timestamp": datetime.now().isoformat(),
            },
        }
        out = file if file is not None else sys.stdout
        cols = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                "tput_avg (Gbps)", "busbw_avg (Gbps)")  # fmt: skip
        if print_log:
            out.write("".join(f"{c: <20}" for c in cols) + "\n")
        for name, rec in data.items():
            result["summary"][name] = {}
            if print_log:
                out.write(f"{name}\n")
            for size, vals in sorted(rec.items()):
                s = result["summary"][name][size] = _summary(size, vals)
                if print_log:
                    out.write(
                        f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}"
                        f"{s['total_latency_ms']: <20.2f}{s['avg_latency_ms']: <20.2f}"
                        f"{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}\n"
                    )
        if show_straggler:
            result["straggler_analysis"] = self._stragglers(data, print_log, out)
        if print_log:
            out.flush()
        return result if return_dict else None

    def _stragglers(
        self, data: dict[str, dict[int, list[Any]]], print_log: bool, out: IO[str]
    ) -> dict[str, Any]:
        """Each op's latency against the fastest rank's, element by element: one
        all_gather_object of every rank's latencies (ranks may have logged different ops;
        an op is compared over the calls every rank logged)."""
        from overlap import comm

        mine = {name: {size: vals[1] for size, vals in rec.items()} for name, rec in data.items()}
        everyone: list[Any] = [None] * comm.get_world_size()
        comm.all_gather_object(everyone, mine, log_name=BYPASS)
        res: dict[str, Any] = {}
        if print_log:
            out.write("_______________________________\nBreakdown with straggler effect\n")
            out.write("-------------------------------\n")
            cols = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)",
                    "Total straggler(ms)", "Avg comm lat(ms)", "Avg straggler(ms)")  # fmt: skip
            out.write("".join(f"{c: <20}" for c in cols) + "\n")
        for name, rec in mine.items():
            res[name] = {}
            if print_log:
                out.write(f"{name}\n")
            for size, lats in sorted(rec.items()):
                others = [d.get(name, {}).get(size, []) for d in everyone]
                n = min(len(x) for x in others)
                fastest = [min(x[i] for x in others) for i in range(n)]
                straggle = [lats[i] - fastest[i] for i in range(n)]
                r = res[name][size] = {
                    "count": n,
                    "total_comm_lat_ms": sum(fastest),
                    "total_straggler_ms": sum(straggle),
                    "avg_comm_lat_ms": trim_mean(fastest, 0.1),
                    "avg_straggler_ms": trim_mean(straggle, 0.1),
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
                if print_log:
                    out.write(
                        f"{' ': <20}{r['msg_size_str']: <20}{n: <20}"
                        f"{r['total_comm_lat_ms']: <20.2f}{r['total_straggler_ms']: <20.2f}"
                        f"{r['avg_comm_lat_ms']: <20.2f}{r['avg_straggler_ms']: <20.2f}\n"
                    )
        return res


def _summary(size: int, vals: list[Any]) -> dict[str, Any]:
    return {
        "count": vals[0],
        "total_latency_ms": sum(vals[1]),
        "avg_latency_ms": trim_mean(vals[1], 0.1),
        "tput_avg_gbps": trim_mean(vals[2], 0.1),
        "busbw_avg_gbps": trim_mean(vals[3], 0.1),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


LOGGER = CommsLogger()


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Set up the comms logger, as ``deepspeed.comm.configure``: from a ds_config (an object
    with ``comms_config``, or the config dict with a ``"comms_logger"`` section), then the
    keywords given (None leaves a setting as it is)."""
    if deepspeed_config is not None:
        LOGGER.configure(_get(deepspeed_config, "comms_config", deepspeed_config))
    if enabled is not None:
        LOGGER.enabled = bool(enabled)
    if prof_all is not None:
        LOGGER.prof_all = bool(prof_all)
    if prof_ops is not None:
        LOGGER.prof_ops = list(prof_ops)
    if verbose is not None:
        LOGGER.verbose = bool(verbose)
    if debug is not None:
        LOGGER.debug = bool(debug)


def _msg_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    import torch

    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.numel() * a.element_size()
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            return sum(t.numel() * t.element_size() for t in a)
    return 0


def timed_op(func: F) -> F:
    """DeepSpeed's decorator for a function that communicates: with the logger enabled and
    the call profiled (``prof=True`` / ``log_name=`` keywords, ``prof_all``, ``prof_ops``), it
    is timed (a returned Handle to its completion) and logged under ``log_name``."""
    raw = func.__name__

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        lg = LOGGER
        log_name = kwargs.get("log_name", raw)
        if not (lg.enabled and lg.wants(kwargs.get("prof", False), log_name)):
            return func(*args, **kwargs)
        record = lg.record_name(log_name, kwargs.get("debug"), depth=2)
        t0 = time.perf_counter_ns()
        out = func(*args, **kwargs)
        if isinstance(out, Handle):
            return lg.time_handle(raw, record, out)
        from overlap import comm

        world = comm.get_world_size(kwargs.get("group")) if comm.is_initialized() else 1
        ms = (time.perf_counter_ns() - t0) / 1e6
        lg.append(raw, record, ms, _msg_bytes(args, kwargs), world)
        return out

    return wrapper  # type: ignore[return-value]


def log_summary(
    show_straggler: bool = False, return_dict: bool = False, *, file: IO[str] | None = None
) -> dict[str, Any] | None:
    """Print the comms logger's table on rank 0 (to ``file``, stdout by default) and return
    DeepSpeed's dictionary with ``return_dict=True``. Collective: every rank calls it (a
    barrier on each side, and one all-gather with ``show_straggler``)."""
    from overlap import comm

    comm.barrier(log_name=BYPASS)
    res = LOGGER.log_all(comm.get_rank() == 0, show_straggler, return_dict, file)
    comm.barrier(log_name=BYPASS)
    return res


def reset_log() -> None:
    """Forget every record (for per-epoch summaries)."""
    LOGGER.reset_data()


def has_comm_data() -> bool:
    """True once any op has been logged."""
    return LOGGER.has_data()


def get_comm_operation_count() -> int:
    """How many ops were logged, of every kind."""
    return LOGGER.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """The log names that have records."""
    return LOGGER.get_operation_names()
