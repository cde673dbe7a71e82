"""The parameters a reducer (a BucketScheduler, a DiLoCo) averages, and the frozen ones it
keeps an eye on.

A reducer takes each trainable parameter (``requires_grad``) once (tied ones once) and
skips the frozen ones: they have no gradient to average. A parameter frozen when the
reducer was built therefore has no gradient hook, no place in a bucket and none in a
fragment. Unfrozen later (gradual unfreezing, as fine-tuning recipes do), each rank would
train it on its own gradient and the ranks' weights would drift apart with no error: what
DDP does. :class:`Selection` keeps the frozen ones, so the reducer can check them at each
step (one read of ``requires_grad`` each) and refuse, naming them and the fix.

The same holds for a parameter assigned after the reducer was built: a new one
(``model.head.extra = nn.Parameter(...)``), one put in place of another (``model[2].weight =
nn.Parameter(...)``, ``load_state_dict(..., assign=True)``), or a submodule put in
(``model[2] = nn.Linear(...)``). The reducer holds the parameter objects it was built over,
so the new ones went unaveraged and the ranks drifted apart, silently (found by trying it).
A Selection built over a module watches it through torch's global registration hooks (a
dictionary lookup per registration anywhere in the process, nothing per step) and records
such changes in :attr:`Selection.changed`; the reducers refuse them where they refuse an
unfrozen parameter.

A lazy module's parameter (``nn.LazyLinear`` before its first forward) has no shape yet,
and a parameter on the meta device no data: each is refused here with the fix, instead of
torch's error from deep inside the set-up.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parameter import UninitializedParameter

__all__ = ["Selection", "select", "unfrozen_message"]

log = logging.getLogger(__name__)


@dataclass
class Selection:
    """``params``: the trainable parameters, each once, in the order given. ``frozen``: the
    frozen ones as (name, parameter). ``changed``: what was assigned into the watched module
    since (see the module docstring), in words, for the refusal."""

    params: list[torch.nn.Parameter] = field(default_factory=list)
    frozen: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    # name -> the change in words; a name given back one of ours is dropped (see _note)
    _changes: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> list[str]:
        """What was assigned into the watched module since, and is still there, in words."""
        return list(self._changes.values())

    def unfrozen(self) -> list[str]:
        """The names of the parameters that were frozen at selection and now require grad."""
        return [name for name, p in self.frozen if p.requires_grad]

    def _known(self, p: torch.Tensor) -> bool:
        return any(p is q for q in self.params) or any(p is q for _, q in self.frozen)

    def _note(self, name: str, p: torch.Tensor, what: str) -> None:
        """A parameter assigned at ``name``: one of ours (re-tying, or the original put
        back after a swap) undoes any change recorded at that name, so a model restored to
        what the reducer was built over trains again; frozen, kept an eye on as the frozen
        ones; trainable, recorded as a change (the latest assignment at a name counts)."""
        if self._known(p):
            self._changes.pop(name, None)
            return
        if p.requires_grad:
            self._changes[name] = f"{name!r} was assigned {what}"
        else:
            self._changes.pop(name, None)
            self.frozen.append((name, p))  # type: ignore[arg-type]

    def unwatch(self) -> None:
        """Stop watching the module (the reducer was removed)."""
        with _LOCK:
            for _, entries in _WATCHED.values():
                entries[:] = [e for e in entries if (s := e[0]()) is not None and s is not self]


# id(module) -> (the module, weakly; [(selection, weakly; the module's name prefix in the
# selection's model)]). Keyed by id, not by the module: a module class may define __eq__
# without __hash__, and a lookup must never raise inside the user's own assignment.
_Entry = tuple["weakref.ref[Selection]", str]
_WATCHED: dict[int, tuple[weakref.ref[torch.nn.Module], list[_Entry]]] = {}
_LOCK = threading.RLock()  # a module's weakref callback may run in a GC under it
_HOOKED = False


def _watchers(module: torch.nn.Module) -> list[tuple[Selection, str]]:
    slot = _WATCHED.get(id(module))
    if slot is None or slot[0]() is not module:
        return []
    live = [(e[0](), e[1]) for e in slot[1]]
    return [(sel, prefix) for sel, prefix in live if sel is not None]


def _forget(key: int) -> Any:
    def drop(_: Any) -> None:
        with _LOCK:
            _WATCHED.pop(key, None)

    return drop


def _on_parameter(module: torch.nn.Module, name: str, param: Any) -> None:
    """torch's hook for every parameter registered on any module of the process."""
    if param is None:
        return None
    try:
        for sel, prefix in _watchers(module):
            sel._note(prefix + name, param, "a new Parameter")
    except Exception:  # never break the user's own assignment
        log.exception("overlap could not check the parameter assigned at %r", name)
    return None


