"""The data-parallel group a model's chunks are sharded over, and the collectives chunkmem runs on it.

Every chunk of ``numel`` elements (a multiple of the group's size) is split into ``world`` equal
contiguous shards; rank ``r`` keeps elements ``[r * shard_numel, (r + 1) * shard_numel)``. With one
rank (no ``torch.distributed``, or a group of one) every collective is a local copy or nothing, so the
single-process path runs the same code.

NCCL needs CUDA tensors and gloo CPU tensors; the helpers here move a host tensor to the compute device
and back when the backend asks for it, so callers pass tensors from whichever tier they live in.

Every collective chunkmem runs goes through :func:`_complete`: it is started with ``async_op=True`` and
waited for with a bound, :func:`collective_timeout` seconds (default 600, set with
:func:`set_collective_timeout` or the environment variable ``CHUNKMEM_COLLECTIVE_TIMEOUT``). A rank
whose partners never join (one caught an exception in its forward and carried on, or stopped) raises
:class:`CollectiveTimeoutError` naming the collective, what it moves (``what``, e.g. "chunk3
parameters") and the rank, instead of waiting until killed. With NCCL the wait stays stream-ordered (a
host-blocking wait would stall the CPU on every gather); NCCL's own watchdog bounds it there, with the
process group's ``timeout``.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import ArgumentTypeError, CollectiveError, CollectiveTimeoutError, InvalidArgumentError, check_number

# torch >= 2.10 names them *_single; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


COLLECTIVE_TIMEOUT_ENV = "CHUNKMEM_COLLECTIVE_TIMEOUT"
# seconds: NCCL's default process-group timeout. Long enough for the legitimate skew between ranks
# (one rank writing a large checkpoint or building the host Adam kernel while the others wait), far
# shorter than gloo's 30 minutes.
DEFAULT_COLLECTIVE_TIMEOUT = 600.0

_timeout_override: float | None = None

_FINISHED_WORKS_KEPT = 8
_finished_works: deque = deque(maxlen=_FINISHED_WORKS_KEPT)
"""The last collectives waited for, kept referenced. gloo's worker thread releases a finished work's
tensors a moment after the work completes; if that release drops the last reference while the
interpreter is finalizing, the process aborts (``terminate called without an active exception``: 5 of
12 two-rank runs of ``all_reduce(async_op=True).wait()`` on a temporary tensor, torch 2.13). Holding the
last few works here makes the worker's release never the last one: these are released by the main
thread, at finalization at the latest. A few collectives' inputs stay alive that much longer."""

_bounded_groups: dict[int, float] = {}  # id(group) -> the timeout (seconds) set on its gloo backend


def _check_timeout(argument: str, seconds: Any) -> float:
    check_number(argument, seconds, low=0, low_open=True, finite=True, allowed="a finite number of seconds > 0")
    return float(seconds)


def set_collective_timeout(seconds: float | None) -> None:
    """Bound, in seconds, how long a rank waits for one collective of chunkmem's (all-gather,
    reduce-scatter, all-reduce) before raising :class:`CollectiveTimeoutError`.

    ``None`` restores the default: the environment variable ``CHUNKMEM_COLLECTIVE_TIMEOUT`` (seconds)
    if set, else 600. Takes effect for the next collective. Does not apply to NCCL, whose waits are
    stream-ordered; there the process group's ``timeout`` (``init_process_group(timeout=...)``) bounds
    them through NCCL's watchdog.
    """
    global _timeout_override
    _timeout_override = None if seconds is None else _check_timeout("seconds", seconds)


