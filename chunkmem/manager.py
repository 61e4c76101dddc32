"""The chunk manager: builds chunks from parameters and executes every move between tiers.

It decides nothing about placement (that is the policy's job); it fetches, releases, accumulates
gradients and keeps the byte ledger exact.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .chunk import MASTER, OPTIM_FAMILIES, Chunk, ChunkKey, ParamSlot
from .errors import GradientAccumulationError
from .layout import pack
from .ledger import TierLedger
from .placement import PlacementPolicy
from .schedule import Scheduler
from .tiers import Tier, device_of_tier

SLOT_ATTR = "_chunkmem_slot"


def slot_of(param: nn.Parameter) -> ParamSlot | None:
    """The slot of a chunk-managed parameter, or ``None`` for an ordinary one."""
    return getattr(param, SLOT_ATTR, None)


def build_chunks(entries: Sequence[tuple[str, nn.Parameter, ChunkKey]], chunk_numel: int, dtype: torch.dtype,
                 ledger: TierLedger, tier: Tier, first_index: int = 0,
                 value_of: Callable[[nn.Parameter], torch.Tensor] | None = None) -> list[Chunk]:
    """Pack ``entries`` (in order) into new chunks on ``tier`` and point each parameter into its chunk.

    ``value_of(param)`` gives the parameter's current value (default: ``param.data``); it is cast to
    ``dtype``. Padding elements are zero.
    """
    value_of = value_of or (lambda p: p.data)
    groups = pack([p.numel() for _, p, _ in entries], [k for _, _, k in entries], chunk_numel)
    chunks = []
    for n, indices in enumerate(groups):
        chunk = Chunk(first_index + n, chunk_numel, dtype, entries[indices[0]][2], ledger)
        flat = _allocate_param_copy(chunk, tier)
        flat.zero_()
        for i in indices:
            name, param, _key = entries[i]
            slot = chunk.add_slot(param, name)
            slot.view(flat).copy_(value_of(param))
        for slot in chunk.slots:
            slot.param.data = slot.view(flat)
            setattr(slot.param, SLOT_ATTR, slot)
        chunks.append(chunk)
    return chunks


def _allocate_param_copy(chunk: Chunk, tier: Tier) -> torch.Tensor:
    if tier is Tier.DEVICE:
        chunk.param.allocate_device()
        chunk.param.device_valid = True
        return chunk.param.device
    chunk.param.host.allocate(Tier.HOST)
    chunk.param.host_valid = True
    return chunk.param.host.tensor


class ChunkManager:
    """Owns the chunks of one model and executes the policy's placement.

    ``reuse_param_memory_for_grads`` (``reuse_fp16_shard``) writes each gradient into the memory of its
    16-bit parameter once the parameter's backward is done, instead of into a separate grad buffer.
    """

    def __init__(self, chunks: list[Chunk], ledger: TierLedger, policy: PlacementPolicy,
                 reuse_param_memory_for_grads: bool) -> None:
        self.ledger = ledger
        self.policy = policy
        self.reuse_grads = reuse_param_memory_for_grads
        self.grads_pending = False
        self.optimizer_state_exists = False
        self.stale: dict[Chunk, None] = {}
        self.scheduler = Scheduler(self, device_of_tier(Tier.DEVICE))
        self.chunks = chunks

    @property
    def chunks(self) -> list[Chunk]:
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: list[Chunk]) -> None:
        self._chunks = chunks
        self.policy.configure(chunks)

    # ---- placement at rest -------------------------------------------------------------------------

    def bind_views_to_device(self) -> None:
        """Make every parameter view the device copy of its chunk, whose memory is given and taken
        back as the chunk is fetched and released."""
        for chunk in self.chunks:
            chunk.bind_views(chunk.param.device)

    def settle(self, chunk: Chunk) -> None:
        """Put an unused chunk's parameters where the policy rests them. Gradients held in parameter
        memory go to the host when the chunk's Adam runs there. A clean device copy of a chunk that
        rests on the host is only marked stale: it is freed at the next period boundary unless that
        period needs it (consecutive modules in one chunk then share one fetch)."""
        if chunk.users or chunk.held_for_backward:
            return
        buf = chunk.param
        tier = self.policy.param_rest_tier(chunk)
        if buf.holds_grads and self.policy.grad_tier(chunk) is Tier.HOST:
            tier = Tier.HOST
        with self.scheduler.paused():
            if tier is Tier.DEVICE:
                buf.fetch_to_device()
                buf.free_host()
            elif tier is Tier.HOST:
                if not buf.host_valid:
                    buf.write_back_to_host()
                if buf.device_valid and not buf.holds_grads:
                    self.stale[chunk] = None
                else:
                    buf.free_device()

    def flush_stale(self, keep: Iterable[Chunk] = ()) -> None:
        """Free the device copies of stale chunks, except those in ``keep`` or in use again."""
        keep = set(keep)
        for chunk in list(self.stale):
            if chunk in keep:
                continue
            del self.stale[chunk]
            if chunk.users == 0 and not chunk.held_for_backward and self.policy.param_rest_tier(chunk) is not Tier.DEVICE:
                with self.scheduler.paused():
                    chunk.param.free_device()

    def settle_all(self) -> None:
        for chunk in self.chunks:
            self.settle(chunk)

    def place_optimizer_state(self, chunk: Chunk) -> None:
        """Allocate the chunk's optimizer families on the policy's tier: the fp32 master from the
        current parameters, exp_avg and exp_avg_sq zero."""
        tier = self.policy.optim_tier(chunk)
        if chunk.has_master:
            master = chunk.optim[MASTER].allocate(tier)
            master.copy_(chunk.param.current())
        for family in OPTIM_FAMILIES[1:]:
            chunk.optim[family].allocate(tier, zero=True)
        self.optimizer_state_exists = True

    def move_optimizer_state(self, chunk: Chunk, tier: Tier) -> None:
        """Move the chunk's optimizer families (and a separate gradient buffer) to ``tier``."""
        with self.scheduler.paused():
            for buf in (*chunk.optim.values(), chunk.grad):
                if buf.allocated:
                    buf.move_to(tier)

    # ---- forward and backward use ------------------------------------------------------------------

    def acquire(self, chunks: Iterable[Chunk]) -> None:
        """Make the chunks' parameters current on the device and count one more user of each."""
        for chunk in chunks:
            self._check_not_holding_grads(chunk)
            self.scheduler.need(chunk)
            with self.scheduler.paused():
                chunk.param.fetch_to_device()
            chunk.users += 1

    def release(self, chunks: Iterable[Chunk]) -> None:
        """Count one user fewer; a chunk nobody uses any more goes back where the policy rests it."""
        for chunk in chunks:
            chunk.users -= 1
            assert chunk.users >= 0, chunk
            self.settle(chunk)

    def hold_for_backward(self, chunks: Iterable[Chunk]) -> None:
        """Fetch the chunks and keep them on the device until their gradients are finished."""
        for chunk in chunks:
            if chunk.held_for_backward:
                continue
            self._check_not_holding_grads(chunk)
            self.scheduler.need(chunk)
            with self.scheduler.paused():
                chunk.param.fetch_to_device()
            chunk.held_for_backward = True

    def _check_not_holding_grads(self, chunk: Chunk) -> None:
        if chunk.param.holds_grads:
            raise GradientAccumulationError(
                "reuse_fp16_shard=True keeps gradients in the parameters' memory until optim.step(), so "
                "a forward or backward before the step (gradient accumulation) is not possible; call "
                "optim.step() or optim.zero_grad() first, or build ShardedModelV2 with reuse_fp16_shard=False")

    # ---- gradients ---------------------------------------------------------------------------------

    def accumulate_grad(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Take one parameter's gradient (from autograd) into its chunk."""
        chunk = slot.chunk
        if not chunk.grad_slots_received:
            self.scheduler.grads_started(chunk)
        if self.reuse_grads:
            if slot.index_in_chunk in chunk.grad_slots_received:
                raise GradientAccumulationError(
                    f"parameter {slot.name!r} received a second gradient in one backward pass (reentrant "
                    "activation checkpointing?); reuse_fp16_shard=True needs each gradient in one piece")
            self.hold_for_backward([chunk])
            slot.view(chunk.param.device).copy_(grad)
        else:
            with self.scheduler.paused():
                staging = self._grad_accumulator(chunk)
            if chunk.accumulator_fresh and slot.index_in_chunk not in chunk.grad_slots_received:
                slot.view(staging).copy_(grad)
            else:
                slot.view(staging).add_(grad)
        chunk.grad_slots_received.add(slot.index_in_chunk)
        if len(chunk.grad_slots_received) == len(chunk.trainable_slots()):
            self.finish_grads(chunk)

    def _grad_accumulator(self, chunk: Chunk) -> torch.Tensor:
        """The device-tier buffer gradients of this backward go into. A buffer allocated in this backward
        is not zero-filled (``accumulator_fresh``): each slot's first gradient is copied in, and slots
        that get none are zeroed when the chunk finishes."""
        buf = chunk.grad if self.policy.grad_tier(chunk) is Tier.DEVICE else chunk.grad_staging
        if not buf.allocated:
            buf.allocate(Tier.DEVICE)
            chunk.accumulator_fresh = True
        return buf.tensor

    def _zero_unwritten(self, chunk: Chunk, flat: torch.Tensor) -> None:
        """Zero the slots of trainable parameters that received no gradient, and the padding."""
        for slot in chunk.trainable_slots():
            if slot.index_in_chunk not in chunk.grad_slots_received:
                slot.view(flat).zero_()
        flat[chunk.used_numel:].zero_()

    def finish_grads(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are complete: move them where they rest, and let the
        parameters go back to their resting tier. Parameters that got no gradient get zero."""
        with self.scheduler.paused():
            if self.reuse_grads:
                self.hold_for_backward([chunk])
                self._zero_unwritten(chunk, chunk.param.device)
                chunk.param.host_valid = False
                chunk.param.holds_grads = True
            else:
                accumulator = self._grad_accumulator(chunk)
                if chunk.accumulator_fresh:
                    self._zero_unwritten(chunk, accumulator)
                    chunk.accumulator_fresh = False
                if chunk.grad_staging.allocated:
                    if chunk.grad.allocated:
                        chunk.grad.tensor.add_(accumulator.to(chunk.grad.tensor.device))
                    else:
                        chunk.grad.allocate(self.policy.grad_tier(chunk)).copy_(accumulator)
                    self.ledger.count_move(chunk.grad.tier, chunk.grad.nbytes)
                    chunk.grad_staging.free()
        chunk.grad_slots_received.clear()
        chunk.grads_finished = True
        chunk.held_for_backward = False
        self.grads_pending = True
        self.scheduler.grads_finished(chunk)
        self.settle(chunk)

    def end_backward(self) -> None:
        """After autograd finished: finish every trainable chunk not finished yet (parameters that got no
        gradient get zero), release what backward held, and close the iteration."""
        for chunk in self.chunks:
            if chunk.trainable and not chunk.grads_finished:
                self.finish_grads(chunk)
            elif chunk.held_for_backward:
                chunk.held_for_backward = False
                self.settle(chunk)
            chunk.grads_finished = False
        self.flush_stale()
        self.scheduler.end_iteration()

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        """The chunk's finished gradient buffer (where it rests), or ``None`` if there is none."""
        if self.reuse_grads:
            return chunk.param.current() if chunk.param.holds_grads else None
        return chunk.grad.tensor

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero every gradient buffer."""
        for chunk in self.chunks:
            if chunk.grad.allocated:
                if set_to_none:
                    chunk.grad.free()
                else:
                    chunk.grad.tensor.zero_()
        self.grads_pending = False

    # ---- optimizer updates -------------------------------------------------------------------------

    def param_update_target(self, chunk: Chunk, tier: Tier) -> torch.Tensor:
        """The copy of the chunk's parameters on ``tier`` that an update running there writes. Without a
        separate master (fp32) the update also reads it, so it is made current first."""
        buf = chunk.param
        with self.scheduler.paused():
            if tier is Tier.DEVICE:
                if chunk.has_master:
                    buf.allocate_device()
                else:
                    buf.fetch_to_device()
                return buf.device
            if not buf.host.allocated:
                buf.host.allocate(Tier.HOST)
            if not chunk.has_master and not buf.host_valid:
                buf.write_back_to_host()
            return buf.host.tensor

    def params_updated(self, chunk: Chunk, tier: Tier) -> None:
        """The copy on ``tier`` now holds the new parameter values; drop the other copy."""
        buf = chunk.param
        buf.holds_grads = False
        if tier is Tier.DEVICE:
            buf.device_valid, buf.host_valid = True, False
            buf.host.free()
        else:
            buf.host_valid, buf.device_valid = True, False
            if buf.device_allocated:
                buf.free_device()
        self.settle(chunk)
