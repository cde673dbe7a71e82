"""Rank-side checks of BucketScheduler against torch DDP on real gloo ranks."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap import BucketScheduler, broadcast_parameters, comm
from overlap.compression import FP16, NoCompression, OneBit, PowerSGD
from overlap.compression.base import Compressor, Steps
from overlap.errors import IncompleteBackwardError
from tests.gloo.catching import catcher, run_dropping
from tests.realign import realign


class Net(nn.Module):
    """Tied weights, a branch used on rank 0 only, a never-used layer, frozen, float64."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.branch = nn.Linear(16, 16)
        self.never = nn.Linear(16, 4)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.d64 = nn.Linear(16, 16).double()
        self.head = nn.Linear(16, 8)
        self.head2 = nn.Linear(16, 8)
        self.head2.weight = self.head.weight  # tied

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.hidden(h))
        if use_branch:
            h = h + self.branch(h)
        h = self.frozen(h)
        h = self.d64(h.double()).float()
        return self.head(h) + self.head2(h)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x is None) == (y is None), (i, x is None, y is None)
        if x is not None and y is not None:
            assert torch.allclose(x.double(), y.double(), atol=1e-6), (i, (x - y).abs().max())


def equals_ddp(
    mode: str, as_view: bool = False, steps: int = 3, solo_bytes: int = 0, compiled: bool = False
) -> int:
    """``solo_bytes``: lower the size from which a gradient is reduced on its own, in place
    (scheduler.SOLO_BYTES, 1 MiB), so this small model's weights take that path: rank 1
    lacks ``branch``'s gradient (its slot's zeros go instead), d64 is float64 (its slot).
    ``compiled``: the scheduler is built over ``torch.compile(model)`` (aot_eager: the
    compiled forward and backward graphs without a C++ build), as a user of torch.compile
    writes it, and that module is trained."""
    import overlap.scheduler.scheduler as scheduler_module

    r = comm.get_rank()
    torch.manual_seed(0)
    ours = Net()
    theirs = copy.deepcopy(ours)
    ddp = DDP(theirs, find_unused_parameters=True)
    saved = scheduler_module.SOLO_BYTES
    scheduler_module.SOLO_BYTES = solo_bytes or saved
    model: nn.Module = torch.compile(ours, backend="aot_eager") if compiled else ours
    try:
        sched = BucketScheduler(
            model, bucket_cap_mb=0.001, first_bucket_mb=0.0005, gradient_as_bucket_view=as_view
        )
    finally:
        scheduler_module.SOLO_BYTES = saved
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + r)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss_a = nn.functional.mse_loss(model(x, r == 0), y)
        if mode == "blocking":
            loss_a.backward()
            sched.synchronize()
        else:
            overlap.run(sched.backward(loss_a), loop=mode)  # type: ignore[arg-type]
        nn.functional.mse_loss(ddp(x, r == 0), y).backward()
        _close(_grads(ours), _grads(theirs))
        if as_view:
            b, pos = sched._where[id(ours.emb.weight)]
            assert ours.emb.weight.grad is not None
            assert ours.emb.weight.grad.data_ptr() == b.view_of(pos).data_ptr()
        if solo_bytes:  # reduced in place: some gradients never went through a bucket
            stats = sched.statistics()
            assert stats["direct"] > 0 and stats["launches"] > stats["buckets"], stats
        opt_a.step()
        opt_b.step()
    assert ours.never.weight.grad is None  # unused on every rank, as DDP
    assert ours.frozen.weight.grad is None
    stats = sched.statistics()
    assert stats["rebuilt"] and stats["buckets"] >= 2
    assert (
        (stats["launches"] > stats["buckets"])
        if solo_bytes
        else (stats["launches"] == stats["buckets"])
    )
    sched.remove()
    return steps


class UserAverage(Compressor):
    """A user's compressor written to the original ``reduce_steps`` signature (no
    ``outputs``): the scheduler must call it without the keyword it does not take."""

    name = "user-average"
    summable = True

    def reduce_steps(  # type: ignore[override]
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> Steps:
        yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
        return flat


def user_compressor_equals_ddp() -> int:
    """A user's compressor of the original signature, through the scheduler: DDP's gradients."""
    r = comm.get_rank()
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    theirs = copy.deepcopy(ours)
    ddp = DDP(theirs)
    sched = BucketScheduler(
        ours, compression=UserAverage(), bucket_cap_mb=0.0004, first_bucket_mb=0.0002
    )
    gen = torch.Generator().manual_seed(20 + r)
    try:
        for _ in range(2):
            x = torch.randn(4, 8, generator=gen)
            ours.zero_grad()
            theirs.zero_grad()
            ours(x).pow(2).mean().backward()
            sched.synchronize()
            ddp(x).pow(2).mean().backward()
            _close(_grads(ours), _grads(theirs))
        return int(sched.statistics()["buckets"])
    finally:
        sched.remove()


def no_sync_equals_ddp(solo_bytes: int = 0) -> bool:
    """``solo_bytes`` as in :func:`equals_ddp`: the accumulated weights are then scaled and
    reduced in place in .grad."""
    import overlap.scheduler.scheduler as scheduler_module

    r = comm.get_rank()
    torch.manual_seed(1)
    ours = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    theirs = copy.deepcopy(ours)
    ddp = DDP(theirs)
    saved = scheduler_module.SOLO_BYTES
    scheduler_module.SOLO_BYTES = solo_bytes or saved
    try:
        sched = BucketScheduler(ours)
    finally:
        scheduler_module.SOLO_BYTES = saved
    gen = torch.Generator().manual_seed(r)
    xs = [torch.randn(5, 6, generator=gen) for _ in range(3)]
    for i, x in enumerate(xs):
        last = i == len(xs) - 1
        with sched.no_sync() if not last else _null():
            ours(x).sum().backward()
        with ddp.no_sync() if not last else _null():
            ddp(x).sum().backward()
    sched.synchronize()
    _close(_grads(ours), _grads(theirs))
    assert (sched.statistics()["direct"] > 0) == bool(solo_bytes)
    sched.remove()
    return True


class _TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x).sum()
        return y + self.b(x).pow(2).sum() if use_b else y


def no_sync_branch_equals_ddp(last_uses_b: str, as_view: bool, mode: str) -> list[bool]:
    """A branch used by the backwards under ``no_sync()`` but not by the step's last one:
    on rank 1 only (``last_uses_b="rank 1"``) or on no rank (``"none"``). DDP (with
    ``find_unused_parameters=True``) counts a parameter used by any backward since the last
    sync and averages its accumulated gradient. Before the forty-sixth session the
    scheduler sent zeros for rank 0's accumulation in the first case (a wrong average, the
    same on every rank), and in the second left each rank its own gradient (the ranks'
    weights drifted apart), with no error. Two steps, grads set to None between."""
    r = comm.get_rank()
    torch.manual_seed(3)
    ours = _TwoBranches()
    theirs = copy.deepcopy(ours)
    ddp = DDP(theirs, find_unused_parameters=True)
    sched = BucketScheduler(ours, gradient_as_bucket_view=as_view)
    gen = torch.Generator().manual_seed(10 + r)
    try:
        for _ in range(2):
            xs = [torch.randn(2, 4, generator=gen) for _ in range(3)]
            for i, x in enumerate(xs):
                last = i == len(xs) - 1
                use_b = not last or (last_uses_b == "rank 1" and r == 1)
                with sched.no_sync() if not last else _null():
                    loss = ours(x, use_b)
                    if last and mode == "await":
                        overlap.run(sched.backward(loss))
                    else:
                        loss.backward()
                with ddp.no_sync() if not last else _null():
                    ddp(x, use_b).backward()
            if mode == "blocking":
                sched.synchronize()
            _close(_grads(ours), _grads(theirs))
            ours.zero_grad(set_to_none=True)
            theirs.zero_grad(set_to_none=True)
        return [True]
    finally:
        sched.remove()


def kept_grads_equal_ddp(as_view: bool, compression: str) -> list[bool]:
    """``.grad`` not zeroed between steps (DDP accumulates into it), with a branch used by
    both ranks, then by rank 1 only, then by none. DDP sends a parameter's ``.grad`` where
    this rank did not use it, and leaves a parameter no rank used untouched. Before the
    forty-sixth session the scheduler sent zeros there (step 2 averaged 7 where DDP gave 10)
    and, with ``gradient_as_bucket_view``, zeroed the ``.grad`` of the parameter no rank used
    (step 3 read 0)."""
    r = comm.get_rank()
    torch.manual_seed(4)
    ours = _TwoBranches()
    theirs = copy.deepcopy(ours)
    ddp = DDP(theirs, find_unused_parameters=True, gradient_as_bucket_view=as_view)
    comp = FP16() if compression == "fp16" else None
    sched = BucketScheduler(ours, gradient_as_bucket_view=as_view, compression=comp)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(20 + r))
    try:
        for use_b in (True, r == 1, False):
            ours(x, use_b).backward()
            sched.synchronize()
            ddp(x, use_b).backward()
            if comp is None:
                _close(_grads(ours), _grads(theirs))
            else:
                for a, b in zip(_grads(ours), _grads(theirs), strict=True):
                    assert a is not None and b is not None
                    assert torch.allclose(a, b, rtol=1e-2, atol=1e-2), (a, b)
        return [True]
    finally:
        sched.remove()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def first_bucket_starts_before_backward_ends() -> list[float]:
    torch.manual_seed(2)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(12)])
    sched = BucketScheduler(model, bucket_cap_mb=0.5, first_bucket_mb=0.3)
    x = torch.randn(512, 256)
    margins = []
    for _ in range(3):  # the last two run on the rebuilt buckets
        loss = model(x).pow(2).mean()
        loss.backward()
        t_end = time.perf_counter()
        sched.synchronize()
        first = min(e["start"] for e in sched.statistics()["timeline"])
        margins.append(t_end - first)
    sched.remove()
    assert all(m > 0 for m in margins), margins  # the first collective began during backward
    return margins


