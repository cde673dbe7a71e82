"""``Auto``: pick the compression that wins on this link and this hardware, by measuring it.

A user rarely knows the network's bandwidth or what a codec costs on their CPU or GPU, and a
wrong pick loses either way: on a fast link every compression is slower than a plain
allreduce; on a 1 Gbit/s link 1-bit is several times faster. So ``BucketScheduler(...,
compression="auto")`` measures instead of guessing:

* **What is measured.** The whole training step, as the scheduler sees it: the time from
  one ``synchronize()`` to the end of the next, on the real buckets. A per-bucket latency
  would miss what matters: a codec's compute competes with backward for the cores, and a
  reduction hidden under backward costs nothing however long it takes.
* **The trial.** Each candidate (default: NoCompression, FP16, OneBit, PowerSGD rank 4)
  runs ``1 + trial_steps`` steps in turn; the first is a settle step (buffers, the bucket
  rebuild) and is not counted; the median of the others (the lower one of an even count,
  so that one stalled step cannot decide) is the candidate's cost.
* **Accuracy policy.** Lossy candidates (anything but NoCompression and the fp16/bf16 casts)
  are tried only from step ``warmup_steps`` on: plain averaging before, as OneBit's own
  warm-up. Once chosen, a choice is kept: a later measuring round (``remeasure()``, or every
  ``remeasure_every`` steps) switches only to a candidate faster by more than ``margin``
  (hysteresis: never back and forth on noise). Candidates not chosen are reset, which frees
  their state (OneBit's error feedback is 2.5 floats per parameter).
* **Every rank agrees.** The schedule is a function of the step count, the same on every
  rank; the costs are reduced with MAX across ranks (a step is as slow as its slowest
  rank) before the choice, which is made at the same step boundary everywhere.
* **Visible.** ``statistics()`` (also in the scheduler's ``statistics()["compression"]``),
  an instant event in the attached trace, and one INFO log line per decision.

The scheduler tells Auto where a step ends through :meth:`Compressor.step_end_steps`; a
direct :meth:`Compressor.reduce` call uses the current choice and never decides.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from overlap import comm
from overlap.argcheck import count
from overlap.comm.steps import Steps
from overlap.compression.base import BF16, FP16, Compressor, NoCompression, steps_of
from overlap.compression.codec import gather_sources, write_outputs
from overlap.compression.nonfinite import check_mode
from overlap.compression.onebit import OneBit
from overlap.compression.powersgd import PowerSGD

__all__ = ["Auto", "default_candidates"]

log = logging.getLogger(__name__)


def default_candidates(on_nonfinite: str = "raise") -> list[Compressor]:
    """NoCompression, FP16, OneBit and rank-4 PowerSGD, each without its own warm-up (Auto
    applies one policy to all); the stateful ones with ``on_nonfinite``."""
    return [
        NoCompression(),
        FP16(),
        OneBit(on_nonfinite=on_nonfinite),
        PowerSGD(rank=4, start_iter=0, on_nonfinite=on_nonfinite),
    ]


def _exact(c: Compressor) -> bool:
    """No state and no more loss than a cast: safe from the first step."""
    return isinstance(c, NoCompression | FP16 | BF16)


class Auto(Compressor):
    """Measure each candidate on the real steps; reduce with the fastest (see the module doc).

    Args:
        candidates: the compressors to choose from (default :func:`default_candidates`),
            tried in this order, exact ones first.
        warmup_steps: lossy candidates are not used before this step.
        trial_steps: measured steps per candidate in a round (after one settle step).
        remeasure_every: start a new measuring round this many steps after a decision
            (default: never; :meth:`remeasure` asks for one).
        margin: a later round switches only to a candidate at least this fraction faster.
        on_nonfinite: given to the default candidates ("raise", or "skip" under a loss
            scaler: :mod:`overlap.compression.nonfinite`); candidates you pass carry their
            own, and this must then be left unset.
    """

    name = "auto"
    summable = False

    def __init__(
        self,
        candidates: Sequence[Compressor] | None = None,
        *,
        warmup_steps: int = 4,
        trial_steps: int = 3,
        remeasure_every: int | None = None,
        margin: float = 0.05,
        on_nonfinite: str | None = None,
    ) -> None:
        if on_nonfinite is not None:
            check_mode(on_nonfinite)
            if candidates is not None:
                raise ValueError(
                    "on_nonfinite applies to Auto's default candidates; with candidates of "
                    "your own, build each with its on_nonfinite (e.g. OneBit(on_nonfinite="
                    "'skip')) and leave Auto's unset"
                )
        cands = list(
            default_candidates(on_nonfinite or "raise") if candidates is None else candidates
        )
        if not cands:
            raise ValueError("Auto needs at least one candidate compressor")
        for c in cands:
            if not isinstance(c, Compressor) or isinstance(c, Auto):
                raise TypeError(
                    f"Auto's candidates are Compressor instances (not Auto), got {type(c).__name__}"
                )
        if len({id(c) for c in cands}) != len(cands):
            raise ValueError("Auto's candidates must be distinct objects (each keeps state)")
        names = [c.name for c in cands]
        if len(set(names)) != len(names):
            raise ValueError(f"Auto's candidates need distinct names, got {names}")
        warmup_steps = count("warmup_steps", warmup_steps, 0)
        trial_steps = count("trial_steps", trial_steps, 1)
        if remeasure_every is not None:
            remeasure_every = count("remeasure_every", remeasure_every, 1)
        round_len = len(cands) * (1 + trial_steps)
        if remeasure_every is not None and remeasure_every <= round_len:
            raise ValueError(
                f"remeasure_every={remeasure_every} would start a round before the last one "
                f"ends ({len(cands)} candidates x {1 + trial_steps} steps = {round_len}); "
                f"pass more than {round_len}, or None"
            )
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin is a fraction in [0, 1), got {margin}")
        # exact ones first: they are safe during the warm-up
        self.candidates = sorted(cands, key=lambda c: not _exact(c))
        self.warmup_steps = warmup_steps
        self.trial_steps = trial_steps
        self.remeasure_every = remeasure_every
        self.margin = margin
        self._plain = next((c for c in self.candidates if _exact(c)), None) or NoCompression()
        self._step = 0  # finished steps
        self._chosen: int | None = None  # index into candidates, once decided
        self._active: Compressor = self.candidates[0]
        self._slot = 0  # the candidate on trial in the current round
        self._slot_steps = 0  # steps it has run in this round
        self._measuring = True
        self._times: list[list[float]] = [[] for _ in self.candidates]
        self._costs: dict[str, float] = {}
        self._decided_at: int | None = None
        self._history: list[tuple[int, str]] = []
        self._last_end: float | None = None
        self._want_round = False
        self._set_active_for_next_step()

    def __repr__(self) -> str:
        names = ", ".join(c.name for c in self.candidates)
        return (
            f"Auto([{names}], warmup_steps={self.warmup_steps}, trial_steps="
            f"{self.trial_steps}, choice={self.choice!r})"
        )

    # ---------------------------------------------------------------- what reduces now
    @property
    def choice(self) -> str | None:
        """The chosen candidate's name (None while the first round runs)."""
        return None if self._chosen is None else self.candidates[self._chosen].name

    def current(self) -> Compressor:
        return self._active

    @property
    def last_skipped(self) -> bool:
        """The active candidate's flag (a stateful one's; False for the others)."""
        return bool(getattr(self._active, "last_skipped", False))

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
        read_outputs: bool = False,
    ) -> Steps:
        c: Any = self._active
        if outputs and c.writes_outputs:
            kw = {"read_outputs": True} if read_outputs and c.reads_outputs else {}
            return (
                yield from steps_of(
                    c,
                    c.reduce_steps(key, flat, group=group, shapes=shapes, outputs=outputs, **kw),
                )
            )
        if read_outputs:  # the outputs hold the input: the active one reads flat
            gather_sources(flat, outputs)
        out = yield from steps_of(c, c.reduce_steps(key, flat, group=group, shapes=shapes))
        write_outputs(flat, outputs)  # outputs were meant for a writer: fill them from flat
        return out

    def fill(self, param: torch.Tensor, view: torch.Tensor, grad: torch.Tensor) -> bool:
        return self._active.fill(param, view, grad)

    def direct_targets(
        self, key: Hashable, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        return self._active.direct_targets(key, params)

    def wire_bytes(
        self, flat: torch.Tensor, group: Any = None, shapes: Sequence[torch.Size] | None = None
    ) -> int:
        return self._active.wire_bytes(flat, group, shapes)

    def begin_step(self) -> None:
        self._active.begin_step()

    def end_step(self) -> None:
        self._active.end_step()

    def reset(self) -> None:
        for c in {id(c): c for c in [*self.candidates, self._plain]}.values():
            c.reset()

    # ----------------------------------------------------------------- the schedule
    def remeasure(self) -> None:
        """Start a measuring round at the next step boundary (every rank must call it at the
        same step, as with any collective decision)."""
        self._want_round = True

    def step_end_steps(self, group: Any, device: torch.device) -> Steps | None:
        now = time.perf_counter()
        interval = None if self._last_end is None else now - self._last_end
        self._last_end = now
        ran = self._active
        self._step += 1
        if not self._measuring:
            due = self.remeasure_every is not None and self._decided_at is not None
            if self._want_round or (due and self._step - self._decided_at >= self.remeasure_every):  # type: ignore[operator]
                self._start_round()
            return None
        cand = self.candidates[self._slot]
        if ran is cand:
            self._slot_steps += 1
            if self._slot_steps > 1 and interval is not None:  # the first one settles
                self._times[self._slot].append(interval)
            if self._slot_steps >= 1 + self.trial_steps:
                self._slot += 1
                self._slot_steps = 0
        if self._slot < len(self.candidates):
            self._set_active_for_next_step()
            return None
        return self._decide(group, device)

    def _start_round(self) -> None:
        self._want_round = False
        self._measuring = True
        self._slot = 0
        self._slot_steps = 0
        self._times = [[] for _ in self.candidates]
        self._set_active_for_next_step()

    def _set_active_for_next_step(self) -> None:
        cand = self.candidates[self._slot]
        if not _exact(cand) and self._step < self.warmup_steps:
            self._active = self._plain  # a lossy one waits for the warm-up
        else:
            self._active = cand

    def _decide(self, group: Any, device: torch.device) -> Steps:
        # the lower median: of an even count (trial_steps=2) the upper one is the larger,
        # so one stalled step (a data-loader hiccup, DDP's bucket rebuild on torch 2.2 in
        # the same loop: 1.2 s) decided the choice; inf: never measured (cannot win)
        med = [sorted(ts)[(len(ts) - 1) // 2] if ts else math.inf for ts in self._times]
        costs = torch.tensor(med, dtype=torch.float64, device=device)
        yield [comm.all_reduce(costs, op="max", group=group, async_op=True)]
        worst = costs.cpu().tolist()
        best = min(range(len(worst)), key=lambda i: (worst[i], i))
        prev = self._chosen
        if prev is not None and best != prev and worst[best] > worst[prev] * (1 - self.margin):
            best = prev  # not enough faster: keep the incumbent (hysteresis)
        self._costs = {
            c.name: round(t * 1e3, 3) for c, t in zip(self.candidates, worst, strict=True)
        }
        self._chosen = best
        self._decided_at = self._step
        self._measuring = False
        chosen = self.candidates[best]
        for c in self.candidates:
            if c is not chosen:
                c.reset()  # free what the losers kept (error feedback, warm starts)
        if prev != best:
            self._history.append((self._step, chosen.name))
        self._active = chosen
        table = ", ".join(f"{n} {ms:.1f}" for n, ms in self._costs.items())
        log.info(
            "auto: reducing with %s from step %d (median step ms, slowest rank: %s)%s",
            chosen.name,
            self._step,
            table,
            "" if prev is None or prev == best else f"; was {self.candidates[prev].name}",
        )
        from overlap.trace.recorder import current

        tracer = current()
        if tracer is not None:
            tracer.instant(f"auto: {chosen.name}", "user", step=self._step, costs_ms=self._costs)
        return None

    def statistics(self) -> dict[str, Any]:
        """The choice, the measured costs (median step ms, MAX over ranks) of the last round,
        the step it was made at, the switches so far and whether a round is running."""
        return {
            "name": self.name,
            "choice": self.choice,
            "active": self._active.name,
            "measuring": self._measuring,
            "costs_ms": dict(self._costs),
            "decided_at": self._decided_at,
            "history": list(self._history),
            "step": self._step,
        }

    # -------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "candidates": [c.name for c in self.candidates],
            "states": [c.state_dict() for c in self.candidates],
            "step": self._step,
            "chosen": self._chosen,
            "measuring": self._measuring,
            "slot": self._slot,
            "slot_steps": self._slot_steps,
            "times": [list(t) for t in self._times],
            "costs": dict(self._costs),
            "decided_at": self._decided_at,
            "history": list(self._history),
        }

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        names = [c.name for c in self.candidates]
        if state.get("candidates") != names:
            raise ValueError(
                f"this Auto state chose among {state.get('candidates')} but this Auto among "
                f"{names}: build Auto with the same candidates"
            )
        for c, s in zip(self.candidates, state["states"], strict=True):
            c.check_state(s)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        for c, s in zip(self.candidates, state["states"], strict=True):
            c.load_state_dict(s)
        self._step = int(state["step"])
        self._chosen = state["chosen"]
        self._measuring = bool(state["measuring"])
        self._slot = int(state["slot"])
        self._slot_steps = int(state["slot_steps"])
        self._times = [list(t) for t in state["times"]]
        self._costs = dict(state["costs"])
        self._decided_at = state["decided_at"]
        self._history = [tuple(h) for h in state["history"]]  # type: ignore[misc]
        self._last_end = None  # the first interval after a resume is not a step's
        if self._measuring:
            self._set_active_for_next_step()
        else:
            assert self._chosen is not None
            self._active = self.candidates[self._chosen]
