"""Shard groups (MiCS): a model's chunks sharded over groups of consecutive data-parallel ranks and
replicated across the groups.

With ``W`` data-parallel ranks and a shard group size ``s`` (a divisor of ``W``), ranks ``[g·s, (g+1)·s)``
form shard group ``g``: each chunk is split into ``s`` shards among them, so every parameter gather stays
inside the group (inside a node, when a group is a node's ranks). Ranks holding the same shard in the
``W / s`` groups (``r, r + s, r + 2s, ...``) form a replica group: a chunk's gradients are
reduce-scattered inside the shard group, then the shard is all-reduced over the replica group, so only
gradients cross groups. ``s = W`` is flat ZeRO-3 (no replica group); ``s = 1`` (every chunk whole on every
rank: plain data parallelism) is not offered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..errors import InvalidArgumentError, check_number
from .collectives import ShardGroup

__all__ = ["GroupLayout", "gather_hierarchy", "group_layout", "secondary_group"]


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """The groups one model trains over: ``data_parallel`` (every rank; agreement, rank 0's duties),
    ``shards`` (the ranks this rank's chunks are split over) and ``replicas`` (the ranks holding the same
    shards in the other shard groups; ``None`` when there is one shard group)."""

    data_parallel: ShardGroup
    shards: ShardGroup
    replicas: ShardGroup | None = None

    @property
    def shard_group_size(self) -> int:
        return self.shards.world


def group_layout(data_parallel: ShardGroup, shard_group_size: int | None,
                 argument: str = "shard_group_size") -> GroupLayout:
    """The groups for ``shard_group_size`` ranks per shard group over ``data_parallel`` (``None``: all of
    them). With several shard groups every rank of ``data_parallel`` creates every sub-group, in the same
    order (``torch.distributed.new_group``), so every rank must call this with the same size."""
    world = data_parallel.world
    if shard_group_size is None or shard_group_size == world:
        return GroupLayout(data_parallel, data_parallel)
    _check_divisor(argument, shard_group_size, data_parallel, low=2,
                   allowed=f"None or a divisor >= 2 of the {world} data-parallel ranks")
    return GroupLayout(data_parallel, _consecutive(data_parallel, shard_group_size),
                       _same_place(data_parallel, shard_group_size))


def secondary_group(shards: ShardGroup, size: int | None, argument: str = "secondary_partition_size") -> ShardGroup | None:
    """ZeRO++'s hpZ: the ``size`` consecutive ranks of ``shards`` this rank shares a secondary partition with
    (``None`` without one). Every rank creates every such group, in the same order."""
    if size is None or size == 1:
        return None
    _check_divisor(argument, size, shards, low=1, below=True, allowed=f"None, 1 or a divisor of the {shards.world} "
                                                                     f"ranks the chunks are sharded over, below it")
    return _consecutive(shards, size)


def gather_hierarchy(shards: ShardGroup, node_size: int | None,
                     argument: str = "gather_node_size") -> tuple[ShardGroup, ShardGroup] | None:
    """MiCS' hierarchical gather: with ``node_size`` consecutive ranks of ``shards`` on each node, the
    ``(across, inside)`` groups of a two-stage gather: the ranks of the other nodes with this rank's place in
    its node, and this node's ranks (``None`` without a hierarchy). Every rank creates every group."""
    if node_size is None:
        return None
    _check_divisor(argument, node_size, shards, low=1, below=True, allowed=f"None or a divisor of the {shards.world} "
                                                                          f"ranks the chunks are sharded over, below it")
    return _same_place(shards, node_size), _consecutive(shards, node_size)


def _check_divisor(argument: str, size: int, group: ShardGroup, low: int, allowed: str, below: bool = False) -> None:
    check_number(argument, size, low=low, integer=True, allowed=allowed)
    if group.world % size or (below and size >= group.world):
        raise InvalidArgumentError(argument, size, allowed)


def _consecutive(group: ShardGroup, size: int) -> ShardGroup:
    """This rank's block of ``size`` consecutive ranks of ``group`` (every rank creates every block)."""
    ranks = [dist.get_global_rank(group.group, r) for r in range(group.world)]
    mine = None
    for first in range(0, group.world, size):
        created = dist.new_group(ranks[first:first + size])
        if first <= group.rank < first + size:
            mine = created
    return ShardGroup(mine, group.rank % size, size)


def _same_place(group: ShardGroup, size: int) -> ShardGroup:
    """The ranks of ``group`` at this rank's place in their blocks of ``size`` (every rank creates all)."""
    ranks = [dist.get_global_rank(group.group, r) for r in range(group.world)]
    mine = None
    for place in range(size):
        created = dist.new_group(ranks[place::size])
        if group.rank % size == place:
            mine = created
    return ShardGroup(mine, group.rank // size, group.world // size)
