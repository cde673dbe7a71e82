"""Single-process: the loop runner, errors before init, and a world of one rank."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import overlap
from overlap import NotInitializedError, comm
from tests.polling import until


def test_run_uses_uvloop_by_default() -> None:
    async def kind() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert overlap.run(kind()).startswith("uvloop")
    assert overlap.run(kind(), loop="asyncio").startswith("asyncio")
    with pytest.raises(ValueError, match="unknown loop kind"):
        overlap.new_event_loop("trio")  # type: ignore[arg-type]


def test_run_takes_an_awaitable_and_refuses_a_function_with_the_fix() -> None:
    class Ready:
        def __await__(self):  # type: ignore[no-untyped-def]
            yield from asyncio.sleep(0).__await__()
            return 7

    assert overlap.run(Ready()) == 7  # asyncio.run: "a coroutine was expected"

    async def main() -> int:
        return 1

    with pytest.raises(TypeError, match=r"got function; call the async function"):
        overlap.run(main)  # type: ignore[arg-type]


@pytest.mark.parametrize("outer_loop", ["uvloop", "asyncio"])
def test_run_inside_a_running_loop_says_to_await(outer_loop: str) -> None:
    """In an async function (or a Jupyter cell) overlap.run used to fail with uvloop's
    "Cannot run the event loop while another loop is running", which named no fix; the
    coroutine is left as it was, so awaiting it there still works."""

    async def inner() -> int:
        return 5

    async def outer() -> int:
        c = inner()
        with pytest.raises(RuntimeError, match=r"inside a running event loop .*await it there"):
            overlap.run(c)
        return await c

    assert overlap.run(outer(), loop=outer_loop) == 5  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda: comm.all_reduce(torch.ones(2)),
        lambda: comm.broadcast(torch.ones(2), src=0),
        lambda: comm.isend(torch.ones(2), dst=1),
        lambda: comm.get_rank(),
        lambda: comm.barrier(async_op=True),
        lambda: comm.new_group([0]),
    ],
)
def test_any_op_before_init_says_to_call_init(call: object) -> None:
    assert not comm.is_initialized()
    with pytest.raises(NotInitializedError, match=r"call overlap.init_distributed\(\) first"):
        call()  # type: ignore[operator]


def test_bad_init_arguments() -> None:
    with pytest.raises(ValueError, match="unknown dist_backend 'tcp'"):
        overlap.init_distributed("tcp")
    with pytest.raises(ValueError, match="timeout must be positive"):
        from overlap.comm.init import _timeout

        _timeout(-1)
    assert not comm.is_initialized()


def test_arguments_that_contradict_the_launcher_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun set RANK=1 of 2; ``rank=0`` (or ``world_size=4``) passed as well was ignored
    and the process joined as rank 1, silently. Arguments that agree are fine (checked
    without starting a job: the refusal comes before any rendezvous)."""
    from overlap.comm.init import _check_given

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank=0\) but the launcher set RANK=1"):
        overlap.init_distributed("gloo", rank=0)
    with pytest.raises(ValueError, match=r"world_size=4\) but the launcher set WORLD_SIZE=2"):
        overlap.init_distributed("gloo", world_size=4)
    assert not comm.is_initialized()
    _check_given((1, 2), (1, 2))  # the same numbers: nothing to refuse
    _check_given((-1, -1), (1, 2))  # nothing passed


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"^RANK='x' is not an integer \(set by torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"^RANK=0 is outside WORLD_SIZE=0$"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "a"}, r"^LOCAL_RANK='a' is not an int"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, r"^LOCAL_RANK=-1 is negative"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}, r"^MASTER_PORT='99999' is not"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, r"^MASTER_PORT='0' is not a port"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29x"}, r"^MASTER_PORT='29x' is not"),
    ],
)
def test_launcher_variables_that_are_wrong_are_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], said: str
) -> None:
    """Before: int()'s "invalid literal for int() with base 10: 'x'", "rank 0 is outside
    world_size 0", torch's "port must have value from 0 to 65535" (none naming the variable),
    and MASTER_PORT=0 on two ranks waited until the timeout. Refused before any rendezvous."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=said):
        overlap.init_distributed("gloo", timeout=5)
    assert not comm.is_initialized()


def test_master_port_zero_is_any_free_port_for_one_rank_only() -> None:
    from overlap.comm.launch_vars import master_port

    assert master_port({"MASTER_PORT": "0"}, 29500, world=1) == 0  # as torch takes it
    assert master_port({}, 29500, world=4) == 29500
    assert master_port({"MASTER_PORT": "65535"}, 29500, world=4) == 65535
    with pytest.raises(ValueError, match="the same on every rank"):
        master_port({"MASTER_PORT": "0"}, 29500, world=2)


LONELY_RANK = textwrap.dedent(
    """
    import os, signal, sys, threading, time, overlap
    from overlap import comm
    os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        overlap.init_distributed("gloo", timeout=40)
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - start:.1f} s", flush=True)
    assert not comm.is_initialized()
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(k)
    overlap.init_distributed("gloo")  # a single rank now, on a port of its own
    assert comm.get_world_size() == 1
    print("OK", flush=True)
    """
)


def test_ctrl_c_in_the_rendezvous_raises_at_once() -> None:
    """Rank 0 of 2 with no rank 1 waits in torch's rendezvous; Ctrl-C a second in. Before,
    the KeyboardInterrupt came only when the rendezvous timed out (torch's TCPStore
    swallows it, pytorch/pytorch#63802): 31 s with a 30 s timeout, 30 minutes by default."""
    from overlap.testing import _free_port

    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", LONELY_RANK, str(_free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    said = out.stdout.split()
    assert said[0] == "interrupted" and float(said[2]) < 5 and said[-1] == "OK", out.stdout
    assert time.monotonic() - start < 30, out.stdout


SINGLE_RANK = textwrap.dedent(
    """
    import asyncio, os, torch, overlap
    from overlap import comm
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(k, None)
    overlap.init_distributed()
    overlap.init_distributed()          # twice is harmless
    overlap.init_distributed("gloo")    # the same backend, by name: harmless too
    try:
        overlap.init_distributed("nccl")
    except ValueError as e:
        assert "already initialized" in str(e), e
    assert comm.get_backend() == "gloo" and comm.get_rank() == 0
    assert comm.get_world_size() == 1 and comm.get_local_rank() == 0
    assert comm.get_local_world_size() == 1 and comm.get_node_rank() == 0
    t = torch.arange(4.)
    assert comm.all_reduce(t, op="avg").tolist() == [0, 1, 2, 3]
    async def main():
        return await comm.all_gather(torch.ones(2), async_op=True)
    assert [x.tolist() for x in overlap.run(main())] == [[1, 1]]
    comm.destroy_process_group()
    comm.destroy_process_group()        # idempotent
    assert not comm.is_initialized()
    print("OK")
    """
)


def test_single_rank_without_a_launcher() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [sys.executable, "-c", SINGLE_RANK], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")


def test_host_placement_from_processor_names_and_torchrun_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from overlap.comm.init import _env_placement, _host_placement

    procs = ["b", "a", "b", "a", "a"]  # hosts numbered by their lowest rank: b=0, a=1
    assert [_host_placement(procs, r) for r in range(5)] == [
        (0, 2, 0), (0, 3, 1), (1, 2, 0), (1, 3, 1), (2, 3, 1)
    ]  # fmt: skip
    for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert _env_placement() == (None, 0)  # nothing said: one host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "2")
    assert _env_placement() == (4, 2)


def test_pid_alive_counts_a_zombie_as_ended() -> None:
    """The leftover sweeps ask pid_alive whether a region's or a namespace's creator is
    gone: a creator that exited but is not reaped yet (a rank killed with its launcher)
    is gone. Before, it counted as alive and its /dev/shm regions were left behind."""
    from overlap.runtime import pid_alive

    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        zombie = lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # noqa: E731
        assert until(zombie, 30, every=0.01), "the child did not exit"  # exited, not reaped
        assert not pid_alive(child.pid)
    finally:
        child.wait()
    assert not pid_alive(child.pid)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("gloo", "gloo"),
        ("cpu:gloo", "gloo"),
        ("cpu:gloo,cuda:gloo", "gloo"),
        ("NCCL", "nccl"),
        ("cpu:gloo,cuda:nccl", "nccl"),
        ("cuda:nccl", "nccl"),
    ],
)
def test_an_adopted_torch_backend_is_named_by_what_runs_it(spec: str, name: str) -> None:
    from overlap.comm.backend_names import adopted_backend

    assert adopted_backend(spec) == name


@pytest.mark.parametrize("spec", ["ucc", "mpi", "cpu:gloo,cuda:ucc", "cpu:mpi", "undefined"])
def test_a_torch_backend_overlap_cannot_run_is_refused(spec: str) -> None:
    from overlap.comm.backend_names import adopted_backend

    with pytest.raises(ValueError, match=rf"initialised with backend '{spec}', which overlap"):
        adopted_backend(spec)
