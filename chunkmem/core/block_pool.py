"""Chunk-sized CPU memory kept and reused, for a machine where the CPU holds both tiers (no CUDA).

On a GPU machine the device copies of chunks come from CUDA's caching allocator and host buffers
from pinned memory, which CUDA also caches. Without CUDA every chunk buffer is ordinary CPU memory,
and left to ``malloc`` the buffers of one chunk's size that come and go many times a step (device
copies, gradient staging, each step's gradients) land in glibc's heap: the first free of a block that
size raises glibc's mmap threshold past it. The activations allocated in between then split the
freed holes, so the heap keeps growing; on the 49M-parameter GPT of
``benchmarks/wrapper_overhead.py`` under placement ``cpu`` that made peak RSS 1.18x plain PyTorch's
instead of 1.10x.

A :class:`BlockPool` maps every block with its own anonymous ``mmap``, outside malloc's heap, and
keeps a freed block for the next buffer of the same byte size, as CUDA's caching allocator does for
GPU memory. The process then holds at most the blocks the model had in use at one time, and the heap
holds only what the model's own computation allocates. One pool serves one model (its
:class:`~chunkmem.core.ledger.TierLedger`); its blocks are unmapped when the model is gone. Only sizes that
a live chunk uses are kept (chunks say so with :meth:`BlockPool.use_sizes`), so the blocks of chunks
replaced by a re-pack are unmapped, not stranded.

Device copies of parameters need one more step: parameters (and views autograd saved in forward)
view the device copy's storage, so the storage object must stay the same while its memory comes and
goes, and a released copy must stay a 0-byte storage (using it then fails loudly). A small native
helper (``csrc/storage_exchange.cpp``, built against the installed torch on first use and cached)
exchanges the memory of two storages in place: :meth:`BlockPool.lend` moves a cached block's memory
into the device copy's storage, :meth:`BlockPool.take_back` moves it out again.

``CHUNKMEM_DISABLE_BLOCK_POOL=1`` (read when a model is wrapped) turns the pool off, and so does a
failed build of the helper (no compiler: reported once with a warning). Buffers then come from torch's
allocator, with the same values and more resident memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections import Counter, defaultdict
from collections.abc import Iterable

import torch

from .native_build import CSRC, LoadedOnce, env_flag, load_library

DISABLE_ENV = "CHUNKMEM_DISABLE_BLOCK_POOL"
SOURCE = CSRC / "storage_exchange.cpp"
ABI_VERSION = 1


def _storage_users(tensor: torch.Tensor) -> int:
    """Tensors sharing ``tensor``'s storage, ``tensor`` included."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1  # minus the temporary storage


