"""The 1-bit codec's numba kernels (imported only through :mod:`codec_numba`).

Importing this module compiles every kernel for its one signature, or loads it from numba's
on-disk cache (``cache=True``: ``__pycache__`` next to this file, else numba's user cache
directory). See :mod:`overlap.compression.codec_numba` for what each kernel computes.

Forms chosen by measurement (16M floats, one thread, this project's 2-core machine):

* the error term as ``v - copysign(s, v)``: 15.6 ms against 33.8 ms for
  ``v - s if v >= 0 else v + s`` (the select does not vectorise). The two differ only at
  v = -0.0, and b is normalised by adding +0.0 so no stored value is ever -0.0 (+0.0 and the
  reference's -0.0 have the same sign and give the same next error: -s);
* a tile held by one piece (most tiles) runs through ``enc8``/``upd8``: 8 elements of the
  stage in registers (add, error, store, sign byte, float64 squares), with a non-temporal
  store of the new b; the encode stage went from 21.6 to 14-16 ms. Tiles that straddle a
  segment boundary run plain loops, then ``sumsq`` (float64, ``reassoc``: 7.1 ms, as fast
  as a read pass) and ``pack`` (``pack8``, a vector compare and movemask: 5.4 ms against
  11.3 ms for a shift-and-or loop and 8.4 ms for ``np.packbits``);
* the server's per-rank sum through a table of +-1 rows (``addt8``): 4.0 ms against 7.1 ms
  for byte-to-mask selects over 2 ranks x 8M elements; on 2 ranks the whole server stage
  runs in registers (``srv2``: the two rows, the error, the store, the sign byte and the
  squares, no tile buffer): 2.4-2.6 ms against 3.0-3.2 ms per 2.1M-float chunk;
* the rebuild by byte-to-mask selects (``putc8``), non-temporal where the output is
  32-byte aligned (``putnt8``): 5.7 ms against 8.8 ms with ordinary stores, which read every
  line before writing it.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from overlap.compression.layout import TILE

_F4, _F8, _U1, _I8 = "float32[::1]", "float64[::1]", "uint8[::1]", "int64[::1]"
_PIECES = f"{_I8}, {_I8}, {_I8}"
_OPTS: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False}

_V8 = ir.VectorType(ir.FloatType(), 8)


def _v8ptr(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
    a = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(builder.gep(a.data, [idx]), _V8.as_pointer())


def _splat(builder: Any, value: Any) -> Any:
    """An 8-lane vector of one float32 value."""
    undef = ir.Constant(_V8, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(
        one, undef, ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)
    )


def _store8(builder: Any, v: Any, ptr: Any, nontemporal: bool) -> None:
    """Store 8 lanes; ``nontemporal`` writes around the caches (ptr 32-byte aligned)."""
    st = builder.store(v, ptr, align=32 if nontemporal else 4)
    if nontemporal:
        st.set_metadata(
            "nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        )


@intrinsic
def pack8(typingctx: Any, arr: Any, idx: Any) -> Any:
    """The byte of v[idx:idx+8] >= 0, MSB first: one vector compare and a movemask."""
    sig = types.uint8(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vec = builder.load(_v8ptr(context, builder, signature.args[0], *args), align=4)
        mask = builder.fcmp_ordered(">=", vec, ir.Constant(_V8, [0.0] * 8))
        rev = builder.module.declare_intrinsic("llvm.bitreverse", [ir.IntType(8)])
        return builder.call(rev, [builder.bitcast(mask, ir.IntType(8))])

    return sig, codegen


def _signed8(accumulate: bool, scalar: bool, nontemporal: bool = False) -> Any:
    """dst[d:d+8] = (or +=) where(bit of byte, src, -src), MSB first; ``src`` is the 8 values
    at src_array[s:s+8], or one scalar broadcast (``scalar``). ``nontemporal`` stores around
    the caches (dst + d must be 32-byte aligned; pair with :func:`sfence`)."""

    def load_src(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if scalar:
            return _splat(builder, args[1])
        return builder.load(_v8ptr(context, builder, sig.args[1], args[1], args[2]), align=4)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        rev = builder.module.declare_intrinsic("llvm.bitreverse", [ir.IntType(8)])
        bits = builder.call(rev, [builder.trunc(args[0], ir.IntType(8))])
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), 8))
        s = load_src(context, builder, sig, args)
        v = builder.select(mask, s, builder.fneg(s))
        d = 2 if scalar else 3
        dp = _v8ptr(context, builder, sig.args[d], args[d], args[d + 1])
        if accumulate:
            v = builder.fadd(builder.load(dp, align=4), v)
        _store8(builder, v, dp, nontemporal)
        return context.get_dummy_value()

    if scalar:

        def typer_s(typingctx: Any, byte: Any, src: Any, dst: Any, didx: Any) -> Any:
            return types.void(byte, src, dst, didx), codegen

        return intrinsic(typer_s)

    def typer(typingctx: Any, byte: Any, src: Any, sidx: Any, dst: Any, didx: Any) -> Any:
        return types.void(byte, src, sidx, dst, didx), codegen

    return intrinsic(typer)


@intrinsic
def f32ptr(typingctx: Any, addr: Any) -> Any:
    """The float32 pointer at address ``addr`` (an int64), for ``nb.carray``: the encode
    kernel reads a segment from the gradient tensor the caller names by its address."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return types.CPointer(types.float32)(types.int64), codegen  # type: ignore[no-untyped-call]


