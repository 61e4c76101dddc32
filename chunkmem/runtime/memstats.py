"""Memory statistics: what the tracer and the runtime saw, as a JSON document and a text summary.

Schema ``chunkmem.memstats/1`` (every size in bytes, chunk ids are chunk indices):

* ``schema``, ``rank``, ``world_size``, ``policy`` (placement name), ``capacity_bytes`` (device tier),
  ``iterations`` (training iterations begun), ``traces`` (of them traced), ``steady_iterations`` (of them
  followed with every chunk resident throughout: their periods were not walked, see ``last_iteration``),
  ``last_iteration_mode``
  (``tracing``, ``following``, ``diverged``, ``untraced``, ``idle``, or ``interrupted``: the last
  iteration stopped on an error, and what it held was released).
* ``chunks``: ``count``, ``numel`` (elements of the largest chunk: the chunk size), ``shard_numel`` (of it,
  the elements this rank keeps: ``numel / world_size``), ``param_bytes`` (its full parameters; the
  ``auto`` plan gives every chunk a slot this size), ``numels`` (elements of each chunk: the last chunk of
  each kind holds only its parameters), ``dtype``, ``trainable`` (ids of chunks with trainable parameters).
* ``periods``: one per period of the traced schedule, in order: ``index``, ``name`` (module),
  ``phase`` (``forward``/``backward``), ``chunks`` (ids that had to be on the device),
  ``non_model_peak_bytes`` (traced), ``grads_started``/``grads_finished`` (ids), and, from the last
  iteration (``null`` where it did not reach that period): ``device_model_bytes`` (peak chunk bytes on
  the device), ``host_model_bytes`` (chunk bytes on the host at the period's end),
  ``moved_to_device_bytes``, ``moved_to_host_bytes``; under ``auto``: ``plan`` with ``slots`` (chunks
  that fit), ``evict`` and ``fetch`` (ids), and ``fallback`` (the period's chunks did not fit its slots:
  it runs as under ``cpu``).
* ``last_iteration``: the same per-period figures for every period the last iteration ran (also when
  it left the schedule): ``name``, ``phase``, ``device_model_bytes``, ``host_model_bytes``,
  ``moved_to_device_bytes``, ``moved_to_host_bytes``. A steady iteration walks no period (nothing can move:
  ``cuda`` placement, or a plan that moves nothing), so after one these are the last walked iteration's.
* ``totals``: ``moved_to_device_bytes`` and ``moved_to_host_bytes`` of the last iteration,
  ``peak_device_bytes`` (chunk bytes, largest over its periods), ``peak_device_with_non_model_bytes``.
* ``tiers``: chunk bytes now, ``{"device": {family: bytes}, "host": {...}}``, and ``"disk": {...}`` when
  the model has a disk tier (the host figure then includes ``disk_io``, its I/O buffers).
* ``disk``: ``null`` without a disk tier, else ``path`` (its private directory), ``file_bytes`` (what
  its files occupy), ``read_bytes`` and ``written_bytes`` (moved so far), ``atomic_step``.
* ``block_pool``: ``null`` with CUDA (or the pool off), else ``cached_bytes`` (freed chunk buffers kept
  for reuse) and ``blocks_mapped`` (mappings made so far); see :mod:`chunkmem.core.block_pool`.
* ``copy_engine``: ``engine`` (its name, :mod:`chunkmem.core.copy_engine`), ``host_waits`` (site -> times the
  host blocked on a copy, cumulative over the process's models using that engine; a site ending in
  ``in backward`` was inside autograd's hooks), ``staging_waits`` (waits for a pinned staging buffer),
  ``pinned_bytes`` (this model's pinned host blocks, in use or kept), ``pinned_in_use_bytes``,
  ``pinned_fallback_bytes`` (host buffers left pageable past the budget), ``pinned_budget_bytes``,
  ``process_pinned_bytes`` (every model's); the pinned figures are 0 without CUDA.
* ``optimizer``: ``device_chunks``, ``host_chunks`` and ``disk_chunks`` (ids by where their optimizer
  state lives), ``device_bytes``, ``host_bytes`` and ``disk_bytes`` (fp32 masters, exp_avg,
  exp_avg_sq), ``margin_bytes`` and
  ``gpu_margin_mem_ratio`` (``auto``).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from ..core.chunk import MASTER
from ..core.tiers import Tier
from ..storage.atomic_file import write_json_atomically

logger = logging.getLogger("chunkmem")

SCHEMA = "chunkmem.memstats/1"


def collect(runtime: Any, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """The statistics document (see the module docstring) for one model's runtime."""
    scheduler = runtime.scheduler
    policy = runtime.policy
    chunks = runtime.chunks
    auto = policy.plans_from_trace
    plan = runtime.state.moves
    stats = [_stats_dict(s) for s in scheduler.stats]
    periods = []
    for i, period in enumerate(scheduler.periods or []):
        entry: dict[str, Any] = {
            "index": i, "name": period.name, "phase": period.phase, "chunks": list(period.needed),
            "non_model_peak_bytes": period.non_model_peak, "grads_started": list(period.grads_started),
            "grads_finished": list(period.grads_finished)}
        matches = i < len(stats) and (stats[i]["name"], stats[i]["phase"]) == (period.name, period.phase)
        for key in ("device_model_bytes", "host_model_bytes", "moved_to_device_bytes", "moved_to_host_bytes"):
            entry[key] = stats[i][key] if matches else None
        if auto and plan is not None:
            step = plan.periods[i]
            entry["plan"] = {"slots": step.slots, "evict": list(step.evict), "fetch": list(step.fetch),
                             "fallback": step.fallback}
        periods.append(entry)
    non_model = [p["non_model_peak_bytes"] for p in periods]
    by_tier: dict[Tier, list[int]] = {Tier.DEVICE: [], Tier.HOST: [], Tier.DISK: []}
    usage = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    for chunk in chunks:
        placed = [chunk.optim[f] for f in (MASTER, *chunk.state_families) if chunk.optim[f].allocated]
        if not chunk.trainable or not placed:
            continue
        by_tier[placed[-1].tier].append(chunk.index)
        for buf in placed:
            usage[buf.tier] += buf.nbytes
    blocks, ledger, disk = runtime.memory.blocks, runtime.ledger, runtime.memory.disk
    largest = max(chunks, key=lambda c: c.numel, default=None)
    return {
        "schema": SCHEMA,
        "rank": rank,
        "world_size": world_size,
        "policy": policy.name,
        "capacity_bytes": ledger.capacity,
        "iterations": scheduler.iterations,
        "traces": scheduler.traces,
        "steady_iterations": scheduler.steady_iterations,
        "last_iteration_mode": scheduler.mode.value,
        "chunks": {
            "count": len(chunks),
            "numel": largest.numel if chunks else 0,
            "shard_numel": largest.shard_numel if chunks else 0,
            "param_bytes": largest.param.nbytes if chunks else 0,
            "numels": [c.numel for c in chunks],
            "dtype": str(chunks[0].dtype).replace("torch.", "") if chunks else None,
            "trainable": [c.index for c in chunks if c.trainable],
        },
        "periods": periods,
        "last_iteration": stats,
        "totals": {
            "moved_to_device_bytes": sum(s["moved_to_device_bytes"] for s in stats),
            "moved_to_host_bytes": sum(s["moved_to_host_bytes"] for s in stats),
            "peak_device_bytes": max((s["device_model_bytes"] for s in stats), default=0),
            "peak_device_with_non_model_bytes": max(
                (s["device_model_bytes"] + (non_model[i] if i < len(non_model) else 0)
                 for i, s in enumerate(stats)), default=0),
        },
        "tiers": runtime.memory.breakdown(),
        "block_pool": None if blocks is None else {"cached_bytes": blocks.cached_bytes,
                                                   "blocks_mapped": blocks.blocks_mapped},
        "copy_engine": _copy_engine(runtime.memory),
        "disk": None if disk is None else {
            "path": disk.path, "file_bytes": disk.file_bytes, "read_bytes": ledger.read_from_disk,
            "written_bytes": ledger.written_to_disk, "atomic_step": disk.atomic_step},
        "optimizer": {
            "device_chunks": by_tier[Tier.DEVICE], "host_chunks": by_tier[Tier.HOST], "disk_chunks": by_tier[Tier.DISK],
            "device_bytes": usage[Tier.DEVICE], "host_bytes": usage[Tier.HOST], "disk_bytes": usage[Tier.DISK],
            "margin_bytes": scheduler.margin_bytes,
            "gpu_margin_mem_ratio": runtime.state.margin_ratio if auto else None,
        },
    }


