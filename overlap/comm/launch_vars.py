"""The integers a launcher leaves in a process's environment, read alike for every launcher
(overlap.comm.slurm, overlap.comm.horovodrun): all of them or none, each a clear error when
it is not an integer, and the rank inside the world size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["launcher_ints", "launcher_local_rank", "master_port"]


def launcher_ints(env: Mapping[str, str], names: Sequence[str], launcher: str) -> list[int] | None:
    """The values of ``names`` in ``env`` as integers, or None unless every one is set.
    ``names`` start with the rank's variable and the world size's. ValueError (naming the
    variable and ``launcher``) for a value that is not an integer or a rank outside the
    world."""
    if not all(n in env for n in names):
        return None
    out = [_integer(env[n], n, launcher) for n in names]
    rank, world = out[0], out[1]
    if not 0 <= rank < world:
        raise ValueError(f"{names[0]}={rank} is outside {names[1]}={world}")
    return out


def launcher_local_rank(env: Mapping[str, str]) -> int:
    """LOCAL_RANK as an integer (0 when unset); a ValueError naming it otherwise."""
    value = _integer(env.get("LOCAL_RANK", "0"), "LOCAL_RANK", "the launcher")
    if value < 0:
        raise ValueError(f"LOCAL_RANK={value} is negative (set by the launcher)")
    return value


def master_port(env: Mapping[str, str], default: int, world: int) -> int:
    """MASTER_PORT as a port number (``default`` when unset), for a job of ``world`` ranks.
    A ValueError naming the variable for a value that is not an integer from 1 to 65535
    (0, any free port, only for one rank: each rank would pick its own): before, int()'s
    "invalid literal" or torch's "port must have value from 0 to 65535", neither naming
    the variable."""
    raw = env.get("MASTER_PORT")
    if raw is None:
        return default
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not (1 if world > 1 else 0) <= port <= 65535:
        raise ValueError(
            f"MASTER_PORT={raw!r} is not a port: set it to a free TCP port from 1 to 65535 "
            "on rank 0's host, the same on every rank (e.g. 29500)"
        )
    return port


def _integer(raw: str, name: str, launcher: str) -> int:
    """``raw``, the value of the variable ``name``, as an integer; a ValueError naming the
    variable and ``launcher`` otherwise."""
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer (set by {launcher})") from None
