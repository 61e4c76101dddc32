"""``no_sync()``: the scope inside which backward passes keep their gradients local, unreduced, as under DDP;
the first backward outside reduces the sum. The chunk runtime's gradient landing (a sharded chunk's staging
buffer) and :class:`~chunkmem.LowLevelZeroOptimizer`'s backward (``param.grad``) each keep one :class:`NoSync`.
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
