"""A module call's chunks brought to the device: the scheduler's orders for the period that begins (evict,
fetch, prefetch, reserve) carried out by the executor, then the chunks fetched and acquired for a forward
(or a ``GatheredParameters`` block) or held for a backward. Before either, each chunk is checked free of
gradients (``reuse_fp16_shard``), and the scheduler may ask for the unpinned chunks to be evicted first
(``auto`` with a chunk the schedule did not foresee).
"""
from __future__ import annotations

import torch.nn as nn

from ..core.chunk import Chunk
from .executor import ChunkExecutor
from .schedule import Scheduler


class ChunkAcquisition:
    """Brings one model's chunks to the device for its modules' calls (see the module docstring).
    ``names``: each watched module's name in the model (the periods are named by it)."""

    def __init__(self, scheduler: Scheduler, executor: ChunkExecutor, names: dict[nn.Module, str]) -> None:
        self._scheduler = scheduler
        self._executor = executor
        self._names = names

    def begin_period(self, module: nn.Module, phase: str, chunks: list[Chunk]) -> None:
        """``module``'s ``phase`` (forward or backward) begins a period using ``chunks``: carry out its orders."""
        name = self._names[module]
        orders = self._scheduler.begin_period(name, phase, [c.index for c in chunks], self._in_use)
        period = self._scheduler.index - 1
        self._executor.memory.ledger.context = f"period {period} ({name} {phase})"
        self._executor.log_event("period", period, name, phase)
        self._executor.execute(orders)

    def _in_use(self) -> list[int]:
        return [c.index for c in self._executor.chunks if c.in_use]

    def _need(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._executor.check_free_of_grads(chunk)
        for chunk in chunks:
            if self._scheduler.need(chunk.index):
                self._executor.evict_unpinned()

    def acquire(self, chunks: list[Chunk], exact: bool = False) -> None:
        """Fetch ``chunks`` and count one more user of each."""
        self._need(chunks)
        self._executor.acquire(chunks, exact)

    def hold_for_backward(self, chunks: list[Chunk]) -> None:
        """Fetch ``chunks`` and keep them on the device until their gradients are finished."""
        chunks = [c for c in chunks if not c.held_for_backward]
        self._need(chunks)
        self._executor.hold_for_backward(chunks)
