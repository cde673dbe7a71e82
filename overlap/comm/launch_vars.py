"""The integers a launcher leaves in a process's environment, read alike for every launcher
(overlap.comm.slurm, overlap.comm.horovodrun): all of them or none, each a clear error when
it is not an integer, and the rank inside the world size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["launcher_ints"]


def launcher_ints(env: Mapping[str, str], names: Sequence[str], launcher: str) -> list[int] | None:
    """The values of ``names`` in ``env`` as integers, or None unless every one is set.
    ``names`` start with the rank's variable and the world size's. ValueError (naming the
    variable and ``launcher``) for a value that is not an integer or a rank outside the
    world."""
    if not all(n in env for n in names):
        return None
    out = []
    for n in names:
        try:
            out.append(int(env[n]))
        except ValueError:
            raise ValueError(f"{n}={env[n]!r} is not an integer (set by {launcher})") from None
    rank, world = out[0], out[1]
    if not 0 <= rank < world:
        raise ValueError(f"{names[0]}={rank} is outside {names[1]}={world}")
    return out
