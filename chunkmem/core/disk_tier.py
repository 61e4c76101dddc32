"""The disk tier of one model: chunk buffers resting in files, read and written through aligned buffers.

Each state family that rests on disk has one file in the model's private scratch directory under
``nvme_path`` (:class:`~chunkmem.storage.disk_io.ScratchSpace`: created with the model, removed with it, at
exit and after an exception). A chunk's buffer of that family is a region of the file at a fixed place
given by the chunk's index; with ``atomic_step`` there are two regions per chunk (two *slots*) and the
buffer's ``disk_slot`` says which one holds the current contents: an optimizer step writes the other
slot and the step commits by switching slots only when every chunk was written on every rank (see
:mod:`chunkmem.optim.disk_step`). Regions start at multiples of :data:`~chunkmem.storage.disk_io.ALIGNMENT`.

All disk I/O goes through the pool of ``buffer_count`` × (families streamed) aligned host buffers of
``buffer_size`` bytes each (pinned only when CUDA exists), counted in the host ledger as the family
``"disk_io"``. Reads and writes run on the I/O worker threads; whole buffers are moved in pieces of
``buffer_size`` bytes.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import numpy
import torch

from ..storage.disk_io import ALIGNMENT, AlignedBufferPool, DiskFile, IOHandle, ScratchSpace, aligned_nbytes
from ..errors import InvalidArgumentError, check_type
from .ledger import TierLedger
from .tiers import Tier

DEFAULT_BUFFER_COUNT = 4
DEFAULT_BUFFER_SIZE = 16 * 2**20  # bytes
PIECE_ALIGNMENT = 2 * ALIGNMENT   # bytes: a piece of a 16-bit and of an fp32 family both start aligned
DISK_IO_FAMILY = "disk_io"
JOURNAL = "journal"  # the old values of fp32 parameters kept while an atomic step runs (see disk_step)


@dataclass(frozen=True)
class DiskRegion:
    """What the disk tier knows of one buffer that may rest on it: its ``family`` (which file), the
    chunk ``index`` (where in the file), its length (``numel`` elements of ``dtype``) and a ``label``
    for error messages. Each of the chunk's slots (see the module docstring) is one region of the file."""

    family: str
    index: int
    numel: int
    dtype: torch.dtype
    label: str

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def check_disk_arguments(offload_optimizer: str | None, offload_param: str | None, nvme_path: object,
                         buffer_count: object, buffer_size: object, atomic_step: object, policy: str,
                         reuse_fp16_shard: bool) -> None:
    """Validate the disk-tier arguments of :class:`~chunkmem.ShardedModelV2` (changing nothing)."""
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value is not None and value != "disk":
            raise InvalidArgumentError(name, value, "None or 'disk'")
    check_type("atomic_step", atomic_step, bool, "True or False")
    check_type("buffer_count", buffer_count, int, "an int >= 1")
    if buffer_count < 1:
        raise InvalidArgumentError("buffer_count", buffer_count, "an int >= 1 (2 or more overlap reads and writes)")
    buffer_size_allowed = f"a whole number of bytes (int), a multiple of {PIECE_ALIGNMENT}"
    check_type("buffer_size", buffer_size, int, buffer_size_allowed)
    if buffer_size < PIECE_ALIGNMENT or buffer_size % PIECE_ALIGNMENT:
        raise InvalidArgumentError("buffer_size", buffer_size, buffer_size_allowed)
    on_disk = offload_optimizer == "disk" or offload_param == "disk"
    if not on_disk:
        if nvme_path is not None:
            raise InvalidArgumentError("nvme_path", nvme_path, "None unless offload_optimizer or offload_param "
                                                               "is 'disk'")
        return
    if nvme_path is None:
        raise InvalidArgumentError("nvme_path", nvme_path, "a directory (str or path) for the disk tier's files, "
                                                           "needed with offload_optimizer/offload_param='disk'")
    check_type("nvme_path", nvme_path, (str, os.PathLike), "a directory (str or os.PathLike)")
    if offload_param == "disk" and reuse_fp16_shard:
        raise InvalidArgumentError("offload_param", offload_param,
                                   "None with reuse_fp16_shard=True (the gradients would live in the parameters' "
                                   "disk files)")
    if policy not in ("cpu", "auto", "static"):
        raise InvalidArgumentError("tensor_placement_policy", policy,
                                   "'cpu', 'auto' or 'static' with the disk tier (under 'cuda' nothing rests "
                                   "off the device)")


