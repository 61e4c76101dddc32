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
    allowed = f"None or a divisor >= 2 of the {world} data-parallel ranks"
    check_number(argument, shard_group_size, low=2, integer=True, allowed=allowed)
    if world % shard_group_size:
        raise InvalidArgumentError(argument, shard_group_size, allowed)
    size, rank = shard_group_size, data_parallel.rank
    ranks = [dist.get_global_rank(data_parallel.group, r) for r in range(world)]
    shard_pg = replica_pg = None
    for first in range(0, world, size):
        group = dist.new_group(ranks[first:first + size])
        if first <= rank < first + size:
            shard_pg = group
    for offset in range(size):
        group = dist.new_group(ranks[offset::size])
        if rank % size == offset:
            replica_pg = group
    return GroupLayout(data_parallel, ShardGroup(shard_pg, rank % size, size),
                       ShardGroup(replica_pg, rank // size, world // size))


def secondary_group(shards: ShardGroup, size: int | None, argument: str = "secondary_partition_size") -> ShardGroup | None:
    """ZeRO++'s hpZ: the ``size`` consecutive ranks of ``shards`` this rank shares a secondary partition with
    (``None`` without one). Every rank creates every such group, in the same order."""
    if size is None or size == 1:
        return None
    allowed = f"None, 1 or a divisor of the {shards.world} ranks the chunks are sharded over, below it"
    check_number(argument, size, low=1, integer=True, allowed=allowed)
    if size >= shards.world or shards.world % size:
        raise InvalidArgumentError(argument, size, allowed)
    ranks = [dist.get_global_rank(shards.group, r) for r in range(shards.world)]
    mine = None
    for first in range(0, shards.world, size):
        group = dist.new_group(ranks[first:first + size])
        if first <= shards.rank < first + size:
            mine = group
    return ShardGroup(mine, shards.rank % size, size)


def gather_hierarchy(shards: ShardGroup, node_size: int | None,
                     argument: str = "gather_node_size") -> tuple[ShardGroup, ShardGroup] | None:
    """MiCS' hierarchical gather: with ``node_size`` consecutive ranks of ``shards`` on each node, the
    ``(across, inside)`` groups of a two-stage gather: the ranks of the other nodes with this rank's place in
    its node, and this node's ranks (``None`` without a hierarchy). Every rank creates every group."""
    if node_size is None:
        return None
    allowed = f"None or a divisor of the {shards.world} ranks the chunks are sharded over, below it"
    check_number(argument, node_size, low=1, integer=True, allowed=allowed)
    if node_size >= shards.world or shards.world % node_size:
        raise InvalidArgumentError(argument, node_size, allowed)
    ranks = [dist.get_global_rank(shards.group, r) for r in range(shards.world)]
    across = inside = None
    for place in range(node_size):
        group = dist.new_group(ranks[place::node_size])
        if shards.rank % node_size == place:
            across = group
    for first in range(0, shards.world, node_size):
        group = dist.new_group(ranks[first:first + node_size])
        if first <= shards.rank < first + node_size:
            inside = group
    nodes = shards.world // node_size
    return (ShardGroup(across, shards.rank // node_size, nodes), ShardGroup(inside, shards.rank % node_size, node_size))
