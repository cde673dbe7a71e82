"""Rank-side bad-input calls: each returns (exception type name, message) per case."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap import comm


def _catch(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _root_only(r: int, fn: Callable[[], Any]) -> tuple[str, str]:
    """The root's error; on the other ranks the call must simply complete."""
    got = _catch(fn)
    return got if r == 0 or got[0] != "no error" else ("skip", "")


def bad_calls() -> dict[str, tuple[str, str]]:
    r, w = comm.get_rank(), comm.get_world_size()
    t = torch.ones(4)
    sub = comm.new_group([0, 1])  # every rank calls it; rank 2 is not a member
    out = {
        "dst_outside": _catch(lambda: comm.reduce(t, dst=w + 2)),
        "src_outside": _catch(lambda: comm.broadcast(t, src=-1, async_op=True)),
        "dst_outside_subgroup": _catch(lambda: comm.gather(t, None, dst=2, group=sub))
        if r < 2
        else ("skip", ""),
        "non_member_group": _catch(lambda: comm.all_reduce(t, group=sub))
        if r == 2
        else ("skip", ""),
        "unknown_op": _catch(lambda: comm.all_reduce(t, op="median")),
        "avg_on_ints": _catch(lambda: comm.all_reduce(torch.ones(2, dtype=torch.int32), op="avg")),
        "non_contiguous": _catch(lambda: comm.all_reduce(torch.ones(4, 4).t())),
        # lazy views whose memory is not their values: MPI sent a conjugate view's memory
        # (the receiver got the unconjugated numbers) and gloo left a negative view
        # unreduced on every rank, silently, before the forty-eighth session
        "conj_view_broadcast": _catch(
            lambda: comm.broadcast(torch.tensor([1 + 2j, 3 - 1j]).conj(), 0)
        ),
        "conj_view_isend": _catch(
            lambda: comm.isend(torch.tensor([1 + 2j]).conj(), dst=(r + 1) % w)
        ),
        "neg_view_all_reduce": _catch(lambda: comm.all_reduce(torch.tensor([1 + 2j]).conj().imag)),
        "wrong_device": _catch(lambda: comm.all_reduce(torch.ones(4, device="meta"))),
        "not_a_tensor": _catch(lambda: comm.all_reduce([1.0, 2.0])),  # type: ignore[arg-type]
        "rs_flat_not_divisible": _catch(
            lambda: comm.reduce_scatter(torch.empty(3), torch.ones(3 * w + 1))
        ),
        "rs_list_wrong_length": _catch(
            lambda: comm.reduce_scatter(torch.empty(2), [torch.ones(2)] * (w + 1))
        ),
        "rs_chunk_mismatch": _catch(
            lambda: comm.reduce_scatter(torch.empty(2), [torch.ones(3)] * w)
        ),
        "agit_wrong_size": _catch(
            lambda: comm.all_gather_into_tensor(torch.empty(w * 2 + 1), torch.ones(2))
        ),
        "all_gather_shape": _catch(lambda: comm.all_gather([torch.empty(3)] * w, torch.ones(2))),
        # one output tensor w times ([x] * w): every part landed in it, silently, before
        "all_gather_one_tensor_w_times": _catch(
            lambda: comm.all_gather([torch.empty(2)] * w, torch.ones(2))
        ),
        "all_to_all_one_tensor_w_times": _catch(
            lambda: comm.all_to_all([torch.empty(2)] * w, [torch.ones(2) for _ in range(w)])
        ),
        "all_gather_overlapping_views": _catch(
            lambda: comm.all_gather(list(torch.empty(2 * w + 1).unfold(0, 3, 2)), torch.ones(3))
        ),
        "all_gather_coalesced_outputs_shared": _catch(
            lambda: comm.all_gather_coalesced([torch.empty(2 * w)] * 2, [torch.ones(2)] * 2)
        ),
        "a2a_not_divisible": _catch(
            lambda: comm.all_to_all_single(torch.empty(w + 1), torch.ones(w + 1))
        ),
        "a2a_bad_splits": _catch(
            lambda: comm.all_to_all_single(torch.empty(w), torch.ones(w), None, [5] * w)
        ),
        # root-only bad arguments: every rank calls, only the root can see the mistake
        "gather_no_list_on_dst": _root_only(r, lambda: comm.gather(t, None, dst=0)),
        "gather_list_wrong_dtype": _root_only(
            r,
            lambda: comm.gather(
                t, [torch.empty(4, dtype=torch.int64) for _ in range(w)] if r == 0 else None
            ),
        ),
        "gather_list_one_tensor_w_times": _root_only(
            r, lambda: comm.gather(t, [torch.empty(4)] * w if r == 0 else None)
        ),
        "scatter_list_wrong_length": _root_only(
            r,
            lambda: comm.scatter(
                torch.empty(4), [torch.ones(4) for _ in range(w + 1)] if r == 0 else None
            ),
        ),
        "batch_two_receives_one_tensor": _catch(
            lambda: comm.batch_isend_irecv(
                [comm.P2POp("irecv", t, (r + 1) % w), comm.P2POp("irecv", t[1:], (r + 2) % w)]
            )
        ),
        "batch_send_of_a_received_tensor": _catch(
            lambda: comm.batch_isend_irecv(
                [comm.P2POp("irecv", t, (r + 1) % w), comm.P2POp("isend", t, (r + 2) % w)]
            )
        ),
        "send_to_self": _catch(lambda: comm.isend(t, dst=r)),
        "p2p_bad_kind": _catch(lambda: comm.batch_isend_irecv([comm.P2POp("put", t, 0)])),
        "new_group_bad_rank": _catch(lambda: comm.new_group([0, w + 5])),
        "new_group_other_backend": _catch(lambda: comm.new_group([0, 1], backend="nccl")),
        # ranks that pass other lists, or one rank's bad list: before, rank 0 (or the ranks
        # with a good list) waited in the backend's set-up until its timeout
        "new_group_ranks_differ": _catch(lambda: comm.new_group([0, 1] if r == 0 else [1, 2])),
        "new_group_bad_rank_on_one_rank": _catch(
            lambda: comm.new_group([0, w + 5] if r == 2 else [0, 1])
        ),
        "group_rank_outside": _catch(lambda: comm.get_global_rank(None, w)),
    }
    t2 = torch.ones(4)
    comm.all_reduce(t2)  # nothing above sent anything: the group is still in step
    assert t2.tolist() == [float(w)] * 4
    same = comm.new_group(list(range(w)), backend=comm.get_backend())  # the job's own
    comm.all_reduce(t2, group=same)
    assert t2.tolist() == [float(w * w)] * 4
    if comm.get_backend() == "gloo":  # torch's device-map spelling of the job's own backend
        mapped = comm.new_group(list(range(w)), backend="cpu:GLOO")
        comm.all_reduce(t2, group=mapped)
        assert t2.tolist() == [float(w**3)] * 4
    return out
