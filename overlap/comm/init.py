"""init_distributed: join the job, however it was launched.

Where rank, world size and the master address come from, first match wins:

1. ``torch.distributed`` already initialised by the caller: adopt it (the placement on the
   host from torchrun's, srun's or horovodrun's variables, where they name this rank).
2. The torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK optional).
3. Explicit ``rank``/``world_size`` arguments (with ``init_method`` or MASTER_ADDR/PORT).
4. Under mpiexec (PMI_*, OMPI_COMM_WORLD_*, PMIX_* in the environment) with mpi4py installed:
   discover them from MPI, as DeepSpeed's ``mpi_discovery`` does. Ranks that all run on one
   host use 127.0.0.1 as the master address. (Under ``srun --mpi=pmi2`` without mpi4py, the
   SLURM step's own variables serve when they agree with MPI's.)
5. Started by horovodrun in its gloo mode (HOROVOD_RANK, ...: overlap.comm.horovodrun).
6. Started by SLURM's srun (its step variables: overlap.comm.slurm): rank, world size, local
   rank and node from them, the master the step's first node.
7. Nothing at all: a single rank (world size 1) on a free local port; with a warning naming
   srun when this process runs inside a SLURM allocation of several tasks.

The innermost launcher wins: torchrun, mpiexec or horovodrun started inside an srun step
(or an allocation) see SLURM's variables too, which then describe the outer launch.
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from overlap.comm import debug as _debug
from overlap.comm import driver, horovodrun, slurm, state
from overlap.comm import interruptible as _interruptible
from overlap.comm import quiesce as _quiesce
from overlap.comm import rendezvous as _rendezvous
from overlap.comm.backend_names import adopted_backend
from overlap.comm.constants import TORCH_DISTRIBUTED_DEFAULT_PORT, default_pg_timeout
from overlap.comm.handshake import check_records, record
from overlap.comm.launch_vars import launcher_ints, launcher_local_rank, master_port
from overlap.comm.netif import advertised_address, set_socket_ifname
from overlap.comm.seconds import positive_seconds
from overlap.comm.torch_backend import TorchBackend
from overlap.comm.waiters import fail_in_flight, reset_pool
from overlap.errors import NotInitializedError

__all__ = ["destroy_process_group", "init_distributed", "in_mpi_env", "mpi_discovery"]

log = logging.getLogger(__name__)

_BACKENDS = ("gloo", "nccl", "mpi")
# how long a rank that aborts the MPI job waits first, for its output to be forwarded
ABORT_DRAIN_S = 0.3
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def in_mpi_env() -> bool:
    """True when this process looks like it was started by mpiexec/mpirun."""
    return any(v in os.environ for v in _MPI_RANK_VARS)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def mpi_discovery(
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True
) -> tuple[int, int, int]:
    """Rank, world size and local rank from MPI; sets RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK (the host's index, as torchrun names it), MASTER_ADDR and
    MASTER_PORT (deepspeed.comm's ``mpi_discovery``, which returns None; this one also
    returns the first three numbers).

    Raises ImportError naming ``pip install overlap[mpi]`` when mpi4py is missing.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "this process runs under mpiexec but mpi4py is not installed, so overlap cannot "
            "discover rank and world size: pip install overlap[mpi] (or launch with torchrun)"
        ) from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    procs, (local_rank, local_size, node) = _mpi_placement(MPI)
    if len(set(procs)) == 1:
        addr = "127.0.0.1"
    else:  # several hosts: rank 0's address that the others reach (tests/hosts)
        addr = comm.bcast(advertised_address() if rank == 0 else None)
    port = master_port(os.environ, distributed_port, size)
    _export(rank, size, local_rank, local_size, node, addr, port)
    (log.info if verbose else log.debug)(
        "Discovered MPI settings of world_rank=%d, local_rank=%d, world_size=%d, "
        "master_addr=%s, master_port=%d",
        rank,
        local_rank,
        size,
        addr,
        port,
    )
    return rank, size, local_rank


