"""The data-parallel group a model's chunks are sharded over, and the collectives chunkmem runs on it.

Every chunk of ``numel`` elements (a multiple of the group's size) is split into ``world`` equal
contiguous shards; rank ``r`` keeps elements ``[r * shard_numel, (r + 1) * shard_numel)``. With one
rank (no ``torch.distributed``, or a group of one) every collective is a local copy or nothing, so the
single-process path runs the same code.

NCCL needs CUDA tensors and gloo CPU tensors; the helpers here move a host tensor to the compute device
and back when the backend asks for it, so callers pass tensors from whichever tier they live in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError

# torch >= 2.10 names them *_single; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def distributed_ready() -> bool:
    """Whether ``torch.distributed`` is available and its default group initialised."""
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True, eq=False)
class ShardGroup:
    """A data-parallel group: ``group`` (``None`` for a single process), this process's ``rank`` in
    it and its ``world`` size."""

    group: Any
    rank: int
    world: int

    @staticmethod
    def of(process_group: Any, argument: str = "process_group") -> "ShardGroup":
        """The group ``process_group`` names: ``None`` is the default group once
        ``torch.distributed`` is initialised, else a single process."""
        if process_group is None:
            if not distributed_ready():
                return SINGLE_PROCESS
            process_group = dist.group.WORLD
        if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise InvalidArgumentError(argument, process_group, "None or a torch.distributed ProcessGroup")
        world = dist.get_world_size(process_group)
        if world == 1:
            return ShardGroup(process_group, 0, 1)
        return ShardGroup(process_group, dist.get_rank(process_group), world)

    @property
    def sharded(self) -> bool:
        """Whether chunks are split over more than one rank."""
        return self.world > 1

    def same_ranks(self, other: "ShardGroup") -> bool:
        return self.world == other.world and self.rank == other.rank

    def of_same_ranks(self, process_group: Any, argument: str, name: str) -> "ShardGroup":
        """The group ``process_group`` names (``None``: this one), which must hold the same ranks as this
        group (``name`` says which that is, for the error)."""
        if process_group is None:
            return self
        other = ShardGroup.of(process_group, argument)
        if not other.same_ranks(self):
            raise InvalidArgumentError(argument, f"a group of {other.world} ranks (this rank {other.rank})",
                                       f"None or a group of the same ranks as {name} ({self.world} ranks, "
                                       f"this rank {self.rank})")
        return other

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``full`` (``world × shard`` elements) with every rank's ``shard``, in rank order."""
        if not self.sharded:
            full.copy_(shard)
            return
        device = _comm_device(self.group, full)
        out = full if full.device == device else torch.empty_like(full, device=device)
        _all_gather_flat(out, shard.to(device), group=self.group)
        if out is not full:
            full.copy_(out)

    def reduce_scatter(self, shard: torch.Tensor, full_pieces: Sequence[torch.Tensor]) -> None:
        """Sum ``full_pieces`` (one per rank, each shaped like ``shard``) over the ranks; rank ``r``
        receives the sum of every rank's piece ``r`` in ``shard``."""
        if not self.sharded:
            shard.copy_(full_pieces[0])
            return
        device = _comm_device(self.group, shard)
        out = shard if shard.device == device else torch.empty_like(shard, device=device)
        pieces = [p.to(device) for p in full_pieces]
        if all(p.is_contiguous() for p in pieces) and _adjacent(pieces):
            _reduce_scatter_flat(out, _joined(pieces), group=self.group)
        else:
            dist.reduce_scatter(out, pieces, group=self.group)
        if out is not shard:
            shard.copy_(out)

    def all_reduce_(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Reduce ``tensor`` in place over the group (``op``: a ``dist.ReduceOp``, default SUM)."""
        if not self.sharded:
            return tensor
        return all_reduce_over(self.group, tensor, op)


def all_reduce_over(group: Any, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (moved to the compute device for NCCL and back)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    op = dist.ReduceOp.SUM if op is None else op
    work = tensor.to(_comm_device(group, tensor))
    dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def _comm_device(group: Any, tensor: torch.Tensor) -> torch.device:
    """Where ``tensor`` must be for a collective over ``group``: NCCL takes only CUDA tensors."""
    if group is not None and dist.get_backend(group) == "nccl" and not tensor.is_cuda:
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def _adjacent(pieces: Sequence[torch.Tensor]) -> bool:
    """Whether the pieces lie back to back in one storage (then one flat collective takes them)."""
    first = pieces[0]
    step = first.numel() * first.element_size()
    return all(p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and p.data_ptr() == first.data_ptr() + i * step for i, p in enumerate(pieces))


def _joined(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    first = pieces[0]
    return first.as_strided((first.numel() * len(pieces),), (1,), first.storage_offset())


SINGLE_PROCESS = ShardGroup(None, 0, 1)
