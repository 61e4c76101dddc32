"""Transfers between tiers as handles, and the bounded pool of pinned host buffers they stage through.

Starting a copy between tiers returns a :class:`Transfer`; whoever uses the destination first calls
:meth:`Transfer.wait`. On the CPU (both tiers in CPU memory) the copy is done when it is started and
``wait`` only runs the completion (the chunk's state moves from ``FETCHING`` to ``CURRENT``), so the
same code path runs with and without a GPU. With CUDA, a copy from the host to the device is staged
through a pinned buffer and runs on a side stream; ``wait`` makes the compute stream wait for the
copy's event, so the copy overlaps whatever the compute stream does until then (prefetch). Copies from
the device to the host are synchronous (the host reads them at once).

Host-tier buffers themselves are ordinary pageable memory: pinning every host buffer (all of the
model's state) takes page-locked memory the kernel cannot reclaim and is a known way to be stopped by
the OOM killer. Only the :class:`PinnedStagingPool` is pinned, and it holds at most
``max_buffers`` buffers (default :data:`PINNED_STAGING_BUFFERS` = 4), each of the size of one transfer
(one chunk buffer), so pinned memory is bounded by 4 chunk buffers whatever the model size. A transfer
that finds every staging buffer busy first waits (on the host) for the oldest one's copy to finish.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

PINNED_STAGING_BUFFERS = 4


class Transfer:
    """A copy between tiers that has been issued. :meth:`wait` before the destination is used; it runs
    the completion (``finish``) once. ``event`` is the CUDA event recorded after the copy, or ``None``
    for a copy that was complete when it was issued."""

    def __init__(self, finish: Callable[[], None], event: "torch.cuda.Event | None" = None,
                 device: torch.device | None = None) -> None:
        self._finish = finish
        self.event = event
        self.device = device  # the CUDA device whose compute stream waits for ``event``
        self.waited = False

    @property
    def on_side_stream(self) -> bool:
        """Whether the copy runs asynchronously on a CUDA side stream."""
        return self.event is not None

    def wait(self) -> None:
        """Order the compute stream after the copy (CUDA) and run the completion; idempotent."""
        if self.waited:
            return
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
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
            event.synchronize()
            self._idle.append(buf)

    def give_back(self, buf: torch.Tensor, event: torch.cuda.Event) -> None:
        """``buf`` may be reused once ``event`` (the copy reading it) has completed."""
        self._busy.append((buf, event))


_pool: PinnedStagingPool | None = None
_side_streams: dict[int, torch.cuda.Stream] = {}


def staging_pool() -> PinnedStagingPool:
    """The process's pinned staging pool (created on first use, only with CUDA)."""
    global _pool
    if _pool is None:
        _pool = PinnedStagingPool()
    return _pool


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream host-to-device copies run on, one per CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def start_copy(dst: torch.Tensor, src: torch.Tensor, finish: Callable[[], None]) -> Transfer:
    """Issue ``dst.copy_(src)`` (same dtype and element count) and return its handle; ``finish`` runs at
    the handle's first :meth:`~Transfer.wait`."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        pool = staging_pool()
        staging = pool.take(src.numel() * src.element_size()).view(src.dtype)
        staging.copy_(src)
        stream = side_stream(dst.device)
        stream.wait_stream(torch.cuda.current_stream(dst.device))  # dst's memory was given on the compute stream
        with torch.cuda.stream(stream):
            dst.copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        pool.give_back(staging.view(torch.uint8), event)
        return Transfer(finish, event, dst.device)
    dst.copy_(src)
    return Transfer(finish)
