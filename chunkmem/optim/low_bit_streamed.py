"""An 8-bit Adam's update inside the streamed disk step (:mod:`chunkmem.optim.disk_step`), and on several ranks the
blocks that a shard boundary cuts, completed once every chunk was streamed.

The stream hands each chunk's shard to :class:`StreamedLowBitUpdate` as one piece: the codes from disk, the block
scales and the small parameters' moments from memory (``in_memory``: the chunk's own buffers, or copies that an
atomic step puts in place when it commits). Whole blocks are stepped and quantized there.

A block cut by a shard boundary (:mod:`chunkmem.optim.low_bit_layout`) is quantized with the scale the ranks agree
on: the largest magnitude of its new moments over every rank's part. That agreement is not made inside the
stream: with ``step_in_backward`` the stream runs on a thread of its own during the backward, beside the
gradients' reductions on autograd's thread, so a collective there would meet the partners' in no order a rank
could promise. Instead the stream steps the cut blocks' parameters (they read the unquantized moments: no scale
needed), keeps the cut parts' new moments and a copy of the aligned pages of codes around them, and writes the
pages with the cut parts' old codes. :func:`settle_cut_blocks`, which the step's commit runs on the caller's
thread of every rank (one whose stream failed too, so that nobody waits for it), agrees on the scales of every
cut block of every chunk in one all-reduce per shard group (:func:`largest_over`: a NaN kept), quantizes the
parts into the pages and the scales, and returns the pages to be written again before the ranks agree that the
step succeeded.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from ..core.chunk import Chunk
from ..distributed.collectives import ShardGroup, reduce_over_groups
from ..storage.disk_io import ALIGNMENT
from .disk_step import ChunkUpdate, LateWrite
from .low_bit_adam import Moments, Segment, random_part, step_cut_segment_, store_cut_segment_, update_segments_
from .low_bit_layout import CODES_M, CODES_V, LOW_BIT_FAMILIES, PLAIN_M, PLAIN_V, SCALES_M, SCALES_V, ChunkStateLayout

CutSegment = tuple[int, Segment]
"""``(index, segment)``: a ``cut`` segment and the index of its block in its layout's ``cut_blocks``."""


class StreamedLowBitUpdate:
    """One chunk's 8-bit update inside the streamed disk step (module docstring): ``segments`` (not cut) stepped
    and quantized, ``cut`` (:data:`CutSegment`) stepped with their new moments kept for :meth:`store_cut`;
    ``random()``: the stochastic rounding's numbers, indexed like the shard (drawn on the disk step's thread from
    this step's sequence), or ``None``."""

    def __init__(self, segments: list[Segment], cut: list[CutSegment], multiplier: float,
                 in_memory: dict[str, torch.Tensor], random: Callable[[], torch.Tensor | None]) -> None:
        self.segments = segments
        self.cut = cut
        self.multiplier = multiplier
        self.in_memory = in_memory
        self.random = random
        self.cut_moments: list[tuple[int, Segment, tuple[torch.Tensor, torch.Tensor]]] = []  # once computed
        self.pages: list[tuple[int, dict[str, torch.Tensor]]] = []  # (first element, each codes family's copy)

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], start: int,
                 end: int) -> None:
        assert start == 0 and end == master.numel(), "the 8-bit update streams each chunk as one piece"
        families = {**state, **self.in_memory}
        moments = Moments(*(families[family] for family in LOW_BIT_FAMILIES))
        random = self.random()
        self.cut_moments = [(index, s, step_cut_segment_(master, grad, moments, s, self.multiplier, None,
                                                         random_part(random, s)))
                            for index, s in self.cut]
        update_segments_(master, grad, moments, self.segments, self.multiplier, None, random)
        self.pages = [(a, {family: state[family][a:b].clone() for family in (CODES_M, CODES_V)})
                      for a, b in aligned_pages([(s.start, s.numel) for _, s in self.cut], end)]

    def fill_largest(self, largest: torch.Tensor) -> None:
        """Write into ``largest`` (2 rows, ``exp_avg`` and ``exp_avg_sq``, by the layout's cut block) the largest
        magnitude of the new moments of each cut part stepped here (nothing before the update was computed)."""
        for index, _, new in self.cut_moments:
            for row, values in enumerate(new):
                largest[row, index] = values.abs().amax()

    def store_cut(self, largest: torch.Tensor) -> list[tuple[str, int, torch.Tensor]]:
        """Quantize the cut parts with their blocks' agreed largest magnitudes (``largest``, as
        :meth:`fill_largest` fills it, reduced over the ranks) into the pages and the in-memory scales; returns
        the pages, ``(family, first element, codes)``, to write again."""
        for index, segment, new in self.cut_moments:
            first, codes = next((a, c) for a, c in self.pages if a <= segment.start < a + c[CODES_M].numel())
            moments = Moments(codes[CODES_M], codes[CODES_V], *(self.in_memory[family] for family in
                                                               (SCALES_M, SCALES_V, PLAIN_M, PLAIN_V)))
            store_cut_segment_(moments, replace(segment, start=segment.start - first), new,
                               (largest[0, index], largest[1, index]))
        return [(family, first, codes[family]) for first, codes in self.pages for family in (CODES_M, CODES_V)]


