"""Rank-side checks of the compression package (gloo pools here, mpiexec in tests/mpi)."""

from __future__ import annotations

import math
from typing import Any

import torch

import overlap
from overlap import comm
from overlap.compression import (
    BF16,
    FP16,
    Int8,
    NoCompression,
    OneBit,
    PowerSGD,
    compressed_allreduce,
    padded_numel,
)
from overlap.errors import NonFiniteError


def reference(
    xs: list[torch.Tensor], wes: list[torch.Tensor], ses: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """DESIGN.md section 4 computed locally for all W ranks, straight from the math."""
    w, n = len(xs), xs[0].numel()
    P = padded_numel(n, w)
    chunk = P // w
    signs, scales, new_we = [], [], []
    for r in range(w):
        b = torch.zeros(P)
        b[:n] = xs[r].reshape(-1).float()
        b = b + wes[r]
        scale = torch.linalg.vector_norm(b) / math.sqrt(P)
        sign = torch.where(b >= 0, 1.0, -1.0)
        signs.append(sign)
        scales.append(scale)
        new_we.append(b - scale * sign)
    result, new_se = torch.zeros(P), []
    for j in range(w):
        c = torch.zeros(chunk)
        for r in range(w):
            c = c + signs[r][j * chunk : (j + 1) * chunk] * (scales[r] / w)
        c = c + ses[j]
        sscale = torch.linalg.vector_norm(c) / math.sqrt(chunk)
        csign = torch.where(c >= 0, 1.0, -1.0)
        new_se.append(c - sscale * csign)
        result[j * chunk : (j + 1) * chunk] = sscale * csign
    return result[:n], new_we, new_se


def onebit_matches_reference(n: int, mode: str, dtype: str = "float32") -> list[float]:
    """3 steps of error feedback; bitwise equal to the reference and across ranks."""
    r, w = comm.get_rank(), comm.get_world_size()
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1000 + n)
    P = padded_numel(n, w)
    we, se = torch.zeros(P), torch.zeros(P // w)
    ref_we = [torch.zeros(P) for _ in range(w)]
    ref_se = [torch.zeros(P // w) for _ in range(w)]
    firsts = []
    for _step in range(3):
        xs = [torch.randn(n, generator=gen).to(dt) for _ in range(w)]
        buf = xs[r].clone().reshape(n)
        if mode == "blocking":
            out = compressed_allreduce(buf, we, se)
        elif mode == "wait":
            out = compressed_allreduce(buf, we, se, async_op=True).wait(timeout=60)
        else:

            async def main(buf: torch.Tensor = buf) -> Any:
                return await compressed_allreduce(buf, we, se, async_op=True)

            out = overlap.run(main(), loop=mode)  # type: ignore[arg-type]
        assert out is buf and out.dtype == dt
        want, ref_we, ref_se = reference(xs, ref_we, ref_se)
        # DESIGN.md section 4 within DeepSpeed's own test tolerance (1e-6 absolute): the
        # kernels' float64 sums of squares differ from torch's float32 norm by about an ulp
        near = dict(rtol=0.0, atol=1e-6)
        assert torch.allclose(out.float(), want.to(dt).float(), **near), (out[:4], want[:4])
        assert torch.allclose(we, ref_we[r], **near) and torch.allclose(se, ref_se[r], **near)
        everyone = comm.all_gather(out.float().contiguous())
        assert all(torch.equal(everyone[0], o) for o in everyone)  # bitwise identical
        firsts.append(float(out.reshape(-1)[0]))
    return firsts


def nan_leaves_state_untouched() -> list[int]:
    r, w = comm.get_rank(), comm.get_world_size()
    n = 50
    P = padded_numel(n, w)
    we, se = torch.zeros(P), torch.zeros(P // w)
    compressed_allreduce(torch.randn(n), we, se)  # some state
    we0, se0 = we.clone(), se.clone()
    buf = torch.randn(n)
    if r == w - 1:
        buf[7] = float("nan")
    buf0 = buf.clone()
    try:
        compressed_allreduce(buf, we, se)
        raise AssertionError("no NonFiniteError")
    except NonFiniteError as e:
        ranks = e.ranks
        assert "left unchanged on every rank" in str(e)
    assert torch.equal(we, we0) and torch.equal(se, se0)
    assert torch.equal(buf.nan_to_num(-7.0), buf0.nan_to_num(-7.0))
    compressed_allreduce(torch.randn(n), we, se)  # the group is still in step
    skipper = OneBit(on_nonfinite="skip")
    flat = torch.full((n,), float("inf")) if r == 0 else torch.ones(n)
    skipper.reduce("k", flat)
    assert skipper.last_skipped and skipper.skipped_steps == 1
    assert bool(flat.isnan().all())  # on every rank: no rank keeps its own input
    assert skipper.state["k"]["step"] == 0
    return ranks


def zero_size_and_bad_input() -> list[str]:
    w = comm.get_world_size()
    empty = torch.empty(0)
    assert compressed_allreduce(empty, torch.zeros(0), torch.zeros(0)) is empty
    h = compressed_allreduce(empty, torch.zeros(0), torch.zeros(0), async_op=True)
    assert h.done() and h.wait() is empty
    msgs = []
    for call in (
        lambda: compressed_allreduce(torch.ones(10), torch.zeros(10), torch.zeros(5)),
        lambda: compressed_allreduce(
            torch.ones(10, dtype=torch.int32), torch.zeros(16 * w), torch.zeros(16)
        ),
        lambda: compressed_allreduce(
            torch.ones(4, 4).t(),
            torch.zeros(padded_numel(16, w)),
            torch.zeros(padded_numel(16, w) // w),
        ),
    ):
        try:
            call()
            msgs.append("no error")
        except (ValueError, TypeError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def compressor_resume_is_bit_identical(name: str) -> bool:
    r = comm.get_rank()
    shapes = [torch.Size([8, 6]), torch.Size([6]), torch.Size([5, 4])]
    n = sum(s.numel() for s in shapes)

    def make() -> Any:
        return {
            "onebit": lambda: OneBit(warmup_steps=1),
            "powersgd": lambda: PowerSGD(rank=2, start_iter=1, min_compression_rate=1.0),
            "fp16": FP16,
            "bf16": BF16,
            "none": NoCompression,
        }[name]()

    def data(step: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(step * 10 + r))

    c = make()
    for step in range(3):
        c.reduce("bucket0", data(step), shapes=shapes)
    saved = c.state_dict()
    a = [c.reduce("bucket0", data(step), shapes=shapes).clone() for step in (3, 4)]
    c2 = make()
    c2.load_state_dict(saved)
    b = [c2.reduce("bucket0", data(step), shapes=shapes).clone() for step in (3, 4)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return True


def train(name: str, steps: int = 150) -> float:
    """A 2-layer MLP regression, each rank on its own shard; returns the final eval loss."""
    r = comm.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(99))
    gen = torch.Generator().manual_seed(1 + r)
    comp = {
        "onebit": OneBit(warmup_steps=20),
        "powersgd": PowerSGD(rank=2, start_iter=20),
        "fp16": FP16(),
        "none": NoCompression(),
    }[name]
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = x @ true_w
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comp.reduce(0, flat, shapes=shapes)
        off = 0
        for p in params:
            p.grad.copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
    xe = torch.randn(512, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(xe), xe @ true_w))


def segmented_onebit_is_consistent() -> list[float]:
    """Per-tensor scales: identical results on all ranks; NaN in one segment stops all."""
    r, w = comm.get_rank(), comm.get_world_size()
    segments = [10, 3, 24]
    n = sum(segments)
    P = padded_numel(n, w)
    we, se = torch.zeros(P), torch.zeros(P // w)
    gen = torch.Generator().manual_seed(5 + r)
    for _ in range(3):
        buf = torch.randn(n, generator=gen) * torch.tensor([100.0] * 10 + [0.01] * 3 + [1.0] * 24)
        out = compressed_allreduce(buf, we, se, segments=segments)
        everyone = comm.all_gather(out)
        assert all(torch.equal(everyone[0], o) for o in everyone)
    # each segment keeps its own magnitude (one scale would flatten the 0.01 segment to ~50)
    assert out[10:13].abs().max() < 1.0 and out[:10].abs().min() > 1.0
    we0 = we.clone()
    bad = torch.ones(n)
    if r == 1:
        bad[11] = float("inf")
    try:
        compressed_allreduce(bad, we, se, segments=segments)
        raise AssertionError("no NonFiniteError")
    except NonFiniteError as e:
        assert e.ranks == [1]
    assert torch.equal(we, we0)
    return out[:3].tolist()


def codecs_agree() -> float:
    """The numba kernels (the CPU codec) against the torch codec (the CUDA path, run here on
    CPU): 3 steps of error feedback, with and without per-tensor segments. Elementwise values
    are the same float32 operations; only the scales' sums of squares differ (float64 in the
    kernels, float32 in torch). Returns the worst absolute difference of results and state."""
    from overlap.compression import codec, codec_numba, codec_torch

    if not codec_numba.available():
        return 0.0
    r, w = comm.get_rank(), comm.get_world_size()
    worst = 0.0
    cases = [(38, None), (38, [10, 3, 24, 1]), (4099, [1, 4000, 98]), (70000, [65537, 4463])]
    for n, segments in cases:
        P = padded_numel(n, w)
        gen = torch.Generator().manual_seed(11 + r + n)
        xs = [torch.randn(n, generator=gen) for _ in range(3)]
        outs = []
        saved = dict(codec._CODECS)
        try:
            for impl in (codec_numba.NumbaCodec(), codec_torch.TorchCodec()):
                codec._CODECS["cpu"] = impl
                we, se = torch.zeros(P), torch.zeros(P // w)
                res = [compressed_allreduce(x.clone(), we, se, segments=segments) for x in xs]
                outs.append((res, we, se))
        finally:
            codec._CODECS.clear()
            codec._CODECS.update(saved)
        (ra, wa, sa), (rb, wb, sb) = outs
        for a, b in [*zip(ra, rb, strict=True), (wa, wb), (sa, sb)]:
            worst = max(worst, (a - b).abs().max().item())
        everyone = comm.all_gather(ra[-1])
        assert all(torch.equal(everyone[0], o) for o in everyone)  # bitwise across ranks
    return worst


def extreme_magnitudes_stay_finite() -> list[float]:
    """Finite gradients of 1e20 or 1e-30 are compressed, not called non-finite or flushed to
    zero: the scales' sums of squares run in float64 (a float32 norm overflows at 1e20)."""
    r, w = comm.get_rank(), comm.get_world_size()
    out = []
    for mag in (1e20, 1e-30):
        n = 4096
        we, se = torch.zeros(padded_numel(n, w)), torch.zeros(padded_numel(n, w) // w)
        x = torch.randn(n, generator=torch.Generator().manual_seed(r)) * mag
        res = compressed_allreduce(x.clone(), we, se)
        assert torch.isfinite(res).all() and torch.isfinite(we).all()
        # every element is +-(a server scale): of the inputs' order of magnitude
        ratio = float(res.abs().mean() / (x.abs().mean()))
        assert 0.1 < ratio < 10, (mag, ratio)
        out.append(ratio)
    return out


def fp16_share_of_a_spike() -> list[float]:
    """FP16 divides by W before the cast: 1e5 (above float16's 65504) on rank 0 and 0
    elsewhere averages to 1e5 / W on every rank, where casting first gave inf."""
    r = comm.get_rank()
    x = torch.full((8,), 1e5 if r == 0 else 0.0)
    FP16().reduce(0, x)
    assert torch.isfinite(x).all(), x
    return x.tolist()


def powersgd_nonfinite(mode: str) -> list[Any]:
    """PowerSGD and a non-finite input on the last rank, after a step whose matrix was all
    zeros (so its warm-start Q is zero, and an Inf times it may come out of the product as
    a finite zero: the flag that rides with the P's must catch it). Every rank raises (or
    skips) alike, the error and Q's stay as they were, the buffer is NaN; the next step is
    finite and the same on every rank (before, the NaN went into Q for good)."""
    r, w = comm.get_rank(), comm.get_world_size()
    shapes = [torch.Size([16, 16]), torch.Size([5])]
    comp = PowerSGD(rank=1, start_iter=0, on_nonfinite=mode)
    gen = torch.Generator().manual_seed(r)
    comp.reduce("k", torch.cat([torch.zeros(256), torch.randn(5, generator=gen)]), shapes=shapes)
    st = comp.state["k"]
    assert bool((st["qs"][0] == 0).all())  # the zero matrix left a zero Q
    kept = (st["error"].clone(), st["qs"][0].clone())
    flat = torch.randn(261, generator=gen)
    if r == w - 1:
        flat[3] = float("inf")
    out: list[Any] = []
    try:
        comp.reduce("k", flat, shapes=shapes)
        out.append("skipped" if comp.last_skipped else "ok")
    except NonFiniteError:
        out.append("raised")
    out.append(bool(flat.isnan().all()))
    out.append(torch.equal(st["error"], kept[0]) and torch.equal(st["qs"][0], kept[1]))
    nxt = torch.randn(261, generator=gen)
    comp.reduce("k", nxt, shapes=shapes)
    out.append(bool(torch.isfinite(nxt).all()))
    out.append(all(torch.equal(nxt, o) for o in comm.all_gather(nxt)))
    return out


def powersgd_float64() -> list[Any]:
    """PowerSGD on a float64 bucket, at full rank (so the approximation is the average
    itself): [the dtype out, the largest error against the exact float64 average, over
    three steps]. Before the forty-seventh session it computed in float32: 1e-7 off where
    float64 is 1e-16 off."""
    r, w = comm.get_rank(), comm.get_world_size()
    shapes = [torch.Size([4, 3]), torch.Size([3])]
    c = PowerSGD(rank=3, start_iter=0, min_compression_rate=0.1)
    worst, dtype = 0.0, None
    for step in range(3):
        gens = [torch.Generator().manual_seed(10 * step + j) for j in range(w)]
        xs = [1.0 + 1e-9 * torch.randn(15, dtype=torch.float64, generator=g) for g in gens]
        out = c.reduce("b", xs[r].clone(), shapes=shapes)
        dtype = str(out.dtype)
        worst = max(worst, float((out - torch.stack(xs).mean(0)).abs().max()))
    return [dtype, worst]


def block_quantized_handle_bytes() -> list[int]:
    """An async ``Int8.reduce`` given its tensors' shapes reports, as the Handle's
    ``nbytes``, the bytes of the buffer as laid out per tensor (each tensor padded to whole
    blocks): [the handle's nbytes, wire_bytes with the shapes, wire_bytes without]. Before,
    the Handle counted the buffer as one run of blocks, without the padding that travels."""
    c = Int8(block=64)
    shapes = [torch.Size([7, 30]), torch.Size([30]), torch.Size([3])]
    flat = torch.ones(sum(s.numel() for s in shapes))
    h = c.reduce("b", flat, shapes=shapes, async_op=True)
    h.wait(60)
    return [h.nbytes, c.wire_bytes(flat, None, shapes), c.wire_bytes(flat)]
