"""Placement policies: where each state family of a chunk rests between uses.

A policy decides; the :class:`~chunkmem.manager.ChunkManager` executes. Policies hold no tensors.

* ``cuda`` (:class:`DevicePlacement`): everything rests on the device tier; Adam runs there.
* ``cpu`` (:class:`HostPlacement`): everything rests on the host; parameter chunks visit the device
  for compute, gradients go to the host, Adam runs on the host.
* ``static`` (:class:`StaticPlacement`): the last ``offload_param_frac`` of the chunks (in packing
  order) rest on the host, the others on the device; the last ``offload_optim_frac`` of the trainable
  chunks keep their optimizer state on the host, the others on the device.
* ``auto`` (:class:`AutoPlacement`): the first iteration is traced while parameters are evicted after
  each use; from then on chunks stay on the device until Belady's rule over the traced schedule evicts
  them, within the capacity less each period's non-model peak, and ``gpu_margin_mem_ratio`` of the
  remaining margin holds optimizer state on the device.
"""
from __future__ import annotations

from typing import Sequence

from .belady import MovePlan, plan_moves
from .chunk import Chunk
from .errors import DeviceCapacityError, InvalidArgumentError, check_choice, check_number
from .tiers import Tier
from .tracer import Period

POLICY_NAMES = ("cuda", "cpu", "auto", "static")


class PlacementPolicy:
    """Where a chunk's families rest, decided per chunk from its index among ``num_chunks``."""

    name = "base"

    def __init__(self) -> None:
        self.num_chunks = 0
        self.trainable_indices: list[int] = []

    def configure(self, chunks: Sequence[Chunk]) -> None:
        """Called whenever the chunks are (re)built."""
        self.num_chunks = len(chunks)
        self.trainable_indices = [c.index for c in chunks if c.trainable]

    def param_rest_tier(self, chunk: Chunk) -> Tier | None:
        """Where the chunk's parameters go when no module uses them; ``None``: the plan decides."""
        raise NotImplementedError

    def optim_tier(self, chunk: Chunk) -> Tier:
        """Tier of the chunk's optimizer families (fp32 master, exp_avg, exp_avg_sq); Adam runs there."""
        raise NotImplementedError

    def grad_tier(self, chunk: Chunk) -> Tier:
        """Tier where the chunk's finished gradients rest until the step: where its Adam runs."""
        return self.optim_tier(chunk)

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

    def optim_tier(self, chunk: Chunk) -> Tier:
        return Tier.DEVICE

    def params_on_device_at_rest(self, index: int, count: int) -> bool:
        return True

    def optim_on_device(self, position: int, count: int) -> bool:
        return True


class HostPlacement(PlacementPolicy):
    name = "cpu"

    def param_rest_tier(self, chunk: Chunk) -> Tier:
        return Tier.HOST

    def optim_tier(self, chunk: Chunk) -> Tier:
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
        return Tier.DEVICE if self.params_on_device_at_rest(chunk.index, self.num_chunks) else Tier.HOST

    def optim_tier(self, chunk: Chunk) -> Tier:
        position = self.trainable_indices.index(chunk.index)
        return Tier.DEVICE if self.optim_on_device(position, len(self.trainable_indices)) else Tier.HOST


class AutoPlacement(PlacementPolicy):
    """Decides from the traced schedule (see the module docstring). ``plan`` is ``None`` until a
    schedule is known, and while the running iteration does not match it: then chunks are evicted
    after use, as under ``cpu``."""

    name = "auto"

    def __init__(self) -> None:
        super().__init__()
        self.plan: MovePlan | None = None
        self.following_plan = False
        self.margin_chunks: set[int] = set()
        self.gpu_margin_mem_ratio = 0.0

    def param_rest_tier(self, chunk: Chunk) -> Tier | None:
        if chunk.index in self.margin_chunks:
            return Tier.DEVICE
        return None if self.following_plan else Tier.HOST

    def optim_tier(self, chunk: Chunk) -> Tier:
        return Tier.DEVICE if chunk.index in self.margin_chunks else Tier.HOST

    def keeps_gathered(self, chunk: Chunk) -> bool:
        return chunk.index in self.margin_chunks

    def choose_margin_chunks(self, periods: Sequence[Period], capacity: int, chunk_param_bytes: int,
                             staging: Sequence[int], group_bytes: int) -> int:
        """Pick the chunks whose optimizer state lives on the device; returns the margin in bytes.

        margin = capacity − max over periods of (non-model peak + bytes of the parameter chunks and
        gradient staging the period needs). ``gpu_margin_mem_ratio × margin`` is filled with whole
        optimizer chunk groups (``group_bytes`` each: the fp32 master, exp_avg, exp_avg_sq, the
        parameter chunk itself and a gradient buffer where one exists), trainable chunks in packing
        order from the first.
        """
        peak = max((p.non_model_peak + len(p.needed) * chunk_param_bytes + s * chunk_param_bytes
                    for p, s in zip(periods, staging)), default=0)
        margin = max(capacity - peak, 0)
        count = int(self.gpu_margin_mem_ratio * margin) // group_bytes if group_bytes else 0
        self.margin_chunks = set(self.trainable_indices[:count])
        return margin

    def make_plan(self, periods: Sequence[Period], capacity: int, chunk_param_bytes: int,
                  staging: Sequence[int], pinned_bytes: int, forced_out: Sequence[Sequence[int]]) -> MovePlan:
        """Belady's plan for the non-pinned chunks, each period's slots being what the capacity leaves
        after the pinned (margin) bytes, the period's non-model peak and its gradient staging."""
        needed = [[c for c in p.needed if c not in self.margin_chunks] for p in periods]
        slots = [max(capacity - pinned_bytes - p.non_model_peak - s * chunk_param_bytes, 0) // chunk_param_bytes
                 for p, s in zip(periods, staging)]
        for i, (p, s) in enumerate(zip(periods, staging)):
            if len(needed[i]) > slots[i]:
                need = len(needed[i]) * chunk_param_bytes
                raise DeviceCapacityError(
                    f"period {i} ({p.name} {p.phase}) needs {len(needed[i])} chunks ({need} bytes), "
                    f"{s * chunk_param_bytes} bytes of gradient staging and {p.non_model_peak} bytes of non-model "
                    f"memory on the device at once: {need + s * chunk_param_bytes + p.non_model_peak} bytes, more "
                    f"than the device capacity of {capacity} bytes less {pinned_bytes} bytes of optimizer state "
                    f"kept there; raise the capacity, lower gpu_margin_mem_ratio, or use smaller chunks or batches")
        self.plan = plan_moves(needed, forced_out, slots, [f"{p.name} {p.phase}" for p in periods])
        return self.plan


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