def _contradiction(given: tuple[int, int], actual: tuple[int, int]) -> tuple[str, int, int] | None:
    """The first of ``rank=`` / ``world_size=`` that was passed (rank >= 0, world_size > 0)
    and differs from ``actual`` (rank, world size): (its name, the value passed, the actual
    one), or None."""
    for name, mine, theirs in zip(("rank", "world_size"), given, actual, strict=True):
        if (mine >= 0 if name == "rank" else mine > 0) and mine != theirs:
            return name, mine, theirs
    return None


def _check_given(given: tuple[int, int], launched: tuple[int, int]) -> None:
    """ValueError when ``rank=`` or ``world_size=`` was passed and contradicts what the
    launcher set (RANK, WORLD_SIZE): one of them is a mistake, and taking either silently
    would put this process in the wrong place of the job (before, the arguments were
    ignored)."""
    found = _contradiction(given, launched)
    if found is not None:
        name, mine, theirs = found
        var = "RANK" if name == "rank" else "WORLD_SIZE"
        raise ValueError(
            f"init_distributed({name}={mine}) but the launcher set {var}={theirs}: leave "
            f"{name} out to take the launcher's, or start this process without it"
        )


def _adopted_placement(rank: int, world: int) -> tuple[int, int | None, int]:
    """(local rank, processes on this host, host index) of a job the caller started
    itself: torchrun's variables when LOCAL_RANK is set, else those of srun or horovodrun
    when they name this very rank of a job of this size (a script that called
    ``init_process_group`` from SLURM's variables, say), else (0, None, 0): one host. Before,
    such a job's every rank said local rank 0 on host 0 of one."""
    if "LOCAL_RANK" in os.environ:
        return (launcher_local_rank(os.environ), *_env_placement())
    for seen in (horovodrun.horovod_placement(), slurm.srun_placement()):
        if seen is not None and (seen.rank, seen.world) == (rank, world):
            return seen.local_rank, seen.local_world, seen.node
    return 0, None, 0


def _export(
    rank: int, world: int, local_rank: int, local_world: int, node: int, addr: str, port: int
) -> None:
    """Put a launcher's placement into torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), which the rest of the job
    reads, whoever started it."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world),
        GROUP_RANK=str(node),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )


def _horovod_discovery(
    hvd: horovodrun.HorovodPlacement, distributed_port: int, verbose: bool
) -> tuple[int, int, int]:
    """Rank, world size and local rank of a horovodrun worker (overlap.comm.horovodrun);
    sets torchrun's variables, keeping a MASTER_PORT already set."""
    if hvd.master is None:
        raise ValueError(
            f"horovodrun started this process as rank {hvd.rank} of {hvd.world} on several "
            "hosts, and overlap cannot join horovodrun's own rendezvous: set MASTER_ADDR to "
            "rank 0's host (MASTER_ADDR=host0 horovodrun ...), or launch with torchrun or "
            "mpiexec (docs/cluster.md)"
        )
    port = master_port(os.environ, distributed_port, hvd.world)
    _export(hvd.rank, hvd.world, hvd.local_rank, hvd.local_world, hvd.node, hvd.master, port)
    (log.info if verbose else log.debug)(
        "init_distributed: started by horovodrun: rank %d of %d, local rank %d of %d, master %s:%d",
        hvd.rank,
        hvd.world,
        hvd.local_rank,
        hvd.local_world,
        hvd.master,
        port,
    )
    return hvd.rank, hvd.world, hvd.local_rank


