"""Steps handles (overlap.comm.steps) waited on a thread, driven by handles a test finishes."""

from __future__ import annotations

import pytest

from overlap.comm.handle import Handle, HandleState
from overlap.comm.steps import Steps, steps_handle
from overlap.errors import CommTimeoutError


def two_phases(first: Handle, second: Handle) -> Steps:
    yield [first]
    yield [second]
    return "done"


def test_a_wait_that_times_out_resumes_where_it_stopped() -> None:
    first, second = Handle("all_to_all"), Handle("all_gather")
    h = steps_handle("onebit", two_phases(first, second))
    with pytest.raises(CommTimeoutError, match="still in flight"):
        h.wait(timeout=0.05)
    first._finish(None)
    with pytest.raises(CommTimeoutError, match="still in flight"):
        h.wait(timeout=0.05)  # now blocked on the second phase
    assert h.state is HandleState.PENDING
    second._finish(None)
    assert h.wait(timeout=1) == "done"


def test_an_op_that_failed_with_the_job_timeout_fails_the_handle() -> None:
    """MPI's job timeout fails an op with CommTimeoutError; the steps handle must fail with
    it. Before, the error was taken for the wait's own timeout: the handle stayed pending
    for good and every wait() said it "did not complete within None s"."""
    first, second = Handle("all_to_all"), Handle("all_gather")
    h = steps_handle("onebit", two_phases(first, second))
    err = CommTimeoutError("all_to_all on rank 0 did not complete within the job timeout")
    first._finish(err)
    with pytest.raises(CommTimeoutError, match="job timeout") as info:
        h.wait()
    assert info.value is err and h.state is HandleState.FAILED and h.exception() is err
    with pytest.raises(CommTimeoutError, match="job timeout"):
        h.wait(timeout=1)
