"""Where an 8-bit Adam's state lies in this rank's shard of a chunk (:mod:`chunkmem.optim.low_bit_rule`).

Each parameter's part in the shard is a :class:`StatePiece`. Whether a parameter's state is quantized is decided
on the whole parameter (:func:`~chunkmem.optim.blockwise.quantizes`), and its blocks of 256 elements are counted
from its first element, as torchao blocks the unsharded parameter. Where a shard boundary falls inside one of its
blocks, the block is **cut**: each rank holding a part of it keeps its part's codes and a copy of the block's one
scale, which the ranks agree on at every step (the largest magnitude over all the parts). So a piece holds:

* the codes of its elements (at their place in the shard, like every per-element family);
* the scales of every block it touches, a cut one at either end included (from ``state_base`` in the scales);
* or, for a parameter kept plain, its elements' fp32 moments (from ``state_base`` in the plain moments).

:class:`ChunkStateLayout` is a chunk's pieces with what the ranks share: the cut blocks in an order every rank
derives alike (boundary by boundary), which the update all-reduces, and the numbering of every block of the
chunk's quantized parameters, in which the state dict gathers the scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.chunk import Chunk
from ..core.layout import part_in_shard
from .blockwise import BLOCK_SIZE, quantizes
from .low_bit_adam import LowBitHyper, Segment

CODES_M, CODES_V = "exp_avg_codes", "exp_avg_sq_codes"
SCALES_M, SCALES_V = "exp_avg_scales", "exp_avg_sq_scales"
PLAIN_M, PLAIN_V = "exp_avg_fp32", "exp_avg_sq_fp32"
LOW_BIT_FAMILIES = (CODES_M, CODES_V, SCALES_M, SCALES_V, PLAIN_M, PLAIN_V)
"""The state families of a chunk under an 8-bit Adam: the codes (one per element of the shard), the block scales
and the plain moments, of ``exp_avg`` and ``exp_avg_sq`` (:mod:`chunkmem.optim.low_bit_rule`)."""

Span = tuple[int, int, bool, int]
"""``(start, numel, cut, state_base)``: a run of a piece updated in one go: whole blocks, or one cut block's part."""


