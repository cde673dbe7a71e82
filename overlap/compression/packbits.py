"""Sign bits packed 8 to a byte, most significant bit first (bit-compatible with numpy.packbits).

A bit is 1 where the value is >= 0 (zero counts as positive, as in DeepSpeed's
``sign().add_(1).bool()``). One torch implementation serves CPU and CUDA: the 8 bool bytes of
each group are read as one int64 and gathered into a byte by a multiply with
0x8040201008040201, then ``>> 56``. Measured on this project's CPU (16M floats, one thread):
3.37 GB/s of fp32 input against 2.95 GB/s for ``np.packbits`` and 1.17 GB/s for the
shift-and-sum formulation, so the same path is used on CPU too.

Unpacking goes through a 256 x 8 lookup table of +-1 values (``table[byte]``), which also lets
the server step scale each rank's signs by indexing a pre-scaled table.
"""

from __future__ import annotations

import torch

__all__ = ["pack_signs", "sign_table", "unpack_signs"]

# 0x8040201008040201 as a signed int64 (two's complement).
_MAGIC = 0x8040201008040201 - (1 << 64)
_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x >= 0`` of a flat tensor whose length is a multiple of 8 into uint8, MSB first."""
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(
            f"pack_signs needs a flat tensor with a multiple of 8 elements, got "
            f"shape {tuple(x.shape)}"
        )
    bits = (x >= 0).view(torch.uint8)
    if bits.storage_offset() % 8:
        bits = bits.clone()
    words = bits.view(torch.int64)
    return ((words * _MAGIC) >> 56).to(torch.uint8)


def sign_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(256, 8) table: row b holds the +-1 values of byte b's bits, MSB first."""
    key = (device, dtype)
    table = _TABLES.get(key)
    if table is None:
        b = torch.arange(256, dtype=torch.int64).unsqueeze(1)
        shifts = torch.arange(7, -1, -1, dtype=torch.int64)
        table = (((b >> shifts) & 1) * 2 - 1).to(dtype=dtype, device=device)
        _TABLES[key] = table
    return table


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The +-1 values of ``packed`` (8 per byte, MSB first) as a flat tensor."""
    table = sign_table(packed.device, dtype)
    return table[packed.reshape(-1).long()].reshape(-1)
