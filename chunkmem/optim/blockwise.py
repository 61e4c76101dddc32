"""Blockwise 8-bit quantization of optimizer state: the format of torchao's ``AdamW8bit`` / ``Adam8bit`` moments.

A tensor of ``n`` elements (``n`` a multiple of the block size, 256 by default) is cut into blocks of consecutive
elements. Each block keeps one fp32 **scale**, the largest magnitude in the block (at least ``1e-12``), and one
``uint8`` **code** per element: the index of the entry of a 256-entry **dynamic map** nearest to the element
divided by the scale. The map (:func:`dynamic_map`) spaces its entries evenly within each decade from 1e-7 to 1,
so small and large values keep the same relative precision: the signed map (for ``exp_avg``) holds 127 values of
each sign, 0 and 1; the unsigned one (for ``exp_avg_sq``) 254 positive values, 0 and 1.

Rounding is to the nearest entry, a tie going up: the code is the largest entry at or below the scaled value,
plus one where the value lies at least half-way to the next entry (computed as ``value - low >= (high - low) *
0.5`` in fp32). A scaled value below the first entry takes code 0; NaN takes code 0. Dequantizing multiplies the
code's entry by the block's scale in fp32. These are the reference's rules, so states quantized here and by
torchao hold the same bytes (``tests/test_low_bit_state.py`` compares them where torchao is installed).

Rounding to the nearest entry is also counting: the code of a scaled value is the number of the map's 255
**rounding thresholds** (the smallest floats that round past each entry: :func:`rounding_thresholds`) at or below
it. The host kernel counts them with one table lookup per value (:func:`bucket_words`).
"""
from __future__ import annotations

import functools

import torch

BLOCK_SIZE = 256
"""Elements per quantization block (torchao's ``AdamW8bit`` default)."""

MIN_QUANTIZED_NUMEL = 4096
"""A parameter with fewer elements keeps fp32 state, as torchao's 8-bit optimizers keep it for tensors under 4096
elements or whose size is not a multiple of the block size (decided on the whole parameter, also where its
elements are sharded over several ranks)."""

_DECADES = 7  # 1e-7 .. 1
_SCALE_FLOOR = 1e-12


def quantizes(numel: int, block_size: int = BLOCK_SIZE) -> bool:
    """Whether state of ``numel`` elements is kept in 8 bits (else fp32): at least :data:`MIN_QUANTIZED_NUMEL`
    elements, in whole blocks."""
    return numel >= MIN_QUANTIZED_NUMEL and numel % block_size == 0


@functools.lru_cache(maxsize=None)
def _map_values(signed: bool) -> tuple[float, ...]:
    values = [0.0, 1.0]
    for decade in range(_DECADES):
        count = 2 ** decade if signed else 2 ** (decade + 1)  # entries of each sign in this decade
        edges = torch.linspace(0.1, 1.0, count + 1)
        centres = (edges[:-1] + edges[1:]) / 2.0
        magnitude = 10.0 ** (decade - (_DECADES - 1))
        values += (magnitude * centres).tolist()  # fp32 products, as the reference computes them
        if signed:
            values += (-magnitude * centres).tolist()
    if len(values) != 256:
        raise AssertionError(f"the dynamic map has {len(values)} entries, not 256")
    return tuple(sorted(values))


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 fp32 entries of the dynamic map, ascending: ``signed`` for state that may be negative (Adam's
    ``exp_avg``), else for state that is not (``exp_avg_sq``)."""
    return torch.tensor(_map_values(signed), dtype=torch.float32, device=device)


def block_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The scales of blocks whose largest magnitudes are ``absmax`` (fp32): at least ``1e-12``."""
    return absmax.clamp_min(_SCALE_FLOOR)


