"""Rank-side checks of OneBitAdam (gloo pools here; the standalone case runs under mpiexec too).

The reference is DeepSpeed's 1-bit Adam computed from the math for all W ranks in one
process: plain Adam on the averaged gradient during warm-up, then per-rank momenta averaged
by the two-phase 1-bit allreduce (DESIGN.md section 4, with each tensor's own scales) with
worker and server error feedback, and the update m / (sqrt(v) + eps) + wd p, no bias
correction.
"""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import torch
from torch import nn

import overlap
from overlap import BucketScheduler, OneBitAdam, comm
from overlap.compression import padded_numel
from overlap.errors import NonFiniteError
from tests.gloo.catching import catcher

SHAPES = [(5, 3), (7,), (4, 4), (1,), (33,)]
FREEZE = 3
STEPS = 7
# group 0: the first three tensors, DeepSpeed's (no bias correction); group 1 (other betas,
# weight decay, AdamW's bias correction): the rest
GROUPS = [
    {"idx": [0, 1, 2], "lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.0, "bc": False},
    {"idx": [3, 4], "lr": 5e-3, "betas": (0.8, 0.99), "weight_decay": 0.1, "bc": True},
]
EPS = 1e-8


# ------------------------------------------------------------------------- the reference
def ref_compress(
    xs: list[torch.Tensor],
    wes: list[torch.Tensor],
    ses: list[torch.Tensor],
    segments: list[int],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The segmented two-phase 1-bit allreduce, straight from the math: each segment (one
    tensor; the padding is a segment of its own) has its own worker scale per rank and its
    own server scale per chunk."""
    w, n = len(xs), xs[0].numel()
    P = padded_numel(n, w)
    chunk = P // w
    lengths = [*segments, P - n] if len(segments) > 1 else [P]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    seg_of = torch.zeros(P, dtype=torch.long)
    for k, (a, L) in enumerate(zip(starts, lengths, strict=True)):
        seg_of[a : a + L] = k

    def rms(v: torch.Tensor) -> float:
        return math.sqrt(float((v.double() ** 2).sum()) / v.numel()) if v.numel() else 0.0

    signs, scales, new_we = [], [], []
    for r in range(w):
        b = torch.zeros(P)
        b[:n] = xs[r]
        b = b + wes[r]
        sc = torch.tensor([rms(b[a : a + L]) for a, L in zip(starts, lengths, strict=True)])
        sign = torch.where(b >= 0, 1.0, -1.0)
        signs.append(sign)
        scales.append(sc)
        new_we.append(b - sc[seg_of] * sign)
    result, new_se = torch.zeros(P), []
    for j in range(w):
        lo, hi = j * chunk, (j + 1) * chunk
        c = torch.zeros(chunk)
        for r in range(w):
            c = c + signs[r][lo:hi] * (scales[r][seg_of[lo:hi]] / w)
        c = c + ses[j]
        cs = torch.where(c >= 0, 1.0, -1.0)
        ss = torch.zeros(chunk)
        for k in range(len(lengths)):
            sel = seg_of[lo:hi] == k
            if bool(sel.any()):
                ss[sel] = rms(c[sel])
        new_se.append(c - ss * cs)
        result[lo:hi] = ss * cs
    return result[:n], new_we, new_se


class Reference:
    """1-bit Adam for W simulated ranks; ``partition`` lists the parameter indices reduced
    together (one compressed buffer per part, in that order)."""

    def __init__(self, params: list[torch.Tensor], w: int, partition: list[list[int]]) -> None:
        self.p = [x.detach().clone() for x in params]
        self.m = [torch.zeros_like(x) for x in params]
        self.v = [torch.zeros_like(x) for x in params]
        self.w, self.partition, self.done = w, partition, 0
        self.err: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.hyper = {i: g for g in GROUPS for i in g["idx"]}

    def step(self, grads: list[list[torch.Tensor]]) -> None:
        """``grads[r][i]``: rank r's gradient of parameter i."""
        w = self.w
        if self.done < FREEZE:
            for i in range(len(self.p)):
                h = self.hyper[i]
                b1, b2 = h["betas"]
                g = sum(grads[r][i] for r in range(w)) / w
                self.m[i] = self.m[i] * b1 + (1 - b1) * g
                self.v[i] = self.v[i] * b2 + (1 - b2) * g * g
                self._update(i)
        else:
            for k, part in enumerate(self.partition):
                sizes = [self.p[i].numel() for i in part]
                n = sum(sizes)
                P = padded_numel(n, w)
                wes, ses = self.err.get(
                    k, ([torch.zeros(P) for _ in range(w)], [torch.zeros(P // w) for _ in range(w)])
                )
                xs = [
                    torch.cat(
                        [
                            torch.lerp(grads[r][i], self.m[i], self.hyper[i]["betas"][0]).reshape(
                                -1
                            )
                            for i in part
                        ]
                    )
                    for r in range(w)
                ]
                out, wes, ses = ref_compress(xs, wes, ses, sizes)
                self.err[k] = (wes, ses)
                a = 0
                for i, s in zip(part, sizes, strict=True):
                    self.m[i] = out[a : a + s].view_as(self.m[i]).clone()
                    a += s
            for i in range(len(self.p)):
                self._update(i)
        self.done += 1

    def _update(self, i: int) -> None:
        h = self.hyper[i]
        if not h["bc"]:  # DeepSpeed's
            upd = self.m[i] / (self.v[i].sqrt() + EPS) + h["weight_decay"] * self.p[i]
            self.p[i] = self.p[i] - h["lr"] * upd
            return
        b1, b2 = h["betas"]  # AdamW's, the variance's correction frozen with it
        t, t_v = self.done + 1, min(self.done + 1, FREEZE)
        denom = (self.v[i] / (1 - b2**t_v)).sqrt() + EPS
        self.p[i] = self.p[i] * (1 - h["lr"] * h["weight_decay"])
        self.p[i] = self.p[i] - h["lr"] / (1 - b1**t) * self.m[i] / denom


# -------------------------------------------------------------------------- fixtures
def _params(device: str = "cpu") -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(11)
    return [nn.Parameter(torch.randn(*s, generator=gen).to(device)) for s in SHAPES]


def _opt(params: list[nn.Parameter], **kw: Any) -> OneBitAdam:
    groups = [
        {
            "params": [params[i] for i in g["idx"]],
            "lr": g["lr"],
            "betas": g["betas"],
            "weight_decay": g["weight_decay"],
            "bias_correction": g["bc"],
        }
        for g in GROUPS
    ]
    return OneBitAdam(groups, freeze_step=FREEZE, eps=EPS, **kw)


def _all_grads(step: int, w: int, device: str = "cpu") -> list[list[torch.Tensor]]:
    """Every rank's gradients at ``step`` (each rank can compute every rank's)."""
    out = []
    for r in range(w):
        gen = torch.Generator().manual_seed(1000 * step + r)
        out.append([torch.randn(*s, generator=gen).to(device) for s in SHAPES])
    return out


def _backward(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    """A real backward whose gradients are exactly ``grads``."""
    sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()  # type: ignore[union-attr]


def _same_on_every_rank(ts: list[torch.Tensor]) -> None:
    flat = torch.cat([t.detach().reshape(-1) for t in ts])
    everyone = comm.all_gather(flat)
    assert all(torch.equal(everyone[0], x) for x in everyone), "ranks differ"


def _close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = a.detach().cpu(), b.cpu()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (what, i, a, b)


# ----------------------------------------------------------------------------- checks
def standalone_matches_reference(mode: str = "blocking", device: str = "cpu") -> int:
    """``loss.backward(); opt.step()``: every step equal to the reference (float rounding),
    parameters bitwise identical across ranks, the stage switch at freeze_step."""
    r, w = comm.get_rank(), comm.get_world_size()
    params = _params(device)
    opt = _opt(params)
    ref = Reference([p.cpu() for p in params], w, [list(range(len(SHAPES)))])
    for step in range(STEPS):
        grads = _all_grads(step, w)
        opt.zero_grad()
        _backward(params, [g.to(device) for g in grads[r]])
        assert opt.frozen == (step >= FREEZE)
        opt.step()
        ref.step(grads)
        _close(list(params), ref.p, f"params at step {step}")
        _close([opt.state[p]["exp_avg"] for p in params], ref.m, f"momentum at step {step}")
        _same_on_every_rank(list(params))
    assert opt.step_count == STEPS and all(opt.state[p]["step"] == STEPS for p in params)
    return opt.step_count


def overlapped_matches_reference(mode: str = "blocking", device: str = "cpu") -> list[list[int]]:
    """``BucketScheduler(params, optimizer=opt)`` with several buckets: equal to the reference
    with the scheduler's bucket partition; .grad keeps the local gradient once frozen."""
    r, w = comm.get_rank(), comm.get_world_size()
    params = _params(device)
    opt = _opt(params)
    sched = BucketScheduler(params, optimizer=opt, bucket_cap_mb=1e-4, first_bucket_mb=5e-5)
    ref = Reference([p.cpu() for p in params], w, [])
    pidx = {id(p): i for i, p in enumerate(params)}
    try:
        for step in range(STEPS):
            cpu_grads = _all_grads(step, w)
            grads = [[g.to(device) for g in gs] for gs in cpu_grads]
            opt.zero_grad()
            if mode == "blocking":
                _backward(params, grads[r])
                sched.synchronize()
            else:

                async def main(g: list[torch.Tensor] = grads[r]) -> None:
                    loss = sum((p * x).sum() for p, x in zip(params, g, strict=True))
                    await sched.backward(loss)  # type: ignore[arg-type]

                overlap.run(main(), loop=mode)  # type: ignore[arg-type]
            opt.step()
            # the frozen steps run on the buckets as rebuilt after step 0
            ref.partition = [[pidx[id(p)] for p in b.params] for b in sched.buckets]
            ref.step(cpu_grads)
            _close(list(params), ref.p, f"params at step {step}")
            if step >= FREEZE:  # DeepSpeed's: backward allreduce off, .grad is local
                _close([p.grad for p in params], grads[r], "local grads")  # type: ignore[misc]
            _same_on_every_rank(list(params))
        assert len(sched.buckets) > 1
        return ref.partition
    finally:
        sched.remove()


def nonfinite(mode: str, scheduled: bool) -> list[Any]:
    """A NaN gradient on the last rank, in warm-up and after the freeze: every rank raises
    (or skips) and the momentum, variance, error feedback and parameters are untouched."""
    r, w = comm.get_rank(), comm.get_world_size()
    params = _params()
    opt = _opt(params, on_nonfinite=mode)
    sched = (
        BucketScheduler(params, optimizer=opt, bucket_cap_mb=1e-4, first_bucket_mb=5e-5)
        if scheduled
        else None
    )
    seen = []
    try:
        for step in range(STEPS):
            grads = _all_grads(step, w)[r]
            poisoned = step in (1, FREEZE + 1)
            if poisoned and r == w - 1:
                grads[4][3] = float("nan")
            before = copy.deepcopy(opt.state_dict())
            p_before = [p.detach().clone() for p in params]
            opt.zero_grad()
            _backward(params, grads)
            try:
                if sched is not None:
                    sched.synchronize()
                opt.step()
                seen.append("ok" if not opt.last_skipped else "skipped")
            except NonFiniteError:
                seen.append("raised")
            if poisoned:
                # Untouched: the parameters, and the momentum and error feedback of what the
                # NaN could reach: everything in warm-up (one allreduce) and standalone (one
                # buffer); with a scheduler after the freeze, the NaN's own bucket (earlier
                # buckets of the step were finite and completed, as with OneBit).
                after = opt.state_dict()
                for p, q in zip(params, p_before, strict=True):
                    assert torch.equal(p.detach(), q)
                keys, idx = list(before["onebit_adam"]["codec"]["state"]), list(before["state"])
                if sched is not None and step >= FREEZE:
                    (key,) = [
                        b.index for b in sched.buckets if any(p is params[4] for p in b.params)
                    ]
                    keys = [key]
                    idx = [4]
                for k in idx:
                    for name in ("exp_avg", "exp_avg_sq"):
                        st = before["state"][k][name]
                        assert torch.equal(st, after["state"][k][name]), (step, k, name)
                codec_a = before["onebit_adam"]["codec"]["state"]
                codec_b = after["onebit_adam"]["codec"]["state"]
                for key in keys:
                    for e in ("worker_error", "server_error"):
                        a = codec_a[key][e] if key in codec_a else None
                        b = codec_b[key][e] if key in codec_b else None
                        if a is None:  # no state before: none committed after either
                            assert b is None or not bool(b.any()), (step, key, e)
                        else:
                            assert torch.equal(a, b), (step, key, e)
            for p in params:
                assert bool(torch.isfinite(p).all())
                assert bool(torch.isfinite(opt.state[p]["exp_avg"]).all())
        _same_on_every_rank(list(params))
        return [seen, opt.skipped_steps, opt.step_count]
    finally:
        if sched is not None:
            sched.remove()


def resume_is_bit_identical(scheduled: bool) -> bool:
    """state_dict()/load_state_dict() through torch.save: the continuation is bitwise equal."""
    r, w = comm.get_rank(), comm.get_world_size()

    def setup() -> tuple[list[nn.Parameter], OneBitAdam, BucketScheduler | None]:
        params = _params()
        opt = _opt(params)
        s = (
            BucketScheduler(params, optimizer=opt, bucket_cap_mb=1e-4, first_bucket_mb=5e-5)
            if scheduled
            else None
        )
        return params, opt, s

    def step(params: list[nn.Parameter], opt: OneBitAdam, s: Any, i: int) -> None:
        opt.zero_grad()
        _backward(params, _all_grads(i, w)[r])
        if s is not None:
            s.synchronize()
        opt.step()

    params, opt, s = setup()
    for i in range(FREEZE + 2):
        step(params, opt, s, i)
    buf = io.BytesIO()
    torch.save(
        {
            "params": [p.detach().clone() for p in params],
            "opt": opt.state_dict(),
            "sched": s.state_dict() if s is not None else None,
        },
        buf,
    )
    for i in range(FREEZE + 2, FREEZE + 5):
        step(params, opt, s, i)
    a = [p.detach().clone() for p in params]
    if s is not None:
        s.remove()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    params2, opt2, s2 = setup()
    with torch.no_grad():
        for p, q in zip(params2, saved["params"], strict=True):
            p.copy_(q)
    opt2.load_state_dict(saved["opt"])
    if s2 is not None:
        s2.load_state_dict(saved["sched"])
    assert opt2.frozen and opt2.step_count == FREEZE + 2
    for i in range(FREEZE + 2, FREEZE + 5):
        step(params2, opt2, s2, i)
    if s2 is not None:
        s2.remove()
    return all(torch.equal(x, y.detach()) for x, y in zip(a, params2, strict=True))


def refusals() -> dict[str, str]:
    """Every refusal names the problem and the fix, and changes nothing."""
    out: dict[str, str] = {}

    catch = catcher(out)

    lin = nn.Linear(3, 2)
    catch("freeze_negative", lambda: OneBitAdam(lin.parameters(), freeze_step=-1))
    catch("freeze_zero", lambda: OneBitAdam(lin.parameters(), freeze_step=0))
    ints = nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)
    catch("non_float", lambda: OneBitAdam([lin.weight, ints], freeze_step=2))
    catch(
        "non_freeze",
        lambda: OneBitAdam([{"params": lin.parameters(), "non_freeze": True}], freeze_step=2),
    )
    emb = nn.Embedding(10, 4, sparse=True)
    eopt = OneBitAdam(emb.parameters(), freeze_step=2)
    emb(torch.tensor([1, 2])).sum().backward()
    catch("sparse", eopt.step)
    opt = OneBitAdam(lin.parameters(), freeze_step=2)
    s1 = BucketScheduler(lin, optimizer=opt)
    catch("two_schedulers", lambda: BucketScheduler(lin, optimizer=opt))
    lin2 = nn.Linear(3, 2)
    catch(
        "with_compression",
        lambda: BucketScheduler(
            lin2,
            optimizer=OneBitAdam(lin2.parameters(), freeze_step=2),
            compression=overlap.OneBit(),
        ),
    )
    catch("step_without_sync", opt.step)
    s1.remove()
    s2 = BucketScheduler(lin, optimizer=opt)  # after remove() the optimizer is free again
    s2.remove()
    two = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    partial = OneBitAdam(two[0].parameters(), freeze_step=2)
    catch("uncovered_groups", lambda: BucketScheduler(two, optimizer=partial))
    # another learning rate on rank 1: every rank refuses (overlap.agreement)
    lr = 1e-3 if comm.get_rank() == 1 else 1e-4
    catch("other_lr", lambda: BucketScheduler(lin2, optimizer=OneBitAdam(lin2.parameters(), lr=lr)))
    # standalone, built with another lr, freeze_step or model on rank 1: before, the ranks'
    # weights moved apart silently, the job hung at the freeze, or gloo ended it; now the
    # first step refuses on every rank with nothing updated
    r1 = comm.get_rank() == 1
    for name, kw, shape in (
        ("standalone_other_lr", {"lr": 1e-3 if r1 else 1e-4}, (3, 2)),
        ("standalone_other_freeze", {"freeze_step": 3 if r1 else 2}, (3, 2)),
        ("standalone_other_model", {}, (3, 3) if r1 else (3, 2)),
    ):
        lone = nn.Linear(*shape)
        w0 = lone.weight.detach().clone()
        lone(torch.ones(1, 3)).sum().backward()
        catch(name, OneBitAdam(lone.parameters(), **kw).step)
        out[name + "_unchanged"] = str(torch.equal(lone.weight, w0))
    catch(
        "not_onebitadam",
        lambda: BucketScheduler(lin, optimizer=torch.optim.Adam(lin.parameters())),
    )
    catch(
        "reduce_dtype",
        lambda: BucketScheduler(lin, optimizer=opt, reduce_dtype=torch.float16),
    )
    # checkpoints from elsewhere: another world size, another model, another optimizer
    params = _params()
    good = _opt(params)
    _backward(params, _all_grads(0, comm.get_world_size())[comm.get_rank()])
    good.step()
    sd = good.state_dict()
    before = [good.state[p]["exp_avg"].clone() for p in params]
    other_w = copy.deepcopy(sd)
    other_w["onebit_adam"]["world_size"] = comm.get_world_size() + 1
    catch("other_world", lambda: good.load_state_dict(other_w))
    catch("other_model", lambda: OneBitAdam(lin.parameters(), freeze_step=2).load_state_dict(sd))
    small = _params()
    shaped = _opt([nn.Parameter(torch.zeros(2, 2)) if i == 2 else q for i, q in enumerate(small)])
    catch("other_shapes", lambda: shaped.load_state_dict(sd))
    # the same parameters in other groups: refused in the checks the vote carries (before:
    # torch's own error, from inside the load, after the vote had let the other ranks load)
    regrouped = OneBitAdam([{"params": params[:2]}, {"params": params[2:]}], freeze_step=FREEZE)
    catch("other_groups", lambda: regrouped.load_state_dict(sd))
    catch(
        "not_onebitadam_state", lambda: good.load_state_dict(torch.optim.Adam(params).state_dict())
    )
    # states of two saves, one a rank: refused on every rank, nothing loaded (a deep copy:
    # torch's state_dict() holds the live state tensors, which the next step changes)
    sd = copy.deepcopy(sd)
    _backward(params, _all_grads(0, comm.get_world_size())[comm.get_rank()])
    good.step()
    later = good.state_dict()
    mixed = later if comm.get_rank() == 1 else sd
    catch("mixed_saves", lambda: good.load_state_dict(mixed))
    out["steps_after_mixed"] = str(good.state_dict()["onebit_adam"]["step"])
    good.load_state_dict(sd)
    out["steps_after_load"] = str(good.state_dict()["onebit_adam"]["step"])
    assert all(
        torch.equal(good.state[p]["exp_avg"], b) for p, b in zip(params, before, strict=True)
    )
    return out


def _scaled_backward(
    scaler: torch.amp.GradScaler, params: list[nn.Parameter], grads: list[torch.Tensor]
) -> None:
    """``scaler.scale(loss).backward()`` for a loss whose gradients are ``grads``."""
    scaler.scale(sum((p * g).sum() for p, g in zip(params, grads, strict=True))).backward()  # type: ignore[union-attr]


def under_grad_scaler() -> dict[str, Any]:
    """OneBitAdam standalone under torch.amp.GradScaler (a power-of-two scale, so unscaling
    is exact), against the same optimizer fed unscaled gradients, through the warm-up and
    the compressed stage; then an overflow on the last rank only (with the default
    on_nonfinite="raise"): every rank skips that step and no rank hangs (before, the
    scaler skipped step() on that rank alone, and its peers' collective waited for ever).
    Then the same under a BucketScheduler: refused, nothing updated."""
    r, w = comm.get_rank(), comm.get_world_size()
    a, b = _params(), _params()
    opt_a, opt_b = _opt(a), _opt(b)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    for step in range(STEPS):
        grads = _all_grads(step, w)[r]
        opt_a.zero_grad()
        _scaled_backward(scaler, a, grads)
        scaler.step(opt_a)
        scaler.update()
        opt_b.zero_grad()
        _backward(b, grads)
        opt_b.step()
    out: dict[str, Any] = {
        "diff": max(float((p - q).abs().max()) for p, q in zip(a, b, strict=True)),
        "frozen": opt_a.frozen,
    }
    before = [p.detach().clone() for p in a]
    opt_a.zero_grad()
    grads = _all_grads(STEPS, w)[r]
    if r == w - 1:
        grads[0][0, 0] = float("inf")
    _scaled_backward(scaler, a, grads)
    scaler.step(opt_a)
    scaler.update()
    out["skipped"] = [opt_a.last_skipped, opt_a.skipped_steps]
    out["unchanged"] = all(torch.equal(p.detach(), q) for p, q in zip(a, before, strict=True))
    out["scale"] = scaler.get_scale()  # halved on the rank that overflowed only

    c = _params()
    opt_c = _opt(c)
    sched = BucketScheduler(c, optimizer=opt_c, bucket_cap_mb=1e-4, first_bucket_mb=5e-5)
    try:
        kept = [p.detach().clone() for p in c]
        other = torch.amp.GradScaler("cpu", init_scale=256.0)
        _scaled_backward(other, c, _all_grads(0, w)[r])
        sched.synchronize()
        try:
            other.step(opt_c)
            out["scheduled"] = "no error"
        except RuntimeError as e:
            out["scheduled"] = str(e).split(":")[0]
        out["scheduled_unchanged"] = all(
            torch.equal(p.detach(), q) for p, q in zip(c, kept, strict=True)
        )
    finally:
        sched.remove()
    return out
