"""Helpers to run scripts under the venv's mpiexec (the mpich wheel's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# OVERLAP_MPIEXEC names the launcher that matches mpi4py's MPI (scripts/gpu-check.sh sets it:
# the GPU image has an Open MPI build of mpi4py and no mpiexec beside its python).
MPIEXEC = (
    os.environ.get("OVERLAP_MPIEXEC")
    or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    or shutil.which("mpiexec")
)

needs_mpiexec = pytest.mark.skipif(
    MPIEXEC is None, reason="needs mpiexec: pip install overlap[mpi]"
)


def clean_env() -> dict[str, str]:
    """The environment minus any launcher variables, so each launch discovers its own job."""
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PMI_RANK",
        "PMI_SIZE",
        "OMPI_COMM_WORLD_RANK",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    # the repo first; keep what was there (gpu-check.sh puts carried wheels on the path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def mpiexec(
    n: int, *args: str, timeout: float = 300, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n N python ARGS`` in :func:`clean_env`, plus ``env_extra``."""
    assert MPIEXEC is not None
    return subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_env(), **(env_extra or {})},
        cwd=ROOT,
    )