def _srun_instead_of_mpi(env: Mapping[str, str] | None = None, mpi4py: bool | None = None) -> bool:
    """True under ``srun --mpi=pmi2`` (or pmix) without mpi4py (``mpi4py``: whether it is
    installed; looked up by default), when the SLURM step's variables agree with MPI's rank
    and size: they then describe the ranks themselves, and the job needs no MPI to start.
    Under ``mpiexec`` inside an allocation they describe hydra's proxies (one task per node)
    and disagree, so MPI discovery keeps its error that names mpi4py."""
    env = os.environ if env is None else env
    if mpi4py is None:
        mpi4py = importlib.util.find_spec("mpi4py") is not None
    if mpi4py:
        return False
    try:
        srun = slurm.srun_placement(env)
    except ValueError:
        return False
    rank = env.get("PMI_RANK", env.get("PMIX_RANK", env.get("OMPI_COMM_WORLD_RANK")))
    size = env.get("PMI_SIZE", env.get("OMPI_COMM_WORLD_SIZE"))
    return srun is not None and rank == str(srun.rank) and (size is None or size == str(srun.world))


def _srun_discovery(
    srun: slurm.SrunPlacement, distributed_port: int, verbose: bool
) -> tuple[int, int, int]:
    """Rank, world size and local rank of an srun task; sets torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) as
    :func:`mpi_discovery` does, keeping a MASTER_ADDR or MASTER_PORT already set."""
    env = os.environ
    addr = env.get("MASTER_ADDR") or (srun.nodes[0] if srun.nodes else "")
    if not addr:
        raise ValueError(
            "srun started this process but neither SLURM_STEP_NODELIST nor "
            "SLURM_JOB_NODELIST names the step's nodes: set MASTER_ADDR to task 0's host"
        )
    given = distributed_port if distributed_port != TORCH_DISTRIBUTED_DEFAULT_PORT else None
    port = slurm.srun_port(env, given)
    _export(srun.rank, srun.world, srun.local_rank, srun.local_world, srun.node, addr, port)
    (log.info if verbose else log.debug)(
        "init_distributed: started by srun: rank %d of %d, local rank %d of %d on node %d, "
        "master %s:%d",
        srun.rank,
        srun.world,
        srun.local_rank,
        srun.local_world,
        srun.node,
        addr,
        port,
    )
    return srun.rank, srun.world, srun.local_rank


def _cuda_device(local_rank: int, visible: int) -> int:
    """The CUDA device of the rank with ``local_rank`` when ``visible`` devices are visible
    to it: its local rank, or device 0 when each rank sees one device of its own (``srun
    --gpus-per-task=1``, or a CUDA_VISIBLE_DEVICES per rank), where ``set_device(local_rank)``
    failed with CUDA's "invalid device ordinal" on every rank but the first of a node."""
    if 0 <= local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise ValueError(
        f"local rank {local_rank} but this process sees {visible} CUDA devices: start at most "
        "as many ranks a node as it has GPUs, or give each rank one GPU of its own "
        "(srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank)"
    )


def _env_placement() -> tuple[int | None, int]:
    """(processes on this host, this host's index) from torchrun's LOCAL_WORLD_SIZE and
    GROUP_RANK (or NODE_RANK), or the DeepSpeed launcher's LOCAL_SIZE and CROSS_RANK; (None,
    0) when the launcher set neither: one host. Before the forty-third session the DeepSpeed
    launcher's two were not read, and on several hosts every rank said it was on host 0 of
    one (``get_node_rank()``, ``get_local_world_size()``; ``hierarchy="auto"`` then chose a
    flat reduction)."""
    env = os.environ
    size = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    node = env.get("GROUP_RANK") or env.get("NODE_RANK") or env.get("CROSS_RANK") or "0"
    return (int(size) if size else None), int(node)


def _mpi_placement(MPI: Any) -> tuple[list[str], tuple[int, int, int]]:
    """Every rank's processor name (one allgather on COMM_WORLD; every rank calls it) and
    this rank's :func:`_host_placement`."""
    comm = MPI.COMM_WORLD
    procs: list[str] = comm.allgather(MPI.Get_processor_name())
    return procs, _host_placement(procs, comm.Get_rank())


