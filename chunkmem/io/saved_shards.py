"""The rank files of a sharded checkpoint as a whole: where each saved parameter lies and which file holds each
of its elements (:class:`SavedLayout`), and the fields of a saved chunk entry (its optimizer state, its
parameters' step counts and scalar state, as files of every version hold them).

Every rank file holds, per chunk of the model that saved it, that rank's shard of each family (the parameters in
the chunk's dtype, the fp32 masters, the optimizer's state) and the chunk's table of parameters (name, offset and
numel in elements, shape), so where each parameter lies is known from any one file, and which file holds each of
its elements from the shard bounds of its chunk. Read by the load into another layout
(:mod:`chunkmem.io.resharding`, :mod:`chunkmem.io.low_bit_resharding`) and by
:func:`~chunkmem.consolidate_checkpoint`.
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.chunk import MASTER
from ..errors import CheckpointError
from ..state_dicts import check_tensor_data

PARAM = "param"
"""The family name of a saved chunk's parameter values (chunk dtype) in a rank file."""

__all__ = ["PARAM", "SavedLayout", "entry_fits_rule", "saved_slot_scalars", "saved_slot_steps", "saved_state"]


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

    def holders(self, n: int) -> list[tuple[int, int, int]]:
        """``(rank, start, end)``: which rank file holds which elements of saved chunk ``n``, in rank order (a
        chunk whole on every rank, of persistent parameters, is read from rank 0's)."""
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
        for rank, shard_start, shard_end in self.holders(n):
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
