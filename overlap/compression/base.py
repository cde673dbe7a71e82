"""The Compressor interface the scheduler uses, and the simple compressors.

A compressor averages one flat buffer across a group, in place, compressed its own way. It
keeps its own state per *bucket key* (error feedback, warm-start matrices, step counters),
and ``state_dict()`` / ``load_state_dict()`` carry that state through a checkpoint so a
resumed run continues bit-identically.

``summable`` tells the transport: ``True`` means the compressed form can be summed by a
plain allreduce (casts, PowerSGD's factors); ``False`` means it needs its own exchange
(OneBit's two-phase gather pattern).

Every compressor implements :meth:`Compressor.reduce_steps`, a steps generator
(:mod:`overlap.comm.steps`); :meth:`Compressor.reduce` runs it blocking or returns
an awaitable Handle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any, ClassVar

import torch

from overlap import comm
from overlap.comm import driver
from overlap.comm.handle import Handle
from overlap.comm.steps import Steps, run

__all__ = ["BF16", "FP16", "Compressor", "NoCompression", "steps_of"]


def steps_of(compressor: Any, steps: Any) -> Steps:
    """``steps`` (what ``compressor.reduce_steps`` returned), checked to be a generator.

    A compressor of a user's own written as a plain function (it reduces and returns the
    tensor, with no ``yield``) hung the BucketScheduler: driven as phases, the returned
    tensor was iterated element by element. Now it is a TypeError with the fix."""
    if not isinstance(steps, Generator):
        name = type(compressor).__name__
        raise TypeError(
            f"{name}.reduce_steps returned {type(steps).__name__}, not a generator: write it "
            "with `yield [handles]` for each phase (the async_op=True handles it needs "
            "finished before it goes on) and `return` the result, as the Compressor "
            "docstring shows; a one-phase body is `yield [comm.all_reduce(flat, op='avg', "
            "group=group, async_op=True)]` then `return flat`"
        )
    if type(compressor).__module__.startswith("overlap."):
        return steps  # overlap's own: their phases are tested, and the wrapper costs a frame
    return _checked_phases(type(compressor).__name__, steps)


def _checked_phases(name: str, steps: Steps) -> Steps:
    """``steps``, each phase checked to be a list (or tuple) of Handles on its way out. A
    user's ``yield h`` (one handle, not a list) or bare ``yield`` hung the scheduler on
    every rank; now it is a TypeError at that phase. Sends and throws go through to
    ``steps`` unchanged, as ``yield from`` would pass them."""
    value: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            phase = steps.send(value) if thrown is None else steps.throw(thrown)
        except StopIteration as stop:
            return stop.value
        thrown = None
        listed = isinstance(phase, (list, tuple))
        if not listed or not all(isinstance(h, Handle) for h in phase):
            steps.close()
            what = (
                "a list holding " + ", ".join(sorted({type(h).__name__ for h in phase}))
                if listed
                else type(phase).__name__
            )
            raise TypeError(
                f"{name}.reduce_steps yielded {what}: each phase yields a list of the Handles "
                "it needs finished (`yield [h]` for one, `yield []` for none), from comm "
                "calls made with async_op=True"
            )
        try:
            value = yield list(phase)
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # a failed handle, thrown in by the driver
            thrown = exc


class Compressor(ABC):
    """Averages a flat buffer across a group, compressed; stateful per bucket key."""

    name: ClassVar[str]
    summable: ClassVar[bool]
    writes_outputs: ClassVar[bool] = False
    reads_outputs: ClassVar[bool] = False
    # True: reduce_steps takes a keyword ``encoded`` and, given True, may resolve to the
    # average still in the compressor's code (Int8's BlockCodes) rather than decoded
    # into ``flat``; see reduce(encoded=)
    encodes_result: bool = False

    @abstractmethod
    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        """Average ``flat`` in place; ``shapes`` are the bucket's tensors, in order, if known.

        ``outputs`` ((offset in flat, tensor) pairs) is only passed to a compressor whose
        ``writes_outputs`` is True: it writes those elements' averages into the tensors
        instead of ``flat`` (whose copy of them is then stale). The scheduler passes the
        gradients, saving the copy back from the bucket.

        A compressor whose ``reads_outputs`` is also True takes a keyword
        ``read_outputs``: when the scheduler (on CPU) passes ``read_outputs=True``, the
        outputs also hold the *input* for their elements and ``flat``'s copy of them is
        stale from the start (the copy into the bucket is saved as well). Such a compressor
        must read the outputs before it writes any of them, and fill ``flat`` from them
        itself on any path that reduces ``flat`` (e.g. an uncompressed warm-up).

        The phases (yields) and collectives must not depend on the values, also when they
        are not finite: raise NonFiniteError only after the last phase. The scheduler
        pipelines buckets by phase count, and under a hierarchical reduction a host's ranks
        reduce different chunks, so a rank that left early would pair its next collectives
        with another bucket's on its peers (overlap.scheduler.hierarchy)."""

    def reduce(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        async_op: bool = False,
        encoded: bool = False,
        ready: Callable[[], None] | None = None,
        background: bool = False,
    ) -> Any:
        """Blocking: returns ``flat``. ``async_op=True``: a Handle resolving to ``flat``, run to
        the end on a driver thread whatever is done with it (:mod:`overlap.comm.driver`).

        ``ready`` (async only): called on the driver thread before the job reads ``flat``,
        blocking until ``flat`` holds its values (DiLoCo fills it on another thread while
        the job waits its turn in the driver's queue). The job keeps its place in the
        queue, taken at this call, so every rank's collectives still pair in call order.
        An error from it fails the job (and stops the twin, as any job error does).

        ``encoded=True`` asks a compressor with ``encodes_result`` for the average in its
        own code, not decoded (:class:`~overlap.compression.quantize.BlockCodes` for Int8):
        a consumer that reads the average once (DiLoCo's landing) then reads a byte per
        element where the decoded float was four, and the decode pass is never made. Its
        ``decode()`` gives ``flat`` as a plain call would have. Other compressors ignore it.

        ``background=True`` (async only) runs the job at the lowest CPU priority, in its
        place in the queue (:mod:`overlap.comm.driver`, "Background jobs"): for a result
        nobody waits for until later, on a host whose cores the training keeps busy.

        A direct call is a step of its own (:meth:`begin_step` runs first)."""
        if async_op:  # bad input raises here, not from the handle (it would stop the twin)
            comm.state.active()._t(flat, "flat")
        self.begin_step()
        kw: dict[str, Any] = {"encoded": True} if encoded and self.encodes_result else {}
        if not async_op:
            steps = self.reduce_steps(key, flat, group=group, shapes=shapes, **kw)
            return run(steps_of(self, steps))

        def job(twin: Any) -> Steps:
            if ready is not None:
                ready()
            return steps_of(self, self.reduce_steps(key, flat, group=twin, shapes=shapes, **kw))

        return driver.submit(
            self.name,
            job,
            group,
            nbytes=self.wire_bytes(flat, group, shapes),
            backend=comm.get_backend(),
            device=flat.device,
            background=background,
        )

    def begin_step(self) -> None:
        """A new training step starts: per-step flags (OneBit's ``last_skipped``) are reset
        here, once, and not by each bucket, so after ``synchronize()`` they describe every
        bucket of the step. The BucketScheduler calls it before the step's first bucket."""
        return None

    def end_step(self) -> None:
        """Every bucket of the step has been reduced without error (the BucketScheduler
        calls it in ``synchronize()`` after the last bucket; on the CPU the buckets are
        copied back into .grad as each is reduced, so before it; on CUDA after it)."""
        return None

    def step_skipped(self) -> bool:
        """True when this step's reduction skipped a non-finite input (``on_nonfinite=
        "skip"``; the same on every rank): the BucketScheduler then leaves NaN in every
        gradient it reduces, so a loss scaler skips the step on every rank alike. A
        compressor with no such mode never skips."""
        return bool(getattr(self, "last_skipped", False))

    def current(self) -> Compressor:
        """The compressor that reduces this step: itself, or the one an :class:`Auto`
        chose (the scheduler asks it, e.g. to take DDP's inline path when it is
        NoCompression)."""
        return self

    def step_end_steps(self, group: Any, device: torch.device) -> Steps | None:
        """Called by the BucketScheduler at the end of each finished step, on its control
        ``group`` (tensors on ``device``): steps (collectives) to run there, or None (the
        default: nothing). :class:`Auto` measures the step and, at a decision, agrees on
        its choice across ranks here."""
        return None

    def statistics(self) -> dict[str, Any]:
        """What this compressor reports in the scheduler's ``statistics()["compression"]``:
        its name (an :class:`Auto` adds its choice and measured costs)."""
        return {"name": self.name}

    def fill(self, param: torch.Tensor, view: torch.Tensor, grad: torch.Tensor) -> bool:
        """Copy ``param``'s gradient into its place in the bucket your own way, in the
        gradient hook (on the autograd thread); return False (the default) to let the
        scheduler copy it. OneBitAdam's reduction forms the momentum right there: one pass
        where a copy and then a momentum pass would be two."""
        return False

    def direct_targets(
        self, key: Hashable, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """Where bucket ``key``'s result goes, if not into the gradients: one tensor per
        parameter of the bucket, in order, each filled with that parameter's part of the
        reduced buffer (passed back to :meth:`reduce_steps` as ``outputs``); the scheduler
        then leaves ``.grad`` as backward made it. None (the default): the gradients.
        OneBitAdam's bucket reduction returns the optimizer's momentum tensors."""
        return None

    def prepare(
        self,
        key: Hashable,
        flat: torch.Tensor,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
    ) -> None:
        """Allocate, and touch, the buffers that calls with ``key`` for a buffer like
        ``flat`` keep, now rather than inside the first calls (a fresh buffer of a few tens
        of MiB costs its page faults once; DiLoCo calls this per fragment when it is built,
        so no training step pays them). Changes no result; the default does nothing."""
        return None

    def wire_bytes(
        self, flat: torch.Tensor, group: Any = None, shapes: Sequence[torch.Size] | None = None
    ) -> int:
        """Bytes this rank sends to reduce ``flat`` (what the Handle reports as ``nbytes``);
        ``shapes``: its tensors, as :meth:`reduce_steps` gets them, for a compressor whose
        bytes depend on how they are laid out (a block quantizer); the others ignore them."""
        return flat.numel() * flat.element_size()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically (tensors are cloned)."""
        return {"name": self.name}

    def reset(self) -> None:
        """Forget all per-bucket state (the scheduler calls this when buckets are rebuilt)."""
        state = getattr(self, "state", None)
        if isinstance(state, dict):
            state.clear()

    def check_state(self, state: dict[str, Any]) -> None:
        """ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing (the
        scheduler checks before it applies anything, so a refused load is atomic)."""
        if state.get("name") != self.name:
            raise ValueError(
                f"this state is for the {state.get('name')!r} compressor, not {self.name!r}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; ValueError if it belongs to another setup."""
        self.check_state(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoCompression(Compressor):
    """A plain averaging allreduce in the buffer's own dtype."""

    name = "none"
    summable = True

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
        return flat


class _Cast(Compressor):
    summable = True
    dtype: ClassVar[torch.dtype]

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        w = comm.get_world_size(group)
        # Divide before summing, as torch's fp16 hook does: W values of the narrow type summed
        # could overflow where their average does not. And divide in the buffer's own dtype,
        # before the cast (the hook casts first): a value above float16's range whose share
        # of the average fits in it (1e5 on one of 2 ranks) was inf, and each value is
        # rounded to the narrow type once instead of twice. The same speed (25M floats: 25-29
        # ms either way); ``flat`` holds the result afterwards anyway.
        low = flat.div_(w).to(self.dtype) if flat.dtype != self.dtype else flat.div_(w)
        yield [comm.all_reduce(low, op="sum", group=group, async_op=True)]
        if low is not flat:
            flat.copy_(low)
        return flat


class FP16(_Cast):
    """Allreduce in float16 (half the bytes of float32), then cast back."""

    name = "fp16"
    dtype = torch.float16


class BF16(_Cast):
    """Allreduce in bfloat16; works on gloo too (PyTorch's bf16 hook refuses there)."""

    name = "bf16"
    dtype = torch.bfloat16