def copy_back_as_each_bucket_lands(name: str) -> float:
    """On the CPU each bucket goes back into .grad as soon as it is reduced, not after the
    last one: with a 16 MiB last bucket (the first layer's weight, still on the wire for
    milliseconds), bucket 0's copy-back must end before the last bucket's reduction does.
    Before, every copy-back ran after the last reduction. Returns that margin in seconds."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4096, 1024), nn.Linear(1024, 64), nn.Linear(64, 64))
    comp = {"none": NoCompression(), "fp16": FP16()}[name]
    tracer = overlap.Tracer()
    sched = BucketScheduler(
        model, compression=comp, bucket_cap_mb=0.02, first_bucket_mb=0.02, tracer=tracer
    )
    try:
        model(torch.randn(4, 4096)).sum().backward()
        sched.synchronize()
        last = len(sched.buckets) - 1
        assert last >= 2, sched.buckets
        spans = {(s[0], s[5].get("bucket")): s for s in tracer.spans}
        assert all(("copy-back", b.index) in spans for b in sched.buckets), spans.keys()
        margin = (spans[(f"reduce bucket {last}", last)][3] - spans[("copy-back", 0)][3]) / 1e9
        assert margin > 0, margin
        return margin
    finally:
        sched.remove()
        tracer.detach()


def train_with(name: str, steps: int = 120) -> float:
    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    comp = {
        "none": NoCompression(),
        "fp16": FP16(),
        "onebit": OneBit(warmup_steps=20),
        "powersgd": PowerSGD(rank=2, start_iter=20),
    }[name]
    sched = BucketScheduler(model, compression=comp)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(99))
    gen = torch.Generator().manual_seed(1 + r)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x @ true_w).backward()
        sched.synchronize()
        opt.step()
    sched.remove()
    xe = torch.randn(512, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(xe), xe @ true_w))


def resume_is_bit_identical() -> bool:
    r = comm.get_rank()

    def setup() -> tuple[nn.Module, Any, BucketScheduler]:
        torch.manual_seed(3)
        m = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 2))
        s = BucketScheduler(
            m, compression=OneBit(warmup_steps=1), bucket_cap_mb=0.001, first_bucket_mb=0.0005
        )
        return m, torch.optim.Adam(m.parameters(), lr=1e-2), s

    def step(m: nn.Module, opt: Any, s: BucketScheduler, i: int) -> None:
        g = torch.Generator().manual_seed(100 * i + r)
        opt.zero_grad()
        m(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
        s.synchronize()
        opt.step()

    m, opt, s = setup()
    for i in range(4):
        step(m, opt, s, i)
    saved = (copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()), s.state_dict())
    for i in range(4, 7):
        step(m, opt, s, i)
    a = [p.detach().clone() for p in m.parameters()]
    s.remove()
    m2, opt2, s2 = setup()
    m2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    s2.load_state_dict(saved[2])
    for i in range(4, 7):
        step(m2, opt2, s2, i)
    b = [p.detach().clone() for p in m2.parameters()]
    s2.remove()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return True


def bad_inputs() -> dict[str, str]:
    r = comm.get_rank()
    out: dict[str, str] = {}

    catch = catcher(out)

    emb = nn.Embedding(10, 4, sparse=True)
    catch("sparse_module", lambda: BucketScheduler(emb))  # refused before any group is made
    attn = nn.Linear(3, 3)
    attn.sparse = True  # a module's own flag (sparse attention): its gradients are dense
    catch("sparse_flag", lambda: BucketScheduler(attn).remove())
    s1 = BucketScheduler(emb.parameters())  # parameters alone: seen in the first backward
    catch("sparse", lambda: emb(torch.tensor([1, 2])).sum().backward())
    s1.remove()
    lin = nn.Linear(3, 3)
    s2 = BucketScheduler(lin)
    catch("sync_without_backward", s2.synchronize)

    def twice() -> None:
        lin(torch.ones(1, 3)).sum().backward()
        lin(torch.ones(1, 3)).sum().backward()

    catch("second_backward", twice)
    catch("second_backward_ended", s2.synchronize)  # the step is dropped on every rank
    lin(torch.ones(1, 3)).sum().backward()
    s2.synchronize()  # the scheduler is ready for the next step
    s2.remove()
    # a reentrant checkpoint over a weight also used outside it: one backward accumulates
    # the weight's gradient twice (the message named only a second backward)
    from torch.utils.checkpoint import checkpoint

    shared = nn.Linear(3, 3)
    s3 = BucketScheduler(shared)
    x = torch.ones(1, 3, requires_grad=True)
    catch(
        "reentrant_checkpoint",
        lambda: checkpoint(shared, shared(x), use_reentrant=True).sum().backward(),
    )
    catch("reentrant_checkpoint_ended", s3.synchronize)
    checkpoint(shared, shared(x), use_reentrant=False).sum().backward()  # the fix, then a step
    s3.synchronize()
    out["reentrant_checkpoint_fixed"] = str(bool(shared.weight.grad.abs().sum() > 0))
    s3.remove()
    other = nn.Linear(3, 3 + (r == 1))
    catch("different_models", lambda: BucketScheduler(other))
    # Settings that decide the step's collectives, other on rank 1: every rank refuses,
    # naming them. Before: OneBit against none hung, FP16 against none ended both processes
    # from gloo's thread, average=False against True gave both ranks the same wrong sum.
    same = nn.Linear(3, 3)
    one = r == 1
    catch("other_compression", lambda: BucketScheduler(same, compression=FP16() if one else None))
    catch("other_average", lambda: BucketScheduler(same, average=not one))
    catch(
        "other_dtype_and_cap",
        lambda: BucketScheduler(
            same, reduce_dtype=torch.float16 if one else None, bucket_cap_mb=1 if one else 25
        ),
    )
    # alike: reduce_dtype None and the parameters' own dtype; a tracer on one rank only
    tracer = overlap.Tracer() if one else None
    BucketScheduler(same, reduce_dtype=torch.float32 if one else None, tracer=tracer).remove()
    mixed = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))]
    catch("several_devices", lambda: BucketScheduler(mixed))
    catch("nothing_to_reduce", lambda: BucketScheduler(nn.Linear(2, 2).requires_grad_(False)))
    catch("hierarchy_one_host", lambda: BucketScheduler(nn.Linear(2, 2), hierarchy="node"))
    catch("hierarchy_name", lambda: BucketScheduler(nn.Linear(2, 2), hierarchy="nodes"))
    flat = BucketScheduler(nn.Linear(2, 2))  # "auto" on one host: flat
    out["auto_on_one_host"] = str(flat.hierarchical)
    flat.remove()
    lazy = nn.Sequential(nn.LazyLinear(2), nn.Linear(2, 2))
    catch("lazy", lambda: BucketScheduler(lazy))  # before any group is made
    catch("cap_nan", lambda: BucketScheduler(nn.Linear(2, 2), bucket_cap_mb=float("nan")))
    return out


def unfrozen_after_build() -> dict[str, Any]:
    """A layer frozen when the scheduler was built, unfrozen later (gradual unfreezing):
    before, its gradient stayed each rank's own, with no error. Now the step is refused on
    every rank (rank 1 alone unfreezes it first), the scheduler keeps working once the layer
    is frozen again, and a scheduler rebuilt after unfreezing averages it."""
    r = comm.get_rank()
    out: dict[str, Any] = {}
    catch = catcher(out)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    m[0].requires_grad_(False)
    sched = BucketScheduler(m)
    gen = torch.Generator().manual_seed(10 + r)

    def step(mean: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One step; (averaged .grad, the mean of the ranks' own gradients) per trainable
        parameter (the latter from autograd.grad, which runs no hook), when every rank
        trains the same ones (``mean``)."""
        for p in m.parameters():
            p.grad = None
        x = torch.randn(3, 4, generator=gen)
        trainable = [p for p in m.parameters() if p.requires_grad]
        want = []
        if mean:
            for g in torch.autograd.grad(m(x).sum(), trainable):
                comm.all_reduce(g)
                want.append(g / comm.get_world_size())
        m(x).sum().backward()
        sched.synchronize()
        return list(zip((p.grad for p in trainable), want, strict=mean))

    def agree(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        return all(g is not None and torch.allclose(g, w, atol=1e-6) for g, w in pairs)

    if r == 1:
        m[0].requires_grad_(True)
    catch("one_rank", lambda: step(mean=False))
    m[0].requires_grad_(False)
    pairs = step()
    out["refrozen_averaged"] = agree(pairs) and len(pairs) == 2
    m[0].requires_grad_(True)
    catch("every_rank", step)
    sched.remove()
    sched = BucketScheduler(m)
    pairs = step()
    out["rebuilt_averaged"] = agree(pairs) and len(pairs) == 4
    sched.remove()
    return out


def assigned_after_build() -> dict[str, Any]:
    """Parameters assigned into the model after the scheduler was built: before, the new
    ones were not averaged and the ranks' weights drifted apart, with no error. Rank 1 alone
    puts a new Parameter in place of a weight: every rank refuses the step. Re-assigning a
    parameter the scheduler holds is no change; a new frozen one is watched like the frozen
    ones (refused once unfrozen); a new submodule is refused on every rank; a scheduler
    built after the changes averages them all."""
    r = comm.get_rank()
    out: dict[str, Any] = {}
    catch = catcher(out)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    sched = BucketScheduler(m)
    gen = torch.Generator().manual_seed(10 + r)

    def step() -> bool:
        """One step; whether every .grad is the mean of the ranks' own gradients."""
        m.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, generator=gen)
        trainable = [p for p in m.parameters() if p.requires_grad]
        want = []
        for g in torch.autograd.grad(m(x).sum(), trainable):
            comm.all_reduce(g)
            want.append(g / comm.get_world_size())
        m(x).sum().backward()
        sched.synchronize()
        return all(
            p.grad is not None and torch.allclose(p.grad, w, atol=1e-6)
            for p, w in zip(trainable, want, strict=True)
        )

    weight = m[2].weight
    if r == 1:
        m[2].weight = nn.Parameter(weight.detach().clone())
    catch("one_rank", step)
    m[2].weight = weight  # the scheduler's own parameter back: the change is undone
    out["restored_averaged"] = step()  # the same scheduler trains again
    m[2] = nn.Linear(4, 2)  # a submodule swapped out and back in: the same
    m[2].weight, m[2].bias = weight, nn.Parameter(torch.zeros(2))
    catch("bias_still_new", step)
    m[2].bias = m[2].bias  # re-assigning the new one is still new
    catch("bias_still_new_again", step)
    sched.remove()
    sched = BucketScheduler(m)
    m[0].weight = m[0].weight  # re-assigning a held parameter is no change
    bias = nn.Parameter(m[0].bias.detach().clone(), requires_grad=False)
    m[0].bias = bias  # new and frozen (the held bias goes unused on every rank)
    out["same_and_frozen_averaged"] = step()
    bias.requires_grad_(True)
    catch("new_unfrozen", step)
    bias.requires_grad_(False)
    m[2] = nn.Linear(4, 2)  # a submodule put in: its parameters are new
    catch("new_module", step)
    sched.remove()
    sched = BucketScheduler(m)
    out["rebuilt_averaged"] = step()
    sched.remove()
    return out


