"""Debug mode's single-message frame for MPI (overlap.comm.p2p_debug.frame / land_frame),
without processes: what lands, and what is refused with the tensor unchanged."""

from __future__ import annotations

import pytest
import torch

from overlap import MessageMismatchError
from overlap.comm import p2p_debug


@pytest.mark.parametrize(
    "sent",
    [
        torch.arange(6, dtype=torch.float32).view(2, 3),
        torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.bfloat16),
        torch.tensor(7.0),
        torch.empty(0),
    ],
)
def test_a_frame_lands_in_a_tensor_of_its_dtype_and_element_count(sent: torch.Tensor) -> None:
    buf = p2p_debug.frame(sent, me=3)
    assert buf.dtype == torch.uint8 and buf.numel() == p2p_debug.FRAME_HEADER_BYTES + sent.nbytes
    into = torch.zeros(sent.numel(), dtype=sent.dtype)  # flat: shapes may differ, as in torch
    assert p2p_debug.land_frame(buf, buf.numel(), into, tag=5, me=1) == 3
    assert torch.equal(into, sent.reshape(-1))


@pytest.mark.parametrize(
    ("into", "says"),
    [
        (torch.full((4,), -1, dtype=torch.int32), "for a int32[4] tensor"),
        (torch.full((5,), -1.0), "for a float32[5] tensor"),
    ],
)
def test_a_frame_of_another_dtype_or_count_is_refused_and_the_tensor_kept(
    into: torch.Tensor, says: str
) -> None:
    buf = p2p_debug.frame(torch.arange(4, dtype=torch.float32), me=0)
    before = into.clone()
    with pytest.raises(MessageMismatchError, match=r"^irecv on rank 1 \(tag 5\) ") as e:
        p2p_debug.land_frame(buf, buf.numel(), into, tag=5, me=1)
    assert "got a float32[4] message (16 bytes) from rank 0 " + says in str(e.value)
    assert e.value.ranks == [0, 1]
    assert torch.equal(into, before)


def test_a_message_with_no_header_names_debug_mode() -> None:
    """A sender outside debug mode sends the bare tensor: no header, and maybe fewer bytes
    than one."""
    into = torch.full((2,), -1.0)
    for raw in (torch.ones(2), torch.ones(64)):
        buf = torch.zeros(p2p_debug.FRAME_HEADER_BYTES + 8, dtype=torch.uint8)
        n = min(raw.nbytes, buf.numel())
        buf[:n] = raw.view(torch.uint8)[:n]
        with pytest.raises(MessageMismatchError, match="no debug-mode header"):
            p2p_debug.land_frame(buf, n, into, tag=5, me=1)
        assert into.tolist() == [-1.0, -1.0]
