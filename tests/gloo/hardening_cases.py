"""Rank-side cases for the hardening promises (docs/reliability.md lists each with its test)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import torch

import overlap
from overlap import CommError, comm
from overlap.comm import waiters
from overlap.runtime import run
from tests.gloo.catching import catcher
from tests.polling import until
from tests.realign import realign


def many_outstanding_receives(n: int) -> list[float]:
    """Rank 0 posts n receives up front and awaits them all, then sends n requests one by
    one; rank 1 answers each request. With a capped waiter pool this deadlocked at 32."""
    r = comm.get_rank()

    async def main() -> list[float]:
        if r == 0:
            outs = [torch.zeros(1) for _ in range(n)]
            hs = [comm.irecv(outs[i], src=1, tag=i) for i in range(n)]
            everything = asyncio.ensure_future(asyncio.gather(*hs))
            await asyncio.sleep(0)  # every receive is now being observed
            for i in range(n):
                await asyncio.wait_for(comm.isend(torch.tensor([float(i)]), dst=1), 60)
            await asyncio.wait_for(everything, 60)
            return [o.item() for o in outs]
        req = torch.zeros(1)
        for _ in range(n):
            await asyncio.wait_for(comm.irecv(req, src=0), 60)
            i = int(req.item())
            await asyncio.wait_for(comm.isend(torch.tensor([10.0 * i]), dst=0, tag=i), 60)
        return []

    return overlap.run(main())


def pool_threads() -> int:
    return waiters.get_pool().num_threads


def destroy_fails_pending_handles() -> list[str]:
    """Handles still in flight at destroy_process_group() fail with CommError: the one being
    awaited (its task wakes), and one nobody had started observing (on a later wait)."""
    r = comm.get_rank()
    seen: list[str] = []
    if r == 0:
        awaited = comm.irecv(torch.zeros(1), src=1, tag=7)  # never sent
        untouched = comm.irecv(torch.zeros(1), src=1, tag=8)  # never sent

        async def main() -> None:
            task = asyncio.ensure_future(awaited)
            await asyncio.sleep(0.2)
            comm.destroy_process_group()
            try:
                await asyncio.wait_for(task, 10)
            except CommError as exc:
                seen.append(f"awaited: {type(exc).__name__}")
            try:
                untouched.wait(timeout=10)
            except CommError as exc:
                seen.append(f"untouched: {type(exc).__name__}")

        overlap.run(main())
    else:
        time.sleep(0.5)
        comm.destroy_process_group()
    return seen


def new_group_inherits_timeout() -> tuple[str, float]:
    """init_distributed(timeout=3): a collective on a new_group whose peer is 8 s late fails
    within about 3 s (torch's own default for new groups is 30 minutes)."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = torch.tensor([s.getsockname()[1] if comm.get_rank() == 0 else 0])
    comm.all_reduce(port)  # a fresh job on a port rank 0 picked, with a 3 s timeout
    comm.destroy_process_group()
    os.environ["MASTER_PORT"] = str(int(port.item()))
    overlap.init_distributed("gloo", timeout=3)
    return _late_peer_all_reduce(comm.new_group([0, 1]))


def _late_peer_all_reduce(group: Any) -> tuple[str, float]:
    """An all_reduce on ``group`` to which rank 1 comes 8 s late: how it ended on this rank
    ("ok" or "CommError") and after how many seconds."""
    comm.barrier(group=group)
    t0 = time.monotonic()
    if comm.get_rank() == 1:
        time.sleep(8)
    try:
        comm.all_reduce(torch.ones(1), group=group)
        kind = "ok"
    except CommError:
        kind = "CommError"
    return kind, time.monotonic() - t0


def requires_grad_leaf_ops() -> dict[str, Any]:
    """In-place collectives on a leaf that requires grad (a parameter): no half-done op."""
    r, w = comm.get_rank(), comm.get_world_size()
    p = torch.nn.Parameter(torch.full((3,), float(r + 1)))
    out: dict[str, Any] = {}
    res = comm.all_reduce(p, op="avg")
    out["avg"] = p.detach().tolist()
    out["same_object"] = res is p
    q = torch.nn.Parameter(torch.full((2,), float(r + 1)))
    comm.reduce(q, dst=0)
    out["reduce"] = q.detach().tolist()
    h = comm.all_reduce(torch.nn.Parameter(torch.ones(2)), op="avg", async_op=True)
    out["async_avg"] = h.wait(timeout=60).detach().tolist()
    out["expect_avg"] = sum(range(1, w + 1)) / w
    # ring and naive too: their in-place sums failed half way on a Parameter, the peer left
    # waiting for a message that never came
    for alg in ("ring", "naive"):
        a = torch.nn.Parameter(torch.full((3,), float(r + 1)))
        assert comm.all_reduce(a, op="avg", algorithm=alg) is a
        out[alg] = a.detach().tolist()
        b = torch.nn.Parameter(torch.full((3,), float(r + 1)))
        out[f"async_{alg}"] = (
            comm.all_reduce(b, op="sum", algorithm=alg, async_op=True).wait(timeout=60).tolist()
        )
    return out


def skip_flag_covers_every_bucket() -> list[bool]:
    """OneBit(on_nonfinite="skip") with 4 buckets, the first-launched one non-finite on rank
    0: after synchronize(), last_skipped is True on every rank (later buckets used to reset
    it) and every gradient is NaN (the finite ones too: a loss scaler skips on every rank),
    and a clean step after it reads False."""
    from overlap import BucketScheduler
    from overlap.compression import OneBit

    r = comm.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    comp = OneBit(on_nonfinite="skip")
    cap = 16 * 17 * 4 / 2**20  # one layer per bucket
    sched = BucketScheduler(model, bucket_cap_mb=cap, first_bucket_mb=cap, compression=comp)
    poison = [r == 0]
    model[3].bias.register_hook(lambda g: g * float("nan") if poison[0] else g)
    try:
        assert len(sched.buckets) == 4, len(sched.buckets)
        flags = []
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
            sched.synchronize()
            if poison[0]:
                # the skipped bucket's gradients were read in place (never copied into the
                # bucket); they come out NaN with every other one
                assert sched.statistics()["read_in_place"] > 0
                assert all(bool(p.grad.isnan().all()) for p in model.parameters())  # type: ignore[union-attr]
            poison[0] = False
            flags.append(comp.last_skipped)
            model.zero_grad()
        return flags
    finally:
        sched.remove()


def environment_seen() -> tuple[str | None, str | None, str | None, int]:
    """(OVERLAP_TEST_MARK, OVERLAP_TEST_OWN, OVERLAP_TEST_GONE, parent's pid) in this rank."""
    import os

    env = os.environ
    got = env.get("OVERLAP_TEST_MARK"), env.get("OVERLAP_TEST_OWN"), env.get("OVERLAP_TEST_GONE")
    return (*got, os.getppid())


class _Rows(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i))


