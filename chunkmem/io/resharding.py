"""Loading a sharded checkpoint into another layout: another world size, chunk size or trimming.

Every rank file of a sharded checkpoint holds, per chunk of the model that saved it, that rank's shard of
each family (the parameters in the chunk's dtype, the fp32 masters, the optimizer's per-element state)
and the chunk's table of parameters (name, offset and numel in elements). Where each parameter lies in the
saved layout is therefore known from any one file, and which file holds each of its elements from the
shard bounds of its chunk. A load into another layout builds this rank's shard of every chunk of the
loading model, family by family, parameter by parameter, from the saved shards that hold the elements;
elements of a shard that belong to no parameter (padding) are zero. The rank files are memory-mapped
(``torch.load(mmap=True)``), so a rank reads only the byte ranges it copies, and holds one chunk's shard
of one family at a time.

:func:`plan_resharded_load` checks everything first (every parameter found with its shape, trainable
alike, every tensor of its shard's size, the optimizer's state of one kind and step) and returns the
function that writes; :mod:`chunkmem.io.checkpoint` decides when it is used (the saved world size or
layout differs from the model's) and verifies the files.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.chunk import Chunk, MASTER
from ..errors import CheckpointError, InvalidArgumentError, UnsupportedOperationError
from ..state_dicts import bump_versions, check_tensor_data, first_few, warn_if_masters_lose_precision

PARAM = "param"
"""The family name of a saved chunk's parameter values (chunk dtype) in a rank file."""

__all__ = ["SavedLayout", "plan_resharded_load"]


