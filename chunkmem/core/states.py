"""Explicit states of a chunk's buffers, and the internal error a transition from a wrong state raises.

Every copy of a chunk's memory (the device copy of its parameters, the parameter shard, the gradient
buffer, each optimizer family) has a :class:`CopyState`, held by one :class:`CopyLife` and changed only
through its transition methods, each of which names the states it may start from (the way FSDP2's
``ShardedState`` is checked before each of its transitions). A transition from any other state raises
:class:`ChunkStateError`, naming the chunk, the copy, its state, the states allowed and the rank: it is
a bug in chunkmem, never a user error. The diagram is in :mod:`chunkmem.core.chunk`.
"""
from __future__ import annotations

import enum

from ..errors import ChunkStateError


class CopyState(enum.Enum):
    """The life of one copy of a chunk buffer (see the diagram in :mod:`chunkmem.core.chunk`)."""

    FREED = "freed"        # no memory
    FETCHING = "fetching"  # memory held, a transfer into it in flight: wait its handle before use
    CURRENT = "current"    # holds the chunk's current contents
    STALE = "stale"        # memory held, contents out of date (about to be overwritten, or to be freed)


class Contents(enum.Enum):
    """What a chunk's parameter memory holds: the parameter values, or (``reuse_fp16_shard``) their
    gradients from the last backward, until the optimizer step writes values again."""

    VALUES = "values"
    GRADS = "grads"


_HOLDING = (CopyState.CURRENT, CopyState.STALE)


class CopyLife:
    """The state of one copy (``what``, e.g. ``"chunk3.param device copy"``) and its transitions."""

    __slots__ = ("what", "rank", "_state")

    def __init__(self, what: str, rank: int = 0) -> None:
        self.what = what
        self.rank = rank
        self._state = CopyState.FREED

    @property
    def state(self) -> CopyState:
        return self._state

    @property
    def holds_memory(self) -> bool:
        """Whether the copy has memory (every state but ``FREED``)."""
        return self._state is not CopyState.FREED

    @property
    def current(self) -> bool:
        return self._state is CopyState.CURRENT

    def check(self, action: str, *allowed: CopyState) -> None:
        """Raise :class:`ChunkStateError` unless the copy is in one of ``allowed``."""
        if self._state not in allowed:
            raise ChunkStateError(self.what, action, self._state, allowed, self.rank)

    def _go(self, action: str, to: CopyState, allowed: tuple[CopyState, ...]) -> None:
        self.check(action, *allowed)
        self._state = to

    def allocated(self) -> None:
        """FREED -> STALE: memory given, contents undefined."""
        self._go("allocate", CopyState.STALE, (CopyState.FREED,))

    def fill_started(self) -> None:
        """STALE -> FETCHING: a transfer into the copy was issued."""
        self._go("start a transfer into it", CopyState.FETCHING, (CopyState.STALE,))

    def fill_finished(self) -> None:
        """FETCHING -> CURRENT: the transfer's handle was waited on."""
        self._go("finish a transfer", CopyState.CURRENT, (CopyState.FETCHING,))

    def written(self) -> None:
        """STALE or CURRENT -> CURRENT: the chunk's new contents were written into the copy."""
        self._go("be written", CopyState.CURRENT, _HOLDING)

    def outdated(self) -> None:
        """CURRENT -> STALE: the contents changed in another copy."""
        self._go("be marked out of date", CopyState.STALE, (CopyState.CURRENT,))

    def freed(self) -> None:
        """STALE or CURRENT -> FREED (a copy in flight is waited on before it is freed)."""
        self._go("be freed", CopyState.FREED, _HOLDING)

    def __repr__(self) -> str:
        return f"CopyLife({self.what!r}, {self._state.name})"