def saved_states() -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4))
    s = BucketScheduler(m, compression=OneBit())
    m(torch.randn(2, 4)).sum().backward()
    s.synchronize()
    out = {"sched": s.state_dict(), "onebit": s.compression.state_dict()}
    s.remove()
    return out


def _load_and_reduce(state: dict[str, Any]) -> None:
    """A OneBit learns its group at its first reduction: a state for another world size is
    refused there, on every rank, before anything is sent."""
    ob = OneBit()
    ob.load_state_dict(state)
    ob.reduce(0, torch.ones(20))


def load_mixed_saves() -> dict[str, str]:
    """States of two saves, one a rank (a save interrupted on one rank leaves them), and a
    state refused on rank 1 only: every rank refuses and nothing is loaded (before: each
    rank loaded its own: other steps of the compressor's warm-up, so the ranks issued
    collectives that did not pair). Then the same save everywhere is taken."""
    out: dict[str, str] = {}
    catch = catcher(out)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    s = BucketScheduler(m, compression=OneBit(warmup_steps=1))
    x = torch.ones(2, 4)

    def step() -> None:
        m.zero_grad()
        m(x).sum().backward()
        s.synchronize()

    step()
    early = s.state_dict()
    step()
    late = s.state_dict()
    one = comm.get_rank() == 1
    catch("mixed", lambda: s.load_state_dict(late if one else early))
    catch("refused_on_one", lambda: s.load_state_dict({**late, "world_size": 5} if one else late))
    out["step_after_refusals"] = str(s.state_dict()["step"])
    s.load_state_dict(early)
    out["step_after_load"] = str(s.state_dict()["step"])
    step()  # the ranks pair: the warm-up step again, then compressed
    step()
    s.remove()
    return out


def restore_elsewhere(states: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4))
    s = BucketScheduler(m, compression=OneBit())
    for name, fn in (
        ("sched", lambda: s.load_state_dict(states["sched"])),
        ("onebit", lambda: _load_and_reduce(states["onebit"])),
    ):
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    other = nn.Sequential(nn.Linear(4, 5))
    s2 = BucketScheduler(other)
    try:
        s2.load_state_dict({**states["sched"], "world_size": comm.get_world_size()})
        out["shapes"] = "no error"
    except ValueError as e:
        out["shapes"] = str(e)
    s.remove()
    s2.remove()
    return out


def low_precision_grads(reduce_dtype: str | None) -> list[float]:
    r, w = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(0)
    m = nn.Linear(4, 2).to(torch.bfloat16)
    s = BucketScheduler(m, reduce_dtype=getattr(torch, reduce_dtype) if reduce_dtype else None)
    assert s.buckets[0].flat.dtype == (torch.float32 if reduce_dtype else torch.bfloat16)
    x = torch.full((3, 4), float(r + 1), dtype=torch.bfloat16)
    m(x).sum().backward()
    sched_grad = None
    s.synchronize()
    sched_grad = m.weight.grad
    assert sched_grad is not None and sched_grad.dtype == torch.bfloat16
    # expected: the average over ranks of 3 * (r + 1) per weight entry
    want = 3 * sum(q + 1 for q in range(w)) / w
    assert torch.allclose(sched_grad.float(), torch.full((2, 4), want)), sched_grad
    s.remove()
    return sched_grad.float().flatten().tolist()[:2]


def onebit_into_grads_equals_the_compressor() -> dict[str, Any]:
    """The scheduler pipelines 1-bit buckets and rebuilds them straight into the gradients
    (no copy back): the grads equal OneBit run by hand on the same buckets, bitwise, over 3
    steps with error feedback. The float32 gradients are read where backward left them (never
    copied into the bucket). A parameter unused on rank 0 (zeros sent, copied back) and a
    float64 one (its own bucket, no direct write) take the other paths. Returns how many
    tensors the last step wrote directly and read in place, and the order of the buckets'
    codec stages."""
    r, w = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(4)
    model = Net()
    tracer = overlap.Tracer()
    ours = BucketScheduler(
        model,
        compression=OneBit(),
        bucket_cap_mb=0.002,
        first_bucket_mb=0.001,
        rebuild_buckets=False,
        tracer=tracer,
    )
    hand, hand_group = OneBit(), comm.new_group(list(range(w)))  # its own group: no race
    gen = torch.Generator().manual_seed(20 + r)
    direct = 0
    worker_cpu: list[float] = []  # the worker thread's CPU seconds after each step
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
        model.zero_grad()
        tracer.clear()
        nn.functional.mse_loss(model(x, r == 1), y).backward()
        flats = {}
        for b in ours.buckets:
            flat = torch.zeros(b.numel, dtype=b.flat.dtype)
            for pos, p in enumerate(b.params):
                if p.grad is not None:
                    flat[b.offsets[pos] : b.offsets[pos] + p.numel()] = p.grad.reshape(-1)
            hand.reduce(b.index, flat, group=hand_group, shapes=b.shapes)
            flats[b.index] = flat
        ours.synchronize()
        direct = ours.statistics()["direct"]
        in_place = ours.statistics()["read_in_place"]
        worker_cpu.append(ours.statistics()["worker_cpu_s"])
        for b in ours.buckets:
            for pos, p in enumerate(b.params):
                if p.grad is not None:
                    want = flats[b.index][b.offsets[pos] : b.offsets[pos] + p.numel()]
                    assert torch.equal(p.grad.reshape(-1), want), (b.index, pos, p.shape)
    assert model.branch.weight.grad is not None  # used on rank 1: averaged in everywhere
    assert 0 < worker_cpu[0] < worker_cpu[1] < worker_cpu[2], worker_cpu  # it compressed
    stages = [
        s[0]
        for s in sorted(tracer.spans, key=lambda s: s[2])
        if s[0].startswith(("compress bucket", "server step bucket"))
    ]
    ours.remove()
    tracer.detach()  # the scheduler attached it: leave this pool process as it was
    return {
        "direct": direct,
        "in_place": in_place,
        "buckets": len(ours.buckets),
        "stages": stages,
    }


def _nan_at_00(g: torch.Tensor) -> torch.Tensor:
    """The gradient with one NaN, at [0, 0]: inside one chunk of a hierarchical bucket."""
    g = g.clone()
    g[0, 0] = float("nan")
    return g


