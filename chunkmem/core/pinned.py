"""Pinned host buffers at their exact size, under a budget, kept for reuse.

On a GPU machine the host-tier buffers that cross PCIe every step (a chunk's parameter shard and its
gradient) are page-locked, so the copy engines read and write them directly and asynchronously. torch's
``pin_memory=True`` rounds each allocation up to a power of two (a 130 MiB buffer pins 256 MiB) and keeps
freed buffers pinned in its own cache; here every block is an anonymous mapping of exactly the buffer's
size, registered with CUDA (``cudaHostRegister``) once, and kept by size for the next buffer of that size
(a step's gradients reuse the last step's blocks instead of faulting in new pages).

The pinned bytes of the process are bounded by a budget (:func:`set_pinned_memory_budget`,
``CHUNKMEM_PINNED_MEMORY``; default half of the memory available when the first block is pinned). A buffer
past the budget is ordinary pageable memory: its copies are staged (slower, the same bytes), and
``fallback_bytes`` counts it. Blocks are unregistered when their model's memory is collected.
"""
from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from collections import defaultdict

import torch

from .tiers import host_memory_available, parse_size

PINNED_MEMORY_ENV = "CHUNKMEM_PINNED_MEMORY"

_budget_override: int | None = None
_lock = threading.Lock()
_process_pinned = 0  # bytes registered by every PinnedHostMemory of the process
_default_budget: int | None = None


def set_pinned_memory_budget(nbytes: int | str | None) -> None:
    """Set the most host memory (bytes, or a size such as ``"16GiB"``) chunkmem pins in this process;
    ``None`` restores the default (``CHUNKMEM_PINNED_MEMORY`` if set, else half of the memory available
    when the first block is pinned). Blocks already pinned stay. A refused value changes nothing."""
    global _budget_override
    _budget_override = None if nbytes is None else parse_size(nbytes, "nbytes", minimum=0)


def pinned_memory_budget() -> int:
    """The pinned-memory budget in bytes (see :func:`set_pinned_memory_budget`)."""
    global _default_budget
    if _budget_override is not None:
        return _budget_override
    env = os.environ.get(PINNED_MEMORY_ENV)
    if env:
        return parse_size(env, PINNED_MEMORY_ENV, minimum=0)
    if _default_budget is None:
        _default_budget = host_memory_available() // 2
    return _default_budget


def process_pinned_bytes() -> int:
    """Bytes chunkmem has pinned in this process now (every model's blocks, in use or cached)."""
    return _process_pinned


def _register(ptr: int, nbytes: int) -> bool:
    error = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    return int(error) == 0


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class PinnedHostMemory:
    """One model's pinned host blocks (module docstring). ``pinned_bytes``: registered now (in use or
    cached); ``in_use_bytes``: lent out now; ``fallback_bytes``: pageable buffers lent past the budget now.

    With ``pin=False`` the same cache of exact-size blocks without registering them (and without a budget):
    host buffers a step takes and gives back every time (``step_in_backward``'s undo copies) reuse their
    pages instead of faulting in new ones each step."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._blocks: dict[int, int] = {}  # data_ptr -> bytes of every registered (or, unpinned, kept) block
        self.pinned_bytes = 0
        self.in_use_bytes = 0
        self.fallback_bytes = 0
        self._warned = False
        if pin:
            weakref.finalize(self, _unregister_all, self._blocks)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``numel`` elements: pinned if the budget allows, else pageable."""
        global _process_pinned
        nbytes = numel * dtype.itemsize
        cached = self._free.get(nbytes)
        if cached:
            self.in_use_bytes += nbytes
            return cached.pop().view(dtype)
        if not self.pin:
            block = torch.empty(nbytes, dtype=torch.uint8)
            self._blocks[block.data_ptr()] = nbytes
            self.in_use_bytes += nbytes
            return block.view(dtype)
        with _lock:
            fits = nbytes > 0 and _process_pinned + nbytes <= pinned_memory_budget()
            if fits:
                _process_pinned += nbytes
        if fits:
            block = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
            if _register(block.data_ptr(), nbytes):
                self._blocks[block.data_ptr()] = nbytes
                self.pinned_bytes += nbytes
                self.in_use_bytes += nbytes
                return block.view(dtype)
            with _lock:
                _process_pinned -= nbytes
        self._fall_back(nbytes)
        return torch.empty(numel, dtype=dtype)

    def _fall_back(self, nbytes: int) -> None:
        self.fallback_bytes += nbytes
        if not self._warned and nbytes:
            self._warned = True
            warnings.warn(f"chunkmem: the pinned-memory budget ({pinned_memory_budget()} bytes, "
                          f"{PINNED_MEMORY_ENV} or chunkmem.set_pinned_memory_budget) is spent: further host "
                          f"buffers are pageable, and their copies to and from the GPU are staged and slower",
                          RuntimeWarning, stacklevel=4)

    def give_back(self, tensor: torch.Tensor, keep: bool = True) -> None:
        """Keep a pinned block for the next buffer of its size (``keep``; else unregister it now); a pageable
        one is simply dropped. Whoever gives a block back has waited for the copies that used it."""
        nbytes = tensor.numel() * tensor.element_size()
        ptr = tensor.data_ptr()
        if ptr not in self._blocks or nbytes != self._blocks[ptr]:
            self.fallback_bytes -= nbytes
            return
        self.in_use_bytes -= nbytes
        if keep:
            self._free[nbytes].append(tensor.view(torch.uint8))
        else:
            self._forget(ptr)

    def release_cached(self) -> None:
        """Unregister and drop the blocks kept for reuse (those in use stay)."""
        for blocks in self._free.values():
            for block in blocks:
                self._forget(block.data_ptr())
        self._free.clear()

    def _forget(self, ptr: int) -> None:
        """Stop keeping the block at ``ptr`` (unregistered when pinned; its mapping goes with its last tensor)."""
        global _process_pinned
        nbytes = self._blocks.pop(ptr)
        if self.pin:
            _unregister(ptr)
            self.pinned_bytes -= nbytes
            with _lock:
                _process_pinned -= nbytes

    def stats(self) -> dict[str, int]:
        return {"pinned_bytes": self.pinned_bytes, "pinned_in_use_bytes": self.in_use_bytes,
                "pinned_fallback_bytes": self.fallback_bytes, "pinned_budget_bytes": pinned_memory_budget(),
                "process_pinned_bytes": _process_pinned}


def _unregister_all(blocks: dict[int, int]) -> None:
    """The model's memory is gone: unregister its blocks (their mappings go with their last tensor)."""
    global _process_pinned
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001  (at interpreter exit CUDA may be gone already)
        pass
    for ptr, nbytes in list(blocks.items()):
        try:
            _unregister(ptr)
        except Exception:  # noqa: BLE001
            pass
        with _lock:
            _process_pinned -= nbytes
    blocks.clear()
