"""The GPU layer: every test here needs CUDA and is skipped cleanly without it.

NCCL cases run in one real NCCL rank (``RankPool(1, backend="nccl")``), started once for the
session; multi-rank CUDA cases run under mpiexec with the MPI backend and CUDA tensors
(NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from overlap.testing import RankPool


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu runs on a GPU machine)")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def nccl() -> Iterator[RankPool]:
    """One NCCL rank on GPU 0, reused by every test of the session."""
    pool = RankPool(1, backend="nccl", timeout=180).start()
    yield pool
    pool.close()
