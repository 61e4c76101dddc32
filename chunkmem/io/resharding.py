"""Loading a sharded checkpoint into another layout: another world size, chunk size or trimming.

Every rank file of a sharded checkpoint holds, per chunk of the model that saved it, that rank's shard of
each family (the parameters in the chunk's dtype, the fp32 masters, the optimizer's per-element state)
and the chunk's table of parameters (name, offset and numel in elements). Where each parameter lies in the
saved layout is therefore known from any one file, and which file holds each of its elements from the
shard bounds of its chunk. A load into another layout builds this rank's shard of every chunk of the
loading model, family by family, parameter by parameter, from the saved shards that hold the elements;
elements of a shard that belong to no parameter (padding) are zero. The rank files are memory-mapped
(``torch.load(mmap=True)``), so a rank reads only the byte ranges it copies, and holds one chunk's shard
of one family at a time (:class:`~chunkmem.io.saved_shards.SavedLayout`). An 8-bit Adam's state is not laid out
by element (its block scales and small parameters' moments are per piece of a shard): it is read back parameter
by parameter whole and cut again for the loading shard (:mod:`chunkmem.io.low_bit_resharding`).

:func:`plan_resharded_load` checks everything first (every parameter found with its shape, trainable
alike, every tensor of its shard's size, the optimizer's state of one kind and step) and returns the
function that writes; :mod:`chunkmem.io.checkpoint` decides when it is used (the saved world size or
layout differs from the model's) and verifies the files.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.chunk import Chunk, MASTER
from ..errors import CheckpointError, InvalidArgumentError
from ..optim.low_bit_rule import LowBitAdamRule
from ..state_dicts import bump_versions, first_few, warn_if_masters_lose_precision
from .low_bit_resharding import SavedLowBitState
from .saved_shards import PARAM, SavedLayout, entry_fits_rule, saved_slot_scalars, saved_slot_steps, saved_state

__all__ = ["plan_resharded_load"]


def plan_resharded_load(path: str, model: Any, optimizer: Any, saved: SavedLayout,
                        load_small_state: Callable[[], None] | None) -> Callable[[], None]:
    """Check that ``saved`` (a sharded checkpoint at ``path``) holds every parameter of ``model`` (a
    ``ShardedModelV2``) and, with ``optimizer``, state of its kind, then return the function that writes
    this rank's shards of everything into the model's chunks (``load_small_state``: the optimizer's
    hyper-parameters and scaler, checked by the caller). Raises before anything is written."""
    parts = saved.parts
    first = parts[0]["model"]
    dtype_name = str(model.dtype).replace("torch.", "")
    if first["dtype"] != dtype_name:
        raise InvalidArgumentError("model", f"a model of dtype {dtype_name}",
                                   f"a model of dtype {first['dtype']}, the sharded checkpoint's (a full checkpoint "
                                   f"loads into any dtype)")
    slots = [s for c in model.chunks for s in c.slots]
    own_names = {s.name for s in slots}
    missing = sorted(own_names - set(saved.where))
    extra = sorted(set(saved.where) - own_names)
    if missing or extra:
        raise InvalidArgumentError("path", path, f"a checkpoint of this model's parameters (the model has "
                                                 f"{first_few(missing)} that it lacks, it has {first_few(extra)} "
                                                 f"that the model lacks)")
    for chunk in model.chunks:
        for slot in chunk.slots:
            n, entry = saved.where[slot.name]
            if entry["numel"] != slot.numel or list(entry["shape"]) != list(slot.shape):
                raise InvalidArgumentError(f"{path}: {slot.name!r}", f"shape {entry['shape']}",
                                           f"shape {list(slot.shape)}, the model's")
            if saved.chunks[n]["trainable"] != chunk.trainable:
                raise InvalidArgumentError(f"{path}: {slot.name!r}", f"trainable={saved.chunks[n]['trainable']}",
                                           f"trainable={chunk.trainable}, as in the model (freeze the same "
                                           f"parameters before building the model and loading)")
    write_state = None
    if optimizer is not None:
        write_state = _state_writer(path, model, optimizer, saved)  # the saved tensors checked
    else:
        saved.check_tensors(())
    steps = _steps_by_name(path, saved) if optimizer is not None else {}
    scalars = {c.index: _scalars_of(c, saved, optimizer) for c in model.chunks if c.trainable} \
        if optimizer is not None and optimizer.update_rule.keeps_slot_state else {}
    saved_masters = any(e[MASTER] is not None for e in saved.chunks)

    def apply() -> None:
        for chunk in model.chunks:
            model.runtime.write_params(chunk, _assemble(saved, chunk, PARAM, chunk.dtype))
            bump_versions(slot.param for slot in chunk.slots)
            if chunk.has_master and chunk.optim[MASTER].allocated:
                chunk.optim[MASTER].write(_assemble(saved, chunk, MASTER, torch.float32))
            elif saved_masters:
                warn_if_masters_lose_precision(chunk, chunk.name, _assemble(saved, chunk, MASTER, torch.float32))
        if optimizer is None:
            return
        if load_small_state is not None:
            load_small_state()
        for chunk in model.chunks:
            if not chunk.trainable:
                continue
            write_state(chunk)
            if optimizer.update_rule.keeps_slot_state:
                optimizer.replace_kept_state(chunk, scalars[chunk.index], {})
            chunk.steps = {slot.index_in_chunk: steps[slot.name] for slot in chunk.slots if steps.get(slot.name)}
    return apply


def _assemble(saved: SavedLayout, chunk: Chunk, family: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of ``chunk``'s per-element ``family`` (``dtype``) from the saved shards: each parameter's
    elements in it read where they were saved, padding zero."""
    shard = torch.zeros(chunk.shard_numel, dtype=dtype)
    for slot in chunk.slots:
        part = chunk.own_range(slot)
        if part is not None:
            start = slot.offset + part[0] - chunk.shard_offset
            saved.read(family, slot.name, part[0], part[1], shard[start:start + part[1] - part[0]])
    return shard


