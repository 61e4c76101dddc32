"""The chunk manager: builds chunks from parameters and executes every move between tiers.

It decides nothing about placement (that is the policy's job); it fetches, releases, accumulates
gradients and keeps the byte ledger exact.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .chunk import MASTER, OPTIM_FAMILIES, Chunk, ChunkKey, ParamSlot, gather_together
from .collectives import SINGLE_PROCESS, ShardGroup
from .errors import GradientAccumulationError
from .layout import pack
from .ledger import TierLedger
from .placement import PlacementPolicy
from .schedule import Scheduler
from .tiers import Tier, device_of_tier

from .param_guard import SLOT_ATTR, adopt, slot_of  # noqa: F401  (re-exported: where callers look)


def build_chunks(entries: Sequence[tuple[str, nn.Parameter, ChunkKey]], chunk_numel: int, dtype: torch.dtype,
                 ledger: TierLedger, tier: Tier, shards: ShardGroup = SINGLE_PROCESS, first_index: int = 0,
                 value_of: Callable[[nn.Parameter], torch.Tensor] | None = None) -> list[Chunk]:
    """Pack ``entries`` (in order) into new chunks and point each parameter into its chunk.

    Each chunk keeps this rank's shard of the parameters on ``tier`` (one rank: the whole chunk, on
    the device tier as its device copy); parameters view the (freed) full device copy when sharded.
    ``value_of(param)`` gives the parameter's full current value (default: ``param.data``); it is cast
    to ``dtype``. Padding elements are zero.
    """
    value_of = value_of or (lambda p: p.data)
    groups = pack([p.numel() for _, p, _ in entries], [k for _, _, k in entries], chunk_numel)
    chunks = []
    for n, indices in enumerate(groups):
        chunk = Chunk(first_index + n, chunk_numel, dtype, entries[indices[0]][2], ledger, shards)
        local = allocate_param_copy(chunk, tier)
        local.zero_()
        for i in indices:
            name, param, _key = entries[i]
            chunk.write_own_part(chunk.add_slot(param, name), local, value_of(param))
        chunk.bind_views(chunk.param.device if shards.sharded else local)
        for slot in chunk.slots:
            adopt(slot.param, slot)
        chunks.append(chunk)
    return chunks


def allocate_param_copy(chunk: Chunk, tier: Tier) -> torch.Tensor:
    """Allocate the chunk's first parameter copy on ``tier`` and return it (contents undefined): the
    shard, or with one rank on the device tier the device copy."""
    if tier is Tier.DEVICE and not chunk.param.sharded:
        chunk.param.allocate_device()
        chunk.param.device_valid = True
        return chunk.param.device
    chunk.param.shard.allocate(tier)
    chunk.param.shard_valid = True
    return chunk.param.shard.tensor


class ChunkManager:
    """Owns the chunks of one model and executes the policy's placement.

    ``reuse_param_memory_for_grads`` (``reuse_fp16_shard``) writes each gradient into the memory of its
    16-bit parameter once the parameter's backward is done, instead of into a separate grad buffer.
    ``reduction`` reduce-scatters finished gradients over the data-parallel ranks (when the chunks
    are sharded); ``gather_together`` gathers all chunks one module needs with one collective.
    """

    def __init__(self, chunks: list[Chunk], ledger: TierLedger, policy: PlacementPolicy,
                 reuse_param_memory_for_grads: bool, reduction: GradientReduction | None = None,
                 gather_together: bool = False) -> None:
        self.ledger = ledger
        self.policy = policy
        self.reuse_grads = reuse_param_memory_for_grads
        self.reduction = reduction or GradientReduction(SINGLE_PROCESS)
        self.gather_together = gather_together
        self.gathers = 0  # all-gather collectives run so far
        self.grads_pending = False
        self.backward_count = 0  # backward passes finished (autograd's end of backward) so far
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

    @property
    def sharded(self) -> bool:
        """Whether the chunks are split over several data-parallel ranks."""
        return self.reduction.shards.sharded

    # ---- placement at rest -------------------------------------------------------------------------

    def bind_views_to_device(self) -> None:
        """Make every parameter view the device copy of its chunk, whose memory is given and taken
        back as the chunk is fetched and released."""
        for chunk in self.chunks:
            chunk.bind_views(chunk.param.device)

    def keeps_device_copy(self, chunk: Chunk) -> bool:
        """Whether the chunk's full device copy stays allocated between uses."""
        if chunk.param.sharded:
            return self.policy.keeps_gathered(chunk)
        return self.policy.param_rest_tier(chunk) is Tier.DEVICE

    def settle(self, chunk: Chunk) -> None:
        """Put an unused chunk's parameters where the policy rests them. Gradients held in parameter
        memory go to the host when the chunk's Adam runs there. A clean device copy that is not kept
        is only marked stale: it is freed at the next period boundary unless that period needs it
        (consecutive modules in one chunk then share one fetch)."""
        if chunk.users or chunk.held_for_backward:
            return
        if chunk.param.sharded:
            self._settle_shard(chunk)
            return
        buf = chunk.param
        tier = self.policy.param_rest_tier(chunk)
        if buf.holds_grads and self.policy.grad_tier(chunk) is Tier.HOST:
            tier = Tier.HOST
        with self.scheduler.paused():
            if tier is Tier.DEVICE:
                buf.fetch_to_device()
                buf.free_shard()
            elif tier is Tier.HOST:
                if not buf.shard_valid:
                    buf.write_back_shard()
                if buf.device_valid and not buf.holds_grads:
                    self.stale[chunk] = None
                else:
                    buf.free_device()

    def _settle_shard(self, chunk: Chunk) -> None:
        """Sharded: the shard (always current) goes to its resting tier, or where Adam reads it while it
        holds gradients; the gathered copy is kept, left to the plan, marked stale, or freed."""
        buf = chunk.param
        tier = self.policy.grad_tier(chunk) if buf.holds_grads else self.policy.param_rest_tier(chunk)
        with self.scheduler.paused():
            if tier is not None and buf.shard.tier is not tier:
                buf.shard.move_to(tier)
            if tier is None or not buf.device_allocated or self.keeps_device_copy(chunk):
                return
            if buf.device_valid:
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
            if chunk.users == 0 and not chunk.held_for_backward and not self.keeps_device_copy(chunk):
                with self.scheduler.paused():
                    chunk.param.free_device()

    def settle_all(self) -> None:
        for chunk in self.chunks:
            self.settle(chunk)

    def place_optimizer_state(self, chunk: Chunk) -> None:
        """Allocate the chunk's optimizer families (this rank's shard) on the policy's tier: the fp32
        master from the current parameters, exp_avg and exp_avg_sq zero."""
        tier = self.policy.optim_tier(chunk)
        if chunk.has_master:
            master = chunk.optim[MASTER].allocate(tier)
            master.copy_(chunk.param.local())
        for family in OPTIM_FAMILIES[1:]:
            chunk.optim[family].allocate(tier, zero=True)
        self.optimizer_state_exists = True

    def move_optimizer_state(self, chunk: Chunk, tier: Tier) -> None:
        """Move the chunk's optimizer families (and a separate gradient buffer) to ``tier``."""
        with self.scheduler.paused():
            for buf in (*chunk.optim.values(), chunk.grad):
                if buf.allocated:
                    buf.move_to(tier)

    def write_params(self, chunk: Chunk, local: torch.Tensor) -> None:
        """Make ``local`` (this rank's ``shard_numel`` elements, any float dtype, cast to the chunk's)
        the chunk's parameter values, then rest the chunk where the policy puts it (loading a
        checkpoint; no module may be using the chunk)."""
        buf = chunk.param
        assert not chunk.users and not chunk.held_for_backward, chunk
        with self.scheduler.paused():
            if not buf.shard.allocated:
                buf.shard.allocate(Tier.HOST)
            buf.shard.tensor.copy_(local)
            buf.shard_valid, buf.holds_grads = True, False
            buf.device_valid = False
            buf.free_device()
        self.settle(chunk)

    # ---- forward and backward use ------------------------------------------------------------------

    def acquire(self, chunks: Iterable[Chunk]) -> None:
        """Make the chunks' parameters current on the device and count one more user of each."""
        chunks = list(chunks)
        for chunk in chunks:
            self._check_not_holding_grads(chunk)
            self.scheduler.need(chunk)
        self.fetch(chunks)
        for chunk in chunks:
            chunk.users += 1

    def fetch(self, chunks: Sequence[Chunk]) -> None:
        """Make the chunks' full device copies current: one gather per chunk, or with ``gather_together``
        one for all of them. Every rank fetches the same chunks in the same order."""
        missing = [c for c in chunks if not c.param.device_valid]
        with self.scheduler.paused():
            if self.gather_together and len(missing) > 1 and missing[0].param.sharded:
                gather_together([c.param for c in missing])
                self.gathers += 1
            else:
                for chunk in missing:
                    chunk.param.fetch_to_device()
                    self.gathers += chunk.param.sharded

    def release(self, chunks: Iterable[Chunk]) -> None:
        """Count one user fewer; a chunk nobody uses any more goes back where the policy rests it."""
        for chunk in chunks:
            chunk.users -= 1
            assert chunk.users >= 0, chunk
            self.settle(chunk)

    def hold_for_backward(self, chunks: Iterable[Chunk]) -> None:
        """Fetch the chunks and keep them on the device until their gradients are finished."""
        chunks = [c for c in chunks if not c.held_for_backward]
        for chunk in chunks:
            self._check_not_holding_grads(chunk)
            self.scheduler.need(chunk)
        self.fetch(chunks)
        for chunk in chunks:
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
        """The full-length device-tier buffer gradients of this backward go into: the chunk's gradient
        buffer itself when it rests on the device unsharded, else the staging buffer. A buffer allocated
        in this backward is not zero-filled (``accumulator_fresh``): each slot's first gradient is copied
        in, and slots that get none are zeroed when the chunk finishes."""
        direct = self.policy.grad_tier(chunk) is Tier.DEVICE and not chunk.param.sharded
        buf = chunk.grad if direct else chunk.grad_staging
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
        """The chunk's gradients of this backward are complete: reduce them over the ranks (sharded),
        move them where they rest, and let the parameters go back to their resting tier. Parameters
        that got no gradient get zero."""
        buf = chunk.param
        with self.scheduler.paused():
            if self.reuse_grads:
                self.hold_for_backward([chunk])
                self._zero_unwritten(chunk, buf.device)
                if buf.sharded:
                    buf.shard.tensor.copy_(self.reduction.reduce(chunk, buf.device))
                    buf.device_valid = False
                else:
                    buf.shard_valid = False
                buf.holds_grads = True
            else:
                accumulator = self._grad_accumulator(chunk)
                if chunk.accumulator_fresh:
                    self._zero_unwritten(chunk, accumulator)
                    chunk.accumulator_fresh = False
                if chunk.grad_staging.allocated:
                    finished = self.reduction.reduce(chunk, accumulator) if buf.sharded else accumulator
                    if chunk.grad.allocated:
                        chunk.grad.tensor.add_(finished.to(chunk.grad.tensor.device))
                    else:
                        chunk.grad.allocate(self.policy.grad_tier(chunk)).copy_(finished)
                    if chunk.grad.tier is Tier.HOST:
                        self.ledger.count_move(Tier.HOST, chunk.grad.nbytes)
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
        self.backward_count += 1
        self.scheduler.end_iteration()

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        """This rank's shard of the chunk's finished gradient (where it rests), or ``None``."""
        if self.reuse_grads:
            if not chunk.param.holds_grads:
                return None
            return chunk.param.shard.tensor if chunk.param.sharded else chunk.param.current()
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
        """The copy of this rank's parameters on ``tier`` that an update running there writes. Without a
        separate master (fp32) the update also reads it, so it is made current first."""
        buf = chunk.param
        with self.scheduler.paused():
            if buf.sharded:
                if buf.shard.tier is not tier:
                    buf.shard.move_to(tier)
                return buf.shard.tensor
            if tier is Tier.DEVICE:
                if chunk.has_master:
                    buf.allocate_device()
                else:
                    buf.fetch_to_device()
                return buf.device
            if not buf.shard.allocated:
                buf.shard.allocate(Tier.HOST)
            if not chunk.has_master and not buf.shard_valid:
                buf.write_back_shard()
            return buf.shard.tensor

    def params_updated(self, chunk: Chunk, tier: Tier) -> None:
        """The copy on ``tier`` now holds the new parameter values; drop (or, sharded and kept,
        invalidate) the other copy."""
        buf = chunk.param
        buf.holds_grads = False
        if buf.sharded:
            buf.shard_valid, buf.device_valid = True, False
            if not self.keeps_device_copy(chunk):
                buf.free_device()
        elif tier is Tier.DEVICE:
            buf.device_valid, buf.shard_valid = True, False
            buf.shard.free()
        else:
            buf.shard_valid, buf.device_valid = True, False
            if buf.device_allocated:
                buf.free_device()
        self.settle(chunk)


