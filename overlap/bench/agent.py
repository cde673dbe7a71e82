"""torchrun's agent on the benchmarks' namespace hosts: torch's own launcher, quiet when the
user stops it.

``overlap bench train|ops --hosts N`` starts one torchrun agent on each namespace host in
the terminal's process group, so Ctrl-C reaches every agent as it reaches the CLI. Run as
``python -m torch.distributed.run``, each agent logged three warnings and printed a
35-line traceback of its ``SignalException`` (measured, fifty-seventh session: 75 lines
from two agents above the CLI's one ``overlap: interrupted``). Run as ``python -m
overlap.bench.agent ARGS`` (torchrun's own arguments), the agent is torch's unchanged, but
it exits ``128 + signal`` with no traceback when a signal stops it, and torch elastic's
warnings are left out, as the CLI leaves them out of its own process (``overlap
--verbose`` runs plain torchrun). Its errors (a worker that failed) still print. And it
sets ``OMP_NUM_THREADS=1`` where torchrun would (several processes a host, the variable
unset) before torchrun looks, so that torchrun's five-line banner about it is not printed
on every host.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["main", "quiet_cpp_env", "quiet_torch_distributed"]


def quiet_torch_distributed() -> None:
    """Leave torch.distributed's warnings out of this process's output (its errors stay).

    torch elastic sets each of its loggers' level when its module is imported
    (``LOGLEVEL``, default WARNING), so a level set on ``torch.distributed`` does not reach
    them: the CLI did only that, and a Ctrl-C of ``overlap demo`` still printed the
    launcher's "Received 2 death signal, shutting down workers". So the parent is set,
    for the loggers made later, and each one made so far: call it again after importing
    the launcher (importing it here cost every CLI command 20 ms)."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed."):
            logging.getLogger(name).setLevel(logging.ERROR)


_CPP = "TORCH_CPP_LOG_LEVEL"  # read once, when torch's C++ library loads
_SET_BY_US = "OVERLAP_AGENT_SET_CPP_LOG"


def quiet_cpp_env(env: dict[str, str] | None) -> dict[str, str]:
    """``env`` (default: this process's) for an agent whose C++ warnings are left out:
    ``TORCH_CPP_LOG_LEVEL=ERROR`` unless the caller chose a level, marked so that the
    agent takes it out again before its workers start (they keep torch's default).

    Why: a Ctrl-C during the rendezvous stopped host 0's agent, which serves the store,
    and the other agent printed c10d's "recvValueWithTimeout failed" warning with a
    30-line C++ stack (fifty-seventh session)."""
    out = dict(os.environ if env is None else env)
    if _CPP not in out:
        out[_CPP] = "ERROR"
        out[_SET_BY_US] = "1"
    return out


def main(argv: list[str] | None = None) -> int:
    """Run torchrun on ``argv`` (default: this process's arguments); its exit code, or
    ``128 + signal`` when a signal (Ctrl-C, SIGTERM) stopped it."""
    from overlap.cli import _stopped_by

    args = list(sys.argv[1:] if argv is None else argv)
    if "--nproc-per-node" in args:
        i = args.index("--nproc-per-node") + 1
        if i < len(args) and args[i].isdigit() and int(args[i]) > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.pop(_SET_BY_US, None):  # this process read it already; not the workers
        os.environ.pop(_CPP, None)
    from torch.distributed.run import main as torchrun

    quiet_torch_distributed()
    try:
        torchrun(args)
    except BaseException as exc:
        sig = _stopped_by(exc)
        if sig is None:
            raise
        return 128 + sig
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
