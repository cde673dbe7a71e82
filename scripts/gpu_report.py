"""Write gpu-report.md and gpu-report.json from a scripts/gpu-check.sh run.

Usage: python scripts/gpu_report.py OUTDIR TESTS_EXIT_CODE SECONDS

Reads OUTDIR/gpu-junit.xml, bench-compress.json and bench-train.json, and measures the GPU's
device-to-device copy bandwidth, so the codec's throughput is stated against it.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _copy_bandwidth() -> dict[str, Any]:
    """GB/s of a 1 GiB device-to-device copy, bytes read plus written (CUDA events)."""
    import torch

    n = 1 << 28
    a = torch.empty(n, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e) / 10
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_GBps": 2 * n * 4 / ms / 1e6,
    }


def _tests(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"error": "no junit file: pytest did not run"}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    cases = []
    for tc in suite.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "")[:300]
                break
        else:
            msg = ""
        cases.append(
            {
                "test": f"{tc.get('classname', '')}::{tc.get('name', '')}",
                "outcome": outcome,
                "seconds": float(tc.get("time", 0)),
                "message": msg,
            }
        )
    count = {
        k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")
    }
    return {"counts": count, "seconds": float(suite.get("time", 0)), "cases": cases}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"{path.name}: {exc}"}


def main() -> None:
    out = Path(sys.argv[1])
    rc, seconds = int(sys.argv[2]), int(sys.argv[3])
    gpu = _copy_bandwidth()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": gpu,
        "tests_exit_code": rc,
        "seconds": seconds,
        "tests": _tests(out / "gpu-junit.xml"),
        "compress": _load(out / "bench-compress.json"),
        "train": _load(out / "bench-train.json"),
    }
    codec = report["compress"].get("codec", []) if isinstance(report["compress"], dict) else []
    for r in codec:
        # worker side moves: read x and e, write e (3 passes) + signs; one read pass is n*4 B
        r["worker_min_passes"] = 3.0
        r["worker_vs_copy_bw"] = (
            3 * r["floats"] * 4 / (r["worker_ms"] / 1e3) / 1e9 / (gpu["copy_GBps"])
        )
    (out / "gpu-report.json").write_text(json.dumps(report, indent=2))

    lines = [
        f"# overlap GPU check: {gpu['device']}",
        "",
        f"{report['date']}, torch {gpu['torch']} (CUDA {gpu['cuda']}), "
        f"scripts/gpu-check.sh in {seconds} s. Device-to-device copy: "
        f"{gpu['copy_GBps']:.0f} GB/s (read + written).",
        "",
        "## tests/gpu",
        "",
    ]
    t = report["tests"]
    if "error" in t:
        lines.append(t["error"])
    else:
        c = t["counts"]
        lines.append(
            f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
            f"{c['skipped']} skipped in {t['seconds']:.0f} s."
        )
        bad = [x for x in t["cases"] if x["outcome"] in ("failed", "error")]
        for x in bad:
            lines.append(f"- **{x['outcome']}** `{x['test']}`: {x['message']}")
    lines += ["", "## Codec (`overlap bench compress --device cuda`)", ""]
    if codec:
        lines += [
            "| floats | read ms | worker ms | worker/read | server+rebuild/read | unpack/read "
            "| worker GB/s | worker traffic vs copy BW |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in codec:
            lines.append(
                f"| {r['floats'] / 2**20:.0f}M | {r['read_ms']:.3f} | {r['worker_ms']:.3f} "
                f"| {r['worker/read']:.2f} | {r.get('server+rebuild/read', float('nan')):.2f} "
                f"| {r['unpack/read']:.2f} | {r['worker_GBps']:.0f} "
                f"| {r['worker_vs_copy_bw']:.0%} |"
            )
    else:
        lines.append(f"not measured: {report['compress']}")
    lines += ["", "## Training step (`overlap bench train --device cuda`)", ""]
    rows = report["train"] if isinstance(report["train"], list) else []
    if rows:
        base = next((r["step_ms"] for r in rows if r["variant"] == "ddp"), None)
        lines += [
            f"{rows[0]['params'] / 1e6:.1f}M-parameter MLP, batch {rows[0]['batch']}, "
            f"{rows[0]['world']} NCCL rank (median step, device-synchronized).",
            "",
            "| variant | step ms | DDP / variant |",
            "|---|---:|---:|",
        ]
        for r in rows:
            ratio = f"{base / r['step_ms']:.2f}x" if base else ""
            lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {ratio} |")
    else:
        lines.append(f"not measured: {report['train']}")
    (out / "gpu-report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
