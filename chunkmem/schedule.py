"""The iteration scheduler: traces an iteration, checks later ones against it, and executes the plan.

Iterations are delimited by the wrapped model's forward (start) and the end of autograd's backward
(end). The first training iteration is traced (:mod:`chunkmem.tracer`); so is any iteration whose
inputs have other shapes than the traced one, and the one after an iteration that left the schedule
(another branch). Forwards without autograd (``torch.no_grad()``) are neither traced nor planned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .chunk import Chunk
from .placement import AutoPlacement
from .tiers import Tier
from .tracer import IterationTrace, Period


@dataclass
class PeriodStats:
    """What one period of the last iteration did on the device tier (bytes)."""

    name: str
    phase: str
    device_model_peak: int = 0
    host_model_bytes: int = 0
    moved_to_device: int = 0
    moved_to_host: int = 0


class Scheduler:
    """Owned by the :class:`~chunkmem.manager.ChunkManager`; see the module docstring.

    ``mode``: ``"idle"`` between iterations, ``"tracing"``, ``"following"`` (the plan is executed),
    ``"diverged"`` (the iteration left the schedule: evict after use until it ends) or ``"untraced"``
    (a forward without autograd).
    """

    def __init__(self, manager: Any, device: torch.device) -> None:
        self.manager = manager
        self.device = device
        self.periods: list[Period] | None = None
        self.trace: IterationTrace | None = None
        self.signature: Any = None
        self.mode = "idle"
        self.index = 0
        self.retrace = True
        self.iterations = 0
        self.traces = 0
        self.stats: list[PeriodStats] = []
        self.margin_bytes = 0
        self._moved_mark = (0, 0)
        self._periods_changed = False
        self._to_close: list[IterationTrace] = []

    @property
    def policy(self) -> Any:
        return self.manager.policy

    @property
    def auto(self) -> AutoPlacement | None:
        return self.policy if isinstance(self.policy, AutoPlacement) else None

    # ---- iteration boundaries ----------------------------------------------------------------------

    def begin_iteration(self, signature: Any, training: bool) -> None:
        if self.trace is not None:  # the last traced forward never reached a backward
            self._to_close.append(self.trace)
            self.trace = None
            self.retrace = True
        self.close_finished_traces()
        self._set_following(False)
        self.index = 0
        self.stats = []
        self._mark_moves()
        if not training:
            self.mode = "untraced"
            return
        self.iterations += 1
        if self.retrace or self.periods is None or signature != self.signature:
            self.mode = "tracing"
            self.signature = signature
            self.trace = IterationTrace(self.device, lambda: self.manager.ledger.tier_bytes(Tier.DEVICE))
            self.traces += 1
        else:
            self.mode = "following"
            self._set_following(True)
            self._evict_unpinned()

    def end_iteration(self) -> None:
        """After backward: close the iteration; a finished trace becomes the schedule and the plan."""
        self._close_stats()
        if self.mode == "tracing":
            self.periods = self.trace.finish()
            self._to_close.append(self.trace)
            self.trace = None
            self.retrace = self._periods_changed
            self._periods_changed = False
            self.mode = "idle"
            self._make_plan()
        else:
            if self.mode == "following" and self.index != len(self.periods):
                self.retrace = True
            self.mode = "idle"
        self._set_following(False)
        self.manager.ledger.context = ""

    def close_finished_traces(self) -> None:
        """Leave the counting modes of finished traces; called where no backward is running (after
        ``optim.backward``, at ``optim.step`` and at the next forward)."""
        while self._to_close:
            self._to_close.pop().close()

    # ---- periods -----------------------------------------------------------------------------------

    def begin_period(self, name: str, phase: str, chunks: list[Chunk]) -> None:
        self.manager.flush_stale(keep=chunks)
        self._close_stats()
        self.manager.ledger.context = f"period {self.index} ({name} {phase})"
        if self.mode == "tracing":
            required = [c.index for c in self.manager.chunks if c.users or c.held_for_backward]
            self.trace.begin_period(name, phase, required + [c.index for c in chunks])
        elif self.mode == "following":
            if self.index >= len(self.periods) or self.periods[self.index].key() != (name, phase):
                self.diverge()
            elif self.auto is not None and self.auto.plan is not None:
                self._execute(self.index)
        self.stats.append(PeriodStats(name, phase))
        self.manager.ledger.peak_device_bytes = self.manager.ledger.tier_bytes(Tier.DEVICE)
        self.index += 1

    def need(self, chunk: Chunk) -> None:
        """A chunk is being made resident for the current period."""
        if self.mode == "tracing":
            self.trace.need(chunk.index)
        elif self.mode == "following":
            current = self.periods[self.index - 1] if self.index else None
            if current is None or chunk.index not in current.needed_set:
                self.diverge()

    def grads_started(self, chunk: Chunk) -> None:
        if self.mode == "tracing":
            self.trace.grads_started(chunk.index)

    def grads_finished(self, chunk: Chunk) -> None:
        if self.mode == "tracing":
            self.trace.grads_finished(chunk.index)

    def paused(self):
        """A context in which the tracer does not count allocations (chunk memory of the manager)."""
        if self.trace is not None:
            return self.trace.paused()
        return _nullcontext()

    def module_chunks_changed(self) -> None:
        """A module was found to need another chunk: the periods of the next iteration will differ
        from this one's, so it is traced again."""
        self._periods_changed = True

    def diverge(self) -> None:
        """The iteration left the schedule: evict after use from now on, and trace the next one."""
        self.mode = "diverged"
        self.retrace = True
        self._set_following(False)
        self._evict_unpinned()

    # ---- the plan ----------------------------------------------------------------------------------

    def _make_plan(self) -> None:
        for period in self.periods:
            period.needed_set = set(period.needed)
        auto = self.auto
        if auto is None or not self.manager.chunks:
            return
        self._agree_on_peaks()
        chunks = self.manager.chunks
        reuse = self.manager.reuse_grads
        param_bytes = chunks[0].param.nbytes
        group_bytes = self._optimizer_group_bytes(chunks[0]) if self.manager.optimizer_state_exists else 0
        capacity = self.manager.ledger.capacity
        staging = self._staging_counts(set())
        self.margin_bytes = auto.choose_margin_chunks(self.periods, capacity, param_bytes, staging, group_bytes)
        # Sharded, every gradient is reduced from a staging buffer, the margin chunks' too.
        staging = self._staging_counts(set() if self.manager.sharded else auto.margin_chunks)
        forced = [[c for c in p.grads_finished if c not in auto.margin_chunks] if reuse else []
                  for p in self.periods]
        auto.make_plan(self.periods, capacity, param_bytes, staging, len(auto.margin_chunks) * group_bytes, forced)
        for index in sorted(auto.margin_chunks):
            self.manager.move_optimizer_state(chunks[index], Tier.DEVICE)
            self.manager.settle(chunks[index])

    def _optimizer_group_bytes(self, chunk: Chunk) -> int:
        """Device bytes of one chunk kept there with its optimizer state: this rank's shard of the fp32
        families and of the gradient, the full parameter copy, and (sharded) the parameter shard."""
        fp32 = 4 * chunk.shard_numel
        families = 3 if chunk.has_master else 2
        shard_bytes = chunk.param.shard.nbytes
        grad = 0 if self.manager.reuse_grads else shard_bytes
        return families * fp32 + chunk.param.nbytes + (shard_bytes if chunk.param.sharded else 0) + grad

    def _agree_on_peaks(self) -> None:
        """Sharded, every rank must fetch (gather) the same chunks in the same order, so every rank plans
        with the largest non-model peak any rank traced for each period."""
        shards = self.manager.reduction.shards
        if not shards.sharded:
            return
        peaks = torch.tensor([p.non_model_peak for p in self.periods], dtype=torch.int64)
        shards.all_reduce_(peaks, dist.ReduceOp.MAX, what="the traced non-model memory peaks")
        for period, peak in zip(self.periods, peaks.tolist()):
            period.non_model_peak = int(peak)

    def _staging_counts(self, excluded: set[int]) -> list[int]:
        """Per period, the most gradient staging buffers alive at once (none with reuse_fp16_shard)."""
        if self.manager.reuse_grads:
            return [0] * len(self.periods)
        live, counts = 0, []
        for period in self.periods:
            started = [c for c in period.grads_started if c not in excluded]
            counts.append(live + len(started))
            live += len(started) - len([c for c in period.grads_finished if c not in excluded])
        return counts

    def _execute(self, index: int) -> None:
        step = self.auto.plan.periods[index]
        for c in step.evict:
            chunk = self.manager.chunks[c]
            if chunk.users == 0 and not chunk.held_for_backward:
                chunk.param.free_device()
        self.manager.fetch([self.manager.chunks[c] for c in step.fetch])

    def _evict_unpinned(self) -> None:
        """Under ``auto``: free the device copy of every unused chunk outside the margin."""
        if self.auto is None:
            return
        for chunk in self.manager.chunks:
            if chunk.index not in self.auto.margin_chunks and chunk.users == 0 and not chunk.held_for_backward:
                chunk.param.free_device()

    def _set_following(self, following: bool) -> None:
        if self.auto is not None:
            self.auto.following_plan = following

    # ---- statistics of the last iteration ----------------------------------------------------------

    def _mark_moves(self) -> None:
        ledger = self.manager.ledger
        self._moved_mark = (ledger.moved_to_device, ledger.moved_to_host)

    def _close_stats(self) -> None:
        if not self.stats:
            self._mark_moves()
            return
        ledger = self.manager.ledger
        last = self.stats[-1]
        last.device_model_peak = max(last.device_model_peak, ledger.peak_device_bytes)
        last.host_model_bytes = ledger.tier_bytes(Tier.HOST)
        last.moved_to_device += ledger.moved_to_device - self._moved_mark[0]
        last.moved_to_host += ledger.moved_to_host - self._moved_mark[1]
        self._mark_moves()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
