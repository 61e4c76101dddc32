"""The optimizer attached to a model's runtime: the one call back up the picture.

The runtime tells the optimizer of its model what it must know (a chunk's gradients are final, the
backward ended or failed) and asks it what only it knows (the gradients' multiplier, torch's gradient
idioms) through the declared :class:`OptimizerListener`. :class:`OptimizerLink` holds that listener
weakly (the model may outlive its optimizer) and answers for it when none is attached.
"""
from __future__ import annotations

import weakref
from typing import Any, Protocol

from ..core.chunk import Chunk, ParamSlot
from ..core.param_guard import ParameterAccessError


class OptimizerListener(Protocol):
    """What the runtime tells the optimizer attached to its model, and asks of it."""

    def on_grads_final(self, chunk: Chunk) -> None:
        """``chunk``'s gradients of this backward are reduced and rest where its update runs (outside
        ``no_sync``)."""

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        """What the next step multiplies the gradients by (unscaling and clipping; for ``slot``, with the
        factor torch's in-place idioms gave its gradient)."""

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on ``.grad`` stand-ins of the model's parameters (:mod:`chunkmem.optim.gradient_idioms`)."""

    def on_backward_failed(self) -> None:
        """A backward raised part-way: drop every pending gradient and undo what the backward started."""

    def on_backward_end(self) -> None:
        """The backward is over: finish the updates it started off autograd's thread (raising what failed)."""

    def check_no_step_in_flight(self, action: str) -> None:
        """Refuse ``action`` while updates a backward started wait for the step (``step_in_backward``)."""


class OptimizerLink:
    """The weak link from a runtime to its model's optimizer (see the module docstring)."""

    def __init__(self) -> None:
        self._listener: weakref.ref | None = None

    def attach(self, listener: OptimizerListener) -> None:
        self._listener = weakref.ref(listener)

    def detach(self) -> None:
        self._listener = None

    @property
    def attached(self) -> bool:
        return self._listener is not None

    def listener(self) -> OptimizerListener | None:
        """The attached optimizer, or ``None`` (none attached, or it was collected)."""
        return None if self._listener is None else self._listener()

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        optimizer = self.listener()
        return 1.0 if optimizer is None else optimizer.grad_multiplier(slot)

    def check_no_step_in_flight(self, action: str) -> None:
        optimizer = self.listener()
        if optimizer is not None:
            optimizer.check_no_step_in_flight(action)

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        optimizer = self.listener()
        if optimizer is None:
            raise ParameterAccessError(
                f"{getattr(func, '__name__', func)} on the gradient of a chunk-managed parameter of a model without "
                "a chunkmem optimizer: build ShardedOptimizerV2 (or chunkmem.initialize with an optimizer) first")
        return optimizer.run_gradient_idiom(func, args, kwargs)
