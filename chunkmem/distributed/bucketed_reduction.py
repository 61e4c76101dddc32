"""The bucketed mode of :class:`~chunkmem.distributed.reduction.GradientReduction`: gradients reduced across
parameters in the order autograd finishes them, a bucket at a time (ZeRO-1/2, :class:`~chunkmem.LowLevelZeroOptimizer`).

Gradients are collected into a bucket; once it holds at least ``bucket_numel`` elements (a gradient that
large forms a bucket alone) the bucket is reduced over the shard group in the reduction dtype, as one
collective (with overlap, at most :data:`MAX_IN_FLIGHT` at once):

* replicated (ZeRO-1): an all-reduce of the concatenated gradients; every rank keeps the mean of all of it.
* partitioned (ZeRO-2): a reduce-scatter whose piece ``r`` holds the elements of the bucket's gradients
  that rank ``r`` keeps (padded to the longest piece). Over gloo the bucket is all-reduced instead and each
  rank keeps its part (:func:`~chunkmem.distributed.collectives.all_reduce_is_faster`).

The input is predivided and the sum turned into the mean by the reduction's own arithmetic
(:meth:`GradientReduction.predivide_`, :meth:`GradientReduction.mean_`: the sum over the ranks divided by
the world size, in the reduction dtype); the reduction counts the buckets (``collectives``) and the
traffic. What a rank keeps of each gradient is handed to ``deliver`` in the bucket's order, still in the
reduction dtype. With ``overlap`` the collectives are started asynchronously and completed in
:meth:`BucketedReduction.finish` (the end of the backward), so they run while autograd computes the
remaining gradients; without it each bucket is reduced before the backward goes on.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from .collectives import PendingCollective, all_reduce_is_faster, start_all_reduce, start_reduce_scatter
from .reduction import GradientReduction
from .traffic import count_collective


MAX_IN_FLIGHT = 2
"""With overlap, at most this many buckets' collectives run at once: adding one more first completes the
oldest, so the communication buffers stay within a few buckets instead of the whole gradient."""


class RankParts(Protocol):
    """Whose elements of one gradient are whose (a parameter's place in a sharded chunk)."""

    def part_of_rank(self, rank: int) -> tuple[int, int] | None:
        """The element range ``(start, end)`` of the gradient that ``rank`` keeps, or ``None``."""


Deliver = Callable[[RankParts, tuple[int, int] | None, torch.Tensor], None]
"""``deliver(owner, kept, mean)``: ``mean`` holds the mean over the ranks of the elements ``kept`` of
``owner``'s gradient (``kept`` ``None``: this rank keeps none of it, ``mean`` empty)."""


class BucketedReduction:
    """Collects finished gradients and reduces them a bucket at a time (see the module docstring).

    Args:
        reduction: the group, predivision and replica sum of the reduction, and its counter of collectives.
        dtype: the reduction dtype (the collectives').
        bucket_numel: elements in a bucket at least before it is reduced.
        overlap: start the collectives asynchronously, at most :data:`MAX_IN_FLIGHT` at once.
        partitioned: each rank keeps only its part of each gradient (``RankParts.part_of_rank``), else all.
        deliver: takes what this rank keeps of each gradient (:data:`Deliver`).
    """

    def __init__(self, reduction: GradientReduction, dtype: torch.dtype, bucket_numel: int, overlap: bool,
                 partitioned: bool, deliver: Deliver) -> None:
        self.reduction = reduction
        self.shards = reduction.shards
        self.dtype = dtype
        self.bucket_numel = bucket_numel
        self.overlap = overlap
        self.partitioned = partitioned
        self.deliver = deliver
        self.entries: list[tuple[RankParts, torch.Tensor]] = []
        self.numel = 0
        self.in_flight: list[tuple[PendingCollective, Callable[[], None]]] = []
        self.scratch = _ScratchBuffers(MAX_IN_FLIGHT + 1)
        self.reduce_scatter = partitioned and not all_reduce_is_faster(self.shards)

    @property
    def collectives(self) -> int:
        """Buckets reduced so far (the reduction's count of collectives)."""
        return self.reduction.collectives

    def add(self, owner: RankParts, grad: torch.Tensor) -> None:
        """Take one finished (local) gradient; reduce the bucket once it is full. A gradient of
        ``bucket_numel`` elements or more first sends the bucket off, then forms one alone (reduced in
        place, without a copy)."""
        if grad.numel() >= self.bucket_numel:
            self.flush()
        self.entries.append((owner, grad))
        self.numel += grad.numel()
        if self.numel >= self.bucket_numel:
            self.flush()

    def flush(self) -> None:
        """Start reducing the bucket (and, without overlap, wait for it)."""
        if not self.entries:
            return
        entries, self.entries, self.numel = self.entries, [], 0
        start = self._start_partitioned if self.reduce_scatter else self._start_whole
        pending, finish = start(entries)
        self.reduction.collectives += 1
        if self.overlap:
            self.in_flight.append((pending, finish))
            while len(self.in_flight) > MAX_IN_FLIGHT:  # bound the buffers held by collectives in flight
                pending, finish = self.in_flight.pop(0)
                pending.wait()
                finish()
        else:
            pending.wait()
            finish()

    def finish(self) -> None:
        """Reduce what is left in the bucket and wait for every collective in flight, in order."""
        self.flush()
        in_flight, self.in_flight = self.in_flight, []
        for pending, finish in in_flight:
            pending.wait()
            finish()

    @property
    def idle(self) -> bool:
        """Whether no gradient waits in the bucket and no collective is in flight."""
        return not self.entries and not self.in_flight

    def _start_whole(self, entries: list[tuple[RankParts, torch.Tensor]]
                     ) -> tuple[PendingCollective, Callable[[], None]]:
        """The bucket all-reduced; each rank keeps its part (partitioned) or all of each gradient."""
        if len(entries) == 1 and entries[0][1].dtype == self.dtype and entries[0][1].is_contiguous():
            flat = entries[0][1].view(-1)  # a gradient alone in its bucket is reduced where it is (no copy)
        else:
            flat = torch.cat([g.reshape(-1).to(self.dtype) for _, g in entries])
        layout = [(owner, g.numel()) for owner, g in entries]
        what = f"a gradient bucket of {flat.numel()} elements"
        self.reduction.predivide_(flat)
        count_collective("gradients", "all_reduce", self.shards.world, flat.numel() * flat.element_size())
        pending = start_all_reduce(self.shards, flat, what=what)

        def finish() -> None:
            mean = self.reduction.mean_(flat, what)
            position = 0
            for owner, numel in layout:
                kept = owner.part_of_rank(self.shards.rank) if self.partitioned else (0, numel)
                first, end = kept if kept is not None else (0, 0)
                self.deliver(owner, kept, mean[position + first:position + end])
                position += numel
        return pending, finish

    def _start_partitioned(self, entries: list[tuple[RankParts, torch.Tensor]]
                           ) -> tuple[PendingCollective, Callable[[], None]]:
        """The bucket reduce-scattered: piece ``r`` joins the parts rank ``r`` keeps, padded to the longest."""
        world, rank = self.shards.world, self.shards.rank
        parts: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(world)]
        for owner, grad in entries:
            flat_grad = grad.reshape(-1)
            for r in range(world):
                part = owner.part_of_rank(r)
                if part is not None:
                    parts[r].append((flat_grad, *part))
        longest = max(1, max(sum(b - a for _, a, b in rows) for rows in parts))
        block = self.scratch.take((world + 1) * longest, self.dtype, entries[0][1].device)
        joined, out = block[:world * longest], block[world * longest:(world + 1) * longest]
        for r, rows in enumerate(parts):
            position = r * longest
            for flat_grad, a, b in rows:
                joined[position:position + b - a].copy_(flat_grad[a:b])
                position += b - a
            joined[position:(r + 1) * longest].zero_()  # the padding of a shorter piece
        owners = [owner for owner, _ in entries]
        del parts, entries  # the local gradients are no longer needed: their elements are in ``joined``
        what = f"a gradient bucket of {joined.numel()} elements"
        self.reduction.predivide_(joined)
        count_collective("gradients", "reduce_scatter", world, joined.numel() * joined.element_size())
        pending = start_reduce_scatter(self.shards, out, joined, what=what)

        def finish() -> None:
            mean = self.reduction.mean_(out, what)
            position = 0
            for owner in owners:
                kept = owner.part_of_rank(rank)
                length = 0 if kept is None else kept[1] - kept[0]
                self.deliver(owner, kept, mean[position:position + length])
                position += length
            self.scratch.give(block)  # only now: the collective reads ``joined`` until it is done
        return pending, finish


class _ScratchBuffers:
    """The communication buffers of the reduce-scatters, kept from bucket to bucket and from step to
    step (at most ``keep`` of them, the largest), so a backward does not allocate and first-touch
    fresh memory for every bucket. :meth:`take` returns a free buffer of at least the size asked (or a
    new one); :meth:`give` returns it."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, buffer in enumerate(self.free):
            if buffer.numel() >= numel and buffer.dtype == dtype and buffer.device == device:
                return self.free.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)
        self.free.sort(key=lambda t: t.numel(), reverse=True)
        del self.free[self.keep:]
