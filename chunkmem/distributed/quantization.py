"""Blockwise int8 quantization for collectives (ZeRO++'s qgZ: quantized gradient reduction).

A tensor of ``rows × n`` elements is cut, row by row, into blocks of :data:`BLOCK` elements (the last block
of a row shorter); each block gets one fp32 scale, ``max |x| / 127``, and its elements become
``round(x / scale)`` in ``[-127, 127]``. Dequantized, an element is off by at most half its block's scale:
``max |x| / 254`` of its block (0.4% of the block's largest magnitude). A block holding an inf or NaN
dequantizes to NaN in every element, so an overflow is never hidden (the loss scaler still sees it).
:func:`pack` lays each row's int8 values and then its scales' bytes side by side in one ``uint8`` row, so a
row travels in one collective: ``n + 4 · ceil(n / BLOCK)`` bytes instead of ``n`` times the element size.
"""
from __future__ import annotations

import torch

__all__ = ["BLOCK", "dequantize", "pack", "packed_numel", "quantize", "unpack"]

BLOCK = 2048
"""Elements per quantization block (one fp32 scale each)."""

_LEVELS = 127.0


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def packed_numel(n: int) -> int:
    """Bytes of one packed row of ``n`` elements."""
    return n + 4 * _blocks(n)


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (2-D, floating) as int8 values (same shape) and fp32 scales (``rows × blocks``)."""
    count, n = rows.shape
    blocks = _blocks(n)
    padded = torch.zeros(count, blocks * BLOCK, dtype=torch.float32, device=rows.device)
    padded[:, :n] = rows
    by_block = padded.view(count, blocks, BLOCK)
    scales = by_block.abs().amax(dim=2) / _LEVELS
    finite = torch.isfinite(scales)
    safe = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
    values = torch.round(by_block / safe.unsqueeze(2)).clamp_(-_LEVELS, _LEVELS)
    values = torch.where(finite.unsqueeze(2), values, torch.zeros_like(values))
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    return values.to(torch.int8).view(count, blocks * BLOCK)[:, :n], scales


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 rows that :func:`quantize` gave ``values`` and ``scales`` for (NaN where a block was not
    finite)."""
    count, n = values.shape
    blocks = scales.shape[1]
    padded = torch.zeros(count, blocks * BLOCK, dtype=torch.float32, device=values.device)
    padded[:, :n] = values
    return (padded.view(count, blocks, BLOCK) * scales.unsqueeze(2)).view(count, blocks * BLOCK)[:, :n]


def pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One ``uint8`` row per row: its int8 values, then its scales' bytes."""
    count, n = values.shape
    out = torch.empty(count, packed_numel(n), dtype=torch.uint8, device=values.device)
    out[:, :n] = values.view(torch.uint8)
    out[:, n:] = scales.contiguous().view(torch.uint8).view(count, -1)
    return out


def unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and scales :func:`pack` laid out (rows of ``n`` elements)."""
    count = packed.shape[0]
    values = packed[:, :n].contiguous().view(torch.int8)
    scales = packed[:, n:].contiguous().view(torch.float32).view(count, _blocks(n))
    return values, scales
