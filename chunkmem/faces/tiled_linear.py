""":class:`TiledLinear`: a linear layer cut into tiles that are separate modules, so that chunkmem fetches
one tile's chunk at a time and a single operator may be larger than the device tier (DeepSpeed's
memory-centric tiling, ``deepspeed.zero.TiledLinear``, same signature).

The weight ``[out_features, in_features]`` is cut into ``out_splits`` row blocks and ``in_splits`` column
blocks (as even as possible: the first ``n % splits`` blocks are one larger). Tile ``(j, i)`` is a
``linear_cls(in_block_i, out_block_j)``; only the last column block of each row carries the bias. The output's
block ``j`` is the sum over ``i`` of tile ``(j, i)`` applied to the input's column block ``i``, in order of
``i``; the blocks are concatenated along the last dimension. This equals ``nn.Linear`` up to the order of
the summation (fp32: within 1e-6 relative). Give the model a chunk size near one tile's bytes so that
each tile has a chunk of its own.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..errors import ArgumentTypeError, InvalidArgumentError, check_number, check_type
from ..runtime.parameter_access import GatheredParameters

__all__ = ["TiledLinear"]


def split_points(n: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries cutting ``n`` items into ``parts`` blocks, the first ``n % parts`` one larger
    (DeepSpeed's uniform partition)."""
    size, extra = divmod(n, parts)
    points = [0]
    for p in range(parts):
        points.append(points[-1] + size + (1 if p < extra else 0))
    return points


class TiledLinear(nn.Module):
    """A linear layer as ``out_splits`` x ``in_splits`` tiles (see the module docstring).

    Args:
        in_features, out_features, bias: as ``torch.nn.Linear``.
        in_splits: column blocks, in ``[1, in_features]``.
        out_splits: row blocks, in ``[1, out_features]``.
        input_is_already_split: the input of :meth:`forward` is a list of ``in_splits`` tensors, one per
            column block.
        combine_out_splits: ``False``: :meth:`forward` returns the list of ``out_splits`` output blocks.
        linear_cls: the class of a tile (``torch.nn.Linear`` or a subclass taking the same arguments).
        init_linear: a linear layer whose weight and bias are copied in (:meth:`copy_params_from`).
        kwargs: further arguments of ``linear_cls`` (``device``, ``dtype``, ...).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: nn.Module | None = None, **kwargs: Any) -> None:
        super().__init__()
        check_number("in_features", in_features, low=1, integer=True)
        check_number("out_features", out_features, low=1, integer=True)
        check_number("in_splits", in_splits, low=1, high=in_features, integer=True)
        check_number("out_splits", out_splits, low=1, high=out_features, integer=True)
        for name, value in (("bias", bias), ("input_is_already_split", input_is_already_split),
                            ("combine_out_splits", combine_out_splits)):
            check_type(name, value, bool, "True or False")
        if not (isinstance(linear_cls, type) and issubclass(linear_cls, nn.Module)):
            raise ArgumentTypeError("linear_cls", linear_cls, "a torch.nn.Module class such as torch.nn.Linear")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = split_points(in_features, in_splits)
        self.out_parts = split_points(out_features, out_splits)
        self.linears = nn.ModuleList()
        for j in range(out_splits):
            row = nn.ModuleList()
            for i in range(in_splits):
                row.append(linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[j + 1] - self.out_parts[j],
                                      bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        if self.input_is_already_split and self.in_splits > 1:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise InvalidArgumentError("input_", f"{len(inputs)} tensors", f"{self.in_splits} (in_splits) tensors")
        elif self.in_splits > 1:
            sizes = [b - a for a, b in zip(self.in_parts, self.in_parts[1:])]
            inputs = list(torch.split(input_, sizes, dim=-1))
        else:
            inputs = [input_]
        outputs = []
        for row in self.linears:
            out = row[0](inputs[0])
            for tile, x in zip(row[1:], inputs[1:]):
                out = out + tile(x)
            outputs.append(out)
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other.weight`` (``[out_features, in_features]``) and ``other.bias`` into the tiles. With
        chunk-managed tiles this gathers them and writes the values of data-parallel rank 0 on every
        rank (every rank calls it)."""
        weight = getattr(other, "weight", None)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (self.out_features, self.in_features):
            raise InvalidArgumentError("other", type(other).__name__,
                                       f"a linear layer with a weight of shape {(self.out_features, self.in_features)}")
        other_bias = getattr(other, "bias", None)
        if self.use_bias != (other_bias is not None):
            raise InvalidArgumentError("other", f"a layer {'without' if self.use_bias else 'with'} a bias",
                                       f"a layer {'with' if self.use_bias else 'without'} a bias, as this one")
        for j, row in enumerate(self.linears):
            rows = slice(self.out_parts[j], self.out_parts[j + 1])
            for i, tile in enumerate(row):
                params = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                with GatheredParameters(params, modifier_rank=0):
                    tile.weight.copy_(weight[rows, self.in_parts[i]:self.in_parts[i + 1]])
                    if tile.bias is not None:
                        tile.bias.copy_(other_bias[rows])
