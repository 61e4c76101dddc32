"""The iteration scheduler: traces an iteration, checks later ones against it, and plans each period.

Iterations are delimited by the wrapped model's forward (start) and the end of autograd's backward
(end). The first training iteration is traced (:mod:`chunkmem.runtime.tracer`); so is any iteration whose
inputs have other shapes than the traced one, and the one after an iteration that left the schedule
(another branch) or was interrupted by an error. Forwards without autograd (``torch.no_grad()``) are
neither traced nor planned.

The scheduler only decides: it moves nothing, runs no collective and holds no reference to what
executes. Each of its event methods returns what the model's runtime is to do (a :class:`PeriodOrders`
at a period's start), and the :class:`~chunkmem.runtime.executor.ChunkExecutor` alone executes. What the
trace and the margin decide under ``auto`` is written here, and only here, into the runtime's
:class:`~chunkmem.runtime.placement.PlacementState`. Figures that must agree over the ranks (the traced
peaks) are agreed by the runtime and handed in (:meth:`Scheduler.schedule_moves`).

The iteration's mode is an :class:`IterationMode`; its transitions:

==================  ==================================  =================================================
from                to                                  on
==================  ==================================  =================================================
any but the four    TRACING / FOLLOWING / UNTRACED      ``begin_iteration`` (an iteration still running
running modes                                           is first ended as interrupted, see below)
FOLLOWING           DIVERGED                            a period or chunk the schedule does not have
TRACING             IDLE                                ``end_iteration``: the trace becomes the schedule
FOLLOWING,          IDLE                                ``end_iteration``
DIVERGED
TRACING, FOLLOWING  INTERRUPTED                         ``interrupt``: the next forward found the last
DIVERGED                                                iteration unfinished (an error in its forward or
                                                        backward, or no backward); an unfinished trace
                                                        is taken again
==================  ==================================  =================================================
"""
from __future__ import annotations

import enum
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from ..core.ledger import TierLedger
from ..core.states import ChunkStateError
from ..core.tiers import Tier
from .placement import PlacementPolicy, PlacementState, choose_margin_chunks, plan_belady
from .tracer import IterationTrace, Period


class IterationMode(str, enum.Enum):
    """What the running iteration does (compares equal to its value, e.g. ``"following"``)."""

    IDLE = "idle"              # between iterations
    TRACING = "tracing"        # recording the schedule
    FOLLOWING = "following"    # executing the plan of the recorded schedule
    DIVERGED = "diverged"      # left the schedule: evict after use until it ends
    UNTRACED = "untraced"      # a forward without autograd
    INTERRUPTED = "interrupted"  # the last iteration stopped on an error; the next one is traced


RUNNING = (IterationMode.TRACING, IterationMode.FOLLOWING, IterationMode.DIVERGED)


@dataclass
class PeriodStats:
    """What one period of the last iteration did on the device tier (bytes)."""

    name: str
    phase: str
    device_model_peak: int = 0
    host_model_bytes: int = 0
    moved_to_device: int = 0
    moved_to_host: int = 0


PREFETCH_LOOKAHEAD = 64
"""How many periods ahead a placement without a plan (``cpu``, sharded ``cuda``) looks for the next chunk to
fetch (see :meth:`Scheduler._next_new_chunks`)."""

@dataclass
class PeriodOrders:
    """What the manager does at the start of a period, in this order: free the stale device copies but
    those of ``keep``; with ``evict_unpinned`` free every unused device copy outside the margin; free the
    device copies of ``evict`` (unused ones); fetch ``fetch``; then, once the period's own chunks are on
    the device, start fetching ``prefetch`` (the next period's chunks) where the capacity allows it,
    keeping ``reserve`` bytes free for the period's non-model memory and gradient staging, and room for
    the chunks of ``needed`` (the period's, as traced) not on the device yet."""

    keep: list[int] = field(default_factory=list)
    evict_unpinned: bool = False
    evict: list[int] = field(default_factory=list)
    fetch: list[int] = field(default_factory=list)
    prefetch: list[int] = field(default_factory=list)
    reserve: int = 0
    needed: list[int] = field(default_factory=list)
    guessed: bool = False  # ``prefetch`` is a traced iteration's guess (:meth:`Scheduler.guess_prefetch`)