def nonfinite_step_leaves_the_scheduler_usable(
    mode: str, hierarchical: bool = False, on_nonfinite: str = "raise"
) -> list[Any]:
    """A NaN in rank 1's gradient, in a middle bucket of a pipelined 1-bit step:
    synchronize() (or await wait()) raises NonFiniteError on every rank (or, with
    on_nonfinite="skip", every rank's OneBit says last_skipped), every other bucket settles,
    and the next steps train on with finite, rank-identical gradients. ``hierarchical``:
    through a Hierarchical reduction, all ranks on one host, where the NaN reaches only the
    chunk that one rank reduces (the host must agree on it)."""
    from overlap.errors import NonFiniteError
    from overlap.scheduler.hierarchy import Hierarchical

    r = comm.get_rank()
    torch.manual_seed(5)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
    onebit = OneBit(on_nonfinite=on_nonfinite)
    comp: Compressor = onebit
    if hierarchical:
        comp = Hierarchical(onebit, hosts=1, local=comm.get_world_size())
    sched = BucketScheduler(
        model, compression=comp, hierarchy="flat", bucket_cap_mb=0.005, first_bucket_mb=0.005
    )
    assert len(sched.buckets) >= 3
    gen = torch.Generator().manual_seed(r)
    out: list[Any] = []
    for step in range(4):
        hook = None
        if step == 1 and r == 1:
            hook = model[3][0].weight.register_hook(_nan_at_00)
        model.zero_grad()
        loss = model(torch.randn(8, 32, generator=gen)).pow(2).mean()
        try:
            if mode == "blocking":
                loss.backward()
                sched.synchronize()
            else:
                overlap.run(sched.backward(loss), loop=mode)  # type: ignore[arg-type]
            out.append("skipped" if onebit.last_skipped else "ok")
        except NonFiniteError as e:
            out.append("NonFiniteError" if hierarchical else f"NonFiniteError {e.ranks}")
        if hook is not None:
            hook.remove()
        if out[-1] == "ok":
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert torch.isfinite(grads).all()
            everyone = comm.all_gather(grads)
            assert all(torch.equal(everyone[0], g) for g in everyone)
        elif out[-1] == "skipped":  # NaN everywhere, on every rank, whoever held the NaN
            assert all(bool(p.grad.isnan().all()) for p in model.parameters())
    sched.remove()
    return out


def _scaled_compressor(name: str) -> Compressor:
    from overlap.compression import Auto, Int8
    from overlap.scheduler.hierarchy import Hierarchical

    make = {
        "none": lambda: NoCompression(),
        "onebit": lambda: OneBit(on_nonfinite="skip"),
        "powersgd": lambda: PowerSGD(rank=2, start_iter=1, on_nonfinite="skip"),
        "int8": lambda: Int8(block=64, on_nonfinite="skip"),
        # two steps per candidate, exact ones first: OneBit reduces steps 2 and 3, so the
        # overflow at step 3 meets a stateful candidate
        "auto": lambda: Auto(
            [NoCompression(), OneBit(on_nonfinite="skip"), PowerSGD(on_nonfinite="skip")],
            warmup_steps=0,
            trial_steps=1,
        ),
        "hierarchical": lambda: Hierarchical(
            OneBit(on_nonfinite="skip"), hosts=1, local=comm.get_world_size()
        ),
    }
    return make[name]()


def grad_scaler_as_ddp(name: str, mode: str = "blocking") -> dict[str, Any]:
    """torch.amp.GradScaler over a BucketScheduler whose compressor skips non-finite steps,
    against DDP with the same scaler: rank 1's loss overflows (Inf) at step 3 of 7. Under
    DDP every rank then skips that step and halves its scale. Returns each scale after
    each step (the scheduler's, DDP's), whether every rank ends with the same finite
    weights, and (NoCompression) the largest difference from DDP's weights."""
    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )
    ref = DDP(copy.deepcopy(model))
    sched = BucketScheduler(
        model,
        bucket_cap_mb=0.01,
        first_bucket_mb=0.005,
        hierarchy="flat",
        compression=_scaled_compressor(name),
    )
    scales: dict[str, list[float]] = {"sched": [], "ddp": []}
    active: list[str] = []  # the compressor that reduced each step
    for which, net in (("sched", model), ("ddp", ref)):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        gen = torch.Generator().manual_seed(10 + r)
        for step in range(7):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            opt.zero_grad()
            if which == "sched":  # the compressor this step runs (current() before it)
                active.append(sched.compression.current().name)
            loss = nn.functional.mse_loss(net(x), y)
            if step == 3 and r == 1:
                loss = loss * float("inf")
            if which == "ddp":
                scaler.scale(loss).backward()
            elif mode == "blocking":
                scaler.scale(loss).backward()
                sched.synchronize()
            else:
                overlap.run(sched.backward(scaler.scale(loss)), loop=mode)  # type: ignore[arg-type]
            scaler.step(opt)
            scaler.update()
            scales[which].append(scaler.get_scale())
    sched.remove()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        **scales,
        "at_overflow": active[3],
        "same": all(torch.equal(flat, g) for g in comm.all_gather(flat)),
        "finite": bool(torch.isfinite(flat).all()),
        "from_ddp": max(
            float((p - q).abs().max())
            for p, q in zip(model.parameters(), ref.module.parameters(), strict=True)
        ),
    }


def hierarchical_pipelined_equals_the_average(
    layout: str = "hosts", as_view: bool = False, no_room: int | None = None
) -> list[Any]:
    """A Hierarchical reduction with several buckets in flight at once: every bucket makes
    its own shared region as it starts, so the pipeline names regions for later buckets
    before earlier ones have stored theirs. ``layout`` "hosts": each rank its own "host" (a
    1-rank group inside, the world between); "local": one host of all the ranks (the mean
    inside it is the whole reduction: 2 ranks take the two-rank path, 3 the general one).
    The gradients go into the slots and come back from the result without a copy into or
    out of the bucket (``as_view``: .grad is the bucket, and the bucket is read instead).
    Returns [max error against the plain average over two steps, buckets, distinct region
    files the buckets mapped, gradients written straight into .grad, gradients read where
    backward left them]. ``no_room``: on that rank /dev/shm has no room (its "host" goes
    through sockets, the others through shared memory)."""
    from overlap.scheduler import hierarchy
    from overlap.scheduler.hierarchy import Hierarchical

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 4))
    plain = copy.deepcopy(model)
    w = comm.get_world_size()
    hosts, local = (w, 1) if layout == "hosts" else (1, w)
    comp = Hierarchical(NoCompression(), hosts=hosts, local=local)
    sched = BucketScheduler(
        model,
        compression=comp,
        hierarchy="flat",
        bucket_cap_mb=0.004,
        first_bucket_mb=0.004,
        gradient_as_bucket_view=as_view,
    )
    shm = hierarchy._SHM
    if comm.get_rank() == no_room:
        hierarchy._SHM = "/nonexistent-overlap-test"  # statvfs fails: no room
    err = 0.0
    try:
        for step in range(2):
            x = torch.randn(
                8, 32, generator=torch.Generator().manual_seed(10 * step + comm.get_rank())
            )
            model.zero_grad()
            plain.zero_grad()
            model(x).pow(2).mean().backward()
            sched.synchronize()
            plain(x).pow(2).mean().backward()
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert q.grad is not None and p.grad is not None
                comm.all_reduce(q.grad, op="avg")
                err = max(err, float((p.grad - q.grad).abs().max()))
        regions = {
            v[0].untyped_storage().data_ptr()
            for k, v in comp.state.items()
            if isinstance(k, tuple) and k[0] == "shm"
        }
        st = sched.statistics()
        return [err, len(sched.buckets), len(regions), st["direct"], st["read_in_place"]]
    finally:
        sched.remove()
        hierarchy._SHM = shm


def _same_gradients(
    models: list[nn.Module],
    comps: list[Compressor],
    batches: list[torch.Tensor],
    loss: Any,
    update: bool,
) -> tuple[int, int]:
    """Each model under a scheduler of its own compressor, on the same batches: the steps on
    which every model's gradients equal the first's bitwise, and the first scheduler's
    bucket count. ``update``: every model steps by -0.1 x its gradient after each batch."""
    scheds = [
        BucketScheduler(
            m, compression=c, hierarchy="flat", bucket_cap_mb=0.004, first_bucket_mb=0.004
        )
        for m, c in zip(models, comps, strict=True)
    ]
    equal = 0
    try:
        for x in batches:
            for m, sched in zip(models, scheds, strict=True):
                m.zero_grad()
                loss(m, x).backward()
                sched.synchronize()
            equal += all(
                p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
                for other in models[1:]
                for p, q in zip(models[0].parameters(), other.parameters(), strict=True)
            )
            if update:
                with torch.no_grad():
                    for m in models:
                        for p in m.parameters():
                            assert p.grad is not None
                            p.sub_(0.1 * p.grad)
        return equal, len(scheds[0].buckets)
    finally:
        for sched in scheds:
            sched.remove()


def hierarchical_onebit_publishes_what_it_rebuilt(layout: str) -> list[Any]:
    """Hierarchical OneBit with each chunk published in its 1-bit form (every rank of a host
    rebuilds every chunk from the signs into its own gradients) against the same reduction
    with the floats published (the owner rebuilds, the others copy): bitwise the same
    gradients, step after step (four compressed steps). With ``layout`` "hosts" (one rank a
    host, so a chunk is the whole bucket) also against a flat OneBit: bitwise the same too,
    as each tensor gets its own scales in both. ``layout`` as in
    :func:`hierarchical_pipelined_equals_the_average`. Returns [steps whose gradients were
    all equal, chunks published as signs, buckets, the most scales a chunk had]."""
    from overlap.scheduler.hierarchy import Hierarchical

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 63), nn.Linear(63, 5))
    w = comm.get_world_size()
    hosts, local = (w, 1) if layout == "hosts" else (1, w)
    comps: list[Compressor] = [Hierarchical(OneBit(), hosts=hosts, local=local) for _ in range(2)]
    if layout == "hosts":
        comps.append(OneBit())
    models = [model] + [copy.deepcopy(model) for _ in comps[1:]]
    published = [0]
    hier, floats = comps[0], comps[1]
    assert isinstance(hier, Hierarchical) and isinstance(floats, Hierarchical)
    real = hier._publish

    def counting(*args: Any) -> bool:
        took = real(*args)
        published[0] += took
        return took

    hier._publish = counting  # type: ignore[method-assign]
    floats._publish = lambda *args: False  # type: ignore[method-assign]
    batches = [
        torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + comm.get_rank()))
        for step in range(4)
    ]
    equal, buckets = _same_gradients(
        models, comps, batches, lambda m, x: m(x).pow(2).mean(), update=True
    )
    inner = hier.inner
    assert isinstance(inner, OneBit)
    most = max(st["lay"].nseg for st in inner.state.values())
    return [equal, published[0], buckets, most]


