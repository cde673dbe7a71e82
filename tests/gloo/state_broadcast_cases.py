"""Rank-side checks of what makes the ranks' state alike: overlap.broadcast_parameters /
broadcast_optimizer_state (Horovod's start-up pair), overlap.sync_buffers, and the buffers
at DiLoCo.finish(); run on 3 gloo ranks (tests/gloo/test_state_broadcast.py) and under
mpiexec (tests/mpi/run_cases.py). Each asserts on every rank and returns nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import overlap
from overlap import comm


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.LazyLinear(4))
    m(torch.randn(2, 2, 5, 5))  # the lazy layer takes its shape; BatchNorm its statistics
    # a weight that is not contiguous (channels_last), kept so
    m[0].weight.data = m[0].weight.data.to(memory_format=torch.channels_last)
    return m


def _raises(words: str, f: Callable[[], Any], kind: type[Exception] = ValueError) -> str:
    try:
        f()
    except kind as exc:
        assert words in str(exc), exc
        return str(exc)
    raise AssertionError(f"no {kind.__name__} ({words!r})")


def _same_everywhere(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    lo, hi = flat.clone(), flat.clone()
    comm.all_reduce(lo, op="min")
    comm.all_reduce(hi, op="max")
    return bool(torch.equal(lo, hi))


def parameters() -> None:
    r, w = comm.get_rank(), comm.get_world_size()
    src = w - 1
    m = _model(r)  # seeded apart
    want = {k: v.clone() for k, v in _model(src).state_dict().items()}
    overlap.broadcast_parameters(m.state_dict(), src=src)
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k  # buffers too (num_batches_tracked included)
    assert m[0].weight.is_contiguous(memory_format=torch.channels_last)
    # named_parameters() and bare tensors, from rank 0
    m2 = _model(10 + r)
    overlap.broadcast_parameters(m2.named_parameters())
    assert _same_everywhere(list(m2.parameters()))
    m3 = _model(20 + r)
    overlap.broadcast_parameters(m3.parameters(), src=0)
    assert _same_everywhere(list(m3.parameters()))
    # a layout that differs on the last rank: every rank refuses, nothing is overwritten
    m4 = _model(30 + r) if r != w - 1 else nn.Sequential(nn.Linear(3, 3))
    before = [p.clone() for p in m4.parameters()]
    said = _raises(f"rank {w - 1}: ", lambda: overlap.broadcast_parameters(m4.state_dict()))
    assert "Nothing was sent" in said, said
    assert all(torch.equal(a, b) for a, b in zip(before, m4.parameters(), strict=True))
    # a name that differs on one rank only
    sd = {"a": torch.full((2,), float(r)), ("b" if r != 1 else "c"): torch.zeros(1)}
    _raises("rank 1: ('c', (1,), torch.float32) here", lambda: overlap.broadcast_parameters(sd))
    assert sd["a"].tolist() == [float(r)] * 2
    # not tensors, a bad root, the module itself
    _raises("['x'] are not tensors", lambda: overlap.broadcast_parameters({"x": 1}))
    _raises("is not a global rank", lambda: overlap.broadcast_parameters(sd, src=w))
    _raises("not the module", lambda: overlap.broadcast_parameters(m), TypeError)
    # a sub-group, its root given by global rank
    g = comm.new_group([0, w - 1])
    if r in (0, w - 1):
        t = torch.full((3,), float(r))
        overlap.broadcast_parameters([t], src=w - 1, group=g)
        assert t.tolist() == [float(w - 1)] * 3


def horovods_root_rank() -> None:
    """Horovod's ``root_rank=`` spelling of ``src``, as a ported script writes it (before:
    "got an unexpected keyword argument 'root_rank'"); both given and differing: refused."""
    r, w = comm.get_rank(), comm.get_world_size()
    m = _model(r)
    want = {k: v.clone() for k, v in _model(w - 1).state_dict().items()}
    overlap.broadcast_parameters(m.state_dict(), root_rank=w - 1)
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    opt = torch.optim.Adam(m.parameters(), lr=0.1 * (r + 1))
    overlap.broadcast_optimizer_state(opt, root_rank=w - 1)
    assert opt.param_groups[0]["lr"] == 0.1 * w
    overlap.broadcast_parameters(m.state_dict(), src=0, root_rank=0)  # the same root: fine
    _raises(
        "src=0 and root_rank=1 name two roots",
        lambda: overlap.broadcast_parameters(m.state_dict(), src=0, root_rank=1),
    )


def optimizer_state() -> None:
    r = comm.get_rank()
    torch.manual_seed(0)
    m = nn.Linear(4, 3)  # the same start everywhere
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3 * (r + 1))
    if r == 0:  # only rank 0 trained (or loaded a checkpoint)
        for _ in range(3):
            m(torch.randn(5, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    overlap.broadcast_parameters(m.parameters())
    overlap.broadcast_optimizer_state(opt)
    st = opt.state_dict()
    assert opt.param_groups[0]["lr"] == 1e-3  # rank 0's settings
    assert all(float(s["step"]) == 3.0 for s in st["state"].values()), st["state"]
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 4 and _same_everywhere(moments)
    # the same gradient from here on: the same weights after the step
    x = torch.arange(8.0).reshape(2, 4)
    m(x).square().sum().backward()
    opt.step()
    assert _same_everywhere(list(m.parameters()))
    # other parameter groups on one rank: every rank refuses, no state changes
    groups = [{"params": [m.weight]}, {"params": [m.bias]}] if r == 1 else [m.weight, m.bias]
    opt2 = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    said = _raises("rank 1: parameter groups of [1, 1] parameters here, [2] on rank 0",
                   lambda: overlap.broadcast_optimizer_state(opt2))  # fmt: skip
    assert "Nothing was sent" in said and not opt2.state, said
    # another optimizer class on rank 1 (before: SGD's groups loaded into its Adam, which
    # then had SGD's lr and no betas or eps), or parameters of other shapes (before: the
    # moments of rank 0's shapes were loaded): every rank refuses, nothing changes
    kind = torch.optim.Adam(m.parameters(), lr=0.5) if r == 1 else opt2
    said = _raises("rank 1: a torch.optim.adam.Adam here, a torch.optim.sgd.SGD on rank 0",
                   lambda: overlap.broadcast_optimizer_state(kind))  # fmt: skip
    assert kind.param_groups[0]["lr"] == (0.5 if r == 1 else 0.1), said
    torch.manual_seed(2)
    shaped = nn.Linear(2, 3) if r == 1 else nn.Linear(3, 2)
    opt4 = torch.optim.Adam(shaped.parameters())
    shaped(torch.ones(1, shaped.in_features)).sum().backward()
    opt4.step()
    before = opt4.state[shaped.weight]["exp_avg"].clone()
    said = _raises("rank 1: parameter 0 has shape (3, 2) here, (2, 3) on rank 0",
                   lambda: overlap.broadcast_optimizer_state(opt4))  # fmt: skip
    assert torch.equal(opt4.state[shaped.weight]["exp_avg"], before), said
    # rank 0's still empty state empties the others' (SGD with momentum after a step)
    torch.manual_seed(1)
    m3 = nn.Linear(2, 2)
    opt3 = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
    if r != 0:
        m3(torch.ones(1, 2)).sum().backward()
        opt3.step()
        assert opt3.state
    overlap.broadcast_optimizer_state(opt3)
    assert not any(opt3.state.values()), opt3.state
    _raises(
        "takes a torch.optim.Optimizer", lambda: overlap.broadcast_optimizer_state(m), TypeError
    )
    onebit = overlap.OneBitAdam(nn.Linear(2, 2).parameters(), lr=1e-3)
    _raises("each rank's own", lambda: overlap.broadcast_optimizer_state(onebit), TypeError)


def _bn_model(rank: int) -> nn.Module:
    """A model with BatchNorm (float running statistics, an int64 counter), its statistics
    trained on this rank's own batches for 1 + rank forwards."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(rank)
    for _ in range(1 + rank):
        m(torch.randn(8, 4, generator=g) * (rank + 1) + rank)
    return m