class BlockPool:
    """Chunk buffers of CPU memory, each an anonymous mapping, reused by byte size once given back.

    ``cached_bytes``: bytes of the blocks waiting in the pool for reuse; ``blocks_mapped``: how many
    mappings the pool has made (a count that stops growing once the pool has what the model needs).
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._chunks_using: Counter[int] = Counter()  # byte size -> live chunks with a buffer that size
        self.cached_bytes = 0
        self.blocks_mapped = 0

    def use_sizes(self, sizes: Iterable[int]) -> None:
        """A new chunk has buffers of these byte sizes: keep blocks of them for reuse."""
        for nbytes in set(sizes):
            self._chunks_using[nbytes] += 1

    def stop_using_sizes(self, sizes: Iterable[int]) -> None:
        """A chunk with buffers of these byte sizes is gone; sizes no live chunk uses are unmapped."""
        for nbytes in set(sizes):
            self._chunks_using[nbytes] -= 1
            if self._chunks_using[nbytes] <= 0:
                del self._chunks_using[nbytes]
                self.cached_bytes -= nbytes * len(self._free.pop(nbytes, ()))

    def cached_blocks(self, nbytes: int) -> int:
        """How many freed blocks of ``nbytes`` bytes the pool keeps for reuse."""
        return len(self._free.get(nbytes, ()))

    def empty(self, numel: int, dtype: torch.dtype, block_nbytes: int = 0) -> torch.Tensor:
        """An uninitialised flat tensor of ``numel`` elements of ``dtype`` at the start of a block of
        ``max(numel * itemsize, block_nbytes)`` bytes: a cached block of that byte size if there is one,
        else a new mapping."""
        nbytes = numel * dtype.itemsize
        return self._take(max(nbytes, block_nbytes))[:nbytes].view(dtype)

    def give_back(self, tensor: torch.Tensor) -> None:
        """Keep the memory of ``tensor``'s block for reuse, unless no live chunk uses its size or something
        else still views it (then it is unmapped when the last view goes). The caller must drop ``tensor``."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or self._chunks_using[nbytes] == 0 or _storage_users(tensor) > 1:
            return
        block = torch.empty(0, dtype=torch.uint8).set_(storage)  # the whole block, not just the view
        self._free[nbytes].append(block)
        self.cached_bytes += nbytes

    def lend(self, storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
        """Give ``storage`` (a released device copy: 0 bytes) the memory of a block of ``nbytes``; the
        returned tensor now holds the 0 bytes and must go to :meth:`take_back`."""
        holder = self._take(nbytes)
        _exchange(storage, holder.untyped_storage())
        return holder

    def take_back(self, storage: torch.UntypedStorage, holder: torch.Tensor) -> None:
        """Return ``storage``'s memory to the pool, leaving ``storage`` with 0 bytes again (``holder``:
        what :meth:`lend` returned)."""
        _exchange(storage, holder.untyped_storage())
        self.give_back(holder)

    def _take(self, nbytes: int) -> torch.Tensor:
        cached = self._free.get(nbytes)
        if cached:
            self.cached_bytes -= nbytes
            return cached.pop()
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        self.blocks_mapped += 1
        # Private, not mmap.mmap's default MAP_SHARED: shared anonymous memory is shmem, which a fork would
        # share instead of copying on write.
        return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)

    def clear(self) -> None:
        """Unmap the cached blocks (those in use stay)."""
        self._free.clear()
        self.cached_bytes = 0


def pool_for_this_machine() -> BlockPool | None:
    """A new pool when the CPU holds both tiers (no CUDA), the pool is not disabled and the native
    helper is available, else ``None``."""
    if torch.cuda.is_available() or env_flag(DISABLE_ENV):
        return None
    if not hasattr(torch._C, "_storage_Use_Count") or HELPER.get(stacklevel=4) is None:
        return None
    return BlockPool()


def load_error() -> str | None:
    """Why the native helper is unavailable (after a model was wrapped), else ``None``."""
    return HELPER.error


def _load() -> ctypes.CDLL:
    torch_dir = os.path.dirname(torch.__file__)
    flags = ("-O2", "-std=c++17", "-shared", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{os.path.join(torch_dir, 'include')}", f"-L{os.path.join(torch_dir, 'lib')}", "-lc10",
             f"-Wl,-rpath,{os.path.join(torch_dir, 'lib')}",
             f"-DCHUNKMEM_TORCH_VERSION={torch.__version__}")  # unused by the source: another torch, another build
    lib, path, _seconds = load_library(SOURCE, flags, "storage_exchange")
    if lib.chunkmem_storage_exchange_abi() != ABI_VERSION:
        raise RuntimeError(f"{path} has another ABI version")
    lib.chunkmem_exchange_storage_memory.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    return lib


HELPER = LoadedOnce(_load, "chunkmem: the block pool is unavailable, chunk buffers come from torch's allocator "
                           "(same values, more resident memory; {error})")


def _exchange(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    if HELPER.value.chunkmem_exchange_storage_memory(a._cdata, b._cdata) != 0:
        raise RuntimeError("chunkmem: cannot exchange the memory of these storages (two distinct CPU storages "
                           "are needed)")
