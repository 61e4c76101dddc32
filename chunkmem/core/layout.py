"""Packing parameters into chunks, and the search for a chunk size that wastes little padding.

Pure functions over element counts: no tensors, so they are cheap to test and to reason about.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Sequence

ALIGN_ELEMENTS = 64
DEFAULT_MIN_CHUNK_BYTES = 4 * 2**20
SEARCH_CANDIDATES = 64
# Bytes one element of a trainable chunk holds at rest under Adam: the parameter and its gradient (16 or
# 32 bits each), the fp32 master of a 16-bit chunk, and the two fp32 moments (16 either way).
RESTING_BYTES_PER_ELEMENT = 16
UNSTAGED_PADDING_TOLERANCE = 0.01
"""With nothing staged on the device tier, the chunk size search takes the largest size whose padding is
within this fraction of the parameters' resting bytes of the least padding."""


def pack(numels: Sequence[int], keys: Sequence[Hashable], chunk_numel: int) -> list[list[int]]:
    """Assign parameters (given in packing order) to chunks of ``chunk_numel`` elements.

    Greedy in order: a parameter goes into the open chunk if it fits there and has the same key,
    otherwise it opens a new chunk. Parameters never straddle chunks and chunks never mix keys.
    Returns the parameter indices of each chunk.
    """
    chunks: list[list[int]] = []
    used = chunk_numel + 1
    open_key: Hashable = object()
    for i, (numel, key) in enumerate(zip(numels, keys)):
        if numel > chunk_numel:
            raise ValueError(f"parameter {i} has {numel} elements, more than a chunk's {chunk_numel}")
        if key != open_key or used + numel > chunk_numel:
            chunks.append([])
            used, open_key = 0, key
        chunks[-1].append(i)
        used += numel
    return chunks


def chunk_sizes(groups: Sequence[Sequence[int]], numels: Sequence[int], keys: Sequence[Hashable], chunk_numel: int,
                world: int = 1) -> list[int]:
    """Elements of each chunk of ``groups`` (what :func:`pack` returned): ``chunk_numel``, except for the
    last chunk of each run of one key (a tail: no parameter follows it there), which holds only its
    parameters, rounded up to whole 64-element groups in each of ``world`` shards. Padding a tail to
    ``chunk_numel`` would cost its share of every family on every tier (16 bytes an element under Adam)
    and buy nothing: the next parameter opens another chunk either way."""
    sizes = []
    for n, group in enumerate(groups):
        tail = n + 1 == len(groups) or keys[groups[n + 1][0]] != keys[group[0]]
        used = sum(numels[i] for i in group)
        sizes.append(min(chunk_numel, aligned_numel(used, world)) if tail else chunk_numel)
    return sizes


def padding_elements(numels: Sequence[int], keys: Sequence[Hashable], chunk_numel: int) -> int:
    """Elements of all chunks not occupied by a parameter when packed with :func:`pack` and sized with
    :func:`chunk_sizes` (one rank)."""
    return sum(chunk_sizes(pack(numels, keys, chunk_numel), numels, keys, chunk_numel)) - sum(numels)


