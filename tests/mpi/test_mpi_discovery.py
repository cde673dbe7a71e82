"""Under mpiexec (the mpich wheel's, in the venv), init_distributed() discovers the job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, overlap
    from overlap import comm
    assert "RANK" not in os.environ, "mpiexec must not set torchrun variables"
    overlap.init_distributed(timeout=60)
    r, w = comm.get_rank(), comm.get_world_size()
    t = torch.arange(5.) + r
    async def main():
        return await comm.all_reduce(t, async_op=True)
    out = overlap.run(main())
    want = torch.arange(5.) * w + w * (w - 1) / 2
    assert torch.equal(out, want), (out, want)
    local = f"{comm.get_local_rank()}/{comm.get_local_world_size()} node {comm.get_node_rank()}"
    sys.stdout.write(f"rank {r}/{w} local {local} {comm.get_backend()} ok\\n")
    comm.destroy_process_group()
    """
)


LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec: pip install overlap[mpi]")
@pytest.mark.parametrize("n", [2, 3])
def test_init_distributed_discovers_rank_and_size_from_mpi(tmp_path: Path, n: int) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    from overlap.comm.init import _free_port

    env["MASTER_PORT"] = str(_free_port())
    out = subprocess.run(
        [str(MPIEXEC), "-n", str(n), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}/{n} local {r}/{n} node 0 gloo ok" for r in range(n)]


def test_mpi_env_without_mpi4py_names_the_extra(tmp_path: Path) -> None:
    # A process that looks launched by mpiexec but cannot import mpi4py.
    code = textwrap.dedent(
        """
        import sys, overlap
        sys.modules["mpi4py"] = None   # makes `import mpi4py` raise ImportError
        try:
            overlap.init_distributed()
        except ImportError as e:
            print("ERR", e)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PMI_RANK"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert "pip install overlap[mpi]" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec: pip install overlap[mpi]")
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_debug_mode_on_one_rank_only_is_refused_on_every_rank(tmp_path: Path, backend: str) -> None:
    """``mpiexec -n 1 -env OVERLAP_DEBUG 1 ... : -n 1 ...``: debug mode on rank 0 only
    would make rank 0 issue check collectives rank 1 does not (a hang, or a timeout in the
    first collective); both ranks refuse at init, naming rank 1 (overlap.comm.handshake:
    one allgather on MPI, the store's handshake on gloo)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, overlap\n"
        "try:\n"
        f"    overlap.init_distributed({backend!r}, timeout=60)\n"
        "except ValueError as exc:\n"
        "    sys.stdout.write(f'REFUSED {exc}\\n')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    from overlap.comm.init import _free_port

    env["MASTER_PORT"] = str(_free_port())
    one = [sys.executable, str(script)]
    out = subprocess.run(
        [str(MPIEXEC), "-n", "1", "-env", "OVERLAP_DEBUG", "1", *one, ":", "-n", "1", *one],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith("REFUSED ")]
    assert len(lines) == 2, out.stdout + out.stderr
    for line in lines:
        assert "rank 1 (pid" in line, line
        assert "debug mode (OVERLAP_DEBUG or init_distributed(debug=)) False where rank 0 " in line
