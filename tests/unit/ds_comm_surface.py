"""deepspeed.comm's public surface, written by hand from DeepSpeed's source: the names
defined in deepspeed/comm/comm.py (commit 09ce632b, the log_summary(show_straggler,
return_dict) / reset_log generation of the 0.17-0.18 releases), deepspeed/comm/torch.py
(commit 0a7c0015: the comm-off switches, Noop, the capability queries) and
deepspeed/comm/reduce_op.py, plus deepspeed/comm/constants.py's names that comm.py
re-exports.

Each function: its parameters in order, as (name, default); NODEFAULT where DeepSpeed has
none, CALLER for DeepSpeed's ``debug=get_caller_func()`` (the caller's name, evaluated once
at import), SUM for ``ReduceOp.SUM``. Left out on purpose (docs/api.md says so): the cloud
helpers (in_aml, in_aws_sm, in_dlts, patch_aml_env_for_torch_nccl_backend,
patch_aws_sm_env_for_torch_nccl_backend), DeepSpeed's module globals (cdb, the backend
objects, timers, comms_logger) and torch.py's internals (TorchBackend, build_shm_op,
get_coalescing_manager, disable_compiler_collective).
"""

from __future__ import annotations

import datetime

NODEFAULT = object()
CALLER = object()
SUM = object()

_P2P = [("group", None), ("tag", 0), ("prof", False)]

FUNCTIONS: dict[str, list[tuple[str, object]]] = {
    "configure": [
        ("deepspeed_config", None),
        ("enabled", None),
        ("prof_all", None),
        ("prof_ops", None),
        ("verbose", None),
        ("debug", None),
    ],
    "timed_op": [("func", NODEFAULT)],
    "init_deepspeed_backend": [
        ("ds_backend", NODEFAULT),
        ("timeout", NODEFAULT),
        ("init_method", NODEFAULT),
    ],
    "is_initialized": [],
    "destroy_process_group": [("group", None)],
    "new_group": [("ranks", NODEFAULT)],
    "is_available": [],
    "set_backend": [],
    "broadcast": [
        ("tensor", NODEFAULT),
        ("src", NODEFAULT),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "broadcast"),
        ("debug", CALLER),
    ],
    "broadcast_object_list": [
        ("object_list", NODEFAULT),
        ("src", NODEFAULT),
        ("group", None),
        ("device", None),
    ],
    "all_gather": [
        ("tensor_list", NODEFAULT),
        ("tensor", NODEFAULT),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_gather"),
        ("debug", CALLER),
    ],
    "all_gather_object": [
        ("object_list", NODEFAULT),
        ("obj", NODEFAULT),
        ("group", None),
        ("prof", False),
        ("log_name", "all_gather_object"),
        ("debug", CALLER),
    ],
    "has_reduce_scatter_tensor": [],
    "reduce_scatter_fn": [
        ("output_tensor", NODEFAULT),
        ("tensor", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("debug", CALLER),
    ],
    "reduce_scatter_tensor": [
        ("output_tensor", NODEFAULT),
        ("tensor", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "reduce_scatter_tensor"),
        ("debug", CALLER),
    ],
    "all_gather_into_tensor": [
        ("output_tensor", NODEFAULT),
        ("tensor", NODEFAULT),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_gather_into_tensor"),
        ("debug", CALLER),
    ],
    "has_all_gather_into_tensor": [],
    "allgather_fn": [
        ("output_tensor", NODEFAULT),
        ("input_tensor", NODEFAULT),
        ("group", None),
        ("async_op", False),
        ("debug", CALLER),
    ],
    "all_to_all_single": [
        ("output", NODEFAULT),
        ("tensor", NODEFAULT),
        ("output_split_sizes", None),
        ("input_split_sizes", None),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_to_all_single"),
        ("debug", CALLER),
    ],
    "all_to_all": [
        ("output_tensor_list", NODEFAULT),
        ("input_tensor_list", NODEFAULT),
        ("group", None),
        ("async_op", False),
    ],
    "send": [
        ("tensor", NODEFAULT),
        ("dst", NODEFAULT),
        *_P2P,
        ("log_name", "send"),
        ("debug", CALLER),
    ],
    "recv": [("tensor", NODEFAULT), ("src", None), *_P2P, ("log_name", "recv"), ("debug", CALLER)],
    "isend": [
        ("tensor", NODEFAULT),
        ("dst", NODEFAULT),
        *_P2P,
        ("log_name", "isend"),
        ("debug", CALLER),
    ],
    "irecv": [
        ("tensor", NODEFAULT),
        ("src", None),
        *_P2P,
        ("log_name", "irecv"),
        ("debug", CALLER),
    ],
    "gather": [
        ("tensor", NODEFAULT),
        ("gather_list", None),
        ("dst", 0),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "gather"),
        ("debug", CALLER),
    ],
    "scatter": [
        ("tensor", NODEFAULT),
        ("scatter_list", None),
        ("src", 0),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "scatter"),
        ("debug", CALLER),
    ],
    "barrier": [
        ("group", None),
        ("async_op", False),
        ("device_ids", None),
        ("prof", False),
        ("log_name", "barrier"),
        ("debug", CALLER),
    ],
    "monitored_barrier": [
        ("group", None),
        ("timeout", None),
        ("wait_all_ranks", False),
        ("prof", False),
        ("log_name", "monitored_barrier"),
        ("debug", CALLER),
    ],
    "log_summary": [("show_straggler", False), ("return_dict", False)],
    "reset_log": [],
    "has_comm_data": [],
    "get_comm_operation_count": [],
    "get_logged_comm_ops": [],
    "reduce": [
        ("tensor", NODEFAULT),
        ("dst", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "reduce"),
        ("debug", CALLER),
    ],
    "reduce_scatter": [
        ("output", NODEFAULT),
        ("input_list", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "reduce_scatter"),
        ("debug", CALLER),
    ],
    "has_all_reduce_coalesced": [],
    "has_coalescing_manager": [],
    "all_gather_coalesced": [
        ("output_tensors", NODEFAULT),
        ("input_tensors", NODEFAULT),
        ("group", None),
        ("async_op", False),
    ],
    "all_reduce": [
        ("tensor", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_reduce"),
        ("debug", CALLER),
    ],
    "inference_all_reduce": [
        ("tensor", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_reduce"),
        ("debug", CALLER),
    ],
    "all_reduce_coalesced": [
        ("tensors", NODEFAULT),
        ("op", SUM),
        ("group", None),
        ("async_op", False),
        ("prof", False),
        ("log_name", "all_reduce"),
        ("debug", CALLER),
    ],
    "get_world_group": [],
    "get_world_size": [("group", None)],
    "get_rank": [("group", None)],
    "get_local_rank": [],
    "get_global_rank": [("group", None), ("group_rank", 0)],
    "get_all_ranks_from_group": [("group", None)],
    "initialize_mesh_device": [("mesh_shape", NODEFAULT), ("mesh_dim_names", NODEFAULT)],
    "enable_symm_mem_for_group": [("group_name", NODEFAULT)],
    "init_distributed": [
        ("dist_backend", None),
        ("auto_mpi_discovery", True),
        ("distributed_port", 29500),
        ("verbose", True),
        ("timeout", datetime.timedelta(minutes=30)),
        ("init_method", None),
        ("dist_init_required", None),
        ("config", None),
        ("rank", -1),
        ("world_size", -1),
    ],
    "mpi_discovery": [("distributed_port", 29500), ("verbose", True)],
    # deepspeed/comm/torch.py
    "all_gather_comm_off": [("flag", False)],
    "reduce_scatter_comm_off": [("flag", False)],
    "broadcast_comm_off": [("flag", False)],
    "all_reduce_comm_off": [("flag", False)],
    "reduce_comm_off": [("flag", False)],
    "backward_comm_off": [("flag", False)],
}

CLASSES = {
    "ProcessGroup": [("comm_id", NODEFAULT), ("ranks", [])],
    "Noop": [],
}

OTHER_NAMES = ["GradBucket", "ReduceOp"]

REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "UNUSED"]

