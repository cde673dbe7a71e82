"""Buckets: parameters grouped into flat buffers that are reduced as one.

Parameters are assigned in the order given (the scheduler passes reverse registration order
first, then the observed gradient-ready order), one dtype and device per bucket, up to a
byte cap; the first bucket has its own, smaller cap so the first collective starts early in
backward (as DDP's ``first_bucket_mb``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "assign_buckets"]


@dataclass(eq=False)
class Bucket:
    """One bucket: its parameters, their offsets in ``flat``, and per-step state."""

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    pending: set[int] = field(default_factory=set)  # positions of params without a grad yet
    ready: bool = False
    zeroed: set[int] = field(default_factory=set)  # no hook gradient here this step
    direct: set[int] = field(default_factory=set)  # reduced straight into .grad this step
    # not copied into ``flat``: the compressor reads these gradients where they are
    sourced: set[int] = field(default_factory=set)
    # DDP's uncompressed path: positions reduced on their own (in .grad where it allows),
    # and the spans of ``flat`` that hold the others (each a maximal run of them)
    solo: tuple[int, ...] = ()
    rest: tuple[tuple[int, int], ...] = ()
    # each parameter's view of ``flat``, made once: the hooks and the copy back ask for one
    # per parameter and step, and a slice + view_as made on each ask was about 8% of a small
    # model's CPU step (a sampling profile of 6 Linear(64, 64) layers, one bucket each)
    views: list[torch.Tensor] = field(init=False, repr=False)
    # the same slots as ``.grad`` holds them (gradient_as_bucket_view), each through
    # ``.data``: the same memory, a version counter of its own. Views of one tensor share
    # one counter, so the scheduler's writes into ``flat``, and autograd accumulating into
    # a neighbour's .grad, would move every .grad's version; this way a .grad's version
    # moves only when that .grad is written (BucketScheduler._touched)
    grad_views: list[torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.views = [
            self.flat[a : a + p.numel()].view_as(p)
            for p, a in zip(self.params, self.offsets, strict=True)
        ]
        self.grad_views = [v.data for v in self.views]

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    def view_of(self, pos: int) -> torch.Tensor:
        """Parameter ``pos``'s slot of ``flat``, shaped like it (the same object every time)."""
        return self.views[pos]

    def grad_view(self, pos: int) -> torch.Tensor:
        """The slot of :meth:`view_of` as ``.grad`` holds it (gradient_as_bucket_view)."""
        return self.grad_views[pos]

    def plan_solo(self, min_bytes: int) -> None:
        """Choose :attr:`solo` and :attr:`rest`: tensors of at least ``min_bytes`` are
        reduced on their own, each run of the others (consecutive in ``flat``) as one span.
        Static (sizes and offsets only), so every rank issues the same collectives."""
        size = self.flat.element_size()
        solo: list[int] = []
        rest: list[list[int]] = []  # [start, end) spans of the small tensors
        for i in sorted(range(len(self.params)), key=lambda i: self.offsets[i]):
            a, e = self.offsets[i], self.offsets[i] + self.params[i].numel()
            if self.params[i].numel() * size >= min_bytes:
                solo.append(i)
            elif rest and rest[-1][1] == a:  # right after the last small one: same run
                rest[-1][1] = e
            else:  # a solo tensor (or the bucket's start) lies between: a new run
                rest.append([a, e])
        self.solo, self.rest = (tuple(solo), tuple((a, e) for a, e in rest)) if solo else ((), ())

    def reset(self) -> None:
        self.pending = set(range(len(self.params)))
        self.ready = False
        self.zeroed = set()
        self.direct = set()
        self.sourced = set()


def assign_buckets(
    params: Sequence[torch.nn.Parameter],
    cap_bytes: int,
    first_cap_bytes: int,
    reduce_dtype: torch.dtype | None = None,
) -> list[Bucket]:
    """Group ``params`` (in this order) into buckets by (dtype, device), within the caps."""
    groups: list[list[torch.nn.Parameter]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    for p in params:
        key = (p.dtype, p.device)
        cap = first_cap_bytes if not groups else cap_bytes
        size = p.numel() * p.element_size()
        cur = open_.setdefault(key, [])
        if cur and open_bytes.get(key, 0) + size > cap:
            groups.append(cur)
            cur = open_[key] = []
            open_bytes[key] = 0
        cur.append(p)
        open_bytes[key] = open_bytes.get(key, 0) + size
    groups.extend(g for g in open_.values() if g)
    buckets = []
    for i, ps in enumerate(groups):
        offsets, off = [], 0
        for p in ps:
            offsets.append(off)
            off += p.numel()
        dtype = reduce_dtype or ps[0].dtype
        flat = torch.zeros(off, dtype=dtype, device=ps[0].device)
        b = Bucket(i, ps, offsets, flat)
        b.reset()
        buckets.append(b)
    return buckets
