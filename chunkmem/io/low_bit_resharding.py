"""An 8-bit Adam's state in a sharded checkpoint, read back parameter by parameter: what loading it into another
layout and :func:`~chunkmem.consolidate_checkpoint` need.

A rank file holds each chunk's state as that rank's shard lays it out (:mod:`chunkmem.optim.low_bit_layout`): the
codes by element, the scales of the blocks its pieces touch (a block cut by a shard boundary has a copy on every
rank that holds a part of it, the one scale the ranks agreed on), and its parts of the small parameters' plain
moments. Each saved shard's layout is derived again from the chunk table the files hold
(:meth:`~chunkmem.optim.low_bit_layout.ChunkStateLayout.of_shard`), so :meth:`SavedLowBitState.moments` reads the
whole state of any parameter (:data:`~chunkmem.optim.low_bit_rule.WholeMoments`): its codes from the shards that
hold its elements, each block's scale once (from the first rank that holds the block; :meth:`SavedLowBitState.check`
verifies first that every copy of a cut block's scale is the same, bit for bit), its plain moments by element.
A load into another layout cuts it again for the loading rank's shard
(:meth:`~chunkmem.optim.low_bit_rule.LowBitAdamRule.families_of_moments`); a consolidation writes it as the full
state dict does (:func:`~chunkmem.optim.low_bit_rule.state_entry`). One parameter's whole state is held at a time
(2 bytes an element and 8 bytes a block); the rank files are memory-mapped, so only the bytes used are read.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from ..errors import CheckpointError, InvalidArgumentError, UnsupportedOperationError
from ..optim.blockwise import BLOCK_SIZE, quantizes
from ..optim.low_bit_layout import ChunkStateLayout
from ..optim.low_bit_rule import (CODES_M, CODES_V, LOW_BIT_FAMILIES, PLAIN_M, PLAIN_V, SCALES_M, SCALES_V,
                                  WholeMoments, state_entry)
from .saved_shards import SavedLayout, saved_slot_steps, saved_state

FORMS = {"torchao-8bit": False, "plain-8bit": True}
"""The state-dict forms a sharded checkpoint of 8-bit state records (``optimizer.state_dict_form``), each with
whether its entries are :mod:`chunkmem.optim.low_bit_param`'s plain tensors (else torchao's ``OptimState8bit``)."""

__all__ = ["FORMS", "SavedLowBitState", "consolidated_state", "holds_low_bit_state"]


def holds_low_bit_state(saved: SavedLayout) -> bool:
    """Whether the trainable chunks of the sharded checkpoint ``saved`` hold an 8-bit Adam's state families."""
    return any(entry["trainable"] and tuple(saved_state(entry)) == LOW_BIT_FAMILIES for entry in saved.chunks
               if "state" in entry)


