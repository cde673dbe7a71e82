"""Rank-side checks of the deepspeed.comm names overlap.comm added (ds-comm-parity), run on
gloo ranks (tests/gloo/test_ds_comm.py) and under mpiexec (tests/mpi/run_cases.py).

Each check asserts on every rank and returns nothing; :func:`run_all` runs them all in one
go and reports "ok" or the traceback per check."""

from __future__ import annotations

import asyncio
import datetime
import io
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import overlap
from overlap import comm
from overlap.comm import ReduceOp, comms_logger
from overlap.errors import CommError


def _ranks() -> tuple[int, int]:
    return comm.get_rank(), comm.get_world_size()


def inference_all_reduce() -> None:
    r, w = _ranks()
    t = torch.full((5,), float(r + 1))
    comm.inference_all_reduce(t)
    assert torch.equal(t, torch.full((5,), w * (w + 1) / 2))
    t = torch.full((3,), float(r))
    comm.inference_all_reduce(t, ReduceOp.MAX, None, True).wait(30)
    assert torch.equal(t, torch.full((3,), float(w - 1)))


def all_reduce_coalesced() -> None:
    r, w = _ranks()
    ts = [torch.full((3,), float(r)), torch.full((2, 2), float(r), dtype=torch.float64),
          torch.full((4,), r + 1, dtype=torch.int64), torch.full((1,), 2.0 * r)]  # fmt: skip
    out = comm.all_reduce_coalesced(ts)
    s = w * (w - 1) / 2
    assert out is not None and len(out) == 4
    assert torch.equal(ts[0], torch.full((3,), s)) and ts[1].dtype == torch.float64
    assert torch.equal(ts[1], torch.full((2, 2), s, dtype=torch.float64))
    assert torch.equal(ts[2], torch.full((4,), w * (w + 1) // 2, dtype=torch.int64))
    assert torch.equal(ts[3], torch.full((1,), 2 * s))
    fs = [torch.full((6,), float(r)), torch.full((2,), float(10 * r))]
    h = comm.all_reduce_coalesced(fs, op="avg", async_op=True)
    got = asyncio.run(_await(h))
    assert got is fs or list(got) == fs
    assert torch.allclose(fs[0], torch.full((6,), (w - 1) / 2))
    assert torch.allclose(fs[1], torch.full((2,), 10 * (w - 1) / 2))
    try:
        comm.all_reduce_coalesced(torch.ones(2))
        raise AssertionError("a bare tensor was accepted")
    except TypeError as exc:
        assert "list of tensors" in str(exc)


async def _await(h: Any) -> Any:
    return await asyncio.wait_for(h, 30)


def all_gather_coalesced() -> None:
    r, w = _ranks()
    ins = [torch.full((3,), float(r)), torch.arange(2, dtype=torch.int64) + 10 * r,
           torch.full((1,), float(-r))]  # fmt: skip
    outs = [torch.empty(w * 3), torch.empty(w * 2, dtype=torch.int64), torch.empty(w)]
    comm.all_gather_coalesced(outs, ins)
    for k in range(w):
        assert torch.equal(outs[0][3 * k : 3 * k + 3], torch.full((3,), float(k)))
        assert torch.equal(outs[1][2 * k : 2 * k + 2], torch.arange(2) + 10 * k)
        assert outs[2][k].item() == -k
    outs2 = [torch.zeros(w * 3), torch.zeros(w * 2, dtype=torch.int64), torch.zeros(w)]
    comm.all_gather_coalesced(outs2, ins, async_op=True).wait(30)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs2, strict=True))
    try:
        comm.all_gather_coalesced([torch.empty(3)], [torch.empty(3)])
        raise AssertionError("a too-small output was accepted")
    except ValueError as exc:
        assert "world_size x 3" in str(exc)


def gather_and_scatter_fns() -> None:
    r, w = _ranks()
    out = torch.empty(w * 2)
    comm.allgather_fn(out, torch.full((2,), float(r)))
    assert torch.equal(out, torch.arange(w).float().repeat_interleave(2))
    part = torch.empty(2)
    comm.reduce_scatter_fn(part, torch.arange(2 * w).float() + r)
    base = torch.arange(2 * r, 2 * r + 2).float()
    assert torch.equal(part, w * base + w * (w - 1) / 2)
    # DeepSpeed's positional spellings
    t = torch.ones(3)
    comm.all_reduce(t, ReduceOp.SUM, None, False)
    assert torch.equal(t, torch.full((3,), float(w)))
    o = torch.empty(w)
    comm.all_to_all_single(o, torch.full((w,), float(r)))
    assert torch.equal(o, torch.arange(w).float())


