"""scripts/bench_summary.py: the short table a device run prints from a bench's JSON."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_summary.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_rows_are_tabled_by_variant_with_the_fields_they_have() -> None:
    rows = [
        {"variant": "compute", "step_ms": 150.04, "max_step_ms": 160.0},
        {
            "variant": "overlap-onebit",
            "step_ms": 200.5,
            "max_step_ms": 270.25,
            "worker_cpu_ms": 61.0,
        },
    ]
    lines = _module().summary(rows).splitlines()
    assert lines[0] == "| variant | step_ms | max_step_ms | worker_cpu_ms |"
    assert lines[2] == "| compute | 150.04 | 160.00 |  |"
    assert lines[3] == "| overlap-onebit | 200.50 | 270.25 | 61.00 |"


def test_ops_rows_and_the_command_line(tmp_path: Path) -> None:
    rows = [
        {
            "op": "sendrecv",
            "bytes": 4,
            "torch_us": 73.5,
            "await_us": 151.0,
            "await/torch": 2.06,
            "await/torch 90%": [1.971, 2.114],
        }
    ]
    f = tmp_path / "ops.json"
    f.write_text(json.dumps(rows))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "| op | bytes | torch_us | await_us | await/torch | await/torch 90% |"
    assert out[2] == "| sendrecv | 4 | 73.50 | 151.00 | 2.06 | 1.97-2.11 |"
    bad = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert bad.returncode == 2 and "Usage" in bad.stderr