_carray: Any = nb.carray  # type: ignore[attr-defined]


@nb.njit(inline="always", cache=True)
def _source(x: Any, src: Any, sstart: Any, k: int) -> Any:
    """(segment k's input array, the buffer index of its element 0): x itself (0), or the
    float32 tensor at address src[k] (its length from the segment starts)."""
    if src[k] != 0:
        return _carray(f32ptr(src[k]), (sstart[k + 1] - sstart[k],)), sstart[k]  # type: ignore[call-arg]
    return x, 0


@nb.njit(inline="always", cache=True)
def _lanes(acc: Any) -> float:
    """The sum of the 8 float64 lanes of a per-tile accumulator, in lane order."""
    tot = 0.0
    for j in range(8):
        tot += acc[j]
    return tot


@intrinsic
def sfence(typingctx: Any) -> Any:
    """Order this thread's non-temporal stores before anything it does next: a seq_cst
    fence, which LLVM lowers to mfence on x86 (it orders non-temporal stores too) and to a
    dmb on ARM, so the kernels stay portable."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def _stage8(
    context: Any, builder: Any, xv: Any, wv: Any, s: Any, out: Any, nt: bool, aty: Any, acc: Any
) -> Any:
    """The codegen both 8-element stages share: b = (xv + (wv - copysign(s, wv))) + 0.0,
    stored at ``out`` (``nt``: non-temporal), b * b (float64) added to the 8 lanes of the
    accumulator ``acc`` (numba type ``aty``); returns the byte of b >= 0, MSB first."""
    v8d = ir.VectorType(ir.DoubleType(), 8)
    zero = ir.Constant(_V8, [0.0] * 8)
    name = "llvm.copysign.v8f32"
    copysign = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(_V8, [_V8, _V8]), name=name
    )
    err = builder.fsub(wv, builder.call(copysign, [_splat(builder, s), wv]))
    b = builder.fadd(builder.fadd(xv, err), zero)
    _store8(builder, b, out, nt)
    ap = builder.bitcast(context.make_array(aty)(context, builder, acc).data, v8d.as_pointer())
    bd = builder.fpext(b, v8d)
    builder.store(builder.fadd(builder.load(ap, align=8), builder.fmul(bd, bd)), ap, align=8)
    mask = builder.fcmp_ordered(">=", b, zero)
    rev = builder.module.declare_intrinsic("llvm.bitreverse", [ir.IntType(8)])
    return builder.call(rev, [builder.bitcast(mask, ir.IntType(8))])


def _enc8(nontemporal: bool) -> Any:
    """The encode stage for 8 elements at idx, in registers: b = (x[xidx:] + (wb -
    copysign(s, wb))) + 0.0, stored to bn (``nontemporal``: around the caches; bn + idx must
    then be 32-byte aligned), b * b (float64) added to the 8 lanes of ``acc``; returns the
    byte of b >= 0, MSB first. One read of x and wb and one write of b: nothing is read back.
    ``x`` is indexed apart (``xidx``) so it can be a gradient tensor of its own rather than
    the bucket (the scheduler then skips copying it into the bucket)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        a = sig.args
        xv = builder.load(_v8ptr(context, builder, a[0], args[0], args[1]), align=4)
        wv = builder.load(_v8ptr(context, builder, a[2], args[2], args[5]), align=4)
        out = _v8ptr(context, builder, a[4], args[4], args[5])
        return _stage8(context, builder, xv, wv, args[3], out, nontemporal, a[6], args[6])

    def typer(
        typingctx: Any, x: Any, xidx: Any, wb: Any, s: Any, bn: Any, idx: Any, acc: Any
    ) -> Any:
        return types.uint8(x, xidx, wb, s, bn, idx, acc), codegen

    return intrinsic(typer)


