"""The flat per-rank partitions of :class:`~chunkmem.LowLevelZeroOptimizer` (ZeRO-1/2).

The optimizer's parameters are packed with chunkmem's chunk layout (:func:`chunkmem.core.layout.pack`, the
chunk size from :func:`chunkmem.core.layout.search_chunk_numel`, rounded to whole 64-element groups per
rank; the last chunk of each param group holds only its parameters, :func:`~chunkmem.core.layout.chunk_sizes`):
each chunk is one flat working buffer that every rank holds in full (the parameters become views
into it, so the module stays a plain module), and rank ``r`` owns elements ``[r * shard_numel,
(r + 1) * shard_numel)`` of it, as a sharded :class:`~chunkmem.core.chunk.Chunk` does. The working buffer is the
shared chunk memory's :class:`~chunkmem.core.chunk.ParamBuffer` in its replicated-resident mode, its bytes counted by
the optimizer's :class:`~chunkmem.core.memory.TierMemory` (:func:`partition_memory`). The fp32 master,
the optimizer's per-element state (Adam's moments, or another optimizer's own: see
:mod:`chunkmem.optim.any_optimizer`) and (ZeRO-2) the gradient exist only for the owned elements.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..core.chunk import ADAM_STATE, GRAD, MASTER, FlatBuffer, ParamBuffer
from ..core.chunk_slots import ChunkSlots, ParamSlot
from ..core.copy_engine import engine_for_new_model
from ..core.layout import aligned_numel, chunk_sizes, pack, part_in_shard, search_chunk_numel
from ..core.ledger import TierLedger
from ..core.memory import TierMemory
from ..core.states import CopyState
from ..core.tiers import Tier
from ..distributed.collectives import ShardGroup


@dataclass(eq=False)
class FlatSlot(ParamSlot):
    """Where one parameter lives in its flat chunk (the shared :class:`~chunkmem.core.chunk_slots.ParamSlot`), and
    ``index``: torch's numbering of it, its position over the optimizer's param groups."""

    index: int = -1

    def owned(self) -> tuple[int, int] | None:
        """The part of this parameter (element range within it) that lies in this rank's shard, or
        ``None`` when it has none."""
        return self.chunk.own_range(self)

    def part_of_rank(self, rank: int) -> tuple[int, int] | None:
        """The element range within this parameter that lies in ``rank``'s shard, or ``None``."""
        shard_numel = self.chunk.shard_numel
        return part_in_shard(self.offset, self.numel, rank * shard_numel, shard_numel)