@dataclass
class MoveInputs:
    """What the planner needs to know of the chunks (bytes): the device capacity, one chunk's parameter
    bytes, one optimizer chunk group's device bytes (0 before the optimizer exists), whether gradients
    live in the parameter memory (no staging buffers), whether the chunks are sharded (then every
    gradient is reduced from a staging buffer), and each period's non-model peak as agreed over the ranks
    (the largest any rank traced: every rank must fetch the same chunks in the same order)."""

    capacity: int
    param_bytes: int
    group_bytes: int
    grads_in_param_memory: bool
    sharded: bool
    agreed_peaks: list[int]


class Scheduler:
    """Owned by the model's runtime; see the module docstring. ``ledger`` is read (bytes per tier and
    moves, for the per-period statistics), never written; ``state`` is the runtime's placement state,
    whose plan, margin and ``following`` fields only the scheduler writes."""

    def __init__(self, ledger: TierLedger, policy: PlacementPolicy, state: PlacementState,
                 device: torch.device, chunk_count: int = 0) -> None:
        self.ledger = ledger
        self.chunk_count = chunk_count  # the model's chunks (a traced iteration guesses among them)
        self.device = device
        self.policy = policy
        self.state = state
        self.periods: list[Period] | None = None
        self._lookahead: list[list[int]] = []  # per period of the schedule: _next_new_chunks, computed once
        self.trace: IterationTrace | None = None
        self.signature: Any = None
        self._mode = IterationMode.IDLE
        self.index = 0
        self.retrace = True
        self.iterations = 0
        self.traces = 0
        self.stats: list[PeriodStats] = []
        self._moved_mark = (0, 0)
        self._periods_changed = False
        self._to_close: list[IterationTrace] = []
        self._staging: list[int] = []  # per period, gradient staging buffers alive at most (prefetch reserve)
        self._used_in_phase: dict[str, set[int]] = {}  # a trace's chunks used so far, by phase (guess_prefetch)
        self._peak_so_far = 0  # the largest non-model peak of a trace's closed periods so far (guess_prefetch)
        self._param_bytes = 0
        self._moved_ahead = 0  # bytes fetched after the last step for the next iteration (fetched_ahead)
        self._steady = False  # the running iteration follows the schedule without walking it (follow_steadily)
        self.steady_iterations = 0
        self._walked_stats: list[PeriodStats] = []  # the stats of the last iteration that walked its periods
        # per period index: the call's chunks, what the orders were made from, a chunk's bytes, the orders
        self._orders_made: dict[int, tuple[tuple[int, ...], tuple, int, PeriodOrders]] = {}  # (_followed_orders)

    @property
    def mode(self) -> IterationMode:
        return self._mode

    @property
    def placing_optimizer_state(self) -> bool:
        """Whether the running iteration's end may move optimizer state to the device: a traced iteration
        under a policy that plans from the trace, with a margin for optimizer state (``auto`` with
        ``gpu_margin_mem_ratio`` > 0: the plan picks the chunks whose state moves)."""
        return (self._mode is IterationMode.TRACING and self.policy.plans_from_trace
                and self.state.margin_ratio > 0)

    def _enter(self, mode: IterationMode, *allowed: IterationMode) -> None:
        if self._mode not in allowed:
            raise ChunkStateError("the iteration scheduler", f"enter {mode.name}", self._mode, allowed,
                                  _rank())
        self._mode = mode

    @property
    def moves(self) -> Any:
        """The move schedule in force (``auto``: Belady's, :class:`~chunkmem.runtime.belady.MoveSchedule`), or
        ``None``."""
        return self.state.moves

    @property
    def margin_bytes(self) -> int:
        return self.state.margin_bytes

    @property
    def running(self) -> bool:
        """Whether an iteration is under way (begun, not ended)."""
        return self._mode in RUNNING

    # ---- iteration boundaries ----------------------------------------------------------------------

    def interrupt(self) -> None:
        """The running iteration will not end normally (an error stopped its forward or backward, or a
        forward had no backward): an unfinished trace is dropped and the next iteration traced again; a
        schedule it was following stays valid."""
        if self.trace is not None:
            self._to_close.append(self.trace)
            self.trace = None
            self.retrace = True
        self._enter(IterationMode.INTERRUPTED, *RUNNING)
        self.state.following = False
        if not self._steady:
            self._close_stats()

    def begin_iteration(self, signature: Any, training: bool) -> bool:
        """Start an iteration; returns whether the manager is to evict every unused chunk outside the
        margin first (an iteration that follows the plan starts from its empty device)."""
        if self.running:
            self.interrupt()
        self.close_finished_traces()
        self.state.following = False
        self.index = 0
        if not self._steady:
            self._walked_stats = self.stats
        self._steady = False
        self.stats = []
        self._mark_moves()
        starts_from = (IterationMode.IDLE, IterationMode.UNTRACED, IterationMode.INTERRUPTED)
        if not training:
            self._enter(IterationMode.UNTRACED, *starts_from)
            return False
        self.iterations += 1
        if self.retrace or self.periods is None or signature != self.signature:
            self._enter(IterationMode.TRACING, *starts_from)
            self.signature = signature
            self.trace = IterationTrace(self.device, lambda: self.ledger.tier_bytes(Tier.DEVICE))
            self.traces += 1
            self._used_in_phase, self._peak_so_far = {}, 0  # what guess_prefetch has seen of this trace
            return False
        self._enter(IterationMode.FOLLOWING, *starts_from)
        self.state.following = True
        return self.policy.plans_from_trace

    def follow_steadily(self, resident: bool) -> bool:
        """Whether the iteration just begun is steady: it follows the schedule and has nothing to move
        (``resident``: every chunk resident throughout, as
        :meth:`~chunkmem.runtime.executor.ChunkExecutor.resident_throughout` finds). Then its periods are not
        walked: the modules' hooks do nothing, no period begins, and the statistics of the last iteration stay
        those of the last iteration that walked its periods."""
        if self._mode is not IterationMode.FOLLOWING or not resident:
            return False
        self._steady = True
        self.steady_iterations += 1
        self.stats = self._walked_stats
        return True

    def end_iteration(self) -> bool:
        """After backward: close the iteration. Returns ``True`` when a finished trace became the new
        schedule: the manager then calls :meth:`schedule_moves`."""
        if self._steady:
            self.state.following = False
            self._enter(IterationMode.IDLE, *RUNNING)
            return False
        self._close_stats()
        self.state.following = False
        if self._mode is IterationMode.TRACING:
            self.periods = self.trace.finish()
            for period in self.periods:
                period.needed_set = set(period.needed)
            self._lookahead = [self._next_new_chunks(i) for i in range(len(self.periods))]
            self._to_close.append(self.trace)
            self.trace = None
            self.retrace = self._periods_changed
            self._periods_changed = False
            self.state.forget_moves()
            self._enter(IterationMode.IDLE, IterationMode.TRACING)
            return True
        if self._mode is IterationMode.FOLLOWING and self.index != len(self.periods):
            self.retrace = True
        if self._mode in RUNNING:
            self._enter(IterationMode.IDLE, *RUNNING)
        return False

    def close_finished_traces(self) -> None:
        """Leave the counting modes of finished traces; called where no backward is running (after
        ``optim.backward``, at ``optim.step`` and at the next forward)."""
        while self._to_close:
            self._to_close.pop().close()

    # ---- periods -----------------------------------------------------------------------------------

    def begin_period(self, name: str, phase: str, chunks: Sequence[int],
                     required: Callable[[], Sequence[int]]) -> PeriodOrders:
        """A period starts (``chunks``: the module's; ``required()``: the chunks in use or held now, asked only
        while tracing). The orders returned are the caller's to read, not to change: following a schedule,
        the same period's orders are one object from iteration to iteration."""
        self._close_stats()
        if self._mode is IterationMode.FOLLOWING and self.index < len(self.periods) \
                and self.periods[self.index].key() == (name, phase):
            orders = self._followed_orders(self.index, tuple(chunks))
        else:
            orders = PeriodOrders(keep=list(chunks))
            if self._mode is IterationMode.TRACING:
                self.trace.begin_period(name, phase, list(required()) + list(chunks))
                self.guess_prefetch(orders, phase, chunks)
            elif self._mode is IterationMode.FOLLOWING:
                orders.evict_unpinned = self.diverge()
        self.stats.append(PeriodStats(name, phase))
        self.index += 1
        return orders

    def _followed_orders(self, index: int, chunks: tuple[int, ...]) -> PeriodOrders:
        """The orders of the schedule's period ``index`` for a call using ``chunks``, made once per schedule.
        They depend on nothing else than the periods, the moves, the lookahead, the staging counts (each a new
        object for a new schedule: :meth:`schedule_moves` makes new staging counts before it sets the periods'
        agreed peaks) and a chunk's bytes."""
        made_from = (self.periods, self.state.moves, self._lookahead, self._staging)
        cached = self._orders_made.get(index)
        if (cached is not None and cached[0] == chunks and cached[2] == self._param_bytes
                and all(a is b for a, b in zip(cached[1], made_from))):
            return cached[3]
        orders = PeriodOrders(keep=list(chunks))
        self._fill_orders(orders, index)
        self._orders_made[index] = (chunks, made_from, self._param_bytes, orders)
        return orders

    def _fill_orders(self, orders: PeriodOrders, index: int) -> None:
        moves = self.state.moves
        if moves is not None:
            step = moves.periods[index]
            orders.evict, orders.fetch = list(step.evict), list(step.fetch)
        if index + 1 >= len(self.periods):
            return
        ahead = self.periods[index + 1]
        period = self.periods[index]
        if moves is not None:
            orders.prefetch = list(moves.periods[index + 1].fetch)
        else:
            orders.prefetch = list(self._lookahead[index]) or list(ahead.needed)
            orders.keep += [c for c in orders.prefetch if c not in orders.keep]
        orders.needed = list(period.needed)
        staging = self._staging[index] if index < len(self._staging) else 0
        orders.reserve = period.non_model_peak + staging * self._param_bytes

    def next_forward_start(self) -> tuple[list[int], int] | None:
        """After a step: the chunks the first period of an iteration that follows the schedule fetches (all it
        needs; under a plan, its fetch orders) and the device bytes that period keeps free (its traced
        non-model peak and gradient staging); ``None`` while an iteration runs, without a schedule, or when
        the next iteration is to be traced again."""
        if self.running or self.retrace or not self.periods or self.periods[0].phase != "forward":
            return None
        first, moves = self.periods[0], self.state.moves
        chunks = list(moves.periods[0].fetch) if moves is not None else list(first.needed)
        staging = self._staging[0] if self._staging else 0
        return chunks, first.non_model_peak + staging * self._param_bytes

    def fetched_ahead(self, nbytes: int) -> None:
        """``nbytes`` moved to the device after the step for the next iteration's first period
        (:meth:`next_forward_start`): the statistics count them in that period, as a fetch there."""
        self._moved_ahead += nbytes

    def guess_prefetch(self, orders: PeriodOrders, phase: str, chunks: Sequence[int]) -> None:
        """A traced iteration has no schedule to prefetch from: guess that the chunks are used in the order
        they were packed (the modules' order: ascending in the forward, descending in the backward) and order
        the next chunk not used yet in this phase fetched ahead (``guessed``), keeping room for the largest
        non-model peak traced so far. A wrong guess costs one fetch, freed at the next period boundary
        unless that period needs it."""
        closed = self.trace.periods[-2:-1]  # the period just closed (its peak is known now)
        self._peak_so_far = max([self._peak_so_far] + [period.non_model_peak for period in closed])
        if not chunks:
            return
        used = self._used_in_phase.get(phase, set())
        step = 1 if phase == "forward" else -1
        guess = max(chunks) + 1 if step == 1 else min(chunks) - 1
        while 0 <= guess < self.chunk_count and guess in used:
            guess += step
        if not 0 <= guess < self.chunk_count:
            return
        orders.prefetch, orders.guessed = [guess], True
        orders.keep.append(guess)
        orders.needed = list(chunks)
        orders.reserve = self._peak_so_far

    def _next_new_chunks(self, index: int) -> list[int]:
        """The chunks of the first period after ``index`` (within :data:`PREFETCH_LOOKAHEAD` periods of the same
        phase, forward or backward) that needs chunks period ``index`` does not: what to fetch next. A chunk spans many modules, so the next period
        usually needs the same chunks, and fetching only its chunks would start a new chunk's copy one small
        module before it is used; looking further ahead gives the copy the compute of every period in
        between. They are kept on the device until then (the orders' ``keep``)."""
        current = self.periods[index].needed_set
        phase = self.periods[index].phase
        for later in self.periods[index + 1:index + 1 + PREFETCH_LOOKAHEAD]:
            if later.phase != phase:  # across the turn to the backward: the next period's chunks, as without it
                return []
            new = [c for c in later.needed if c not in current]
            if new:
                return new
        return []

    def need(self, chunk_index: int) -> bool:
        """A chunk is being made resident for the current period; returns whether the iteration just
        left the schedule (the manager then evicts every unused chunk outside the margin)."""
        if self._mode is IterationMode.TRACING:
            self.trace.need(chunk_index)
            if self.trace.current is not None:
                self._used_in_phase.setdefault(self.trace.current.phase, set()).add(chunk_index)
        elif self._mode is IterationMode.FOLLOWING:
            current = self.periods[self.index - 1] if self.index else None
            if current is None or chunk_index not in current.needed_set:
                return self.diverge()
        return False

    def grads_started(self, chunk_index: int) -> None:
        if self._mode is IterationMode.TRACING:
            self.trace.grads_started(chunk_index)

    def grads_finished(self, chunk_index: int) -> None:
        if self._mode is IterationMode.TRACING:
            self.trace.grads_finished(chunk_index)

    def paused(self) -> ContextManager[None]:
        """A context in which the tracer does not count allocations (chunk memory of the manager)."""
        if self.trace is not None:
            return self.trace.paused()
        return nullcontext()

    def adopt(self, tensor: torch.Tensor) -> None:
        """A tensor the model's backward made is chunk memory from now on (a kept gradient): the tracer
        stops counting it as non-model memory."""
        if self.trace is not None:
            self.trace.adopt(tensor)

    def module_chunks_changed(self) -> None:
        """A module was found to need another chunk: the periods of the next iteration will differ
        from this one's, so it is traced again."""
        self._periods_changed = True

    def diverge(self) -> bool:
        """The iteration left the schedule: evict after use from now on, and trace the next one. Returns
        whether the manager is to evict every unused chunk outside the margin (under ``auto``)."""
        self._enter(IterationMode.DIVERGED, IterationMode.FOLLOWING)
        self.retrace = True
        self.state.following = False
        return self.policy.plans_from_trace

    # ---- the move schedule -------------------------------------------------------------------------

    def schedule_moves(self, inputs: MoveInputs) -> list[int]:
        """Decide the chunk moves of the recorded schedule (Belady's, under ``auto``) from the agreed peaks.
        Returns the chunks whose optimizer state the executor moves to the device (``auto``'s margin). If
        that fails, no move schedule is kept and the next iteration is traced again (never run on the moves
        of another schedule)."""
        self.state.forget_moves()
        self._param_bytes = inputs.param_bytes
        self._staging = self.staging_counts(inputs.grads_in_param_memory, set())
        if not self.periods:
            return []
        for period, peak in zip(self.periods, inputs.agreed_peaks):
            period.non_model_peak = peak  # (every policy: prefetch decisions read the peaks too)
        if not self.policy.plans_from_trace:
            return []
        try:
            margin_bytes, margin = choose_margin_chunks(self.periods, self.state, inputs.capacity,
                                                        inputs.param_bytes, self._staging, inputs.group_bytes)
            # Sharded, every gradient is reduced from a staging buffer, the margin chunks' too.
            staging = self.staging_counts(inputs.grads_in_param_memory, set() if inputs.sharded else margin)
            forced = [[c for c in p.grads_finished if c not in margin] if inputs.grads_in_param_memory else []
                      for p in self.periods]
            plan = plan_belady(self.periods, inputs.capacity, inputs.param_bytes, staging,
                               len(margin) * inputs.group_bytes, forced, margin)
        except BaseException:
            self.retrace = True
            raise
        self.state.adopt_moves(plan, margin, margin_bytes)
        return sorted(margin)

    def staging_counts(self, grads_in_param_memory: bool, excluded: set[int]) -> list[int]:
        """Per period, the most gradient staging buffers alive at once (none with reuse_fp16_shard)."""
        if grads_in_param_memory or not self.periods:
            return [0] * len(self.periods or [])
        live, counts = 0, []
        for period in self.periods:
            started = [c for c in period.grads_started if c not in excluded]
            counts.append(live + len(started))
            live += len(started) - len([c for c in period.grads_finished if c not in excluded])
        return counts

    # ---- statistics of the last iteration ----------------------------------------------------------

    def _mark_moves(self) -> None:
        self._moved_mark = (self.ledger.moved_to_device, self.ledger.moved_to_host)

    def _close_stats(self) -> None:
        if not self.stats:  # an iteration's first period begins: what was fetched for it after the step counts
            self._mark_moves()
            self._moved_mark = (self._moved_mark[0] - self._moved_ahead, self._moved_mark[1])
            self._moved_ahead = 0
            return
        ledger = self.ledger
        last = self.stats[-1]
        last.device_model_peak = max(last.device_model_peak, ledger.peak_device_bytes)
        last.host_model_bytes = ledger.tier_bytes(Tier.HOST)
        last.moved_to_device += ledger.moved_to_device - self._moved_mark[0]
        last.moved_to_host += ledger.moved_to_host - self._moved_mark[1]
        self._mark_moves()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