class _SideBySide(nn.Module):
    """Linear layers side by side on one input: each weight's gradient is c x^T and each
    bias's c, whatever the weights, so dyadic inputs give exact gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, k) for k in (64, 63, 5, 40)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        terms = [lin(x).sum() * (k + 1) * 0.5 for k, lin in enumerate(self.layers)]
        return torch.stack(terms).sum()


def hierarchical_fused_mean_is_the_unfused_one() -> list[Any]:
    """Hierarchical OneBit on one host of two ranks averages each rank's chunk inside the
    encode pass ((x + y) * 0.5, its inputs read where they are) against the same reduction
    with the mean written out first (``lerp``): bitwise the same gradients over three steps,
    the first a warm-up (the fused inputs then averaged into the chunk for a plain
    allreduce).
    The gradients are exact (dyadic inputs, :class:`_SideBySide`), so the two means agree
    exactly and any difference is a wrong input, slot or offset. Returns [steps equal,
    buckets]."""
    from overlap.scheduler.hierarchy import Hierarchical

    torch.manual_seed(0)
    models = [_SideBySide(), _SideBySide()]
    models[1].load_state_dict(models[0].state_dict())
    comps = [
        Hierarchical(OneBit(warmup_steps=1), hosts=1, local=comm.get_world_size()) for _ in range(2)
    ]
    comps[1]._fuse = False
    batches = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + comm.get_rank())
        batches.append(torch.randint(-4, 5, (8, 32), generator=g).float() * 0.25)
    equal, buckets = _same_gradients(
        list(models), list(comps), batches, lambda m, x: m(x), update=False
    )
    return [equal, buckets]


class FailsOnOneRank(Compressor):
    """Two summing all_reduces a bucket (then the average); on ``rank``, at ``step``, bucket
    ``key`` raises a RuntimeError of its own, ``where`` "start" (before its first
    collective: during backward), "between" (after its first: in the step's flush) or
    "after" (after its last: every collective issued)."""

    name = "fails-on-one-rank"
    summable = True

    def __init__(self, rank: int, step: int, key: int, where: str) -> None:
        self.fail = (rank, step, key)
        self.where = where
        self.step = -1

    def begin_step(self) -> None:
        self.step += 1

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        bucket = key[0] if isinstance(key, tuple) else key  # (bucket, "chunk") if hierarchical
        failing = (comm.get_rank(), self.step, bucket) == self.fail
        if failing and self.where == "start":
            raise RuntimeError(f"a local failure in bucket {key}")
        yield [comm.all_reduce(flat, op="sum", group=group, async_op=True)]
        if failing and self.where == "between":
            raise RuntimeError(f"a local failure in bucket {key}")
        yield [comm.all_reduce(flat, op="sum", group=group, async_op=True)]
        if failing and self.where == "after":
            raise RuntimeError(f"a local failure in bucket {key}")
        flat.div_(comm.get_world_size(group) ** 2)
        return flat


class BrokenEverywhere(Compressor):
    """A compressor with the bug of a user's own on every rank: its first phase is not a list
    of handles (one handle, ``yield h``; a bare ``yield``; a list of something else), which
    the scheduler names as a TypeError when the bucket is launched."""

    name = "broken-everywhere"
    summable = True

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def reduce_steps(self, key: Any, flat: torch.Tensor, **kw: Any) -> Any:  # type: ignore[override]
        if self.kind == "junk":
            yield [42]
        h = comm.all_reduce(flat, op="avg", group=kw.get("group"), async_op=True)
        yield h if self.kind == "handle" else None
        h.wait()
        return flat


def every_rank_fails_alike(trials: int) -> list[tuple[str, float]]:
    """``trials`` new schedulers in a row, each failing alike on every rank at its one
    bucket's first phase: per trial, what synchronize() raised here and how long it took.
    Before, a rank whose worker had failed before the step's vote skipped the vote, while a
    peer whose worker had not failed yet waited in it until the job's timeout (30 minutes
    by default on gloo, for ever on MPI): the first trial of most runs."""
    out: list[tuple[str, float]] = []
    m = nn.Linear(4, 2)
    for i in range(trials):
        sched = BucketScheduler(m, compression=BrokenEverywhere(("junk", "handle", "none")[i % 3]))
        t = time.monotonic()
        try:
            m(torch.ones(2, 4)).sum().backward()
            sched.synchronize()
            out.append(("no error", time.monotonic() - t))
        except TypeError as e:
            assert str(e).startswith("BrokenEverywhere.reduce_steps yielded "), e
            out.append(("TypeError", time.monotonic() - t))
        except overlap.CommError as e:  # the peer's bit came first: this rank stops too
            assert "stopped issuing this BucketScheduler's collectives" in str(e), e
            out.append(("CommError", time.monotonic() - t))
        finally:
            sched.remove()
            m.zero_grad()
    return out


def one_rank_failure_stops_every_rank(
    where: str, timeout: float, hierarchical: bool = False
) -> list[Any]:
    """Rank 0's compressor raises inside a middle bucket of step 1 (see FailsOnOneRank).
    Returns per step what synchronize() did and how long it took. Before, rank 0 went on
    with the other buckets, whose collectives paired with different buckets' on rank 1:
    rank 1's step 1 returned gradients summed across the wrong buckets as a normal result,
    and rank 0's step 2 did the same. ``hierarchical``: through a Hierarchical reduction of
    one host of both ranks (shared memory; the error in rank 0's chunk). ``where="after"``:
    one bucket, failing in step 0 after its last collective."""
    from overlap.errors import OutOfStepError

    r = comm.get_rank()
    torch.manual_seed(5)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(6)])
    after = where == "after"  # one bucket, step 0: the peer ends its step, then the
    # step's rebuild broadcast waits for rank 0, which no longer sends anything
    comp: Compressor = FailsOnOneRank(
        rank=0, step=0 if after else 1, key={"start": 2, "between": 1}.get(where, 0), where=where
    )
    if hierarchical:
        from overlap.scheduler.hierarchy import Hierarchical

        comp = Hierarchical(comp, hosts=1, local=comm.get_world_size())
    cap = 1.0 if after else 0.004
    sched = BucketScheduler(
        model, compression=comp, hierarchy="flat", bucket_cap_mb=cap, first_bucket_mb=cap
    )
    assert len(sched.buckets) == (1 if after else 6)
    gen = torch.Generator().manual_seed(r)
    out: list[Any] = []
    for _ in range(4):
        model.zero_grad()
        t = time.monotonic()
        try:
            model(torch.randn(8, 32, generator=gen)).pow(2).mean().backward()
            sched.synchronize()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            everyone = comm.all_gather(grads)
            out.append("ok" if all(torch.equal(everyone[0], g) for g in everyone) else "differ")
        except OutOfStepError:
            out.append("OutOfStepError")
        except overlap.CommError:
            out.append("CommError")
        except RuntimeError as e:
            assert "a local failure in bucket" in str(e), e
            out.append("RuntimeError")
        assert time.monotonic() - t < timeout + 5, (out, time.monotonic() - t)
    sched.remove()
    # The job's own group is untouched: the ranks still talk. Rank 1 gets here at once or
    # a timeout after rank 0 (learning of the stop from the step's vote, or from a bucket
    # collective rank 0 never issued): meet first, so that the check does not time out.
    realign()
    x = torch.ones(1)
    comm.all_reduce(x)
    assert x.item() == comm.get_world_size()
    return out


def cancelled_wait_leaves_the_step_running(loop: str) -> list[Any]:
    """Rank 0 cancels its ``await sched.wait()`` (asyncio.wait_for times out) in step 1 and
    awaits it again; in step 2 it cancels and lets the step end in the background while it
    sleeps, then goes on with step 3, where it does the same and takes the ended step up
    with synchronize(). Every step must end with rank-identical gradients.
    Before, the cancelled rank dropped the end of its step halfway (the compressor's end of
    step included): with OneBit the next steps failed with CommError on both ranks."""
    import asyncio

    r = comm.get_rank()
    torch.manual_seed(5)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    sched = BucketScheduler(
        model, compression=OneBit(), hierarchy="flat", bucket_cap_mb=0.02, first_bucket_mb=0.02
    )
    gen = torch.Generator().manual_seed(r)
    out: list[Any] = []

    async def main() -> None:
        for step in range(5):
            model.zero_grad()
            model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
            if r == 0 and step in (1, 2, 3):
                try:
                    await asyncio.wait_for(sched.wait(), timeout=1e-4)
                    out.append("done at once")
                except TimeoutError:
                    out.append("timeout")
                if step == 1:
                    await sched.wait()  # take the step up again
                else:
                    if sched._finishing is not None and not sched._finishing[0].done():
                        try:
                            sched.remove()  # refused: the step still uses its groups
                            out.append("removed")
                        except RuntimeError as e:
                            assert "await sched.wait()` first" in str(e), e
                            out.append("remove refused")
                    while sched._finishing is not None and not sched._finishing[0].done():
                        await asyncio.sleep(0.01)  # ends in the background
                    if step == 3:
                        sched.synchronize()  # takes the ended step up (step 2: never taken)
            else:
                await sched.wait()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            everyone = comm.all_gather(grads)
            out.append("ok" if all(torch.equal(everyone[0], g) for g in everyone) else "differ")

    overlap.run(main(), loop=loop)  # type: ignore[arg-type]
    sched.remove()
    return out


class _InBackward(torch.autograd.Function):
    """Identity forward; its backward first calls ``action`` (raise: an OOM, a bug on one
    rank; sleep: a long backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, action: Any) -> torch.Tensor:
        ctx.action = action
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.action()
        return g, None


def _boom() -> None:
    raise RuntimeError("boom in backward")


def _own_average(ref: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The ranks' average of ``ref``'s gradients of ``loss`` (what a step must give)."""
    ref.zero_grad()
    loss.backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    return comm.all_reduce(want, op="avg")  # type: ignore[no-any-return]


def _seeded_blocks(n: int) -> tuple[nn.ModuleList, nn.ModuleList]:
    """``n`` Linear(32, 32) + Tanh blocks, alike on every rank, and a copy to reduce by hand."""
    torch.manual_seed(5)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(n))
    return blocks, copy.deepcopy(blocks)


def failed_backward_drops_the_step(mode: str, compression: str, skip: bool = False) -> list[Any]:
    """Rank 0's backward raises halfway through step 1, after the later layers' gradients
    reached their buckets (some of them sent). ``mode`` "blocking": rank 0 catches it and
    calls synchronize(), or with ``skip`` first runs step 2's backward (refused, naming the
    failed one) and then synchronize(); "uvloop": ``await sched.backward(loss)``, which ends
    the step itself. Every rank must raise for step 1 (IncompleteBackwardError naming rank
    0; in uvloop rank 0 its own error) and train on: each other step's gradients are the
    average of the ranks' own (exactly, uncompressed; rank-identical with OneBit). The
    middle blocks run under a reentrant checkpoint, a nested backward inside each one: it
    must not count as a failed backward. Before, step 1 returned gradients that mixed rank
    0's partial ones in (zeros for what it never reached) on both ranks, as a normal
    result; with ``skip`` the next backward said "a second backward"."""
    from torch.utils.checkpoint import checkpoint

    r = comm.get_rank()
    blocks, ref = _seeded_blocks(6)

    def forward(m: nn.ModuleList, x: torch.Tensor, fail: bool) -> torch.Tensor:
        h = m[1](m[0](x))
        if fail:
            h = _InBackward.apply(h, _boom)
        h = checkpoint(lambda t: m[3](m[2](t)), h, use_reentrant=True)
        return m[5](m[4](h)).pow(2).mean()  # type: ignore[no-any-return]

    comp = OneBit() if compression == "onebit" else None
    sched = BucketScheduler(
        blocks, compression=comp, hierarchy="flat", bucket_cap_mb=0.005, first_bucket_mb=0.005
    )
    assert len(sched.buckets) >= 4
    gen = torch.Generator().manual_seed(r)
    out: list[Any] = []
    warned: list[str] = []  # the scheduler's warnings: none here (no backward is cancelled)
    catch = logging.Handler()
    catch.emit = lambda rec: warned.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("overlap.scheduler.scheduler").addHandler(catch)

    def end(loss: torch.Tensor) -> None:
        if mode == "blocking":
            try:
                loss.backward()
            except RuntimeError as e:
                out.append(str(e))
            sched.synchronize()
        else:
            overlap.run(sched.backward(loss), loop=mode)  # type: ignore[arg-type]

    for step in range(4):
        x = torch.randn(8, 32, generator=gen)
        blocks.zero_grad()
        fail = step == 1 and r == 0
        try:
            if fail and skip:
                try:
                    forward(blocks, x, fail).backward()
                except RuntimeError as e:
                    out.append(str(e))
                blocks.zero_grad()
                try:
                    forward(blocks, x, False).backward()  # step 1 was never ended
                except RuntimeError as e:
                    out.append("refused" if "its step was not ended" in str(e) else str(e))
                sched.synchronize()
            else:
                end(forward(blocks, x, fail))
        except IncompleteBackwardError as e:
            out.append(f"IncompleteBackwardError {e.ranks}")
            continue
        except RuntimeError as e:
            out.append(str(e))
            continue
        grads = torch.cat([p.grad.reshape(-1) for p in blocks.parameters()])
        everyone = comm.all_gather(grads)
        same = all(torch.equal(everyone[0], g) for g in everyone)
        if compression == "onebit":
            out.append("ok" if same and bool(torch.isfinite(grads).all()) else "differ")
            continue
        want = _own_average(ref, forward(ref, x, False))
        out.append("ok" if same and torch.allclose(grads, want, atol=1e-6) else "wrong")
    logging.getLogger("overlap.scheduler.scheduler").removeHandler(catch)
    assert not warned, warned
    sched.remove()
    return out


def cancelled_backward_finishes_the_step(loop: str) -> list[Any]:
    """Rank 0's ``await sched.backward(loss)`` is cancelled (asyncio.wait_for times out)
    while its backward runs in the executor, halfway through the model; it then awaits
    ``sched.wait()``. The backward goes on in its thread, and the wait must end the step
    only after it: every step's gradients the exact average of the ranks' own. Before,
    the wait voted at once, with the gradients not yet produced counted as unused (zeros),
    and the backward's later gradients were refused inside its thread."""
    import asyncio

    r = comm.get_rank()
    blocks, ref = _seeded_blocks(4)

    def forward(m: nn.ModuleList, x: torch.Tensor, slow: bool) -> torch.Tensor:
        h = m[1](m[0](x))
        if slow:
            h = _InBackward.apply(h, lambda: time.sleep(0.3))
        return m[3](m[2](h)).pow(2).mean()  # type: ignore[no-any-return]

    sched = BucketScheduler(blocks, hierarchy="flat", bucket_cap_mb=0.005, first_bucket_mb=0.005)
    gen = torch.Generator().manual_seed(r)
    out: list[Any] = []

    async def main() -> None:
        for step in range(3):
            x = torch.randn(8, 32, generator=gen)
            blocks.zero_grad()
            loss = forward(blocks, x, r == 0 and step == 1)
            if r == 0 and step == 1:
                try:
                    await asyncio.wait_for(sched.backward(loss), timeout=0.05)
                    out.append("done at once")
                except TimeoutError:
                    out.append("timeout")
                try:
                    sched.synchronize()
                except RuntimeError as e:
                    out.append("refused" if "still running in its thread" in str(e) else str(e))
                await sched.wait()
            else:
                await sched.backward(loss)
            grads = torch.cat([p.grad.reshape(-1) for p in blocks.parameters()])
            want = _own_average(ref, forward(ref, x, False))
            out.append("ok" if torch.allclose(grads, want, atol=1e-6) else "wrong")

    overlap.run(main(), loop=loop)  # type: ignore[arg-type]
    sched.remove()
    return out


def cast_after_build(view: bool) -> dict[str, Any]:
    """model.double() after the scheduler was built: before, every gradient was cast into
    the float32 bucket and back without a word (or, with gradient_as_bucket_view, torch
    refused the view with a message about grad_dtype). Now the first backward raises,
    naming the parameter and the fix; removing the scheduler and building a new one works."""
    r = comm.get_rank()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    s = BucketScheduler(m, gradient_as_bucket_view=view)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    m(x).sum().backward()
    s.synchronize()
    m.double()
    m.zero_grad()
    out: dict[str, Any] = {}
    try:
        m(x.double()).sum().backward()
        s.synchronize()
        out["error"] = "no error"
    except RuntimeError as e:
        out["error"] = str(e)
    s.remove()
    s = BucketScheduler(m, gradient_as_bucket_view=view)
    m.zero_grad()
    m(x.double()).sum().backward()
    s.synchronize()
    got = [p.grad.clone() for p in m.parameters()]
    s.remove()
    m.zero_grad()
    m(x.double()).sum().backward()
    ok = True
    for p, g in zip(m.parameters(), got, strict=True):
        ref = p.grad.clone()
        comm.all_reduce(ref, op="avg")
        ok = ok and g.dtype == torch.float64 and torch.allclose(ref, g)
    out["rebuilt"] = ok
    return out


LATE_S = 2.0  # how late the peer is; the Ctrl-C comes at 0.3 s, well before


def _interrupt_in(seconds: float) -> Any:
    """Ctrl-C to this process in ``seconds`` (the handler raises KeyboardInterrupt in the
    main thread, at its next Python instruction); returns the timer, to cancel."""
    import os
    import signal
    import threading

    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def interrupted_wait() -> dict[str, Any]:
    """Ctrl-C on rank 0 in ``h.wait()`` of an all_reduce and of a receive (rank 1 is 2 s
    late): the KeyboardInterrupt reaches the caller, and a second ``h.wait()`` returns the
    op's result: the signal interrupts the wait, not the op (on gloo it lands once the
    backend's wait has returned for a receive, and the handle completes then; for a gloo
    collective while the op runs, since the fiftieth session; on MPI with a job timeout it
    lands in the polling, and the op goes on). Before, gloo's wait raised a CommError with
    an empty message and the interrupt was lost. On gloo, also a blocking all_reduce: the
    interrupt lands while it runs (``blocking_s``, the seconds to it), and the op goes on
    (its result after the next barrier). Before the fiftieth session a gloo collective's
    interrupt landed only when the late peer came (``all_reduce_s`` about LATE_S)."""
    r = comm.get_rank()
    out: dict[str, Any] = {}
    t = torch.ones(2)
    buf = torch.zeros(3)
    gloo = comm.get_backend() == "gloo"
    if r == 0:
        for name, h in (
            ("all_reduce", comm.all_reduce(t, async_op=True)),
            ("irecv", comm.irecv(buf, src=1, tag=4)),
        ):
            timer = _interrupt_in(0.3)
            start = time.monotonic()
            try:
                h.wait()
                out[name] = "no interrupt"
            except KeyboardInterrupt:
                out[name] = "KeyboardInterrupt"
            out[f"{name}_s"] = time.monotonic() - start
            timer.cancel()
            value = h.wait().tolist()  # again: the op went on (or had completed)
            out[f"{name}_after"] = (str(h.exception()), value)
            comm.barrier()
        if gloo:
            blocking = torch.ones(2)
            timer = _interrupt_in(0.3)
            start = time.monotonic()
            try:
                comm.all_reduce(blocking)
                out["blocking"] = "no interrupt"
            except KeyboardInterrupt:
                out["blocking"] = "KeyboardInterrupt"
            out["blocking_s"] = time.monotonic() - start
            timer.cancel()
            comm.barrier()  # gloo's barrier waits for the group's earlier ops
            out["blocking_after"] = blocking.tolist()
    else:
        time.sleep(LATE_S)
        comm.all_reduce(t)
        comm.barrier()
        if r == 1:
            time.sleep(LATE_S)
            comm.send(torch.full((3,), 7.0), dst=0, tag=4)
        comm.barrier()
        if gloo:
            time.sleep(LATE_S)
            comm.all_reduce(torch.ones(2))
            comm.barrier()
    out["world"] = comm.get_world_size()
    return out


def interrupted_step(timeout: float) -> dict[str, Any]:
    """Ctrl-C on rank 0 while it waits (rank 1 is 2 s late): in ``h.wait()`` of a plain
    all_reduce, then in ``synchronize()``. Before, the wait raised a CommError with an
    empty message and the Ctrl-C was lost; in synchronize() the step was dropped and the
    next synchronize() voted again, pairing with another collective on rank 1 (a timeout
    on both). Now the KeyboardInterrupt reaches the caller, the op's handle says it was
    interrupted, and the scheduler stops (OutOfStepError at once on rank 0, CommError
    within the timeout on rank 1, as for any rank that stops)."""
    from overlap.errors import OutOfStepError

    r = comm.get_rank()
    out: dict[str, Any] = {}

    def late() -> None:
        if r == 1:
            time.sleep(LATE_S)

    out.update(interrupted_wait())
    # the scheduler
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    s = BucketScheduler(m, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(r))
    steps: list[str] = []
    for step in range(3):
        m.zero_grad()
        start = time.monotonic()
        try:
            m(x).sum().backward()
            if step == 1:
                late()
                if r == 0:
                    _interrupt_in(0.3)
            s.synchronize()
            steps.append("ok")
        except KeyboardInterrupt:
            steps.append("KeyboardInterrupt")
        except OutOfStepError:
            steps.append("OutOfStepError")
        except overlap.CommError:
            steps.append("CommError")
        assert time.monotonic() - start < timeout + 5, (steps, time.monotonic() - start)
    out["steps"] = steps
    s.remove()
    if r == 0:
        time.sleep(timeout)  # rank 1 waited that long for rank 0 in step 2
    y = torch.ones(1)
    comm.all_reduce(y)  # the job's own group still works
    out["after"] = y.item()
    return out


def _seeded_apart() -> nn.Module:
    """Each rank seeds with its own rank, as a DDP user (whose DDP broadcasts) writes it: a
    trainable layer, BatchNorm's buffers, a frozen layer initialised at random, a weight
    that is not contiguous."""
    r = comm.get_rank()
    torch.manual_seed(r)
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))
    m[2].requires_grad_(False)
    m[1].running_mean.add_(float(r))
    m[3].weight.data = m[3].weight.data.t().contiguous().t()
    return m


