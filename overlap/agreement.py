"""Do the ranks of a group agree? The check a BucketScheduler or DiLoCo runs when built.

Every rank must build the same model with the same settings, or the first collective over
mismatched buffers hangs or returns garbage. A few integers per rank (a signature of the
parameters' shapes and dtypes, one per setting) are all-gathered once at construction, and
the ranks that differ from group rank 0 are named in the refusal, with the settings they
differ in.

Settings matter because they decide which collectives a rank issues: before the
forty-fourth session a BucketScheduler built with OneBit on one rank and none on the other
hung, FP16 against none (or ``reduce_dtype=torch.float16`` against none) ended both
processes from gloo's thread ("Received data size doesn't match"), and ``average=True``
against ``False`` returned the same wrong gradient on both ranks (one rank's half plus the
other's whole), with no error. A DiLoCo with Int8 on one rank and none on the other hung,
and one whose ranks had different outer learning rates moved each rank's global weights
apart, silently.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from overlap import comm

__all__ = [
    "agree_on_load",
    "compare",
    "differing",
    "hyperparameters",
    "optimizer_settings",
    "param_signature",
    "setting_signature",
    "settings_error",
]


def param_signature(params: Sequence[torch.Tensor]) -> int:
    """A checksum of the parameters' shapes and dtypes, in order."""
    return zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())


def setting_signature(value: Any) -> int:
    """One setting as an integer that is equal on two ranks when the setting is. overlap's
    own objects (compressors, OneBitAdam, optimizers' hyperparameters as plain values) by
    their ``repr``, which names their settings; another object by its class, since its
    ``repr`` may hold an address or a rank."""
    cls = type(value)
    own = cls.__module__.startswith("overlap.") or value is None
    plain = isinstance(value, (bool, int, float, str, tuple, torch.dtype))
    text = repr(value) if own or plain else f"{cls.__module__}.{cls.__qualname__}"
    return zlib.crc32(text.encode())


def optimizer_settings(opt: Any) -> tuple[Any, ...] | None:
    """What an optimizer does to the parameters it is given, comparable across ranks: its
    class, its ``repr`` where overlap wrote it (OneBitAdam's names its freeze step), and
    each parameter group's hyperparameters (lr, momentum, betas, ...), not its tensors."""
    if opt is None:
        return None
    cls = type(opt)
    own = repr(opt) if cls.__module__.startswith("overlap.") else ""
    return (f"{cls.__module__}.{cls.__qualname__}", own, hyperparameters(opt))


def hyperparameters(opt: Any) -> tuple[Any, ...]:
    """Each parameter group's hyperparameters (lr, betas, ...), not its tensors, as values
    alike on every rank where the settings are."""
    return tuple(
        tuple(sorted((k, _hyper(v)) for k, v in g.items() if k != "params"))
        for g in getattr(opt, "param_groups", ())
    )


def _hyper(value: Any) -> str:
    """A hyperparameter as text alike on every rank: a tensor (a capturable optimizer's
    ``lr``) by its values, since its ``repr`` names its device, which is each rank's own
    GPU under NCCL; a large one by its shape and dtype."""
    if isinstance(value, torch.Tensor):
        if value.numel() <= 16 and value.device.type != "meta":
            return f"tensor{value.detach().cpu().tolist()!r}"
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    return repr(value)


def differing(
    values: Sequence[int], group: Any, device: torch.device
) -> list[tuple[int, list[int]]]:
    """(global rank, the positions where its ``values`` differ) for each rank of ``group``
    whose values differ from group rank 0's. A collective: every member calls it with as
    many values. ``device``: where the backend reduces (CUDA for NCCL)."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = comm.all_gather(mine, group=group)
    out = []
    for i, t in enumerate(everyone):
        at = (t != everyone[0]).nonzero().flatten().tolist()
        if at:
            out.append((comm.get_global_rank(group, i), at))
    return out


def compare(
    what: str, values: Sequence[int], settings: dict[str, Any], group: Any, device: torch.device
) -> tuple[list[int], ValueError | None]:
    """One all-gather of ``values`` (the model's signature, the schedule: what the caller
    names in its own refusal) and one :func:`setting_signature` per entry of ``settings``.
    Returns the ranks whose ``values`` differ from group rank 0's, and, when only settings
    differ, the refusal naming them (:func:`settings_error`; ``what`` names the object)."""
    found = differing([*values, *map(setting_signature, settings.values())], group, device)
    ranks = [r for r, at in found if min(at) < len(values)]
    if found and not ranks:
        return ranks, settings_error(what, found, list(settings), len(values), group)
    return ranks, None


def settings_error(
    what: str, found: list[tuple[int, list[int]]], names: Sequence[str], first: int, group: Any
) -> ValueError:
    """The refusal for ranks whose settings differ: ``found`` from :func:`differing`, whose
    positions ``first`` and on are the settings ``names``."""
    ranks = [r for r, _ in found]
    which = sorted({names[i - first] for _, at in found for i in at if i >= first})
    return ValueError(
        f"{what} settings differ across ranks: ranks {ranks} passed another "
        f"{', '.join(which)} than rank {comm.get_global_rank(group, 0)}; build it with the "
        "same arguments on every rank (other settings issue other collectives, which hang or "
        "pair wrongly, or apply other updates)"
    )


def agree_on_load(
    what: str,
    check: Callable[[], Sequence[float]],
    names: Sequence[str],
    group: Any,
    device: torch.device,
) -> None:
    """The vote of a ``load_state_dict`` that is a collective (BucketScheduler, DiLoCo,
    OneBitAdam): ``check`` runs this rank's checks of its own state and returns one value
    per entry of ``names`` that must be equal on every rank (``"step"`` first, then e.g. a
    bucket layout's crc32);
    one MAX all-reduce over ``group`` carries each rank's verdict and values. Raises on
    every rank, before anything is loaded: this rank's own error, or a ValueError when
    another rank refused its state or the values differ (states of different saves: a job
    killed while saving leaves some ranks' newest files one save older). Why: each rank
    used to load its own state, and ranks resumed from different saves went on from other
    steps of their schedules, with no error."""
    own: Exception | None = None
    count = len(names)
    values = [0.0] * count
    try:
        got = [float(v) for v in check()]
        if len(got) != count:
            raise RuntimeError(f"{what}: the check gave {len(got)} values, not {count}")
        values = got
    except Exception as exc:  # voted on below, so that no other rank loads alone
        own = exc
    mine = [float(own is not None)] + [x for v in values for x in (v, -v)]
    vote = torch.tensor(mine, dtype=torch.float64, device=device)
    comm.all_reduce(vote, op="max", group=group)
    if own is not None:
        raise own
    got = vote.tolist()
    if got[0]:
        raise ValueError(
            f"{what}: another rank of the group refused its state (its error says why); "
            "nothing was loaded on any rank"
        )
    apart = [i for i in range(count) if got[1 + 2 * i] != -got[2 + 2 * i]]
    if apart:
        why = ", ".join(
            f"steps {-got[2]:.0f} to {got[1]:.0f}" if names[i] == "step" else f"another {names[i]}"
            for i in apart
        )
        raise ValueError(
            f"{what}: the ranks' states are of different saves ({why}): load the states one "
            "save wrote, on every rank (a save that a failure interrupted leaves some ranks' "
            "files older); nothing was loaded"
        )
