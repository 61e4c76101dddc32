"""Placement policies: where each state family of a chunk rests between uses.

A policy decides; the :class:`~chunkmem.runtime.executor.ChunkExecutor` executes. A policy is a frozen
value chosen once from the model's settings; every query takes the chunk and the
:class:`PlacementState` (what the layout, the optimizer and the traced schedule decided at run time), so
no policy is ever changed after it is made and no caller needs to know which policy it holds.

* ``cuda`` (:class:`DevicePlacement`): everything rests on the device tier; Adam runs there.
* ``cpu`` (:class:`HostPlacement`): everything rests on the host; parameter chunks visit the device
  for compute, gradients go to the host, Adam runs on the host.
* ``static`` (:class:`StaticPlacement`): the last ``offload_param_frac`` of the chunks (in packing
  order) rest on the host, the others on the device; the last ``offload_optim_frac`` of the trainable
  chunks keep their optimizer state on the host, the others on the device.
* ``auto`` (:class:`AutoPlacement`): the first iteration is traced while parameters are evicted after
  each use; from then on chunks stay on the device until Belady's rule over the traced schedule evicts
  them, within the capacity less each period's non-model peak, and ``gpu_margin_mem_ratio`` of the
  remaining margin holds optimizer state on the device. A period whose chunks, non-model peak and
  gradient staging do not fit falls back to what ``cpu`` does for it (evict what it does not need,
  fetch, compute, evict after use), so ``auto`` trains wherever ``cpu`` does.

With the disk tier (``optimizer_on_disk`` / ``params_on_disk``), what a policy rests on the host rests on
disk instead: all of it, except (``auto`` with a host capacity) the parameters of the chunks in
``PlacementState.param_host_chunks`` and the optimizer state of those in ``PlacementState.optim_host_chunks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.chunk import Chunk
from ..errors import InvalidArgumentError, check_choice, check_number
from ..core.tiers import Tier
from .belady import MoveSchedule, belady_moves
from .tracer import Period

POLICY_NAMES = ("cuda", "cpu", "auto", "static")


@dataclass
class PlacementState:
    """What the placement depends on beyond the policy. Owned by the model's runtime: the layout facts
    (``num_chunks``; ``trainable``, the indices of the trainable chunks in packing order) when the chunks
    are built, with ``param_host_chunks``; ``margin_ratio`` (``gpu_margin_mem_ratio``) and
    ``optim_host_chunks`` when the optimizer is attached; ``moves`` (the move schedule), ``margin_chunks`` (chunks whose optimizer
    state and parameters stay on the device; ``margin_bytes`` the margin) and ``following`` (the running
    iteration follows it) by the scheduler, under ``auto``."""

    num_chunks: int = 0
    trainable: tuple[int, ...] = ()
    margin_ratio: float = 0.0
    param_host_chunks: frozenset[int] = frozenset()
    optim_host_chunks: frozenset[int] = frozenset()
    moves: MoveSchedule | None = None
    margin_chunks: frozenset[int] = frozenset()
    margin_bytes: int = 0
    following: bool = False

    def adopt_moves(self, moves: MoveSchedule, margin_chunks: set[int], margin_bytes: int) -> None:
        self.moves, self.margin_chunks, self.margin_bytes = moves, frozenset(margin_chunks), margin_bytes

    def forget_moves(self) -> None:
        """The schedule changed: no move schedule until the new one is made (the margin stays where it is)."""
        self.moves = None


@dataclass(frozen=True)
class PlacementPolicy:
    """Where a chunk's families rest. ``optimizer_on_disk`` / ``params_on_disk``: the disk tier takes what
    the policy rests on the host (``offload_optimizer`` / ``offload_param="disk"``)."""

    optimizer_on_disk: bool = False
    params_on_disk: bool = False
    name = "base"
    plans_from_trace = False
    """Whether the placement is decided from the traced schedule (``auto``): the scheduler then plans
    Belady's moves and the margin, and an iteration that leaves the schedule evicts after use."""

    def _off_device(self, chunk: Chunk, state: PlacementState) -> Tier:
        """Where the chunk's parameters rest when not on the device."""
        return Tier.DISK if self.params_on_disk and chunk.index not in state.param_host_chunks else Tier.HOST

    def param_rest_tier(self, chunk: Chunk, state: PlacementState) -> Tier | None:
        """Where the chunk's parameters go when no module uses them; ``None``: the plan decides."""
        raise NotImplementedError

    def compute_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        """Tier the chunk's Adam runs on (the device or the host; state on disk is streamed to the host)."""
        raise NotImplementedError

    def optim_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        """Tier where the chunk's optimizer families (fp32 master, exp_avg, exp_avg_sq) rest: the tier
        its Adam runs on (:meth:`compute_tier`), or the disk tier in place of the host."""
        tier = self.compute_tier(chunk, state)
        on_disk = self.optimizer_on_disk and chunk.index not in state.optim_host_chunks
        return Tier.DISK if tier is Tier.HOST and on_disk else tier

    def grad_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        """Tier where the chunk's finished gradients rest until the step: where its Adam runs."""
        return self.compute_tier(chunk, state)

    def keeps_gathered(self, chunk: Chunk, state: PlacementState) -> bool:
        """For a chunk sharded over several ranks: whether its gathered full copy stays on the device
        between uses (otherwise it is freed after use, and :meth:`param_rest_tier` is where the shard
        rests)."""
        return False

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        """Whether chunk ``index`` of ``count`` rests on the device (for capacity checks before building)."""
        return False

    def optim_on_device(self, position: int, count: int) -> bool:
        """Whether the ``position``-th of ``count`` trainable chunks keeps its optimizer state on the
        device from the start (before any trace)."""
        return False


