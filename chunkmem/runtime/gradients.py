"""Where a backward's gradients go: a strategy chosen once, when a model's runtime is built.

* :class:`StagedGradients` (``reuse_fp16_shard=False``): each parameter's gradient is added into a
  full-length buffer on the device tier (the chunk's gradient buffer itself when it rests on the device
  unsharded, else a staging buffer); when the chunk's gradients are complete they are reduced over the
  ranks (sharded) and rest in the chunk's gradient buffer where its Adam runs. Several backwards add up
  (gradient accumulation); inside ``no_sync`` a sharded chunk keeps accumulating in its staging buffer,
  unreduced, until the first backward outside.
* :class:`GradientsInParamMemory` (``reuse_fp16_shard=True``): each gradient is written into its 16-bit
  parameter's own memory once the parameter's backward is done (14 bytes per parameter in all); the
  step overwrites them with the new values. No accumulation: a second backward before the step is
  refused.

Either way a trainable parameter that receives no gradient in a backward gets zero, and so does the
chunk's padding.
"""
from __future__ import annotations

import torch

from ..core.chunk import MASTER, Chunk, ParamSlot
from ..errors import GradientAccumulationError
from ..core.tiers import Tier
from ..distributed.reduction import GradientReduction
from .executor import ChunkExecutor


