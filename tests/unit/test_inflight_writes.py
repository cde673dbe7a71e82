"""overlap.comm.inflight_writes on its own: what its check sees, in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from overlap.comm.inflight_writes import guard, snapshot
from overlap.errors import CommError, InFlightWriteError


def test_a_write_since_the_snapshot_is_named_with_the_op_and_the_tensor() -> None:
    t = torch.ones(2, 3)
    written = snapshot("all_reduce", 4, t)
    assert written() is None
    t[0].zero_()  # through a view: the base's counter moves
    err = written()
    assert isinstance(err, InFlightWriteError) and isinstance(err, CommError)
    assert str(err).startswith("all_reduce on rank 4: its tensor ((2, 3), torch.float32) was")


def test_a_list_names_the_written_tensor_by_position() -> None:
    ts = [torch.ones(1), torch.ones(2)]
    written = snapshot("all_to_all", 0, ts)
    ts[1].add_(1)
    assert "tensor 1 of its list ((2,)" in str(written())


def test_a_view_is_not_watched_and_untouched_tensors_pass() -> None:
    base = torch.ones(8)
    written = snapshot("all_reduce", 0, base[:4])
    base[4:].mul_(2)  # another part of the base: no race, and the view's counter is shared
    assert written() is None
    assert guard("all_reduce", 0, base[:4], None) is None  # nothing to watch: post unchanged


def test_the_guard_checks_before_the_post_runs() -> None:
    t = torch.ones(3)
    ran: list[Any] = []
    post = guard("all_reduce", 1, t, lambda *a: ran.append(a))
    assert post is not None
    post("status")
    assert ran == [("status",)]
    post = guard("all_reduce", 1, t, lambda *a: ran.append(a))
    assert post is not None
    t.div_(2)
    with pytest.raises(InFlightWriteError, match="before writing the tensor"):
        post()
    assert ran == [("status",)]  # the op's own post-processing did not run on a mixed tensor
