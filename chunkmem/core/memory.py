"""Where chunk buffers get their memory on each tier, and the ledger that counts it.

Every buffer of every chunk takes its memory from the model's :class:`TierMemory` and gives it back
there: device and host buffers from the :class:`~chunkmem.core.block_pool.BlockPool` when the CPU holds
both tiers (else from torch's allocators), disk-tier buffers as regions of the
:class:`~chunkmem.core.disk_tier.DiskTier`'s files. Each allocation is first counted on the
:class:`~chunkmem.core.ledger.TierLedger`, which refuses bytes past a tier's capacity before anything
is allocated.
"""
from __future__ import annotations

import torch

from .block_pool import BlockPool, pool_for_this_machine
from .copy_engine import CopyEngine, engine_for_new_model
from .disk_tier import DiskTier
from .ledger import TierLedger
from .pinned import PinnedHostMemory
from .tiers import Tier, empty_on_tier

PINNED_FAMILIES = ("param", "grad")
"""The host-tier families that cross PCIe every step: pinned on a GPU machine (the parameter shard, read by
each fetch; the gradient, written by each backward). Optimizer state is read where it rests."""
RESTING_FAMILY = "resting"
"""The host copies of parameters resting on disk as their own masters that the backward hands its disk updates
(:meth:`~chunkmem.runtime.executor.ChunkExecutor.copy_of_resting_values`)."""
REUSED_FAMILIES = ("undo", RESTING_FAMILY)
"""Host-tier families taken and given back every step (``step_in_backward``'s undo copies and resting values): on
a GPU machine, where no block pool serves the host tier, kept by size for reuse (pageable)."""


class TierMemory:
    """The device, host and disk memory of one model's chunk buffers (see the module docstring).

    ``ledger`` counts; ``blocks`` (``None`` with CUDA or without the native helper) lends device and host
    memory when the CPU holds both tiers; ``disk`` is the model's disk tier, or ``None`` without one.

    ``copies``: the model's copy engine (:mod:`chunkmem.core.copy_engine`), chosen when the memory is made;
    ``pinned``: with an engine that pins host memory, the exact-size pinned blocks of the
    :data:`PINNED_FAMILIES` on the host tier (:mod:`chunkmem.core.pinned`), else ``None``; ``reused``: with
    it, the kept (unpinned) blocks of the :data:`REUSED_FAMILIES`.

    ``device_block_nbytes`` (bytes; 0: none): the block size of every device-tier buffer the pool lends, set
    when the device tier stages chunks for compute (placement ``cpu`` or ``auto``, or sharded). A chunk
    smaller than the others (a trimmed tail) then stages through the same blocks as the rest instead of
    keeping blocks of a size of its own cached; the ledger counts the bytes the chunk asked for.
    """

    def __init__(self, ledger: TierLedger, blocks: BlockPool | None = None, disk: DiskTier | None = None,
                 copies: CopyEngine | None = None) -> None:
        self.ledger = ledger
        self.blocks = blocks
        self.disk = disk
        self.device_block_nbytes = 0
        self.copies = copies if copies is not None else engine_for_new_model()
        self.pinned = PinnedHostMemory() if self.copies.pins_host else None
        self.reused = PinnedHostMemory(pin=False) if self.copies.pins_host else None

    @staticmethod
    def for_this_machine(capacity: int, host_capacity: int | None = None) -> "TierMemory":
        """A new ledger with the given capacities (bytes), the machine's block pool, no disk tier."""
        return TierMemory(TierLedger(capacity, host_capacity), pool_for_this_machine())

    def take(self, tier: Tier, family: str, numel: int, dtype: torch.dtype, what: str,
             device: torch.device | None = None) -> torch.Tensor | None:
        """Count, then allocate, a flat buffer of ``numel`` elements of ``family`` on ``tier`` (contents
        undefined); on the disk tier nothing is allocated here (the buffer is a file region) and ``None``
        is returned. Past the tier's capacity the ledger raises and nothing changes. ``device``: allocate on
        that device with torch's allocator (a buffer that must sit beside tensors of the caller's: ZeRO-1/2's
        masters and state, on the parameters' device), counted on ``tier`` all the same."""
        nbytes = numel * dtype.itemsize
        self.ledger.reserve(tier, family, nbytes, what)
        if tier is Tier.DISK:
            return None
        try:
            if device is not None:
                return torch.empty(numel, dtype=dtype, device=device)
            if self.pinned is not None and tier is Tier.HOST and family in PINNED_FAMILIES:
                return self.pinned.empty(numel, dtype)
            if self.reused is not None and tier is Tier.HOST and family in REUSED_FAMILIES:
                return self.reused.empty(numel, dtype)
            if self.blocks is None:
                return empty_on_tier(tier, numel, dtype)
            return self.blocks.empty(numel, dtype, self.device_block_nbytes if tier is Tier.DEVICE else 0)
        except BaseException:
            self.ledger.release(tier, family, nbytes)
            raise

    def give_back(self, tier: Tier, family: str, nbytes: int, tensor: torch.Tensor | None) -> None:
        """Return a buffer taken with :meth:`take` (``tensor`` ``None`` on the disk tier)."""
        self.ledger.release(tier, family, nbytes)
        if tensor is None:
            return
        if self.pinned is not None and tier is Tier.HOST and family in PINNED_FAMILIES:
            self.copies.before_host_write(tensor, "host buffer reuse")  # a copy may still read it
            # a step's gradients come back every step; a shard freed is rarely needed again (cuda placement
            # frees the host shard the model was built in once, for good)
            self.pinned.give_back(tensor, keep=family == "grad")
        elif self.reused is not None and tier is Tier.HOST and family in REUSED_FAMILIES:
            self.reused.give_back(tensor)
        elif self.blocks is not None:
            self.blocks.give_back(tensor)

    def fill_storage(self, storage: torch.UntypedStorage, family: str, nbytes: int, what: str) -> torch.Tensor | None:
        """Count ``nbytes`` on the device tier and give the freed (0-byte) ``storage`` that much memory in
        place, so tensors viewing it stay valid. Returns the block pool's token for :meth:`empty_storage`
        (``None`` when torch's allocator resized the storage)."""
        self.ledger.reserve(Tier.DEVICE, family, nbytes, what)
        if self.blocks is not None:
            return self.blocks.lend(storage, max(nbytes, self.device_block_nbytes))
        storage.resize_(nbytes)
        return None

    def empty_storage(self, storage: torch.UntypedStorage, family: str, nbytes: int, lent: torch.Tensor | None) -> None:
        """Take back the memory :meth:`fill_storage` gave ``storage`` (it has 0 bytes again)."""
        if lent is not None:
            self.blocks.take_back(storage, lent)
        else:
            storage.resize_(0)
        self.ledger.release(Tier.DEVICE, family, nbytes)

    def breakdown(self) -> dict[str, dict[str, int]]:
        """Bytes per tier and family (see :meth:`TierLedger.breakdown`; the disk tier listed when there is one)."""
        return self.ledger.breakdown(with_disk=self.disk is not None)
