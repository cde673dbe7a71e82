"""Benchmarks behind ``overlap bench``: shared statistics and table helpers, one module each."""

from __future__ import annotations

from overlap.bench.harness import Table, human_bytes, median

__all__ = ["Table", "human_bytes", "median"]
