"""The gradient stores of a :class:`~chunkmem.LowLevelZeroOptimizer`: where each flat chunk's reduced gradients
are kept between the backward and the step.

A chunk's store holds what the bucketed reduction delivered to it (:meth:`GradientStores.add_mean`, called by
:mod:`chunkmem.distributed.bucketed_reduction`: the mean over the ranks, in the store's units, times the loss scale
with fp16): the whole chunk (stage 1) or only this rank's shard (stage 2, ``partition_grad``). Its memory is the
chunk's ``grad_buffer``, a :class:`~chunkmem.core.chunk.FlatBuffer` of the chunks' shared memory (family ``grad``,
counted by its ledger on the device tier, on the working chunk's device), allocated zero-filled at a backward's
first gradient for the chunk unless ``zero_grad`` kept it (as DDP keeps its buckets: STALE, zeroed then); a 16-bit
store holding an earlier backward's sum is widened to fp32 before the next backward adds to it (gradient
accumulation summed in fp32), unless ``grad_accum_dtype`` is the parameters' dtype. The step, the
``.grad`` stand-ins (:mod:`chunkmem.optim.zero_gradient_view`) and the accessors read this rank's part of it
(:meth:`GradientStores.own`, :meth:`GradientStores.grad_part`).
"""
from __future__ import annotations

import torch

from ..core.tiers import Tier
from ..distributed.collectives import ShardGroup
from .mixed_precision import MixedPrecisionStep
from .zero_partition import FlatChunk, FlatSlot


class GradientStores:
    """The gradient stores of one optimizer's chunks (see the module docstring).

    Args:
        chunks: the optimizer's flat chunks (each is given its store's buffer here, ``grad_buffer``; ``grad`` reads
            it).
        shards: the data-parallel ranks.
        mixed: the optimizer's mixed-precision step (the loss scale the stores are multiplied by; the groups a
            norm over sharded stores sums over).
        dtype: the working parameters' dtype (a new store's).
        partition_grad: stage 2: a store holds only this rank's shard of its chunk.
        accumulate_in_fp32: widen a 16-bit store holding an earlier backward's sum to fp32.
    """

    def __init__(self, chunks: list[FlatChunk], shards: ShardGroup, mixed: MixedPrecisionStep, dtype: torch.dtype,
                 partition_grad: bool, accumulate_in_fp32: bool) -> None:
        self.chunks = chunks
        self.shards = shards
        self.mixed = mixed
        self.dtype = dtype
        self.partition_grad = partition_grad
        self.accumulate_in_fp32 = accumulate_in_fp32
        # backwards begun so far: a store last added to in an earlier one holds that backward's sum (the reductions
        # of one backward may complete after it ends, with overlap_communication)
        self.backwards_begun = 0
        for chunk in chunks:
            chunk.make_grad_buffer(chunk.shard_numel if partition_grad else chunk.numel, dtype)

    @property
    def grads_sharded(self) -> bool:
        """Whether each rank holds only its shard of the reduced gradients (stage 2 over several ranks)."""
        return self.partition_grad and self.shards.sharded

    @property
    def loss_scale(self) -> float:
        """The loss scale the stores' gradients are multiplied by (1.0 without a scaler)."""
        return self.mixed.loss_scale

    def begin_backward(self) -> None:
        """A backward begins: the stores added to before it hold an earlier backward's sum."""
        self.backwards_begun += 1

    def store(self, chunk: FlatChunk) -> torch.Tensor:
        """Where ``chunk``'s reduced gradients of this backward are added: a 16-bit store holding an earlier
        backward's sum is widened to fp32 first (gradient accumulation summed in fp32, unless
        ``grad_accum_dtype`` is the parameters' dtype)."""
        buffer = chunk.grad_buffer
        if not buffer.allocated:
            buffer.allocate(Tier.DEVICE, zero=True)
        elif chunk.grad is None:  # the memory zero_grad kept: already touched, no page faults, no allocator call
            buffer.tensor.zero_()
            buffer.mark_written()
        elif (self.accumulate_in_fp32 and chunk.grad_backward != self.backwards_begun
              and buffer.dtype != torch.float32):
            buffer.widen(torch.float32)
        chunk.grad_backward = self.backwards_begun
        return buffer.tensor

    def add_mean(self, slot: FlatSlot, kept: tuple[int, int] | None, mean: torch.Tensor) -> None:
        """Add ``mean`` (the mean over the ranks of ``slot``'s gradient elements ``kept``, in the reduction
        dtype) into ``slot``'s chunk's store, made or widened first (:meth:`store`) even when this rank keeps
        none of the gradient (``kept`` ``None``)."""
        store = self.store(slot.chunk)
        if kept is None:
            return
        start = slot.offset + kept[0] - (slot.chunk.shard_offset if self.partition_grad else 0)
        target = store[start:start + kept[1] - kept[0]]
        target.add_(mean.to(target.device, target.dtype))

    def own(self, chunk: FlatChunk) -> torch.Tensor:
        """This rank's shard of ``chunk``'s store (made zeroed when it has none)."""
        store = self.store(chunk)
        return store if self.partition_grad else chunk.own(store)

    def grad_part(self, slot: FlatSlot) -> torch.Tensor | None:
        """This rank's elements of ``slot``'s reduced gradient in its chunk's store, as a flat view (the whole
        parameter unless :attr:`grads_sharded`; possibly empty), in the store's units (times the loss
        scale with fp16); ``None`` while the chunk has no store."""
        store = slot.chunk.grad
        if store is None:
            return None
        if not self.partition_grad:
            return store[slot.offset:slot.offset + slot.numel]
        run = slot.chunk.own_run(slot)
        return store[:0] if run is None else store[run[0]:run[1]]

    def release(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``: no parameter has a gradient any more; the store's memory is kept for the next
        backward unless it was widened for accumulation, as the next backward's is 16-bit) or zero the stores."""
        for chunk in self.chunks:
            if set_to_none:  # zeroed gradients still count: torch steps a parameter whose .grad is zeros
                chunk.slots_with_grads.clear()
            buffer = chunk.grad_buffer
            if chunk.grad is None:
                continue
            if not set_to_none:
                buffer.tensor.zero_()
            elif buffer.dtype == buffer.base_dtype:
                buffer.mark_outdated()  # kept (STALE) for the next backward
            else:
                buffer.free()
