"""The chunk manager: builds chunks from parameters and executes every move between tiers.

It decides nothing about placement (that is the policy's job) nor about when to move what (the
scheduler's plan, :mod:`chunkmem.runtime.schedule`): it executes, alone. It fetches (issuing transfers and
waiting on their handles, :mod:`chunkmem.core.transfer`), releases, accumulates gradients and keeps the byte
ledger exact. Chunk buffers change state only through their own transitions (:mod:`chunkmem.core.chunk`).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
import torch.nn as nn

from ..core.chunk import MASTER, OPTIM_FAMILIES, Chunk, ChunkKey, ParamSlot, gather_together
from ..dist.collectives import SINGLE_PROCESS, ShardGroup
from ..core.errors import GradientAccumulationError
from ..core.layout import pack
from ..core.ledger import TierLedger
from ..core.memory import TierMemory
from .belady import MovePlan
from .placement import PlacementPolicy
from .schedule import IterationMode, PeriodOrders, PeriodStats, PlanInputs, Scheduler
from ..core.states import ChunkStateError, CopyState
from .tracer import Period
from ..core.tiers import Tier, device_of_tier

from ..core.param_guard import adopt, slot_of  # noqa: F401  (slot_of re-exported: where callers look)


def build_chunks(entries: Sequence[tuple[str, nn.Parameter, ChunkKey]], chunk_numel: int, dtype: torch.dtype,
                 memory: TierMemory, tier: Tier, shards: ShardGroup = SINGLE_PROCESS, first_index: int = 0,
                 value_of: Callable[[nn.Parameter], torch.Tensor] | None = None, to_disk: bool = False) -> list[Chunk]:
    """Pack ``entries`` (in order) into new chunks and point each parameter into its chunk.

    Each chunk keeps this rank's shard of the parameters on ``tier`` (one rank: the whole chunk, on
    the device tier as its device copy); parameters view the (freed) full device copy when sharded.
    ``value_of(param)`` gives the parameter's full current value (default: ``param.data``); it is cast
    to ``dtype``. Padding elements are zero. ``to_disk``: each chunk's shard goes to the disk tier as
    soon as it is filled (``offload_param="disk"``: host memory holds one chunk at a time).
    """
    value_of = value_of or (lambda p: p.data)
    groups = pack([p.numel() for _, p, _ in entries], [k for _, _, k in entries], chunk_numel)
    chunks = []
    for n, indices in enumerate(groups):
        chunk = Chunk(first_index + n, chunk_numel, dtype, entries[indices[0]][2], memory, shards)
        local = allocate_param_copy(chunk, tier)
        local.zero_()
        for i in indices:
            name, param, _key = entries[i]
            chunk.write_own_part(chunk.add_slot(param, name), local, value_of(param))
        chunk.bind_views(chunk.param.device if shards.sharded else local)
        if to_disk:
            chunk.param.shard.move_to(Tier.DISK)
            chunk.bind_views(chunk.param.device)
        for slot in chunk.slots:
            adopt(slot.param, slot)
        chunks.append(chunk)
    return chunks


def allocate_param_copy(chunk: Chunk, tier: Tier) -> torch.Tensor:
    """Allocate the chunk's first parameter copy on ``tier`` and return it (the caller writes the values
    at once): the shard, or with one rank on the device tier the device copy."""
    return chunk.param.first_copy(tier)


class ScheduleDriver:
    """``manager.scheduler``: where the hooks and the wrapper report iteration and period boundaries.

    It is the manager's side of the scheduling: each event goes to the :class:`~chunkmem.runtime.schedule.Scheduler`
    (``planner``), which decides and returns orders, and the manager executes them. The planner holds no
    reference to the manager. Read-only views of the planner's figures (``mode``, ``traces``...) are here
    for the statistics.
    """

    def __init__(self, manager: "ChunkManager", planner: Scheduler) -> None:
        self._manager = manager
        self.planner = planner

    # ---- read-only views ---------------------------------------------------------------------------

    @property
    def mode(self) -> IterationMode:
        return self.planner.mode

    @property
    def traces(self) -> int:
        return self.planner.traces

    @property
    def iterations(self) -> int:
        return self.planner.iterations

    @property
    def periods(self) -> list[Period] | None:
        return self.planner.periods

    @property
    def stats(self) -> list[PeriodStats]:
        return self.planner.stats

    @property
    def margin_bytes(self) -> int:
        return self.planner.margin_bytes

    @property
    def plan(self) -> MovePlan | None:
        return self.planner.state.plan

    # ---- events ------------------------------------------------------------------------------------

    def begin_iteration(self, signature: Any, training: bool) -> None:
        manager = self._manager
        if self.planner.running:  # the last iteration stopped on an error: release what it held
            manager.recover_interrupted()
        if self.planner.begin_iteration(signature, training):
            manager.evict_unpinned()

    def begin_period(self, name: str, phase: str, chunks: list[Chunk]) -> None:
        manager = self._manager
        required = [c.index for c in manager.chunks if c.in_use]
        orders = self.planner.begin_period(name, phase, [c.index for c in chunks], required)
        manager.ledger.context = f"period {self.planner.index - 1} ({name} {phase})"
        manager.log_event("period", self.planner.index - 1, name, phase)
        manager.execute(orders)

    def need(self, chunk: Chunk) -> None:
        if self.planner.need(chunk.index):
            self._manager.evict_unpinned()

    def grads_started(self, chunk: Chunk) -> None:
        self.planner.grads_started(chunk.index)

    def grads_finished(self, chunk: Chunk) -> None:
        self.planner.grads_finished(chunk.index)

    def module_chunks_changed(self) -> None:
        self.planner.module_chunks_changed()

    def close_finished_traces(self) -> None:
        self.planner.close_finished_traces()

    def paused(self) -> ContextManager[None]:
        return self.planner.paused()

    def end_iteration(self) -> None:
        if self.planner.end_iteration():
            self._make_plan()
        self._manager.ledger.context = ""

    def _make_plan(self) -> None:
        """Plan the new schedule and move the margin's optimizer state to the device."""
        manager = self._manager
        if not manager.chunks:
            return
        margin = self.planner.make_plan(manager.plan_inputs())
        for index in margin:
            manager.move_optimizer_state(manager.chunks[index], Tier.DEVICE)
            manager.settle(manager.chunks[index])