def _equal_to_rank_0(m: nn.Module, buffers: bool) -> list[tuple[str, bool]]:
    named = [*m.named_parameters(), *(m.named_buffers() if buffers else [])]
    out = []
    for name, t in named:
        both = comm.all_gather(t.detach().contiguous())
        out.append((name, all(torch.equal(both[0], x) for x in both)))
    return out


def start_from_rank_0(kind: str, init_sync: bool = True) -> list[Any]:
    """Build a BucketScheduler (or a DiLoCo) over :func:`_seeded_apart`: which parameters
    and buffers equal rank 0's then, which parameters still do after a step (the buffers
    then hold each rank's own batch statistics, as in DDP between broadcasts), and whether
    the odd layout was kept."""
    from overlap import DiLoCo

    m = _seeded_apart()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if kind == "scheduler":
        reducer: Any = BucketScheduler(m, init_sync=init_sync)
    else:
        reducer = DiLoCo(m, opt, sync_every=4)
    built = _equal_to_rank_0(m, buffers=True)
    gen = torch.Generator().manual_seed(comm.get_rank())
    nn.functional.mse_loss(m(torch.randn(6, 4, generator=gen)), torch.zeros(6, 2)).backward()
    if kind == "scheduler":
        reducer.synchronize()
    opt.step()
    if kind != "scheduler":
        reducer.step()  # not a sync step: each rank's inner step apart
    stepped = _equal_to_rank_0(m, buffers=False)
    reducer.remove()
    return [built, stepped, m[3].weight.is_contiguous()]