def _host_placement(procs: list[str], rank: int) -> tuple[int, int, int]:
    """(local rank, processes on this host, host index) from every rank's processor name, in
    rank order; hosts are numbered by their lowest rank."""
    me = procs[rank]
    hosts = list(dict.fromkeys(procs))
    return sum(1 for p in procs[:rank] if p == me), procs.count(me), hosts.index(me)


def _timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None:
        return None
    return datetime.timedelta(seconds=positive_seconds(timeout))


def _adopted_timeout(
    timeout: float | datetime.timedelta | None, name: str
) -> datetime.timedelta | None:
    """The op timeout of an adopted job, which the groups overlap makes in it get.

    A timeout passed to init_distributed is also set on the adopted world group (torch's
    ``_set_pg_timeout``), since the docs promise that it bounds every op on every group: it
    was ignored, and a late peer hung the caller for the adopted group's 30 minutes instead
    of failing within the asked seconds. The default (or None) keeps the world group's own
    timeout, read from it, so new groups get that rather than torch's 30-minute default.
    ``name``: the adopted backend (:func:`adopted_backend`)."""
    world = dist.group.WORLD
    if timeout is not None and timeout is not default_pg_timeout:
        td = _timeout(timeout)
        setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if setter is None:  # torch before 2.3
            log.warning(
                "init_distributed: torch %s cannot change the adopted group's timeout; only "
                "the groups overlap makes get timeout=%s",
                torch.__version__,
                timeout,
            )
        else:
            setter(td, world)
        return td
    try:
        dev = torch.device("cuda" if name == "nccl" else "cpu")
        own: datetime.timedelta = world._get_backend(dev).options._timeout  # type: ignore[union-attr]
        return own
    except Exception:  # a torch without these (private) attributes: torch's default then
        return None


