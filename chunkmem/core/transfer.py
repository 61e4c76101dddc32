"""Transfers between tiers as handles, and the bounded pool of pinned host buffers pageable sources stage through.

A copy between tiers is issued by the model's copy engine (:mod:`chunkmem.core.copy_engine`) and returns a
:class:`Transfer`; whoever uses the destination first calls :meth:`Transfer.wait`. What waiting means is the
engine's: on the CPU the copy was done when it was issued and ``wait`` only runs the completion (a chunk's
state moves from ``FETCHING`` to ``CURRENT``); with CUDA, a copy to the device makes the compute stream wait
for the copy's event (no host wait), and a copy to the host makes the host wait for it (the host is about to
read the bytes); the test engine does the copy itself only then.

Host-tier buffers that cross PCIe every step (parameter shards, gradients) are pinned at their exact size
(:mod:`chunkmem.core.pinned`). A pageable source (past the pinned budget) is staged through the
:class:`PinnedStagingPool`: at most ``max_buffers`` buffers (default :data:`PINNED_STAGING_BUFFERS` = 4), each
of the size of one transfer, so staging memory is bounded by 4 chunk buffers whatever the model size. A
transfer that finds every staging buffer busy first waits (on the host) for the oldest one's copy to finish.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

PINNED_STAGING_BUFFERS = 4


class Transfer:
    """A copy between tiers that has been issued. :meth:`wait` before the destination is used; it orders
    the reader after the copy (``complete``, run once) and then runs the completion (``finish``) once.
    ``event`` is the CUDA event recorded after the copy, or ``None`` for a copy that runs on no stream."""

    def __init__(self, finish: Callable[[], None] = lambda: None, event: "torch.cuda.Event | None" = None,
                 device: torch.device | None = None, complete: Callable[[], None] | None = None) -> None:
        self._finish = finish
        self._complete = complete
        self.event = event
        self.device = device  # the CUDA device whose stream or host thread waits for ``event``
        self.waited = False

    @property
    def on_side_stream(self) -> bool:
        """Whether the copy runs asynchronously on a CUDA side stream."""
        return self.event is not None

    def wait(self) -> None:
        """Order the reader after the copy and run the completion; idempotent."""
        if self.waited:
            return
        if self._complete is not None:
            self._complete()
        self.waited = True
        self._finish()


class PinnedStagingPool:
    """At most ``max_buffers`` pinned host buffers (bytes) through which host-to-device copies are staged.

    ``pinned_bytes`` is the pinned memory held now; ``peak_pinned_bytes`` the most ever held.
    """

    def __init__(self, max_buffers: int = PINNED_STAGING_BUFFERS) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers={max_buffers!r} is not allowed: expected an integer >= 1")
        self.max_buffers = max_buffers
        self._idle: list[torch.Tensor] = []
        self._busy: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self.pinned_bytes = 0
        self.peak_pinned_bytes = 0
        self.host_waits = 0  # times a take() waited for the oldest copy

    @property
    def buffers(self) -> int:
        """Pinned buffers held now (idle or in use)."""
        return len(self._idle) + len(self._busy)

    def _reclaim(self) -> None:
        while self._busy and self._busy[0][1].query():
            self._idle.append(self._busy.popleft()[0])

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of exactly ``nbytes`` bytes; waits for the oldest copy if all are busy."""
        self._reclaim()
        while True:
            for i, buf in enumerate(self._idle):
                if buf.numel() == nbytes:
                    return self._idle.pop(i)
            if self.buffers < self.max_buffers:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned_bytes += nbytes
                self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)
                return buf
            if self._idle:  # an idle buffer of another size makes room
                self.pinned_bytes -= self._idle.pop(0).numel()
                continue
            buf, event = self._busy.popleft()
            self.host_waits += 1
            event.synchronize()
            self._idle.append(buf)

    def give_back(self, buf: torch.Tensor, event: torch.cuda.Event) -> None:
        """``buf`` may be reused once ``event`` (the copy reading it) has completed."""
        self._busy.append((buf, event))


_pool: PinnedStagingPool | None = None


def staging_pool() -> PinnedStagingPool:
    """The process's pinned staging pool (created on first use, only with CUDA)."""
    global _pool
    if _pool is None:
        _pool = PinnedStagingPool()
    return _pool
