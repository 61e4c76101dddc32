"""The sum of squares behind the gradient norm (clipping, and fp16's overflow check), for CPU tensors.

``torch.linalg.vector_norm(t, dtype=torch.float32)`` converts a 16-bit CPU tensor element by element and
accumulates in fp32: about 1 G elements/s (2 cores of an AMD EPYC, and 16 cores of an Intel Xeon alike),
and a relative error near 1e-3 in the squared norm of a chunk of 34M elements. :func:`sum_of_squares`
squares each element exactly in double (a float has 24 significant bits, its square at most 48) and adds
in a fixed order: blocks of :data:`BLOCK` elements, each summed in 16 lanes (element ``16 t + j`` into
lane ``j``, in ``t`` order) that are combined as ``((l0 + l4) + (l8 + l12)) ...`` below, then the block
sums in block order. The native kernel (``chunkmem_sum_squares`` in ``csrc/host_adam.cpp``) does it at
the memory bandwidth; where it is unavailable or disabled (``CHUNKMEM_DISABLE_CPP_ADAM=1``),
:func:`sum_of_squares_reference` computes the same bits with torch ops, so that the norm (and a clipping
coefficient or an overflow decision drawn from it) never depends on whether the kernel was built.
"""
from __future__ import annotations

import torch

from . import host_adam_ext

BLOCK = 1 << 16
"""Elements per block of the fixed summation order (the kernel's ``kNormBlock``)."""
LANES = 16
SUMMED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes :func:`sum_of_squares` takes."""


def sum_of_squares(tensor: torch.Tensor) -> float:
    """The sum of the squares of a CPU tensor's elements (fp32, fp16 or bf16), in double, in the fixed
    order of the module docstring; inf or NaN where an element is."""
    if tensor.device.type != "cpu" or tensor.dtype not in SUMMED_DTYPES:
        raise ValueError(f"sum_of_squares takes an fp32, fp16 or bf16 CPU tensor, not {tensor.dtype} on "
                         f"{tensor.device}")
    flat = tensor.contiguous().reshape(-1)  # (contiguous() is the tensor itself when it already is)
    kernel = None if host_adam_ext.disabled() else host_adam_ext.kernel()
    if kernel is not None:
        return kernel.sum_squares(flat)
    return sum_of_squares_reference(flat)


def sum_of_squares_reference(flat: torch.Tensor) -> float:
    """:func:`sum_of_squares` of a flat CPU tensor with torch ops, bit for bit the kernel's result."""
    total = 0.0
    for start in range(0, flat.numel(), BLOCK):
        total += _block_sum(flat[start:start + BLOCK])
    return total


def _block_sum(block: torch.Tensor) -> float:
    body = block.numel() - block.numel() % LANES
    squares = block[:body].double().square().reshape(-1, LANES)
    # each lane's running sum, in t order (cumsum adds sequentially: one rounding per element, as the
    # kernel's fused multiply-add of an exact square does)
    lanes = squares.cumsum(0)[-1].tolist() if body else [0.0] * LANES
    # the kernel's four accumulators hold lanes 0-3, 4-7, 8-11 and 12-15, added (a0 + a1) + (a2 + a3) lane
    # by lane, then the four lanes as (l0 + l1) + (l2 + l3)
    acc = [(lanes[j] + lanes[4 + j]) + (lanes[8 + j] + lanes[12 + j]) for j in range(4)]
    total = (acc[0] + acc[1]) + (acc[2] + acc[3])
    for value in block[body:].double().tolist():
        total += value * value
    return total
