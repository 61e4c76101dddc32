"""torch's ``optimizer.step(closure)`` contract, for chunkmem's two optimizers.

``closure`` (a callable that recomputes the loss, forward and backward) runs once with autograd enabled before
the update, and ``step`` then returns what it returned; without one ``step`` returns whether the parameters were
updated. Accelerate passes a closure to every ``step``; an optimizer that re-evaluates the closure several
times (L-BFGS) is not steppable by chunkmem (:mod:`chunkmem.optim.any_optimizer`), so once is the contract.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ArgumentTypeError


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """The loss ``closure()`` returns (computed with autograd on), or ``None`` without a closure."""
    if closure is None:
        return None
    if not callable(closure):
        raise ArgumentTypeError("closure", type(closure).__name__, "None or a callable returning the loss")
    with torch.enable_grad():
        return closure()
