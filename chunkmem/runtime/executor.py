"""The chunk executor: carries out every move of one model's chunks between tiers.

It decides nothing: where a chunk rests is the placement policy's answer (:mod:`chunkmem.runtime.placement`),
when to move what is the scheduler's (:mod:`chunkmem.runtime.schedule`), and the model's runtime
(:mod:`chunkmem.runtime.runtime`) hands their orders here. It fetches (issuing transfers and waiting on
their handles, :mod:`chunkmem.core.transfer`), counts users, releases, settles chunks where they rest,
and gives the optimizer the copy an update writes. Chunk buffers change state only through their own
transitions (:mod:`chunkmem.core.chunk`), and every byte goes through the model's
:class:`~chunkmem.core.memory.TierMemory`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..core.chunk import MASTER, Chunk, gather_together
from ..core.copy_engine import nothing_to_wait_for
from ..errors import GradientAccumulationError
from ..core.memory import RESTING_FAMILY, TierMemory
from ..core.states import ChunkStateError, CopyState
from ..core.tiers import Tier
from .placement import PlacementPolicy, PlacementState
from .schedule import PeriodOrders


class ChunkExecutor:
    """Executes the placement and the scheduler's orders for the chunks of one model.

    ``gather_together`` gathers all chunks one module needs with one collective (the bucket strategy).
    ``prefetch``: while an iteration follows its recorded schedule, start fetching the next period's
    chunks before the current period computes, where the capacity allows (at most ``prefetch_chunks``
    of them, when set). ``events``: set it to a list
    to have ``("period", index, name, phase)`` appended at each period start and ``("fetch", chunk index,
    "prefetch" or "demand")`` at each fetch issued (for tests and debugging; ``None`` records nothing).
    ``gathers`` and ``prefetched`` count the all-gathers and the fetches issued ahead so far.
    """

    def __init__(self, chunks: list[Chunk], memory: TierMemory, policy: PlacementPolicy, state: PlacementState,
                 gather_together: bool = False) -> None:
        self.memory = memory
        self.policy = policy
        self.state = state
        self.gather_together = gather_together
        self.gathers = 0
        self.prefetch = True
        self.prefetch_chunks: int | None = None  # most chunks fetched ahead at once (None: the capacity decides)
        self.prefetched = 0
        self.events: list[tuple] | None = None
        self.stale: dict[Chunk, None] = {}
        self._pending_prefetch: PeriodOrders | None = None
        self._ahead: set[Chunk] = set()  # fetched after the step for the next iteration's first period
        self.chunks = chunks

    @property
    def chunks(self) -> list[Chunk]:
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: list[Chunk]) -> None:
        self._chunks = chunks
        self.state.num_chunks = len(chunks)
        self.state.trainable = tuple(c.index for c in chunks if c.trainable)

    def log_event(self, *event: Any) -> None:
        if self.events is not None:
            self.events.append(event)

    # ---- the placement, for this chunk -------------------------------------------------------------

    def rest_tier(self, chunk: Chunk) -> Tier | None:
        """Where the chunk's parameters rest between uses (``None``: the plan decides)."""
        return self.policy.param_rest_tier(chunk, self.state)

    def compute_tier(self, chunk: Chunk) -> Tier:
        """Where the chunk's optimizer update runs."""
        return self.policy.compute_tier(chunk, self.state)

    def optim_tier(self, chunk: Chunk) -> Tier:
        """Where the chunk's optimizer state rests."""
        return self.policy.optim_tier(chunk, self.state)

    def grad_tier(self, chunk: Chunk) -> Tier:
        """Where the chunk's finished gradients rest until the step."""
        return self.policy.grad_tier(chunk, self.state)

    def keeps_device_copy(self, chunk: Chunk) -> bool:
        """Whether the chunk's full device copy stays allocated between uses."""
        if chunk.param.sharded:
            return self.policy.keeps_gathered(chunk, self.state)
        return self.rest_tier(chunk) is Tier.DEVICE

    # ---- placement at rest -------------------------------------------------------------------------

    def bind_views_to_device(self) -> None:
        """Make every parameter view the device copy of its chunk, whose memory is given and taken
        back as the chunk is fetched and released."""
        for chunk in self.chunks:
            chunk.bind_views(chunk.param.device)

    def resident_throughout(self, moves: Any, gradients_in_param_memory: bool) -> bool:
        """Whether an iteration that follows the schedule would move nothing: every chunk unsharded, its full
        device copy current, resting on the device (or, under a plan, ``moves``, none of whose periods evicts,
        fetches or falls back), and the gradients outside the parameters' memory (which the backward holds)."""
        if gradients_in_param_memory:
            return False
        if moves is not None and any(p.evict or p.fetch or p.fallback for p in moves.periods):
            return False
        for chunk in self.chunks:
            rest = self.rest_tier(chunk)
            if rest is Tier.DEVICE and not chunk.param.sharded:
                chunk.param.wait()  # the copy back of a host update (settle): no hook waits in a steady iteration
            if chunk.param.sharded or not chunk.param.device_valid or rest is Tier.HOST or rest is Tier.DISK:
                return False
            if rest is None and moves is None:
                return False
        return True

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
        tier = self.rest_tier(chunk)
        if buf.holds_grads and self.grad_tier(chunk) is Tier.HOST:
            tier = Tier.HOST
        if tier is Tier.DEVICE:
            if chunk.trainable and self.compute_tier(chunk) is Tier.HOST:
                # the shard stays, current: the host update writes it every step (offloaded optimizer state), and
                # giving it back would pin and unpin its memory and copy it back from the device at every step.
                # So the copy back of an update is not waited for here: the step updates the next chunk
                # meanwhile, and the next reader of the device copy waits (resident_throughout, a fetch, a read)
                if not buf.device_valid and not buf.fetching:
                    buf.start_fetch()
            else:
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
        tier = self.grad_tier(chunk) if buf.holds_grads else self.rest_tier(chunk)
        if tier is not None and buf.shard.tier is not tier:
            buf.shard.move_to(tier)
        if tier is None or not buf.device_allocated or self.keeps_device_copy(chunk):
            return
        buf.wait()
        if buf.device_valid:
            self.stale[chunk] = None
        else:
            buf.free_device()

    def settle_all(self) -> None:
        for chunk in self.chunks:
            self.settle(chunk)

    def drop_secondaries(self) -> None:
        """hpZ's secondary partitions live from a forward to its backward only."""
        for chunk in self.chunks:
            chunk.param.drop_secondary()

    def flush_stale(self, keep: Iterable[Chunk] = ()) -> None:
        """Free the device copies of stale chunks, except those in ``keep`` or in use again."""
        keep = set(keep)
        for chunk in list(self.stale):
            if chunk in keep:
                continue
            del self.stale[chunk]
            if not chunk.in_use and not self.keeps_device_copy(chunk):
                chunk.param.free_device()

    def evict_unpinned(self) -> None:
        """Under ``auto``: free the device copy of every unused chunk outside the margin, except those fetched
        after the step for the first period (:meth:`prefetch_next_forward`)."""
        if not self.policy.plans_from_trace:
            return
        for chunk in self.chunks:
            if chunk.index not in self.state.margin_chunks and not chunk.in_use and chunk not in self._ahead:
                chunk.param.free_device()

    def place_optimizer_state(self, chunk: Chunk) -> None:
        """Allocate the chunk's optimizer families (this rank's shard) on the policy's tier: the fp32
        master from the current parameters, the per-element state (Adam's exp_avg and exp_avg_sq, or the
        optimizer's own) zero."""
        tier = self.optim_tier(chunk)
        if chunk.has_master:
            chunk.optim[MASTER].allocate(tier)
            chunk.optim[MASTER].write(chunk.param.local())
        for family in chunk.state_families:
            kept_in_memory = tier is Tier.DISK and family in chunk.in_memory_families
            chunk.optim[family].allocate(Tier.HOST if kept_in_memory else tier, zero=True)

    def move_optimizer_state(self, chunk: Chunk, tier: Tier) -> None:
        """Move the chunk's optimizer families (and a separate gradient buffer) to ``tier``."""
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
        chunk.param.load_values(local)
        self.settle(chunk)

    # ---- executing the scheduler's orders ----------------------------------------------------------

    def execute(self, orders: PeriodOrders) -> None:
        """Carry out what the scheduler ordered at a period's start (see
        :class:`~chunkmem.runtime.schedule.PeriodOrders`); the prefetch waits until the period's own
        chunks are on the device (:meth:`acquire` / :meth:`hold_for_backward`)."""
        if self.stale:
            self.flush_stale(keep=[self.chunks[i] for i in orders.keep])
        if orders.evict_unpinned:
            self.evict_unpinned()
        for index in orders.evict:
            chunk = self.chunks[index]
            if not chunk.in_use:
                chunk.param.free_device()
        if orders.fetch:
            fetched = [self.chunks[i] for i in orders.fetch]
            for chunk in self._ahead.intersection(fetched):  # the plan keeps what it fetches, ahead or not
                self.stale.pop(chunk, None)
            self.fetch(fetched)
        self._ahead.clear()
        self.memory.ledger.peak_device_bytes = self.memory.ledger.tier_bytes(Tier.DEVICE)
        # sharded, a prefetch is a gather every rank starts alike: the decision in _issue_prefetch reads only
        # what agrees over the ranks (the chunks on the device and the agreed traced peaks)
        self._pending_prefetch = orders if self.prefetch and orders.prefetch else None

    def _issue_prefetch(self) -> None:
        """Start fetching the next period's chunks that are not on the device, in order, as many as fit
        in the capacity less the device bytes in use, the chunks this period still needs and the
        period's reserve (its traced non-model peak and gradient staging), and at most
        ``prefetch_chunks`` (the model's ``prefetch_numel`` in whole chunks)."""
        orders, self._pending_prefetch = self._pending_prefetch, None
        ahead = [self.chunks[i] for i in orders.prefetch if not self.chunks[i].param.device_allocated]
        if not ahead or any(c.param.holds_grads for c in ahead):
            return
        if orders.guessed and any(c.param.sharded for c in ahead):
            return  # a guess's reserve is this rank's trace so far: the ranks could decide unlike
        missing = sum(1 for i in orders.needed if not self.chunks[i].param.device_allocated)
        for chunk in self._fetch_ahead(ahead, orders.reserve + missing * ahead[0].param.nbytes, "prefetch"):
            if self.rest_tier(chunk) is Tier.HOST or orders.guessed:
                self.stale[chunk] = None  # freed at the next period boundary unless that period needs it

    def prefetch_next_forward(self, start: tuple[list[int], int] | None) -> int:
        """After a step: start fetching the chunks the next iteration's first period fetches (``start``, from
        :meth:`~chunkmem.runtime.schedule.Scheduler.next_forward_start`: their indexes and the bytes that period
        keeps free), as many as fit in the capacity less the device bytes in use and that reserve, and at most
        ``prefetch_chunks``. On a GPU their copies then run while the caller prepares the next batch, instead of
        after the forward has begun. Each is marked stale: the first period keeps it, anything else frees it
        at its start, as a prefetch that turned out unused. Only unsharded chunks whose parameters rest in
        host memory (a gather is a collective, which every rank would have to start here alike; a read from
        disk takes the disk tier's thread). Returns the bytes whose copies started."""
        if start is None or not self.prefetch:
            return 0
        indexes, reserve = start
        ahead = [c for c in (self.chunks[i] for i in indexes) if not c.in_use and not c.param.sharded
                 and not c.param.device_allocated and not c.param.holds_grads and c.param.shard_valid
                 and not c.param.shard.on_disk]
        if not ahead:
            return 0
        moved = self.memory.ledger.moved_to_device
        for chunk in self._fetch_ahead(ahead, reserve, "after step"):
            self.stale[chunk] = None
            self._ahead.add(chunk)
        return self.memory.ledger.moved_to_device - moved

    def _fetch_ahead(self, chunks: list[Chunk], keep_free: int, why: str) -> list[Chunk]:
        """Start fetching the first of ``chunks`` (none on the device, all of one size) that fit in the capacity less
        the device bytes in use and ``keep_free``, at most ``prefetch_chunks`` of them; ``why`` names the fetches in
        :attr:`events`. Returns those started."""
        ledger = self.memory.ledger
        count = max(ledger.capacity - ledger.tier_bytes(Tier.DEVICE) - keep_free, 0) // chunks[0].param.nbytes
        if self.prefetch_chunks is not None:
            count = min(count, self.prefetch_chunks)
        for chunk in chunks[:count]:
            chunk.param.start_fetch(exact=False)
            self.gathers += chunk.param.sharded
            self.prefetched += 1
            self.log_event("fetch", chunk.index, why)
        return chunks[:count]

    # ---- forward and backward use ------------------------------------------------------------------

    def acquire(self, chunks: Iterable[Chunk], exact: bool = False) -> None:
        """Make the chunks' parameters current on the device and count one more user of each (``exact``:
        never the dequantized copy of a quantized gather, for code that reads or writes the values)."""
        chunks = list(chunks)
        self.fetch(chunks, exact)
        for chunk in chunks:
            chunk.add_user()
        if self._pending_prefetch is not None:
            self._issue_prefetch()

    def fetch(self, chunks: Sequence[Chunk], exact: bool = False) -> None:
        """Make the chunks' full device copies current: one gather per chunk, or with ``gather_together``
        one for all of them; a copy already in flight (prefetched) is waited on. Every rank fetches the
        same chunks in the same order. Compute fetches of a model with quantized gathers get dequantized
        copies; ``exact`` ones replace such a copy by an exact gather."""
        if exact:
            for chunk in chunks:
                if chunk.param.approximate:
                    if chunk.in_use:
                        raise ChunkStateError(chunk.name, "be read exactly while a module computes with its "
                                              "dequantized copy", chunk.param.device_state, (), chunk.shards.rank)
                    self.stale.pop(chunk, None)
                    chunk.param.drop_device_copy()
        missing = [c for c in chunks if not c.param.device_valid]
        idle = [c for c in missing if not c.param.fetching]  # the others were prefetched: waited on below
        if self.gather_together and len(idle) > 1 and idle[0].param.sharded:
            gather_together([c.param for c in idle])
            self.gathers += 1
            missing = [c for c in missing if c.param.fetching]
        issued = []
        for chunk in missing:
            if not chunk.param.fetching:
                chunk.param.start_fetch(exact)
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
        self.fetch(chunks)
        for chunk in chunks:
            chunk.hold()
        if self._pending_prefetch is not None:
            self._issue_prefetch()

    def release_backward_hold(self, chunk: Chunk) -> None:
        """The chunk's backward is over: it may leave the device again."""
        chunk.unhold()
        self.settle(chunk)

    def cancel_prefetch(self) -> None:
        self._pending_prefetch = None

    @staticmethod
    def check_free_of_grads(chunk: Chunk) -> None:
        """Refuse to compute with a chunk whose parameter memory holds gradients (``reuse_fp16_shard``)."""
        if chunk.param.holds_grads:
            raise GradientAccumulationError(
                "reuse_fp16_shard=True keeps gradients in the parameters' memory until optim.step(), so "
                "a forward or backward before the step (gradient accumulation) is not possible; call "
                "optim.step() or optim.zero_grad() first, or build ShardedModelV2 with reuse_fp16_shard=False")

    # ---- optimizer updates -------------------------------------------------------------------------

    @contextlib.contextmanager
    def updating(self, chunk: Chunk, tier: Tier) -> Iterator[torch.Tensor]:
        """The copy of this rank's parameters on ``tier`` that an update running there writes; when the
        block ends without an exception that copy holds the new values (:meth:`mark_updated`)."""
        target = self.update_target(chunk, tier)
        yield target
        self.mark_updated(chunk, tier)

    def update_target(self, chunk: Chunk, tier: Tier) -> torch.Tensor:
        """The first half of :meth:`updating`, for updates that complete later (the streamed disk step):
        the copy on ``tier`` an update writes. Without a separate master (fp32) the update also reads
        it, so it is made current first."""
        target, wait = self.update_target_waiting_later(chunk, tier)
        wait()
        return target

    def update_target_waiting_later(self, chunk: Chunk, tier: Tier) -> tuple[torch.Tensor, Callable[[], None]]:
        """:meth:`update_target` and the wait for the copies still reading it (a fetch of the parameters to
        the device), which the caller runs before it writes: an update running off autograd's thread waits
        there, so that autograd's thread goes on launching the backward."""
        buf = chunk.param
        buf.wait()
        if buf.sharded:
            if buf.shard.tier is not tier:
                buf.shard.move_to(tier)
            return buf.shard.tensor, buf.shard.host_write_wait()
        if tier is Tier.DEVICE:
            if chunk.has_master:
                buf.allocate_device()
            else:
                buf.fetch_to_device()
            return buf.device, nothing_to_wait_for
        if not buf.shard.allocated:
            buf.shard.allocate(Tier.HOST)
        if not chunk.has_master and not buf.shard_valid:
            buf.write_back_shard()
        if buf.shard.on_disk:  # back to the disk when the chunk settles after the update
            buf.shard.move_to(Tier.HOST)
        return buf.shard.tensor, buf.shard.host_write_wait()

    def copy_of_resting_values(self, chunk: Chunk) -> torch.Tensor | None:
        """A host copy of this rank's parameter values of ``chunk``, whose parameters rest on disk and are their
        own masters, taken from the device copy the forward or backward fetched, or ``None`` where that copy
        is gone or does not hold them exactly (dequantized from a quantized gather; gradients in its memory).
        The streamed disk step then updates from it instead of reading the same bytes from disk again."""
        buf = chunk.param
        if chunk.has_master or not buf.shard.on_disk:
            return None
        buf.wait()
        if not buf.device_valid or buf.approximate or buf.holds_grads:
            return None
        ledger = self.memory.ledger
        if ledger.host_capacity is not None and ledger.tier_bytes(Tier.HOST) + buf.shard.nbytes > ledger.host_capacity:
            return None
        values = self.memory.take(Tier.HOST, RESTING_FAMILY, buf.shard_numel, buf.dtype,
                                  f"{chunk.name}'s parameters for the disk step")
        # waited for here, in the backward: the device copy may be freed and its memory reused once this returns
        # (on a GPU a copy into pageable memory waits anyway; the disk step, far slower, bounds this backward)
        self.memory.copies.to_host(values, buf.own_slice(buf.device), "resting values for the disk step").wait()
        return values

    def release_copy_of_resting_values(self, values: torch.Tensor) -> None:
        """The disk step took :meth:`copy_of_resting_values`' copy: its memory goes back."""
        self.memory.give_back(Tier.HOST, RESTING_FAMILY, values.nbytes, values)

    def mark_updated(self, chunk: Chunk, tier: Tier) -> None:
        """The second half of :meth:`updating`: the copy on ``tier`` (the shard when sharded; ``DISK``: the
        shard on disk, written by the streamed step) holds the parameters' values now. It becomes the
        current copy; the other is dropped (or, sharded and kept, marked out of date)."""
        self.stale.pop(chunk, None)
        chunk.param.updated_on(tier, self.keeps_device_copy(chunk))
        self.settle(chunk)