class GradientReduction:
    """How finished gradients of a sharded chunk are reduce-scattered over the data-parallel ranks.

    Each rank's full-length gradient is divided by ``predivide_factor``, summed over the ranks (in fp32
    when ``fp32`` is set, else in the chunk's dtype), and this rank's shard of the sum is divided by
    ``world / predivide_factor``: the mean over the ranks. A chunk is reduced in pieces of at most
    ``bucket_bytes`` of collective input (every rank's part of the piece, in the reduction dtype), so
    the fp32 temporaries stay within one bucket.
    """

    def __init__(self, shards: ShardGroup, bucket_bytes: int = 25 * 2**20, fp32: bool = False,
                 predivide_factor: float = 1.0) -> None:
        self.shards = shards
        self.bucket_bytes = bucket_bytes
        self.fp32 = fp32
        self.predivide_factor = predivide_factor
        self.collectives = 0

    def reduce(self, chunk: Chunk, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the mean over the ranks of ``full`` (``chunk.numel`` elements on the
        device tier; it may be overwritten), in the chunk's dtype."""
        world, shard_numel = self.shards.world, chunk.shard_numel
        dtype = torch.float32 if self.fp32 else full.dtype
        out = torch.empty(shard_numel, dtype=dtype, device=full.device)
        piece = max(self.bucket_bytes // (world * out.element_size()), 1)
        for start in range(0, shard_numel, piece):
            end = min(start + piece, shard_numel)
            parts = [full[r * shard_numel + start:r * shard_numel + end] for r in range(world)]
            parts = [p.to(dtype) for p in parts]
            if self.predivide_factor != 1.0:
                for p in parts:
                    p.div_(self.predivide_factor)
            self.shards.reduce_scatter(out[start:end], parts, what=f"{chunk.name} gradients")
            self.collectives += 1
        post = world / self.predivide_factor
        if post != 1.0:
            out.div_(post)
        return out.to(chunk.dtype)
