"""horovodrun's gloo-mode worker variables (overlap.comm.horovodrun). Pure: real workers
are started in tests/gloo/test_launcher_env.py."""

from __future__ import annotations

import pytest

from overlap.comm.horovodrun import horovod_placement


def _worker(rank: int, size: int, local: int, local_size: int, cross: int = 0) -> dict[str, str]:
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross),
    }


def test_a_worker_knows_its_place_and_master() -> None:
    one = horovod_placement(_worker(1, 2, 1, 2))
    assert one is not None
    assert (one.rank, one.world, one.local_rank, one.local_world, one.node) == (1, 2, 1, 2, 0)
    assert one.master == "127.0.0.1"  # every worker on this host
    two = horovod_placement(_worker(3, 4, 1, 2, cross=1))
    assert two is not None and two.node == 1 and two.master is None  # several hosts
    given = horovod_placement({**_worker(3, 4, 1, 2, 1), "MASTER_ADDR": "host0"})
    assert given is not None and given.master == "host0"


def test_no_horovodrun_no_placement() -> None:
    assert horovod_placement({}) is None
    assert horovod_placement({"HOROVOD_RANK": "0"}) is None  # not all four


@pytest.mark.parametrize(
    ("env", "why"),
    [
        (_worker(2, 2, 0, 2), "HOROVOD_RANK=2 is outside HOROVOD_SIZE=2"),
        (_worker(0, 2, 2, 2), "do not fit"),
        (_worker(0, 2, 0, 3), "do not fit"),
        ({**_worker(0, 2, 0, 2), "HOROVOD_SIZE": "two"}, "HOROVOD_SIZE='two' is not an integer"),
    ],
)
def test_contradicting_variables_are_refused(env: dict[str, str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        horovod_placement(env)