enc8 = _enc8(True)  # a new buffer far larger than the caches: write around them
upd8 = _enc8(False)  # in place over lines just read (the server's chunk)


@intrinsic
def enc8m(
    typingctx: Any, x: Any, xidx: Any, y: Any, wb: Any, s: Any, bn: Any, idx: Any, acc: Any
) -> Any:
    """``enc8`` of the mean of two inputs: x[xidx:] and y[idx:] (8 lanes each) summed and
    halved, ((x + y) * 0.5), then the stage as ``enc8`` with its non-temporal store. A
    hierarchical host of two ranks averages a chunk of its two ranks' gradients this way
    inside the encode pass: the mean is never written out and read back."""
    sig = types.uint8(x, xidx, y, wb, s, bn, idx, acc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        xv = builder.load(_v8ptr(context, builder, a[0], args[0], args[1]), align=4)
        yv = builder.load(_v8ptr(context, builder, a[2], args[2], args[6]), align=4)
        mv = builder.fmul(builder.fadd(xv, yv), _splat(builder, ir.Constant(ir.FloatType(), 0.5)))
        wv = builder.load(_v8ptr(context, builder, a[3], args[3], args[6]), align=4)
        out = _v8ptr(context, builder, a[5], args[5], args[6])
        return _stage8(context, builder, mv, wv, args[4], out, True, a[7], args[7])

    return sig, codegen


# Row b (8 floats) holds the +-1.0 of byte b's bits, MSB first.
_SIGNS = (
    (((np.arange(256)[:, None] >> np.arange(7, -1, -1)) & 1) * 2 - 1).astype(np.float32).ravel()
)


@intrinsic
def addt8(typingctx: Any, byte: Any, tbl: Any, q: Any, acc: Any, idx: Any) -> Any:
    """acc[idx:idx+8] += tbl[8 byte : 8 byte + 8] * q: the server's per-rank sum through a
    (256, 8) table of +-1 rows. +-1 * q is exact, so this equals the select form bit for
    bit; measured 4.0 ms against 7.1 ms for the byte-to-mask select form (``_signed8``)
    over 2 ranks x 8M elements."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        off = builder.mul(builder.zext(args[0], ir.IntType(64)), ir.Constant(ir.IntType(64), 8))
        row = builder.load(_v8ptr(context, builder, sig.args[1], args[1], off), align=4)
        qv = _splat(builder, args[2])
        ap = _v8ptr(context, builder, sig.args[3], args[3], args[4])
        builder.store(builder.fadd(builder.load(ap, align=4), builder.fmul(row, qv)), ap, align=4)
        return context.get_dummy_value()

    return types.void(byte, tbl, q, acc, idx), codegen


@intrinsic
def srv2(
    typingctx: Any, b0: Any, b1: Any, tbl: Any, q0: Any, q1: Any, c: Any, s: Any, idx: Any, acc: Any
) -> Any:
    """The whole server stage for 8 elements of a 2-rank chunk, in registers: the rank sum
    v = (0 + tbl[b0] * q0) + tbl[b1] * q1 (``addt8`` twice, in rank order, without the
    tile buffer), then c[idx:idx+8] = (v + (c - copysign(s, c))) + 0.0 in place, its float64
    squares added to ``acc`` and its sign byte returned (``upd8``). The same operations in
    the same order as ``addt8`` + ``upd8``, so bitwise the same result."""
    sig = types.uint8(b0, b1, tbl, q0, q1, c, s, idx, acc)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = signature.args
        zero = ir.Constant(_V8, [0.0] * 8)

        def term(byte: Any, q: Any) -> Any:
            off = builder.mul(builder.zext(byte, ir.IntType(64)), ir.Constant(ir.IntType(64), 8))
            row = builder.load(_v8ptr(context, builder, a[2], args[2], off), align=4)
            return builder.fmul(row, _splat(builder, q))

        v = builder.fadd(builder.fadd(zero, term(args[0], args[3])), term(args[1], args[4]))
        cp = _v8ptr(context, builder, a[5], args[5], args[7])
        wv = builder.load(cp, align=4)
        return _stage8(context, builder, v, wv, args[6], cp, False, a[8], args[8])

    return sig, codegen


put8 = _signed8(False, False)
add8 = _signed8(True, False)
putc8 = _signed8(False, True)  # (byte, float32 scalar, dst, didx)
# putc8 writing around the caches: the rebuild's output is far larger than them, so this
# saves the read-for-ownership of every line (measured: 16M floats, 8.8 -> 5.7 ms)
putnt8 = _signed8(False, True, nontemporal=True)


@nb.njit(f"float64({_F4})", fastmath={"reassoc", "contract"}, **_OPTS)
def sumsq(v: Any) -> float:
    s = 0.0
    for i in range(v.shape[0]):
        d = np.float64(v[i])
        s += d * d
    return s


@nb.njit(f"void({_F4}, {_U1})", **_OPTS)
def pack(v: Any, out: Any) -> None:
    # out[k] bit j (MSB first) = v[8k + j] >= 0 (a NaN gives 0: a NaN step raises anyway)
    for k in range(out.shape[0]):
        out[k] = pack8(v, 8 * k)  # type: ignore[call-arg]


@nb.njit(f"int64({_F4}, {_F4}, int64, int64, {_PIECES}, int64)", **_OPTS)
def fill(buf: Any, vals: Any, lo: int, hi: int, ps: Any, pe: Any, pseg: Any, q: int) -> int:
    # buf[i - lo] = vals[segment of i] for the pieces from q that start below hi
    while q < ps.shape[0] and ps[q] < hi:
        s = vals[pseg[q]]
        for i in range(ps[q] - lo, pe[q] - lo):
            buf[i] = s
        q += 1
    return q


@nb.njit(
    f"void({_F4}, {_I8}, {_I8}, {_F4}, int64, {_F4}, {_F4}, {_F4}, {_U1}, {_PIECES}, "
    f"int64, int64, int64, {_F8})",
    **_OPTS,
)
def encode(
    x: Any, src: Any, sstart: Any, y: Any, mean: int, wb: Any, ws: Any, bn: Any, packed: Any,
    ps: Any, pe: Any, pseg: Any, q: int, lo: int, hi: int, partial: Any,
) -> None:  # fmt: skip
    # bn = x + (wb - ws[seg] * sign(wb)) + 0.0 over [lo, hi); pack; sum of squares per piece.
    # src[seg] != 0: segment seg's x is the float32 array at that address (its element 0 is
    # element sstart[seg] of the buffer, its length sstart[seg + 1] - sstart[seg]), not x's
    # copy of it. The padding segment (the last) never has a source.
    # mean != 0: x is replaced by (x + y) * 0.5 (y indexed as the buffer, at least n long).
    n = x.shape[0]
    zero = np.float32(0.0)
    half = np.float32(0.5)
    acc = np.zeros(8, np.float64)
    aligned = bn.ctypes.data % 32 == 0
    for t0 in range(lo, hi, TILE):
        t1 = min(t0 + TILE, hi)
        if aligned and t1 <= n and pe[q] - ps[q] == t1 - t0:
            # one piece fills the tile: the whole stage in registers, b written around the
            # caches (measured: see docs/benchmarks.md)
            k = pseg[q]
            s = ws[k]
            xa, off = _source(x, src, sstart, k)
            acc[:] = 0.0
            if mean:
                for j in range((t1 - t0) >> 3):
                    i = t0 + 8 * j
                    packed[(t0 >> 3) + j] = enc8m(xa, i - off, y, wb, s, bn, i, acc)  # type: ignore[call-arg]
            else:
                for j in range((t1 - t0) >> 3):
                    i = t0 + 8 * j
                    packed[(t0 >> 3) + j] = enc8(xa, i - off, wb, s, bn, i, acc)  # type: ignore[call-arg]
            partial[q] = _lanes(acc)
            q += 1
            continue
        q1 = q
        while q1 < ps.shape[0] and ps[q1] < t1:  # one loop per piece, its scale a scalar
            a, e, k = ps[q1], pe[q1], pseg[q1]
            s = ws[k]
            c = min(e, n)
            if c > a:  # slices: the loop vectorises (measured 3x faster than indexing)
                xa, off = _source(x, src, sstart, k)
                xs, vs, bs = xa[a - off : c - off], wb[a:c], bn[a:c]
                if mean:
                    ys = y[a:c]
                    for t in range(c - a):
                        v = vs[t]
                        m = (xs[t] + ys[t]) * half
                        bs[t] = (m + (v - np.float32(np.copysign(s, v)))) + zero
                else:
                    for t in range(c - a):
                        v = vs[t]
                        bs[t] = (xs[t] + (v - np.float32(np.copysign(s, v)))) + zero
            for i in range(max(a, n), e):  # the padding: the error alone
                v = wb[i]
                bn[i] = (v - np.float32(np.copysign(s, v))) + zero
            q1 += 1
        pack(bn[t0:t1], packed[t0 >> 3 : t1 >> 3])
        for r in range(q, q1):
            partial[r] = sumsq(bn[ps[r] : pe[r]])
        q = q1
    sfence()  # type: ignore[call-arg]


@nb.njit(
    f"void(uint8[:, ::1], float32[:, ::1], {_F4}, {_F4}, {_U1}, "
    f"{_PIECES}, int64, int64, int64, {_F8})",
    **_OPTS,
)
def server(
    recv: Any, q: Any, sc: Any, ss: Any, packed: Any,
    ps: Any, pe: Any, pseg: Any, p: int, lo: int, hi: int, partial: Any,
) -> None:  # fmt: skip
    # sc = sum over ranks r in order of sign_r * q[r, seg] + (sc - ss[seg] * sign(sc)), in
    # place over [lo, hi) of this rank's chunk; pack; sum of squares per piece
    w = recv.shape[0]
    acc = np.empty(TILE, np.float32)
    qb = np.empty(TILE, np.float32)
    sb = np.empty(TILE, np.float32)
    sq = np.zeros(8, np.float64)
    for t0 in range(lo, hi, TILE):
        t1 = min(t0 + TILE, hi)
        m = t1 - t0
        cs = sc[t0:t1]
        if pe[p] - ps[p] == m and w == 2:  # the whole stage in registers (srv2)
            k = pseg[p]
            q0, q1, s = q[0, k], q[1, k], ss[k]
            r0, r1 = recv[0, t0 >> 3 : t1 >> 3], recv[1, t0 >> 3 : t1 >> 3]
            sq[:] = 0.0
            for j in range(m >> 3):
                packed[(t0 >> 3) + j] = srv2(r0[j], r1[j], _SIGNS, q0, q1, cs, s, 8 * j, sq)  # type: ignore[call-arg]
            partial[p] = _lanes(sq)
            p += 1
            continue
        acc[:m] = 0.0  # the tile's rank sum (srv2 above keeps it in registers)
        if pe[p] - ps[p] == m:  # one piece fills the tile: scalar scales
            p1 = p + 1
            k = pseg[p]
            for r in range(w):
                qr = q[r, k]
                rb = recv[r, t0 >> 3 : t1 >> 3]
                for j in range(m >> 3):  # acc + (+-q), in rank order
                    addt8(rb[j], _SIGNS, qr, acc, 8 * j)  # type: ignore[call-arg]
            s = ss[k]
            # c = acc + (v - copysign(s, v)), stored in place, signs and squares in one go
            # (upd8's +0.0 is a no-op here: acc is never -0.0)
            sq[:] = 0.0
            for j in range(m >> 3):
                packed[(t0 >> 3) + j] = upd8(acc, 8 * j, cs, s, cs, 8 * j, sq)
            partial[p] = _lanes(sq)
            p = p1
            continue
        else:  # segment boundaries inside the tile: per-element scales
            p1 = fill(sb, ss, t0, t1, ps, pe, pseg, p)
            for r in range(w):
                fill(qb, q[r], t0, t1, ps, pe, pseg, p)
                rb = recv[r, t0 >> 3 : t1 >> 3]
                for j in range(m >> 3):
                    add8(rb[j], qb, 8 * j, acc, 8 * j)
            for t in range(m):
                v = cs[t]
                cs[t] = acc[t] + (v - np.float32(np.copysign(sb[t], v)))
        pack(cs, packed[t0 >> 3 : t1 >> 3])
        for r in range(p, p1):
            partial[r] = sumsq(sc[ps[r] : pe[r]])
        p = p1
    sfence()  # type: ignore[call-arg]


@nb.njit(
    f"void({_U1}, float32[:, ::1], {_F4}, {_PIECES}, {_I8}, int64, int64, int64, int64)",
    **_OPTS,
)
def rebuild(
    signs: Any, sscales: Any, out: Any,
    ps: Any, pe: Any, pseg: Any, powner: Any, q: int, lo: int, hi: int, off: int,
) -> None:  # fmt: skip
    # out[i - off] = sscales[owner, seg] * sign(bit i) for i in [lo, hi); q: a piece at or
    # before the one holding lo. [lo, hi) need not be aligned: a tensor of a bucket can be
    # rebuilt straight into its own .grad (off = its offset in the bucket).
    sbuf = np.empty(TILE, np.float32)
    i = lo
    while i < hi and (i & 7) != 0:  # unaligned head, element by element
        while pe[q] <= i:
            q += 1
        s = sscales[powner[q], pseg[q]]
        out[i - off] = s if (signs[i >> 3] >> (7 - (i & 7))) & 1 else -s
        i += 1
    for t0 in range(i, hi, TILE):
        t1 = min(t0 + TILE, hi)
        while pe[q] <= t0:
            q += 1
        full = (t1 - t0) >> 3
        os_ = out[t0 - off : t1 - off]
        sg = signs[t0 >> 3 : (t0 >> 3) + full]
        if pe[q] >= t1:  # one piece covers the tile: a scalar scale
            s = sscales[powner[q], pseg[q]]
            if os_.ctypes.data % 32 == 0:
                for k in range(full):
                    putnt8(sg[k], s, os_, 8 * k)
            else:
                for k in range(full):
                    putc8(sg[k], s, os_, 8 * k)
            sbuf[: t1 - t0] = s
        else:
            r = q
            while r < ps.shape[0] and ps[r] < t1:
                s = sscales[powner[r], pseg[r]]
                for j in range(max(ps[r], t0) - t0, min(pe[r], t1) - t0):
                    sbuf[j] = s
                r += 1
            for k in range(full):
                put8(sg[k], sbuf, 8 * k, os_, 8 * k)
        for t in range(8 * full, t1 - t0):
            j = t0 + t
            bit = (signs[j >> 3] >> (7 - (j & 7))) & 1
            os_[t] = sbuf[t] if bit else -sbuf[t]
    sfence()  # type: ignore[call-arg]


@nb.njit(f"void({_F4}, {_F4}, {_F4}, {_PIECES}, int64, int64, int64)", **_OPTS)
def unlazy(v: Any, s: Any, out: Any, ps: Any, pe: Any, pseg: Any, q: int, lo: int, hi: int) -> None:
    # out = v - copysign(s[seg], v) over [lo, hi) (out may be v): the true error
    while q < ps.shape[0] and ps[q] < hi:
        a, e, k = max(ps[q], lo), min(pe[q], hi), s[pseg[q]]
        vs, os_ = v[a:e], out[a:e]
        for t in range(e - a):
            x = vs[t]
            os_[t] = x - np.float32(np.copysign(k, x))
        q += 1


KERNELS: dict[str, Any] = {
    "encode": encode,
    "server": server,
    "rebuild": rebuild,
    "unlazy": unlazy,
}