def data_loader_workers() -> float:
    """A DataLoader with worker processes inside a rank (a daemonic rank may not start
    them), its batches summed over the ranks."""
    batches = torch.utils.data.DataLoader(_Rows(), batch_size=2, num_workers=2)
    total = torch.stack([b.sum() for b in batches]).sum()
    comm.all_reduce(total)
    return float(total)


def debug_enabled() -> bool:
    from overlap.comm import debug

    return debug.enabled()


def _os_resources() -> tuple[int, int]:
    """(open file descriptors, OS threads) of this process."""
    import os

    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def scheduler_lifecycle(cycles: int) -> dict[str, Any]:
    """(14) a second scheduler over hooked parameters is refused until remove(); (18) a
    compressor is owned by one live scheduler; (15) build/step/remove cycles release their
    groups and threads."""
    from torch import nn

    from overlap import BucketScheduler, OneBit

    out: dict[str, Any] = {}
    lin = nn.Linear(4, 3)

    def step(s: BucketScheduler, model: nn.Linear) -> None:
        model(torch.ones(2, model.in_features)).sum().backward()
        s.synchronize()

    s1 = BucketScheduler(lin)
    try:
        BucketScheduler(lin)
        out["second"] = "no error"
    except ValueError as e:
        out["second"] = str(e)
    step(s1, lin)  # the first one is unharmed by the refusal
    s1.remove()
    s1.remove()  # idempotent
    comp = OneBit()
    s2 = BucketScheduler(lin, compression=comp)
    assert overlap.holder_of(comp) is s2
    other = nn.Linear(2, 2)
    try:
        BucketScheduler(other, compression=comp)
        out["shared_compressor"] = "no error"
    except ValueError as e:
        out["shared_compressor"] = str(e)
    s2.remove()
    s3 = BucketScheduler(other, compression=comp)  # free again after remove()
    step(s3, other)
    s3.remove()

    # a scheduler lost without remove() (built in a function that raised): its hooks keep
    # it and its claim alive, so before the fiftieth session nothing could free the model
    def build_and_fail() -> None:
        BucketScheduler(lin, compression=OneBit())
        raise KeyError("the rest of the set-up")

    try:
        build_and_fail()
    except KeyError:
        pass
    try:
        BucketScheduler(lin)
        out["lost"] = "no error"
    except ValueError as e:
        out["lost"] = str(e)
    lost = overlap.holder_of(lin)
    out["found"] = [type(lost).__name__, overlap.holder_of(lin.weight) is lost]
    lost.remove()
    s4 = BucketScheduler(lin)
    out["freed"] = [overlap.holder_of(lin) is s4]
    step(s4, lin)
    s4.remove()
    out["freed"].append(overlap.holder_of(lin) is None)
    opt = overlap.OneBitAdam(lin.parameters())
    s5 = BucketScheduler(lin, optimizer=opt)
    out["freed"].append(overlap.holder_of(opt) is s5)
    s5.remove()
    out["freed"].append(overlap.holder_of(opt) is None and overlap.holder_of(comp) is None)
    step_model = nn.Linear(4, 3)
    s = BucketScheduler(step_model)  # warm everything up once
    step(s, step_model)
    s.remove()
    before = _os_resources()
    for _ in range(cycles):
        s = BucketScheduler(step_model)
        step(s, step_model)
        s.remove()
    out["before"], out["after"] = before, _os_resources()
    return out