def _pick_backend(dist_backend: str | None) -> str:
    if dist_backend is None:
        if torch.cuda.is_available() and dist.is_nccl_available():
            return "nccl"
        return "gloo"
    name = str(dist_backend).lower()
    if name == "mpi":
        return name
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown dist_backend {dist_backend!r}; use one of {list(_BACKENDS)} or None "
            "(nccl when CUDA is usable, gloo otherwise)"
        )
    if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("dist_backend='nccl' needs CUDA and an NCCL build of torch; use 'gloo'")
    return name


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: float | datetime.timedelta | None = default_pg_timeout,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
    *,
    debug: bool | None = None,
) -> None:
    """Initialise overlap's communication (and torch.distributed) for this process.

    deepspeed.comm's signature, positional order included. ``dist_backend`` is ``"gloo"``,
    ``"nccl"``, ``"mpi"`` or ``None`` (nccl when CUDA is usable, gloo otherwise).
    ``timeout`` (seconds or timedelta; DeepSpeed's default, 30 minutes or DEEPSPEED_TIMEOUT
    minutes) bounds every collective of the job, on every group; on MPI the default means no
    deadline, as MPI has none of its own, and a value given sets one. ``config``: a ds_config
    (dict or DeepSpeed config object) whose ``comms_logger`` section configures the comms
    logger. ``dist_init_required=False`` refuses to initialise: it raises unless the job
    already is. ``verbose=False`` logs the set-up at debug level instead of info.

    ``rank``/``world_size`` that contradict a launcher's RANK/WORLD_SIZE raise ValueError
    (they were ignored). Calling it again is harmless; asking for a different backend while
    one is active raises ValueError (call ``destroy_process_group()`` first).
    ``debug=True`` (or ``OVERLAP_DEBUG=1``) checks every collective's op, shapes and dtypes
    across ranks before issuing it (overlap.comm.debug).

    On gloo and NCCL the ranks check at init that they make one job (the same world size,
    backend and debug mode, each rank number once), on every rank, and refuse with a
    ValueError naming the rank and what differs; a rank that waits for others logs what it
    waits for after 30 s, and torch's rendezvous failures are raised as CommTimeoutError or
    CommError naming the fix (overlap.comm.rendezvous, overlap.comm.handshake).
    """
    if config is not None:
        from overlap.comm.comms_logger import configure

        configure(deepspeed_config=config)
    if dist_init_required is False and not (state.is_active() or dist.is_initialized()):
        raise NotInitializedError(
            "init_distributed(dist_init_required=False) but nothing is initialized: pass "
            "dist_init_required=True (or leave it None), or initialize torch.distributed first"
        )
    info = log.info if verbose else log.debug
    if timeout is default_pg_timeout and str(dist_backend).lower() == "mpi":
        timeout = None  # MPI: no deadline unless one is asked for (module docstring)
    if debug is not None:
        _debug.set_enabled(debug)
    if state.is_active():
        current = state.active().name
        if dist_backend is not None and str(dist_backend).lower() != current:
            raise ValueError(
                f"overlap.comm is already initialized with {current!r}; call "
                "overlap.comm.destroy_process_group() before initializing another backend"
            )
        log.debug("init_distributed: already initialized (%s)", current)
        return

    if dist.is_initialized():
        spec = str(dist.get_backend())
        name = adopted_backend(spec)
        if dist_backend is not None and str(dist_backend).lower() != name:
            raise ValueError(
                f"init_distributed({dist_backend!r}): torch.distributed is already initialised "
                f"with {spec!r}; leave dist_backend out to adopt that job, or call "
                "torch.distributed.destroy_process_group() first"
            )
        td = _adopted_timeout(timeout, name)
        info("init_distributed: adopting the existing torch.distributed group (%s)", spec)
        state.set_active(
            TorchBackend(name, td), *_adopted_placement(dist.get_rank(), dist.get_world_size())
        )
        return

    backend = _pick_backend(dist_backend)
    if backend == "mpi":
        td = _timeout(timeout)
        _init_mpi(None if td is None else td.total_seconds(), rank, world_size)
        return
    env = os.environ
    local = launcher_local_rank(env)
    said = launcher_ints(env, ("RANK", "WORLD_SIZE"), "torchrun or the environment")
    if said is not None:
        given = (rank, world_size)
        rank, world_size = said
        _check_given(given, (rank, world_size))
    elif rank >= 0 and world_size > 0:
        pass
    elif rank >= 0 or world_size > 0:
        raise ValueError(
            f"rank={rank} and world_size={world_size}: pass both (rank >= 0, world_size > 0) "
            "or neither"
        )
    elif auto_mpi_discovery and in_mpi_env() and not _srun_instead_of_mpi():
        rank, world_size, local = mpi_discovery(distributed_port, verbose)
    elif (hvd := horovodrun.horovod_placement()) is not None and hvd.world > 1:
        rank, world_size, local = _horovod_discovery(hvd, distributed_port, verbose)
    elif (srun := slurm.srun_placement()) is not None and srun.world > 1:
        # a step of one task (an interactive `srun --pty bash`) runs as below: a free local
        # port, not the step's derived one, which two such runs on a node would share
        rank, world_size, local = _srun_discovery(srun, distributed_port, verbose)
    else:
        rank, world_size = 0, 1
        tasks = slurm.unlaunched_tasks()
        if tasks is not None:
            log.warning(
                "init_distributed: this process runs in a SLURM allocation of %d tasks but "
                "was not started by srun, so it runs as a single rank; start every rank with "
                "`srun python ...` (or torchrun, or mpiexec)",
                tasks,
            )
        else:
            info("init_distributed: no launcher environment found; running as a single rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if init_method is None:
        master_port(env, distributed_port, world_size)  # before anything waits on it
        if world_size == 1 and "MASTER_PORT" not in env:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        else:
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(distributed_port))
            init_method = "env://"
    if world_size > 1:  # the interface that reaches the master, unless given (netif.py)
        from urllib.parse import urlparse

        master = env.get("MASTER_ADDR") if init_method == "env://" else None
        if init_method.startswith("tcp://"):
            master = urlparse(init_method).hostname
        set_socket_ifname(master)
    if backend == "nccl":
        torch.cuda.set_device(_cuda_device(local, torch.cuda.device_count()))
    td = _timeout(timeout)
    method = init_method

    def start() -> None:
        # torch's rendezvous and overlap's handshake on its store (rendezvous.py: every
        # rank agrees it is one job, and a wrong start is told in words), then the group
        # on that store, as torch's init_method path makes it
        store = _rendezvous.join(
            method, backend, rank, world_size, td or default_pg_timeout, _debug.enabled()
        )
        kwargs: dict[str, Any] = {} if td is None else {"timeout": td}
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, **kwargs
        )

    if backend == "gloo":  # Ctrl-C raises while it waits for ranks that have not come
        _interruptible.rendezvous(start, dist.destroy_process_group)
    else:  # NCCL: not moved to another thread without a GPU to prove it on
        start()
    state.set_active(TorchBackend(backend, td), local, *_env_placement())
    if backend == "gloo":  # destroyed at exit, before the interpreter finalizes (quiesce.py)
        _quiesce.release_at_exit(_destroy_at_exit)
    info("init_distributed: rank %d of %d on %s", rank, world_size, backend)


