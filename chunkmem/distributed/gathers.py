"""How a sharded chunk's parameters are gathered into its full device copy: one strategy per chunk, chosen
once by the builder (:func:`gather_for`), so no fetch tests the model's modes.

* :class:`FlatGather`: one all-gather of every rank's shard over the chunk's shard group. A shard resting on
  the disk tier is read on the disk tier's fetch thread into this rank's slot of the device copy (while a
  prefetched gather's period computes) and gathered in place when the fetch is waited on.
* :class:`HierarchicalGather` (MiCS): first across the nodes, from the ranks at this rank's place in theirs,
  then inside the node, reordered into rank order.
* :class:`QuantizedGather` (ZeRO++'s qwZ): a fetch for compute gathers the shards as blockwise int8 and the
  device copy holds their dequantized values; an exact fetch goes to the exact gather it wraps.
* :class:`SecondaryGather` (ZeRO++'s hpZ): a module's forward keeps this rank's part of the chunk inside a
  smaller secondary group; the backward's fetch for compute gathers inside that group from it. Any other
  fetch goes to the gather it wraps.

A gather reads the chunk through :class:`GatherSource` (core's ``ParamBuffer`` is one) and fills a tensor it
is given; the copy states stay the source's. Every collective is counted (:mod:`~chunkmem.distributed.traffic`)
as it is issued. :func:`gather_joined` (several chunks in one collective, the bucketed shard strategy) and
:func:`gather_whole` (any family of a chunk, exact) are the other parameter gathers a chunk issues.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .collectives import ShardGroup, start_all_gather
from .quantization import dequantize, pack, packed_numel, quantize, unpack
from .traffic import count_collective

__all__ = ["FlatGather", "GatherSource", "GatherStarted", "HierarchicalGather", "ParamGather", "QuantizedGather",
           "SecondaryGather", "gather_for", "gather_joined", "gather_whole"]


class GatherSource(Protocol):
    """A chunk's parameter memory as a gather reads it (core's ``ParamBuffer``)."""

    owner: str
    """The chunk's name, for the collectives' errors."""

    @property
    def shard_on_disk(self) -> bool:
        """Whether this rank's shard rests on the disk tier."""

    def read_shard(self) -> torch.Tensor:
        """This rank's shard, current (read from the disk tier's file when it rests there)."""

    def start_shard_read(self, out: torch.Tensor) -> Callable[[], None]:
        """Start reading the shard from the disk tier into ``out`` on the fetch thread; the returned call waits
        for the read (and raises, the device copy freed, when it failed)."""

    def reserve_secondary(self, nbytes: int) -> None:
        """Count ``nbytes`` of device memory kept for the secondary partition (may raise at capacity)."""

    def release_secondary(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` kept for the secondary partition."""


@dataclass(frozen=True)
class GatherStarted:
    """A gather issued: ``complete`` waits for it and leaves the values in the device copy (what it returns is
    ignored); ``approximate`` says whether they are dequantized values of a quantized gather (for compute only)."""

    complete: Callable[[], object]
    approximate: bool = False


class ParamGather:
    """How one sharded chunk's device copy is filled from the shards (see the module docstring)."""

    @property
    def quantized(self) -> bool:
        """Whether fetches for compute travel as blockwise int8 (their copies are then approximate)."""
        return False

    def start(self, full: torch.Tensor, source: GatherSource, exact: bool) -> GatherStarted:
        """Issue the gather of ``source``'s shards into ``full`` (the chunk's device copy, all its elements);
        ``exact=False``: the fetch is for compute, which may take an approximate or secondary copy."""
        raise NotImplementedError

    def keep_for_backward(self, full: torch.Tensor, source: GatherSource, approximate: bool) -> None:
        """A forward computed with ``full`` (current; ``approximate``: dequantized) and a backward follows:
        keep what the backward's gather reads (nothing but for hpZ)."""

    def drop_kept(self, source: GatherSource) -> None:
        """Forget what :meth:`keep_for_backward` kept (the backward used it, or the values changed)."""


class FlatGather(ParamGather):
    """One all-gather over ``shards``: from the shard where it rests, or read from the disk tier into this
    rank's slot of the device copy first."""

    def __init__(self, shards: ShardGroup) -> None:
        self.shards = shards

    def start(self, full: torch.Tensor, source: GatherSource, exact: bool) -> GatherStarted:
        shards = self.shards
        count_collective("parameters", "all_gather", shards.world, full.numel() * full.element_size())
        what = f"{source.owner} parameters"
        if not source.shard_on_disk:
            gathering = start_all_gather(shards, full, source.read_shard(), what=what)
            return GatherStarted(gathering.wait)
        n = full.numel() // shards.world
        own = full[shards.rank * n:(shards.rank + 1) * n]
        read = source.start_shard_read(own)

        def gathered_in_place() -> None:  # the gather starts here, in the same order on every rank
            read()
            start_all_gather(shards, full, own, what=what).wait()
        return GatherStarted(gathered_in_place)


class HierarchicalGather(ParamGather):
    """MiCS' two-stage gather over ``across`` (the ranks at this rank's place on the other nodes, started at
    once) and ``inside`` (this node's ranks, when waited for)."""

    def __init__(self, across: ShardGroup, inside: ShardGroup) -> None:
        self.across = across
        self.inside = inside

    def start(self, full: torch.Tensor, source: GatherSource, exact: bool) -> GatherStarted:
        across, inside = self.across, self.inside
        n = full.numel() // (across.world * inside.world)
        column = torch.empty(across.world * n, dtype=full.dtype, device=full.device)
        count_collective("parameters", "all_gather", across.world, column.numel() * full.element_size())
        first = start_all_gather(across, column, source.read_shard(),
                                 what=f"{source.owner} parameters (across nodes)")

        def gathered() -> None:
            first.wait()
            by_place = torch.empty(inside.world * column.numel(), dtype=full.dtype, device=full.device)
            count_collective("parameters", "all_gather", inside.world, full.numel() * full.element_size())
            inside.all_gather(by_place, column, what=f"{source.owner} parameters (inside the node)")
            # by_place is [place][node][shard]; rank order is [node][place][shard]
            full.view(across.world, inside.world, n).copy_(by_place.view(inside.world, across.world, n).transpose(0, 1))
        return GatherStarted(gathered)


class QuantizedGather(ParamGather):
    """qwZ: a fetch for compute gathers every rank's shard as int8 blocks with their scales in one all-gather
    over ``shards`` and dequantizes them into the device copy (this rank's own part too, so every rank computes
    with the same values); an exact fetch is ``exact``'s."""

    def __init__(self, shards: ShardGroup, exact: ParamGather) -> None:
        self.shards = shards
        self.exact = exact

    @property
    def quantized(self) -> bool:
        return True

    def start(self, full: torch.Tensor, source: GatherSource, exact: bool) -> GatherStarted:
        if exact:
            return self.exact.start(full, source, exact)
        world = self.shards.world
        n = full.numel() // world
        rows = pack(*quantize(source.read_shard().view(1, n)))
        gathered = torch.empty(world, packed_numel(n), dtype=torch.uint8, device=full.device)
        count_collective("parameters", "all_gather", world, gathered.numel())
        gathering = start_all_gather(self.shards, gathered.view(-1), rows.view(-1), what=f"{source.owner} parameters")

        def dequantized() -> None:
            gathering.wait()
            full.view(world, n).copy_(dequantize(*unpack(gathered, n)))
        return GatherStarted(dequantized, approximate=True)


class SecondaryGather(ParamGather):
    """hpZ over ``group`` (consecutive ranks of the shard group): the part kept from the forward is gathered
    inside ``group`` by the backward's fetch for compute, then forgotten; ``inner`` does every other fetch."""

    def __init__(self, group: ShardGroup, inner: ParamGather) -> None:
        self.group = group
        self.inner = inner
        self.kept: torch.Tensor | None = None  # this rank's part of the secondary partition
        self._kept_approximate = False  # kept from a dequantized copy

    @property
    def quantized(self) -> bool:
        return self.inner.quantized

    def keep_for_backward(self, full: torch.Tensor, source: GatherSource, approximate: bool) -> None:
        if self.kept is not None:
            return
        n = full.numel() // self.group.world
        source.reserve_secondary(n * full.element_size())
        self.kept = full[self.group.rank * n:(self.group.rank + 1) * n].clone()
        self._kept_approximate = approximate

    def drop_kept(self, source: GatherSource) -> None:
        if self.kept is None:
            return
        source.release_secondary(self.kept.numel() * self.kept.element_size())
        self.kept = None

    def start(self, full: torch.Tensor, source: GatherSource, exact: bool) -> GatherStarted:
        if exact or self.kept is None:
            return self.inner.start(full, source, exact)
        count_collective("parameters", "all_gather", self.group.world, full.numel() * full.element_size())
        gathering = start_all_gather(self.group, full, self.kept, what=f"{source.owner} parameters (secondary)")

        def gathered() -> None:
            gathering.wait()
            self.drop_kept(source)
        # a compute fetch of a chunk whose gathers are quantized counts as approximate whatever was kept
        return GatherStarted(gathered, approximate=self._kept_approximate or self.quantized)


def gather_for(shards: ShardGroup, quantized: bool, secondary: ShardGroup | None,
               hierarchy: tuple[ShardGroup, ShardGroup] | None) -> ParamGather:
    """The gather of a chunk sharded over ``shards``: hierarchical with ``hierarchy`` (``(across, inside)``),
    else flat; wrapped by the quantized gather for compute fetches when ``quantized``, and by hpZ's over
    ``secondary`` when given."""
    gather: ParamGather = HierarchicalGather(*hierarchy) if hierarchy is not None else FlatGather(shards)
    if quantized:
        gather = QuantizedGather(shards, gather)
    if secondary is not None:
        gather = SecondaryGather(secondary, gather)
    return gather


def gather_joined(shards: ShardGroup, pieces: list[torch.Tensor], device: torch.device, what: str) -> torch.Tensor:
    """Every rank's ``pieces`` (several chunks' shards, laid one after the other) in one all-gather over
    ``shards``, as a ``world × total`` tensor on ``device`` (row ``r``: rank ``r``'s shards)."""
    local = torch.cat([t.to(device) for t in pieces])
    gathered = torch.empty(shards.world * local.numel(), dtype=local.dtype, device=device)
    count_collective("parameters", "all_gather", shards.world, gathered.numel() * gathered.element_size())
    shards.all_gather(gathered, local, what=what)
    return gathered.view(shards.world, local.numel())


def gather_whole(shards: ShardGroup, local: torch.Tensor, what: str) -> torch.Tensor:
    """A new tensor of every rank's ``local`` (one shard of any family of a chunk) in rank order; exact, not
    counted as training traffic (checkpoints, state dicts, accessors)."""
    full = torch.empty(shards.world * local.numel(), dtype=local.dtype, device=local.device)
    shards.all_gather(full, local, what=what)
    return full