def checkpoint_refusals() -> dict[str, Any]:
    """(11) a sub-group OneBit state restores; a refused scheduler load changes nothing; a
    per-tensor state does not load into per_tensor_scales=False."""
    from torch import nn

    from overlap import BucketScheduler, OneBit, PowerSGD

    out: dict[str, Any] = {}
    r = comm.get_rank()
    sub = comm.new_group([0, 1])
    if r in (0, 1):
        ob = OneBit()
        ob.reduce("k", torch.arange(10.0) * (r + 1), group=sub)
        again = OneBit()
        again.load_state_dict(ob.state_dict())  # saved on the 2-rank sub-group of 3
        x = torch.arange(10.0)
        again.reduce("k", x, group=sub)
        out["subgroup"] = "ok"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    s = BucketScheduler(m, compression=OneBit(), bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    m(torch.ones(2, 4)).sum().backward()
    s.synchronize()
    before = s.state_dict()
    bad = dict(before)
    bad["compression"] = PowerSGD().state_dict()
    bad["layout"] = list(reversed(before["layout"]))
    bad["step"] = 99
    try:
        s.load_state_dict(bad)
        out["atomic"] = "no error"
    except ValueError as e:
        out["atomic"] = str(e)
    after = s.state_dict()
    out["unchanged"] = after["layout"] == before["layout"] and after["step"] == before["step"]
    s.remove()
    try:
        OneBit(per_tensor_scales=False).load_state_dict(before["compression"])
        out["per_tensor"] = "no error"
    except ValueError as e:
        out["per_tensor"] = str(e)
    return out


def call_errors() -> dict[str, str]:
    """(13, 19, 20) errors that name the call and its fix, raised on every rank before
    anything is sent; the group is still in step afterwards."""
    from torch import nn

    from overlap import BucketScheduler

    out: dict[str, str] = {}

    catch = catcher(out)

    r = comm.get_rank()
    catch("int16", lambda: comm.all_reduce(torch.ones(2, dtype=torch.int16)))
    # (gloo moves these dtypes' bytes in the ops that only move data: any_dtype_moves)
    if hasattr(torch, "uint32"):  # torch 2.3 and later
        catch("uint32_reduce", lambda: comm.reduce(torch.ones(2, dtype=torch.uint32), dst=0))
    catch("float8", lambda: comm.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn)))
    catch(
        "scalar_gather",
        lambda: comm.all_gather_into_tensor(torch.zeros(2), torch.tensor(1.0)),
    )
    catch("scalar_scatter", lambda: comm.reduce_scatter(torch.tensor(0.0), torch.arange(2.0)))
    catch("empty_group", lambda: comm.new_group([]))
    catch("string_group", lambda: comm.new_group("01"))  # before: ranks [0, 1]
    catch("float_group", lambda: comm.new_group([0.0, 1.0]))
    # before: the backend used the generator up, and the twin got no ranks ("empty")
    gen = comm.new_group(r for r in (0, 1))
    ones = torch.ones(1)
    comm.all_reduce(ones, group=gen)
    out["generator_group"] = ones.item()
    comm.destroy_process_group(gen)
    catch("reserved_tag", lambda: comm.isend(torch.ones(1), dst=1 - r, tag=20000))
    catch("payload_tag", lambda: comm.irecv(torch.ones(1), src=1 - r, tag=2**30))
    catch("negative_tag", lambda: comm.recv(torch.ones(1), src=1 - r, tag=-1))
    bf16 = nn.Linear(2, 2).to(torch.bfloat16)
    catch(
        "view_and_reduce_dtype",
        lambda: BucketScheduler(bf16, reduce_dtype=torch.float32, gradient_as_bucket_view=True),
    )
    t = torch.ones(3)
    comm.all_reduce(t)  # still in step
    out["after"] = str(t.tolist())
    # the ring still works with its reserved tags, and a user tag just below them too
    x = torch.full((5,), float(r + 1))
    comm.all_reduce(x, algorithm="ring")
    h = comm.isend(torch.full((1,), 7.0), dst=1 - r, tag=19999)
    y = torch.zeros(1)
    comm.irecv(y, src=1 - r, tag=19999).wait(timeout=30)
    h.wait(timeout=30)
    out["ring"] = str(x.tolist())
    out["user_tag"] = str(y.tolist())
    return out


def _eventually(check: Any, what: str, timeout: float = 20.0) -> None:
    assert until(check, timeout, every=0.005), f"{what}: not done after {timeout} s"