def _destroy_at_exit() -> None:
    """atexit (after the wait for ops in flight): the job init_distributed made, destroyed
    while threads may still take the GIL (overlap.comm.quiesce.release_at_exit)."""
    if state.is_active():
        destroy_process_group()


def _finalize_mpi() -> None:
    """atexit: MPI_Finalize, unless an op expired. With a dead peer and requests still
    pending, MPICH's MPI_Finalize blocks forever (measured), so a broken job skips it."""
    from mpi4py import MPI

    from overlap.comm.progress import _graveyard, stop_reaper

    stop_reaper()
    if not _graveyard and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def mpi_job_of_several() -> Any:
    """mpi4py's ``MPI`` when this process is a rank of a running MPI job of two or more
    ranks (initialised, not finalised), else None: where aborting the job is what stops its
    peers."""
    import sys

    if "mpi4py.MPI" not in sys.modules:
        return None
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return None
    return MPI


def _abort_if_failed() -> None:
    """atexit, registered after :func:`_finalize_mpi` (so it runs first): when this rank
    exits with an uncaught exception (a bug, Ctrl-C) in a job of several ranks, abort the
    MPI job, as ``python -m mpi4py`` does, instead of finalising.

    Why: with no job timeout (MPI's default), a rank that raised left its peers waiting in
    their next collective for ever, and itself hung in MPI_Finalize, which waits for them:
    measured, under ``mpiexec -n 2`` rank 1 raising a RuntimeError while rank 0 waited in an
    all_reduce hung the job until it was killed (60 s here, for ever otherwise); Ctrl-C to
    mpiexec reached only the rank that was running Python, with the same end. MPI_Abort
    ends every rank of the job, and the launcher reports the failing one. An exception
    left over in an interactive session is not taken for a failure, nor is ``sys.exit``
    (not an uncaught exception)."""
    import sys

    failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if failure is None or sys.flags.interactive or hasattr(sys, "ps1"):
        return
    MPI = mpi_job_of_several()
    if MPI is None:
        return
    log.error(
        "rank %d exits with an uncaught %s: aborting the MPI job (MPI_Abort), so that its "
        "peers stop instead of waiting for it for ever",
        MPI.COMM_WORLD.Get_rank(),
        type(failure).__name__,
    )
    # MPI_Abort makes the launcher kill every process of the job, its output forwarders
    # among them: what this rank wrote and they had not forwarded yet was lost, the
    # traceback that says why included (measured: 3 of 20 Ctrl-C'd jobs under MPICH's
    # mpiexec ended with one line, "Traceback (most recent call last):", and CI's run of
    # tests/mpi/uncaught.py failed so). So the output is flushed and given a moment to leave
    # before the abort: 20 of 20 kept it all.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more can be saved
            pass
    time.sleep(ABORT_DRAIN_S)
    MPI.COMM_WORLD.Abort(1)


