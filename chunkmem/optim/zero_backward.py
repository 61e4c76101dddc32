"""The backward side of a :class:`~chunkmem.LowLevelZeroOptimizer`: each gradient taken as autograd finishes it,
reduced into the gradient stores, and the account of the backwards the step relies on.

Autograd's hook on each trainable parameter (:meth:`ZeroBackward.on_grad`) hands its gradient to the bucketed mode
of the runtime's gradient reduction (:mod:`chunkmem.distributed.bucketed_reduction`), which delivers the means into
the stores, and leaves the ``.grad`` stand-in (:mod:`chunkmem.optim.zero_gradient_view`) in its place; the first
gradient of a backward runs the ranks' agreement and queues the backward's end, where the reductions complete
(:meth:`ZeroBackward.finish`), whether the backward went through ``optim.backward`` or not. Inside ``no_sync`` the
gradients stay local in ``param.grad`` until the first backward outside. The account says whether gradients are
pending, whether a backward of fp16 parameters bypassed the loss scaler, and how many backwards and steps the ranks
have run (what they agree on); ``zero_grad`` drops or zeroes it all.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed.agreement import agree_on_point
from ..distributed.bucketed_reduction import BucketedReduction
from ..distributed.reduction import GradientReduction
from ..runtime.hooks import at_backward_end
from ..runtime.no_sync import NoSync
from .zero_gradient_store import GradientStores
from .zero_gradient_view import GradientViews
from .zero_partition import FlatSlot


class ZeroBackward:
    """One optimizer's backwards (see the module docstring).

    Args:
        stores: the chunks' gradient stores.
        slot_of: ``id(parameter)`` -> its place in the chunks, for each trainable parameter.
        communication_dtype, reduce_bucket_size, overlap_communication: the reduction's dtype, bucket size
            (elements) and overlap (:class:`~chunkmem.distributed.bucketed_reduction.BucketedReduction`).
    """

    def __init__(self, stores: GradientStores, slot_of: dict[int, FlatSlot], communication_dtype: torch.dtype,
                 reduce_bucket_size: int, overlap_communication: bool) -> None:
        self.stores = stores
        self.slot_of = slot_of
        self.buckets = BucketedReduction(GradientReduction(stores.shards), communication_dtype, reduce_bucket_size,
                                         overlap_communication, stores.partition_grad, stores.add_mean)
        self.views = GradientViews(stores)  # param.grad: stand-ins for the gradients in the stores
        self.no_sync = NoSync()  # the chunk runtime's no_sync() scope; inside, the gradients stay in param.grad
        self.in_backward = False  # inside optim.backward()
        self.unscaled = False  # a backward of fp16 parameters bypassed the loss scaler
        self.pending = False  # gradients reduced (or deferred) since the last step or zero_grad
        self.backwards = 0  # backward passes with gradients so far
        self.steps = 0  # step() calls so far (the optimizer counts them)
        self._agreed = False  # the running backward's agreement ran

    @property
    def deferring(self) -> bool:
        """Whether gradients stay local in ``param.grad`` now: inside ``no_sync`` over several ranks. With one
        rank there is no collective to defer, and a gradient added at once to the store is summed in the order
        autograd sums torch's ``.grad`` (a sum kept local and added at the end would be reassociated:
        ``g1 + (g2 + g3)`` instead of ``(g1 + g2) + g3``, off in the last bits)."""
        return self.no_sync.active and self.stores.shards.sharded

    def on_grad(self, param: nn.Parameter) -> None:
        """A parameter's gradient is final in this backward (autograd's hook): the first of a backward
        runs the ranks' agreement first, then the gradient goes to the buckets."""
        if not self._agreed:
            self._agreed = True
            self.stores.begin_backward()
            at_backward_end(self._backward_ended)
            agree_on_point(self.stores.shards, "backward", "LowLevelZeroOptimizer's backward",
                           [("backward passes so far", self.backwards), ("optimizer steps so far", self.steps),
                            ("inside no_sync", self.no_sync.active)])
        self.take(param)

    def _backward_ended(self) -> None:
        """The backward's final callback (every rank runs the same backward): its reductions complete here,
        ``loss.backward()`` as ``optim.backward``, so the ``.grad`` stand-ins read finished stores."""
        self._agreed = False
        self.backwards += 1
        self.finish()

    def take(self, param: nn.Parameter) -> None:
        """Send ``param``'s local gradient (what autograd left in ``param.grad``, or added to its stand-in)
        to the buckets and leave the stand-in in ``param.grad``; inside ``no_sync`` it stays local."""
        slot = self.slot_of[id(param)]
        grad = self.views.settle(slot, take=not self.deferring)
        if grad is None:
            return
        if self.stores.mixed.scaler is not None and not self.in_backward:
            self.unscaled = True
        slot.chunk.slots_with_grads.add(slot.index_in_chunk)
        self.buckets.add(slot, grad)
        self.views.install(slot)
        self.pending = True

    def finish(self) -> None:
        """Take gradients autograd left in ``param.grad`` (accumulated inside ``no_sync`` and not
        touched since; a ``param.grad`` the user set), then reduce what is left and wait for every
        collective in flight."""
        if self.deferring:
            return
        for slot in self.slot_of.values():
            self.take(slot.param)
        self.buckets.finish()
        self.views.changed()

    def run(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` times the loss scale, then the reductions (``optim.backward``)."""
        mixed = self.stores.mixed
        self.in_backward = True
        try:
            (loss * mixed.loss_scale if mixed.scaler is not None else loss).backward()
        finally:
            self.in_backward = False
        self.finish()

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero the reduced gradients, and drop gradients accumulated inside
        ``no_sync`` and collectives in flight (``optim.zero_grad``)."""
        if not self.buckets.idle:  # the collectives every rank started must complete on every rank
            self.buckets.finish()
        assigned: set[int] = set()  # slot.index: a tensor the user set as .grad, zeroed in place as torch does
        if not set_to_none:  # a gradient whose .grad the user set to None is gone, not zeroed
            for slot in self.slot_of.values():
                self.views.settle(slot, take=False)
                if slot.param.grad is not None and slot.param.grad is not self.views.current(slot):
                    assigned.add(slot.index)
        self.stores.release(set_to_none)
        self.views.clear(keep=not set_to_none)
        for slot in self.slot_of.values():  # zeroed: the stand-ins stay (reading zeros), as torch's zeroed .grad
            if slot.index in assigned:
                _zero_in_place(slot.param.grad)  # the next step takes it, a zero gradient, as any set .grad
            else:
                slot.param.grad = None if set_to_none else self.views.current(slot)
        # zeroed gradients are still gradients: the next step updates those parameters, as torch's does
        self.pending = not set_to_none and (bool(assigned) or any(c.slots_with_grads for c in self.stores.chunks))
        self.unscaled = False


def _zero_in_place(grad: torch.Tensor) -> None:
    """Zero a ``.grad`` tensor the user set, as ``torch.optim.Optimizer.zero_grad(set_to_none=False)`` zeroes
    one: out of any autograd graph first, then in place (the same tensor object stays ``param.grad``)."""
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()