def collective_timeout() -> float:
    """The bound in seconds on one collective wait (see :func:`set_collective_timeout`)."""
    if _timeout_override is not None:
        return _timeout_override
    env = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not env:
        return DEFAULT_COLLECTIVE_TIMEOUT
    try:
        value: Any = float(env)
    except ValueError:
        value = env
    return _check_timeout(COLLECTIVE_TIMEOUT_ENV, value)


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
            raise ArgumentTypeError(argument, process_group, "None or a torch.distributed ProcessGroup")
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

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str = "a tensor") -> None:
        """Fill ``full`` (``world × shard`` elements) with every rank's ``shard``, in rank order
        (``what``: what the shards hold, for the error if the collective fails or times out)."""
        if not self.sharded:
            full.copy_(shard)
            return
        start_all_gather(self, full, shard, what).wait()

    def reduce_scatter(self, shard: torch.Tensor, full_pieces: Sequence[torch.Tensor], what: str = "a tensor") -> None:
        """Sum ``full_pieces`` (one per rank, each shaped like ``shard``) over the ranks; rank ``r``
        receives the sum of every rank's piece ``r`` in ``shard`` (``what``: for the error). The pieces
        may be overwritten (over gloo they are all-reduced in place: :func:`all_reduce_is_faster`)."""
        self.start_reduce_scatter(shard, full_pieces, what).wait()

    def start_reduce_scatter(self, shard: torch.Tensor, full_pieces: Sequence[torch.Tensor],
                             what: str = "a tensor") -> "PendingCollective":
        """:meth:`reduce_scatter` started: ``shard`` holds the sum once the returned handle's ``wait()``
        returned; the pieces must stay unchanged until then."""
        if not self.sharded:
            shard.copy_(full_pieces[0])
            return PendingCollective("reduce_scatter", what, None, None, shard, shard)
        bound_gloo_timeout(self.group)
        device = _comm_device(self.group, shard)
        pieces = [p.to(device) for p in full_pieces]
        adjacent = all(p.is_contiguous() for p in pieces) and _adjacent(pieces)
        if all_reduce_is_faster(self):
            summed = [_joined(pieces)] if adjacent else pieces
            work = _AllWorks([dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                              for t in summed])
            return PendingCollective("reduce_scatter", what, self.group, work, pieces[self.rank], shard)
        out = shard if shard.device == device else torch.empty_like(shard, device=device)
        if adjacent:
            work = _reduce_scatter_flat(out, _joined(pieces), group=self.group, async_op=True)
        else:
            work = dist.reduce_scatter(out, pieces, group=self.group, async_op=True)
        return PendingCollective("reduce_scatter", what, self.group, work, out, shard)

    def all_reduce_(self, tensor: torch.Tensor, op: Any = None, what: str = "a tensor") -> torch.Tensor:
        """Reduce ``tensor`` in place over the group (``op``: a ``dist.ReduceOp``, default SUM;
        ``what``: for the error)."""
        if not self.sharded:
            return tensor
        return all_reduce_over(self.group, tensor, op, what)

    def broadcast_(self, tensor: torch.Tensor, source_rank: int, what: str = "a tensor") -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``source_rank``'s (a rank of this group)."""
        if not self.sharded:
            return tensor
        work = tensor.to(_comm_device(self.group, tensor))
        src = dist.get_global_rank(self.group, source_rank)
        _complete("broadcast", what, self.group,
                  lambda: dist.broadcast(work, src=src, group=self.group, async_op=True))
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_gather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's ``data`` (any length, may differ between ranks), in rank order: two bounded
        all-gathers, of the lengths and of the data padded to the longest."""
        if not self.sharded:
            return [data]
        lengths = torch.empty(self.world, dtype=torch.int64)
        self.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), what=f"the lengths of {what}")
        longest = int(lengths.max())
        if longest == 0:
            return [b""] * self.world
        padded = torch.zeros(longest, dtype=torch.uint8)
        if data:
            padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(self.world * longest, dtype=torch.uint8)
        self.all_gather(everyone, padded, what=what)
        rows = everyone.view(self.world, longest).numpy()
        return [rows[r, :int(n)].tobytes() for r, n in enumerate(lengths.tolist())]


def all_reduce_over(group: Any, tensor: torch.Tensor, op: Any = None, what: str = "a tensor") -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` (moved to the compute device for NCCL and back;
    ``what``: for the error if the collective fails or times out)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    op = dist.ReduceOp.SUM if op is None else op
    work = tensor.to(_comm_device(group, tensor))
    _complete("all_reduce", what, group, lambda: dist.all_reduce(work, op=op, group=group, async_op=True))
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def reduce_over_groups(groups: list[Any], tensor: torch.Tensor, maximum: bool, what: str) -> torch.Tensor:
    """``tensor`` summed (``maximum``: its elementwise max) over each of ``groups`` in turn, returned; an
    element that is NaN on any rank is NaN in the result (a sum carries it; a max may drop it, so it travels
    as a count of its own)."""
    if not maximum:
        for group in groups:
            all_reduce_over(group, tensor, what=what)
        return tensor
    nan = torch.isnan(tensor).double()
    tensor = torch.where(torch.isnan(tensor), 0.0, tensor)  # (nan_to_num would make an infinity finite)
    for group in groups:
        all_reduce_over(group, nan, what=f"which of {what} are NaN")
        all_reduce_over(group, tensor, dist.ReduceOp.MAX, what=what)
    return torch.where(nan > 0, math.nan, tensor)


class PendingCollective:
    """A collective started with ``async_op=True`` and not waited for yet (gradient reduction overlapped
    with the rest of a backward). :meth:`wait` waits as every chunkmem collective does (bounded by
    :func:`collective_timeout` except with NCCL) and then copies the result from the communication
    buffer into ``target`` when they differ (a host tensor reduced over NCCL)."""

    def __init__(self, collective: str, what: str, group: Any, work: Any, out: torch.Tensor,
                 target: torch.Tensor) -> None:
        self.collective, self.what, self.group, self.work = collective, what, group, work
        self.out, self.target = out, target

    def wait(self) -> torch.Tensor:
        """Wait for the collective; returns ``target``, which holds the result."""
        if self.work is not None:
            _wait(self.collective, self.what, self.group, self.work)
            self.work = None
            if self.out is not self.target:
                self.target.copy_(self.out)
        return self.target


def start_all_reduce(shards: ShardGroup, tensor: torch.Tensor, what: str) -> PendingCollective:
    """Start summing ``tensor`` in place over ``shards``' group; the sum is in ``tensor`` once the
    returned handle's ``wait()`` returned (one rank: at once)."""
    if not shards.sharded:
        return PendingCollective("all_reduce", what, None, None, tensor, tensor)
    bound_gloo_timeout(shards.group)
    work_tensor = tensor.to(_comm_device(shards.group, tensor))
    work = dist.all_reduce(work_tensor, op=dist.ReduceOp.SUM, group=shards.group, async_op=True)
    return PendingCollective("all_reduce", what, shards.group, work, work_tensor, tensor)