def multiphase_progress_without_waiter() -> dict[str, Any]:
    """(2) compressed_allreduce, Compressor.reduce and ring/naive allreduce finish with no
    one waiting: dropped, polled with done(), with only a callback, or with their awaiter's
    loop gone; the peer never hangs, and the caller's own ops on the group stay in step."""
    import threading

    from overlap.compression import OneBit, compressed_allreduce, padded_numel

    r, w = comm.get_rank(), comm.get_world_size()
    n = 48  # a multiple of 8 W for W = 2, 3: no padding, so constant inputs reduce exactly
    P = padded_numel(n, w)
    want = sum(range(1, w + 1)) / w
    out: dict[str, Any] = {}

    def fresh() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.full((n,), float(r + 1)), torch.zeros(P), torch.zeros(P // w)

    # dropped
    x, we, se = fresh()
    compressed_allreduce(x, we, se, async_op=True)
    _eventually(lambda: bool((x == want).all()), "dropped compressed_allreduce")
    # polled with done() while the caller issues its own op on the same group
    x, we, se = fresh()
    h = compressed_allreduce(x, we, se, async_op=True)
    mine = torch.ones(3)
    comm.all_reduce(mine)  # interleaves with the handle's phases on every rank differently
    _eventually(h.done, "polled compressed_allreduce")
    out["polled"] = bool((x == want).all()) and mine.tolist() == [float(w)] * 3
    # only a callback
    x, we, se = fresh()
    fired = threading.Event()
    compressed_allreduce(x, we, se, async_op=True).add_done_callback(lambda _: fired.set())
    out["callback"] = fired.wait(20) and bool((x == want).all())
    # the awaiter's loop closes before the op is done (the peer starts late)
    x, we, se = fresh()

    async def impatient() -> None:
        if r == w - 1:
            time.sleep(0.5)
        h = compressed_allreduce(x, we, se, async_op=True)
        try:
            await asyncio.wait_for(h, 0.01)
        except (asyncio.TimeoutError, TimeoutError):
            pass

    overlap.run(impatient())
    _eventually(lambda: bool((x == want).all()), "compressed_allreduce after its loop closed")
    # Compressor.reduce and the p2p algorithms, dropped
    flat = torch.full((n,), float(r + 1))
    OneBit().reduce("k", flat, async_op=True)
    _eventually(lambda: bool((flat == want).all()), "dropped OneBit.reduce")
    total = float(sum(range(1, w + 1)))
    for algorithm in ("ring", "naive"):
        t = torch.full((5,), float(r + 1))
        comm.all_reduce(t, algorithm=algorithm, async_op=True)
        _eventually(lambda t=t: bool((t == total).all()), f"dropped {algorithm} all_reduce")
    t = torch.ones(2)
    comm.all_reduce(t)  # still in step
    out["after"] = t.tolist()
    return out


def background_jobs_keep_their_order() -> list[Any]:
    """Async 1-bit reductions on one group, background and not alternating, all in flight
    at once, then waited in reverse: each holds its own average (the twin's FIFO order is
    kept across the background thread), each background one ran at nice 19, and the
    calling thread's priority is untouched. Returns [the averages' first elements, the
    background jobs' nices, the caller's nice]."""
    from overlap.compression import NoCompression

    r, w = comm.get_rank(), comm.get_world_size()
    comp = NoCompression()
    nices: list[int] = []

    def note() -> None:
        nices.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    ts = [torch.full((1000,), float(r + 10 * i)) for i in range(4)]
    hs = [
        comp.reduce(i, t, async_op=True, background=i % 2 == 0, ready=note if i % 2 == 0 else None)
        for i, t in enumerate(ts)
    ]
    got = [h.wait()[0].item() for h in reversed(hs)][::-1]
    want = [(sum(range(w)) + 10 * i * w) / w for i in range(4)]
    assert got == want, (got, want)
    return [got, nices, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())]


def async_multiphase_failure_on_one_rank(timeout: float, background: bool = False) -> list[str]:
    """A bad argument (alike on every rank), then three async Compressor.reduce calls on
    a group of its own, the first failing on rank 0 only; each must raise, none may return
    a result (before, the later two returned averages of the wrong calls' tensors).
    ``background``: the calls run as background jobs (overlap.comm.driver), the same way."""
    from overlap.errors import OutOfStepError
    from tests.gloo.scheduler_cases import FailsOnOneRank

    r = comm.get_rank()
    group = comm.new_group([0, 1])
    # a direct call is a step of its own: calls 0, 1, 2 (the bad one raises before it counts)
    comp = FailsOnOneRank(rank=0, step=0, key=0, where="start")
    out: list[str] = []
    try:
        comp.reduce("bad", torch.ones(4, 2).t(), group=group, async_op=True)
    except ValueError as e:
        assert "not contiguous" in str(e), e
        out.append("ValueError")
    for i in range(3):
        t = torch.full((4,), float(r + 1 + 10 * i))
        t0 = time.monotonic()
        try:
            comp.reduce(i, t, group=group, async_op=True, background=background).wait()
            out.append(f"ok {t[0].item()}")
        except OutOfStepError:
            out.append("OutOfStepError")
        except overlap.CommError:
            out.append("CommError")
        except RuntimeError as e:
            assert str(e) == "a local failure in bucket 0", e
            out.append("RuntimeError")
        assert time.monotonic() - t0 < timeout + 5, (out, time.monotonic() - t0)
    comm.destroy_process_group(group)
    # The job's own group is untouched. Rank 0 gets here a timeout ahead of rank 1 (which
    # waited that long for it): meet first, so that the check does not time out.
    realign()
    x = torch.ones(1)
    comm.all_reduce(x)
    assert x.item() == 2
    return out


