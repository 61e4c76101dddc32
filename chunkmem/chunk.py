"""A chunk: one fixed-size flat buffer per state family, holding a run of whole parameters.

Every state family of a chunk (16-bit or fp32 ``param``, ``grad``, fp32 ``master``, ``exp_avg``,
``exp_avg_sq``) has the same length and layout, so a parameter's slot is one (chunk, offset, numel) for
all of them and the optimizer updates a chunk with one call over flat buffers.

The ``param`` family is special: parameters are views (``param.data``) into its device-tier buffer,
whose storage is freed (0 bytes) when the chunk is not resident and given memory again, in place,
when it is fetched. Views made by autograd during forward stay valid through such a round trip. When
the CPU holds both tiers, every family's memory comes from the model's
:class:`~chunkmem.block_pool.BlockPool`, else from torch's allocators (the storage is then resized).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .collectives import SINGLE_PROCESS, ShardGroup
from .ledger import TierLedger
from .tiers import Tier, device_of_tier, empty_on_tier

PARAM = "param"
GRAD = "grad"
GRAD_STAGING = "grad_staging"
MASTER = "master"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
OPTIM_FAMILIES = (MASTER, EXP_AVG, EXP_AVG_SQ)


@dataclass(frozen=True)
class ChunkKey:
    """What all parameters of one chunk share: trainability and optimizer param-group index."""

    trainable: bool
    group: int = 0


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives: ``numel`` elements from ``offset`` (elements) in ``chunk``."""

    param: nn.Parameter
    name: str
    chunk: "Chunk"
    offset: int
    numel: int
    shape: torch.Size
    index_in_chunk: int = 0

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's slice of a flat buffer of the chunk, shaped like the parameter."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


class FlatBuffer:
    """One state family of one chunk: a flat buffer on one tier at a time, its bytes on the ledger."""

    def __init__(self, family: str, numel: int, dtype: torch.dtype, ledger: TierLedger, owner: str) -> None:
        self.family = family
        self.numel = numel
        self.dtype = dtype
        self.ledger = ledger
        self.owner = owner
        self.tensor: torch.Tensor | None = None
        self.tier: Tier | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer when allocated."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def allocated(self) -> bool:
        return self.tensor is not None

    def allocate(self, tier: Tier, zero: bool = False) -> torch.Tensor:
        """Allocate the buffer on ``tier`` (zero-filled if ``zero``); it must not be allocated yet."""
        assert self.tensor is None, f"{self.owner}.{self.family} already allocated"
        self.ledger.reserve(tier, self.family, self.nbytes, f"{self.owner}.{self.family}")
        self.tensor = self._empty(tier)
        if zero:
            self.tensor.zero_()
        self.tier = tier
        return self.tensor

    def move_to(self, tier: Tier) -> None:
        """Copy the buffer into a new buffer on ``tier`` and free the old one."""
        assert self.tensor is not None
        if tier is self.tier:
            return
        old, old_tier = self.tensor, self.tier
        self.ledger.reserve(tier, self.family, self.nbytes, f"{self.owner}.{self.family}")
        new = self._empty(tier)
        new.copy_(old)
        self.ledger.count_move(tier, self.nbytes)
        self.tensor, self.tier = new, tier
        self.ledger.release(old_tier, self.family, self.nbytes)
        self._give_back(old)

    def free(self) -> None:
        if self.tensor is not None:
            self.ledger.release(self.tier, self.family, self.nbytes)
            old, self.tensor, self.tier = self.tensor, None, None
            self._give_back(old)

    def _empty(self, tier: Tier) -> torch.Tensor:
        if self.ledger.blocks is not None:
            return self.ledger.blocks.empty(self.numel, self.dtype)
        return empty_on_tier(tier, self.numel, self.dtype)

    def _give_back(self, tensor: torch.Tensor) -> None:
        if self.ledger.blocks is not None:
            self.ledger.blocks.give_back(tensor)


