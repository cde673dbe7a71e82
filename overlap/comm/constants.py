"""deepspeed.comm's constants, under the same names (deepspeed/comm/constants.py): backend
names, the comms logger's ds_config keys and defaults, and the default timeout and port of
:func:`~overlap.comm.init_distributed`."""

from __future__ import annotations

import datetime

from overlap.comm import knobs as _knobs

__all__ = [
    "CCL_BACKEND",
    "COMMS_LOGGER",
    "COMMS_LOGGER_DEBUG",
    "COMMS_LOGGER_DEBUG_DEFAULT",
    "COMMS_LOGGER_ENABLED",
    "COMMS_LOGGER_ENABLED_DEFAULT",
    "COMMS_LOGGER_PROF_ALL",
    "COMMS_LOGGER_PROF_ALL_DEFAULT",
    "COMMS_LOGGER_PROF_OPS",
    "COMMS_LOGGER_PROF_OPS_DEFAULT",
    "COMMS_LOGGER_VERBOSE",
    "COMMS_LOGGER_VERBOSE_DEFAULT",
    "DEFAULT_AML_MASTER_PORT",
    "DEFAULT_AML_NCCL_SOCKET_IFNAME",
    "GLOO_BACKEND",
    "HCCL_BACKEND",
    "MPI_BACKEND",
    "NCCL_BACKEND",
    "SCCL_BACKEND",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "XLA_BACKEND",
    "default_pg_timeout",
]

NCCL_BACKEND = "nccl"
CCL_BACKEND = "ccl"
MPI_BACKEND = "mpi"
GLOO_BACKEND = "gloo"
SCCL_BACKEND = "sccl"
HCCL_BACKEND = "hccl"
XLA_BACKEND = "xla"

DEFAULT_AML_MASTER_PORT = "54965"
DEFAULT_AML_NCCL_SOCKET_IFNAME = "^docker0,lo"

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
# DeepSpeed's: 30 minutes, or DEEPSPEED_TIMEOUT minutes (read once, at import, as DeepSpeed does)
default_pg_timeout = datetime.timedelta(
    minutes=_knobs.number("DEEPSPEED_TIMEOUT", 30, low=1e-3, high=1e7, unit="minutes")
)

# The comms logger's section of a ds_config (``"comms_logger": {...}``) and its defaults.
COMMS_LOGGER = "comms_logger"
COMMS_LOGGER_ENABLED = "enabled"
COMMS_LOGGER_ENABLED_DEFAULT = False
COMMS_LOGGER_VERBOSE = "verbose"
COMMS_LOGGER_VERBOSE_DEFAULT = False
COMMS_LOGGER_PROF_ALL = "prof_all"
COMMS_LOGGER_PROF_ALL_DEFAULT = True
COMMS_LOGGER_DEBUG = "debug"
COMMS_LOGGER_DEBUG_DEFAULT = False
COMMS_LOGGER_PROF_OPS = "prof_ops"
COMMS_LOGGER_PROF_OPS_DEFAULT: list[str] = []