def _state_writer(path: str, model: Any, optimizer: Any, saved: SavedLayout) -> Callable[[Chunk], None]:
    """What writes this rank's optimizer state families of a trainable chunk of ``model``, after checking the saved
    state and every saved tensor (raises before anything is written): each per-element family cut anew by
    element, or an 8-bit Adam's families cut anew from each parameter's whole state
    (:mod:`chunkmem.io.low_bit_resharding`)."""
    families = _check_optimizer_state(path, model, optimizer, saved)
    if isinstance(optimizer.update_rule, LowBitAdamRule):
        saved.check_tensors(())  # the parameters and masters; the 8-bit families:
        reader = SavedLowBitState(saved)
        reader.check()

        def write_low_bit(chunk: Chunk) -> None:
            moments = ((slot, reader.moments(slot.name)) for slot in chunk.slots if chunk.own_range(slot) is not None)
            for family, values in optimizer.update_rule.families_of_moments(chunk, moments).items():
                chunk.optim[family].write(values)
        return write_low_bit
    saved.check_tensors(families)

    def write(chunk: Chunk) -> None:
        for family in chunk.state_families:
            chunk.optim[family].write(_assemble(saved, chunk, family, torch.float32))
    return write


def _check_optimizer_state(path: str, model: Any, optimizer: Any, saved: SavedLayout) -> tuple[str, ...]:
    """The optimizer's per-element families, after checking that the saved state is of the same kind and
    can be split anew (no whole-parameter state)."""
    families = next((c.state_families for c in model.chunks if c.trainable), ())
    for n, entry in enumerate(saved.chunks):
        if not entry["trainable"]:
            continue
        if not entry_fits_rule(entry, optimizer.update_rule, families):
            raise InvalidArgumentError(f"{path}: model.chunks[{n}]: the optimizer state",
                                       f"families {list(saved_state(entry))}",
                                       f"the optimizer's {list(families)} (save and load with one optimizer class)")
        if entry.get("whole"):
            raise InvalidArgumentError("path", path, "a sharded checkpoint without whole-parameter optimizer state "
                                                     "(Adafactor-like factors) to load into another layout; load it "
                                                     "with the layout and world size that saved it")
    return tuple(families)


def _sources(chunk: Chunk, saved: SavedLayout) -> list[int]:
    """The saved chunks that hold ``chunk``'s parameters, in order, each once."""
    seen: list[int] = []
    for slot in chunk.slots:
        n = saved.where[slot.name][0]
        if n not in seen:
            seen.append(n)
    return seen


def _steps_by_name(path: str, saved: SavedLayout) -> dict[str, int]:
    """Each saved parameter's optimizer steps, by name (a parameter keeps its count whatever chunk it lands in)."""
    steps: dict[str, int] = {}
    for n, entry in enumerate(saved.chunks):
        counts = saved_slot_steps(entry)
        if len(counts) != len(entry["slots"]) or any(not isinstance(c, int) or c < 0 for c in counts):
            raise InvalidArgumentError(f"{path}: model.chunks[{n}]['slot_steps']", counts,
                                       f"{len(entry['slots'])} integers >= 0, one per parameter of the chunk")
        steps.update((slot["name"], count) for slot, count in zip(entry["slots"], counts))
    return steps


def _scalars_of(chunk: Chunk, saved: SavedLayout, optimizer: Any) -> dict[int, dict[str, Any]]:
    """Another optimizer's scalar state of each of ``chunk``'s parameters that has stepped, by its position in
    ``chunk``: its own, from the saved chunk that holds it (a checkpoint saved before 2026-11-27: its saved
    chunk's value for its param group)."""
    group_of_name = {slot.name: optimizer.group_of(slot.param) for c in optimizer.model.chunks for slot in c.slots}
    kept: dict[int, dict[str, Any]] = {}
    for slot in chunk.slots:
        n, saved_slot = saved.where[slot.name]
        entry = saved.chunks[n]
        position = entry["slots"].index(saved_slot)
        scalars = saved_slot_scalars(entry, [group_of_name.get(s["name"]) for s in entry["slots"]])
        if position not in scalars:
            continue
        state = scalars[position]
        if not isinstance(state, dict):
            raise CheckpointError(f"{saved.files[0]}: model.chunks[{n}]['slot_scalars'][{position!r}] is a "
                                  f"{type(state).__name__}, expected a dict of the optimizer's state")
        kept[slot.index_in_chunk] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return kept