def aligned_pages(cut: Sequence[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """``(start, end)``: the element ranges of a shard's one-byte codes (``numel`` of them) that hold the ``cut``
    parts (``(start, numel)`` each), from a multiple of the I/O alignment to one or to the shard's end, sorted and
    disjoint (two parts in one page share it: it is written once, with both)."""
    pages: list[tuple[int, int]] = []
    for start, count in sorted(cut):
        a = start // ALIGNMENT * ALIGNMENT
        b = min(numel, -(-(start + count) // ALIGNMENT) * ALIGNMENT)
        if pages and a < pages[-1][1]:
            pages[-1] = (pages[-1][0], max(b, pages[-1][1]))
        else:
            pages.append((a, b))
    return pages


def rewritten_nbytes(layout: ChunkStateLayout, shard_numel: int) -> int:
    """Bytes of codes a step over a shard of ``shard_numel`` elements laid out as ``layout`` writes again when every
    parameter steps (:meth:`StreamedLowBitUpdate.store_cut`: the pages of its cut blocks' parts, of both moments),
    besides the whole shard the stream writes."""
    cut = [(start, count) for piece in layout.pieces.values() for start, count, is_cut, _ in piece.spans() if is_cut]
    return 2 * sum(b - a for a, b in aligned_pages(cut, shard_numel))


def settle_cut_blocks(cut_chunks: Sequence[tuple[Chunk, int]], updates: list[ChunkUpdate],
                      failed: bool) -> list[LateWrite]:
    """The streamed step's :data:`~chunkmem.optim.disk_step.Settle` for an 8-bit Adam on several ranks (module
    docstring). ``cut_chunks``: ``(chunk, its layout's number of cut blocks)`` for every trainable chunk whose shard
    boundaries cut a block, in chunk order, the same on every rank whatever this rank streamed; one all-reduce
    per shard group over all of them (this rank's parts: those of ``updates`` computed), also where this rank's
    stream ``failed`` (then nothing is stored or returned)."""
    streamed = {id(u.chunk): u for u in updates if isinstance(u.rule, StreamedLowBitUpdate)}
    groups: dict[int, tuple[ShardGroup, list[tuple[Chunk, int]]]] = {}
    for chunk, count in cut_chunks:
        groups.setdefault(id(chunk.shards.group), (chunk.shards, []))[1].append((chunk, count))
    late: list[LateWrite] = []
    for shards, members in groups.values():
        bases = [sum(count for _, count in members[:position]) for position in range(len(members) + 1)]
        largest = torch.zeros(2, bases[-1], dtype=torch.float32)
        for (chunk, _), a, b in zip(members, bases, bases[1:]):
            if id(chunk) in streamed:
                streamed[id(chunk)].rule.fill_largest(largest[:, a:b])
        largest = largest_over(shards, largest, f"the 8-bit scales of the blocks cut by shard boundaries in "
                                                f"{len(members)} chunks streamed from disk")
        if failed:
            continue
        for (chunk, _), a, b in zip(members, bases, bases[1:]):
            update = streamed.get(id(chunk))
            if update is not None:
                late += [(update, family, first, codes) for family, first, codes in
                         update.rule.store_cut(largest[:, a:b])]
    return late


def largest_over(shards: ShardGroup, values: torch.Tensor, what: str) -> torch.Tensor:
    """``values``' elementwise maximum over the ``shards`` ranks, returned (``what``: for the error): a NaN on any
    rank stays a NaN, as torchao's ``amax`` of a whole block keeps it (gloo's MAX drops a NaN that another rank
    meets with a number; :func:`~chunkmem.distributed.collectives.reduce_over_groups` carries it as a count)."""
    return reduce_over_groups([shards.group] if shards.sharded else [], values, True, what)
