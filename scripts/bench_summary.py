"""Print a short table of an ``overlap bench train|ops --json`` file: the figures a device
run's output needs (scripts/device-cpu-bench.sh keeps the whole JSON beside it).

Usage: python scripts/bench_summary.py FILE.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

TRAIN = [
    "step_ms", "max_step_ms", "worker_cpu_ms", "exposed_ms", "train_cpu_ms", "rank_cpu_ms",
    "own_compute_ms", "own_compute_max_ms", "diloco_step_ms", "diloco_step_max_ms",
    "diloco_wait_max_ms", "diloco_pass_thread", "diloco_background", "vs_ddp_90",
    "x_compute_90",
]  # fmt: skip
OPS = [
    "torch_us", "blocking_us", "await_us", "await/torch", "await/torch 90%", "blocking/torch",
    "blocking/torch 90%", "await/blocking", "a/a", "a/a 90%",
]  # fmt: skip


def _cell(v: Any) -> str:
    if isinstance(v, list) and len(v) == 2:  # a ratio's 90% interval
        return f"{v[0]:.2f}-{v[1]:.2f}" if v[0] == v[0] else ""
    return f"{v:.2f}" if isinstance(v, float) else "" if v is None else str(v)


def summary(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: train rows by variant, ops rows by op and size."""
    if not rows:
        return "(no rows)"
    if "variant" in rows[0]:
        keys, lead = TRAIN, ["variant"]
    else:
        keys, lead = OPS, ["op", "bytes"]
    keys = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(lead + keys) + " |", "|" + "---|" * (len(lead) + len(keys))]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in lead + keys) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write(__doc__.strip() + "\n")
        return 2
    with open(argv[0]) as f:
        sys.stdout.write(summary(json.load(f)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