def gather_by_broadcasts(shards: ShardGroup) -> bool:
    """Whether an all-gather over ``shards`` is better done as one broadcast per rank, each straight into
    its slot of the output. True over gloo, whose all-gather allocates a temporary the size of the output
    at every call. 2 ranks, 16 MB of output, torch 2.13: 29-34 ms against 12 ms when malloc gives large
    blocks back to the system at once (``M_MMAP_THRESHOLD`` fixed, as the ZeRO recipe benchmark does;
    each call then first-touches 16 MB), the same time otherwise (18.8 and 18.4 ms in one run). The bytes
    moved are the same."""
    return shards.sharded and dist.get_backend(shards.group) == "gloo"


class _AllWorks:
    """Several started collectives waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True


def all_reduce_is_faster(shards: ShardGroup) -> bool:
    """Whether a reduce-scatter over ``shards`` is better done as an all-reduce of the whole input
    (each rank then keeps its piece). True over gloo, whose reduce-scatter of a tensor takes about twice
    as long as its all-reduce of the same tensor (2 ranks, 16 MB: 29.9 ms against 14.7 ms,
    torch 2.13), although it moves half the data; NCCL's reduce-scatter is the faster one."""
    return shards.sharded and dist.get_backend(shards.group) == "gloo"


def start_all_gather(shards: ShardGroup, full: torch.Tensor, shard: torch.Tensor, what: str) -> PendingCollective:
    """Start filling ``full`` (contiguous, ``world × shard.numel()`` elements) with every rank's ``shard``
    in rank order; ``full`` holds them once the returned handle's ``wait()`` returned. ``shard`` may be
    this rank's own slot of ``full`` (in place); otherwise it must not overlap ``full``, and it must stay
    unchanged until then."""
    if not shards.sharded:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return PendingCollective("all_gather", what, None, None, full, full)
    bound_gloo_timeout(shards.group)
    device = _comm_device(shards.group, full)
    work_out = full if full.device == device else torch.empty_like(full, device=device)
    local = shard.to(device)
    if gather_by_broadcasts(shards):
        n, group = local.numel(), shards.group
        own = work_out[shards.rank * n:(shards.rank + 1) * n]
        if own.data_ptr() != local.data_ptr():
            own.copy_(local)
        work = _AllWorks([dist.broadcast(work_out[r * n:(r + 1) * n], src=dist.get_global_rank(group, r),
                                         group=group, async_op=True) for r in range(shards.world)])
    else:
        work = _all_gather_flat(work_out, local, group=shards.group, async_op=True)
    return PendingCollective("all_gather", what, shards.group, work, work_out, full)