def aliased_buffers() -> dict[str, bool]:
    """Collectives whose input shares memory with their output, as torch allows (ZeRO's
    in-place all_gather into the flat buffer it is a view of): each result must equal the
    same op on separate buffers, on every rank. Before, gloo returned a wrong
    all_to_all_single (partial overlap), a wrong list reduce_scatter (output = an
    input) and a wrong scatter (the source's output one of its other parts), and MPI
    raised "Invalid buffer pointer" on some ranks and hung the others."""
    r, w = comm.get_rank(), comm.get_world_size()
    n = 3
    out: dict[str, bool] = {}

    def rows(base: float) -> torch.Tensor:
        return torch.arange(float(w * n)) + base + 100 * r

    # all_gather_into_tensor with the input at this rank's slot, and at another rank's
    flat = torch.zeros(w * n)
    flat[r * n : (r + 1) * n] = r + 1.0
    comm.all_gather_into_tensor(flat, flat[r * n : (r + 1) * n])
    want = torch.arange(1.0, w + 1).repeat_interleave(n)
    out["all_gather_in_place"] = bool(torch.equal(flat, want))
    other = (r + 1) % w
    flat = torch.zeros(w * n)
    flat[other * n : (other + 1) * n] = r + 1.0
    comm.all_gather_into_tensor(flat, flat[other * n : (other + 1) * n].clone())
    ref = flat.clone()
    flat = torch.zeros(w * n)
    flat[other * n : (other + 1) * n] = r + 1.0
    comm.all_gather_into_tensor(flat, flat[other * n : (other + 1) * n])
    out["all_gather_other_slot"] = bool(torch.equal(flat, ref))
    # reduce_scatter with the output at this rank's slot of the flat input
    inp = rows(0)
    want = sum(torch.arange(float(w * n)) + 100 * q for q in range(w))[r * n : (r + 1) * n]
    comm.reduce_scatter_tensor(inp[r * n : (r + 1) * n], inp)
    out["reduce_scatter_in_place"] = bool(torch.equal(inp[r * n : (r + 1) * n], want))
    # list reduce_scatter whose output is one of the inputs
    ins = [torch.full((n,), 10.0 * r + j) for j in range(w)]
    want = torch.full((n,), float(sum(10 * q + r for q in range(w))))
    comm.reduce_scatter(ins[(r + 1) % w], ins)
    out["reduce_scatter_list_alias"] = bool(torch.equal(ins[(r + 1) % w], want))
    # all_to_all_single in place, and with the output one element past the input
    want = torch.cat([torch.arange(float(n)) + r * n + 100 * q for q in range(w)])
    t = rows(0)
    comm.all_to_all_single(t, t)
    out["all_to_all_in_place"] = bool(torch.equal(t, want))
    t = torch.cat([rows(0), torch.zeros(1)])
    comm.all_to_all_single(t[1:], t[:-1])
    out["all_to_all_overlap"] = bool(torch.equal(t[1:], want))
    # list all_to_all, outputs the inputs in another order
    ins = [torch.full((n,), 10.0 * r + j) for j in range(w)]
    outs = ins[1:] + ins[:1]
    comm.all_to_all(outs, ins)
    out["all_to_all_list_alias"] = all(
        torch.equal(o, torch.full((n,), 10.0 * q + r)) for q, o in enumerate(outs)
    )
    # scatter whose source receives into the part it sends to the next rank (a race on
    # gloo: wrong about half the time before, so 20 tries)
    ok = True
    for _ in range(20):
        parts = [torch.full((n,), q + 1.0) for q in range(w)] if r == 0 else None
        t = parts[1] if parts is not None else torch.zeros(n)
        comm.scatter(t, parts, src=0)
        ok = ok and bool(torch.equal(t, torch.full((n,), 1.0 if r == 0 else r + 1.0)))
    out["scatter_into_a_part"] = ok
    t = torch.ones(2)
    comm.all_reduce(t)  # still in step
    out["after"] = t.tolist() == [float(w)] * 2
    return out