class SavedLowBitState:
    """The 8-bit Adam state of the sharded checkpoint ``saved`` (module docstring): call :meth:`check` once, then
    :meth:`moments` per parameter."""

    def __init__(self, saved: SavedLayout) -> None:
        self.saved = saved
        self.world = len(saved.parts)
        self._layouts: dict[tuple[int, int], ChunkStateLayout] = {}

    def layout(self, rank: int, n: int) -> ChunkStateLayout:
        """The state layout of rank ``rank``'s saved shard of chunk ``n``."""
        if (rank, n) not in self._layouts:
            entry = self.saved.parts[rank]["model"]["chunks"][n]
            slots = [(slot["offset"], slot["numel"]) for slot in entry["slots"]]
            self._layouts[rank, n] = ChunkStateLayout.of_shard(slots, entry["shard_offset"], entry["shard_numel"],
                                                               self.world)
        return self._layouts[rank, n]

    def check(self) -> None:
        """Raise :class:`~chunkmem.CheckpointError` naming the file and the field unless every trainable chunk of
        every rank file holds the 8-bit families, each of the size and dtype its shard's layout gives, and every
        copy of a cut block's scale is the same (the rank files are of one save). Reads the cut blocks' scales
        only."""
        for rank, part in enumerate(self.saved.parts):
            for n, entry in enumerate(part["model"]["chunks"]):
                if entry["trainable"]:
                    self._check_families(rank, n, entry)
        for n, entry in enumerate(self.saved.chunks):
            if entry["trainable"]:
                self._check_cut_copies(n)

    def _check_families(self, rank: int, n: int, entry: dict[str, Any]) -> None:
        where = f"{self.saved.files[rank]}: model.chunks[{n}]"
        state = saved_state(entry)
        if tuple(state) != LOW_BIT_FAMILIES:
            raise CheckpointError(f"{where}['state'] holds the families {list(state)}, expected an 8-bit Adam's "
                                  f"{list(LOW_BIT_FAMILIES)} (the rank files are not of one save)")
        layout = self.layout(rank, n)
        sizes = {CODES_M: entry["shard_numel"], CODES_V: entry["shard_numel"], SCALES_M: layout.scale_numel,
                 SCALES_V: layout.scale_numel, PLAIN_M: layout.plain_numel, PLAIN_V: layout.plain_numel}
        for family, numel in sizes.items():
            value = state[family]
            dtypes = {CODES_M: (torch.uint8,), CODES_V: (torch.uint8,), SCALES_M: (torch.float32,),
                      SCALES_V: (torch.float32,)}.get(family, (torch.float32, torch.bfloat16))
            if not isinstance(value, torch.Tensor) or value.is_meta or value.layout != torch.strided or \
                    value.dtype not in dtypes or value.numel() != numel:
                found = (f"a {value.dtype} tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
                         else f"a {type(value).__name__}")
                raise CheckpointError(f"{where}['state'][{family!r}] is {found}, expected a "
                                      f"{' or '.join(str(d) for d in dtypes)} tensor of {numel} elements (the state "
                                      f"layout of the shard [{entry['shard_offset']}, "
                                      f"{entry['shard_offset'] + entry['shard_numel']}) of its chunk)")
        if state[PLAIN_M].dtype != state[PLAIN_V].dtype:
            raise CheckpointError(f"{where}['state']: {PLAIN_M!r} is {state[PLAIN_M].dtype} and {PLAIN_V!r} is "
                                  f"{state[PLAIN_V].dtype}, expected one dtype")

    def _check_cut_copies(self, n: int) -> None:
        """Every rank's copy of each block of chunk ``n`` cut by a shard boundary holds the same scales."""
        seen: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (position, block) -> first rank, its scales
        for rank, _, _ in self.saved.holders(n):
            state = saved_state(self.saved.parts[rank]["model"]["chunks"][n])
            for position, piece in self.layout(rank, n).pieces.items():
                for start, numel, cut, base in piece.spans():
                    if not cut:
                        continue
                    block = (piece.first + start - piece.start) // BLOCK_SIZE
                    scales = torch.stack([state[SCALES_M][base], state[SCALES_V][base]]).view(torch.int32)
                    first = seen.setdefault((position, block), (rank, scales))
                    if not torch.equal(first[1], scales):
                        name = self.saved.chunks[n]["slots"][position]["name"]
                        raise CheckpointError(
                            f"{self.saved.files[rank]}: model.chunks[{n}]['state']: the scales of block {block} of "
                            f"{name!r}, cut by a shard boundary, differ from those in {self.saved.files[first[0]]} "
                            f"(every rank holding a part keeps the one agreed scale): the rank files are not of one "
                            f"save")

    def moments(self, name: str) -> WholeMoments:
        """The whole ``(exp_avg, exp_avg_sq)`` of the saved parameter ``name`` (new CPU tensors): its codes and
        block scales where its state is quantized, else its plain moments in the dtype they were saved in."""
        n, slot = self.saved.where[name]
        position = self.saved.chunks[n]["slots"].index(slot)
        numel = slot["numel"]
        if quantizes(numel):
            codes = [torch.empty(numel, dtype=torch.uint8) for _ in range(2)]
            for family, out in zip((CODES_M, CODES_V), codes):
                self.saved.read(family, name, 0, numel, out)
            scales = [torch.empty(numel // BLOCK_SIZE, dtype=torch.float32) for _ in range(2)]
            self._fill(n, position, (SCALES_M, SCALES_V), scales, quantized=True)
            return (codes[0], scales[0]), (codes[1], scales[1])
        dtype = saved_state(self.saved.chunks[n])[PLAIN_M].dtype
        plain = [torch.empty(numel, dtype=dtype) for _ in range(2)]
        self._fill(n, position, (PLAIN_M, PLAIN_V), plain, quantized=False)
        return plain[0], plain[1]

    def _fill(self, n: int, position: int, families: tuple[str, str], out: list[torch.Tensor], quantized: bool) -> None:
        """Copy the parameter at ``position`` of chunk ``n``'s scales (by block: each block from the first rank
        that holds it) or plain moments (by element) from every rank's shard into ``out``."""
        taken = 0  # blocks (or elements) filled: the ranks hold them in order
        for rank, _, _ in self.saved.holders(n):
            piece = self.layout(rank, n).pieces.get(position)
            if piece is None:
                continue
            first, count = (piece.first_block, piece.blocks) if quantized else (piece.first, piece.numel)
            skip = max(taken - first, 0)  # a cut block's scale taken from the rank before
            state = saved_state(self.saved.parts[rank]["model"]["chunks"][n])
            for family, whole in zip(families, out):
                source = state[family][piece.state_base + skip:piece.state_base + count]
                whole[first + skip:first + count].copy_(source)
            taken = max(taken, first + count)
        if taken != out[0].numel():
            name = self.saved.chunks[n]["slots"][position]["name"]
            raise CheckpointError(f"the saved shards of chunk {n} hold {taken} of the {out[0].numel()} "
                                  f"{'block scales' if quantized else 'moments'} of {name!r}: the rank files are not "
                                  f"of one save")


def consolidated_state(path: str, saved: SavedLayout, small: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The ``"state"`` of the full optimizer state dict of the sharded checkpoint of 8-bit state at ``path``
    (``saved``; ``small``: its rank 0 file's optimizer part), each entry in the form the optimizer's own
    ``state_dict()`` writes (recorded as ``state_dict_form``): torchao's ``OptimState8bit`` needs torchao."""
    form = small.get("state_dict_form")
    if form not in FORMS:
        raise InvalidArgumentError("path", path, f"a sharded checkpoint of 8-bit Adam state that records its state "
                                                 f"dict's form (optimizer.state_dict_form: one of {sorted(FORMS)}; "
                                                 f"found {form!r}: saved by an older chunkmem?); load it (at any "
                                                 f"world size) and take optimizer.state_dict(), or save it again")
    if not FORMS[form]:
        try:
            importlib.import_module("torchao.optim.subclass_8bit")  # the full state dict's class
        except ImportError as exc:
            raise UnsupportedOperationError(f"consolidating the sharded checkpoint {path} of torchao's 8-bit Adam "
                                            f"state: its full state dict holds torchao's OptimState8bit, which needs "
                                            f"torchao (pip install torchao)") from exc
    reader = SavedLowBitState(saved)
    reader.check()
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(small["param_names"]):
        n, slot = saved.where[name]
        entry = saved.chunks[n]
        step = saved_slot_steps(entry)[entry["slots"].index(slot)] if entry["trainable"] else 0
        if step:  # torch keeps no state for a parameter never stepped
            state[index] = state_entry(step, reader.moments(name), slot["shape"], FORMS[form])
    return state