def start_reduce_scatter(shards: ShardGroup, out: torch.Tensor, joined: torch.Tensor, what: str) -> PendingCollective:
    """Start a reduce-scatter of ``joined`` (``world × out.numel()`` contiguous elements, rank ``r``'s
    piece at ``[r * n, (r + 1) * n)``): rank ``r`` receives the sum over the ranks of piece ``r`` in
    ``out`` once the returned handle's ``wait()`` returned. ``joined`` must stay unchanged until then."""
    return _start_into(shards, "reduce_scatter", what, out, joined, lambda work_out, data: _reduce_scatter_flat(
        work_out, data, group=shards.group, async_op=True))


def start_all_to_all(shards: ShardGroup, out: torch.Tensor, rows: torch.Tensor, what: str) -> PendingCollective:
    """Start sending row ``r`` of ``rows`` (``world`` equal rows, contiguous) to rank ``r``; ``out`` (shaped
    like ``rows``) holds in row ``r`` what rank ``r`` sent this rank once the returned handle's ``wait()``
    returned. ``rows`` must stay unchanged until then."""
    return _start_into(shards, "all_to_all", what, out, rows, lambda work_out, data: dist.all_to_all_single(
        work_out, data, group=shards.group, async_op=True))


def _start_into(shards: ShardGroup, collective: str, what: str, out: torch.Tensor, data: torch.Tensor,
                launch: Callable[[torch.Tensor, torch.Tensor], Any]) -> PendingCollective:
    """Start ``launch(output, input)`` on the communication device (a copy with one rank); the handle
    copies the result into ``out`` when they differ."""
    if not shards.sharded:
        out.copy_(data)
        return PendingCollective(collective, what, None, None, out, out)
    bound_gloo_timeout(shards.group)
    device = _comm_device(shards.group, out)
    work_out = out if out.device == device else torch.empty_like(out, device=device)
    return PendingCollective(collective, what, shards.group, launch(work_out, data.to(device)), work_out, out)


def _complete(collective: str, what: str, group: Any, start: Callable[[], Any]) -> None:
    """Start a collective (``start`` launches it with ``async_op=True``) and wait for it, at most
    :func:`collective_timeout` seconds except with NCCL (see the module docstring)."""
    bound_gloo_timeout(group)
    _wait(collective, what, group, start())


def bound_gloo_timeout(group: Any) -> None:
    """Lower a gloo group's own collective timeout to :func:`collective_timeout` (never raise it), before
    chunkmem starts a collective on it. Waiting for a collective is bounded here, but gloo's worker
    thread would stay inside a collective whose partner never comes until the group's timeout (30
    minutes by default), and interpreter exit joins that thread: with the group bounded too, a process
    whose collective timed out exits promptly. The user's own collectives on the group get the lower
    bound as well."""
    if group is None or dist.get_backend(group) != "gloo":
        return
    bound = collective_timeout()
    if _bounded_groups.get(id(group)) == bound:
        return
    try:
        options = group._get_backend(torch.device("cpu")).options
        current = getattr(options, "_timeout", None) or getattr(options, "timeout", None)
    except (AttributeError, RuntimeError):  # a torch without these: the group keeps its own timeout
        return
    if current is None or current.total_seconds() > bound:
        group.set_timeout(timedelta(seconds=bound))
    _bounded_groups[id(group)] = bound


def _wait(collective: str, what: str, group: Any, work: Any) -> None:
    """Wait for a started collective's ``work`` handle (see :func:`_complete`); the handle is then kept
    among the last few finished (see ``_finished_works``)."""
    _finished_works.append(work)
    if dist.get_backend(group) == "nccl":
        work.wait()
        return
    timeout = collective_timeout()
    began = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        waited = time.monotonic() - began
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        where = f"{collective} of {what} on rank {rank} of {world}{_global_rank_note(group, rank)}"
        if waited >= timeout * 0.99 or "timed out" in str(exc).lower():
            raise CollectiveTimeoutError(
                f"{where} did not complete within {waited:.1f} s: another rank of the group never joined it "
                f"(it stopped, skipped part of a step, e.g. after catching an exception in its forward, or "
                f"runs different code). The bound is {timeout:g} s (chunkmem.set_collective_timeout or "
                f"{COLLECTIVE_TIMEOUT_ENV}); the process group is unusable now: end every rank",
                collective, what, rank, world, timeout, waited) from exc
        raise CollectiveError(f"{where} failed: {exc}", collective, what, rank, world) from exc


def _global_rank_note(group: Any, rank: int) -> str:
    """``" (global rank N)"`` when the group's rank differs from the default group's."""
    global_rank = dist.get_rank()
    return "" if global_rank == rank else f" (global rank {global_rank})"


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