def object_collectives_fail_on_every_rank() -> dict[str, str]:
    """all_gather_object / broadcast_object_list with bad input on rank 0 only: before,
    rank 0 raised before the first exchange and every other rank waited in it until the
    job timeout (and rank 0's next collective paired with it). Now every rank raises, and
    the group stays in step. Returns each case's ``error class: message`` on this rank."""
    import threading

    r, w = comm.get_rank(), comm.get_world_size()
    out: dict[str, str] = {}

    def case(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"

    case(
        "unpicklable", lambda: comm.all_gather_object([None] * w, threading.Lock() if r == 0 else r)
    )
    case("bad_list", lambda: comm.all_gather_object([None] * (w + (r == 0)), r))
    case(
        "broadcast_unpicklable",
        lambda: comm.broadcast_object_list([threading.Lock()] if r == 0 else [None], src=0),
    )
    case("broadcast_not_a_list", lambda: comm.broadcast_object_list("x" if r == 0 else [1], src=0))
    lock = threading.Lock()
    case("gather_unpicklable", lambda: comm.gather_object(lock if r == 0 else r, [None] * w, dst=1))
    case("gather_bad_list", lambda: comm.gather_object(r, [None] * (w + 1), dst=0))
    case(
        "scatter_unpicklable",
        lambda: comm.scatter_object_list([None], [lock] * w if r == 0 else None, src=0),
    )
    case("scatter_not_a_list", lambda: comm.scatter_object_list([None], "xy", src=0))
    # only the receiver's own list is wrong: it alone raises, after the scatter
    case("scatter_bad_output", lambda: comm.scatter_object_list([] if r else [None], [1] * w))
    # send_object_list (rank 0 to 1): an unpicklable object, then a receiving list of the
    # wrong length; the pair is still in step after each
    if r < 2:
        if r == 0:
            case("send_unpicklable", lambda: comm.send_object_list([1, lock], 1))
            case("send_then_short_list", lambda: comm.send_object_list([1, 2], 1))
        else:
            case("send_unpicklable", lambda: comm.recv_object_list([None, None], 0))
            case("send_then_short_list", lambda: comm.recv_object_list([None], 0))
        got_pair: list[Any] = [None]
        if r == 0:
            comm.send_object_list(["after"], 1)
        else:
            comm.recv_object_list(got_pair, 0)
            out["pair_after"] = repr(got_pair)
    # a root outside the group: every rank raises before anything moves
    case("gather_no_such_rank", lambda: comm.gather_object(r, [None] * w, dst=w))
    got = [None] * w
    comm.all_gather_object(got, {"rank": r})
    out["after"] = "ok" if got == [{"rank": q} for q in range(w)] else repr(got)
    return out


def another_ranks_state() -> dict[str, str]:
    """Rank 1 loads rank 0's checkpoint (the ``if rank == 0: torch.save(...)`` habit):
    refused, with nothing changed, where the state holds rank 0's own error feedback
    (a BucketScheduler with OneBit, OneBitAdam, DiLoCo with Int8); accepted where it has
    none (no compression). Each rank's own state loads. ``{case: "ok" | error}``."""
    from torch import nn

    from overlap import BucketScheduler, DiLoCo, Int8, OneBit, OneBitAdam

    r = comm.get_rank()
    out: dict[str, str] = {}

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def ranks_0s(state: Any) -> Any:
        box = [state]
        comm.broadcast_object_list(box, src=0)
        return box[0]

    def load(name: str, obj: Any, state: Any, mark: Any) -> None:
        before = mark()
        try:
            obj.load_state_dict(state)
            out[name] = "ok"
        except ValueError as e:
            out[name] = str(e) if mark() == before else f"changed: {e}"

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r))

    def train(m: nn.Module, steps: int, after: Any) -> None:
        for _ in range(steps):
            m.zero_grad()
            m(x).pow(2).sum().backward()
            after()

    def swap(name: str, obj: Any, mark: Any) -> None:
        """Load rank 0's state (refused on rank 1 where it holds error feedback), then this
        rank's own."""
        mine = obj.state_dict()
        load(name, obj, ranks_0s(mine), mark)
        load(f"{name}_own", obj, mine, mark)

    for name, comp in (("scheduler_onebit", OneBit()), ("scheduler_none", None)):
        m = model()
        s = BucketScheduler(m, compression=comp)
        train(m, 2, s.synchronize)
        swap(name, s, lambda s=s: str(s.state_dict()))
        s.remove()
    m = model()
    opt = OneBitAdam(m.parameters(), lr=1e-2, freeze_step=1)
    train(m, 3, opt.step)
    swap("onebit_adam", opt, lambda: str(opt.state_dict()))
    m = model()
    dl = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=1, compression=Int8())
    train(m, 2, dl.step)
    swap("diloco", dl, lambda: str(dl.state_dict()["step"]))
    dl.remove()
    return out