class ParamBuffer:
    """The ``param`` family of a chunk: a full device-tier copy that parameters view, and this rank's shard.

    ``device`` holds all ``numel`` elements (gathered from every rank's shard when the chunk is
    sharded); its storage is freed (0 bytes) when the chunk is not resident. ``shard`` holds this rank's
    ``shard_numel`` elements on the host tier, or on the device tier when the chunk is sharded and rests
    there (with one rank the shard is the whole chunk, and a chunk resting on the device keeps only its
    full copy). ``device_valid`` / ``shard_valid`` say which copies hold the current contents;
    ``holds_grads`` says the contents are gradients (``reuse_fp16_shard``), not values. When sharded,
    parameters change only through the shard, so the shard is always current and the full copy is
    either a gathered copy of it or invalid.
    """

    def __init__(self, numel: int, dtype: torch.dtype, ledger: TierLedger, owner: str,
                 shards: ShardGroup = SINGLE_PROCESS) -> None:
        self.numel = numel
        self.dtype = dtype
        self.ledger = ledger
        self.owner = owner
        self.shards = shards
        self.shard_numel = numel // shards.world
        self.shard_offset = shards.rank * self.shard_numel
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.device = torch.empty(numel, dtype=dtype, device=device_of_tier(Tier.DEVICE))
        self.device.untyped_storage().resize_(0)
        self._lent: torch.Tensor | None = None  # with a block pool: holds the 0 bytes while memory is lent
        self.device_valid = False
        self.shard = FlatBuffer(PARAM, self.shard_numel, dtype, ledger, owner)
        self.shard_valid = False
        self.holds_grads = False

    @property
    def sharded(self) -> bool:
        return self.shards.sharded

    @property
    def device_allocated(self) -> bool:
        return self.device.untyped_storage().nbytes() > 0

    def own_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a full-length flat tensor."""
        return full[self.shard_offset:self.shard_offset + self.shard_numel]

    def allocate_device(self) -> None:
        """Give the device copy its memory back (contents undefined until written)."""
        if not self.device_allocated:
            self.ledger.reserve(Tier.DEVICE, PARAM, self.nbytes, f"{self.owner}.{PARAM}")
            if self.ledger.blocks is not None:
                self._lent = self.ledger.blocks.lend(self.device.untyped_storage(), self.nbytes)
            else:
                self.device.untyped_storage().resize_(self.nbytes)

    def fetch_to_device(self) -> None:
        """Make the full device copy current: a copy of the shard, or a gather of every rank's shard."""
        if self.device_valid:
            return
        assert self.shard_valid, f"{self.owner}: no valid copy of the parameters"
        self.allocate_device()
        if self.sharded:
            self.shards.all_gather(self.device, self.shard.tensor, what=f"{self.owner} parameters")
        else:
            self.device.copy_(self.shard.tensor, non_blocking=True)
        if self.shard.tier is Tier.HOST:
            self.ledger.count_move(Tier.DEVICE, self.shard.nbytes)
        self.device_valid = True

    def free_device(self) -> None:
        """Free the device copy, first copying it to the shard if the shard is not current."""
        if not self.device_allocated:
            return
        if self.device_valid and not self.shard_valid:
            self.write_back_shard()
        if self._lent is not None:
            self.ledger.blocks.take_back(self.device.untyped_storage(), self._lent)
            self._lent = None
        else:
            self.device.untyped_storage().resize_(0)
        self.ledger.release(Tier.DEVICE, PARAM, self.nbytes)
        self.device_valid = False

    def write_back_shard(self) -> None:
        """Copy this rank's part of the device copy into the shard (allocated on the host if missing)
        and mark the shard current."""
        if not self.shard.allocated:
            self.shard.allocate(Tier.HOST)
        self.shard.tensor.copy_(self.own_slice(self.device))
        if self.shard.tier is Tier.HOST:
            self.ledger.count_move(Tier.HOST, self.shard.nbytes)
        self.shard_valid = True

    def free_shard(self) -> None:
        """Free the shard, first making the device copy current if the shard is the only current copy
        (one rank only: a sharded chunk always keeps its shard)."""
        if not self.shard.allocated:
            return
        assert not self.sharded, f"{self.owner}: a sharded chunk keeps its shard"
        if self.shard_valid and not self.device_valid:
            self.fetch_to_device()
        self.shard.free()
        self.shard_valid = False

    def current(self) -> torch.Tensor:
        """A full-length tensor holding the current contents (one rank only): the device copy if current,
        else the shard."""
        assert not self.sharded, f"{self.owner}: the full contents of a sharded chunk need a gather"
        if self.device_valid:
            return self.device
        assert self.shard_valid, f"{self.owner}: no valid copy of the parameters"
        return self.shard.tensor

    def local(self) -> torch.Tensor:
        """This rank's ``shard_numel`` elements of the current contents (the whole chunk with one rank)."""
        if self.shard_valid:
            return self.shard.tensor
        assert self.device_valid, f"{self.owner}: no valid copy of the parameters"
        return self.own_slice(self.device)