@dataclass(frozen=True)
class StatePiece:
    """One parameter's part of this rank's shard: ``numel`` elements from ``start`` in the shard (elements), which
    are its elements from ``first``; its state quantized (``state_base``: the scale of the first block it
    touches) or plain (``state_base``: its first plain moment)."""

    slot: int
    start: int
    numel: int
    quantized: bool
    state_base: int
    first: int

    @property
    def first_block(self) -> int:
        """The parameter's block holding the piece's first element."""
        return self.first // BLOCK_SIZE

    @property
    def blocks(self) -> int:
        """The block scales the piece keeps: one per block of the parameter it touches (0 when plain)."""
        if not self.quantized:
            return 0
        return -(-(self.first + self.numel) // BLOCK_SIZE) - self.first_block

    def spans(self) -> list[Span]:
        """The piece cut where its blocks are: a cut block's part at its start, its whole blocks, a cut block's
        part at its end (one of each at most; a plain piece is one span)."""
        if not self.quantized:
            return [(self.start, self.numel, False, self.state_base)]
        begin, end = self.first, self.first + self.numel
        head_end = min(end, -(-begin // BLOCK_SIZE) * BLOCK_SIZE)
        tail_begin = max(head_end, end // BLOCK_SIZE * BLOCK_SIZE)
        spans, scale = [], self.state_base
        for a, b, cut in ((begin, head_end, True), (head_end, tail_begin, False), (tail_begin, end, True)):
            if a < b:
                spans.append((self.start + a - begin, b - a, cut, scale))
                scale += 1 if cut else (b - a) // BLOCK_SIZE
        return spans

    def segments(self, hyper: LowBitHyper, step: int) -> list[Segment]:
        """The piece's :meth:`spans` as segments stepped with ``hyper`` to step number ``step``."""
        return [Segment(start, numel, self.quantized, base, hyper, step, cut)
                for start, numel, cut, base in self.spans()]


@dataclass(frozen=True)
class ChunkStateLayout:
    """A chunk's 8-bit state in this rank's shard (module docstring).

    Attributes:
        pieces: each parameter's piece by its position in the chunk (those with no element here: none).
        blocks: the block scales this shard keeps (elements of each scales family before padding).
        plain: the plain moments this shard keeps (elements of each plain family before padding).
        cut_blocks: ``(position in the chunk, block of the parameter)`` of every block a shard boundary cuts,
            in the same order on every rank.
        block_bases: the first block of each quantized parameter (by position in the chunk) in a numbering of
            all the chunk's quantized blocks, whose count is ``chunk_blocks``.
        plain_slots: whether any parameter of the chunk keeps plain state (the same on every rank).
    """

    pieces: dict[int, StatePiece]
    blocks: int
    plain: int
    cut_blocks: tuple[tuple[int, int], ...]
    block_bases: dict[int, int]
    chunk_blocks: int
    plain_slots: bool

    @property
    def scale_numel(self) -> int:
        """Elements of each scales family's buffer: :attr:`blocks`, at least one (a shard may have no quantized
        parameter)."""
        return max(self.blocks, 1)

    @property
    def plain_numel(self) -> int:
        """Elements of each plain family's buffer: :attr:`plain`, at least one."""
        return max(self.plain, 1)

    @staticmethod
    def of(chunk: Chunk) -> "ChunkStateLayout":
        """The layout of ``chunk``'s state in this rank's shard."""
        return ChunkStateLayout.of_shard([(slot.offset, slot.numel) for slot in chunk.slots], chunk.shard_offset,
                                         chunk.shard_numel, chunk.shards.world)

    @staticmethod
    def of_shard(slots: Sequence[tuple[int, int]], shard_offset: int, shard_numel: int,
                 world: int) -> "ChunkStateLayout":
        """The layout of the shard ``[shard_offset, shard_offset + shard_numel)`` of a chunk sharded over ``world``
        ranks into shards of ``shard_numel`` elements, whose parameters are ``slots``: ``(offset, numel)`` in
        elements, in the chunk's order (their positions are the pieces' keys). A chunk whole on every rank (of
        persistent parameters) has one shard of all its elements, and no block is cut. A sharded checkpoint's
        layout is derived by it from the chunk table its files hold (:mod:`chunkmem.io.low_bit_resharding`)."""
        pieces, blocks, plain = {}, 0, 0
        for index, (offset, numel) in enumerate(slots):
            part = part_in_shard(offset, numel, shard_offset, shard_numel)
            if part is None:
                continue
            quantized = quantizes(numel)
            piece = StatePiece(index, offset + part[0] - shard_offset, part[1] - part[0], quantized,
                               blocks if quantized else plain, part[0])
            pieces[index] = piece
            blocks += piece.blocks
            plain += 0 if quantized else piece.numel
        cuts: list[tuple[int, int]] = []
        for rank in range(1, world):
            boundary = rank * shard_numel
            for index, (offset, numel) in enumerate(slots):
                inside = boundary - offset
                if quantizes(numel) and 0 < inside < numel and inside % BLOCK_SIZE:
                    if (index, inside // BLOCK_SIZE) not in cuts:  # a block under several boundaries
                        cuts.append((index, inside // BLOCK_SIZE))
        bases, total = {}, 0
        for index, (_, numel) in enumerate(slots):
            if quantizes(numel):
                bases[index] = total
                total += numel // BLOCK_SIZE
        return ChunkStateLayout(pieces, blocks, plain, tuple(cuts), bases, total,
                                any(not quantizes(numel) for _, numel in slots))

    def cut_index(self, piece: StatePiece, segment: Segment) -> int:
        """The position in :attr:`cut_blocks` of the block whose part the ``cut`` ``segment`` of ``piece`` is."""
        return self.cut_blocks.index((piece.slot, (piece.first + segment.start - piece.start) // BLOCK_SIZE))