def _init_mpi(timeout: float | None = None, rank: int = -1, world_size: int = -1) -> None:
    import atexit
    import sys

    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            # overlap initialises MPI, so it also finalises it (see _finalize_mpi)
            mpi4py.rc.finalize = False
            atexit.register(_finalize_mpi)
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "dist_backend='mpi' needs mpi4py: pip install overlap[mpi] (it brings mpi4py and "
            "MPICH's mpiexec)"
        ) from exc
    from overlap.comm.mpi_backend import MpiBackend

    _check_mpi_usable(MPI, mpi4py.rc.thread_level)
    atexit.unregister(_abort_if_failed)  # once, and after _finalize_mpi: it runs first
    atexit.register(_abort_if_failed)
    comm = MPI.COMM_WORLD
    _check_mpi_world((comm.Get_rank(), comm.Get_size()), (rank, world_size))
    if comm.Get_size() > 1:  # one job: debug mode alike on every rank (handshake.py)
        mine = record(comm.Get_rank(), comm.Get_size(), "mpi", _debug.enabled())
        check_records(comm.allgather(mine), comm.Get_rank())
    _, (local_rank, local_size, node) = _mpi_placement(MPI)
    state.set_active(MpiBackend(timeout), local_rank, local_size, node)
    if comm.Get_size() == 1 and not in_mpi_env():
        log.info("init_distributed(mpi): not under mpiexec; running as a single rank")
    log.info(
        "init_distributed: rank %d of %d on mpi (%s)",
        comm.Get_rank(),
        comm.Get_size(),
        MPI.Get_library_version().splitlines()[0].strip(),
    )


def _check_mpi_world(mpi: tuple[int, int], given: tuple[int, int]) -> None:
    """ValueError when MPI's (rank, size) contradicts the ``rank=``/``world_size=`` passed or
    a launcher's RANK and WORLD_SIZE.

    On MPI the job is what mpiexec started. Under torchrun, ``init_distributed("mpi")`` made
    each process an MPI singleton: every process ran as rank 0 of 1 and trained a model of
    its own, with no error (found by trying it). Arguments that disagree with MPI were
    ignored the same way. Either is refused now, on every rank alike (each sees the same
    contradiction), before anything is set up.
    """
    mr, ms = mpi
    where = f"MPI's world has {ms} rank{'s' if ms != 1 else ''} (this is rank {mr})"
    found = _contradiction(given, mpi)
    if found is not None:
        name, mine, _ = found
        raise ValueError(
            f"init_distributed('mpi', {name}={mine}) but {where}: on MPI the job is what "
            f"mpiexec started, so leave {name} out (mpiexec -n N sets the world size)"
        )
    read = launcher_ints(os.environ, ("RANK", "WORLD_SIZE"), "the launcher")
    if read is None or tuple(read) == mpi:
        return
    said = f"RANK={read[0]} and WORLD_SIZE={read[1]}"
    if ms == 1 and not in_mpi_env():
        raise ValueError(
            f"init_distributed('mpi'): this process was started with {said} (torchrun, or "
            "another launcher that is not mpiexec), so MPI sees it alone: each process would "
            "run as a job of one rank and train apart. Launch with mpiexec -n "
            f"{read[1]} python ..., or use dist_backend='gloo' (or 'nccl') under torchrun"
        )
    raise ValueError(
        f"init_distributed('mpi'): the environment says {said} but {where}: one of them is "
        "wrong. Unset RANK and WORLD_SIZE (on MPI the job is what mpiexec started), or "
        "launch so that they agree"
    )


