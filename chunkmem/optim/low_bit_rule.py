"""The update rule of torchao's 8-bit Adams (``AdamW8bit``, ``Adam8bit``): their moments in chunk families.

A :class:`~chunkmem.ShardedOptimizerV2` over one of them keeps, for each trainable chunk (this rank's shard):

* ``exp_avg_codes`` and ``exp_avg_sq_codes``: one ``uint8`` code per element;
* ``exp_avg_scales`` and ``exp_avg_sq_scales``: one fp32 scale per block of 256 elements of the parameters whose
  state is quantized (at least 4096 elements, in whole blocks: :func:`chunkmem.optim.blockwise.quantizes`), for
  every block the shard touches;
* ``exp_avg_fp32`` and ``exp_avg_sq_fp32``: the moments of the other parameters, fp32 as torchao keeps them
  (bf16 beside bf16 masters, below).

So a parameter's state costs 2 bytes and 8 bytes per 256 elements instead of 8 bytes per element. The families
live on the chunk's optimizer tier, move with it and are counted like Adam's. The update is
:mod:`chunkmem.optim.low_bit_adam` (the host kernel, or torch ops on the device), in the order and with the
roundings of torchao's step run eagerly; its ``lr``, ``betas``, ``eps`` and ``weight_decay`` are read from the
param groups at every step. The state dict is torchao's: per parameter a float ``step`` tensor and ``exp_avg`` /
``exp_avg_sq`` as torchao's ``OptimState8bit`` (codes shaped like the parameter, the block scales and the map)
or as fp32 tensors for the small ones, so a run moves between chunkmem and the plain optimizer both ways.

**16-bit masters.** With ``bf16_stochastic_round=True`` on a bf16 model the parameters are their own masters,
as in torchao: no fp32 master family (2 bytes a parameter instead of 6), each step's result rounded to bf16
stochastically with random numbers drawn, per parameter in the model's order, from the default generator of the
parameters' device as torchao draws them (so the chunks are updated in the model's order, not as their gradients
land).

**Several ranks.** Sharded (ZeRO-3), the state lies in each shard as :mod:`chunkmem.optim.low_bit_layout` says:
quantized-or-not and the blocks are the whole parameter's, and a block cut by a shard boundary is stepped in two
halves, its parts on each rank, then quantized with the scale the ranks agree on (an all-reduce of its largest
magnitudes per chunk and step, in chunk order on every rank). With stochastic rounding every rank draws each
parameter's random numbers whole and keeps its part's. The state dict is gathered (collectives in chunk order);
a sharded checkpoint loads with the layout that saved it only (:attr:`LowBitAdamRule.why_not_resharded`).

Not yet: the disk tier, ``step_in_backward``, ``amsgrad``, another ``block_size`` and ``bf16_stochastic_round``
over an fp16 model are refused when the optimizer is wrapped (:func:`check_low_bit_optimizer`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..core.chunk import MASTER, Chunk, ParamSlot
from ..errors import InvalidArgumentError, UnsupportedOperationError
from ..runtime.runtime import ChunkRuntime
from .blockwise import BLOCK_SIZE, dynamic_map, quantizes
from .disk_step import gaps
from .low_bit_adam import (LowBitHyper, Moments, Segment, draw_random, step_cut_segment_, store_cut_segment_,
                           update_segments_)
from .low_bit_layout import ChunkStateLayout, StatePiece
from .state_dict import check_entry as check_plain_entry
from .update_rule import KeptState, UpdateRule

CODES_M, CODES_V = "exp_avg_codes", "exp_avg_sq_codes"
SCALES_M, SCALES_V = "exp_avg_scales", "exp_avg_sq_scales"
PLAIN_M, PLAIN_V = "exp_avg_fp32", "exp_avg_sq_fp32"
LOW_BIT_FAMILIES = (CODES_M, CODES_V, SCALES_M, SCALES_V, PLAIN_M, PLAIN_V)
"""The state families of a chunk under an 8-bit Adam (module docstring)."""

_DECOUPLED = {"AdamW8bit": True, "Adam8bit": False}
_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def low_bit_decoupled(optimizer: Any) -> bool | None:
    """``True`` for torchao's ``AdamW8bit``, ``False`` for its ``Adam8bit``, ``None`` for any other optimizer
    (recognised by class, without importing torchao)."""
    cls = type(optimizer)
    if cls.__module__.startswith("torchao.optim") and cls.__name__ in _DECOUPLED:
        return _DECOUPLED[cls.__name__]
    return None


def stochastic_rounding(optimizer: Any, dtype: torch.dtype) -> bool:
    """Whether the 8-bit Adam ``optimizer`` over a model of ``dtype`` keeps bf16 parameters as their own masters,
    rounded stochastically (``bf16_stochastic_round=True`` on a bf16 model; on an fp32 one torchao ignores it)."""
    return bool(getattr(optimizer, "bf16_stochastic_round", False)) and dtype == torch.bfloat16


def check_low_bit_optimizer(optimizer: Any, *, dtype: torch.dtype, disk: bool, step_in_backward: bool) -> None:
    """Refuse, naming what is asked and what is allowed, an 8-bit Adam with what chunkmem does not run yet."""
    name = type(optimizer).__name__
    if getattr(optimizer, "block_size", BLOCK_SIZE) != BLOCK_SIZE:
        raise InvalidArgumentError(f"optimizer ({name}).block_size", optimizer.block_size, f"{BLOCK_SIZE}")
    if getattr(optimizer, "bf16_stochastic_round", False) and dtype == torch.float16:
        raise UnsupportedOperationError(f"{name}(bf16_stochastic_round=True) over an fp16 model: stochastic rounding "
                                        "keeps bf16 parameters as their own masters; use a bf16 model, or "
                                        "bf16_stochastic_round=False (fp32 masters)")
    for index, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise InvalidArgumentError(f"optimizer.param_groups[{index}]['amsgrad']", True, "False")
    for asked, what in ((disk, "with the disk tier"), (step_in_backward, "with step_in_backward=True")):
        if asked:
            raise UnsupportedOperationError(f"{name} in ShardedOptimizerV2 {what}: not supported yet (the state on "
                                            "the device or the host, updated in step())")


class LowBitAdamRule(UpdateRule):
    """torchao's 8-bit Adam over the chunks (module docstring).

    Args:
        decoupled: AdamW's weight decay (``AdamW8bit``), else Adam's L2 term (``Adam8bit``).
    """

    def __init__(self, optimizer: Optimizer, runtime: ChunkRuntime, group_of: dict[int, int], decoupled: bool,
                 stochastic_round: bool = False) -> None:
        super().__init__(optimizer, runtime, group_of)
        self.why_not_resharded = (f"{type(optimizer).__name__}'s 8-bit state (its block scales and fp32 moments "
                                  "are laid out per shard, not by element)")
        self.decoupled = decoupled
        self.stochastic_round = stochastic_round
        self._layouts: dict[int, ChunkStateLayout] = {}  # by chunk index

    @property
    def families(self) -> tuple[str, ...]:
        return LOW_BIT_FAMILIES

    @staticmethod
    def state_buffers(chunk: Chunk, stochastic_round: bool = False) -> dict[str, tuple[int, torch.dtype]]:
        """The elements and dtype of each of ``chunk``'s state families (a buffer holds at least one element: a
        chunk may have no quantized or no plain parameter); the plain moments are bf16 beside bf16 parameters
        that are their own masters, as torchao keeps a small bf16 tensor's state."""
        layout = ChunkStateLayout.of(chunk)
        codes, scales = (chunk.shard_numel, torch.uint8), (max(layout.blocks, 1), torch.float32)
        small = (max(layout.plain, 1), torch.bfloat16 if stochastic_round else torch.float32)
        return {CODES_M: codes, CODES_V: codes, SCALES_M: scales, SCALES_V: scales, PLAIN_M: small, PLAIN_V: small}

    def keeps_master(self, chunk: Chunk) -> bool:
        return chunk.dtype != torch.float32 and not self.stochastic_round

    def state_nbytes(self, chunk: Chunk) -> int:
        return sum(numel * dtype.itemsize for numel, dtype in self.state_buffers(chunk, self.stochastic_round).values())

    def prepare_chunks(self) -> None:
        self.optimizer.state.clear()
        for chunk in self.runtime.trainable_chunks():
            self._layouts[chunk.index] = ChunkStateLayout.of(chunk)
            chunk.use_state_buffers(self.state_buffers(chunk, self.stochastic_round))
            chunk.masters_in_params = self.stochastic_round

    def update_order(self, chunks: list[Chunk]) -> list[Chunk]:
        """The model's order with stochastic rounding (each parameter draws its random numbers in the order
        torchao's step draws them: its param groups list the parameters in the model's order) and on several
        ranks (the agreement on the cut blocks' scales is a collective: every rank issues them in one order)."""
        sharded = any(chunk.shards.sharded for chunk in chunks)
        return sorted(chunks, key=lambda chunk: chunk.index) if self.stochastic_round or sharded else chunks

    def _hyper(self, group: int) -> LowBitHyper:
        g = self.optimizer.param_groups[group]
        beta1, beta2 = g["betas"]
        return LowBitHyper(float(g["lr"]), float(beta1), float(beta2), float(g["eps"]), float(g["weight_decay"]),
                           self.decoupled)

    def segments(self, chunk: Chunk) -> list[tuple[StatePiece, Segment]]:
        """The stepped parameters' pieces of ``chunk`` as segments (whole blocks, cut blocks' parts, plain runs)
        with their hyper-parameters and step numbers after this step, each with its piece."""
        pieces = self._layouts[chunk.index].pieces
        hyper = [self._hyper(index) for index in range(len(self.optimizer.param_groups))]
        segments = []
        for slot, group, part in self.stepped_slots(chunk):
            if part is not None:
                piece = pieces[slot.index_in_chunk]
                segments += [(piece, s) for s in piece.segments(hyper[group], chunk.step_of(slot) + 1)]
        return segments

    @staticmethod
    def moments(chunk: Chunk) -> Moments:
        """``chunk``'s state families as the update reads them (allocated, in memory)."""
        return Moments(*(chunk.optim[family].tensor for family in LOW_BIT_FAMILIES))

    def update(self, chunk: Chunk, multiplier: float) -> None:
        tier = self.runtime.compute_tier(chunk)
        grad = self.runtime.grad_of(chunk)
        segments = self.segments(chunk)
        whole = [s for _, s in segments if not s.cut]
        with self.runtime.updating(chunk, tier) as target:
            master = chunk.optim[MASTER].tensor if chunk.has_master else target
            out = target if chunk.has_master else None
            grad = grad.to(target.device)
            moments = self.moments(chunk)
            random = self._random(chunk, target.device) if self.stochastic_round else None
            cut = [(piece, s, step_cut_segment_(master, grad, moments, s, multiplier, out, _part(random, s)))
                   for piece, s in segments if s.cut]
            joined = None if random is None or not whole else torch.cat([_part(random, s) for s in whole])
            update_segments_(master, grad, moments, whole, multiplier, out, joined)
            self._store_cut(chunk, moments, cut)
            chunk.advance_steps(slot for slot, _, _ in self.stepped_slots(chunk))
            if chunk.has_master:  # the copy written may be new memory: what no segment wrote is the master's rounding
                for a, b in gaps([(s.start, s.start + s.numel) for _, s in segments], 0, chunk.shard_numel):
                    target[a:b].copy_(master[a:b])

    def _random(self, chunk: Chunk, device: torch.device) -> torch.Tensor:
        """The stochastic rounding's random numbers of this rank's shard of ``chunk`` (int32, indexed like the
        shard): every rank draws each stepped parameter's numbers whole, in order, as torchao draws them on the
        unsharded parameter (so every rank's generator advances alike), and keeps those of its part."""
        shard = torch.zeros(chunk.shard_numel, dtype=torch.int32, device=device)
        for slot, _, part in self.stepped_slots(chunk):
            drawn = draw_random(slot.numel, device)
            if part is not None:
                start = slot.offset + part[0] - chunk.shard_offset
                shard[start:start + part[1] - part[0]] = drawn[part[0]:part[1]]
        return shard

    def _store_cut(self, chunk: Chunk, moments: Moments,
                   cut: list[tuple[StatePiece, Segment, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Quantize the cut blocks' parts stepped here with their whole blocks' scales: the largest magnitudes of
        the new moments over every rank's part (an all-reduce of every cut block of ``chunk``, on every rank,
        whether or not its parameter stepped here)."""
        layout = self._layouts[chunk.index]
        if not layout.cut_blocks:
            return
        largest = torch.zeros(2, len(layout.cut_blocks), dtype=torch.float32, device=moments.scales_m.device)
        for piece, segment, new in cut:
            index = layout.cut_index(piece, segment)
            for row, values in enumerate(new):
                largest[row, index] = values.abs().amax()
        chunk.shards.all_reduce_(largest, dist.ReduceOp.MAX, what=f"the cut blocks' 8-bit scales of {chunk.name}")
        for piece, segment, new in cut:
            index = layout.cut_index(piece, segment)
            store_cut_segment_(moments, segment, new, (largest[0, index], largest[1, index]))

    def _streamed(self, chunk: Chunk, multiplier: float) -> Any:
        raise UnsupportedOperationError("an 8-bit Adam with the disk tier: not supported yet")

    # ---- state dicts: torchao's format -------------------------------------------------------------------

    def state_entries(self, chunk: Chunk, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        layout = self._layouts[chunk.index]
        codes, scales, plain = self._gathered(chunk)
        maps = dynamic_map(True), dynamic_map(False)
        entries = {}
        for slot in chunk.slots:
            if id(slot.param) not in index_of or chunk.step_of(slot) == 0:  # torch keeps no state for one never stepped
                continue
            entry: dict[str, Any] = {"step": torch.tensor(float(chunk.step_of(slot)), dtype=torch.float32)}
            for row, key in enumerate(_STATE_KEYS):
                if quantizes(slot.numel):
                    first = layout.block_bases[slot.index_in_chunk]
                    blocks = scales[row, first:first + slot.numel // BLOCK_SIZE]
                    entry[key] = _quantized_state(slot.view(codes[row]), blocks, maps[row], signed=row == 0)
                else:
                    entry[key] = slot.view(plain[row]).to("cpu", copy=True)
            entries[index_of[id(slot.param)]] = entry
        return entries

    def _gathered(self, chunk: Chunk) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor] | None]:
        """``chunk``'s whole state from every rank's shard, by collectives in chunk order on every rank: the codes
        of each moment by element, the scales of both (rows) by block in the layout's chunk-wide numbering (a cut
        block's scale is the same on the ranks that hold it: the maximum is it), the plain moments by element
        (``None``: the chunk has no plain parameter)."""
        layout = self._layouts[chunk.index]
        state = Moments(*(chunk.optim[family].read() for family in LOW_BIT_FAMILIES))
        codes = [chunk.gather(state.codes_m), chunk.gather(state.codes_v)]
        scales = torch.zeros(2, layout.chunk_blocks, dtype=torch.float32, device=state.scales_m.device)
        by_element = [torch.zeros(chunk.shard_numel, dtype=state.plain_m.dtype, device=state.plain_m.device)
                      for _ in range(2)]
        for piece in layout.pieces.values():
            if piece.quantized:
                first = layout.block_bases[piece.slot] + piece.first_block
                for row, held in enumerate((state.scales_m, state.scales_v)):
                    scales[row, first:first + piece.blocks] = held[piece.state_base:piece.state_base + piece.blocks]
            else:
                for local, held in zip(by_element, (state.plain_m, state.plain_v)):
                    local[piece.start:piece.start + piece.numel] = held[piece.state_base:piece.state_base + piece.numel]
        if layout.chunk_blocks:
            chunk.shards.all_reduce_(scales, dist.ReduceOp.MAX, what=f"the 8-bit moments' scales of {chunk.name}")
        plain = [chunk.gather(local) for local in by_element] if layout.plain_slots else None
        return codes, scales, plain

    def state_keys(self, slot: ParamSlot) -> tuple[str, ...]:
        return _STATE_KEYS

    def check_entry(self, index: Any, name: str, entry: Any, slot: ParamSlot) -> int:
        if not isinstance(entry, Mapping) or any(key not in entry for key in ("step", *_STATE_KEYS)):
            raise InvalidArgumentError(f"state_dict['state'][{index}] ({name})", type(entry).__name__,
                                       "a dict with 'step', 'exp_avg' and 'exp_avg_sq' (torchao's 8-bit Adam state)")
        quantized = quantizes(slot.numel)
        plain = {}
        for key in _STATE_KEYS:
            value = entry[key]
            codes = getattr(value, "codes", None)
            if quantized != (codes is not None):
                raise InvalidArgumentError(f"state_dict['state'][{index}][{key!r}] ({name})", type(value).__name__,
                                           "an OptimState8bit" if quantized else "an fp32 tensor (a parameter under "
                                           "4096 elements or not in whole blocks of 256 keeps fp32 state)")
            if codes is not None:
                if tuple(codes.shape) != tuple(slot.shape) or codes.dtype != torch.uint8 or \
                        value.scale.numel() != slot.numel // BLOCK_SIZE:
                    raise InvalidArgumentError(f"state_dict['state'][{index}][{key!r}] ({name})",
                                               f"codes of shape {tuple(codes.shape)}, {value.scale.numel()} scales",
                                               f"uint8 codes of shape {tuple(slot.shape)}, {slot.numel // BLOCK_SIZE} scales")
                plain[key] = torch.zeros(slot.shape)  # the step count and its form are checked like Adam's
            else:
                plain[key] = value
        return check_plain_entry(index, name, {"step": entry["step"], **plain}, slot)

    def loaded_families(self, chunk: Chunk, entries: list[tuple[ParamSlot, Mapping[str, Any]]]) -> dict[str, torch.Tensor]:
        families = {family: torch.zeros(chunk.optim[family].numel, dtype=chunk.optim[family].dtype)
                    for family in LOW_BIT_FAMILIES}
        state = Moments(*families.values())
        for slot, entry in entries:
            piece = self._layouts[chunk.index].pieces.get(slot.index_in_chunk)
            if piece is None:
                continue
            elements = slice(piece.first, piece.first + piece.numel)
            for key, codes, scales, plain in ((_STATE_KEYS[0], state.codes_m, state.scales_m, state.plain_m),
                                              (_STATE_KEYS[1], state.codes_v, state.scales_v, state.plain_v)):
                value = entry[key]
                if piece.quantized:
                    codes[piece.start:piece.start + piece.numel] = value.codes.reshape(-1)[elements]
                    scales[piece.state_base:piece.state_base + piece.blocks] = \
                        value.scale.reshape(-1)[piece.first_block:piece.first_block + piece.blocks]
                else:
                    plain[piece.state_base:piece.state_base + piece.numel] = value.detach().reshape(-1)[elements]
        return families

    def saved_state(self, chunk: Chunk, save: Callable[[Any], Any]) -> dict[str, Any]:
        return {"state": {family: save(chunk.optim[family]) for family in LOW_BIT_FAMILIES}}

    def keep_entry(self, slot: ParamSlot, entry: dict[str, Any], scalars: KeptState, whole: KeptState) -> None:
        """Nothing: the step count is the chunk's, the moments are in the families."""


def _quantized_state(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """One quantized moment as torchao keeps it: an ``OptimState8bit`` of CPU copies of ``codes`` (shaped like the
    parameter) and its block ``scales``."""
    from torchao.optim.subclass_8bit import OptimState8bit  # the optimizer's own package: installed

    codes, scales = (t.detach().to("cpu", copy=True) for t in (codes, scales))
    return OptimState8bit(codes, scales, qmap.clone(), signed, dtype=torch.float32)


def _part(random: torch.Tensor | None, segment: Segment) -> torch.Tensor | None:
    """``segment``'s random numbers from a shard's (``None``: no stochastic rounding)."""
    return None if random is None else random[segment.start:segment.start + segment.numel]
