"""Gradient compression: DeepSpeed's 1-bit allreduce, casts, int8/fp8
block quantization and PowerSGD.

``compressed_allreduce(buffer, worker_error, server_error)`` is the exact two-phase 1-bit
algorithm; the :class:`Compressor` classes wrap each method with per-bucket state for the
scheduler.
"""

from __future__ import annotations

from overlap.comm.steps import run, run_async, steps_handle
from overlap.compression.auto import Auto
from overlap.compression.base import BF16, FP16, Compressor, NoCompression
from overlap.compression.onebit import (
    OneBit,
    compressed_allreduce,
    compressed_bytes,
    padded_numel,
)
from overlap.compression.packbits import pack_signs, unpack_signs
from overlap.compression.powersgd import PowerSGD
from overlap.compression.quantize import FP8, BlockCodes, Int8

__all__ = [
    "Auto",
    "BF16",
    "BlockCodes",
    "FP16",
    "Compressor",
    "FP8",
    "Int8",
    "NoCompression",
    "OneBit",
    "PowerSGD",
    "compressed_allreduce",
    "compressed_bytes",
    "pack_signs",
    "padded_numel",
    "run",
    "run_async",
    "steps_handle",
    "unpack_signs",
]