@dataclass(frozen=True)
class DevicePlacement(PlacementPolicy):
    name = "cuda"

    def param_rest_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        return Tier.DEVICE

    def compute_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        return Tier.DEVICE

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        return True

    def optim_on_device(self, position: int, count: int) -> bool:
        return True


@dataclass(frozen=True)
class HostPlacement(PlacementPolicy):
    name = "cpu"

    def param_rest_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        return self._off_device(chunk, state)

    def compute_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        return Tier.HOST


@dataclass(frozen=True)
class StaticPlacement(PlacementPolicy):
    """Fixed fractions on the host: the last ``round(frac × n)`` chunks (in packing order)."""

    offload_param_frac: float = 0.0
    offload_optim_frac: float = 0.0
    name = "static"

    @staticmethod
    def _on_device(position: int, count: int, frac: float) -> bool:
        return position < count - round(frac * count)

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        return self._on_device(index, count, self.offload_param_frac)

    def optim_on_device(self, position: int, count: int) -> bool:
        return self._on_device(position, count, self.offload_optim_frac)

    def param_rest_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        if self.params_on_device_at_rest(chunk.index, state.num_chunks):
            return Tier.DEVICE
        return self._off_device(chunk, state)

    def compute_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        position = state.trainable.index(chunk.index)
        return Tier.DEVICE if self.optim_on_device(position, len(state.trainable)) else Tier.HOST


@dataclass(frozen=True)
class AutoPlacement(PlacementPolicy):
    """Decides from the traced schedule (see the module docstring): what the trace decided is in the
    :class:`PlacementState`. While no plan applies (no schedule yet, or the running iteration left it)
    chunks are evicted after use, as under ``cpu``; so are they in the periods the plan cannot keep them
    in (fallback)."""

    name = "auto"
    plans_from_trace = True

    def param_rest_tier(self, chunk: Chunk, state: PlacementState) -> Tier | None:
        if chunk.index in state.margin_chunks:
            return Tier.DEVICE
        if state.following:
            return None
        return self._off_device(chunk, state)

    def compute_tier(self, chunk: Chunk, state: PlacementState) -> Tier:
        return Tier.DEVICE if chunk.index in state.margin_chunks else Tier.HOST

    def keeps_gathered(self, chunk: Chunk, state: PlacementState) -> bool:
        return chunk.index in state.margin_chunks


def choose_margin_chunks(periods: Sequence[Period], state: PlacementState, capacity: int, chunk_param_bytes: int,
                         staging: Sequence[int], group_bytes: int) -> tuple[int, set[int]]:
    """``auto``: the margin in bytes, and the chunks whose optimizer state lives on the device.

    margin = capacity − max over periods of (non-model peak + bytes of the parameter chunks and gradient
    staging the period needs), or 0. ``state.margin_ratio × margin`` is filled with whole optimizer chunk
    groups (``group_bytes`` each: the fp32 master, exp_avg, exp_avg_sq, the parameter chunk itself and a
    gradient buffer where one exists), trainable chunks in packing order from the first.
    """
    peak = max((p.non_model_peak + len(p.needed) * chunk_param_bytes + s * chunk_param_bytes
                for p, s in zip(periods, staging)), default=0)
    margin = max(capacity - peak, 0)
    count = int(state.margin_ratio * margin) // group_bytes if group_bytes else 0
    return margin, set(state.trainable[:count])


def plan_belady(periods: Sequence[Period], capacity: int, chunk_param_bytes: int, staging: Sequence[int],
                pinned_bytes: int, forced_out: Sequence[Sequence[int]], margin_chunks: set[int]) -> MoveSchedule:
    """``auto``: Belady's plan for the chunks outside the margin, each period's slots being what the
    capacity leaves after the pinned (margin) bytes, the period's non-model peak and its gradient staging.
    A period whose chunks do not fit in its slots falls back to what ``cpu`` does (see
    :func:`~chunkmem.runtime.belady.belady_moves`): that is never refused here; the ledger refuses only chunk
    bytes past the capacity, as under ``cpu``."""
    needed = [[c for c in p.needed if c not in margin_chunks] for p in periods]
    slots = [max(capacity - pinned_bytes - p.non_model_peak - s * chunk_param_bytes, 0) // chunk_param_bytes
             for p, s in zip(periods, staging)]
    return belady_moves(needed, forced_out, slots, [f"{p.name} {p.phase}" for p in periods])


def make_policy(name: str, offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0,
                optimizer_on_disk: bool = False, params_on_disk: bool = False) -> PlacementPolicy:
    """The policy named by ``tensor_placement_policy`` (arguments checked; nothing else changes)."""
    check_choice("tensor_placement_policy", name, POLICY_NAMES)
    check_number("offload_param_frac", offload_param_frac, low=0.0, high=1.0)
    check_number("offload_optim_frac", offload_optim_frac, low=0.0, high=1.0)
    if name != "static" and (offload_param_frac or offload_optim_frac):
        raise InvalidArgumentError("offload_param_frac/offload_optim_frac", (offload_param_frac, offload_optim_frac),
                                   "0.0 unless tensor_placement_policy='static'")
    disk = dict(optimizer_on_disk=optimizer_on_disk, params_on_disk=params_on_disk)
    if name == "cuda":
        return DevicePlacement(**disk)
    if name == "cpu":
        return HostPlacement(**disk)
    if name == "static":
        return StaticPlacement(**disk, offload_param_frac=offload_param_frac, offload_optim_frac=offload_optim_frac)
    return AutoPlacement(**disk)