class ChunkManager:
    """Owns the chunks of one model and executes the policy's placement and the scheduler's orders.

    ``reuse_param_memory_for_grads`` (``reuse_fp16_shard``) writes each gradient into the memory of its
    16-bit parameter once the parameter's backward is done, instead of into a separate grad buffer.
    ``reduction`` reduce-scatters finished gradients over the data-parallel ranks (when the chunks
    are sharded); ``gather_together`` gathers all chunks one module needs with one collective.
    ``prefetch``: while an iteration follows its recorded schedule, start fetching the next period's
    chunks before the current period computes, where the capacity allows (one rank only: sharded
    fetches are collectives). ``events``: set it to a list to have the manager append
    ``("period", index, name, phase)`` at each period start and ``("fetch", chunk index, "prefetch" or
    "demand")`` at each fetch it issues (for tests and debugging; ``None`` records nothing).
    """

    def __init__(self, chunks: list[Chunk], memory: TierMemory, policy: PlacementPolicy,
                 reuse_param_memory_for_grads: bool, reduction: GradientReduction | None = None,
                 gather_together: bool = False) -> None:
        self.memory = memory
        self.policy = policy
        self.reuse_grads = reuse_param_memory_for_grads
        self.reduction = reduction or GradientReduction(SINGLE_PROCESS)
        self.gather_together = gather_together
        self.gathers = 0  # all-gather collectives run so far
        self.grads_pending = False
        self.no_sync = False  # ShardedModelV2.no_sync(): sharded gradients stay local, unreduced
        # called with each chunk whose gradients of this backward are final (reduced, where they rest),
        # outside no_sync (ShardedOptimizerV2's step_in_backward)
        self.on_grads_final: Callable[[Chunk], None] | None = None
        self.backward_count = 0  # backward passes finished (autograd's end of backward) so far
        self.optimizer_state_exists = False
        self.prefetch = True
        self.prefetched = 0  # chunk fetches issued ahead of their period so far
        self.events: list[tuple] | None = None
        self.stale: dict[Chunk, None] = {}
        self._pending_prefetch: PeriodOrders | None = None
        self.scheduler = ScheduleDriver(self, Scheduler(memory.ledger, policy, device_of_tier(Tier.DEVICE)))
        self.chunks = chunks

    @property
    def chunks(self) -> list[Chunk]:
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: list[Chunk]) -> None:
        self._chunks = chunks
        self.policy.configure(chunks)

    @property
    def ledger(self) -> TierLedger:
        """The byte counts of the chunks' memory."""
        return self.memory.ledger

    @property
    def sharded(self) -> bool:
        """Whether the chunks are split over several data-parallel ranks."""
        return self.reduction.shards.sharded

    def log_event(self, *event: Any) -> None:
        if self.events is not None:
            self.events.append(event)

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
        if chunk.in_use:
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
            elif tier in (Tier.HOST, Tier.DISK):
                buf.wait()
                if not buf.shard_valid:
                    buf.write_back_shard()
                if tier is Tier.DISK and not buf.shard.on_disk:
                    buf.shard.move_to(Tier.DISK)
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
            buf.wait()
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
            if not chunk.in_use and not self.keeps_device_copy(chunk):
                with self.scheduler.paused():
                    chunk.param.free_device()

    def settle_all(self) -> None:
        for chunk in self.chunks:
            self.settle(chunk)

    def evict_unpinned(self) -> None:
        """Under ``auto``: free the device copy of every unused chunk outside the margin."""
        margin = getattr(self.policy, "margin_chunks", None)
        if margin is None:
            return
        with self.scheduler.paused():
            for chunk in self.chunks:
                if chunk.index not in margin and not chunk.in_use:
                    chunk.param.free_device()

    def place_optimizer_state(self, chunk: Chunk) -> None:
        """Allocate the chunk's optimizer families (this rank's shard) on the policy's tier: the fp32
        master from the current parameters, exp_avg and exp_avg_sq zero."""
        tier = self.policy.optim_tier(chunk)
        if chunk.has_master:
            chunk.optim[MASTER].allocate(tier)
            chunk.optim[MASTER].write(chunk.param.local())
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
        if chunk.in_use:
            raise ChunkStateError(f"{chunk.name}", "be loaded (a module is using it)", CopyState.CURRENT, (),
                                  chunk.shards.rank)
        self.stale.pop(chunk, None)
        with self.scheduler.paused():
            chunk.param.load_values(local)
        self.settle(chunk)

    def plan_inputs(self) -> PlanInputs:
        """The byte counts the planner needs (see :class:`~chunkmem.runtime.schedule.PlanInputs`)."""
        first = self.chunks[0]
        group_bytes = self._optimizer_group_bytes(first) if self.optimizer_state_exists else 0
        return PlanInputs(self.ledger.capacity, first.param.nbytes, group_bytes, self.reuse_grads,
                          self.reduction.shards)

    def _optimizer_group_bytes(self, chunk: Chunk) -> int:
        """Device bytes of one chunk kept there with its optimizer state: this rank's shard of the fp32
        families and of the gradient, the full parameter copy, and (sharded) the parameter shard."""
        fp32 = 4 * chunk.shard_numel
        families = 3 if chunk.has_master else 2
        shard_bytes = chunk.param.shard.nbytes
        grad = 0 if self.reuse_grads else shard_bytes
        return families * fp32 + chunk.param.nbytes + (shard_bytes if chunk.param.sharded else 0) + grad

    # ---- executing the scheduler's orders ----------------------------------------------------------

    def execute(self, orders: PeriodOrders) -> None:
        """Carry out what the scheduler ordered at a period's start (see
        :class:`~chunkmem.runtime.schedule.PeriodOrders`); the prefetch waits until the period's own chunks are
        on the device (:meth:`acquire` / :meth:`hold_for_backward`)."""
        self.flush_stale(keep=[self.chunks[i] for i in orders.keep])
        if orders.evict_unpinned:
            self.evict_unpinned()
        with self.scheduler.paused():
            for index in orders.evict:
                chunk = self.chunks[index]
                if not chunk.in_use:
                    chunk.param.free_device()
        self.fetch([self.chunks[i] for i in orders.fetch])
        self.ledger.peak_device_bytes = self.ledger.tier_bytes(Tier.DEVICE)
        # sharded, a prefetch is a gather every rank starts alike: the decision in _issue_prefetch reads only
        # what agrees over the ranks (the chunks on the device and the agreed traced peaks)
        self._pending_prefetch = orders if self.prefetch and orders.prefetch else None

    def _issue_prefetch(self) -> None:
        """Start fetching the next period's chunks that are not on the device, in order, as many as fit
        in the capacity less the device bytes in use, the chunks this period still needs and the
        period's reserve (its traced non-model peak and gradient staging)."""
        orders, self._pending_prefetch = self._pending_prefetch, None
        ahead = [self.chunks[i] for i in orders.prefetch if not self.chunks[i].param.device_allocated]
        if not ahead or any(c.param.holds_grads for c in ahead):
            return
        chunk_bytes = ahead[0].param.nbytes
        missing = sum(1 for i in orders.needed if not self.chunks[i].param.device_allocated)
        free = self.ledger.capacity - self.ledger.tier_bytes(Tier.DEVICE) - orders.reserve - missing * chunk_bytes
        rests_on_host = [self.policy.param_rest_tier(c) is Tier.HOST for c in ahead]
        with self.scheduler.paused():
            for chunk, to_host in zip(ahead[:max(free, 0) // chunk_bytes], rests_on_host):
                chunk.param.start_fetch()
                self.prefetched += 1
                self.log_event("fetch", chunk.index, "prefetch")
                if to_host:  # freed at the next period boundary unless that period needs it
                    self.stale[chunk] = None

    # ---- forward and backward use ------------------------------------------------------------------

    def acquire(self, chunks: Iterable[Chunk]) -> None:
        """Make the chunks' parameters current on the device and count one more user of each."""
        chunks = list(chunks)
        for chunk in chunks:
            self._check_not_holding_grads(chunk)
            self.scheduler.need(chunk)
        self.fetch(chunks)
        for chunk in chunks:
            chunk.add_user()
        if self._pending_prefetch is not None:
            self._issue_prefetch()

    def fetch(self, chunks: Sequence[Chunk]) -> None:
        """Make the chunks' full device copies current: one gather per chunk, or with ``gather_together``
        one for all of them; a copy already in flight (prefetched) is waited on. Every rank fetches the
        same chunks in the same order."""
        missing = [c for c in chunks if not c.param.device_valid]
        with self.scheduler.paused():
            idle = [c for c in missing if not c.param.fetching]  # the others were prefetched: waited on below
            if self.gather_together and len(idle) > 1 and idle[0].param.sharded:
                gather_together([c.param for c in idle])
                self.gathers += 1
                missing = [c for c in missing if c.param.fetching]
            issued = []
            for chunk in missing:
                if not chunk.param.fetching:
                    chunk.param.start_fetch()
                    self.gathers += chunk.param.sharded
                    self.log_event("fetch", chunk.index, "demand")
                issued.append(chunk)
            for chunk in issued:
                chunk.param.wait()

    def release(self, chunks: Iterable[Chunk]) -> None:
        """Count one user fewer; a chunk nobody uses any more goes back where the policy rests it."""
        for chunk in chunks:
            chunk.remove_user()
            self.settle(chunk)

    def hold_for_backward(self, chunks: Iterable[Chunk]) -> None:
        """Fetch the chunks and keep them on the device until their gradients are finished."""
        chunks = [c for c in chunks if not c.held_for_backward]
        for chunk in chunks:
            self._check_not_holding_grads(chunk)
            self.scheduler.need(chunk)
        self.fetch(chunks)
        for chunk in chunks:
            chunk.hold()
        if self._pending_prefetch is not None:
            self._issue_prefetch()

    def _check_not_holding_grads(self, chunk: Chunk) -> None:
        if chunk.param.holds_grads:
            raise GradientAccumulationError(
                "reuse_fp16_shard=True keeps gradients in the parameters' memory until optim.step(), so "
                "a forward or backward before the step (gradient accumulation) is not possible; call "
                "optim.step() or optim.zero_grad() first, or build ShardedModelV2 with reuse_fp16_shard=False")

    def recover_interrupted(self) -> None:
        """The last iteration stopped on an error (e.g. :class:`~chunkmem.DeviceCapacityError` in its
        backward): release what its backward held, drop its unfinished gradients (staging buffers, and
        with ``reuse_fp16_shard`` device copies part-overwritten by gradients), and put every chunk
        where it rests, so the next iteration starts as after a finished one. Gradients of chunks
        the backward had finished stay (``optim.zero_grad()`` drops them)."""
        self._pending_prefetch = None
        with self.scheduler.paused():
            for chunk in self.chunks:
                chunk.unhold()
                if self.reuse_grads and chunk.grad_slots_received and chunk.param.shard_valid:
                    chunk.param.drop_device_copy()
                chunk.grad_slots_received.clear()
                chunk.grads_finished = False
                chunk.accumulator_fresh = False
                chunk.grad_staging.free()
        for chunk in self.chunks:
            self.settle(chunk)
        self.flush_stale()

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
            buf.mark_written()  # it accumulates this backward's gradients from now on
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
                    buf.grads_in_shard(self.reduction.reduce(chunk, buf.device))
                else:
                    buf.grads_in_device_copy()
            else:
                accumulator = self._grad_accumulator(chunk)
                if chunk.accumulator_fresh:
                    self._zero_unwritten(chunk, accumulator)
                    chunk.accumulator_fresh = False
                deferred = self.no_sync and buf.sharded  # the staging buffer keeps accumulating, unreduced
                if chunk.grad_staging.allocated and not deferred:
                    finished = self.reduction.reduce(chunk, accumulator) if buf.sharded else accumulator
                    if chunk.grad.allocated:
                        chunk.grad.tensor.add_(finished.to(chunk.grad.tensor.device))
                    else:
                        chunk.grad.allocate(self.policy.grad_tier(chunk)).copy_(finished)
                        chunk.grad.mark_written()
                    if chunk.grad.tier is Tier.HOST:
                        self.ledger.count_move(Tier.HOST, chunk.grad.nbytes)
                    chunk.grad_staging.free()
        chunk.grad_slots_received.clear()
        chunk.grads_finished = True
        chunk.unhold()
        self.grads_pending = self.grads_pending or not (self.no_sync and buf.sharded)
        self.scheduler.grads_finished(chunk)
        self.settle(chunk)
        if self.on_grads_final is not None and not self.no_sync:
            self.on_grads_final(chunk)

    def end_backward(self) -> None:
        """After autograd finished: finish every trainable chunk not finished yet (parameters that got no
        gradient get zero), release what backward held, and close the iteration."""
        self._pending_prefetch = None
        for chunk in self.chunks:
            if chunk.trainable and not chunk.grads_finished:
                self.finish_grads(chunk)
            elif chunk.held_for_backward:
                chunk.unhold()
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
        """Drop (``set_to_none``) or zero every gradient buffer, and drop gradients accumulated unreduced
        inside ``no_sync``."""
        for chunk in self.chunks:
            if chunk.grad_staging.allocated and not chunk.grad_slots_received:
                chunk.grad_staging.free()
                chunk.accumulator_fresh = False
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
            buf.wait()
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
            if buf.shard.on_disk:  # back to the disk when the chunk settles after the update
                buf.shard.move_to(Tier.HOST)
            return buf.shard.tensor

    def params_updated(self, chunk: Chunk, tier: Tier) -> None:
        """The copy on ``tier`` now holds the new parameter values; drop (or, sharded and kept,
        invalidate) the other copy."""
        self.stale.pop(chunk, None)
        chunk.param.updated_on(tier, self.keeps_device_copy(chunk))
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
        self._out: torch.Tensor | None = None  # the reduced shard's buffer, reused from chunk to chunk

    def _out_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = self._out
        if out is None or out.numel() != numel or out.dtype != dtype or out.device != device:
            out = self._out = torch.empty(numel, dtype=dtype, device=device)
        return out

    def reduce(self, chunk: Chunk, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the mean over the ranks of ``full`` (``chunk.numel`` elements on the
        device tier; it may be overwritten), in the chunk's dtype. The result is valid until the next
        call (its buffer is reused: copy it out)."""
        world, shard_numel = self.shards.world, chunk.shard_numel
        dtype = torch.float32 if self.fp32 else full.dtype
        out = self._out_buffer(shard_numel, dtype, full.device)
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