def _stats_dict(stats: Any) -> dict[str, Any]:
    return {"name": stats.name, "phase": stats.phase, "device_model_bytes": stats.device_model_peak,
            "host_model_bytes": stats.host_model_bytes, "moved_to_device_bytes": stats.moved_to_device,
            "moved_to_host_bytes": stats.moved_to_host}


def dump(doc: dict[str, Any], filename: str) -> str:
    """Write ``doc`` as JSON to ``filename`` (with ``.rank{N}`` before the extension when it is one rank's of
    several), log its :func:`summary`, and return the path written (``ShardedModelV2.dump_memory_stats``)."""
    if doc["world_size"] > 1:
        root, ext = os.path.splitext(filename)
        filename = f"{root}.rank{doc['rank']}{ext}"
    write_json_atomically(doc, filename)
    logger.info("%s\n  written to %s", summary(doc), filename)
    return filename


def summary(doc: dict[str, Any]) -> str:
    """A few lines for the log."""
    mib = 2**20
    totals, chunks, optim = doc["totals"], doc["chunks"], doc["optimizer"]
    lines = [
        f"chunkmem memory stats (rank {doc['rank']}): policy {doc['policy']}, capacity "
        f"{doc['capacity_bytes'] / mib:.1f} MiB, {chunks['count']} chunks of {chunks['param_bytes'] / mib:.2f} MiB "
        f"({chunks['dtype']}), {len(doc['periods'])} periods, {doc['traces']} trace(s) in {doc['iterations']} "
        f"iteration(s)",
        f"  last iteration ({doc['last_iteration_mode']}): peak chunk bytes on device "
        f"{totals['peak_device_bytes'] / mib:.2f} MiB, with non-model {totals['peak_device_with_non_model_bytes'] / mib:.2f}"
        f" MiB; moved to device {totals['moved_to_device_bytes'] / mib:.2f} MiB, to host "
        f"{totals['moved_to_host_bytes'] / mib:.2f} MiB",
        f"  optimizer state: {len(optim['device_chunks'])} chunk groups on device ({optim['device_bytes'] / mib:.2f} MiB),"
        f" {len(optim['host_chunks'])} on host ({optim['host_bytes'] / mib:.2f} MiB), {len(optim['disk_chunks'])} on "
        f"disk ({optim['disk_bytes'] / mib:.2f} MiB)",
    ]
    if doc["disk"] is not None:
        disk = doc["disk"]
        lines.append(f"  disk tier {disk['path']}: files {disk['file_bytes'] / mib:.2f} MiB, read "
                     f"{disk['read_bytes'] / mib:.2f} MiB, written {disk['written_bytes'] / mib:.2f} MiB")
    return "\n".join(lines)


def _copy_engine(memory: Any) -> dict[str, Any]:
    from ..core.pinned import pinned_memory_budget, process_pinned_bytes

    doc: dict[str, Any] = dict(memory.copies.stats())
    if memory.pinned is not None:
        doc.update(memory.pinned.stats())
    else:
        doc.update({"pinned_bytes": 0, "pinned_in_use_bytes": 0, "pinned_fallback_bytes": 0,
                    "pinned_budget_bytes": pinned_memory_budget(), "process_pinned_bytes": process_pinned_bytes()})
    return doc
