"""What keeps overlap working across the torch releases it supports (torch>=2.2)."""

from __future__ import annotations

import torch

from overlap.comm.torch_backend import issue_failed
from overlap.dtypes import float8_dtypes, present


def test_present_takes_only_the_dtypes_this_torch_has() -> None:
    # torch 2.2 has no uint16/32/64: naming them at import broke `import overlap` there
    assert present("int16", "no_such_dtype", "float32") == [torch.int16, torch.float32]
    assert present("__version__", "manual_seed") == []  # attributes that are not dtypes
    assert all(isinstance(d, torch.dtype) for d in float8_dtypes())
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.float8_e4m3fn in float8_dtypes()


def test_an_op_this_torchs_backend_lacks_names_the_ways_out() -> None:
    # the messages torch 2.2.2's gloo gives for reduce_scatter, all_to_all and an async
    # reduce_scatter_tensor (measured there)
    for said in (
        "ProcessGroupGloo does not support reduce_scatter",
        "Backend gloo does not support alltoall",
        "Gloo reduce_scatter_base fallback not supported with async_op=True",
    ):
        msg = str(issue_failed("reduce_scatter", 1, "world", "gloo", RuntimeError(said)))
        assert msg.startswith(f"reduce_scatter on rank 1 (group world) failed: {said}. "), msg
        assert "gloo backend lacks this op: upgrade torch" in msg, msg
        assert "init_distributed('mpi')" in msg, msg
    other = str(issue_failed("all_reduce", 0, "world", "gloo", RuntimeError("Connection reset")))
    assert other == "all_reduce on rank 0 (group world) failed: Connection reset", other


def test_a_refused_direct_call_goes_through_torchs_wrapper_from_then_on() -> None:
    """overlap calls the process group directly for the tensor collectives; where a torch
    refuses that call as missing (an older release's gloo), the op goes through torch's
    Python wrapper, at once and on every later call; any other error is the op's."""
    import pytest

    from overlap.comm import torch_backend as tb

    calls: list[str] = []

    def refused() -> str:
        calls.append("direct")
        raise RuntimeError("ProcessGroupGloo does not support _allgather_base")

    def wrapper() -> str:
        calls.append("wrapper")
        return "work"

    def broken() -> str:
        raise RuntimeError("Connection closed by peer")

    kind = "test-kind"
    tb.NO_DIRECT.discard(kind)
    try:
        assert tb._direct_first(kind, refused, wrapper) == "work"
        assert tb._direct_first(kind, refused, wrapper) == "work"
        assert calls == ["direct", "wrapper", "wrapper"] and kind in tb.NO_DIRECT
        with pytest.raises(RuntimeError, match="Connection closed"):
            tb._direct_first("other-kind", broken, wrapper)
        assert "other-kind" not in tb.NO_DIRECT
    finally:
        tb.NO_DIRECT.discard(kind)