def split_size_types() -> dict[str, str]:
    """all_to_all_single's split sizes as a list, a tuple, a tensor or a NumPy array (MoE
    code counts tokens in a tensor) all give the same result; before, a tensor reached
    torch, which raised "incompatible function arguments". A negative split is refused
    before anything is sent, and a bad peer type names the fix."""
    import numpy as np

    r, w = comm.get_rank(), comm.get_world_size()
    sends = [[i + j + 1 for j in range(w)] for i in range(w)]  # rank i sends i+j+1 to j
    expects = [sends[i][r] for i in range(w)]
    x = torch.arange(float(sum(sends[r]))) + 100 * r
    want = torch.cat(
        [
            torch.arange(float(sum(sends[i][:r])), float(sum(sends[i][: r + 1]))) + 100 * i
            for i in range(w)
        ]
    )
    out: dict[str, str] = {}
    kinds: list[tuple[str, Any]] = [
        ("list", list), ("tuple", tuple), ("tensor", torch.tensor), ("numpy", np.array)
    ]  # fmt: skip
    for name, kind in kinds:
        o = torch.zeros(sum(expects))
        try:
            comm.all_to_all_single(o, x, kind(expects), kind(sends[r]))
            out[name] = "ok" if torch.equal(o, want) else f"wrong: {o.tolist()}"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    bad = [-1, sends[r][0] + sends[r][1] + 1, *sends[r][2:]]  # the right sum, a -1 in it
    try:
        comm.all_to_all_single(torch.zeros(sum(expects)), x, expects, bad)
        out["negative"] = "no error"
    except ValueError as e:
        out["negative"] = str(e)
    try:
        comm.broadcast(torch.ones(1), src=np.int64(0))
        out["numpy_src"] = "no error"
    except TypeError as e:
        out["numpy_src"] = str(e)
    t = torch.ones(1)
    comm.all_reduce(t)  # still in step
    out["after"] = "ok" if t.item() == w else str(t.item())
    return out


def interrupted_hand_off() -> dict[str, Any]:
    """A KeyboardInterrupt raised between a handle's claim of its Work and the hand-off to
    a waiter thread or the future's callback (injected: ``quiesce.begin``, which runs in
    that window, raises once), for ``h.wait()``, ``h.wait(timeout)`` and ``await h`` of a
    receive and an ``await`` of an all_reduce: the interrupt reaches the caller, and the
    next wait returns the op's result. Before, the claim was kept with nobody observing
    the Work, and the handle stayed pending for good (a SIGINT storm over awaited receives
    did this in about 1 round in 24)."""
    from overlap.comm import quiesce

    r = comm.get_rank()
    out: dict[str, Any] = {}
    modes = ("wait", "wait_timeout", "await", "await_all_reduce")
    begin = quiesce.begin

    def interrupt(handle: Any) -> None:
        quiesce.begin = begin
        raise KeyboardInterrupt

    for mode in modes:
        collective = mode == "await_all_reduce"
        if r != 0:
            if collective:
                comm.all_reduce(torch.ones(2))
            else:
                comm.recv(torch.zeros(1), src=0, tag=8)
                comm.send(torch.full((2,), 3.0), dst=0, tag=7)
            continue
        h = (
            comm.all_reduce(torch.ones(2), async_op=True)
            if collective
            else comm.irecv(torch.zeros(2), src=1, tag=7)
        )
        quiesce.begin = interrupt
        try:
            if mode == "wait":
                h.wait()
            elif mode == "wait_timeout":
                h.wait(timeout=10)
            else:
                overlap.run(_awaited(h))
            out[mode] = "no interrupt"
        except KeyboardInterrupt:
            out[mode] = "KeyboardInterrupt"
        finally:
            quiesce.begin = begin
        if not collective:
            comm.send(torch.ones(1), dst=1, tag=8)  # now rank 1 sends
        try:
            out[f"{mode}_after"] = h.wait(timeout=10).tolist()
        except CommError as e:
            out[f"{mode}_after"] = type(e).__name__
    comm.barrier()
    return out


async def _awaited(h: Any) -> Any:
    return await h