def search_chunk_numel(numels: Sequence[int], keys: Sequence[Hashable], element_size: int,
                       min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES, staged_buffers: int = 0) -> int:
    """The chunk size (elements) that costs the fewest bytes: the padding of all chunks at rest
    (:data:`RESTING_BYTES_PER_ELEMENT` an element) plus ``staged_buffers`` chunk-sized buffers of
    ``element_size``-byte elements that a step holds on the device tier besides the chunks resting there
    (see :func:`staged_buffers`). With none it is the size that wastes the fewest padding elements.

    Candidates run from the smallest size allowed (the largest parameter, and at least
    ``min_chunk_bytes`` unless the whole model is smaller) up to twice that, in 64 steps, each a
    multiple of 64 elements. Ties go to the smaller size, which gives the placement finer grain. With
    nothing staged, grain buys nothing: the largest size whose padding is within
    :data:`UNSTAGED_PADDING_TOLERANCE` of the parameters' resting bytes of the least is taken instead
    (fewer chunks: fewer hook and kernel calls per step).
    """
    if not numels:
        return ALIGN_ELEMENTS
    largest = max(numels)
    floor_numel = min(max(min_chunk_bytes // element_size, 1), sum(numels))
    lower = aligned_numel(max(largest, floor_numel))
    step = aligned_numel(max(lower // SEARCH_CANDIDATES, 1))
    candidates = [lower + k * step for k in range(SEARCH_CANDIDATES + 1)]
    costs = [padding_elements(numels, keys, c) * RESTING_BYTES_PER_ELEMENT + staged_buffers * c * element_size
             for c in candidates]
    least = min(costs)
    if staged_buffers:
        return candidates[costs.index(least)]
    slack = UNSTAGED_PADDING_TOLERANCE * sum(numels) * RESTING_BYTES_PER_ELEMENT
    return max(c for c, cost in zip(candidates, costs) if cost <= least + slack)


def staged_buffers(placement: str, sharded: bool) -> int:
    """Chunk-sized buffers a step holds on the device tier besides the chunks resting there: none when
    every chunk rests there whole (placement ``"cuda"``, one rank), else two (a parameter copy fetched or
    gathered for compute, and a gradient staging buffer)."""
    return 0 if placement == "cuda" and not sharded else 2


def part_in_shard(offset: int, numel: int, shard_offset: int, shard_numel: int) -> tuple[int, int] | None:
    """The elements ``(start, end)`` of a parameter at ``offset`` of ``numel`` elements in its chunk (0 =
    its first element) that lie in the shard ``[shard_offset, shard_offset + shard_numel)`` of that chunk,
    or ``None`` when none do (both chunk engines shard a chunk into equal contiguous ranges)."""
    start = max(offset, shard_offset)
    end = min(offset + numel, shard_offset + shard_numel)
    return (start - offset, end - offset) if start < end else None


def join_runs(pieces: Iterable[tuple[int, int, Hashable]]) -> list[tuple[int, int, Hashable]]:
    """``(start, end, key)`` pieces of a shard (elements, in increasing order) joined into maximal runs:
    a piece that starts where the run before it ends and has its key extends that run. Both optimizers
    update a shard per run of parameters that are trainable now (one kernel call per run)."""
    runs: list[tuple[int, int, Hashable]] = []
    for start, end, key in pieces:
        if runs and runs[-1][1] == start and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], end, key)
        else:
            runs.append((start, end, key))
    return runs


def aligned_numel(numel: int, world: int = 1) -> int:
    """``numel`` rounded up to whole 64-element groups in each of ``world`` equal shards (elements)."""
    unit = ALIGN_ELEMENTS * world
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class ChunkLayout:
    """Which parameters go into which chunk, settled once when a model is wrapped.

    ``entries`` are ``(name, parameter, trainable)`` in packing order (the parameters of the kind, trainable
    or frozen at wrapping time, that comes first in ``named_parameters()``, then those of the other kind,
    each in that order); ``groups`` lists
    the entry indices of each chunk; chunk ``i`` holds ``numels[i]`` elements of ``element_size`` bytes (this
    rank's share is ``numels[i] // world``): ``chunk_numel`` (the chunk size), except that the last chunk of
    each kind holds only its parameters (:func:`chunk_sizes`). Chunks never mix trainable and frozen parameters, so
    a frozen chunk has no gradient or optimizer state; optimizer param groups may share a chunk (the
    update runs per contiguous range of one group). ``replicated`` (per chunk; empty: none) marks the
    chunks of persistent parameters: whole on every rank of a sharded model, never gathered, their
    gradients all-reduced (``persistence_threshold``); they never mix with sharded ones.
    """

    entries: tuple[tuple[str, Any, bool], ...]
    groups: tuple[tuple[int, ...], ...]
    chunk_numel: int
    element_size: int
    numels: tuple[int, ...]
    replicated: tuple[bool, ...] = ()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a chunk of the full size ``chunk_numel`` (all ranks' shards): the largest chunk."""
        return self.chunk_numel * self.element_size

    @property
    def num_chunks(self) -> int:
        return len(self.groups)

    def trainable(self, chunk_index: int) -> bool:
        return self.entries[self.groups[chunk_index][0]][2]

    def is_replicated(self, chunk_index: int) -> bool:
        """Whether the chunk is whole on every rank (persistent parameters)."""
        return bool(self.replicated) and self.replicated[chunk_index]

    def shard_numel(self, chunk_index: int, world: int) -> int:
        """Elements of the chunk one rank of ``world`` keeps (all of them when replicated)."""
        numel = self.numels[chunk_index]
        return numel if self.is_replicated(chunk_index) else numel // world

    def shard_bytes(self, chunk_index: int, world: int) -> int:
        """Bytes of the chunk's parameters one rank of ``world`` keeps (all of them when replicated)."""
        return self.shard_numel(chunk_index, world) * self.element_size

    def chunk_of_param(self) -> dict[int, int]:
        """``id(parameter)`` -> the index of its chunk."""
        return {id(self.entries[i][1]): c for c, group in enumerate(self.groups) for i in group}


def plan_layout(named: Sequence[tuple[str, Any]], trainable: Sequence[bool], chunk_numel: int,
                element_size: int, persistent: Sequence[bool] | None = None, world: int = 1,
                trim_tails: bool = True) -> ChunkLayout:
    """The layout of ``named`` parameters (``trainable[i]`` for each): the parameters of the kind that
    comes first, then the others, each kind in the given order, packed with :func:`pack`. With
    ``persistent`` (per parameter), each kind's persistent parameters come after its others, in chunks
    of their own (``ChunkLayout.replicated``). Each kind's last chunk is trimmed to its parameters
    (:func:`chunk_sizes`, aligned for ``world`` shards) unless ``trim_tails`` is false (every chunk
    ``chunk_numel`` elements: the chunks a ``ZeroInitContext`` built at a given size, reused as they are)."""
    first = bool(trainable[0]) if trainable else True
    kept = persistent if persistent is not None else [False] * len(named)
    order = sorted(range(len(named)), key=lambda i: (bool(trainable[i]) != first, bool(kept[i])))
    entries = tuple((named[i][0], named[i][1], bool(trainable[i])) for i in order)
    keys = [(bool(trainable[i]), bool(kept[i])) for i in order]
    numels = [p.numel() for _, p, _ in entries]
    groups = pack(numels, keys, chunk_numel)
    sizes = chunk_sizes(groups, numels, keys, chunk_numel, world) if trim_tails else [chunk_numel] * len(groups)
    replicated = tuple(keys[g[0]][1] for g in groups) if any(kept) else ()
    return ChunkLayout(entries, tuple(tuple(g) for g in groups), chunk_numel, element_size, tuple(sizes),
                       replicated)