class GradientStore:
    """One model's gradient strategy (see the module docstring). The runtime calls it; it moves chunk
    memory only through the executor."""

    in_param_memory = False
    """Whether the gradients live in the parameters' memory (no gradient or staging buffers): the
    runtime then holds a chunk's parameters on the device before handing it a gradient or finishing it."""

    def __init__(self, executor: ChunkExecutor, reduction: GradientReduction) -> None:
        self.executor = executor
        self.reduction = reduction

    def accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Take one parameter's gradient (from autograd) into its chunk."""
        raise NotImplementedError

    def finish(self, chunk: Chunk, deferred: bool) -> None:
        """The chunk's gradients of this backward are complete: zero what got none, and reduce them over
        the ranks into where they rest (``deferred``: inside ``no_sync``, keep them local)."""
        raise NotImplementedError

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        """This rank's shard of the chunk's finished gradient (where it rests), or ``None``."""
        raise NotImplementedError

    def drop(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero every chunk's finished gradients."""
        raise NotImplementedError

    def abandon(self, chunk: Chunk) -> None:
        """An interrupted backward: forget what it left unfinished in ``chunk``."""
        raise NotImplementedError

    def check_can_accumulate(self) -> None:
        """Raise :class:`~chunkmem.GradientAccumulationError` if a second backward (or ``no_sync``) cannot
        add to the gradients this strategy holds."""

    @staticmethod
    def _zero_unwritten(chunk: Chunk, flat: torch.Tensor) -> None:
        """Zero the slots of the parameters that received no gradient (frozen ones too: a parameter frozen
        after wrapping still has a slot in a trainable chunk), and the padding."""
        for slot in chunk.slots:
            if slot.index_in_chunk not in chunk.grad_slots_received:
                slot.view(flat).zero_()
        flat[chunk.used_numel:].zero_()


class StagedGradients(GradientStore):
    """Gradients accumulate in full-length device buffers, then rest reduced where Adam runs."""

    def _accumulator(self, chunk: Chunk) -> torch.Tensor:
        """The full-length device-tier buffer gradients of this backward go into. A buffer allocated in
        this backward is not zero-filled (``accumulator_fresh``): each slot's first gradient is copied in,
        and slots that get none are zeroed when the chunk finishes."""
        direct = self.executor.grad_tier(chunk) is Tier.DEVICE and not chunk.param.sharded
        buf = chunk.grad if direct else chunk.grad_staging
        if not buf.allocated:
            buf.allocate(Tier.DEVICE)
            buf.mark_written()  # it accumulates this backward's gradients from now on
            chunk.accumulator_fresh = True
        return buf.tensor

    def accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        staging = self._accumulator(chunk)
        if chunk.accumulator_fresh and slot.index_in_chunk not in chunk.grad_slots_received:
            slot.view(staging).copy_(grad)
        else:
            slot.view(staging).add_(grad)

    def finish(self, chunk: Chunk, deferred: bool) -> None:
        accumulator = self._accumulator(chunk)
        if chunk.accumulator_fresh:
            self._zero_unwritten(chunk, accumulator)
            chunk.accumulator_fresh = False
        if not chunk.grad_staging.allocated or deferred:  # (deferred: it keeps accumulating, unreduced)
            return
        sharded = chunk.param.sharded
        finished = self.reduction.reduce(accumulator, f"{chunk.name} gradients") if sharded else accumulator
        if chunk.grad.allocated:
            chunk.grad.tensor.add_(finished.to(chunk.grad.tensor.device))
        else:
            chunk.grad.allocate(self.executor.grad_tier(chunk)).copy_(finished)
            chunk.grad.mark_written()
        if chunk.grad.tier is Tier.HOST:
            chunk.memory.ledger.count_move(Tier.HOST, chunk.grad.nbytes)
        chunk.grad_staging.free()

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        return chunk.grad.tensor

    def drop(self, set_to_none: bool) -> None:
        for chunk in self.executor.chunks:
            if chunk.grad_staging.allocated and not chunk.grad_slots_received:
                chunk.grad_staging.free()
                chunk.accumulator_fresh = False
            if chunk.grad.allocated:
                if set_to_none:
                    chunk.grad.free()
                else:
                    chunk.grad.tensor.zero_()

    def abandon(self, chunk: Chunk) -> None:
        chunk.accumulator_fresh = False
        chunk.grad_staging.free()


class GradientsInParamMemory(GradientStore):
    """``reuse_fp16_shard``: each chunk's gradients are written over its 16-bit parameter memory."""

    in_param_memory = True

    def accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        if slot.index_in_chunk in chunk.grad_slots_received:
            raise GradientAccumulationError(
                f"parameter {slot.name!r} received a second gradient in one backward pass (reentrant "
                "activation checkpointing?); reuse_fp16_shard=True needs each gradient in one piece")
        slot.view(chunk.param.device).copy_(grad)  # (the runtime holds the chunk on the device)

    def finish(self, chunk: Chunk, deferred: bool) -> None:
        buf = chunk.param
        self._zero_unwritten(chunk, buf.device)
        if buf.sharded:
            buf.grads_in_shard(self.reduction.reduce(buf.device, f"{chunk.name} gradients"))
        else:
            buf.grads_in_device_copy()

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        buf = chunk.param
        if not buf.holds_grads:
            return None
        return buf.shard.tensor if buf.sharded else buf.current()

    def drop(self, set_to_none: bool) -> None:
        """The parameters' memory gets its values back from the fp32 masters (``set_to_none`` is moot:
        there is no gradient buffer to keep)."""
        for chunk in self.executor.chunks:
            if chunk.trainable and chunk.param.holds_grads:
                tier = self.executor.compute_tier(chunk)
                with self.executor.updating(chunk, tier) as target:
                    target.copy_(chunk.optim[MASTER].read())

    def abandon(self, chunk: Chunk) -> None:
        if chunk.grad_slots_received and chunk.param.shard_valid:
            chunk.param.drop_device_copy()

    def check_can_accumulate(self) -> None:
        if any(c.param.holds_grads for c in self.executor.chunks):
            raise GradientAccumulationError(
                "reuse_fp16_shard=True cannot accumulate gradients over two backward passes: call "
                "optim.step() or optim.zero_grad() between them, or use reuse_fp16_shard=False")


def gradient_store(in_param_memory: bool, executor: ChunkExecutor, reduction: GradientReduction) -> GradientStore:
    """The strategy for ``reuse_fp16_shard`` (``in_param_memory``)."""
    return (GradientsInParamMemory if in_param_memory else StagedGradients)(executor, reduction)
