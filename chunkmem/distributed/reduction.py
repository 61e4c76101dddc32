"""How finished gradients of a sharded chunk are reduce-scattered over the data-parallel ranks (ZeRO-3), and
those of a chunk whole on every rank (persistent parameters) all-reduced. ZeRO-1/2 reduces the same way a
bucket of parameters at a time (:mod:`chunkmem.distributed.bucketed_reduction`)."""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .collectives import PendingCollective, ShardGroup, start_all_to_all
from .quantization import dequantize, pack, quantize, unpack
from .traffic import count_collective


class GradientReduction:
    """Reduce-scatters full-length gradients into this rank's shard of their mean over the ranks.

    Each rank's full-length gradient is divided by ``predivide_factor``, summed over the ranks (in fp32
    when ``fp32`` is set, else in the gradient's dtype), and this rank's shard of the sum is divided by
    ``world / predivide_factor``: the mean over the ranks. A gradient is reduced in pieces of at most
    ``bucket_bytes`` of collective input (every rank's part of the piece, in the reduction dtype), so the
    fp32 temporaries stay within one bucket. ``collectives`` counts the collectives run so far.

    With shard groups (:mod:`chunkmem.distributed.shard_groups`) the sum inside the shard group
    (``shards``) is then summed over the ``replicas`` group before the division: the mean over all
    ``data_parallel`` ranks.

    ``quantized`` (ZeRO++'s qgZ): instead of a reduce-scatter, each rank quantizes every other rank's part
    of its predivided gradient to blockwise int8 (:mod:`chunkmem.distributed.quantization`), the parts
    are exchanged in one all-to-all of the whole chunk (no buckets), and each rank sums the dequantized
    parts it received in fp32, in rank order: ``1 + 4 / 2048`` bytes an element cross the network instead
    of the element size, and the sum is off by at most the sum over the ranks of half a block's scale
    (``max |x| / 254`` of each rank's block).
    """

    def __init__(self, shards: ShardGroup, bucket_bytes: int = 25 * 2**20, fp32: bool = False,
                 predivide_factor: float = 1.0, replicas: ShardGroup | None = None, quantized: bool = False) -> None:
        self.shards = shards
        self.replicas = replicas
        self.quantized = quantized
        self.bucket_bytes = bucket_bytes
        self.fp32 = fp32
        self.predivide_factor = predivide_factor
        self.collectives = 0
        self._out: torch.Tensor | None = None  # the reduced shard's buffer, reused from chunk to chunk

    def _out_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = self._out
        if out is None or out.numel() != numel or out.dtype != dtype or out.device != device:
            out = self._out = torch.empty(numel, dtype=dtype, device=device)
        return out

    def reduce(self, full: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's shard of the mean over the ranks of ``full`` (a chunk's full-length gradient on the
        device tier, ``world × shard`` elements; it may be overwritten), in ``full``'s dtype. ``what``
        names the gradients for a collective's error. The result is valid until the next call (its
        buffer is reused: copy it out)."""
        if self.quantized:
            return self._start_quantized(full, what).wait()
        out = self._out_buffer(full.numel() // self.shards.world, self._dtype(full), full.device)
        for out_piece, parts in self._pieces(full, out):
            self.shards.reduce_scatter(out_piece, parts, what=what)
        return _mean(out, self.replicas, what, self._post_divisor, full.dtype)

    def start(self, full: torch.Tensor, what: str) -> "PendingReduction":
        """:meth:`reduce` started, every bucket's collective at once, into a buffer of its own: the
        returned handle's ``wait()`` gives the shard (the same bits as :meth:`reduce`). ``full`` must stay
        unchanged until then; with ``fp32`` its fp32 copy lives as long (not one bucket at a time)."""
        if self.quantized:
            return self._start_quantized(full, what)
        out = torch.empty(full.numel() // self.shards.world, dtype=self._dtype(full), device=full.device)
        started = [self.shards.start_reduce_scatter(out_piece, parts, what=what)
                   for out_piece, parts in self._pieces(full, out)]
        return PendingReduction(started, lambda: out, self.replicas, what, self._post_divisor, full.dtype)

    def _start_quantized(self, full: torch.Tensor, what: str) -> "PendingReduction":
        """The all-to-all of the quantized parts started (see the class docstring)."""
        world = self.shards.world
        shard_numel = full.numel() // world
        parts = full.view(world, shard_numel).to(torch.float32)
        if self.predivide_factor != 1.0:
            parts = parts / self.predivide_factor
        rows = pack(*quantize(parts))
        received = torch.empty_like(rows)
        self.collectives += 1
        count_collective("gradients", "all_to_all", world, rows.numel())
        started = start_all_to_all(self.shards, received, rows, what)

        def summed() -> torch.Tensor:
            return dequantize(*unpack(received, shard_numel)).sum(dim=0)
        return PendingReduction([started], summed, self.replicas, what, self._post_divisor, full.dtype)

    def _dtype(self, full: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32 else full.dtype

    def _pieces(self, full: torch.Tensor, out: torch.Tensor) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Per bucket: the slice of ``out`` it reduces into and every rank's part of ``full`` for it, in
        the reduction dtype and predivided (made as the caller reaches it)."""
        world = self.shards.world
        shard_numel = out.numel()
        piece = max(self.bucket_bytes // (world * out.element_size()), 1)
        for start in range(0, shard_numel, piece):
            end = min(start + piece, shard_numel)
            parts = [full[r * shard_numel + start:r * shard_numel + end].to(out.dtype) for r in range(world)]
            if self.predivide_factor != 1.0:
                for p in parts:
                    p.div_(self.predivide_factor)
            self.collectives += 1
            count_collective("gradients", "reduce_scatter", world, world * (end - start) * out.element_size())
            yield out[start:end], parts

    @property
    def data_parallel_world(self) -> int:
        """The ranks the gradients are averaged over (the shard group's, times the replica group's)."""
        return self.shards.world * (1 if self.replicas is None else self.replicas.world)

    @property
    def _post_divisor(self) -> float:
        """What the summed shard is divided by to give the mean (the predivision done)."""
        return self.data_parallel_world / self.predivide_factor

    def predivide_(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a collective's input, in the reduction dtype) divided in place by ``predivide_factor``."""
        return local.div_(self.predivide_factor) if self.predivide_factor != 1.0 else local

    def mean_(self, summed: torch.Tensor, what: str) -> torch.Tensor:
        """The mean over the data-parallel ranks from ``summed`` (a predivided input summed over the shard
        group; overwritten), in ``summed``'s dtype: summed over the replica group, then divided."""
        return _mean(summed, self.replicas, what, self._post_divisor, summed.dtype)

    def all_reduce_mean_(self, full: torch.Tensor, what: str) -> torch.Tensor:
        """``full`` (a chunk's whole gradient on every rank) replaced by its mean over the ranks, in place,
        with the same predivision and reduction dtype as :meth:`reduce`, in pieces of at most
        ``bucket_bytes`` of collective input. Returns ``full``."""
        dtype = torch.float32 if self.fp32 else full.dtype
        piece = max(self.bucket_bytes // dtype.itemsize, 1)
        post = self.shards.world / self.predivide_factor
        for start in range(0, full.numel(), piece):
            part = full[start:start + piece]
            summed = part.to(dtype, copy=True) if dtype != full.dtype else part
            if self.predivide_factor != 1.0:
                summed.div_(self.predivide_factor)
            count_collective("gradients", "all_reduce", self.shards.world, summed.numel() * summed.element_size())
            self.shards.all_reduce_(summed, what=what)
            self.collectives += 1
            if post != 1.0:
                summed.div_(post)
            if summed is not part:
                part.copy_(summed)
        return full


class PendingReduction:
    """A chunk's gradient reduction started by :meth:`GradientReduction.start`."""

    def __init__(self, started: list[PendingCollective], summed: Callable[[], torch.Tensor],
                 replicas: ShardGroup | None, what: str, post_divisor: float, dtype: torch.dtype) -> None:
        self._started, self._summed, self._replicas, self._what = started, summed, replicas, what
        self._post_divisor, self._dtype = post_divisor, dtype

    def wait(self) -> torch.Tensor:
        """Wait for every collective; this rank's shard of the mean over the ranks, in the gradient's
        dtype (``summed()`` gives the shard group's sum once they are done)."""
        for pending in self._started:
            pending.wait()
        return _mean(self._summed(), self._replicas, self._what, self._post_divisor, self._dtype)


def _mean(summed: torch.Tensor, replicas: ShardGroup | None, what: str, post_divisor: float,
          dtype: torch.dtype) -> torch.Tensor:
    """The shard group's sum, summed over the replica group (in place), divided into the mean over the
    data-parallel ranks, in ``dtype``."""
    if replicas is not None:
        count_collective("gradients", "all_reduce", replicas.world, summed.numel() * summed.element_size())
        replicas.all_reduce_(summed, what=f"{what} (over the replica group)")
    if post_divisor != 1.0:
        summed.div_(post_divisor)
    return summed.to(dtype)
