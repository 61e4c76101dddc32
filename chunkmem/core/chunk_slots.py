"""What every chunk knows of its parameters, whatever holds its memory: the slots (a parameter is one
:class:`ParamSlot` ``(chunk, offset, numel)`` in every family), this rank's shard of them, which were given a
gradient since the last step and how many steps each took (per parameter, as torch counts them). Both kinds of
chunk are :class:`ChunkSlots`: :class:`~chunkmem.core.chunk.Chunk` (the runtime's, its families in tiers) and
:class:`~chunkmem.optim.zero_partition.FlatChunk` (:class:`~chunkmem.LowLevelZeroOptimizer`'s).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn

from .layout import part_in_shard


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives: ``numel`` elements from ``offset`` (elements) in ``chunk``; ``index_in_chunk``
    is its position among the chunk's slots (the key of its step count)."""

    param: nn.Parameter
    name: str
    chunk: Any  # the ChunkSlots holding it
    offset: int
    numel: int
    shape: torch.Size
    index_in_chunk: int = 0

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's slice of a flat buffer of the chunk, shaped like the parameter."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


class ChunkSlots:
    """The parameter side of a chunk; a subclass gives ``shard_numel`` and ``shard_offset`` and fills ``slots``."""

    shard_numel: int
    shard_offset: int

    def __init__(self) -> None:
        self.slots: list[ParamSlot] = []
        # by index_in_chunk: the parameters given a gradient since the gradients were last dropped (a step updates
        # only those, as torch skips a parameter whose .grad is None), and the optimizer steps each one took
        self.slots_with_grads: set[int] = set()
        self.steps: dict[int, int] = {}  # a slot not in it has taken none

    def step_of(self, slot: ParamSlot) -> int:
        """Optimizer steps applied to ``slot``'s parameter so far."""
        return self.steps.get(slot.index_in_chunk, 0)

    @property
    def stepped(self) -> bool:
        """Whether any parameter of the chunk has taken an optimizer step (it then has optimizer state)."""
        return any(self.steps.values())

    def advance_steps(self, slots: Iterable[ParamSlot]) -> None:
        """One more step for each of ``slots`` (the parameters a step updated)."""
        for slot in slots:
            self.steps[slot.index_in_chunk] = self.steps.get(slot.index_in_chunk, 0) + 1

    def own_range(self, slot: ParamSlot) -> tuple[int, int] | None:
        """The elements ``(start, end)`` of ``slot``'s parameter (0 = its first element) that lie in this
        rank's shard, or ``None`` when none do."""
        return part_in_shard(slot.offset, slot.numel, self.shard_offset, self.shard_numel)

    def own_run(self, slot: ParamSlot) -> tuple[int, int, int] | None:
        """``(start, end, first)``: the run of this rank's shard (elements from the shard's start) that holds
        ``slot``'s elements ``first`` onwards, or ``None`` when the shard holds none of them."""
        part = self.own_range(slot)
        if part is None:
            return None
        start = slot.offset + part[0] - self.shard_offset
        return start, start + part[1] - part[0], part[0]

    def write_own_part(self, slot: ParamSlot, local: torch.Tensor, value: torch.Tensor) -> None:
        """Copy this rank's part of ``value`` (``slot``'s whole parameter) into ``local``, a buffer of
        ``shard_numel`` elements of this chunk."""
        run = self.own_run(slot)
        if run is not None:
            start, end, first = run
            local[start:end].copy_(value.reshape(-1)[first:first + end - start])
