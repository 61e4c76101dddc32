"""``no_sync()``: the scope inside which backward passes keep their gradients local, unreduced, as under DDP.

Both gradient owners keep one :class:`NoSync`: the chunk runtime's gradient landing (a sharded chunk's gradients
accumulate in its staging buffer) and :class:`~chunkmem.LowLevelZeroOptimizer`'s backward (the local gradients
accumulate in ``param.grad``). What stays local is each owner's; the scope, its refusal of a nested one and the
flag the backward reads are this class's. The first backward outside the scope reduces the sum.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from ..errors import InvalidArgumentError


class NoSync:
    """Whether backward passes defer their reductions now (:attr:`active`), and the scope that says so."""

    def __init__(self) -> None:
        self.active = False

    @contextlib.contextmanager
    def scope(self, check: Callable[[], None] = lambda: None) -> Iterator[None]:
        """Defer inside; ``check`` runs first and may refuse (the gradient strategy's own limits). A nested
        scope raises :class:`~chunkmem.InvalidArgumentError`."""
        check()
        if self.active:
            raise InvalidArgumentError("no_sync", "a nested no_sync()", "one no_sync() at a time")
        self.active = True
        try:
            yield
        finally:
            self.active = False
