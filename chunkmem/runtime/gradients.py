"""Where a backward's gradients go: a strategy chosen once, when a model's runtime is built.

* :class:`StagedGradients` (``reuse_fp16_shard=False``): each parameter's gradient is added into a
  full-length buffer on the device tier (the chunk's gradient buffer itself when it rests on the device
  unsharded, else a staging buffer); when the chunk's gradients are complete they are reduced over the
  ranks (sharded) and rest in the chunk's gradient buffer where its Adam runs. Several backwards add up
  (gradient accumulation); inside ``no_sync`` a sharded chunk keeps accumulating in its staging buffer,
  unreduced, until the first backward outside. 16-bit sums of several backwards are kept in fp32 (the
  buffer holding an earlier backward's sum is widened when the next one's first gradient comes), unless
  ``grad_accum_dtype`` is the model's dtype.
  Where the device tier is the CPU and a chunk's gradients rest there unsharded, the chunk keeps the
  tensors autograd produced instead (one a parameter, counted on the ledger as the chunk's gradient
  buffer): copying them into the buffer would move every gradient byte twice more, and the host Adam
  kernel reads them where they are (:meth:`StagedGradients.pieces`). Whoever needs the flat buffer
  (:meth:`GradientStore.grad_of`) gets it filled from them then.
* :class:`GradientsInParamMemory` (``reuse_fp16_shard=True``): each gradient is written into its 16-bit
  parameter's own memory once the parameter's backward is done (14 bytes per parameter in all); the
  step overwrites them with the new values. No accumulation: a second backward before the step is
  refused.

Either way a trainable parameter that receives no gradient in a backward gets zero, and so does the
chunk's padding.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.chunk import MASTER, Chunk, ParamSlot
from ..core.transfer import Transfer
from ..errors import GradientAccumulationError
from ..core.tiers import Tier, device_of_tier
from ..distributed.reduction import GradientReduction, PendingReduction
from .executor import ChunkExecutor


class GradientStore:
    """One model's gradient strategy (see the module docstring). The runtime calls it; it moves chunk
    memory only through the executor."""

    in_param_memory = False
    """Whether the gradients live in the parameters' memory (no gradient or staging buffers): the
    runtime then holds a chunk's parameters on the device before handing it a gradient or finishing it."""
    overwritten_by_update = False
    """Whether a chunk's update overwrites its gradients (they share the memory it writes): the optimizer then
    cannot redo a step from them, starts no update of a chunk in memory in the backward, and has no gradient
    left to free or keep after an update."""

    def __init__(self, executor: ChunkExecutor, reduction: GradientReduction) -> None:
        self.executor = executor
        self.reduction = reduction

    def accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Take one parameter's gradient (from autograd) into its chunk."""
        raise NotImplementedError

    def finish(self, chunk: Chunk, deferred: bool, overlap: bool = False) -> bool:
        """The chunk's gradients of this backward are complete: zero what got none, and reduce them over
        the ranks into where they rest (``deferred``: inside ``no_sync``, keep them local). With
        ``overlap`` a sharded chunk's reduce-scatter may be left running: returns ``True`` when it was,
        and :meth:`complete` then finishes it."""
        raise NotImplementedError

    def complete(self, chunk: Chunk) -> None:
        """Wait for the chunk's reduction that :meth:`finish` left running and store its result where the
        gradient rests (nothing when none runs)."""

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        """This rank's shard of the chunk's finished gradient (where it rests), or ``None``."""
        raise NotImplementedError

    def landing(self, chunk: Chunk) -> tuple[torch.Tensor, Callable[[], None]]:
        """The chunk's finished flat gradient where it rests, and a function that waits for its copy there
        (none here); callable from another thread (:mod:`chunkmem.optim.host_updates`)."""
        return self.grad_of(chunk), lambda: None

    def pieces(self, chunk: Chunk) -> list[tuple[int, torch.Tensor]] | None:
        """The chunk's finished gradient as ``(offset, tensor)`` pieces (``offset`` in elements of the
        chunk; the elements between them are padding) where it is kept in pieces, else ``None``."""
        return None

    def tensors(self, chunk: Chunk) -> list[torch.Tensor]:
        """The tensors holding the chunk's finished gradient (its pieces, or the flat shard), for norms."""
        pieces = self.pieces(chunk)
        if pieces is not None:
            return [t for _, t in pieces]
        grad = self.grad_of(chunk)
        return [] if grad is None else [grad]

    def flatten(self, chunk: Chunk) -> None:
        """Make the chunk's gradient (if kept in pieces) its flat buffer, before the buffer moves."""

    def drop(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero every chunk's finished gradients."""
        raise NotImplementedError

    def release(self, chunk: Chunk) -> None:
        """Free ``chunk``'s finished gradient before the step ends: its update used it and nothing will
        read it again (the disk step of ``step_in_backward`` without a redo, see
        :class:`~chunkmem.ShardedOptimizerV2`). Nothing to free where it lives in the parameters' memory."""

    def released(self, chunk: Chunk) -> bool:
        """Whether :meth:`release` freed ``chunk``'s finished gradient since the last :meth:`drop`: its parameters
        have no gradient to show any more (``.grad`` is ``None``, as ``safe_get_full_grad`` is)."""
        return False

    def abandon(self, chunk: Chunk) -> None:
        """An interrupted backward: forget what it left unfinished in ``chunk``."""
        raise NotImplementedError

    def check_can_accumulate(self) -> None:
        """Raise :class:`~chunkmem.GradientAccumulationError` if a second backward (or ``no_sync``) cannot
        add to the gradients this strategy holds."""

    def check_can_defer(self) -> None:
        """Raise :class:`~chunkmem.GradientAccumulationError` if this strategy cannot keep gradients unreduced
        over several backwards (``no_sync()``)."""

    def grad_bytes(self, chunk: Chunk) -> int:
        """Bytes of this rank's finished gradient of ``chunk`` in a buffer of its own (0: none, they are in the
        parameters' memory)."""
        return chunk.param.shard.nbytes

    @staticmethod
    def _zero_unwritten(chunk: Chunk, flat: torch.Tensor) -> None:
        """Zero the slots of the parameters that received no gradient (frozen ones too: a parameter frozen
        after wrapping still has a slot in a trainable chunk), and the padding."""
        for slot in chunk.slots:
            if slot.index_in_chunk not in chunk.grad_slots_received:
                slot.view(flat).zero_()
        flat[chunk.used_numel:].zero_()


class StagedGradients(GradientStore):
    """Gradients accumulate in full-length device buffers, then rest reduced where Adam runs; on a CPU
    device tier a chunk resting there unsharded keeps autograd's tensors instead (module docstring)."""

    def __init__(self, executor: ChunkExecutor, reduction: GradientReduction,
                 adopt: Callable[[torch.Tensor], None], accumulate_in_fp32: bool = True) -> None:
        super().__init__(executor, reduction)
        self.accumulate_in_fp32 = accumulate_in_fp32
        self.copies = executor.memory.copies
        # (not under the deferred test engine, which stands for a GPU's copies: it runs the path CUDA takes)
        self.keeps_autograd_tensors = device_of_tier(Tier.DEVICE).type == "cpu" and not self.copies.asynchronous
        self._adopt = adopt  # tells the tracer that a kept tensor is chunk memory now
        self._kept: dict[Chunk, dict[int, torch.Tensor]] = {}  # chunk -> slot index -> its gradient
        self._reducing: dict[Chunk, PendingReduction] = {}  # reductions left running by finish(overlap=True)
        self._landing: dict[Chunk, Transfer] = {}  # chunk -> the copy of its gradient to the host, in flight
        self._released: set[Chunk] = set()  # chunks whose gradient release() freed before the step (released())

    def _landed(self, chunk: Chunk) -> None:
        """Wait for the copy of the chunk's gradient to the host, if one is in flight: the host reads,
        changes or frees the bytes next (the copy engine counts a wait that blocks as ``"grad landing"``)."""
        landing = self._landing.pop(chunk, None)
        if landing is not None:
            landing.wait()

    def _direct(self, chunk: Chunk) -> bool:
        """Whether the chunk's gradients accumulate where they rest (no staging buffer)."""
        return self.executor.grad_tier(chunk) is Tier.DEVICE and not chunk.param.sharded and chunk.replicas is None

    def _accumulator(self, chunk: Chunk) -> torch.Tensor:
        """The full-length device-tier buffer gradients of this backward go into. A buffer allocated in
        this backward is not zero-filled (``accumulator_fresh``): each slot's first gradient is copied in,
        and slots that get none are zeroed when the chunk finishes."""
        buf = chunk.grad if self._direct(chunk) else chunk.grad_staging
        if not buf.allocated:
            buf.allocate(Tier.DEVICE)
            buf.mark_written()  # it accumulates this backward's gradients from now on
            chunk.accumulator_fresh = True
        return buf.tensor

    def _widen_for_accumulation(self, chunk: Chunk) -> None:
        """A backward's first gradient of ``chunk`` arrives while the chunk holds an earlier backward's 16-bit
        sum (gradient accumulation, ``no_sync``): with ``accumulate_in_fp32`` that sum moves to fp32 first,
        so the backwards add up in fp32 (kept tensors go into the flat buffer, which is widened)."""
        if not self.accumulate_in_fp32 or chunk.dtype == torch.float32:
            return
        self.flatten(chunk)
        if self._direct(chunk) and chunk.grad.allocated:
            chunk.grad.widen(torch.float32)
        elif chunk.grad_staging.allocated and not chunk.accumulator_fresh:  # (inside no_sync: kept unreduced)
            chunk.grad_staging.widen(torch.float32)

    def accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        if not chunk.grad_slots_received and not chunk.accumulator_fresh:
            self._widen_for_accumulation(chunk)
        kept = self._kept.get(chunk)
        if kept is None and self.keeps_autograd_tensors and not chunk.grad.allocated and self._direct(chunk):
            _count_as_grad_buffer(chunk)
            kept = self._kept[chunk] = {}
            chunk.accumulator_fresh = True
        if kept is not None:
            held = kept.get(slot.index_in_chunk)
            if held is not None:
                held.add_(grad)
            elif grad.is_contiguous() and grad.dtype == chunk.dtype and grad.shape == slot.shape:
                kept[slot.index_in_chunk] = grad  # autograd's own tensor: nobody else holds it
                self._adopt(grad)
            else:
                kept[slot.index_in_chunk] = grad.to(chunk.dtype, memory_format=torch.contiguous_format,
                                                    copy=True).view(slot.shape)
            return
        staging = self._accumulator(chunk)
        if chunk.accumulator_fresh and slot.index_in_chunk not in chunk.grad_slots_received:
            slot.view(staging).copy_(grad)
        else:
            slot.view(staging).add_(grad)

    def finish(self, chunk: Chunk, deferred: bool, overlap: bool = False) -> bool:
        kept = self._kept.get(chunk)
        if kept is not None:
            for slot in chunk.slots:  # frozen ones too (see _zero_unwritten)
                if slot.index_in_chunk not in kept:
                    kept[slot.index_in_chunk] = torch.zeros(slot.shape, dtype=chunk.dtype,
                                                            device=device_of_tier(Tier.DEVICE))
            chunk.accumulator_fresh = False
            return False
        accumulator = self._accumulator(chunk)
        if chunk.accumulator_fresh:
            self._zero_unwritten(chunk, accumulator)
            chunk.accumulator_fresh = False
        if not chunk.grad_staging.allocated or deferred:  # (deferred: it keeps accumulating, unreduced)
            return False
        if chunk.param.sharded and overlap:
            self._reducing[chunk] = self.reduction.start(accumulator, f"{chunk.name} gradients")
            return True
        if chunk.param.sharded:
            finished = self.reduction.reduce(accumulator, f"{chunk.name} gradients")
        elif chunk.replicas is not None:
            finished = self.reduction.all_reduce_mean_(accumulator, f"{chunk.name} gradients")
        else:
            finished = accumulator
        self._store(chunk, finished, owned=finished is accumulator)
        return False

    def complete(self, chunk: Chunk) -> None:
        pending = self._reducing.pop(chunk, None)
        if pending is not None:
            self._store(chunk, pending.wait(), owned=False)

    def _store(self, chunk: Chunk, finished: torch.Tensor, owned: bool) -> None:
        """The reduced gradient into the chunk's gradient buffer where it rests; the staging buffer goes.
        A gradient resting on the host leaves through the copy engine: on a GPU the copy runs on the
        device-to-host stream while the backward goes on, and readers wait for it (:meth:`_landed`).
        ``owned``: ``finished`` is the staging buffer freed here; otherwise it is the reduction's output
        buffer, which the next chunk's reduction overwrites, so a copy that completes later reads a
        private copy of it."""
        self._released.discard(chunk)
        if chunk.grad.allocated:
            self._landed(chunk)
            if self.accumulate_in_fp32:
                chunk.grad.widen(torch.float32)  # an earlier backward's sum: add up in fp32 (no-op for fp32)
            chunk.grad.tensor.add_(finished.to(chunk.grad.tensor.device))
        else:
            tier = self.executor.grad_tier(chunk)
            widened = chunk.grad_staging.allocated and chunk.grad_staging.dtype != chunk.grad_staging.base_dtype
            target = chunk.grad.allocate(tier, dtype=finished.dtype if widened else None)
            if tier is Tier.HOST:
                source = finished if owned or not self.copies.asynchronous else finished.clone()
                self._landing[chunk] = self.copies.to_host(target, source, "grad landing")
            else:
                target.copy_(finished)
            chunk.grad.mark_written()
        if chunk.grad.tier is Tier.HOST:
            chunk.memory.ledger.count_move(Tier.HOST, chunk.grad.nbytes)
        chunk.grad_staging.free()

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        self.flatten(chunk)
        return chunk.grad.tensor

    def landing(self, chunk: Chunk) -> tuple[torch.Tensor, Callable[[], None]]:
        if chunk in self._kept:
            self.flatten(chunk)
        landing = self._landing.get(chunk)  # (left for grad_of to pop: the copy is waited for again, for free)
        return chunk.grad.tensor, (lambda: None) if landing is None else landing.wait

    def tensors(self, chunk: Chunk) -> list[torch.Tensor]:
        self._landed(chunk)
        return super().tensors(chunk)

    def pieces(self, chunk: Chunk) -> list[tuple[int, torch.Tensor]] | None:
        kept = self._kept.get(chunk)
        if kept is None:
            return None
        return [(slot.offset, kept[slot.index_in_chunk]) for slot in chunk.slots if slot.index_in_chunk in kept]

    def flatten(self, chunk: Chunk) -> None:
        """The kept tensors go into the chunk's gradient buffer (zero where none is: slots still to come
        in a running backward, and the padding), which takes over their count on the ledger."""
        self._landed(chunk)
        kept = self._kept.pop(chunk, None)
        if kept is None:
            return
        _uncount_grad_buffer(chunk)  # the buffer counts them from now on
        try:
            flat = chunk.grad.allocate(Tier.DEVICE)
        except BaseException:
            _count_as_grad_buffer(chunk)
            self._kept[chunk] = kept
            raise
        for slot in chunk.slots:
            held = kept.get(slot.index_in_chunk)
            if held is None:
                slot.view(flat).zero_()
            else:
                slot.view(flat).copy_(held)
        flat[chunk.used_numel:].zero_()
        chunk.grad.mark_written()
        chunk.accumulator_fresh = False  # every slot holds its sum so far: later gradients add to it

    def _forget_kept(self, chunk: Chunk) -> None:
        if self._kept.pop(chunk, None) is not None:
            _uncount_grad_buffer(chunk)

    def drop(self, set_to_none: bool) -> None:
        self._released.clear()
        for chunk in self.executor.chunks:
            self._landed(chunk)
            if chunk.grad_staging.allocated and not chunk.grad_slots_received:
                chunk.grad_staging.free()
                chunk.accumulator_fresh = False
            if set_to_none:
                self._forget_kept(chunk)
            else:
                for held in self._kept.get(chunk, {}).values():
                    held.zero_()
            if chunk.grad.allocated:
                if set_to_none:
                    chunk.grad.free()
                else:
                    chunk.grad.tensor.zero_()

    def release(self, chunk: Chunk) -> None:
        self._landed(chunk)
        self._forget_kept(chunk)
        if chunk.grad.allocated:
            chunk.grad.free()
        self._released.add(chunk)

    def released(self, chunk: Chunk) -> bool:
        return chunk in self._released

    def abandon(self, chunk: Chunk) -> None:
        """Drop the gradients of an unfinished chunk that this backward began (a buffer or kept tensors
        holding nothing finished); a staging buffer always."""
        if chunk.accumulator_fresh and chunk.grad_slots_received:
            self._landed(chunk)
            self._forget_kept(chunk)
            if self._direct(chunk):
                chunk.grad.free()
        chunk.accumulator_fresh = False
        chunk.grad_staging.free()


def _count_as_grad_buffer(chunk: Chunk) -> None:
    """Count kept gradient tensors on the ledger as the chunk's device-tier gradient buffer."""
    chunk.memory.ledger.reserve(Tier.DEVICE, chunk.grad.family, chunk.grad.nbytes, chunk.grad.region.label)


def _uncount_grad_buffer(chunk: Chunk) -> None:
    chunk.memory.ledger.release(Tier.DEVICE, chunk.grad.family, chunk.grad.nbytes)


class GradientsInParamMemory(GradientStore):
    """``reuse_fp16_shard``: each chunk's gradients are written over its 16-bit parameter memory."""

    in_param_memory = True
    overwritten_by_update = True

    def accumulate(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        if slot.index_in_chunk in chunk.grad_slots_received:
            raise GradientAccumulationError(
                f"parameter {slot.name!r} received a second gradient in one backward pass (reentrant "
                "activation checkpointing?); reuse_fp16_shard=True needs each gradient in one piece")
        slot.view(chunk.param.device).copy_(grad)  # (the runtime holds the chunk on the device)

    def finish(self, chunk: Chunk, deferred: bool, overlap: bool = False) -> bool:
        buf = chunk.param
        self._zero_unwritten(chunk, buf.device)
        if buf.sharded:
            buf.grads_in_shard(self.reduction.reduce(buf.device, f"{chunk.name} gradients"))
        else:
            if chunk.replicas is not None:
                self.reduction.all_reduce_mean_(buf.device, f"{chunk.name} gradients")
            buf.grads_in_device_copy()
        return False

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

    def check_can_defer(self) -> None:
        raise GradientAccumulationError(
            "no_sync() accumulates gradients over several backward passes, which reuse_fp16_shard=True cannot "
            "do (the gradients share the parameters' memory); build ShardedModelV2 with reuse_fp16_shard=False")

    def grad_bytes(self, chunk: Chunk) -> int:
        return 0


def gradient_store(in_param_memory: bool, executor: ChunkExecutor, reduction: GradientReduction,
                   adopt: Callable[[torch.Tensor], None], accumulate_in_fp32: bool = True) -> GradientStore:
    """The strategy for ``reuse_fp16_shard`` (``in_param_memory``); ``adopt`` is told of each tensor
    made by the model's backward that becomes chunk memory (the tracer's
    :meth:`~chunkmem.runtime.schedule.Scheduler.adopt`); ``accumulate_in_fp32``: 16-bit gradients of several
    backwards are summed in fp32 (``ShardedModelV2(grad_accum_dtype=)``)."""
    if in_param_memory:
        return GradientsInParamMemory(executor, reduction)
    return StagedGradients(executor, reduction, adopt, accumulate_in_fp32)