class DiskTier:
    """The files, slots and I/O buffers of one model's disk tier (see the module docstring).

    ``file_bytes`` is what the files occupy on disk (regions rounded up to the alignment, both slots
    with ``atomic_step``); the ledger's ``disk`` figures are the buffers' own bytes.
    """

    def __init__(self, nvme_path: str | os.PathLike, buffer_count: int, buffer_size: int, atomic_step: bool,
                 ledger: TierLedger) -> None:
        self.scratch = ScratchSpace(nvme_path)
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.atomic_step = atomic_step
        self.slots = 2 if atomic_step else 1
        self.ledger = ledger
        self._files: dict[str, DiskFile] = {}
        self._regions: dict[str, list[int]] = {}  # bytes of each chunk's region, per family
        self._starts: dict[str, list[int]] = {}   # byte offset of each chunk's first region, per family
        self._slots: dict[str, int] = {}   # regions per chunk of each family
        self._pool: AlignedBufferPool | None = None
        self._fetcher: ThreadPoolExecutor | None = None  # reads parameter chunks for compute, one at a time
        self._fetch_pool: AlignedBufferPool | None = None
        self._fetch_buffer: torch.Tensor | None = None
        self._caller_pool: AlignedBufferPool | None = None  # whole-region reads and writes (see _caller_buffers)

    @property
    def path(self) -> str:
        """The private scratch directory."""
        return self.scratch.path

    @property
    def file_bytes(self) -> int:
        """Bytes the disk tier's files occupy (preallocated)."""
        return self.scratch.bytes_on_disk()

    def close(self) -> None:
        """Remove the files (the model is gone)."""
        self.release_buffers()
        self.scratch.close()

    # ---- files and regions ---------------------------------------------------------------------------

    def reserve_chunks(self, family: str, region_nbytes: list[int], slots: int | None = None) -> None:
        """Make the family's file hold a region of ``region_nbytes[i]`` bytes for chunk ``i`` (0: none, for a
        chunk whose family does not rest on disk) × ``slots`` (default: 2 with ``atomic_step``, else 1),
        preallocated, so that a full disk shows here, before any state changes; once per family. Raises
        :class:`~chunkmem.storage.disk_io.DiskIOError` naming the file."""
        if family in self._regions:
            raise ValueError(f"internal error: {family} regions reserved twice")
        self._add_regions(family, [aligned_nbytes(n) for n in region_nbytes], self.slots if slots is None else slots)

    def add_region(self, family: str, region_nbytes: int) -> None:
        """One more chunk's region of ``region_nbytes`` bytes (one slot), whatever the others' sizes: a
        ``ZeroInitContext`` building onto the disk tier adds each chunk as it opens, and a parameter
        larger than its chunk size gets a chunk of its own size. Preallocated, as :meth:`reserve_chunks`."""
        self._add_regions(family, [aligned_nbytes(region_nbytes)], self._slots.get(family, 1))

    def _add_regions(self, family: str, new: list[int], slots: int) -> None:
        regions, starts = list(self._regions.get(family, [])), list(self._starts.get(family, []))
        for region in new:
            starts.append(starts[-1] + regions[-1] * slots if regions else 0)
            regions.append(region)
        need = starts[-1] + regions[-1] * slots if regions else 0
        if family not in self._files:
            self._files[family] = self.scratch.file(f"{family}.bin", need)
        elif self._files[family].nbytes < need:
            self._files[family].grow(need)
        self._regions[family], self._starts[family], self._slots[family] = regions, starts, slots

    def offset(self, family: str, chunk_index: int, slot: int) -> int:
        """Byte offset of the chunk's region ``slot`` in the family's file."""
        return self._starts[family][chunk_index] + slot * self._regions[family][chunk_index]

    def file(self, family: str) -> DiskFile:
        return self._files[family]

    # ---- I/O buffers ---------------------------------------------------------------------------------

    def buffers(self, families: int, nbytes: int | None = None) -> AlignedBufferPool:
        """The pool of aligned buffers for streaming ``families`` families at once, each of ``nbytes`` bytes
        (default and at least ``buffer_size``: a step that streams whole chunks asks for more); grown if needed,
        held bytes on the host ledger."""
        count = self.buffer_count * families
        nbytes = aligned_nbytes(max(nbytes or 0, self.buffer_size))
        if self._pool is None or self._pool.count < count or self._pool.buffer_nbytes < nbytes:
            if self._pool is not None:
                count, nbytes = max(count, self._pool.count), max(nbytes, self._pool.buffer_nbytes)
            self._release_pool()
            self.ledger.reserve(Tier.HOST, DISK_IO_FAMILY, count * nbytes, "the disk tier's I/O buffers")
            self._pool = AlignedBufferPool(count, nbytes)
        return self._pool

    def _caller_buffers(self) -> AlignedBufferPool:
        """One aligned buffer for whole-region reads and writes on the caller's thread (:meth:`read_all`,
        :meth:`store`), apart from the streamed step's pool: a step streamed during the backward may hold
        every buffer of that one while the backward reads a sharded chunk's parameters from disk (on the host
        ledger, made on first use)."""
        if self._caller_pool is None:
            self.ledger.reserve(Tier.HOST, DISK_IO_FAMILY, aligned_nbytes(self.buffer_size),
                                "the disk tier's in-line buffer")
            self._caller_pool = AlignedBufferPool(1, self.buffer_size)
        return self._caller_pool

    def release_buffers(self) -> None:
        """Give back the I/O buffers and stop the fetch thread (their bytes leave the host ledger)."""
        self._release_pool()
        if self._caller_pool is not None:
            self.ledger.release(Tier.HOST, DISK_IO_FAMILY, aligned_nbytes(self.buffer_size))
            self._caller_pool = None
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
            self.ledger.release(Tier.HOST, DISK_IO_FAMILY, self._fetch_pool.total_nbytes)
            self._fetcher = self._fetch_pool = self._fetch_buffer = None

    def _release_pool(self) -> None:
        if self._pool is not None:
            self.ledger.release(Tier.HOST, DISK_IO_FAMILY, self._pool.count * self._pool.buffer_nbytes)
            self._pool = None

    def start_read_all(self, region: DiskRegion, slot: int, out: torch.Tensor) -> "Future[None]":
        """Start copying ``region``'s ``slot`` into ``out`` on the fetch thread (through its own aligned
        buffer of ``buffer_size`` bytes, on the host ledger); the future's result raises a failed read's
        :class:`~chunkmem.storage.disk_io.DiskIOError`."""
        if self._fetcher is None:
            self.ledger.reserve(Tier.HOST, DISK_IO_FAMILY, aligned_nbytes(self.buffer_size),
                                "the disk tier's fetch buffer")
            self._fetch_pool = AlignedBufferPool(1, self.buffer_size)
            self._fetch_buffer = self._fetch_pool.take()
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="chunkmem-disk-fetch")
        self.ledger.count_disk(read=region.nbytes)  # here, not on the thread: the counters are the caller's
        return self._fetcher.submit(self._copy_into, region, slot, out, self._fetch_buffer)

    def _copy_into(self, region: DiskRegion, slot: int, out: torch.Tensor, staging: torch.Tensor) -> None:
        """Read ``region``'s ``slot`` piece by piece through ``staging`` into ``out`` (bytes already counted)."""
        for start, end in self.pieces(region.numel, region.element_size):
            self.read_piece(region, slot, start, end, staging, count=False).wait()
            out[start:end].copy_(typed_view(staging, region.dtype, end - start))

    # ---- whole-buffer reads and writes (checkpoints, setup, accessors) -------------------------------

    def pieces(self, numel: int, element_size: int) -> Iterable[tuple[int, int]]:
        """``(start, end)`` element ranges of at most ``buffer_size`` bytes covering ``numel`` elements."""
        step = self.buffer_size // element_size
        return ((a, min(a + step, numel)) for a in range(0, numel, step))

    def read_piece(self, region: DiskRegion, slot: int, start: int, end: int, into: torch.Tensor,
                   count: bool = True) -> IOHandle:
        """Start reading elements ``[start, end)`` of ``region``'s ``slot`` into the aligned uint8 buffer
        ``into`` (``count``: add the bytes to the ledger's disk reads)."""
        esize = region.element_size
        nbytes = aligned_nbytes((end - start) * esize)
        offset = self.offset(region.family, region.index, slot) + start * esize
        if count:
            self.ledger.count_disk(read=(end - start) * esize)
        return self._files[region.family].read_into(into[:nbytes], offset, region.label)

    def write_piece(self, region: DiskRegion, slot: int, start: int, end: int, data: torch.Tensor) -> IOHandle:
        """Start writing the aligned uint8 buffer ``data`` (elements ``[start, end)`` of ``region``) into
        ``slot``."""
        esize = region.element_size
        nbytes = aligned_nbytes((end - start) * esize)
        offset = self.offset(region.family, region.index, slot) + start * esize
        self.ledger.count_disk(written=(end - start) * esize)
        return self._files[region.family].write_from(data[:nbytes], offset, region.label)

    def load(self, region: DiskRegion, slot: int) -> torch.Tensor:
        """A new host tensor holding ``region``'s ``slot`` (read piece by piece)."""
        out = torch.empty(region.numel, dtype=region.dtype)
        self.read_all(region, slot, out)
        return out

    def read_all(self, region: DiskRegion, slot: int, out: torch.Tensor) -> None:
        """Copy ``region``'s ``slot`` into ``out`` (``region.numel`` elements, any device), piece by piece."""
        pool = self._caller_buffers()
        staging = pool.take()
        self.ledger.count_disk(read=region.nbytes)
        try:
            self._copy_into(region, slot, out, staging)
        finally:
            pool.give_back(staging)

    def mapped(self, region: DiskRegion, slot: int) -> torch.Tensor:
        """``region``'s ``slot`` as a read-only CPU tensor mapped from its file (pages are read as they are
        touched and can be dropped again: a checkpoint streams through it without holding it)."""
        offset = self.offset(region.family, region.index, slot)
        raw = numpy.memmap(self._files[region.family].path, dtype=numpy.uint8, mode="c", offset=offset,
                           shape=(region.nbytes,))
        return torch.from_numpy(raw).view(region.dtype)

    def store(self, region: DiskRegion, slot: int, values: torch.Tensor | None) -> None:
        """Write ``values`` (``region.numel`` elements; ``None``: zeros) into ``region``'s ``slot``, piece
        by piece, waiting for the writes."""
        pool = self._caller_buffers()
        staging = pool.take()
        try:
            if values is None:
                staging.zero_()
            for start, end in self.pieces(region.numel, region.element_size):
                if values is not None:
                    typed_view(staging, region.dtype, end - start).copy_(values[start:end])
                self.write_piece(region, slot, start, end, staging).wait()
        finally:
            pool.give_back(staging)


def typed_view(raw: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of the uint8 buffer ``raw`` seen as ``dtype``."""
    size = dtype.itemsize
    return raw[:numel * size].view(dtype)