class FlatChunk(ChunkSlots):
    """One chunk (its slots, shard and per-parameter steps: :class:`~chunkmem.core.chunk_slots.ChunkSlots`): the
    full working ``param`` buffer (``numel`` elements, every rank: the device copy of ``param_buffer``, a
    replicated-resident :class:`~chunkmem.core.chunk.ParamBuffer`), this rank's ``master`` and per-element
    optimizer ``state`` by family (``exp_avg``, ``exp_avg_sq`` for Adam; ``shard_numel`` fp32 elements each),
    another optimizer's ``scalars`` (``{param index: {key: value}}``, each parameter that has stepped its own
    ``step``, ..., as torch keeps them; also on a rank that holds none of the parameter's elements) or
    whole-parameter state (``whole_state``, by the parameter's index: :mod:`chunkmem.optim.any_optimizer`), and
    the finished gradient store ``grad`` (``None`` until a backward reduced into it; after ``zero_grad`` its memory
    is kept for the next backward, as DDP keeps its buckets).

    The master and the state families are :class:`~chunkmem.core.chunk.FlatBuffer` s of the param buffer's memory
    in ``optim`` (by family; no ``master`` entry when the working shard is its own master), fixed to
    ``optim_device`` and counted on ``optim_tier`` (the host tier when they sit apart from the parameters:
    ``cpu_offload`` on a GPU; else the device tier). The gradient store is the :class:`~chunkmem.core.chunk.FlatBuffer`
    ``grad_buffer`` of the same memory (family ``grad``; its size and dtype the gradient stores' choice,
    :meth:`make_grad_buffer`), fixed to the working chunk's device and counted on the device tier as the working
    chunk is."""

    def __init__(self, index: int, group: int, param_buffer: ParamBuffer, optim_device: torch.device,
                 optim_tier: Tier) -> None:
        super().__init__()
        self.index, self.group, self.param_buffer = index, group, param_buffer
        self.numel, self.world, self.rank = param_buffer.numel, param_buffer.shards.world, param_buffer.shards.rank
        self.shard_numel, self.shard_offset = param_buffer.shard_numel, param_buffer.shard_offset
        self.optim_device, self.optim_tier = optim_device, optim_tier
        self.optim: dict[str, FlatBuffer] = {}
        self.scalars: dict[int, dict[str, Any]] = {}  # param index -> its scalar state
        self.whole_state: dict[int, dict[str, Any]] = {}
        self.grad_buffer: FlatBuffer | None = None  # made by the gradient stores (:meth:`make_grad_buffer`)
        self.grad_backward = -1  # which backward (the optimizer's count of those begun) last added to ``grad``

    @property
    def param(self) -> torch.Tensor:
        """The working chunk: all ``numel`` elements, which the parameters view (resident, never freed)."""
        return self.param_buffer.device

    @property
    def grad(self) -> torch.Tensor | None:
        """The finished gradient store (CURRENT ``grad_buffer``); ``None`` before a backward reduced into it and
        after ``zero_grad`` dropped it (its memory then kept, STALE, for the next backward)."""
        buffer = self.grad_buffer
        return buffer.tensor if buffer is not None and buffer.state is CopyState.CURRENT else None

    @property
    def master(self) -> torch.Tensor:
        """This rank's ``shard_numel`` masters: their own buffer, or the working shard (a view) when it is its own
        master."""
        buffer = self.optim.get(MASTER)
        return self.own(self.param) if buffer is None else buffer.tensor

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The per-element optimizer state by family (a new dict of the buffers' tensors; write into them)."""
        return {family: buffer.tensor for family, buffer in self.optim.items() if family != MASTER}

    @property
    def state_families(self) -> tuple[str, ...]:
        """The per-element optimizer state's family names."""
        return tuple(family for family in self.optim if family != MASTER)

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-chunk flat tensor (a view)."""
        return flat[self.shard_offset:self.shard_offset + self.shard_numel]

    def keep_master(self, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Give the chunk masters of their own in ``dtype``, holding ``values`` (this rank's ``shard_numel``)."""
        buffer = self._optim_buffer(MASTER, self.shard_numel, dtype)
        buffer.allocate(self.optim_tier).copy_(values)
        buffer.mark_written()

    def use_state_buffers(self, buffers: dict[str, tuple[int, torch.dtype]]) -> None:
        """Make ``buffers`` (family -> elements and dtype of this rank's buffer) the optimizer state, zero, in place
        of the families the chunk had (their memory given back)."""
        for family in self.state_families:
            self.optim.pop(family).free()
        for family, (numel, dtype) in buffers.items():
            self._optim_buffer(family, numel, dtype).allocate(self.optim_tier, zero=True)

    def make_grad_buffer(self, numel: int, dtype: torch.dtype) -> FlatBuffer:
        """Give the chunk its gradient store's buffer (``numel`` elements of ``dtype``; not allocated yet) on the
        working chunk's device."""
        self.grad_buffer = self._flat_buffer(GRAD, numel, dtype, self.param.device)
        return self.grad_buffer

    def _optim_buffer(self, family: str, numel: int, dtype: torch.dtype) -> FlatBuffer:
        buffer = self._flat_buffer(family, numel, dtype, self.optim_device)
        self.optim[family] = buffer
        return buffer

    def _flat_buffer(self, family: str, numel: int, dtype: torch.dtype, device: torch.device) -> FlatBuffer:
        return FlatBuffer(family, numel, dtype, self.param_buffer.memory, self.param_buffer.owner, self.rank,
                          self.index, device)


def partition_memory() -> TierMemory:
    """The memory of one optimizer's flat chunks: a ledger that counts (bytes per tier and family) without bounding
    (the optimizer has no capacity argument; its working chunks are allocated once, as the model's parameters were),
    torch's allocators (no block pool: the chunks are never given back, so pooling would only round them up) and
    the copy engine a model wrapped now uses."""
    return TierMemory(TierLedger(sys.maxsize), copies=engine_for_new_model())


def build_partition(groups: list[list[nn.Parameter]], index_of: dict[int, int], dtype: torch.dtype,
                    shards: ShardGroup, memory: TierMemory, master_device: torch.device, separate_master: bool,
                    families: tuple[str, ...] = ADAM_STATE, master_dtype: torch.dtype = torch.float32
                    ) -> list[FlatChunk]:
    """Pack the parameters of ``groups`` (chunks never mix groups; ``index_of``: ``id(parameter)`` -> torch's
    index of it) into flat chunks of ``dtype`` on the parameters' device (replicated-resident
    :class:`~chunkmem.core.chunk.ParamBuffer` s of ``memory``, one per chunk, over ``shards``), make every
    parameter a view into its chunk, and allocate this rank's
    master (``master_dtype``: fp32, or bf16 for bf16 parameters that are their own masters; a copy of the
    values before any cast, when ``separate_master``; else the owned elements of the working buffer are the
    masters) and zero fp32 optimizer state ``families`` (one element per element of the shard) on
    ``master_device``. Padding is zero."""
    entries = [(g, p) for g, params in enumerate(groups) for p in params]
    numels = [p.numel() for _, p in entries]
    keys = [g for g, _ in entries]
    element_size = dtype.itemsize
    chunk_numel = aligned_numel(search_chunk_numel(numels, keys, element_size), shards.world)
    packed = pack(numels, keys, chunk_numel)
    chunks = []
    for n, (members, numel) in enumerate(zip(packed, chunk_sizes(packed, numels, keys, chunk_numel, shards.world))):
        device = entries[members[0]][1].device
        working = ParamBuffer.replicated_resident(numel, dtype, memory, f"flat chunk {n}", shards, device, n)
        flat = working.device
        exact = torch.zeros(numel, dtype=master_dtype, device=device) if separate_master else None
        chunk = FlatChunk(n, entries[members[0]][0], working, master_device,
                          Tier.DEVICE if master_device == device else Tier.HOST)
        offset = 0
        for i in members:
            param = entries[i][1]
            index = index_of[id(param)]
            slot = FlatSlot(param, f"parameter {index}", chunk, offset, param.numel(), tuple(param.shape),
                            len(chunk.slots), index)
            with torch.no_grad():
                slot.view(flat).copy_(param.data)
                if exact is not None:
                    slot.view(exact).copy_(param.data)
            param.data = slot.view(flat)
            chunk.slots.append(slot)
            offset += param.numel()
        if exact is not None:
            chunk.keep_master(chunk.own(exact), master_dtype)
        chunk.use_state_buffers({family: (chunk.shard_numel, torch.float32) for family in families})
        chunks.append(chunk)
    return chunks
