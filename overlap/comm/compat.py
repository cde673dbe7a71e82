"""The rest of deepspeed.comm's surface: capability queries, group helpers, the comm-off
switches of deepspeed/comm/torch.py, and names DeepSpeed keeps for its own plumbing.

Kept apart from :mod:`overlap.comm` so the op functions there stay short. Each function says
how it maps onto overlap; docs/api.md has the migration table.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = [
    "Noop",
    "ProcessGroup",
    "all_gather_comm_off",
    "all_reduce_comm_off",
    "backward_comm_off",
    "broadcast_comm_off",
    "comm_off",
    "enable_symm_mem_for_group",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "init_deepspeed_backend",
    "initialize_mesh_device",
    "is_available",
    "reduce_comm_off",
    "reduce_scatter_comm_off",
    "set_backend",
    "skipped",
]

log = logging.getLogger(__name__)


class ProcessGroup:
    """DeepSpeed's plain record of a group (``comm_id``, ``ranks``, ``size``); overlap's groups
    are whatever :func:`overlap.comm.new_group` returns, as DeepSpeed's are torch's."""

    def __init__(self, comm_id: Any, ranks: list[int] | None = None) -> None:
        self.ranks = list(ranks) if ranks is not None else []
        self.comm_id = comm_id
        self.size = len(self.ranks)


class Noop:
    """What DeepSpeed returns for an op switched off: ``wait()`` does nothing."""

    def wait(self) -> None:
        return None


# ----------------------------------------------------------------- comm-off switches
# deepspeed/comm/torch.py's DS_COMM_*_OFF: an op switched off is skipped (returns Noop),
# for measuring a run without that communication. all_reduce's switch is kept but, as in
# DeepSpeed, all_reduce does not consult it.
comm_off: set[str] = set()


def _switch(name: str, flag: bool) -> None:
    if flag:
        comm_off.add(name)
    else:
        comm_off.discard(name)


def all_gather_comm_off(flag: bool = False) -> None:
    _switch("all_gather", flag)


def reduce_scatter_comm_off(flag: bool = False) -> None:
    _switch("reduce_scatter", flag)


def broadcast_comm_off(flag: bool = False) -> None:
    _switch("broadcast", flag)


def all_reduce_comm_off(flag: bool = False) -> None:
    _switch("all_reduce", flag)


def reduce_comm_off(flag: bool = False) -> None:
    _switch("reduce", flag)


def backward_comm_off(flag: bool = False) -> None:
    """all_gather and reduce_scatter off (or on): the backward pass's communication."""
    all_gather_comm_off(flag)
    reduce_scatter_comm_off(flag)


def skipped(name: str) -> Noop:
    """The result of an op switched off (logged on rank 0, as DeepSpeed does)."""
    from overlap import comm

    if comm.get_rank() == 0:
        log.warning("%s is OFF (%s_comm_off(True)): skipped", name.upper(), name)
    return Noop()


# ----------------------------------------------------------------- capability queries
def _active() -> Any:
    from overlap.comm import state

    return state.active()  # raises NotInitializedError naming init_distributed


def is_available() -> bool:
    """True: the communication package is importable (DeepSpeed's meaning)."""
    return True


def has_all_gather_into_tensor() -> bool:
    """True on every backend (MPI included): :func:`~overlap.comm.all_gather_into_tensor`."""
    _active()
    return True


def has_reduce_scatter_tensor() -> bool:
    """True on every backend: :func:`~overlap.comm.reduce_scatter_tensor`."""
    _active()
    return True


def has_all_reduce_coalesced() -> bool:
    """True on every backend: :func:`~overlap.comm.all_reduce_coalesced` is overlap's own."""
    _active()
    return True


def has_coalescing_manager() -> bool:
    """False: overlap does not expose torch's private ``_coalescing_manager``; coalesce with
    :func:`~overlap.comm.all_reduce_coalesced` / :func:`~overlap.comm.all_gather_coalesced`.
    DeepSpeed's callers take their fallback path on False."""
    _active()
    return False


# ----------------------------------------------------------------- backend plumbing
def set_backend() -> None:
    """Nothing to do: :func:`~overlap.comm.init_distributed` picks the backend (DeepSpeed
    picks its backend object from the accelerator here)."""
    return None


def init_deepspeed_backend(ds_backend: str, timeout: Any, init_method: Any) -> None:
    """DeepSpeed's unused hook for its own (CCL) backend objects; overlap has none, so this
    only logs, as DeepSpeed does for nccl, mpi and gloo."""
    log.debug("init_deepspeed_backend(%r): overlap has no separate backend objects", ds_backend)


def initialize_mesh_device(mesh_shape: Any, mesh_dim_names: Any) -> Any:
    """A ``torch.distributed.device_mesh.DeviceMesh`` of this shape over the job (gloo: CPU,
    NCCL: CUDA). On MPI, which torch's DeviceMesh cannot use, None with a warning, as
    DeepSpeed does for a backend without meshes."""
    from overlap import comm

    b = _active()
    if b.name == "mpi":
        if comm.get_rank() == 0:
            log.warning("backend mpi does not support mesh device initialization")
        return None
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if b.name == "nccl" else "cpu"
    return init_device_mesh(device, tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))


def enable_symm_mem_for_group(group_name: str) -> None:
    """torch's symmetric memory for ``group_name`` (NCCL only, as it needs CUDA); any other
    backend raises RuntimeError as DeepSpeed does."""
    b = _active()
    if b.name != "nccl" or not torch.cuda.is_available():
        raise RuntimeError(
            f"Backend {b.name} does not support symmetric memory initialization: it needs "
            "NCCL on CUDA (init_distributed('nccl'))"
        )
    from torch.distributed import _symmetric_memory

    _symmetric_memory.enable_symm_mem_for_group(group_name)  # type: ignore[arg-type]
