"""Placement policies: where each state family of a chunk rests between uses.

A policy decides; the :class:`~chunkmem.manager.ChunkManager` executes. Policies hold no tensors.
"""
from __future__ import annotations

from .chunk import Chunk
from .errors import check_choice
from .tiers import Tier

POLICY_NAMES = ("cuda", "cpu", "auto")


class PlacementPolicy:
    """Where a chunk's families rest. A static policy rests everything on ``resting_tier``; a dynamic
    one (``resting_tier = None``) overrides the three ``*_tier`` methods."""

    name = "base"
    resting_tier: Tier | None = None

    def param_tier(self, chunk: Chunk) -> Tier:
        """Tier where the chunk's parameters rest between forward/backward uses."""
        assert self.resting_tier is not None
        return self.resting_tier

    def grad_tier(self, chunk: Chunk) -> Tier:
        """Tier where the chunk's finished gradients rest until the optimizer step."""
        assert self.resting_tier is not None
        return self.resting_tier

    def optim_tier(self, chunk: Chunk) -> Tier:
        """Tier of the chunk's optimizer families (fp32 master, exp_avg, exp_avg_sq); Adam runs there."""
        assert self.resting_tier is not None
        return self.resting_tier


class DevicePlacement(PlacementPolicy):
    """``tensor_placement_policy="cuda"``: everything rests on the device tier; Adam runs there."""

    name = "cuda"
    resting_tier = Tier.DEVICE


class HostPlacement(PlacementPolicy):
    """``tensor_placement_policy="cpu"``: everything rests on the host; parameters visit the device
    for compute, gradients go to the host as each chunk's backward completes, Adam runs on the host."""

    name = "cpu"
    resting_tier = Tier.HOST


def make_policy(name: str) -> PlacementPolicy:
    """The policy named by ``tensor_placement_policy``."""
    check_choice("tensor_placement_policy", name, POLICY_NAMES)
    if name == "auto":
        raise NotImplementedError(
            "tensor_placement_policy='auto' needs the runtime memory tracer, which is not built yet; "
            "use 'cpu' or 'cuda'")
    return DevicePlacement() if name == "cuda" else HostPlacement()
