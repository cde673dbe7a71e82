"""MpiOp is a Handle that sets Handle's fields itself (one call frame less per MPI op):
every field a Handle sets must be set on an MpiOp too, or a later Handle field would be
missing from every MPI op. No MPI needed: the op is completed by hand."""

from __future__ import annotations

from overlap.comm import progress
from overlap.comm.handle import DONE, Handle
from overlap.comm.progress import MpiOp


def _set_fields(h: Handle) -> set[str]:
    out = set()
    for cls in type(h).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name == "__weakref__":
                continue
            try:
                getattr(h, name)
            except AttributeError:
                continue
            out.add(name)
    return out


def test_an_mpi_op_sets_every_field_a_handle_sets() -> None:
    before = progress._open
    op = MpiOp("all_reduce", "result", 8, "world", None, 2, None, None, None, 0)
    try:
        plain = Handle("all_reduce", "result", 8, "world", "mpi", None, world=2)
        assert _set_fields(plain) <= _set_fields(op), _set_fields(plain) - _set_fields(op)
        for name in ("op", "nbytes", "group", "backend", "world", "_result", "_state"):
            assert getattr(op, name) == getattr(plain, name), name
        assert op.end_ns is None and op._keep is None and op._exc is None
    finally:
        op._complete(None)  # no post: finishes it, and closes it in the open-op count
    assert op._state is DONE and op.result() == "result"
    assert progress._open == before