def join_equals_ddp_join(mode: str, counts: list[int], compression: str = "none") -> list[Any]:
    """Ranks with ``counts[rank]`` batches each, in ``sched.join()``, against torch DDP's own
    ``Join`` on a copy (``compression="none"``): the final weights, the steps this rank
    shadowed, whether every rank ends with the same weights, and one more step after
    (the scheduler goes on)."""
    from torch.distributed.algorithms.join import Join as TorchJoin

    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(10 + r)
    data = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))
        for _ in range(counts[r])
    ]
    ddp = DDP(ref)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    with TorchJoin([ddp]):
        for x, y in data:
            opt_b.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt_b.step()
    comp: Compressor = OneBit() if compression == "onebit" else NoCompression()
    sched = BucketScheduler(model, bucket_cap_mb=0.002, first_bucket_mb=0.001, compression=comp)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "blocking":
        with sched.join() as j:
            for x, y in data:
                opt_a.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                sched.synchronize()
                opt_a.step()
    else:

        async def main() -> Any:
            async with sched.join() as j:
                for x, y in data:
                    opt_a.zero_grad()
                    await sched.backward(nn.functional.mse_loss(model(x), y))
                    opt_a.step()
            return j

        j = overlap.run(main(), loop=mode)  # type: ignore[arg-type]
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    diff = max((p - q).abs().max().item() for p, q in pairs)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    agreed = all(torch.equal(flat, x) for x in comm.all_gather(flat))
    opt_a.zero_grad()
    nn.functional.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    sched.synchronize()  # a step together after join(): nothing left out of step
    sched.remove()
    return [diff, j.steps_shadowed, agreed]


def create_graph_backward() -> dict[str, Any]:
    """``loss.backward(create_graph=True)``: refused in the hook with the fix, the scheduler
    ready afterwards; a gradient penalty (autograd.grad with create_graph, then a plain
    backward) is averaged exactly."""
    r, w = comm.get_rank(), comm.get_world_size()
    out: dict[str, Any] = {}
    catch = catcher(out)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    sched = BucketScheduler(m)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r)).requires_grad_(True)
    catch("create_graph", lambda: m(x).sum().backward(create_graph=True))
    catch("after", sched.synchronize)
    m.zero_grad(set_to_none=True)

    def penalised() -> torch.Tensor:
        y = m(x).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        return y + gx.pow(2).sum()

    want = list(torch.autograd.grad(penalised(), list(m.parameters())))
    for g in want:
        comm.all_reduce(g)
        g /= w
    penalised().backward()
    sched.synchronize()
    out["penalty_exact"] = all(
        torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(m.parameters(), want, strict=True)
    )
    sched.remove()
    return out


