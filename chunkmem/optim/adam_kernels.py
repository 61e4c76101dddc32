"""Adam update kernels over flat buffers: one call updates a whole chunk.

``adam_update_`` is what callers use: on contiguous CPU buffers it runs the one-pass C++ kernel of
:mod:`chunkmem.optim.host_adam_ext` (built on first use; the same operations and roundings except for a
correctly rounded square root, one pass over memory instead of about ten; fp32 gradients only where
that makes it bitwise equal to the reference formulation, see there), and everywhere else, or when that
kernel is unavailable or disabled with ``CHUNKMEM_DISABLE_CPP_ADAM=1``, the torch-op formulation of
:mod:`chunkmem.optim.adam_math`.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from . import host_adam_ext
from .adam_math import AdamHyper, adam_update_torch_


def adam_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: int, hyper: AdamHyper, grad_multiplier: float = 1.0,
                 param_out: torch.Tensor | None = None, fp32_within_ulp: bool = False,
                 param_spans: list[tuple[int, int]] | None = None,
                 undo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One Adam step on flat buffers, in place (arguments as for :func:`adam_update_torch_`): the host
    kernel where it applies, else the torch-op formulation. ``fp32_within_ulp``, ``param_spans`` (where
    the parameters packed in the buffers begin and end): see
    :func:`chunkmem.optim.host_adam_ext.try_update`. ``undo``: three buffers like ``master`` that receive
    ``master``, ``exp_avg`` and ``exp_avg_sq`` as they were before the update (by the kernel in its pass
    over memory, else copied first)."""
    try:
        if host_adam_ext.try_update(master, grad, exp_avg, exp_avg_sq, step, hyper, grad_multiplier, param_out,
                                    fp32_within_ulp, param_spans, undo):
            return
    except BaseException:
        _save(undo, master, exp_avg, exp_avg_sq)  # the kernel refused before writing anything
        raise
    _save(undo, master, exp_avg, exp_avg_sq)
    adam_update_torch_(master, grad, exp_avg, exp_avg_sq, step, hyper, grad_multiplier, param_out)


def _save(undo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, *state: torch.Tensor) -> None:
    for saved, values in zip(undo or (), state):
        saved.copy_(values)


def adam_update_pieces_(master: torch.Tensor, grad: host_adam_ext.GradPieces, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper, grad_multiplier: float = 1.0,
                        param_out: torch.Tensor | None = None,
                        param_spans: list[tuple[int, int]] | None = None) -> bool:
    """:func:`adam_update_` with the gradient in pieces (``(offset, tensor)``, see
    :data:`~chunkmem.optim.host_adam_ext.GradPieces`), which only the host kernel reads: ``False`` (nothing
    done) where it does not apply; the caller then updates from the flat gradient."""
    return host_adam_ext.try_update(master, grad, exp_avg, exp_avg_sq, step, hyper, grad_multiplier, param_out,
                                    False, param_spans)


def param_spans(slots: Iterable[Any], origin: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` element spans of the parameters of ``slots`` (each with ``offset`` and
    ``numel`` in elements of its chunk) relative to element ``origin`` of the chunk (a shard's start):
    what :func:`adam_update_` takes as ``param_spans``."""
    return [(slot.offset - origin, slot.offset + slot.numel - origin) for slot in slots]
