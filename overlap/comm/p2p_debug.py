"""Debug mode for point-to-point messages: a header before each message (gloo; MPI: see
:func:`frame`).

gloo reports nothing about a received message's size. A receive into a larger tensor is
filled partly and completes as if nothing were wrong; one into a smaller tensor makes gloo
abort the whole process (``gloo::EnforceNotMet``, measured on torch 2.13). MPI reports the
received count, which overlap's MPI backend checks on every receive; on gloo, debug mode
(``OVERLAP_DEBUG=1``) sends each message as two:

1. a fixed-size header on the user's tag: a magic number, a sequence number, the sender's
   global rank, and the tensor's byte count, element count, dtype and shape;
2. the payload, on a tag of its own in the reserved range 2**30 to 2**31 - 1, picked by the
   sequence number.

The receive posts the header's receive at once (on the user's tag and source, so matching,
any-source receives and ordering are the user's own), and the payload's only once the
header is in, from the rank the header names and on the payload tag it names. The payload
lands in the user's tensor when the dtype and element count agree, or else in a scratch
buffer of the sent size, and the receive fails with
:class:`~overlap.errors.MessageMismatchError`: the receiving tensor is left as it was, and
the message is consumed, so the next message on that tag pairs as it should.

Why a tag per payload, not the user's: two receives from one peer on one tag are both
waiting for their header; their payload receives are posted from the header's completion
callbacks, which may run in either order on the waiter pool's threads. A payload tag named
by the sequence number makes each payload receive take its own payload, whatever the order.
The sequence number is process-wide, so a payload tag repeats only after 2**30 messages;
a repeat matters only if both are in flight between the same two ranks at once.

Shapes may differ (a flat buffer may receive a matrix's elements, as torch allows); dtype
and element count may not. NCCL and CUDA tensors are not framed (NCCL pairs messages by
issue order and ignores tags).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch

from overlap.comm.handle import Handle
from overlap.comm.inflight_writes import snapshot
from overlap.comm.p2p import PAYLOAD_TAGS, describe, dtype_name
from overlap.errors import MessageMismatchError

__all__ = ["FRAME_HEADER_BYTES", "frame", "irecv", "isend", "land_frame"]

_MAGIC = 0x6F766C7064626731  # "ovlpdbg1"
_FIELDS = 16  # int64s: magic, seq, sender, nbytes, numel, ndim, 7 dims, 3 for the dtype's name
_DIMS = 7
_NAME = 24  # bytes of the dtype's name
_seq = itertools.count()
FRAME_HEADER_BYTES = _FIELDS * 8

RawSend = Callable[[torch.Tensor, int], Handle]  # (tensor, tag), to the destination
RawRecv = Callable[[torch.Tensor, "int | None", int], Handle]  # (tensor, src or None, tag)


def _header(t: torch.Tensor, seq: int, sender: int) -> torch.Tensor:
    shape = list(t.shape)[:_DIMS]
    name = dtype_name(t.dtype).encode()[:_NAME].ljust(_NAME, b"\0")
    fields = [_MAGIC, seq, sender, t.numel() * t.element_size(), t.numel(), t.dim()]
    fields += shape + [0] * (_DIMS - len(shape))
    out = torch.empty(_FIELDS, dtype=torch.int64)
    out[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    out[len(fields) :] = torch.frombuffer(bytearray(name), dtype=torch.int64)
    return out


def payload_tag(seq: int) -> int:
    return PAYLOAD_TAGS.start + seq % len(PAYLOAD_TAGS)


def isend(raw: RawSend, tensor: torch.Tensor, tag: int, outer: Handle, me: int) -> Handle:
    """Send the header, then ``tensor``; ``outer`` (the user's Handle) completes when both
    have, with the first error."""
    seq = next(_seq)
    parts = [raw(_header(tensor, seq, me), tag), raw(tensor, payload_tag(seq))]
    lock = threading.Lock()
    left = [len(parts)]
    errors: list[BaseException] = []

    def one(h: Handle) -> None:
        with lock:
            left[0] -= 1
            if h._exc is not None:
                errors.append(h._exc)
            last = left[0] == 0
        if last:
            outer._finish(errors[0] if errors else None)

    for h in parts:
        h.add_done_callback(one)
    return outer


def irecv(
    raw: RawRecv,
    tensor: torch.Tensor,
    src: int | None,
    tag: int,
    outer: Handle,
    me: int,
    sender: list[int] | None = None,
) -> Handle:
    """Receive the header, then the payload it names; see the module docstring.

    ``sender`` gets the sending rank appended once the header is in."""
    head = torch.zeros(_FIELDS, dtype=torch.int64)
    # the payload is posted once the header is in: a write to the tensor before that is
    # checked from here (overlap.comm.inflight_writes)
    written = snapshot("irecv", me, tensor)

    def on_header(h: Handle) -> None:
        if h._exc is not None:
            outer._finish(h._exc)
            return
        try:
            frm, seq, buf, err = _land(head, tensor, tag, me)
            if sender is not None:
                sender.append(frm)
            part = raw(buf, frm, payload_tag(seq))
        except BaseException as exc:  # a header from a rank not in debug mode, or the job went away
            outer._finish(exc)
            return
        part.add_done_callback(lambda p: outer._finish(p._exc or err or written()))

    raw(head, src, tag).add_done_callback(on_header)
    return outer


def _land(
    head: torch.Tensor, tensor: torch.Tensor, tag: int, me: int
) -> tuple[int, int, torch.Tensor, MessageMismatchError | None]:
    """(sender, seq, where the payload lands, the error to raise once it has)."""
    f = head.tolist()
    if f[0] != _MAGIC:
        raise MessageMismatchError(
            f"irecv on rank {me} (tag {tag}) received a message with no debug-mode header: "
            "the sender is not in debug mode. Turn debug mode on on every rank "
            "(OVERLAP_DEBUG=1 or init_distributed(debug=True)) or on none",
            ranks=[me],
        )
    seq, frm, nbytes, numel, ndim = f[1:6]
    name = bytes(head[6 + _DIMS :].numpy().tobytes()).rstrip(b"\0").decode(errors="replace")
    if name == dtype_name(tensor.dtype) and numel == tensor.numel():
        return frm, seq, tensor, None
    dims = f[6 : 6 + min(ndim, _DIMS)]
    sent = f"{name}{dims}" if ndim <= _DIMS else f"{name}[{numel} elements in {ndim} dims]"
    err = MessageMismatchError(
        f"irecv on rank {me} (tag {tag}) got a {sent} message ({nbytes} bytes) from rank "
        f"{frm} for a {describe(tensor)} tensor ({tensor.numel() * tensor.element_size()} "
        "bytes): sender and receiver must use the same dtype and number of elements. The "
        "message was taken off the wire and dropped; the receiving tensor is unchanged",
        ranks=[frm, me],
    )
    return frm, seq, torch.empty(nbytes, dtype=torch.uint8), err


def frame(tensor: torch.Tensor, me: int) -> torch.Tensor:
    """Debug mode's message on MPI: the header and the payload in one byte buffer.

    MPI keeps messages between two ranks on one tag in order, and reports a received
    message's byte count, so on MPI one message carries both (one copy each way, in debug
    mode only) and no payload tags are needed: MPI's largest tag (MPICH: 2**29 - 1) is below
    gloo's payload range, and reserving tags of the user's range was the alternative."""
    nbytes = tensor.numel() * tensor.element_size()
    out = torch.empty(FRAME_HEADER_BYTES + nbytes, dtype=torch.uint8)
    out[:FRAME_HEADER_BYTES] = _header(tensor, next(_seq), me).view(torch.uint8)
    if nbytes:
        out[FRAME_HEADER_BYTES:] = tensor.reshape(-1).view(torch.uint8)
    return out


def land_frame(buf: torch.Tensor, got: int, tensor: torch.Tensor, tag: int, me: int) -> int:
    """Land a received :func:`frame` of ``got`` bytes in ``tensor``; return the sender's
    rank. Raises MessageMismatchError, with ``tensor`` unchanged, for a message of another
    dtype or element count, or one with no header (a sender not in debug mode)."""
    head = buf[:FRAME_HEADER_BYTES].view(torch.int64)
    if got < FRAME_HEADER_BYTES:
        head = torch.zeros(_FIELDS, dtype=torch.int64)  # no header: _land says so
    frm, _, _, err = _land(head, tensor, tag, me)
    if err is not None:
        raise err
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        tensor.reshape(-1).view(torch.uint8).copy_(
            buf[FRAME_HEADER_BYTES : FRAME_HEADER_BYTES + nbytes]
        )
    return frm


def is_framed(tensor: Any) -> bool:
    """Whether a message of ``tensor`` goes framed: gloo tensors (on the CPU) only."""
    return isinstance(tensor, torch.Tensor) and tensor.is_cpu


def new_outer(op: str, tensor: torch.Tensor, group: str, backend: str, world: int) -> Handle:
    return Handle(
        op,
        result=tensor,
        nbytes=tensor.numel() * tensor.element_size(),
        group=group,
        backend=backend,
        world=world,
    )
