"""Where a backward's gradients land, and when they are final: a chunk's gradients from the first that arrives
to the optimizer hearing that they rest where its update runs.

The runtime hands over each parameter's gradient as autograd gives it (:meth:`GradientLanding.receive`);
when a chunk has one for each of its trainable parameters (or the backward ends: :meth:`GradientLanding.finish`)
its gradients are finished: reduced over the ranks (sharded; left running while the backward goes on, at most
``reductions_in_flight`` of them, the oldest completed first), then settled where the chunk's update runs,
and the optimizer is told (:meth:`~chunkmem.runtime.optimizer_link.OptimizerListener.on_grads_final`, not
inside ``no_sync``). The order in which chunks became final is kept for the step
(:meth:`GradientLanding.in_landing_order`). The gradients' bytes are the strategy's
(:mod:`chunkmem.runtime.gradients`); moving chunks is the executor's.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable

import torch

from ..core.chunk import Chunk, ParamSlot
from ..errors import GradientAccumulationError
from .executor import ChunkExecutor
from .gradients import GradientStore
from .no_sync import NoSync
from .optimizer_link import OptimizerLink
from .schedule import Scheduler


class GradientLanding:
    """One model's gradients from autograd to the optimizer (see the module docstring). ``hold_for_backward``
    is the runtime's: it holds chunks on the device for the backward (gradients in the parameters' memory
    need the chunk's device copy until they are finished)."""

    def __init__(self, gradients: GradientStore, executor: ChunkExecutor, scheduler: Scheduler,
                 optimizer: OptimizerLink, hold_for_backward: Callable[[list[Chunk]], None],
                 reductions_in_flight: int) -> None:
        self.gradients = gradients
        self._executor = executor
        self._scheduler = scheduler
        self._optimizer = optimizer
        self._hold_for_backward = hold_for_backward
        self.reductions_in_flight = reductions_in_flight  # the bound (see ShardedModelV2's argument)
        self.grads_pending = False  # a backward left gradients no step or zero_grad consumed yet
        self.no_sync = NoSync()  # model.no_sync(): sharded gradients accumulate unreduced inside
        self._reducing: deque[Chunk] = deque()  # chunks whose gradient reductions run, oldest first
        self._final_order: dict[Chunk, None] = {}  # chunks whose gradients became final since they were dropped

    def refuse_forward_over_gradients(self) -> None:
        """Raise :class:`~chunkmem.GradientAccumulationError` while the last backward's gradients are in the
        parameters' memory (``reuse_fp16_shard``): a forward would compute with them."""
        if any(c.param.holds_grads for c in self._executor.chunks):
            raise GradientAccumulationError(
                "forward called while gradients from the last backward are still in the parameters' memory "
                "(reuse_fp16_shard=True): call optim.step() or optim.zero_grad() first; gradient "
                "accumulation needs reuse_fp16_shard=False")

    def receive(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Autograd's gradient of ``slot``'s parameter: into the chunk; the chunk's gradients are finished
        once every trainable slot has one."""
        if not chunk.grad_slots_received:
            self._scheduler.grads_started(chunk.index)
            chunk.grads_expected = len(chunk.trainable_slots())  # once a backward: every slot is read
        self.hold_where_gradients_land(chunk)
        self.gradients.accumulate(chunk, slot, grad)
        chunk.grad_slots_received.add(slot.index_in_chunk)
        chunk.slots_with_grads.add(slot.index_in_chunk)
        if len(chunk.grad_slots_received) == chunk.grads_expected:
            self.finish(chunk)

    def hold_where_gradients_land(self, chunk: Chunk) -> None:
        """Gradients written into the parameters' memory need the chunk's device copy until they are finished."""
        if self.gradients.in_param_memory:
            self._hold_for_backward([chunk])

    def finish(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are complete: reduce them over the ranks (sharded; left
        running when reductions may be in flight), let the parameters go back to their resting tier, and,
        once the reduction is done, let the gradients rest where the update runs and tell the optimizer."""
        deferred = self.no_sync.active and chunk.param.sharded
        self.hold_where_gradients_land(chunk)
        running = self.gradients.finish(chunk, deferred, overlap=self.reductions_in_flight > 0)
        chunk.grad_slots_received.clear()
        chunk.grads_finished = True
        chunk.unhold()
        self.grads_pending = self.grads_pending or not deferred
        if running:
            self._reducing.append(chunk)
            self._executor.log_event("reduce", chunk.index, "started")
            self.complete_reductions(self.reductions_in_flight)
        else:
            self._final(chunk)

    def complete_reductions(self, keep: int) -> None:
        """Wait for the oldest reductions in flight until at most ``keep`` remain."""
        while len(self._reducing) > keep:
            chunk = self._reducing.popleft()
            self.gradients.complete(chunk)
            self._executor.log_event("reduce", chunk.index, "done")
            self._final(chunk)

    def _final(self, chunk: Chunk) -> None:
        """The chunk's gradients are reduced: they rest where its update runs; the optimizer hears of it."""
        self._scheduler.grads_finished(chunk.index)
        self._final_order.setdefault(chunk)
        self._executor.settle(chunk)
        optimizer = self._optimizer.listener()
        if optimizer is not None and not self.no_sync.active:
            optimizer.on_grads_final(chunk)

    def in_landing_order(self, trainable: list[Chunk]) -> list[Chunk]:
        """``trainable`` in the order their gradients became final, then the others in their order."""
        present = set(trainable)
        return [c for c in self._final_order if c in present] + [c for c in trainable if c not in self._final_order]

    def abandon(self, chunk: Chunk) -> None:
        """An interrupted backward: forget what it left unfinished in ``chunk``."""
        self.gradients.abandon(chunk)
        chunk.grad_slots_received.clear()
        chunk.grads_finished = False

    def drop(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero every finished gradient, and what ``no_sync`` accumulated. Zeroed
        gradients are still pending: the next step updates each parameter that had one with a zero gradient,
        as torch steps a parameter whose ``.grad`` is a zero tensor (gradients in the parameters' memory are
        gone once zeroed: nothing stays pending)."""
        self.gradients.drop(set_to_none)
        if set_to_none:
            for chunk in self._executor.chunks:
                chunk.slots_with_grads.clear()
        self.grads_pending = not set_to_none and not self.gradients.in_param_memory and any(
            chunk.slots_with_grads for chunk in self._executor.chunks if chunk.trainable)
        self._final_order.clear()

    def drop_after_failed_backward(self) -> None:
        """A backward failed part-way: no pending gradient stays; the optimizer undoes what the backward
        started (:meth:`~chunkmem.runtime.optimizer_link.OptimizerListener.on_backward_failed`)."""
        optimizer = self._optimizer.listener()
        if optimizer is not None:
            optimizer.on_backward_failed()
        else:
            self.drop(set_to_none=True)
        self.grads_pending = False

    def deferring(self) -> contextlib.AbstractContextManager[None]:
        """``model.no_sync()``: sharded gradients accumulate locally, unreduced, inside."""
        return self.no_sync.scope(self.gradients.check_can_defer)
