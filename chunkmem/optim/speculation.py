"""Undo copies for ``step_in_backward`` over optimizer state held in memory (host or device tier).

With ``ShardedOptimizerV2(..., step_in_backward=True)`` the backward updates each chunk as soon as its
gradients are final, as if nothing overflowed and nothing is clipped (the multiplier ``1 / loss scale``).
``step()`` decides afterwards. A chunk whose state rests on disk is updated into the disk's other slot, so
not committing is its undo (:mod:`chunkmem.optim.disk_step`). A chunk whose state is in memory is updated
in place, so before its update the optimizer takes an :class:`UndoCopy` here: this rank's values of
every optimizer family (the master included; for fp32 chunks the parameters, which are the master), the
chunk's step counts and another optimizer's scalar and whole-parameter state. ``step()`` either keeps the
update (same multiplier, nothing else changed) and releases the copy, or puts the copy back (the 16-bit
parameters become the restored master's rounding, as after every step) and updates again with what it
decided.

The copies rest on the host tier and are counted in the ledger as family ``undo``: at most one per chunk,
released by ``step()`` or ``zero_grad()``, so the bytes are bounded by one copy of the in-memory optimizer
state (:func:`undo_nbytes` a chunk; the optimizer checks the host's room for all of them when it is built).
A copy the host tier has no room for at the time is not taken, and that chunk is updated in ``step()`` as
without ``step_in_backward``: the same bits, without the overlap.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.chunk import EXP_AVG, EXP_AVG_SQ, MASTER, Chunk
from ..core.memory import TierMemory
from ..core.tiers import Tier
from ..errors import HostCapacityError

UNDO = "undo"  # the ledger family of the copies


def undo_families(chunk: Chunk) -> tuple[str, ...]:
    """The optimizer families an undo copy of ``chunk`` holds (the master first, when separate)."""
    return ((MASTER,) if chunk.has_master else ()) + tuple(chunk.state_families)


def undo_nbytes(chunk: Chunk) -> int:
    """Bytes of one undo copy of ``chunk``: this rank's buffer of every family of :func:`undo_families`, plus the
    parameters themselves where they are their own masters (fp32 chunks, or bf16 ones rounded stochastically)."""
    params = 0 if chunk.has_master else chunk.shard_numel * chunk.dtype.itemsize
    return sum(chunk.optim[name].nbytes for name in undo_families(chunk)) + params


@dataclass
class UndoCopy:
    """What one chunk held before the update the backward made (see the module docstring)."""

    chunk: Chunk
    steps: dict[int, int]  # the chunk's step counts (by slot) before the update
    multiplier: float  # what the update multiplied the gradients by
    assumed: tuple[Any, ...]  # the optimizer's speculation key: what else the update took as given
    families: dict[str, torch.Tensor] = field(default_factory=dict)  # family -> this rank's values (host)
    params: torch.Tensor | None = None  # fp32 chunks: the parameters' values (host)
    scalars: dict[int, dict[str, Any]] = field(default_factory=dict)  # another optimizer's, by slot
    whole: dict[int, dict[str, Any]] = field(default_factory=dict)  # another optimizer's, by slot
    sources: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (copy, source) to fill
    filled: bool = False  # the values are in (an update started off autograd's thread fills it first)

    def adam_copies(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The copies of Adam's master (the parameters for an fp32 chunk), ``exp_avg`` and ``exp_avg_sq``,
        which the host Adam kernel fills in the pass of its update; ``None`` where the copy holds another
        optimizer's state."""
        master = self.families.get(MASTER, self.params)
        if master is None or set(self.families) - {MASTER} != {EXP_AVG, EXP_AVG_SQ}:
            return None
        return master, self.families[EXP_AVG], self.families[EXP_AVG_SQ]


class UndoCopies:
    """The undo copies of one optimizer's in-memory chunks, by chunk index, in the ledger (``undo``)."""

    def __init__(self, memory: TierMemory) -> None:
        self.memory = memory
        self._copies: dict[int, UndoCopy] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def __contains__(self, chunk: Chunk) -> bool:
        return chunk.index in self._copies

    def get(self, chunk: Chunk) -> UndoCopy | None:
        return self._copies.get(chunk.index)

    def copies(self) -> list[UndoCopy]:
        """Every copy held, in the order they were taken."""
        return list(self._copies.values())

    def take(self, chunk: Chunk, params: torch.Tensor | None, multiplier: float, assumed: tuple[Any, ...],
             scalars: dict[int, dict[str, Any]], whole: dict[int, dict[str, Any]], fill: bool = True) -> bool:
        """Copy ``chunk``'s optimizer state (and, for an fp32 chunk, ``params``: the copy of its parameters
        the update will write) to the host tier before an update in the backward. Returns ``False``, with
        nothing taken, when the host tier has no room for it. ``fill=False`` only takes the memory: the
        update's own thread copies the values (:meth:`fill`) before it writes the state."""
        tensors = [chunk.optim[name].tensor for name in undo_families(chunk)]
        if params is not None:
            tensors.append(params)
        copies: list[torch.Tensor] = []
        try:
            for tensor in tensors:
                copies.append(self.memory.take(Tier.HOST, UNDO, tensor.numel(), tensor.dtype,
                                               f"the undo copy of {chunk.name} (step_in_backward)"))
        except HostCapacityError:
            for taken in copies:
                self.memory.give_back(Tier.HOST, UNDO, taken.nbytes, taken)
            return False
        saved = list(copies)
        saved_params = copies.pop() if params is not None else None
        undo = self._copies[chunk.index] = UndoCopy(
            chunk, dict(chunk.steps), multiplier, assumed, dict(zip(undo_families(chunk), copies)), saved_params,
            copy.deepcopy(scalars), copy.deepcopy(whole), sources=list(zip(saved, tensors)))
        if fill:
            self.fill(undo)
        return True

    @staticmethod
    def fill(undo: UndoCopy, outside: list[tuple[int, int]] | None = None) -> None:
        """Copy the values into ``undo`` (tensors only: callable from the update's thread); ``outside``: only
        these element ranges, the update having copied the rest (:meth:`UndoCopy.adam_copies`)."""
        for saved, tensor in undo.sources:
            for a, b in outside if outside is not None else [(0, saved.numel())]:
                saved[a:b].copy_(tensor[a:b])
        undo.sources, undo.filled = [], True

    def restore_into(self, undo: UndoCopy, params: torch.Tensor) -> None:
        """Put ``undo``'s values back into its chunk's families and ``params`` (the copy of the parameters
        the update wrote: the saved values, or the restored master's rounding), then release it. The
        step count and the kept state are the caller's to put back (they belong to the optimizer)."""
        for name, saved in undo.families.items():
            undo.chunk.optim[name].tensor.copy_(saved)
        params.copy_(undo.params if undo.params is not None else undo.chunk.optim[MASTER].tensor)
        self.release(undo.chunk)

    def release(self, chunk: Chunk) -> None:
        """Drop ``chunk``'s copy (kept: the update stands), giving its bytes back."""
        undo = self._copies.pop(chunk.index)
        saved = list(undo.families.values()) + ([undo.params] if undo.params is not None else [])
        for tensor in saved:
            self.memory.give_back(Tier.HOST, UNDO, tensor.nbytes, tensor)
