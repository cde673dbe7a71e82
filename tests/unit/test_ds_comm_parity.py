"""overlap.comm against deepspeed.comm's public surface (tests/unit/ds_comm_surface.py):
every name exists; every function's parameters, in order, have DeepSpeed's names, kinds and
defaults (with the documented differences); anything overlap adds comes after them, with a
default. Plus the comms logger's pure parts."""

from __future__ import annotations

import inspect
import io
from typing import Any

import pytest

from overlap import comm
from overlap.comm import comms_logger
from overlap.comm.reduce_op import parse_op
from overlap.errors import NotInitializedError
from tests.unit import ds_comm_surface as ds

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_params(name: str, obj: Any, want: list[tuple[str, object]]) -> None:
    params = list(inspect.signature(obj).parameters.values())
    got = [p.name for p in params[: len(want)]]
    assert got == [w[0] for w in want], f"{name}: parameters {got}, DeepSpeed's {want}"
    for p, (pname, default) in zip(params, want, strict=False):
        assert p.kind in POSITIONAL, f"{name}({pname}) must be positional as in DeepSpeed"
        if (name, pname) in ds.DIFFERENT_DEFAULTS:
            assert p.default == ds.DIFFERENT_DEFAULTS[(name, pname)], (name, pname)
        elif default is ds.NODEFAULT:
            assert p.default is inspect.Parameter.empty, f"{name}({pname}) has a default"
        elif default is ds.CALLER:
            assert p.default is None, f"{name}: debug defaults to None (the caller, at call time)"
        elif default is ds.SUM:
            assert getattr(p.default, "name", None) == "SUM", f"{name}: op defaults to SUM"
        else:
            assert p.default == default, f"{name}({pname}={p.default!r}), DeepSpeed's {default!r}"
    for p in params[len(want) :]:  # overlap's additions: never in the way of DeepSpeed's calls
        assert p.kind is not inspect.Parameter.VAR_POSITIONAL, name
        assert p.kind is inspect.Parameter.VAR_KEYWORD or p.default is not p.empty, (
            f"{name}: extra parameter {p.name} must have a default"
        )


@pytest.mark.parametrize("name", sorted(ds.FUNCTIONS))
def test_function_matches_deepspeed(name: str) -> None:
    assert name in comm.__all__, f"overlap.comm.{name} is not exported"
    fn = getattr(comm, name)
    assert callable(fn)
    _check_params(name, fn, ds.FUNCTIONS[name])


@pytest.mark.parametrize("name", sorted(ds.CLASSES))
def test_class_matches_deepspeed(name: str) -> None:
    assert inspect.isclass(getattr(comm, name)) and name in comm.__all__
    _check_params(name, getattr(comm, name), ds.CLASSES[name])


def test_other_names_constants_and_reduce_ops() -> None:
    for name in ds.OTHER_NAMES:
        assert hasattr(comm, name) and name in comm.__all__, name
    for name, value in ds.CONSTANTS.items():
        assert getattr(comm, name) == value, name
    assert [m.name for m in comm.ReduceOp] == [
        "SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "UNUSED"
    ]  # fmt: skip
    assert set(ds.REDUCE_OPS) == {m.name for m in comm.ReduceOp}
    with pytest.raises(ValueError, match="unknown reduction op"):
        parse_op(comm.ReduceOp.UNUSED)


def test_noop_and_process_group() -> None:
    assert comm.Noop().wait() is None
    g = comm.ProcessGroup(7, [0, 2])
    assert (g.comm_id, g.ranks, g.size) == (7, [0, 2], 2)
    assert comm.ProcessGroup(1).ranks == []


def test_queries_need_initialization_as_deepspeed_asserts() -> None:
    assert comm.is_available() is True
    for q in (comm.has_all_gather_into_tensor, comm.has_reduce_scatter_tensor,
              comm.has_all_reduce_coalesced, comm.has_coalescing_manager):  # fmt: skip
        with pytest.raises(NotInitializedError, match="init_distributed"):
            q()


def test_init_distributed_refuses_when_not_initialized_and_not_required() -> None:
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        comm.init_distributed("gloo", dist_init_required=False)
    assert not comm.is_initialized()


