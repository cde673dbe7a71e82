"""Several ranks on one GPU: the CUDA scheduler and codec over MPI with CUDA tensors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.mpi.conftest import mpiexec, needs_mpiexec

pytestmark = [pytest.mark.mpi, needs_mpiexec]

_runs: dict[int, list[dict[str, Any]]] = {}


def run_all(n: int) -> list[dict[str, Any]]:
    """Every case of tests/gpu/mpi_cuda_cases.py in one mpiexec launch of n ranks (cached)."""
    if n not in _runs:
        out = mpiexec(n, "-m", "tests.gpu.mpi_cuda_cases", timeout=300)
        results = [
            json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")
        ]
        assert out.returncode == 0 and len(results) == n, out.stdout[-3000:] + out.stderr[-3000:]
        assert sorted(r["rank"] for r in results) == list(range(n)), results
        _runs[n] = sorted(results, key=lambda d: d["rank"])
    return _runs[n]


def _values(n: int, case: str) -> list[Any]:
    vals = [r[case] for r in run_all(n)]
    errors = [v for v in vals if isinstance(v, str)]
    assert not errors, errors[0]
    return vals


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", ["blocking", "uvloop", "asyncio"])
def test_cuda_scheduler_equals_the_exact_average(n: int, mode: str) -> None:
    assert max(_values(n, f"none/{mode}")) < 1e-6


@pytest.mark.parametrize("n", [2, 3])
def test_cuda_scheduler_fp16(n: int) -> None:
    assert max(_values(n, "fp16/blocking")) < 2e-3


@pytest.mark.parametrize("n", [2, 3])
def test_cuda_scheduler_no_sync(n: int) -> None:
    assert max(_values(n, "no_sync")) < 1e-6


@pytest.mark.parametrize("n", [2, 3])
def test_onebit_scheduler_cuda_equals_cpu(n: int) -> None:
    assert max(_values(n, "onebit_cuda_vs_cpu")) < 1e-4


@pytest.mark.parametrize("n", [2, 3])
def test_codec_cuda_equals_cpu(n: int) -> None:
    for per_rank in _values(n, "codec_cuda_vs_cpu"):
        for size, r in per_rank.items():
            # float32 norms summed in another order: ~sqrt(n) * eps relative (measured on an
            # H100: 2.6e-5 at 2**18 floats); the signs themselves agree bit for bit
            assert r["first_rel"] < 1e-4, (size, r)
            assert r["later_mismatch_fraction"] < 1e-3, (size, r)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_scheduler_cuda_equals_cpu(n: int, name: str) -> None:
    # float rounding can move a value across a code boundary: one Int8 step is 1/127 of a
    # block's maximum, an FP8 e4m3 step up to 32/448 near the top of its range (measured on
    # an H100: FP8 0.026)
    assert max(_values(n, f"{name}_cuda_vs_cpu")) < {"int8": 1e-2, "fp8": 0.08}[name]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_streaming_diloco_cuda_equals_cpu(n: int, compression: str) -> None:
    key = "diloco_cuda_vs_cpu" if compression == "none" else "diloco_int8_cuda_vs_cpu"
    for r in _values(n, key):
        assert r["across_ranks"] == 0.0, r  # one outer step, the same on every rank
        assert r["vs_cpu"] < (1e-4 if compression == "none" else 2e-2), r


@pytest.mark.parametrize("n", [2, 3])
def test_deepspeed_coalesced_ops_on_cuda_tensors(n: int) -> None:
    assert all(_values(n, "coalesced_on_cuda"))
