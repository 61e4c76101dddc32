"""Placement policies: where each state family of a chunk rests between uses.

A policy decides; the :class:`~chunkmem.runtime.manager.ChunkManager` executes. Policies hold no tensors.

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

Policies hold settings, never run-time state: what the trace decides under ``auto`` lives in the
scheduler's :class:`PlanState`.
"""
from __future__ import annotations

from typing import Sequence

from .belady import MovePlan, plan_moves
from ..core.chunk import Chunk
from ..core.errors import InvalidArgumentError, check_choice, check_number
from ..core.tiers import Tier
from .tracer import Period

POLICY_NAMES = ("cuda", "cpu", "auto", "static")


class PlacementPolicy:
    """Where a chunk's families rest, decided per chunk from its index among ``num_chunks``."""

    name = "base"

    def __init__(self) -> None:
        self.num_chunks = 0
        self.trainable_indices: list[int] = []
        self.optimizer_on_disk = False  # offload_optimizer="disk": optimizer state meant for the host rests on disk
        self.optim_host_chunks: frozenset[int] = frozenset()  # ... except these chunks' (auto, host capacity)
        self.params_on_disk = False  # offload_param="disk": parameter shards meant for the host rest on disk

    def configure(self, chunks: Sequence[Chunk]) -> None:
        """Called whenever the chunks are (re)built."""
        self.num_chunks = len(chunks)
        self.trainable_indices = [c.index for c in chunks if c.trainable]

    def param_rest_tier(self, chunk: Chunk) -> Tier | None:
        """Where the chunk's parameters go when no module uses them; ``None``: the plan decides."""
        raise NotImplementedError

    def optim_tier(self, chunk: Chunk) -> Tier:
        """Tier where the chunk's optimizer families (fp32 master, exp_avg, exp_avg_sq) rest: the tier
        its Adam runs on (:meth:`compute_tier`), or the disk tier in place of the host."""
        tier = self.compute_tier(chunk)
        on_disk = self.optimizer_on_disk and chunk.index not in self.optim_host_chunks
        return Tier.DISK if tier is Tier.HOST and on_disk else tier

    def compute_tier(self, chunk: Chunk) -> Tier:
        """Tier the chunk's Adam runs on (the device or the host; state on disk is streamed to the host)."""
        raise NotImplementedError

    def grad_tier(self, chunk: Chunk) -> Tier:
        """Tier where the chunk's finished gradients rest until the step: where its Adam runs."""
        return self.compute_tier(chunk)

    def keeps_gathered(self, chunk: Chunk) -> bool:
        """For a chunk sharded over several ranks: whether its gathered full copy stays on the device
        between uses (otherwise it is freed after use, and :meth:`param_rest_tier` is where the shard
        rests)."""
        return False

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        """Whether chunk ``index`` of ``count`` rests on the device (for capacity checks before building)."""
        return False

    def optim_on_device(self, position: int, count: int) -> bool:
        """Whether the ``position``-th of ``count`` trainable chunks keeps its optimizer state on the device."""
        return False


class DevicePlacement(PlacementPolicy):
    name = "cuda"

    def param_rest_tier(self, chunk: Chunk) -> Tier:
        return Tier.DEVICE

    def compute_tier(self, chunk: Chunk) -> Tier:
        return Tier.DEVICE

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        return True

    def optim_on_device(self, position: int, count: int) -> bool:
        return True


class HostPlacement(PlacementPolicy):
    name = "cpu"

    def param_rest_tier(self, chunk: Chunk) -> Tier:
        return Tier.DISK if self.params_on_disk else Tier.HOST

    def compute_tier(self, chunk: Chunk) -> Tier:
        return Tier.HOST


class StaticPlacement(PlacementPolicy):
    """Fixed fractions on the host: the last ``round(frac × n)`` chunks (in packing order)."""

    name = "static"

    def __init__(self, offload_param_frac: float, offload_optim_frac: float) -> None:
        super().__init__()
        self.offload_param_frac = offload_param_frac
        self.offload_optim_frac = offload_optim_frac

    @staticmethod
    def _on_device(position: int, count: int, frac: float) -> bool:
        return position < count - round(frac * count)

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        return self._on_device(index, count, self.offload_param_frac)

    def optim_on_device(self, position: int, count: int) -> bool:
        return self._on_device(position, count, self.offload_optim_frac)

    def param_rest_tier(self, chunk: Chunk) -> Tier:
        if self.params_on_device_at_rest(chunk.index, self.num_chunks):
            return Tier.DEVICE
        return Tier.DISK if self.params_on_disk else Tier.HOST

    def compute_tier(self, chunk: Chunk) -> Tier:
        position = self.trainable_indices.index(chunk.index)
        return Tier.DEVICE if self.optim_on_device(position, len(self.trainable_indices)) else Tier.HOST