def test_logger_pieces_match_deepspeed() -> None:
    assert comms_logger.convert_size(0) == "0B"
    assert comms_logger.convert_size(1024) == "1.0 KB"
    assert comms_logger.convert_size(3 * 1024**2 // 2) == "1.5 MB"
    # 10%: the smallest and the largest of 10 go
    data = [1.0, 2.0, 3.0, 100.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert comms_logger.trim_mean(data, 0.1) == 2.125
    # all_reduce of 1 GB in 1 s on 4 ranks: algbw 8 Gbps, busbw x 1.5 (nccl-tests)
    alg, bus = comms_logger.calc_bw_log("all_reduce", 10**9, 1000.0, 4)
    assert alg == pytest.approx(8.0) and bus == pytest.approx(12.0)
    # an all_gather logs this rank's input; its size is world x that
    alg, bus = comms_logger.calc_bw_log("all_gather_into_tensor", 10**9, 1000.0, 4)
    assert alg == pytest.approx(32.0) and bus == pytest.approx(24.0)


def test_configure_from_a_ds_config_dict_and_keywords() -> None:
    lg = comms_logger.LOGGER
    saved = (lg.enabled, lg.verbose, lg.debug, lg.prof_all, list(lg.prof_ops))
    try:
        section = {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}
        comm.configure({"comms_logger": section})
        assert lg.enabled and not lg.prof_all and lg.prof_ops == ["all_reduce"]
        assert lg.wants(False, "all_reduce") and not lg.wants(False, "broadcast")
        assert lg.wants(True, "broadcast") and not lg.wants(True, comms_logger.BYPASS)
        comm.configure(enabled=False, debug=True)
        assert not lg.enabled and lg.debug
    finally:
        lg.enabled, lg.verbose, lg.debug, lg.prof_all, lg.prof_ops = saved


def test_log_all_prints_deepspeeds_table_and_dict() -> None:
    lg = comms_logger.CommsLogger()
    for ms in (1.0, 2.0, 3.0):
        lg.append("all_reduce", "all_reduce", ms, 4096, 2)
    lg.append("broadcast", "my_bcast", 0.5, 100, 2)
    out = io.StringIO()
    res = lg.log_all(print_log=True, return_dict=True, file=out)
    text = out.getvalue()
    assert text.splitlines()[0].startswith("Comm. Op") and "busbw_avg (Gbps)" in text
    assert "my_bcast" in text and "4.0 KB" in text
    assert res is not None
    s = res["summary"]["all_reduce"][4096]
    assert s["count"] == 3 and s["total_latency_ms"] == pytest.approx(6.0)
    assert s["msg_size_str"] == "4.0 KB" and res["straggler_analysis"] is None
    assert lg.get_total_operations() == 4 and lg.get_operation_names() == ["all_reduce", "my_bcast"]
    lg.reset_data()
    assert not lg.has_data()


# DeepSpeed's tests/unit/comm/test_comms_logger.py, ported (only the imports changed)
def test_stop_profiling_comms_disables_prof_all() -> None:
    lg = comms_logger.CommsLogger()
    lg.start_profiling_comms()
    assert lg.prof_all is True
    lg.stop_profiling_comms()
    assert lg.prof_all is False


def test_get_operation_summary_does_not_reorder_the_stored_records() -> None:
    lg = comms_logger.CommsLogger()
    latencies = [3.0, 1.0, 2.0]
    algbws = [10.0 / latency for latency in latencies]
    busbws = [algbw * 2 for algbw in algbws]
    lg.comms_dict = {"all_reduce": {1024: [3, list(latencies), list(algbws), list(busbws)]}}
    summary = lg.get_operation_summary("all_reduce")
    stored = lg.get_raw_data()["all_reduce"][1024]
    assert stored[1] == latencies and stored[2] == algbws and stored[3] == busbws
    assert summary is not None and summary[1024]["avg_latency_ms"] == 2.0


def test_trim_mean_does_not_mutate_its_argument() -> None:
    data = [3.0, 1.0, 2.0]
    assert comms_logger.trim_mean(data, 0.1) == 2.0
    assert data == [3.0, 1.0, 2.0]
