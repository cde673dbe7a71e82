"""The examples run, and the pipeline equals the same model in one process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from examples import pipeline_async
from overlap.testing import RankPool

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_matches_single_process(pools: Callable[[int], RankPool], stages: int) -> None:
    results = pools(stages).run(pipeline_async.stage_main, timeout=120)
    ref = pipeline_async.reference(stages)
    losses = [r["loss"] for r in results]
    assert losses[:-1] == [None] * (stages - 1)
    assert abs(losses[-1] - ref["loss"]) < 1e-6
    for r in results:
        for got, want in zip(r["grads"], ref["grads"][r["stage"]], strict=True):
            assert torch.allclose(got, want, atol=1e-6), (r["stage"], (got - want).abs().max())


def test_pipeline_example_runs_standalone() -> None:
    out = subprocess.run(
        [sys.executable, "examples/pipeline_async.py", "--stages", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "loss" in out.stdout