class PlanState:
    """What the traced schedule decided at run time under ``auto``: the plan, the chunks whose optimizer
    state lives on the device (the margin, bytes in ``margin_bytes``), and whether the running iteration
    follows the plan. Owned and written only by the :class:`~chunkmem.runtime.schedule.Scheduler`;
    :class:`AutoPlacement` reads it."""

    def __init__(self) -> None:
        self.plan: MovePlan | None = None
        self.margin_chunks: frozenset[int] = frozenset()
        self.margin_bytes = 0
        self.following = False

    def adopt(self, plan: MovePlan, margin_chunks: set[int], margin_bytes: int) -> None:
        self.plan, self.margin_chunks, self.margin_bytes = plan, frozenset(margin_chunks), margin_bytes

    def forget_plan(self) -> None:
        """The schedule changed: no plan until the new one is made (the margin stays where it is)."""
        self.plan = None


class AutoPlacement(PlacementPolicy):
    """Decides from the traced schedule (see the module docstring). Holds only its setting
    ``gpu_margin_mem_ratio``; what the trace decided is read from the scheduler's :class:`PlanState`.
    While no plan applies (no schedule yet, or the running iteration left it) chunks are evicted after
    use, as under ``cpu``; so are they in the periods the plan cannot keep them in (fallback)."""

    name = "auto"

    def __init__(self) -> None:
        super().__init__()
        self.gpu_margin_mem_ratio = 0.0
        self._state = PlanState()

    def read_state_from(self, state: PlanState) -> None:
        """Read the run-time decisions from ``state`` (the scheduler's) from now on."""
        self._state = state

    @property
    def plan(self) -> MovePlan | None:
        """The plan in force (read-only; ``None`` until a schedule is planned)."""
        return self._state.plan

    @property
    def margin_chunks(self) -> frozenset[int]:
        """Chunks whose optimizer state (and parameters) stay on the device (read-only)."""
        return self._state.margin_chunks

    @property
    def following_plan(self) -> bool:
        return self._state.following

    def param_rest_tier(self, chunk: Chunk) -> Tier | None:
        if chunk.index in self._state.margin_chunks:
            return Tier.DEVICE
        if self._state.following:
            return None
        return Tier.DISK if self.params_on_disk else Tier.HOST

    def compute_tier(self, chunk: Chunk) -> Tier:
        return Tier.DEVICE if chunk.index in self._state.margin_chunks else Tier.HOST

    def keeps_gathered(self, chunk: Chunk) -> bool:
        return chunk.index in self._state.margin_chunks

    def choose_margin_chunks(self, periods: Sequence[Period], capacity: int, chunk_param_bytes: int,
                             staging: Sequence[int], group_bytes: int) -> tuple[int, set[int]]:
        """The margin in bytes, and the chunks whose optimizer state lives on the device.

        margin = capacity − max over periods of (non-model peak + bytes of the parameter chunks and
        gradient staging the period needs), or 0. ``gpu_margin_mem_ratio × margin`` is filled with whole
        optimizer chunk groups (``group_bytes`` each: the fp32 master, exp_avg, exp_avg_sq, the
        parameter chunk itself and a gradient buffer where one exists), trainable chunks in packing
        order from the first.
        """
        peak = max((p.non_model_peak + len(p.needed) * chunk_param_bytes + s * chunk_param_bytes
                    for p, s in zip(periods, staging)), default=0)
        margin = max(capacity - peak, 0)
        count = int(self.gpu_margin_mem_ratio * margin) // group_bytes if group_bytes else 0
        return margin, set(self.trainable_indices[:count])

    def make_plan(self, periods: Sequence[Period], capacity: int, chunk_param_bytes: int,
                  staging: Sequence[int], pinned_bytes: int, forced_out: Sequence[Sequence[int]],
                  margin_chunks: set[int]) -> MovePlan:
        """Belady's plan for the chunks outside the margin, each period's slots being what the capacity
        leaves after the pinned (margin) bytes, the period's non-model peak and its gradient staging. A
        period whose chunks do not fit in its slots falls back to what ``cpu`` does (see
        :func:`~chunkmem.runtime.belady.plan_moves`): that is never refused here; the ledger refuses only chunk
        bytes past the capacity, as under ``cpu``."""
        needed = [[c for c in p.needed if c not in margin_chunks] for p in periods]
        slots = [max(capacity - pinned_bytes - p.non_model_peak - s * chunk_param_bytes, 0) // chunk_param_bytes
                 for p, s in zip(periods, staging)]
        return plan_moves(needed, forced_out, slots, [f"{p.name} {p.phase}" for p in periods])


def make_policy(name: str, offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0) -> PlacementPolicy:
    """The policy named by ``tensor_placement_policy``."""
    check_choice("tensor_placement_policy", name, POLICY_NAMES)
    check_number("offload_param_frac", offload_param_frac, low=0.0, high=1.0)
    check_number("offload_optim_frac", offload_optim_frac, low=0.0, high=1.0)
    if name != "static" and (offload_param_frac or offload_optim_frac):
        raise InvalidArgumentError("offload_param_frac/offload_optim_frac", (offload_param_frac, offload_optim_frac),
                                   "0.0 unless tensor_placement_policy='static'")
    if name == "cuda":
        return DevicePlacement()
    if name == "cpu":
        return HostPlacement()
    if name == "static":
        return StaticPlacement(offload_param_frac, offload_optim_frac)
    return AutoPlacement()