CONSTANTS = {
    "NCCL_BACKEND": "nccl",
    "CCL_BACKEND": "ccl",
    "MPI_BACKEND": "mpi",
    "GLOO_BACKEND": "gloo",
    "SCCL_BACKEND": "sccl",
    "HCCL_BACKEND": "hccl",
    "XLA_BACKEND": "xla",
    "DEFAULT_AML_MASTER_PORT": "54965",
    "DEFAULT_AML_NCCL_SOCKET_IFNAME": "^docker0,lo",
    "COMMS_LOGGER": "comms_logger",
    "COMMS_LOGGER_ENABLED": "enabled",
    "COMMS_LOGGER_ENABLED_DEFAULT": False,
    "COMMS_LOGGER_VERBOSE": "verbose",
    "COMMS_LOGGER_VERBOSE_DEFAULT": False,
    "COMMS_LOGGER_PROF_ALL": "prof_all",
    "COMMS_LOGGER_PROF_ALL_DEFAULT": True,
    "COMMS_LOGGER_DEBUG": "debug",
    "COMMS_LOGGER_DEBUG_DEFAULT": False,
    "COMMS_LOGGER_PROF_OPS": "prof_ops",
    "COMMS_LOGGER_PROF_OPS_DEFAULT": [],
}

# Where overlap differs on purpose (docs/api.md, "Differences from deepspeed.comm"):
# (function, parameter) -> overlap's default.
DIFFERENT_DEFAULTS = {
    ("all_gather", "tensor"): None,  # overlap adds the one-argument form all_gather(tensor)
    ("new_group", "ranks"): None,  # None: every rank, as torch's new_group
    ("ProcessGroup", "ranks"): None,  # no shared mutable default; None means []
}
