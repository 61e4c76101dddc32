"""Chunks laid out frozen (no trainable parameter: a LoRA base): how long a backward holds them, and the
parameters of theirs that require grad again, which cannot train.

No gradient of a frozen chunk says when the backward is done with it. The same holds for a trainable chunk all
of whose parameters were frozen after wrapping (``requires_grad_(False)``, which keeps their optimizer state):
for the iteration it is a frozen chunk (:meth:`FrozenHolds.begin_iteration`). A module call tracked by
:class:`~chunkmem.runtime.hooks.FrozenBackward` says it for itself; :class:`FrozenHolds` counts, per frozen
chunk, the calls whose backward runs and still use it, and the chunks a call without a tracker uses (kept
to the end of the backward), so a chunk leaves the device once none needs it.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from torch._C import DisableTorchFunctionSubclass

from ..core.chunk import Chunk
from ..errors import UnsupportedOperationError


class FrozenHolds:
    """The frozen chunks held for one backward (see the module docstring)."""

    def __init__(self) -> None:
        self._users: Counter[Chunk] = Counter()  # module calls whose backward runs and use the chunk
        self._kept: set[Chunk] = set()  # used by a call without a tracker: kept to the end of the backward
        self._frozen_since_wrapping: frozenset[Chunk] = frozenset()  # trainable, every parameter frozen now

    def begin_iteration(self, chunks: Iterable[Chunk]) -> None:
        """An iteration begins: the trainable ``chunks`` none of whose parameters requires grad now get no
        gradient in its backward, so they are held as frozen chunks are (read once an iteration: the forward
        records which tensors require grad as it runs)."""
        with DisableTorchFunctionSubclass():  # requires_grad of a chunk-managed parameter
            self._frozen_since_wrapping = frozenset(
                c for c in chunks if c.trainable and not any(slot.param.requires_grad for slot in c.slots))

    def frozen(self, chunk: Chunk) -> bool:
        """Whether no gradient of this iteration's backward will tell when it is done with ``chunk``."""
        return not chunk.trainable or chunk in self._frozen_since_wrapping

    def held(self, chunks: Iterable[Chunk], tracked: bool) -> None:
        """A module call's backward begins with ``chunks`` held (``tracked``: it will say when it is over)."""
        for chunk in chunks:
            if self.frozen(chunk):
                if tracked:
                    self._users[chunk] += 1
                else:
                    self._kept.add(chunk)

    def done(self, chunks: Iterable[Chunk], release: Callable[[Chunk], None]) -> None:
        """A tracked call's backward is over: ``release`` each of its frozen ``chunks`` no other call whose
        backward runs uses."""
        for chunk in chunks:
            if not self.frozen(chunk) or self._users[chunk] == 0:
                continue
            self._users[chunk] -= 1
            if self._users[chunk] == 0 and chunk not in self._kept and chunk.held_for_backward:
                release(chunk)

    def clear(self) -> None:
        """The backward ended (or was abandoned)."""
        self._users.clear()
        self._kept.clear()


def unfrozen_since_wrapping(chunks: Iterable[Chunk]) -> list[str]:
    """Names of the parameters of chunks laid out frozen that require grad now."""
    with DisableTorchFunctionSubclass():  # read past the parameter guard
        return [slot.name for c in chunks if not c.trainable for slot in c.slots if slot.param.requires_grad]


def refuse_unfrozen(where: str, unfrozen: list[str]) -> None:
    """Raise :class:`~chunkmem.UnsupportedOperationError` (``where`` names the call refused) if ``unfrozen``
    names any parameter (see :meth:`chunkmem.runtime.runtime.ChunkRuntime.refuse_unfrozen`)."""
    if unfrozen:
        raise UnsupportedOperationError(
            f"{where}: parameter {unfrozen[0]!r}{f' and {len(unfrozen) - 1} more' if len(unfrozen) > 1 else ''} "
            f"requires grad now but was frozen (requires_grad=False) when the model was wrapped, so its chunk has "
            f"no gradient or optimizer state and it cannot be trained: wrap the model with it trainable and "
            f"freeze it after wrapping instead (a parameter frozen after wrapping keeps its optimizer state and is "
            f"stepped again once unfrozen), or freeze it again; nothing was changed")