def _expected(m: nn.Module) -> list[torch.Tensor]:
    """Every rank's buffers averaged where floating, rank 0's otherwise (the contract)."""
    w = comm.get_world_size()
    out = []
    for b in m.buffers():
        every = [torch.empty_like(b) for _ in range(w)]
        comm.all_gather(every, b.contiguous())
        out.append(torch.stack(every).mean(0) if b.is_floating_point() else every[0])
    return out


def _close_to(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a, b)


def buffers() -> None:
    """sync_buffers: floating buffers averaged, the counter rank 0's, every rank the same;
    a rank with another buffer layout makes every rank raise, nothing changed."""
    r = comm.get_rank()
    m = _bn_model(r)
    assert int(m[1].num_batches_tracked) == 1 + r
    want = _expected(m)
    overlap.sync_buffers(m)
    _close_to(list(m.buffers()), want)
    assert int(m[1].num_batches_tracked) == 1  # rank 0's
    assert _same_everywhere(list(m.buffers()))
    before = [b.clone() for b in m.buffers()]
    if r == 1:
        m[0].register_buffer("extra", torch.zeros(3))
    _raises("hold buffers of different names, shapes or dtypes", lambda: overlap.sync_buffers(m))
    mine = [b for n, b in m.named_buffers() if n != "0.extra"]
    assert all(torch.equal(a, b) for a, b in zip(mine, before, strict=True))
    _raises("takes a torch.nn.Module", lambda: overlap.sync_buffers([]), TypeError)  # type: ignore[arg-type]
    overlap.sync_buffers(nn.Linear(2, 2))  # no buffers: nothing to do, no error


def diloco_finish_buffers() -> None:
    """DiLoCo.finish() (and afinish()) ends every rank on one model, BatchNorm statistics
    included; a layout that differs is refused on every rank."""
    r = comm.get_rank()
    for mode in ("blocking", "async"):
        m = _bn_model(0)  # the same start everywhere (DiLoCo broadcasts rank 0's anyway)
        inner = torch.optim.SGD(m.parameters(), lr=0.05)
        d = overlap.DiLoCo(m, inner, sync_every=3, fragments=2, delay=1)
        g = torch.Generator().manual_seed(r)
        for _ in range(4):
            inner.zero_grad()
            m(torch.randn(8, 4, generator=g) * (r + 1) + r).pow(2).mean().backward()
            inner.step()
            d.step()
        want = _expected(m)
        d.finish() if mode == "blocking" else overlap.run(d.afinish())
        _close_to(list(m.buffers()), want)
        assert _same_everywhere([*m.parameters(), *m.buffers()]), mode
        if r == comm.get_world_size() - 1:
            m[2].register_buffer("extra", torch.zeros(1))
        ranks = list(range(comm.get_world_size()))
        _raises(f"DiLoCo.finish(): the ranks {ranks} hold buffers", d.finish)
        d.remove()


CHECKS: dict[str, Callable[[], None]] = {
    "parameters": parameters,
    "optimizer_state": optimizer_state,
    "horovods_root_rank": horovods_root_rank,
    "buffers": buffers,
    "diloco_finish_buffers": diloco_finish_buffers,
}
