"""The parameters a reducer (a BucketScheduler, a DiLoCo) averages, and the frozen ones it
keeps an eye on.

A reducer takes each trainable parameter (``requires_grad``) once (tied ones once) and
skips the frozen ones: they have no gradient to average. A parameter frozen when the
reducer was built therefore has no gradient hook, no place in a bucket and none in a
fragment. Unfrozen later (gradual unfreezing, as fine-tuning recipes do), each rank would
train it on its own gradient and the ranks' weights would drift apart with no error: what
DDP does. :class:`Selection` keeps the frozen ones, so the reducer can check them at each
step (one read of ``requires_grad`` each) and refuse, naming them and the fix.

A lazy module's parameter (``nn.LazyLinear`` before its first forward) has no shape yet:
it is refused here with the fix, instead of torch's error from deep inside the set-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.nn.parameter import UninitializedParameter

__all__ = ["Selection", "select", "unfrozen_message"]


@dataclass
class Selection:
    """``params``: the trainable parameters, each once, in the order given. ``frozen``: the
    frozen ones as (name, parameter)."""

    params: list[torch.nn.Parameter] = field(default_factory=list)
    frozen: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)

    def unfrozen(self) -> list[str]:
        """The names of the parameters that were frozen at selection and now require grad."""
        return [name for name, p in self.frozen if p.requires_grad]


def select(model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter], what: str) -> Selection:
    """Split a module's parameters (or an iterable of them) into trainable and frozen.

    Raises TypeError for an item that is not a tensor and ValueError for a lazy module's
    uninitialised parameter, naming ``what`` (the reducer being built) in the fix."""
    if isinstance(model_or_params, torch.nn.Module):
        named = list(model_or_params.named_parameters())
    else:
        named = [(f"parameter {i}", p) for i, p in enumerate(model_or_params)]
    seen: set[int] = set()
    out = Selection()
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected parameters, got {type(p).__name__}")
        if id(p) in seen:
            continue  # tied: once
        seen.add(id(p))
        if isinstance(p, UninitializedParameter):
            raise ValueError(
                f"{name} is not initialised yet (a lazy module such as nn.LazyLinear has no "
                f"shape before its first forward): run one forward pass, then build the {what}"
            )
        if p.requires_grad:
            out.params.append(p)
        else:
            out.frozen.append((name, p))
    return out


def unfrozen_message(names: list[str], what: str, ranks: list[int] | None = None) -> str:
    """The error for parameters unfrozen after ``what`` was built (``names`` on this rank;
    ``ranks``: the ranks where some were, when this one has none)."""
    if names:
        shown = ", ".join(repr(n) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        which = f"{shown}{more} did not require grad when this {what} was built and now do"
    else:
        which = (
            f"rank{'s' if ranks and len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks or []))} unfroze parameters that did not require grad "
            f"when the {what} was built"
        )
    return (
        f"{which}: the {what} was built without them and does not average them, so each "
        "rank would train them on its own gradient and the ranks' weights would drift apart. "
        f"After changing requires_grad, call remove() and build a new {what} over the model"
    )