def quantize_(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor,
              block_size: int = BLOCK_SIZE) -> None:
    """Quantize the flat fp32 ``values`` (``n`` elements, ``n % block_size == 0``) into ``codes`` (``uint8``,
    ``n``) and ``scales`` (fp32, ``n // block_size``), in place (see the module docstring)."""
    blocks = values.view(-1, block_size)
    scale = block_scale(blocks.abs().amax(-1))
    _encode_(blocks / scale.view(-1, 1), codes, qmap)
    scales.copy_(scale)


def quantize_part_(values: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> None:
    """Quantize the flat fp32 ``values``, a part of one block whose ``scale`` (one fp32 element, from
    :func:`block_scale` of the whole block's largest magnitude) is given, into ``codes`` (``uint8``), in place:
    the codes :func:`quantize_` gives these elements when it quantizes the whole block."""
    _encode_(values / scale, codes, qmap)


def _encode_(scaled: torch.Tensor, codes: torch.Tensor, qmap: torch.Tensor) -> None:
    scaled = scaled.reshape(-1)
    low = (torch.searchsorted(qmap, scaled, right=True) - 1).clamp_(0, 255)
    low = torch.where(torch.isnan(scaled), torch.zeros_like(low), low)
    high = (low + 1).clamp_(max=255)
    low_value, high_value = qmap[low], qmap[high]
    codes.copy_(torch.where(scaled - low_value >= (high_value - low_value) * 0.5, high, low))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor,
               block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The fp32 values of ``codes`` and ``scales`` (a new flat tensor of ``codes.numel()`` elements)."""
    return (qmap[codes.long()].view(-1, block_size) * scales.view(-1, 1)).view(-1)


def dequantize_part(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``codes``, a part of one block whose ``scale`` (one fp32 element) is given: what
    :func:`dequantize` gives these elements (a new flat tensor)."""
    return qmap[codes.long()] * scale


def rounding_thresholds(qmap: torch.Tensor) -> torch.Tensor:
    """For each entry ``c`` of the map but the last, the smallest fp32 value ``y`` that quantizes past it
    (``y - q[c] >= (q[c + 1] - q[c]) * 0.5`` in fp32): the code of a scaled value is the number of these at or
    below it (NaN aside)."""
    low, high = qmap[:-1], qmap[1:]
    half = (high - low) * 0.5
    rounds_up = lambda y: y - low >= half  # noqa: E731 - monotone in y
    found = low + half
    down, up = torch.tensor(-float("inf")), torch.tensor(float("inf"))
    for _ in range(8):  # a few ulps at most from the real half-way point
        below = torch.nextafter(found, down)
        found = torch.where(rounds_up(below), below, found)
        found = torch.where(rounds_up(found), found, torch.nextafter(found, up))
    if not bool(rounds_up(found).all()) or bool(rounds_up(torch.nextafter(found, down)).any()):
        raise RuntimeError("the map's rounding thresholds were not found")
    return found


def _order_keys(values: torch.Tensor) -> torch.Tensor:
    """Order-preserving unsigned keys of fp32 ``values``, as int64."""
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)


def bucket_words(qmap: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """The host kernel's table for quantizing with ``qmap`` (``csrc/low_bit_adam.cpp``, ``kFirstBucket``): for each
    of ``count`` buckets of order-preserving keys from ``first`` (the keys' top 16 bits), the number of rounding
    thresholds below the bucket << 17 | the low 16 bits of the one inside it (``0x10000``: none)."""
    keys = _order_keys(rounding_thresholds(qmap))
    buckets = torch.arange(first, first + count, dtype=torch.int64)
    below = torch.searchsorted(keys, buckets << 16)
    inside = torch.searchsorted(keys, (buckets + 1) << 16) - below
    if int(inside.max()) > 1:
        raise RuntimeError("a bucket of the quantization table holds two rounding thresholds")
    low = torch.where(inside == 1, keys[below.clamp(max=keys.numel() - 1)] & 0xFFFF, torch.full_like(below, 0x10000))
    return ((below << 17) | low).to(torch.int32)
