"""Where a candidate of :func:`~chunkmem.plan.choose` rests its bytes once the disk tier takes the optimizer state
and/or the parameters, derived from the meta run of its placement (:mod:`chunkmem.plan.meta_run`) by the disk
tier's rules: the families on disk and in host memory, the I/O buffers, the files, the bytes a step reads and
writes, and the host peak.

Each trainable chunk's optimizer families come from the meta run's layout (``extra["optim_families"]``: elements
and bytes per element of each, the master included): Adam's fp32 moments, or an 8-bit Adam's codes (on disk) with
their block scales and the small parameters' moments (kept in host memory: ``extra["in_memory_families"]``),
streamed a whole chunk at a time (``extra["whole_chunks"]``, :func:`chunkmem.optim.disk_step.whole_piece_nbytes`).
Units: bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.chunk import MASTER
from ..model.builder import param_chunks_kept_on_host
from ..optim.disk_step import streamed_count
from ..storage.disk_io import aligned_nbytes
from .meta_run import PolicyPlan

__all__ = ["DiskSettings", "Placed", "place_bytes", "bytes_per_rank", "disk_file_bytes", "disk_traffic", "host_peak"]


@dataclass(frozen=True)
class DiskSettings:
    """The disk tier's settings of a :func:`~chunkmem.plan.choose`: as ShardedModelV2's ``buffer_count``,
    ``buffer_size`` (bytes) and ``atomic_step``."""

    buffer_count: int
    buffer_size: int
    atomic_step: bool


@dataclass
class Placed:
    """Where one candidate's chunk bytes rest (``tier_bytes``: tier -> family -> bytes), with what its disk
    accounting reads: the host bytes of the parameters before any went to disk (``param_host``), the chunks
    whose parameters stay on the host all the same (``param_kept``, ``kept_param_bytes``), the trainable chunks
    whose optimizer state rests on disk (``optim_on_disk``, ``on_disk_numel`` elements, ``optim_disk_bytes`` of
    their families on disk, which the streamed step reads and writes) and the disk tier's I/O buffers on the host
    (``disk_io``)."""

    tier_bytes: dict[str, dict[str, int]]
    param_host: int
    param_kept: frozenset[int]
    kept_param_bytes: int
    optim_on_disk: set[int]
    on_disk_numel: int
    disk_io: int
    optim_disk_bytes: int = 0


def _streamed_families(base: PolicyPlan) -> int:
    """The state families (not the master) the streamed step reads from disk for each chunk."""
    ex = base.extra
    families = ex["optim_families"][0] if ex["optim_families"] else {}
    return len([f for f in families if f != MASTER and f not in ex["in_memory_families"]])


def _kept_on_host(base: PolicyPlan, policy: str, host_capacity: int | None, reuse: bool, dtype: torch.dtype,
                  host_now: int, disk: DiskSettings, streamed: int) -> int:
    """With the optimizer state on disk: how many chunks' state stays on the host all the same (under ``auto``
    with a host capacity, the first ones that fit, as ShardedOptimizerV2 decides; else none). ``host_now``:
    the host bytes of the parameters (and the disk's fetch buffer)."""
    ex = base.extra
    numels = ex["trainable_shard_numels"]
    if policy != "auto" or host_capacity is None or not numels:
        return 0
    state_bytes = sum(numel * size for numel, size in ex["optim_families"][0].values())
    grads = 0 if reuse else len(numels) * numels[0] * dtype.itemsize
    # a rule streaming whole chunks takes buffers of one shard (4 bytes an element at most) where larger
    buffer_bytes = max(4 * numels[0], disk.buffer_size) if ex["whole_chunks"] else disk.buffer_size
    free = host_capacity - host_now - grads - disk.buffer_count * streamed * buffer_bytes
    return min(max(free, 0) // state_bytes, len(numels))


def _pool_buffer_bytes(base: PolicyPlan, optim_on_disk: set[int], param_disk: bool, param_kept: frozenset[int],
                       dtype: torch.dtype, disk: DiskSettings) -> int:
    """Bytes of each buffer of the streamed step's pool: ``buffer_size``, or with whole chunks streamed at least one
    shard of the widest family a chunk on disk reads or writes (the disk step's ``stream_shape``)."""
    ex = base.extra
    nbytes = disk.buffer_size
    if not ex["whole_chunks"]:
        return aligned_nbytes(nbytes)
    for k in optim_on_disk:
        widths = [size for family, (_, size) in ex["optim_families"][k].items()
                  if family != MASTER and family not in ex["in_memory_families"]]
        if ex["has_master"]:
            widths.append(4)
        if param_disk and ex["trainable_index"][k] not in param_kept:
            widths.append(dtype.itemsize)
        elif disk.atomic_step and not ex["has_master"]:
            widths.append(4)  # the journal of the parameters overwritten in host memory
        nbytes = max(nbytes, aligned_nbytes(max(widths) * ex["trainable_shard_numels"][k]))
    return aligned_nbytes(nbytes)


def place_bytes(base: PolicyPlan, policy: str, reuse: bool, optim_disk: bool, param_disk: bool, disk: DiskSettings,
                dtype: torch.dtype, host_capacity: int | None) -> Placed:
    """Where the meta run ``base``'s bytes rest once the disk variant moves parameters and optimizer state to
    disk (under ``auto`` with a host capacity the first chunks that fit stay on the host, as ShardedModelV2 and
    ShardedOptimizerV2 decide)."""
    ex = base.extra
    tier_bytes = {"device": dict(base.tier_bytes["device"]), "host": dict(base.tier_bytes["host"]), "disk": {}}
    param_host = tier_bytes["host"].get("param", 0)
    shard_bytes = ex["param_shard_bytes"]
    param_kept: frozenset[int] = frozenset()  # auto with a host capacity: parameters resting on the host
    if param_disk and policy == "auto" and host_capacity is not None:
        trainable_flags = [i in set(ex["trainable_index"]) for i in range(base.num_chunks)]
        param_kept = param_chunks_kept_on_host(shard_bytes, trainable_flags, dtype.itemsize, host_capacity,
                                               disk.buffer_count, disk.buffer_size)
    kept_param_bytes = sum(shard_bytes[i] for i in param_kept)
    params_to_disk = param_disk and len(param_kept) < base.num_chunks
    if param_disk:
        tier_bytes["host"]["param"] = kept_param_bytes
        tier_bytes["disk"]["param"] = param_host - kept_param_bytes
    io = aligned_nbytes(disk.buffer_size)
    optim_on_disk: set[int] = set()
    optim_disk_bytes = 0
    if optim_disk:  # (else the state off the device rests on the host, as the meta run counted it)
        host_now = param_host if not param_disk else kept_param_bytes + (io if params_to_disk else 0)
        streamed = streamed_count(_streamed_families(base), ex["has_master"], param_disk, disk.atomic_step)
        kept = _kept_on_host(base, policy, host_capacity, reuse, dtype, host_now, disk, streamed)
        optim_on_disk, optim_disk_bytes = _state_to_disk(base, tier_bytes, kept)
    on_disk_numel = sum(ex["trainable_shard_numels"][k] for k in optim_on_disk)
    disk_io = 0
    if optim_on_disk or params_to_disk:  # (the optimizer "on disk" with every chunk's state on the host: none)
        disk_io = io  # the in-line buffer (the initial values written to the files, whole-region reads)
        if optim_on_disk:  # the streamed step's pool: buffers for the parameters too if a chunk it streams has them
            params_streamed = param_disk and any(ex["trainable_index"][k] not in param_kept for k in optim_on_disk)
            disk_io += disk.buffer_count * _pool_buffer_bytes(base, optim_on_disk, param_disk, param_kept, dtype,
                                                              disk) * streamed_count(
                _streamed_families(base), ex["has_master"], params_streamed, disk.atomic_step)
        disk_io += io if params_to_disk else 0  # the fetch thread's buffer
        tier_bytes["host"]["disk_io"] = disk_io
    for tier in tier_bytes:
        tier_bytes[tier] = {f: n for f, n in sorted(tier_bytes[tier].items()) if n}
    if not (optim_disk or param_disk):
        del tier_bytes["disk"]
    return Placed(tier_bytes, param_host, param_kept, kept_param_bytes, optim_on_disk, on_disk_numel, disk_io,
                  optim_disk_bytes)


def bytes_per_rank(base: PolicyPlan, placed: Placed, world: int) -> list[dict[str, dict[str, int]]]:
    """Each of the ``world`` ranks' ``tier_bytes`` of a disk variant (``placed``: rank 0's). The ranks' shards
    differ only in the families kept in memory (an 8-bit Adam's block scales and small parameters' moments: where
    the shard boundaries fall), which stay where the meta run ``base`` counted them: each rank's are rank 0's plus
    its difference there (none where the meta run counted one rank's)."""
    families = base.extra["in_memory_families"]
    ranks = base.tier_bytes_per_rank or [base.tier_bytes] * world
    out = []
    for rank in ranks:
        tiers = {tier: dict(held) for tier, held in placed.tier_bytes.items()}
        for tier in ("device", "host"):
            for family in families:
                value = tiers[tier].get(family, 0) + rank[tier].get(family, 0) - ranks[0][tier].get(family, 0)
                if value:
                    tiers[tier][family] = value
        out.append({tier: dict(sorted(held.items())) for tier, held in tiers.items()})
    return out


def _state_to_disk(base: PolicyPlan, tier_bytes: dict[str, dict[str, int]], kept: int) -> tuple[set[int], int]:
    """Move the optimizer families of the chunks off the device, but the first ``kept``, from the host to disk in
    ``tier_bytes`` (those kept in memory stay on the host); returns those chunks (by trainable position) and the
    bytes of their families on disk."""
    ex = base.extra
    states = ex["optim_families"]
    families = {family for state in states for family in state}
    for family in families:
        tier_bytes["host"].pop(family, None)
    off = [k for k, on in enumerate(ex["optim_on_device"]) if not on]
    on_disk, disk_bytes = set(), 0
    for position, k in enumerate(off):
        to_disk = position >= kept
        if to_disk:
            on_disk.add(k)
        for family, (numel, size) in states[k].items():
            tier = "disk" if to_disk and family not in ex["in_memory_families"] else "host"
            tier_bytes[tier][family] = tier_bytes[tier].get(family, 0) + numel * size
            disk_bytes += numel * size if tier == "disk" else 0
    return on_disk, disk_bytes


def disk_file_bytes(base: PolicyPlan, disk: DiskSettings, param_disk: bool, param_kept: int,
                    optim_on_disk: set[int]) -> int:
    """The bytes of the disk tier's files: regions (two slots with ``atomic_step``) for the chunks whose
    parameters (all but ``param_kept``) or optimizer state (the trainable chunks ``optim_on_disk``) rest on disk
    only, as ShardedOptimizerV2 reserves them: a family of one fp32 element per element (the master, Adam's
    moments) a full-size chunk's region, another (8-bit codes) its own bytes; the journal of parameters that are
    their own masters (one slot)."""
    ex = base.extra
    world = ex["world"]
    slots = 2 if disk.atomic_step else 1
    full = ex["chunk_numel"] // world
    files = 0
    if param_disk:
        files += aligned_nbytes(base.chunk_bytes // world) * slots * (base.num_chunks - param_kept)
    for k in optim_on_disk:
        shard = ex["trainable_shard_numels"][k]
        for family, (numel, size) in ex["optim_families"][k].items():
            if family not in ex["in_memory_families"]:
                files += aligned_nbytes(full * 4 if numel == shard and size == 4 else numel * size) * slots
        if not ex["has_master"] and disk.atomic_step:
            files += aligned_nbytes(full * 4)
    return files


def disk_traffic(base: PolicyPlan, param_disk: bool, placed: Placed
                 ) -> tuple[int, list[int], int, int, list[int]]:
    """A step's disk traffic: bytes the step reads, bytes it writes on each rank (rank ``r`` at index ``r``: they
    differ by the 8-bit codes' pages around the blocks the rank's shard boundaries cut, which it writes again),
    bytes the forward and backward read (the parameters resting on disk), bytes still moved to the device from the
    host (those kept there), and the parameter bytes of each chunk the step loads into host memory to update it
    outside the streamed step."""
    ex = base.extra
    shard_bytes = ex["param_shard_bytes"]
    param_kept, optim_on_disk = placed.param_kept, placed.optim_on_disk
    read = written = read_compute = 0
    moved_to_device = base.moved_to_device_per_step
    if param_disk:  # the forward's and backward's fetches of chunks resting on disk come from the files
        fetched = [0 if ex["param_on_device"][i] else n * shard_bytes[i] for i, n in enumerate(ex["fetches"])]
        read_compute = sum(b for i, b in enumerate(fetched) if i not in param_kept)
        moved_to_device = sum(b for i, b in enumerate(fetched) if i in param_kept)
    read += placed.optim_disk_bytes  # the streamed step: the families on disk, read and written
    written += placed.optim_disk_bytes
    # parameter chunks on disk: the step writes each back; it reads it too, except where the streamed
    # step (the chunk's optimizer state on disk) writes 16-bit parameters as its output; one updated
    # outside the streamed step is read into host memory first
    param_chunks = [(k, i) for k, i in enumerate(ex["trainable_index"])
                    if param_disk and not ex["param_on_device"][i] and i not in param_kept]
    written += sum(shard_bytes[i] for _, i in param_chunks)
    read += sum(shard_bytes[i] for k, i in param_chunks if not (ex["has_master"] and k in optim_on_disk))
    loaded = [shard_bytes[i] for k, i in param_chunks if k not in optim_on_disk]
    written_per_rank = [written + sum(rewritten[k] for k in optim_on_disk) for rewritten in ex["rewritten_per_rank"]]
    return read, written_per_rank, read_compute, moved_to_device, loaded


def host_peak(base: PolicyPlan, placed: Placed, param_disk: bool, optim_disk: bool, loaded: list[int]) -> int:
    """The most chunk bytes on the host at once: the meta run's, less the parameters gone to disk, plus the
    optimizer state (the largest rank's) and I/O buffers on the host, the largest parameter chunk loaded from disk
    for its update (``loaded``), and the host copies of parameters resting on the device that the host's Adam
    updates."""
    ex = base.extra
    families = {family for state in ex["optim_families"] for family in state}
    ranks = bytes_per_rank(base, placed, 1) if optim_disk or param_disk else \
        base.tier_bytes_per_rank or [placed.tier_bytes]
    state_on_host = max(sum(n for f, n in rank["host"].items() if f in families) for rank in ranks)  # the largest
    peak = ex["host_peak_meta"] - (placed.param_host - placed.kept_param_bytes if param_disk else 0) + \
        state_on_host + placed.disk_io
    peak += max(loaded, default=0)
    # a chunk whose parameters rest on the device and whose Adam runs on the host ('static') is updated in
    # a host copy of its parameters: one at a time, or all of them in the streamed disk step
    copies = [ex["param_shard_bytes"][i] for k, i in enumerate(ex["trainable_index"])
              if ex["param_on_device"][i] and not ex["optim_on_device"][k]]
    peak += sum(copies) if optim_disk else max(copies, default=0)
    return peak
