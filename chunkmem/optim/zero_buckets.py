"""Bucketed gradient reduction of :class:`~chunkmem.LowLevelZeroOptimizer`.

Gradients arrive one parameter at a time as autograd finishes them. They are collected into a bucket;
once it holds at least ``bucket_numel`` elements (a gradient that large forms a bucket alone) the bucket
is reduced over the data-parallel ranks in the communication dtype, as one collective (with overlap, at
most :data:`MAX_IN_FLIGHT` at once):

* ZeRO-1 (``partition_grad=False``): an all-reduce of the concatenated gradients; every rank adds the
  mean into its full-chunk gradient store.
* ZeRO-2 (``partition_grad=True``): a reduce-scatter whose piece ``r`` holds the elements of the
  bucket's gradients that rank ``r`` owns (padded to the longest piece); each rank adds the mean of its
  piece into its shard-sized gradient store. Over gloo the bucket is all-reduced instead and each rank
  keeps its part (:func:`~chunkmem.distributed.collectives.all_reduce_is_faster`): the store is still shard-sized.

The mean is the sum over the ranks divided by the world size, both in the communication dtype, then
cast to the store's dtype. With ``overlap`` the collectives are started asynchronously and waited for in
:meth:`GradientBuckets.finish` (the end of the backward), so they run while autograd computes the
remaining gradients; without it each bucket is reduced before the backward goes on.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..distributed.collectives import (PendingCollective, ShardGroup, all_reduce_is_faster, start_all_reduce,
                          start_reduce_scatter)
from .zero_partition import FlatChunk, FlatSlot


MAX_IN_FLIGHT = 2
"""With overlap, at most this many buckets' collectives run at once: adding one more first completes the
oldest, so the communication buffers stay within a few buckets instead of the whole gradient."""


class GradientBuckets:
    """Collects finished gradients and reduces them into the chunks' gradient stores.

    ``store_of(chunk)`` returns the chunk's gradient store (allocating it zeroed at first use): the full
    chunk (ZeRO-1) or this rank's shard (ZeRO-2). ``comm_dtype``: the dtype of the collectives.
    """

    def __init__(self, shards: ShardGroup, partition_grad: bool, comm_dtype: torch.dtype, bucket_numel: int,
                 overlap: bool, store_of: Callable[[FlatChunk], torch.Tensor]) -> None:
        self.shards = shards
        self.partition_grad = partition_grad
        self.comm_dtype = comm_dtype
        self.bucket_numel = bucket_numel
        self.overlap = overlap
        self.store_of = store_of
        self.entries: list[tuple[FlatSlot, torch.Tensor]] = []
        self.numel = 0
        self.in_flight: list[tuple[PendingCollective, Callable[[], None]]] = []
        self.collectives = 0  # buckets reduced so far
        self.scratch = _ScratchBuffers(MAX_IN_FLIGHT + 1)
        self.reduce_scatter = partition_grad and not all_reduce_is_faster(shards)

    def add(self, slot: FlatSlot, grad: torch.Tensor) -> None:
        """Take one parameter's finished (local) gradient; reduce the bucket once it is full. A gradient
        of ``bucket_numel`` elements or more first sends the bucket off, then forms one alone (reduced in
        place, without a copy)."""
        if grad.numel() >= self.bucket_numel:
            self.flush()
        self.entries.append((slot, grad))
        self.numel += grad.numel()
        if self.numel >= self.bucket_numel:
            self.flush()

    def flush(self) -> None:
        """Start reducing the bucket (and, without overlap, wait for it)."""
        if not self.entries:
            return
        entries, self.entries, self.numel = self.entries, [], 0
        start = self._start_partitioned if self.reduce_scatter else self._start_replicated
        pending, finish = start(entries)
        self.collectives += 1
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

    def _start_replicated(self, entries: list[tuple[FlatSlot, torch.Tensor]]
                          ) -> tuple[PendingCollective, Callable[[], None]]:
        if len(entries) == 1 and entries[0][1].dtype == self.comm_dtype and entries[0][1].is_contiguous():
            flat = entries[0][1].view(-1)  # a gradient alone in its bucket is reduced where it is (no copy)
        else:
            flat = torch.cat([g.reshape(-1).to(self.comm_dtype) for _, g in entries])
        layout = [(slot, g.numel()) for slot, g in entries]
        pending = start_all_reduce(self.shards, flat, what=f"a gradient bucket of {flat.numel()} elements")

        def finish() -> None:
            if self.shards.world > 1:
                flat.div_(self.shards.world)
            position = 0
            for slot, numel in layout:
                store = self.store_of(slot.chunk)
                if not self.partition_grad:
                    target, source = store[slot.offset:slot.offset + numel], flat[position:position + numel]
                else:  # ZeRO-2 over an all-reduce: keep the part this rank owns
                    run = slot.chunk.own_run(slot)
                    if run is None:
                        position += numel
                        continue
                    start, end, first = run
                    target, source = store[start:end], flat[position + first:position + first + end - start]
                target.add_(source.to(target.device, target.dtype))
                position += numel
        return pending, finish

    def _start_partitioned(self, entries: list[tuple[FlatSlot, torch.Tensor]]
                           ) -> tuple[PendingCollective, Callable[[], None]]:
        world, rank = self.shards.world, self.shards.rank
        parts: list[list[tuple[FlatSlot, torch.Tensor, int, int]]] = [[] for _ in range(world)]
        for slot, grad in entries:
            flat_grad = grad.reshape(-1)
            for r in range(world):
                part = slot.part_of_rank(r)
                if part is not None:
                    parts[r].append((slot, flat_grad, *part))
        longest = max(1, max(sum(b - a for _, _, a, b in rows) for rows in parts))
        device = entries[0][1].device
        block = self.scratch.take((world + 1) * longest, self.comm_dtype, device)
        joined, out = block[:world * longest], block[world * longest:(world + 1) * longest]
        for r, rows in enumerate(parts):
            position = r * longest
            for _, flat_grad, a, b in rows:
                joined[position:position + b - a].copy_(flat_grad[a:b])
                position += b - a
            joined[position:(r + 1) * longest].zero_()  # the padding of a shorter piece
        mine = [(slot, a, b) for slot, _, a, b in parts[rank]]
        del parts, entries  # the local gradients are no longer needed: their elements are in ``joined``
        pending = start_reduce_scatter(self.shards, out, joined, what=f"a gradient bucket of {joined.numel()} "
                                                                      f"elements")

        def finish() -> None:
            if self.shards.world > 1:
                out.div_(self.shards.world)
            position = 0
            for slot, a, b in mine:
                store = self.store_of(slot.chunk)
                start = slot.offset + a - slot.chunk.shard_offset
                store[start:start + b - a].add_(out[position:position + b - a].to(store.device, store.dtype))
                position += b - a
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