def _check_mpi_usable(MPI: Any, requested: str) -> None:
    """Refuse an MPI that overlap cannot use safely, before its first MPI call.

    overlap calls MPI from more than one thread: the BucketScheduler's worker posts bucket
    collectives while the training thread posts its own ops, the progress engine's reaper
    thread tests requests nobody awaits, a DiLoCo background reduction runs on a thread of
    its own. That needs ``MPI_THREAD_MULTIPLE``. Below it the library skips its own locks,
    and two threads in MPI at once corrupt its state: measured with MPICH at
    ``mpi4py.rc.thread_level = "serialized"`` and ``"single"``, two threads each running
    overlap ops segfaulted or aborted in 4 runs of 4, where ``"multiple"`` ran clean. An MPI
    not initialised (``mpi4py.rc.initialize = False``) or already finalised ended the
    process from inside MPICH ("Attempting to use an MPI routine before initializing or
    after finalizing"). Each is a RuntimeError here that names the fix.
    """
    where = "init_distributed(dist_backend='mpi')"
    if MPI.Is_finalized():
        raise RuntimeError(
            f"{where}: MPI was already finalised in this process (MPI.Finalize() ran), and "
            "MPI cannot be initialised twice: call init_distributed before anything "
            "finalises MPI, and leave finalising to the process's exit (mpi4py, or overlap "
            "when it imported mpi4py.MPI, finalises MPI then)"
        )
    if not MPI.Is_initialized():
        raise RuntimeError(
            f"{where}: MPI is not initialised (mpi4py.rc.initialize is False and nothing "
            "called MPI.Init_thread): call MPI.Init_thread(MPI.THREAD_MULTIPLE) first, or "
            "leave mpi4py.rc.initialize at True"
        )
    provided = MPI.Query_thread()
    if provided >= MPI.THREAD_MULTIPLE:
        return
    names = {
        MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
        MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
        MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    }
    how = (
        f"mpi4py.rc.thread_level is {requested!r} here: leave it at its default 'multiple' "
        "(set before mpi4py.MPI is first imported)"
        if requested != "multiple"
        else "this MPI library gave less than the 'multiple' mpi4py asked for: use an MPI "
        "built with thread support (the mpich wheel, pip install overlap[mpi], has it)"
    )
    raise RuntimeError(
        f"{where}: MPI runs with {names.get(provided, provided)}, but overlap calls MPI from "
        "more than one thread (the BucketScheduler's worker, the progress engine's reaper, "
        "a DiLoCo background reduction) and needs MPI_THREAD_MULTIPLE; with less, two "
        f"threads in MPI at once corrupt its state (MPICH segfaults). {how}; if you "
        "initialise MPI yourself, call MPI.Init_thread(MPI.THREAD_MULTIPLE). Or use "
        "dist_backend='gloo'"
    )


def destroy_process_group(group: Any = None) -> None:
    """Leave the job: stop the waiter threads and destroy the default group. Idempotent.

    On gloo and NCCL, handles still in flight fail with CommError (their awaiters and
    waiters wake), and any handle of this job waited on later fails the same way: nothing is
    left waiting for an op that can no longer complete. (On MPI a pending op keeps the job
    timeout's expiry: failing it early would free buffers MPI may still write into.)

    With ``group`` (one from :func:`new_group`), free that group only, as torch's and
    DeepSpeed's ``destroy_process_group(group)``: its sockets and threads on gloo, its
    communicator on MPI. Every member calls it, when it has no op in flight on the group.
    """
    if group is not None:
        if state.is_active():
            state.active().destroy_group(group)
        return
    backend = state.clear()
    _quiesce.release_at_exit(None)
    fail_in_flight()
    twins = driver.clear() + _debug.forget()  # private groups made for the job's groups
    reset_pool()
    if backend is not None:
        backend.destroy()
    if dist.is_initialized():
        for pg in twins:  # multi-phase twins (overlap.comm.driver) and debug groups
            dist.destroy_process_group(pg)
        dist.destroy_process_group()
