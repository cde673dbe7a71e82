"""What a stateful compressor does with a non-finite input: ``on_nonfinite``.

A compressor with error feedback (OneBit, Int8, FP8, PowerSGD) must never fold a NaN or an
Inf into its state: one such step would poison every later one (measured: torch's own
``powerSGD_hook`` under ``torch.amp.GradScaler``, one rank overflowing once, halves the scale
at every later step, for ever, since its warm-start matrix holds NaN). Each of them finds a
non-finite input from values every rank shares after a phase (so every rank decides alike,
with no extra collective) and then, by ``on_nonfinite``:

- ``"raise"`` (the default): :class:`~overlap.errors.NonFiniteError` on every rank;
- ``"skip"``: no error; the result is NaN on every rank (an average of a non-finite input
  has no finite value, and NaN is what an uncompressed allreduce would have given some of
  it), ``skipped_steps`` counts the step and ``last_skipped`` says so until the next step
  begins. A loss scaler (``torch.amp.GradScaler``) then finds the NaN, skips the optimizer
  step and lowers its scale on every rank alike, as it does under DDP. Leaving each rank's
  own input in place instead (the first version) let a scaler step on the ranks whose
  input was finite and skip on the others: replicas that differ, silently.

Either way the compressor's state is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from overlap.errors import NonFiniteError

__all__ = ["MODES", "SkipsNonFinite", "check_mode", "nan_result"]

MODES = ("raise", "skip")

# Said by every NonFiniteError a compressor raises: the fix for the common cause.
HINT = (
    "With loss scaling (torch.amp.GradScaler), build the compressor with "
    "on_nonfinite='skip': the step's gradients are then NaN on every rank and the scaler "
    "skips it. Otherwise find the source of the non-finite value"
)


def check_mode(on_nonfinite: object) -> str:
    """``on_nonfinite`` if it is one of :data:`MODES`, else a ValueError naming them."""
    if on_nonfinite not in MODES:
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    return str(on_nonfinite)


def nan_result(
    flat: torch.Tensor, outputs: Sequence[tuple[int, torch.Tensor]] = ()
) -> torch.Tensor:
    """A skipped reduction's result: ``flat`` and its ``outputs`` (the (offset, tensor)
    pairs a compressor writes instead of ``flat``) all NaN. Returns ``flat``."""
    flat.fill_(float("nan"))
    for _, t in outputs:
        t.fill_(float("nan"))
    return flat


class SkipsNonFinite:
    """The ``on_nonfinite`` policy and its counters, shared by the stateful compressors.

    ``last_skipped`` covers every bucket of a step: it is reset only by :meth:`begin_step`,
    which the BucketScheduler calls once before the step's first bucket (and a direct
    ``reduce()`` before its own call)."""

    on_nonfinite: str
    skipped_steps: int
    last_skipped: bool

    def _init_nonfinite(self, on_nonfinite: str) -> None:
        self.on_nonfinite = check_mode(on_nonfinite)
        self.skipped_steps = 0
        self.last_skipped = False

    def _nonfinite(self, exc: NonFiniteError) -> None:
        """Every rank saw a non-finite input: raise ``exc`` or count the step as skipped
        (the caller then leaves NaN as the result)."""
        if self.on_nonfinite == "raise":
            raise NonFiniteError(f"{exc}. {HINT}", ranks=exc.ranks) from None
        self.skipped_steps += 1
        self.last_skipped = True

    def begin_step(self) -> None:
        self.last_skipped = False
