"""Bad input: the documented exception type and a message that names the fix.

The calls run on 3 real ranks; afterwards an all_reduce proves that no bad call sent
anything or left the group out of step.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from overlap.testing import RankPool
from tests.gloo import bad_input_cases

EXPECTED = {
    "dst_outside": ("ValueError", r"dst=5 is not a rank of group world .*\[0, 1, 2\]"),
    "src_outside": ("ValueError", r"src=-1 is not a rank of group world"),
    "dst_outside_subgroup": ("ValueError", r"dst=2 is not a rank of group ranks0,1"),
    "non_member_group": ("ValueError", r"rank \(2\) is not a member .*\[0, 1\]"),
    "unknown_op": ("ValueError", r"unknown reduction op 'median'; valid ops are 'sum'"),
    "avg_on_ints": ("TypeError", r"op='avg' needs a floating-point tensor"),
    "non_contiguous": ("ValueError", r"not contiguous.*\.contiguous\(\)"),
    "conj_view_broadcast": ("ValueError", r"is a conjugate view .*\.resolve_conj\(\)"),
    "conj_view_isend": ("ValueError", r"is a conjugate view .*\.resolve_conj\(\)"),
    "neg_view_all_reduce": ("ValueError", r"is a negative view .*\.resolve_neg\(\)"),
    "wrong_device": ("ValueError", r"on meta but the gloo backend works on cpu.*\.cpu\(\)"),
    "not_a_tensor": ("TypeError", r"must be a torch.Tensor, got list"),
    "rs_flat_not_divisible": ("ValueError", r"not world_size \(3\) x output \(3\) = 9"),
    "rs_list_wrong_length": ("ValueError", r"has 4 tensors but the group has 3 ranks"),
    "rs_chunk_mismatch": ("ValueError", r"input\[0\] is torch.float32\[3\] but output"),
    "agit_wrong_size": ("ValueError", r"output has 7 elements, expected"),
    "all_gather_shape": ("ValueError", r"tensor_list\[0\] is torch.float32\[3\]"),
    "all_gather_one_tensor_w_times": (
        "ValueError",
        r"tensor_list\[1\] is tensor_list\[0\].*for _ in",
    ),
    "all_to_all_one_tensor_w_times": (
        "ValueError",
        r"output_tensor_list\[1\] is output_tensor_list\[0\]",
    ),
    "all_gather_overlapping_views": (
        "ValueError",
        r"tensor_list\[1\] shares memory with tensor_list\[0\]",
    ),
    "gather_list_one_tensor_w_times": (
        "ValueError",
        r"gather_list\[1\] is gather_list\[0\].*stays in step",
    ),
    "all_gather_coalesced_outputs_shared": (
        "ValueError",
        r"output_tensors\[1\] is output_tensors\[0\]",
    ),
    "a2a_not_divisible": ("ValueError", r"does not divide by world_size \(3\)"),
    "a2a_bad_splits": ("ValueError", r"input_split_sizes \[5, 5, 5\] must have 3 entries"),
    "gather_no_list_on_dst": ("ValueError", r"must pass gather_list.*took part in the gather"),
    "gather_list_wrong_dtype": ("ValueError", r"gather_list\[0\] is torch.int64.*stays in step"),
    "scatter_list_wrong_length": ("ValueError", r"has 4 tensors but the group has 3.*scatter"),
    "batch_two_receives_one_tensor": (
        "ValueError",
        r"receives 0 and 1 of p2p_op_list land in the same memory",
    ),
    "batch_send_of_a_received_tensor": (
        "ValueError",
        r"send 1 of p2p_op_list reads memory that receive 0 of the same batch",
    ),
    "send_to_self": ("ValueError", r"is this rank"),
    "p2p_bad_kind": ("ValueError", r"must be 'isend' or 'irecv'"),
    "new_group_bad_rank": ("ValueError", r"ranks \[8\] are outside the world of 3"),
    "new_group_other_backend": (
        "ValueError",
        r"backend='nccl' differs from this job's backend 'gloo'; overlap runs every",
    ),
    "new_group_ranks_differ": (
        "ValueError",
        r"ranks \[1, 2\] passed other ranks than rank 0 \(this rank passed \[[0-2], [1-2]\]\)",
    ),
    "new_group_bad_rank_on_one_rank": (
        "ValueError",
        r"ranks \[8\] are outside the world of 3 ranks; no group|rank 2 refused the ranks it",
    ),
    "group_rank_outside": ("ValueError", r"group_rank=3 is outside group world"),
}


@pytest.fixture(scope="module")
def results(pools: Callable[[int], RankPool]) -> list[dict[str, tuple[str, str]]]:
    out: list[dict[str, tuple[str, str]]] = pools(3).run(bad_input_cases.bad_calls, timeout=60)
    return out


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input_is_refused_clearly(results: list[dict[str, tuple[str, str]]], case: str) -> None:
    import re

    kind, pattern = EXPECTED[case]
    checked = 0
    for rank, per_rank in enumerate(results):
        got_kind, msg = per_rank[case]
        if got_kind == "skip":
            continue
        assert got_kind == kind, f"rank {rank}: {got_kind}: {msg}"
        assert re.search(pattern, msg), f"rank {rank}: {msg!r} !~ {pattern!r}"
        checked += 1
    assert checked >= 1