def saved_state(entry: dict[str, Any]) -> dict[str, Any]:
    """A rank file chunk entry's optimizer state by family: Adam's moments, or another optimizer's ``"state"``
    (an 8-bit Adam's codes, scales and fp32 moments)."""
    return entry["state"] if "state" in entry else {"exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}


def entry_fits_rule(entry: dict[str, Any], rule: Any, families: tuple[str, ...]) -> bool:
    """Whether a rank file chunk entry holds the state ``rule`` (an :class:`~chunkmem.optim.update_rule.UpdateRule`)
    keeps: its ``families``, in the same fields."""
    return (tuple(saved_state(entry)) == tuple(families) and rule.keeps_slot_state == ("whole" in entry)
            and rule.state_field == ("state" in entry))


def saved_slot_steps(entry: dict[str, Any]) -> list[int]:
    """The optimizer steps each parameter of a saved chunk took, in the order of its ``slots`` (checkpoints
    written before 2026-11-27 hold one ``step`` for the whole chunk)."""
    steps = entry.get("slot_steps")
    return list(steps) if steps is not None else [entry["step"]] * len(entry["slots"])


def saved_slot_scalars(entry: dict[str, Any], groups: list[int | None]) -> dict[int, dict[str, Any]]:
    """Another optimizer's scalar state of each parameter of a saved chunk that has stepped, by its position
    in the chunk's ``slots`` (the file's own dicts, not copied). Checkpoints written before 2026-11-27 hold
    one ``"scalars"`` per param group instead: each parameter of the group that has stepped takes it
    (``groups``: each slot's param group, ``None`` for one in none)."""
    if "slot_scalars" in entry:
        return dict(entry["slot_scalars"])
    return {position: entry["scalars"][group]
            for position, (group, count) in enumerate(zip(groups, saved_slot_steps(entry)))
            if count and group in entry["scalars"]}


class SavedLayout:
    """The chunks of a sharded checkpoint as its rank files hold them: ``parts`` are the rank files'
    payloads in rank order (``files`` their names, for errors). Reads any element range of any saved
    parameter from the shards that hold it (:meth:`read`)."""

    def __init__(self, parts: list[dict[str, Any]], files: list[str]) -> None:
        self.parts, self.files = parts, files
        self.chunks = parts[0]["model"]["chunks"]
        self.where: dict[str, tuple[int, dict[str, Any]]] = {}
        for n, entry in enumerate(self.chunks):
            for slot in entry["slots"]:
                self.where[slot["name"]] = (n, slot)
        tables = [[(e["numel"], e["dtype"], e["trainable"], e["slots"]) for e in part["model"]["chunks"]]
                  for part in parts]
        for rank, table in enumerate(tables):
            if table != tables[0]:
                raise CheckpointError(f"{files[rank]}: its chunks' parameter tables differ from {files[0]}'s: the "
                                      f"rank files are not of one save")
        for rank, part in enumerate(parts):
            for n, entry in enumerate(part["model"]["chunks"]):
                end = entry["shard_offset"] + entry["shard_numel"]
                if entry["shard_offset"] < 0 or end > entry["numel"]:
                    raise CheckpointError(f"{files[rank]}: model.chunks[{n}] has the shard [{entry['shard_offset']}, "
                                          f"{end}) of a chunk of {entry['numel']} elements")

    def _holders(self, n: int) -> list[tuple[int, int, int]]:
        """``(rank, start, end)``: which rank file holds which elements of saved chunk ``n`` (a chunk whole
        on every rank, of persistent parameters, is read from rank 0's)."""
        first = self.parts[0]["model"]["chunks"][n]
        if first["shard_numel"] == first["numel"]:
            return [(0, 0, first["numel"])]
        holders = []
        for rank, part in enumerate(self.parts):
            entry = part["model"]["chunks"][n]
            holders.append((rank, entry["shard_offset"], entry["shard_offset"] + entry["shard_numel"]))
        return holders

    def family(self, rank: int, n: int, family: str) -> torch.Tensor | None:
        """Rank ``rank``'s saved shard of chunk ``n``'s ``family`` (``None``: not saved, e.g. no masters)."""
        entry = self.parts[rank]["model"]["chunks"][n]
        if family in (PARAM, MASTER):
            return entry[family]
        return saved_state(entry).get(family)

    def read(self, family: str, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, end)`` of the saved parameter ``name``'s ``family`` into ``out``
        (``end - start`` elements). Masters a chunk was saved without are its parameter values."""
        n, slot = self.where[name]
        low, high = slot["offset"] + start, slot["offset"] + end
        covered = 0
        for rank, shard_start, shard_end in self._holders(n):
            a, b = max(low, shard_start), min(high, shard_end)
            if a >= b:
                continue
            source = self.family(rank, n, family)
            if source is None and family == MASTER:
                source = self.family(rank, n, PARAM)
            out[a - low:b - low].copy_(source[a - shard_start:b - shard_start])
            covered += b - a
        if covered != end - start:
            raise CheckpointError(f"the saved shards of chunk {n} do not cover elements [{low}, {high}) of "
                                  f"{name!r}: the rank files are not of one save")

    def check_tensors(self, families: tuple[str, ...]) -> None:
        """Raise naming the file and field unless every saved shard of ``families`` (and the parameters)
        is a floating tensor of its shard's size."""
        for rank, part in enumerate(self.parts):
            for n, entry in enumerate(part["model"]["chunks"]):
                for family in (PARAM, MASTER, *(families if entry["trainable"] else ())):
                    value = self.family(rank, n, family)
                    if value is not None:
                        check_tensor_data(f"{self.files[rank]}: model.chunks[{n}][{family!r}]", value,
                                          floating=True, numel=entry["shard_numel"])


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
    families: tuple[str, ...] = ()
    if optimizer is not None:
        families = _check_optimizer_state(path, model, optimizer, saved)
    saved.check_tensors(families)
    steps = _steps_by_name(path, saved) if optimizer is not None else {}
    scalars = {c.index: _scalars_of(c, saved, optimizer) for c in model.chunks if c.trainable} \
        if optimizer is not None and optimizer.update_rule.keeps_slot_state else {}

    def assemble(chunk: Chunk, family: str, dtype: torch.dtype) -> torch.Tensor:
        shard = torch.zeros(chunk.shard_numel, dtype=dtype)
        for slot in chunk.slots:
            part = chunk.own_range(slot)
            if part is not None:
                start = slot.offset + part[0] - chunk.shard_offset
                saved.read(family, slot.name, part[0], part[1], shard[start:start + part[1] - part[0]])
        return shard

    saved_masters = any(e[MASTER] is not None for e in saved.chunks)

    def apply() -> None:
        for chunk in model.chunks:
            model.runtime.write_params(chunk, assemble(chunk, PARAM, chunk.dtype))
            bump_versions(slot.param for slot in chunk.slots)
            if chunk.has_master and chunk.optim[MASTER].allocated:
                chunk.optim[MASTER].write(assemble(chunk, MASTER, torch.float32))
            elif saved_masters:
                warn_if_masters_lose_precision(chunk, chunk.name, assemble(chunk, MASTER, torch.float32))
        if optimizer is None:
            return
        if load_small_state is not None:
            load_small_state()
        for chunk in model.chunks:
            if not chunk.trainable:
                continue
            for family in chunk.state_families:
                chunk.optim[family].write(assemble(chunk, family, torch.float32))
            if optimizer.update_rule.keeps_slot_state:
                optimizer.replace_kept_state(chunk, scalars[chunk.index], {})
            chunk.steps = {slot.index_in_chunk: steps[slot.name] for slot in chunk.slots if steps.get(slot.name)}
    return apply


def _check_optimizer_state(path: str, model: Any, optimizer: Any, saved: SavedLayout) -> tuple[str, ...]:
    """The optimizer's per-element families, after checking that the saved state is of the same kind and
    can be split anew (no whole-parameter state)."""
    families = next((c.state_families for c in model.chunks if c.trainable), ())
    refusal = optimizer.update_rule.why_not_resharded
    if refusal is not None and any(entry["trainable"] for entry in saved.chunks):
        raise UnsupportedOperationError(f"loading the sharded checkpoint {path} into another layout (world size, "
                                        f"chunk size or trimming) with {refusal}: load it with the world size and "
                                        f"chunk size that saved it, or save a full checkpoint (sharded=False), "
                                        f"which loads into any layout")
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