def schedulers_per_subgroup(compression: str = "none") -> dict[str, Any]:
    """Every rank builds a BucketScheduler over its own group of two consecutive ranks (the
    last alone when the world is odd), as over the data-parallel groups of a topology: each
    averages inside its group only, for two steps (the buckets rebuilt in between). Then the
    ranks disagree on the groups (the first two pass their pair, the rest the world): every
    rank refuses. Then every rank passes the first pair's group, which ranks 2 and up are not
    members of: every rank refuses (before: those ranks raised alone, and the pair waited in
    the groups' all-gather until the backend's timeout). Returns what was refused."""
    r, w = comm.get_rank(), comm.get_world_size()
    lists = [list(range(i, min(i + 2, w))) for i in range(0, w, 2)]
    mine: Any = None
    first: Any = None
    for ranks in lists:  # every rank makes every group, in one order
        g = comm.new_group(ranks)
        first = g if first is None else first
        if r in ranks:
            mine = g
    mates = lists[r // 2]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    comp = {"none": NoCompression(), "onebit": OneBit(warmup_steps=0)}[compression]
    sched = BucketScheduler(m, group=mine, compression=comp, bucket_cap_mb=0.00002)
    x = torch.full((1, 3), float(r + 1))
    for _ in range(2):
        m.zero_grad()
        m(x).sum().backward()
        sched.synchronize()
    # the last layer's weight gradient is the first layer's output: the mates' mean of it
    with torch.no_grad():
        outs = [m[0](torch.full((1, 3), float(k + 1))) for k in mates]
    want = (sum(outs) / len(outs)).expand(2, 4)
    assert m[1].weight.grad is not None
    if compression == "none":
        assert torch.allclose(m[1].weight.grad, want, atol=1e-6), (m[1].weight.grad, want)
    grads = torch.cat([p.grad.reshape(-1) for p in m.parameters()])  # type: ignore[union-attr]
    got = [torch.zeros_like(grads) for _ in range(w)]
    comm.all_gather(got, grads)
    assert all(torch.equal(got[k], grads) for k in mates), "a group's ranks differ"
    sched.remove()
    out: dict[str, Any] = {}
    catch = catcher(out)
    catch("disagree", lambda: BucketScheduler(m, group=mine if r < 2 else None))
    catch("outside", lambda: BucketScheduler(m, group=first))
    # nothing was made or claimed: the pair's scheduler can be built after the refusal
    BucketScheduler(m, group=mine).remove()
    return out


def _averaged_grads(ref: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``ref``'s gradients of ``ref(x).sum()``, averaged over the ranks: what one plain step
    of a scheduler over a model like ``ref`` must leave in ``.grad``."""
    ref.zero_grad()
    ref(x).sum().backward()
    return [comm.all_reduce(q.grad.clone(), op="avg") for q in ref.parameters()]


def second_backward_drops_the_step(as_view: bool) -> list[Any]:
    """Two backwards before synchronize(): the second one's first gradient raises, and
    autograd has already added it to .grad, which with ``gradient_as_bucket_view`` is the
    bucket itself. Before the forty-seventh session synchronize() then returned, each rank
    with another .grad (2.76 and 6.33 off the first backward's average, no error); now
    it raises IncompleteBackwardError on every rank. Returns [what the second backward
    raised, what synchronize() raised, whether the next step's gradients are the average
    (against the same model's gradients all-reduced)]."""
    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    sched = BucketScheduler(
        model, bucket_cap_mb=1e-4, first_bucket_mb=1e-4, gradient_as_bucket_view=as_view
    )
    out: list[Any] = []
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(r))
    try:
        y = model(x)
        y.sum().backward(retain_graph=True)
        try:
            y.pow(2).sum().backward()
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e).split(";")[0])
        try:
            sched.synchronize()
            out.append("no error")
        except IncompleteBackwardError:
            out.append("IncompleteBackwardError")
        model.zero_grad()
        model(x).sum().backward()
        sched.synchronize()
        want = _averaged_grads(ref, x)
        out.append(
            all(torch.allclose(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))
        )
    finally:
        sched.remove()
    return out


def grad_changed_before_synchronize(what: str, as_view: bool, compression: str) -> list[Any]:
    """Backward, then ``what`` to the gradients, then synchronize(): "clip"
    (``clip_grad_norm_``, in place), "zero" (``zero_grad(set_to_none=False)``), "none"
    (``zero_grad()``), "replace" (a new ``.grad``) or "step" (``optimizer.step()``, which
    then stepped each rank on its own gradient: the weights drifted apart, with no error;
    the case then broadcasts rank 0's weights, as the message says). Measured before the
    forty-seventh
    session: the clipping lost without a word where the gradient had been copied into its
    bucket, a 1 MiB gradient (reduced where it is) half clipped, a .grad left None while
    the others got the average, and with ``gradient_as_bucket_view`` or a replaced
    ``.grad`` the two ranks ending with different gradients. Now synchronize() raises on
    every rank and the step is dropped. Returns [the start of what synchronize() raised,
    whether the next step (done right) gives the average (1-bit: the same on every
    rank)]."""
    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 2))  # a 1 MiB weight
    comp = {"none": None, "fp16": FP16(), "onebit": OneBit()}[compression]
    sched = BucketScheduler(model, gradient_as_bucket_view=as_view, compression=comp)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(r))
    out: list[Any] = []
    try:
        model(x).sum().backward()
        if what == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        elif what in ("zero", "none"):
            model.zero_grad(set_to_none=what == "none")
        elif what == "step":
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            broadcast_parameters(model.state_dict())  # what the message says to do
        else:
            for p in model.parameters():
                assert p.grad is not None
                p.grad = p.grad * 2
        try:
            sched.synchronize()
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e).split(":")[0])
        model.zero_grad()
        ref = copy.deepcopy(model)  # the weights as they are now ("step" moved them)
        model(x).sum().backward()
        sched.synchronize()
        want = _averaged_grads(ref, x)
        if compression == "onebit":  # 1-bit is not the average: the ranks must agree
            want = [comm.all_gather(p.grad.clone())[0] for p in model.parameters()]
        tol = {"none": 1e-5, "fp16": 1e-2, "onebit": 0.0}[compression]
        out.append(
            all(
                bool(((p.grad - w).abs().max() <= tol * w.abs().max()).item())
                for p, w in zip(model.parameters(), want, strict=True)
            )
        )
    finally:
        sched.remove()
    return out


def unawaited_backward() -> list[Any]:
    """``sched.backward(loss)`` written without ``await``: before the forty-eighth session it
    left every ``.grad`` None with no error (the model never trained). Now the next
    ``backward()`` names the call that never ran. Returns [what that call raised, whether a
    step done right afterwards gives the average]."""
    import asyncio
    import gc

    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    sched = BucketScheduler(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(r))
    out: list[Any] = []

    async def main() -> None:
        sched.backward(model(x).sum())  # the bug: no await
        gc.collect()
        try:
            await sched.backward(model(x).sum())
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e).split(":")[0])
        await asyncio.gather(sched.backward(model(x).sum()))  # kept by gather: runs
        want = _averaged_grads(copy.deepcopy(model), x)
        out.append(
            all(
                torch.allclose(p.grad, w, atol=1e-6)
                for p, w in zip(model.parameters(), want, strict=True)
            )
        )

    run_dropping(main(), sched.remove)
    return out


def int8_per_tensor_error(block: int, hosts: int = 0) -> list[list[float]]:
    """Each parameter's averaged gradient under Int8 in a BucketScheduler, against the
    exact mean (relative norm), over three steps: a 300-float bias shares one bucket with a
    weight whose gradients are about 10x larger. The gradients are the same on every rank.
    ``hosts``: under the node hierarchy, the job as that many hosts (Int8 across them)."""
    from overlap.compression import Int8
    from overlap.scheduler.hierarchy import Hierarchical

    r = comm.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 300), nn.Tanh(), nn.Linear(300, 3))
    twin = copy.deepcopy(model)
    comp: Compressor = Int8(block=block)
    if hosts:
        comp = Hierarchical(comp, hosts=hosts, local=comm.get_world_size() // hosts)
    sched = BucketScheduler(model, compression=comp, hierarchy="flat")
    assert len(sched.buckets) == 1
    out = []
    for step in range(3):
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(10 * r + step))
        model.zero_grad()
        twin.zero_grad()
        model(x).pow(2).mean().backward()
        sched.synchronize()
        twin(x).pow(2).mean().backward()
        errs = []
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            exact = q.grad.double()
            comm.all_reduce(exact, op="avg")
            errs.append(float((p.grad.double() - exact).norm() / exact.norm()))
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert all(torch.equal(flat, g) for g in comm.all_gather(flat))
        out.append(errs)
    if hosts:
        sched.remove()
        return out
    # A state saved before the per-tensor layout (no "layout" in it) loads; at the bucket's
    # next step its errors, which stand at other places, are dropped with a warning. A
    # state of today's layout is kept as it is.
    saved = comp.state_dict()
    assert saved["layout"] == "per-tensor" and list(saved["state"]) == [0]
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: warned.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("overlap.compression.quantize").addHandler(handler)
    try:
        for legacy in (False, True):
            state = {k: v for k, v in saved.items() if not (legacy and k == "layout")}
            if legacy:  # errors that, used, would throw the average far off
                state["state"] = {0: {n: t + 1e3 for n, t in saved["state"][0].items()}}
            comp.load_state_dict(state)
            model.zero_grad()
            twin.zero_grad()
            x = torch.ones(5, 7) * (r + 1)
            model(x).pow(2).mean().backward()
            sched.synchronize()
            twin(x).pow(2).mean().backward()
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                exact = q.grad.double()
                comm.all_reduce(exact, op="avg")
                assert float((p.grad.double() - exact).norm() / exact.norm()) < 0.05, legacy
            assert len(warned) == int(legacy), warned
    finally:
        logging.getLogger("overlap.compression.quantize").removeHandler(handler)
    assert "saved by an earlier overlap" in warned[0] and "dropped" in warned[0], warned
    sched.remove()
    return out