def gather_together(buffers: list[ParamBuffer]) -> None:
    """Make the full device copies of several sharded chunks of equal size current with one all-gather
    (what :class:`~chunkmem.BucketTensorShardStrategy` does for the chunks of one module)."""
    first = buffers[0]
    shards, count, shard_numel = first.shards, len(buffers), first.shard_numel
    device = first.device.device
    local = torch.cat([b.shard.tensor.to(device) for b in buffers])
    gathered = torch.empty(shards.world * count * shard_numel, dtype=first.dtype, device=device)
    shards.all_gather(gathered, local, what="parameters of " + ", ".join(b.owner for b in buffers))
    by_rank = gathered.view(shards.world, count, shard_numel)
    for i, buf in enumerate(buffers):
        buf.allocate_device()
        buf.device.view(shards.world, shard_numel).copy_(by_rank[:, i])
        if buf.shard.tier is Tier.HOST:
            buf.ledger.count_move(Tier.DEVICE, buf.shard.nbytes)
        buf.device_valid = True


class Chunk:
    """A fixed number of elements (``numel``) holding whole parameters of one :class:`ChunkKey`."""

    def __init__(self, index: int, numel: int, dtype: torch.dtype, key: ChunkKey, ledger: TierLedger,
                 shards: ShardGroup = SINGLE_PROCESS) -> None:
        if numel % shards.world:
            raise ValueError(f"chunk of {numel} elements cannot be split into {shards.world} equal shards")
        self.index = index
        self.numel = numel
        self.shards = shards
        self.dtype = dtype
        self.key = key
        self.ledger = ledger
        self.name = f"chunk{index}"
        self.slots: list[ParamSlot] = []
        self.used_numel = 0
        self.size_was_given = False
        self.built_with: list["Chunk"] = [self]  # the chunks built together with this one
        self.param = ParamBuffer(numel, dtype, ledger, self.name, shards)
        # Finished gradients and optimizer state are per shard; the staging buffer the backward writes
        # into is full-length (reduce-scattered into ``grad`` when sharded).
        self.grad = FlatBuffer(GRAD, self.shard_numel, dtype, ledger, self.name)
        self.grad_staging = FlatBuffer(GRAD_STAGING, numel, dtype, ledger, self.name)
        self.optim: dict[str, FlatBuffer] = {
            family: FlatBuffer(family, self.shard_numel, torch.float32, ledger, self.name)
            for family in OPTIM_FAMILIES}
        self._buffer_sizes = {self.param.nbytes, *(b.nbytes for b in self.flat_buffers())}  # bytes
        if ledger.blocks is not None:
            ledger.blocks.use_sizes(self._buffer_sizes)
        # Per-backward bookkeeping, reset by the manager.
        self.grad_slots_received: set[int] = set()
        self.grads_finished = False
        self.accumulator_fresh = False
        self.users = 0
        self.held_for_backward = False
        self.step = 0

    @property
    def trainable(self) -> bool:
        return self.key.trainable

    def flat_buffers(self) -> tuple[FlatBuffer, ...]:
        """Every family's buffer but the device copy of the parameters."""
        return (self.param.shard, self.grad, self.grad_staging, *self.optim.values())

    def free_all(self) -> None:
        """Free every buffer of a chunk that is no longer used (a re-pack replaced it); the block pool
        stops keeping blocks of its sizes unless another chunk has them."""
        self.param.free_device()
        self.param.shard_valid = False
        for buf in self.flat_buffers():
            buf.free()
        if self.ledger.blocks is not None:
            self.ledger.blocks.stop_using_sizes(self._buffer_sizes)
            self._buffer_sizes = set()

    @property
    def shard_numel(self) -> int:
        """Elements of the chunk this rank keeps in every family (all of them with one rank)."""
        return self.param.shard_numel

    @property
    def shard_offset(self) -> int:
        """Where this rank's elements start in the chunk (elements)."""
        return self.param.shard_offset

    @property
    def has_master(self) -> bool:
        """Whether the fp32 master is a separate family (16-bit params) or the params themselves (fp32)."""
        return self.trainable and self.dtype != torch.float32

    @property
    def element_size(self) -> int:
        return self.param.nbytes // self.numel

    def fits(self, numel: int) -> bool:
        return self.used_numel + numel <= self.numel

    def add_slot(self, param: nn.Parameter, name: str) -> ParamSlot:
        slot = ParamSlot(param, name, self, self.used_numel, param.numel(), param.shape, len(self.slots))
        self.slots.append(slot)
        self.used_numel += slot.numel
        return slot

    def bind_views(self, flat: torch.Tensor, slots: list[ParamSlot] | None = None) -> None:
        """Point the ``.data`` of every parameter (or of those in ``slots``) at its slice of ``flat``. A
        view can only be cut from allocated storage, so storage freed to 0 bytes is given its size for
        the moment of cutting."""
        storage = flat.untyped_storage()
        freed = storage.nbytes() == 0
        if freed:
            storage.resize_(flat.numel() * flat.element_size())
        with torch._C.DisableTorchFunctionSubclass():  # chunkmem's own write, past the parameter guard
            for slot in self.slots if slots is None else slots:
                slot.param.data = slot.view(flat)
        if freed:
            storage.resize_(0)

    def trainable_slots(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.param.requires_grad]

    def own_range(self, slot: ParamSlot) -> tuple[int, int] | None:
        """The elements ``(start, end)`` of ``slot``'s parameter (0 = its first element) that lie in this
        rank's shard, or ``None`` when none do."""
        start = max(slot.offset, self.shard_offset)
        end = min(slot.offset + slot.numel, self.shard_offset + self.shard_numel)
        return (start - slot.offset, end - slot.offset) if start < end else None

    def write_own_part(self, slot: ParamSlot, local: torch.Tensor, value: torch.Tensor) -> None:
        """Copy this rank's part of ``value`` (``slot``'s whole parameter) into ``local``, a buffer of
        ``shard_numel`` elements of this chunk."""
        part = self.own_range(slot)
        if part is not None:
            begin, end = part
            start = slot.offset + begin - self.shard_offset
            local[start:start + end - begin].copy_(value.reshape(-1)[begin:end])

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """A new full-length tensor from every rank's ``local`` shard (a collective when sharded: every
        rank calls it for the same chunks in the same order)."""
        full = torch.empty(self.numel, dtype=local.dtype, device=local.device)
        self.shards.all_gather(full, local, what=self.name)
        return full

    def __repr__(self) -> str:
        return (f"Chunk({self.index}, numel={self.numel}, used={self.used_numel}, dtype={self.dtype}, "
                f"key={self.key}, params={len(self.slots)})")
