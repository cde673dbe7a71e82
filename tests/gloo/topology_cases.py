"""Rank-side checks of PipelineParallelGrid and of ring/naive allreduce."""

from __future__ import annotations

from typing import Any

import torch

from overlap import comm
from overlap.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from tests.gloo.cases import go


def grid_2x2() -> dict[str, Any]:
    """4 ranks as 2 stages x 2 data replicas; groups work and match DeepSpeed's layout."""
    import overlap.topology as topo_mod

    calls: list[list[int]] = []
    real = topo_mod.comm.new_group

    def counting(ranks: Any, **kw: Any) -> Any:
        calls.append(list(ranks))
        return real(ranks, **kw)

    topo_mod.comm.new_group = counting  # type: ignore[assignment]
    try:
        grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    finally:
        topo_mod.comm.new_group = real  # type: ignore[assignment]
    r = comm.get_rank()
    t = torch.ones(1) * r
    comm.all_reduce(t, group=grid.get_data_parallel_group())
    p = torch.ones(1) * r
    comm.all_reduce(p, group=grid.get_pipe_parallel_group())
    return {
        "stage": grid.get_stage_id(),
        "dp_id": grid.get_data_parallel_id(),
        "dp_group": grid.dp_group,
        "pp_group": grid.pp_group,
        "first": grid.is_first_stage,
        "last": grid.is_last_stage,
        "dp_sum": t.item(),
        "pp_sum": p.item(),
        "p2p": grid.p2p_groups,
        "next_stage": grid.stage_to_global(1),
        "mpu": [
            grid.get_pipe_parallel_rank(),
            grid.get_pipe_parallel_world_size(),
            grid.get_data_parallel_rank(),
            grid.get_data_parallel_world_size(),
            grid.get_model_parallel_rank(),
            grid.get_model_parallel_world_size(),
            grid.get_slice_parallel_rank(),
            grid.get_slice_parallel_world_size(),
        ],
        "groups_created": len(calls),
    }


def grid_without_pipe_axis() -> list[int]:
    grid = PipelineParallelGrid(ProcessTopology(axes=["data"], dims=[comm.get_world_size()]))
    assert grid.get_stage_id() == 0 and grid.is_first_stage and grid.is_last_stage
    t = torch.ones(1)
    comm.all_reduce(t, group=grid.get_data_parallel_group())
    return [grid.get_data_parallel_id(), int(t.item())]


def grid_other_topology() -> list[str]:
    """Rank 3 builds a 4 x 1 grid where the others build 2 x 2: every rank refuses, naming
    rank 3 (before: every rank hung in the group creations); a grid built alike afterwards
    works."""
    dims = [4, 1] if comm.get_rank() == 3 else [2, 2]
    try:
        PipelineParallelGrid(ProcessTopology(axes=["pipe", "data"], dims=dims))
        got = "no error"
    except ValueError as exc:
        got = str(exc)
    grid = PipelineParallelGrid(ProcessTopology(axes=["pipe", "data"], dims=[2, 2]))
    t = torch.ones(1)
    comm.all_reduce(t, group=grid.get_data_parallel_group())
    return [got, str(int(t.item()))]


def grid_on_a_process_group() -> Any:
    """The grid spans the ranks of process_group (global ranks 1, 2, 3 of 4)."""
    sub = comm.new_group([1, 2, 3])
    if comm.get_rank() == 0:
        return None
    grid = PipelineParallelGrid(
        PipeModelDataParallelTopology(num_pp=3, num_mp=1, num_dp=1), process_group=sub
    )
    t = torch.ones(1)
    comm.all_reduce(t, group=grid.get_pipe_parallel_group())
    return [grid.get_stage_id(), grid.pp_group, grid.stage_to_global(0), int(t.item())]


def allreduce_algorithms(algorithm: str, mode: str) -> int:
    """ring/naive equal native for every op on floats and ints, many sizes."""
    r, w = comm.get_rank(), comm.get_world_size()
    checked = 0
    for n in (0, 1, 5, 37, 1000):
        for op, dtype in (
            ("sum", torch.float64),
            ("avg", torch.float64),
            ("max", torch.int64),
            ("min", torch.float32),
            ("product", torch.int32),
            ("sum", torch.int64),
            ("bxor", torch.int64),
        ):
            gen = torch.Generator().manual_seed(n * 7 + r)
            if dtype.is_floating_point:
                base = torch.randint(-8, 9, (n,), generator=gen).to(dtype)  # exact in any order
            else:
                base = torch.randint(1, 4, (n,), generator=gen).to(dtype)
            mine, native = base.clone(), base.clone()
            out = go(
                lambda a, mine=mine, op=op: comm.all_reduce(
                    mine, op=op, async_op=a, algorithm=algorithm
                ),
                mode,
            )
            comm.all_reduce(native, op=op)
            assert out is mine
            assert torch.equal(mine, native), (algorithm, op, dtype, n, mine[:5], native[:5])
            checked += 1
    # shaped tensors keep their shape
    m = torch.arange(12.0).reshape(3, 4) + r
    comm.all_reduce(m, algorithm=algorithm)
    assert m.shape == (3, 4) and float(m[0, 0]) == w * (w - 1) / 2
    return checked


def grid_groups_take_every_op() -> list[Any]:
    """The grid's data-parallel group (made by its members alone) carries what needs a
    private twin: an async ring all_reduce, an async 1-bit Compressor.reduce, a DiLoCo;
    and a BucketScheduler per data-parallel group. 4 ranks, 2 stages x 2 replicas. Before:
    the first three refused the group ("need a group from overlap.comm.new_group"), the
    schedulers hung every rank."""
    import overlap
    from overlap.compression import OneBit

    r = comm.get_rank()
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    dp = grid.get_data_parallel_group()
    out: list[Any] = []
    t = torch.full((5,), float(r))
    comm.all_reduce(t, group=dp, algorithm="ring", async_op=True).wait(timeout=60)
    out.append(t[0].item())
    x = torch.full((64,), float(r + 1))
    OneBit().reduce("grid", x, group=dp, async_op=True).wait(timeout=60)
    out.append(round(x[0].item(), 4))  # the 1-bit average of equal values is exact
    torch.manual_seed(r)
    m = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    d = overlap.DiLoCo(m, inner, sync_every=1, group=dp)
    m(torch.full((1, 2), float(r))).sum().backward()
    inner.step()
    d.step()
    w = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    d.remove()
    sched = overlap.BucketScheduler(m, group=dp)
    m.zero_grad()
    m(torch.full((1, 2), float(r))).sum().backward()
    sched.synchronize()
    out.append(m.weight.grad[0].tolist() if m.weight.grad is not None else None)
    sched.remove()
    every = [torch.zeros_like(w) for _ in range(4)]
    comm.all_gather(every, w)
    mates = grid.dp_group
    out.append(all(torch.equal(every[k], w) for k in mates))  # one model per replica group
    return out