def _on_module(module: torch.nn.Module, name: str, sub: Any) -> None:
    """torch's hook for every submodule registered on any module of the process."""
    if not isinstance(sub, torch.nn.Module):
        return None
    try:
        for sel, prefix in _watchers(module):
            for pname, p in sub.named_parameters():
                what = f"a parameter of the new submodule {name!r}"
                sel._note(f"{prefix}{name}.{pname}", p, what)
            _watch(sub, sel, f"{prefix}{name}.")
    except Exception:  # never break the user's own assignment
        log.exception("overlap could not check the submodule assigned at %r", name)
    return None


def _watch(model: torch.nn.Module, sel: Selection, prefix: str = "") -> None:
    global _HOOKED
    mod = torch.nn.modules.module
    if not hasattr(mod, "register_module_parameter_registration_hook"):
        return  # a torch without the global hooks: unfreezing is still checked
    with _LOCK:
        if not _HOOKED:
            mod.register_module_parameter_registration_hook(_on_parameter)
            mod.register_module_module_registration_hook(_on_module)
            _HOOKED = True
        ref = weakref.ref(sel)
        for name, m in model.named_modules():
            slot = _WATCHED.get(id(m))
            if slot is None or slot[0]() is not m:
                slot = _WATCHED[id(m)] = (weakref.ref(m, _forget(id(m))), [])
            slot[1][:] = [e for e in slot[1] if e[0]() is not None]  # reducers gone
            slot[1].append((ref, prefix + (f"{name}." if name else "")))


def select(model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter], what: str) -> Selection:
    """Split a module's parameters (or an iterable of them) into trainable and frozen.

    Raises TypeError for an item that is not a tensor and ValueError for a lazy module's
    uninitialised parameter or one on the meta device, naming ``what`` (the reducer being
    built) in the fix."""
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
        if p.is_meta:
            # before: torch's "Cannot copy out of meta tensor; no data!" from a DiLoCo's set-up
            raise ValueError(
                f"{name} is on the meta device, which holds no data (a model built under "
                "`with torch.device('meta')` or with its initialisation deferred): materialise "
                "it first (model.to_empty(device='cpu'), then initialise or load the weights), "
                f"then build the {what}"
            )
        if p.requires_grad:
            out.params.append(p)
        else:
            out.frozen.append((name, p))
    if isinstance(model_or_params, torch.nn.Module):
        _watch(model_or_params, out)
    return out


def unfrozen_message(
    names: list[str], what: str, ranks: list[int] | None = None, changed: list[str] | None = None
) -> str:
    """The error for parameters unfrozen after ``what`` was built (``names`` on this rank),
    or assigned into the model since (``changed``); ``ranks``: the ranks where some were,
    when this one has none."""
    parts = []
    if names:
        shown = ", ".join(repr(n) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        parts.append(f"{shown}{more} did not require grad when this {what} was built and now do")
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        parts.append(f"{'; '.join(changed[:3])}{more} after this {what} was built")
    if not parts:
        parts.append(
            f"rank{'s' if ranks and len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks or []))} unfroze parameters that did not require grad "
            f"when the {what} was built, or assigned new ones into the model"
        )
    return (
        f"{'; '.join(parts)}: the {what} was built without them and does not average them, "
        "so each rank would train them on its own gradient and the ranks' weights would "
        f"drift apart. After changing requires_grad or the model's parameters, call remove() "
        f"and build a new {what} over the model"
        + (" (or put the parameters it was built over back in their places)" if changed else "")
    )