def objects() -> None:
    r, w = _ranks()
    got: list[Any] = [None] * w
    comm.all_gather_object(got, {"rank": r, "text": "x" * (r * 37)})
    assert got == [{"rank": k, "text": "x" * (k * 37)} for k in range(w)]
    src = w - 1
    objs: list[Any] = [None, "mine", r] if r != src else [{"from": src}, [1, 2, 3], None]
    comm.broadcast_object_list(objs, src)
    assert objs == [{"from": src}, [1, 2, 3], None]
    mine = [1] if r == 0 else [1, 2]
    try:
        comm.broadcast_object_list(mine, 0)
        assert r == 0, "a receiver's list of another length was accepted"
    except ValueError as exc:
        assert r != 0 and "same length" in str(exc) and mine == [1, 2], (r, exc)
    comm.barrier()  # every rank got through: none is left in the broadcast
    # tensors of the dtypes torch pickles but cannot unpickle (uint16/32/64, float8): every
    # receiver failed ("'UntypedStorage' has no attribute 'dtype'"); they travel as bytes
    from overlap.dtypes import float8_dtypes, present

    rare = {str(dt): torch.arange(3).to(dt).reshape(3, 1) for dt in present("uint16", "uint64")}
    rare.update({str(dt): torch.tensor(1.5).to(dt) for dt in float8_dtypes()})
    rare["empty"] = torch.empty(0, 2).to(float8_dtypes()[0])
    got_rare: list[Any] = [None] * w
    comm.all_gather_object(got_rare, rare)
    for name, t in rare.items():
        back = got_rare[(r + 1) % w][name]
        assert back.dtype == t.dtype and back.shape == t.shape, (name, back)
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8)), (name, back)
    # torch's send_object_list / recv_object_list: around the ring, then to rank 0 from any
    sent = [{"from": r}, torch.arange(r + 1), rare]
    nxt, prv = (r + 1) % w, (r - 1) % w
    into: list[Any] = [None] * 3
    if r % 2 == 0:
        comm.send_object_list(sent, nxt)
        assert comm.recv_object_list(into, prv) == prv
    else:
        assert comm.recv_object_list(into, prv) == prv
        comm.send_object_list(sent, nxt)
    assert into[0] == {"from": prv} and torch.equal(into[1], torch.arange(prv + 1)), into
    assert set(into[2]) == set(rare)
    if r == 0:
        senders = set()
        for _ in range(w - 1):
            one: list[Any] = [None]
            who = comm.recv_object_list(one)
            assert one == [f"hello from {who}"], (who, one)
            senders.add(who)
        assert senders == set(range(1, w)), senders
    else:
        comm.send_object_list([f"hello from {r}"], 0)
    comm.barrier()
    # torch's gather_object / scatter_object_list, to the last rank and from it
    gathered: list[Any] | None = [None] * w if r == src else None
    comm.gather_object({"rank": r, "t": torch.tensor([r])}, gathered, dst=src)
    if r == src:
        assert gathered is not None and [g["rank"] for g in gathered] == list(range(w))
        assert [int(g["t"]) for g in gathered] == list(range(w))
    out: list[Any] = [None]
    comm.scatter_object_list(out, [f"to{k}" * k for k in range(w)] if r == src else None, src)
    assert out == [f"to{r}" * r], out
    # on a group of the odd ranks (its global ranks as roots), when there are some
    odd = comm.new_group(list(range(1, w, 2)))
    if r % 2:
        n = len(range(1, w, 2))
        got_odd: list[Any] | None = [None] * n if r == 1 else None
        comm.gather_object(r * 10, got_odd, dst=1, group=odd)
        assert r != 1 or got_odd == [k * 10 for k in range(1, w, 2)], got_odd
        comm.scatter_object_list(out, list(range(n)) if r == 1 else None, src=1, group=odd)
        assert out == [r // 2], out


def groups_and_queries() -> None:
    r, w = _ranks()
    assert comm.get_all_ranks_from_group() == list(range(w))
    # one host here: every rank local, host 0 (RankPool sets no LOCAL_WORLD_SIZE; MPI's
    # processor names all match)
    assert comm.get_local_world_size() == w and comm.get_node_rank() == 0
    assert comm.get_global_rank() == 0
    members = list(range(0, w, 2))
    g = comm.new_group(members)
    if r in members:
        assert comm.get_all_ranks_from_group(g) == members
    assert comm.has_all_gather_into_tensor() and comm.has_reduce_scatter_tensor()
    assert comm.has_all_reduce_coalesced() and not comm.has_coalescing_manager()
    assert comm.is_available()
    comm.set_backend()
    comm.init_deepspeed_backend(comm.get_backend(), None, None)
    for required in (None, True, False):  # initialized already: harmless, as DeepSpeed
        overlap.init_distributed(comm.get_backend(), dist_init_required=required)
    mesh = comm.initialize_mesh_device((w,), ("dp",))
    if comm.get_backend() == "mpi":
        assert mesh is None
    else:
        assert mesh.size() == w and mesh.mesh_dim_names == ("dp",)
    try:
        comm.enable_symm_mem_for_group("0")
        raise AssertionError("symmetric memory without NCCL was accepted")
    except RuntimeError as exc:
        assert "NCCL" in str(exc)


def monitored_barrier_passes() -> None:
    t0 = time.monotonic()
    comm.monitored_barrier(timeout=20)
    comm.monitored_barrier(timeout=datetime.timedelta(seconds=20), wait_all_ranks=True)
    assert time.monotonic() - t0 < 10


def monitored_barrier_names_the_late_rank() -> None:
    """The last rank arrives 3 s late for a 1 s monitored_barrier: rank 0 names it, the
    others fail for want of a release, all within the timeout plus a margin."""
    r, w = _ranks()
    if w == 1:
        return
    comm.barrier()
    late = w - 1
    if r == late:
        time.sleep(3)
    t0 = time.monotonic()
    try:
        comm.monitored_barrier(timeout=1, wait_all_ranks=True)
        raise AssertionError(f"rank {r}: the barrier passed with rank {late} missing")
    except CommError as exc:
        msg = str(exc)
        if r == 0:
            assert f"Rank {late} did not reach" in msg or f"{late} did not" in msg, msg
        else:
            assert "was not released" in msg, msg
    assert time.monotonic() - t0 < 1 + 5


def comms_logger_end_to_end() -> None:
    """prof=True / log_name / prof_ops / prof_all, blocking and awaited; an awaited op is timed
    to completion (the last rank joins 0.4 s late); the summary's dict, table and stragglers."""
    r, w = _ranks()
    lg = comms_logger.LOGGER
    saved = (lg.enabled, lg.prof_all, list(lg.prof_ops), lg.debug)
    comm.reset_log()
    try:
        comm.configure(enabled=True, prof_all=False, prof_ops=["custom_bcast"])
        t = torch.ones(256)
        comm.all_reduce(t)  # not profiled
        comm.all_reduce(t, prof=True)
        comm.barrier()
        if r == w - 1:
            time.sleep(0.4)
        h = comm.all_reduce(torch.ones(256), async_op=True, prof=True)
        h.wait(30)
        comm.broadcast(torch.ones(8), 0, log_name="custom_bcast")
        comm.broadcast(torch.ones(8), 0)  # not in prof_ops
        got: list[Any] = [None] * w
        comm.all_gather_object(got, r, prof=True)
        if w > 1:
            peer = (r + 1) % w
            src = (r - 1) % w
            hs = [comm.isend(torch.ones(4), peer, prof=True),
                  comm.irecv(torch.empty(4), src, prof=True)]  # fmt: skip
            for x in hs:
                x.wait(30)
        comm.configure(debug=True)
        comm.all_reduce(torch.ones(2), prof=True)
        comm.all_gather_object([None] * w, r, prof=True)
        comm.configure(debug=False)
        raw = lg.get_raw_data()
        assert raw["all_reduce"][1024][0] == 2, raw  # the blocking and the awaited one
        lats = raw["all_reduce"][1024][1]
        if r == 0 and w > 1:
            # awaited: issue to completion, so it includes the 0.4 s wait for the late rank
            assert max(lats) >= 0.3 * 1e3, lats
        assert "custom_bcast" in raw and raw["custom_bcast"][32][0] == 1
        assert "broadcast" not in raw and "all_gather_object" in raw
        for op in ("all_reduce", "all_gather_object"):  # the caller, named at call time
            assert f"{op} | [Caller Func: comms_logger_end_to_end]" in raw, list(raw)
        if w > 1:
            assert raw["isend"][16][0] == 1 and raw["irecv"][16][0] == 1
        out = io.StringIO()
        res = comm.log_summary(show_straggler=True, return_dict=True, file=out)
        assert res is not None and res["metadata"]["world_size"] == w
        s = res["summary"]["all_reduce"][1024]
        assert s["count"] == 2 and s["busbw_avg_gbps"] >= 0 and s["msg_size_str"] == "1.0 KB"
        strag = res["straggler_analysis"]["all_reduce"][1024]
        assert strag["count"] == 2 and strag["total_straggler_ms"] >= 0
        text = out.getvalue()
        assert ("Comm. Op" in text and "custom_bcast" in text) == (r == 0), text
        assert comm.has_comm_data() and comm.get_comm_operation_count() >= 5
        assert "custom_bcast" in comm.get_logged_comm_ops()

        @comm.timed_op
        def my_collective(x: torch.Tensor, prof: bool = False) -> Any:
            return comm.all_reduce(x, async_op=True)

        my_collective(torch.ones(4), prof=True).wait(30)
        time.sleep(0.05)  # the done-callback runs on the completing thread
        assert lg.get_raw_data()["my_collective"][16][0] == 1
    finally:
        lg.enabled, lg.prof_all, lg.prof_ops, lg.debug = saved
        comm.reset_log()


def comm_off_switches() -> None:
    r, _ = _ranks()
    t = torch.full((3,), float(r))
    comm.broadcast_comm_off(True)
    try:
        res = comm.broadcast(t, 0)
        assert isinstance(res, comm.Noop) and res.wait() is None
        assert torch.equal(t, torch.full((3,), float(r)))  # skipped: unchanged
    finally:
        comm.broadcast_comm_off(False)
    comm.broadcast(t, 0)
    assert torch.equal(t, torch.zeros(3))
    comm.backward_comm_off(True)
    assert {"all_gather", "reduce_scatter"} <= comm.comm_off
    comm.backward_comm_off(False)
    assert not comm.comm_off


def deepspeed_test_dist() -> None:
    """DeepSpeed's tests/unit/comm/test_dist.py, ported (harness changed: these ranks instead
    of its DistributedTest): TestInit, TestDistAllReduce, TestDistInferenceAllReduce (fp32,
    bf16, fp16), TestDistIsendIrecv. Its non-member irecv test is the one difference: overlap
    raises a ValueError naming the members where torch returns None (docs/api.md)."""
    r, w = _ranks()
    assert comm.is_initialized() and comm.get_rank() < w
    total = w * (w + 1) // 2
    for n in (128, 3):
        x = torch.ones(1, n) * (r + 1)
        comm.all_reduce(x)
        assert torch.all(x == torch.ones(1, n) * total)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = (torch.ones(1, n) * (r + 1)).to(dtype)
            comm.inference_all_reduce(y)
            assert torch.all(y == (torch.ones(1, n) * total).to(dtype)), dtype
    if w >= 2 and r < 2:
        length = 4096
        if r == 0:
            handle = comm.isend(torch.arange(length, dtype=torch.float32), dst=1)
        else:
            received = torch.zeros(length, dtype=torch.float32)
            handle = comm.irecv(received, src=0)
        assert hasattr(handle, "wait")
        handle.wait(30)
        if r == 1:
            assert torch.equal(received, torch.arange(length, dtype=torch.float32))
    sub = comm.new_group(ranks=[0])
    if r == 1:
        try:
            comm.irecv(torch.full((8,), 7.0), src=0, group=sub)
            raise AssertionError("an irecv on a group without this rank was accepted")
        except ValueError as exc:
            assert "[0]" in str(exc), exc


def _raises(kind: type[Exception], words: str, f: Callable[[], Any]) -> None:
    try:
        f()
    except kind as exc:
        assert words in str(exc), exc
        return
    raise AssertionError(f"no {kind.__name__} ({words!r})")


def torch_group_helpers() -> None:
    """torch.distributed's group helpers and queries (overlap/comm/torch_names.py), with
    groups named in reverse order and a rank outside them (3 ranks)."""
    r, w = _ranks()
    assert comm.get_process_group_ranks() == comm.get_process_group_ranks(None) == list(range(w))
    assert comm.get_group_rank(None, r) == r
    g = comm.new_group([w - 1, 0])
    assert comm.get_process_group_ranks(g) == [0, w - 1]  # on non-members too
    assert comm.get_group_rank(g, w - 1) == 1 and comm.get_group_rank(g, 0) == 0
    if w > 2:
        _raises(
            ValueError, "not part of the group of ranks [0, 2]", lambda: comm.get_group_rank(g, 1)
        )
    _raises(TypeError, "global_rank must be an int", lambda: comm.get_group_rank(g, "0"))
    # one subgroup per rank, then the default: this host's processes (all of them here)
    cur, subs = comm.new_subgroups(1)
    assert len(subs) == w and comm.get_world_size(cur) == 1 and comm.get_rank(cur) == 0
    t = torch.tensor([float(r + 1)])
    comm.all_reduce(t, group=cur)
    assert t.item() == r + 1
    cur, subs = comm.new_subgroups()
    assert len(subs) == 1 and comm.get_process_group_ranks(cur) == list(range(w))
    comm.all_reduce(t, group=cur)
    assert t.item() == w * (w + 1) / 2
    # refused on every rank before any group is made, and the ranks stay in step
    _raises(ValueError, "must be positive and divide", lambda: comm.new_subgroups(w + 1))
    _raises(ValueError, "must be positive and divide", lambda: comm.new_subgroups(0))
    _raises(ValueError, "rank 0 is in both subgroup [0] and [1, 0]",
            lambda: comm.new_subgroups_by_enumeration([[0], [1, 0]]))  # fmt: skip
    _raises(ValueError, f"{w} in subgroup [0, {w}] is not a global rank",
            lambda: comm.new_subgroups_by_enumeration([[0, w]]))  # fmt: skip
    _raises(ValueError, "is empty", lambda: comm.new_subgroups_by_enumeration([]))
    # the last rank alone, the rest together
    cur, subs = comm.new_subgroups_by_enumeration([list(range(w - 1)), [w - 1]])
    assert len(subs) == 2 and cur is subs[r == w - 1]
    t = torch.tensor([float(r + 1)])
    comm.all_reduce(t, group=cur)
    assert t.item() == (w if r == w - 1 else (w - 1) * w / 2)
    # a group's own subgroups: its non-members call too, and get none
    cur, subs = comm.new_subgroups(1, group=g)
    assert len(subs) == 2
    if r in (0, w - 1):
        assert comm.get_process_group_ranks(cur) == [r]
    else:
        assert cur is None
    # only subgroups of a list: ranks outside every list get None
    cur, subs = comm.new_subgroups_by_enumeration([[0]])
    assert (cur is subs[0]) if r == 0 else cur is None
    # torch's newer names of the tensor gathers
    out = torch.zeros(w)
    comm.all_gather_single(out, torch.tensor([float(r)]))
    assert out.tolist() == [float(i) for i in range(w)]
    red = torch.zeros(1)
    comm.reduce_scatter_single(red, torch.ones(w) * (r + 1))
    assert red.item() == w * (w + 1) / 2
    assert comm.get_node_local_rank() == comm.get_local_rank() == r  # one host
    assert comm.is_gloo_available() and comm.is_mpi_available()  # the test install has both
    assert not comm.is_torchelastic_launched()  # RankPool and mpiexec, not torchrun


CHECKS: dict[str, Callable[[], None]] = {
    "inference_all_reduce": inference_all_reduce,
    "all_reduce_coalesced": all_reduce_coalesced,
    "all_gather_coalesced": all_gather_coalesced,
    "gather_and_scatter_fns": gather_and_scatter_fns,
    "objects": objects,
    "groups_and_queries": groups_and_queries,
    "torch_group_helpers": torch_group_helpers,
    "monitored_barrier_passes": monitored_barrier_passes,
    "comms_logger": comms_logger_end_to_end,
    "comm_off_switches": comm_off_switches,
    "deepspeed_test_dist": deepspeed_test_dist,
}


def run_all(names: list[str] | None = None) -> dict[str, str]:
    """Every check (or the named ones), in order: "ok" or the traceback."""
    out: dict[str, str] = {}
    for name in names or list(CHECKS):
        try:
            CHECKS[name]()
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()
        comm.barrier()  # the next check starts together even after a failure
    return out
