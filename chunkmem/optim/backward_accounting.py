"""Which backward passes of a model the coming step may use: with a loss scaler, only those run through
``optim.backward`` / ``optim.backward_by_grad`` carry the loss scale.

The runtime counts every backward pass of the model (``runtime.backward_count``); :class:`BackwardAccounting`
counts those the optimizer ran itself, so that a plain ``loss.backward()`` of an fp16 model is refused at the
step instead of being divided by a scale it never carried.
"""
from __future__ import annotations

from typing import Callable

from ..errors import UnscaledBackwardError
from ..runtime.runtime import ChunkRuntime
from .mixed_precision import MixedPrecisionStep


class BackwardAccounting:
    """One optimizer's account of the model's backward passes (see the module docstring)."""

    def __init__(self, runtime: ChunkRuntime, mixed: MixedPrecisionStep) -> None:
        self.runtime = runtime
        self.mixed = mixed
        # backward passes of the model whose gradients may be stepped on (all of them without a scaler;
        # with one, those run by backward() / backward_by_grad())
        self.accounted = runtime.backward_count

    def run(self, run: Callable[[], None]) -> None:
        """Run a backward and count the model's backward passes it made as scaled."""
        before = self.runtime.backward_count
        try:
            run()
        except BaseException as error:
            self.runtime.abandon_iteration(error)
            raise
        finally:
            self.accounted += self.runtime.backward_count - before
            self.runtime.backward_returned()

    def check_scaled(self) -> None:
        """With a loss scaler, raise if a backward pass of the model did not go through ``optim.backward``."""
        if self.mixed.scaler is None:
            return
        unscaled = self.runtime.backward_count - self.accounted
        if unscaled:
            raise UnscaledBackwardError(
                f"{unscaled} backward pass(es) of the fp16 model since the last zero_grad() did not go through "
                f"the loss scaler (loss.backward()?): their gradients are not multiplied by the loss scale "
                f"({self.mixed.loss_scale}), so the step would divide them by it. Call optim.backward(loss) instead "
                f"of loss.backward(); call optim.zero_grad() to drop the gradients already accumulated")

    def forget(self) -> None:
        """The gradients were dropped: earlier backward passes no longer matter."""
        self.accounted = self.runtime.backward_count

    def discard_gradients(self) -> None:
        """Drop the gradients (a skipped step, a failed disk step that overwrote them): with
        ``reuse_fp16_shard`` the parameters' memory gets its values back from the masters."""
        self.runtime.drop_gradients(set_to_none=True)
        self.mixed.forget()
        self.forget()
