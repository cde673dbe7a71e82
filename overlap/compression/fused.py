"""Fused CPU kernels for the 1-bit codec (numba, the ``fast`` extra), one memory pass each.

Eager torch spends one memory pass per operation: packing signs alone costs a compare pass,
a bool write and the int64 gather. These kernels do each codec step in a single pass with
the GIL released (``nogil``), so the scheduler's worker thread runs beside backward. They are
elementwise IEEE float32 operations in the same order as the torch path (norms stay in torch,
whose summation order they would change), so results are bitwise identical to it and to the
reference. ``available()`` is False without numba or with ``OVERLAP_NUMBA=0``; callers then
use the torch path.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["available", "error_update", "pack_signs_np", "rebuild", "server_accumulate"]

_kernels: dict[str, Any] | None = None
_tried = False


def _build() -> dict[str, Any] | None:
    if os.environ.get("OVERLAP_NUMBA", "1") == "0":
        return None
    try:
        import numba as nb
        import numpy as np
    except ImportError:
        return None

    jit: Any = nb.njit(nogil=True, cache=True, boundscheck=False)

    def pack(b: Any, out: Any) -> None:
        # out[k] bit j (MSB first) = b[8k + j] >= 0
        for k in range(out.shape[0]):
            v = 0
            base = 8 * k
            for j in range(8):
                v = (v << 1) | (1 if b[base + j] >= 0 else 0)
            out[k] = v

    def update(v: Any, s: Any, out: Any) -> None:
        # out = v - s * sign(v): v - s for v >= 0 (bitwise equal to v - copysign(s, v) here)
        for i in range(v.shape[0]):
            x = v[i]
            out[i] = x - s if x >= 0 else x + s

    def server(parts: Any, q: Any, err: Any, out: Any) -> None:
        # out[i] = (sum over r in order of +-q[r]) + err[i]; parts[r] holds rank r's bits
        w = parts.shape[0]
        for k in range(parts.shape[1]):
            for j in range(8):
                acc = np.float32(0.0)
                shift = 7 - j
                for r in range(w):
                    acc = acc + q[r] if (parts[r, k] >> shift) & 1 else acc - q[r]
                i = 8 * k + j
                out[i] = acc + err[i]

    def rebuild_(signs: Any, scales: Any, chunk_bytes: int, n: int, out: Any) -> None:
        for k in range(signs.shape[0]):
            s = scales[k // chunk_bytes]
            byte = signs[k]
            for j in range(8):
                i = 8 * k + j
                if i >= n:
                    return
                out[i] = s if (byte >> (7 - j)) & 1 else -s

    def update_ranges(v: Any, starts: Any, ends: Any, scales: Any, out: Any) -> None:
        for k in range(starts.shape[0]):
            s = scales[k]
            for i in range(starts[k], ends[k]):
                x = v[i]
                out[i] = x - s if x >= 0 else x + s

    def server_ranges(
        parts: Any, q: Any, starts: Any, ends: Any, segk: Any, err: Any, out: Any
    ) -> None:
        # pieces of segments inside this chunk; q[r, k] = rank r's scale of segment k / W
        w = parts.shape[0]
        for p in range(starts.shape[0]):
            k = segk[p]
            for i in range(starts[p], ends[p]):
                byte = i >> 3
                shift = 7 - (i & 7)
                acc = np.float32(0.0)
                for r in range(w):
                    acc = acc + q[r, k] if (parts[r, byte] >> shift) & 1 else acc - q[r, k]
                out[i] = acc + err[i]

    def rebuild_ranges(
        signs: Any, scales: Any, starts: Any, ends: Any, owner: Any, segk: Any, out: Any
    ) -> None:
        for p in range(starts.shape[0]):
            s = scales[owner[p], segk[p]]
            for i in range(starts[p], ends[p]):
                out[i] = s if (signs[i >> 3] >> (7 - (i & 7))) & 1 else -s

    return {
        "pack": jit(pack),
        "update": jit(update),
        "server": jit(server),
        "rebuild": jit(rebuild_),
        "update_ranges": jit(update_ranges),
        "server_ranges": jit(server_ranges),
        "rebuild_ranges": jit(rebuild_ranges),
    }


def _get() -> dict[str, Any] | None:
    global _kernels, _tried
    if not _tried:
        _tried = True
        _kernels = _build()
    return _kernels


def available() -> bool:
    return _get() is not None


def pack_signs_np(b: Any, out: Any) -> None:
    k = _get()
    assert k is not None
    k["pack"](b, out)


def error_update(v: Any, s: float, out: Any) -> None:
    import numpy as np

    k = _get()
    assert k is not None
    k["update"](v, np.float32(s), out)


def server_accumulate(parts: Any, q: Any, err: Any, out: Any) -> None:
    k = _get()
    assert k is not None
    k["server"](parts, q, err, out)


def rebuild(signs: Any, scales: Any, chunk_bytes: int, n: int, out: Any) -> None:
    k = _get()
    assert k is not None
    k["rebuild"](signs, scales, chunk_bytes, n, out)


def kernel(name: str) -> Any:
    """One of the compiled kernels (call only when :func:`available`)."""
    k = _get()
    assert k is not None
    return k[name]