def objects_of_an_ended_job(port: int) -> dict[str, Any]:
    """A scheduler, a DiLoCo and a group made in one job, used after destroy_process_group()
    and a new init_distributed() (a notebook cell run again): each refuses with the fix
    (before: a KeyError from torch's group table, or a hang in a half-made group), a
    DiLoCo's agreed weights can still be swapped in (no collective), and a new scheduler
    over the same model trains. The new job listens on ``port``: reusing the old port
    races with the old store (torch's own re-init does too)."""
    import os

    from torch import nn

    from overlap import BucketScheduler, DiLoCo

    r = comm.get_rank()
    out: dict[str, Any] = {}
    catch = catcher(out)
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    sched = BucketScheduler(m)
    m2 = nn.Linear(4, 2)
    d = DiLoCo(m2, torch.optim.SGD(m2.parameters(), lr=0.1), sync_every=1)
    g = comm.new_group([0, 1])
    comm.barrier()
    overlap.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    overlap.init_distributed("gloo", timeout=30)
    catch("backward", lambda: m(torch.ones(1, 4)).sum().backward())
    catch("synchronize", sched.synchronize)
    catch("diloco_step", d.step)
    with d.global_weights():
        out["global_weights"] = [p.shape for p in m2.parameters()] == [(2, 4), (2,)]
    # nothing in flight: the state is local, and carries over into a DiLoCo of the new job
    state = d.state_dict()
    catch("group", lambda: comm.all_reduce(torch.ones(1), group=g))
    catch("destroy_group", lambda: comm.destroy_process_group(g))
    catch("remove", sched.remove)
    catch("diloco_remove", d.remove)
    d2 = DiLoCo(m2, torch.optim.SGD(m2.parameters(), lr=0.1), sync_every=1)
    d2.load_state_dict(state)
    out["diloco_resumed"] = (
        all(torch.equal(a, b) for a, b in zip(d.globals, d2.globals, strict=True))
        and d2.inner_steps == d.inner_steps
    )
    d2.remove()
    for p in m.parameters():
        p.grad = None
    fresh = BucketScheduler(m)
    m(torch.ones(1, 4) * (r + 1)).sum().backward()  # d/dW = x: 1 on rank 0, 2 on rank 1
    fresh.synchronize()
    out["fresh_grad"] = m.weight.grad.flatten().tolist()
    fresh.remove()
    return out


def _own_torch_job(spec: str, port: int, **kwargs: Any) -> int:
    """Leave the pool's job and start torch.distributed on ``spec`` by hand, on ``port``, as
    a user who initialises torch before overlap does (``kwargs``: init_process_group's);
    this rank's rank."""
    import torch.distributed as dist

    rank, world = comm.get_rank(), comm.get_world_size()
    comm.destroy_process_group()  # the pool's own job
    dist.init_process_group(
        spec, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kwargs
    )
    return rank


def adopts_a_torch_group(spec: str, port: int) -> dict[str, Any]:
    """torch.distributed initialised by the caller with ``spec`` (a plain name or a device
    map), then ``init_distributed()`` adopts it: the backend overlap names, an all_reduce, an
    awaited send/recv pair, and gloo's dtype refusal, which names the fix."""
    rank = _own_torch_job(spec, port)
    comm.init_distributed()
    out: dict[str, Any] = {"backend": comm.get_backend()}
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t)
    out["sum"] = t.tolist()
    peer = 1 - rank
    got = torch.zeros(2)

    async def pair() -> None:
        await comm.collect_all(
            [comm.irecv(got, src=peer), comm.isend(torch.full((2,), float(rank)), dst=peer)]
        )

    run(pair())
    out["received"] = got.tolist()
    try:
        comm.all_reduce(torch.ones(2, dtype=torch.int16))
        out["int16"] = "no error"
    except Exception as exc:
        out["int16"] = f"{type(exc).__name__}: {exc}"
    return out


def adopted_job_timeout(mode: str, port: int) -> tuple[str, float, str]:
    """An adopted torch job's timeout. "explicit": torch's job has 60 s and
    ``init_distributed(timeout=3)`` asks for 3, which was ignored; "inherited": torch's job
    has 3 s, and a group overlap makes inherits it (it got torch's 30-minute default). Rank
    1 comes 8 s late to an all_reduce: rank 0's fails within about 3 s. Also: asking for
    another backend than the adopted job's is refused."""
    import datetime

    secs = 60 if mode == "explicit" else 3
    _own_torch_job("gloo", port, timeout=datetime.timedelta(seconds=secs))
    try:
        comm.init_distributed("mpi")
        other = "no error"
    except ValueError as exc:
        other = str(exc)
    if mode == "explicit":
        comm.init_distributed(timeout=3)
        g = None
    else:
        comm.init_distributed()
        g = comm.new_group([0, 1])
    kind, seconds = _late_peer_all_reduce(g)
    return kind, seconds, other


def torch_group_of_another_backend() -> dict[str, Any]:
    """A group made with torch's own ``dist.new_group(backend=...)`` on another backend than
    the job's, passed to an overlap op. torch's test backend "fake" stands in for the usual
    case (a gloo group in an NCCL job), which needs a GPU: its ops do nothing, so before,
    an all_reduce over it returned the rank's own values as if averaged. A group of the
    job's own backend made the torch way is taken."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend

    r = comm.get_rank()
    out: dict[str, Any] = {}
    fake = dist.new_group([0, 1], backend="fake")
    t = torch.full((2,), float(r + 1))
    try:
        comm.all_reduce(t, group=fake)
        out["fake"] = f"no error: {t.tolist()}"
    except ValueError as exc:
        out["fake"] = str(exc)
    own = dist.new_group([0, 1])  # the job's backend, made the torch way
    comm.all_reduce(t, group=own)
    out["own"] = t.tolist()
    dist.destroy_process_group(fake)  # the pool's ranks go on with other tests
    comm.destroy_process_group(own)
    return out
