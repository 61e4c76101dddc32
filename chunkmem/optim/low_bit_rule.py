"""The update rule of 8-bit Adams (torchao's ``AdamW8bit``, ``Adam8bit``, ``HybridAdam(state_dtype="8bit")``): their
moments in chunk families.

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
or as fp32 tensors for the small ones, so a run moves between chunkmem and the plain optimizer both ways. A
:class:`~chunkmem.HybridAdam` with ``state_dtype="8bit"`` runs the same rule, its param groups' ``adamw_mode``
choosing the weight decay, and its state dict holds plain tensors instead (:mod:`chunkmem.optim.low_bit_param`):
no torchao needed.

**16-bit masters.** With ``bf16_stochastic_round=True`` (torchao's, or ``HybridAdam``'s with 8-bit state) on a bf16
model the parameters are their own masters, as in torchao: no fp32 master family (2 bytes a parameter instead of 6),
each step's result rounded to bf16 stochastically with each parameter's random numbers where torchao's step draws
them from the default generator (:mod:`chunkmem.optim.rounding_draws`: whatever order the chunks are updated in, and
the generator left where torchao leaves it). Without it a 16-bit model keeps fp32 masters, as under every optimizer
chunkmem runs (torchao on a plain bf16 model rounds each step's result to the nearest bf16 and keeps no master).

**The disk tier.** With ``offload_optimizer="disk"`` the codes rest on disk and the streamed step
(:mod:`chunkmem.optim.disk_step`) hands each chunk's shard to the update as one piece, so that no block is cut
(its I/O buffers hold a whole shard of the widest family streamed, more than the disk tier's ``buffer_size``
when that is smaller: :func:`~chunkmem.optim.disk_step.whole_piece_nbytes`). The block scales and the small
parameters' moments, indexed by block and not by element, stay in host memory (``in_memory_families``: 8 bytes
per 256 elements); an atomic step writes their new values into copies that replace them when it commits.
``step_in_backward`` works as for Adam: the undo copies hold each family in its own dtype.

**Several ranks.** Sharded (ZeRO-3), the state lies in each shard as :mod:`chunkmem.optim.low_bit_layout` says:
quantized-or-not and the blocks are the whole parameter's, and a block cut by a shard boundary is stepped in two
halves, its parts on each rank, then quantized with the scale the ranks agree on (an all-reduce of its largest
magnitudes per chunk and step, in chunk order on every rank). With stochastic rounding each rank takes its part's
numbers of each parameter's draw. The streamed disk step quantizes the cut blocks once every chunk was streamed,
on the thread of ``step()``, in one all-reduce over all the chunks (:mod:`chunkmem.optim.low_bit_streamed`, also
with ``step_in_backward``, whose stream runs on a thread of its own during the backward); with the state in memory
``step_in_backward`` leaves the chunks with cut blocks to ``step()`` (:meth:`LowBitAdamRule.updates_in_backward`).
The state dict is gathered (collectives in chunk order). A sharded checkpoint
holds each rank's shard as it lies; into another layout it is loaded, and consolidated, through each parameter's
whole state (:mod:`chunkmem.io.low_bit_resharding`: its codes, each block's scale once, its plain moments), cut
again for the loading shard by :meth:`LowBitAdamRule.families_of_moments` or written as the full state dict
writes it by :func:`state_entry`.

Not yet: ``amsgrad``, another ``block_size``, and ``bf16_stochastic_round`` over an fp16 model or with
``reuse_fp16_shard=True`` are refused when the optimizer is wrapped (:func:`check_low_bit_optimizer`; before
2026-11-27 also several ranks with the disk tier or ``step_in_backward``).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.optim import Optimizer

from ..core.chunk import MASTER, Chunk, ParamSlot
from ..core.tiers import Tier, device_of_tier
from ..errors import InvalidArgumentError, UnsupportedOperationError
from ..runtime.runtime import ChunkRuntime
from . import low_bit_param
from .adam import HybridAdam
from .blockwise import BLOCK_SIZE, dynamic_map, quantizes
from .disk_step import ChunkUpdate, Settle, gaps
from .low_bit_adam import (LowBitHyper, Moments, Segment, random_part, step_cut_segment_, store_cut_segment_,
                           update_segments_)
from .low_bit_layout import (CODES_M, CODES_V, LOW_BIT_FAMILIES, PLAIN_M, PLAIN_V, SCALES_M, SCALES_V,  # noqa: F401
                             ChunkStateLayout, StatePiece)
from .low_bit_streamed import StreamedLowBitUpdate, largest_over, rewritten_nbytes, settle_cut_blocks
from .rounding_draws import StepDraws
from .state_dict import check_entry as check_plain_entry
from .update_rule import KeptState, UpdateRule

_Moment = tuple[torch.Tensor, torch.Tensor] | torch.Tensor
WholeMoments = tuple[_Moment, _Moment]
"""A parameter's whole ``(exp_avg, exp_avg_sq)``: each a ``(codes, scales)`` pair of flat tensors (``uint8``, one
code per element; fp32, one scale per block of 256) where its state is quantized, else a flat tensor of its plain
moments (fp32, or bf16 beside bf16 parameters that are their own masters)."""

_DECOUPLED = {"AdamW8bit": True, "Adam8bit": False}
_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def low_bit_decoupled(optimizer: Any) -> bool | None:
    """``True`` for torchao's ``AdamW8bit``, ``False`` for its ``Adam8bit`` (recognised by class, without importing
    torchao), a :class:`~chunkmem.HybridAdam` with ``state_dtype="8bit"``'s default ``adamw_mode`` (each param
    group may set its own), ``None`` for any other optimizer."""
    if isinstance(optimizer, HybridAdam):
        return bool(optimizer.defaults["adamw_mode"]) if optimizer.quantized_state else None
    cls = type(optimizer)
    if cls.__module__.startswith("torchao.optim") and cls.__name__ in _DECOUPLED:
        return _DECOUPLED[cls.__name__]
    return None


def stochastic_rounding(optimizer: Any, dtype: torch.dtype) -> bool:
    """Whether the 8-bit Adam ``optimizer`` over a model of ``dtype`` keeps bf16 parameters as their own masters,
    rounded stochastically (``bf16_stochastic_round=True`` on a bf16 model; on an fp32 one torchao ignores it)."""
    return bool(getattr(optimizer, "bf16_stochastic_round", False)) and dtype == torch.bfloat16


def check_low_bit_optimizer(optimizer: Any, *, dtype: torch.dtype, reuse_fp16_shard: bool = False) -> None:
    """Refuse, naming what is asked and what is allowed, an 8-bit Adam with what chunkmem does not run yet."""
    name = type(optimizer).__name__
    if getattr(optimizer, "block_size", BLOCK_SIZE) != BLOCK_SIZE:
        raise InvalidArgumentError(f"optimizer ({name}).block_size", optimizer.block_size, f"{BLOCK_SIZE}")
    if getattr(optimizer, "bf16_stochastic_round", False) and dtype == torch.float16:
        raise UnsupportedOperationError(f"{name}(bf16_stochastic_round=True) over an fp16 model: stochastic rounding "
                                        "keeps bf16 parameters as their own masters; use a bf16 model, or "
                                        "bf16_stochastic_round=False (fp32 masters)")
    if stochastic_rounding(optimizer, dtype) and reuse_fp16_shard:  # the gradients would overwrite the only copy
        raise UnsupportedOperationError(f"{name}(bf16_stochastic_round=True) with reuse_fp16_shard=True: the bf16 "
                                        "parameters are their own masters, so their memory cannot hold the gradients; "
                                        "use reuse_fp16_shard=False")
    for index, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise InvalidArgumentError(f"optimizer.param_groups[{index}]['amsgrad']", True, "False")


class LowBitAdamRule(UpdateRule):
    """torchao's 8-bit Adam over the chunks (module docstring).

    Args:
        decoupled: AdamW's weight decay (``AdamW8bit``), else Adam's L2 term (``Adam8bit``); a param group's
            ``adamw_mode`` (HybridAdam) overrides it.
        stochastic_round: bf16 parameters are their own masters (module docstring).
        plain_state: the state dict holds :mod:`chunkmem.optim.low_bit_param`'s plain tensors
            (``HybridAdam(state_dtype="8bit")``), not torchao's ``OptimState8bit``.
    """

    in_memory_families = (SCALES_M, SCALES_V, PLAIN_M, PLAIN_V)
    streams_whole_chunks = True  # a block must not be cut: its scale is the absmax of all of it

    def __init__(self, optimizer: Optimizer, runtime: ChunkRuntime, group_of: dict[int, int], decoupled: bool,
                 stochastic_round: bool = False, plain_state: bool = False) -> None:
        super().__init__(optimizer, runtime, group_of)
        self.state_dict_form = "plain-8bit" if plain_state else "torchao-8bit"
        self.decoupled = decoupled
        self.stochastic_round = stochastic_round
        self.plain_state = plain_state
        self._layouts: dict[int, ChunkStateLayout] = {}  # by chunk index
        self._draws = StepDraws(optimizer.param_groups)  # stochastic rounding's

    @property
    def families(self) -> tuple[str, ...]:
        return LOW_BIT_FAMILIES

    @staticmethod
    def state_buffers(chunk: Chunk, stochastic_round: bool = False) -> dict[str, tuple[int, torch.dtype]]:
        """The elements and dtype of each of ``chunk``'s state families (a buffer holds at least one element: a
        chunk may have no quantized or no plain parameter); the plain moments are bf16 beside bf16 parameters
        that are their own masters, as torchao keeps a small bf16 tensor's state."""
        return family_buffers(ChunkStateLayout.of(chunk), chunk.shard_numel, stochastic_round)

    @staticmethod
    def rewritten_nbytes(chunk: Chunk) -> int:
        """Bytes of codes the streamed step over ``chunk``'s shard writes again when every parameter steps (its
        cut blocks' pages, on several ranks: :func:`~chunkmem.optim.low_bit_streamed.rewritten_nbytes`)."""
        return rewritten_nbytes(ChunkStateLayout.of(chunk), chunk.shard_numel) if chunk.shards.sharded else 0

    def keeps_master(self, chunk: Chunk) -> bool:
        return chunk.dtype != torch.float32 and not self.stochastic_round

    def family_buffers(self, chunk: Chunk) -> dict[str, tuple[int, torch.dtype]]:
        return self.state_buffers(chunk, self.stochastic_round)

    def prepare_chunks(self) -> None:
        self.optimizer.state.clear()
        for chunk in self.runtime.trainable_chunks():
            self._layouts[chunk.index] = ChunkStateLayout.of(chunk)
            chunk.use_state_buffers(self.state_buffers(chunk, self.stochastic_round))
            chunk.in_memory_families = self.in_memory_families
            chunk.masters_in_params = self.stochastic_round

    def update_order(self, chunks: list[Chunk]) -> list[Chunk]:
        """On several ranks the model's order: the agreement on the cut blocks' scales is a collective, which every
        rank issues in one order."""
        return sorted(chunks, key=lambda chunk: chunk.index) if any(c.shards.sharded for c in chunks) else chunks

    # ---- stochastic rounding's random numbers (chunkmem.optim.rounding_draws) -----------------------------

    def begin_step(self) -> None:
        self._draws.begin_step()

    def end_step(self, stepped: bool) -> None:
        self._draws.end_step(stepped)

    def _random(self, chunk: Chunk, device: torch.device) -> Callable[[], torch.Tensor | None]:
        """What draws the stochastic rounding's random numbers of this rank's shard of ``chunk`` (``None`` without
        stochastic rounding): decided now, drawn later, maybe on the disk step's thread."""
        if not self.stochastic_round:
            return lambda: None
        return self._draws.shard_numbers(chunk, [(slot, part) for slot, _, part in self.stepped_slots(chunk)], device)

    def assumptions(self, chunk: Chunk) -> tuple[Any, ...]:
        """Adam's, and with stochastic rounding where the chunk's parameters' numbers lie in this step's draws:
        the default generator's state and their positions in the order of the parameters stepped."""
        assumed = super().assumptions(chunk)
        if not self.stochastic_round:
            return assumed
        params = [slot.param for slot, _, _ in self.stepped_slots(chunk)]
        return assumed + self._draws.key(params, device_of_tier(self.runtime.compute_tier(chunk)))

    def segments(self, chunk: Chunk) -> list[tuple[StatePiece, Segment]]:
        """The stepped parameters' pieces of ``chunk`` as segments (whole blocks, cut blocks' parts, plain runs)
        with their hyper-parameters and step numbers after this step, each with its piece."""
        pieces = self._layouts[chunk.index].pieces
        hyper = [LowBitHyper.of_group(group, self.decoupled) for group in self.optimizer.param_groups]
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
            random = self._random(chunk, target.device)()
            cut = [(piece, s, step_cut_segment_(master, grad, moments, s, multiplier, out, random_part(random, s)))
                   for piece, s in segments if s.cut]
            update_segments_(master, grad, moments, whole, multiplier, out, random)
            self._store_cut(chunk, moments, cut)
            chunk.advance_steps(slot for slot, _, _ in self.stepped_slots(chunk))
            if chunk.has_master:  # the copy written may be new memory: what no segment wrote is the master's rounding
                for a, b in gaps([(s.start, s.start + s.numel) for _, s in segments], 0, chunk.shard_numel):
                    target[a:b].copy_(master[a:b])

    def _store_cut(self, chunk: Chunk, moments: Moments,
                   cut: list[tuple[StatePiece, Segment, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Quantize ``chunk``'s cut blocks (:func:`~chunkmem.optim.low_bit_rule.store_cut_blocks`)."""
        store_cut_blocks(self._layouts[chunk.index], chunk.shards, moments, cut,
                         f"the cut blocks' 8-bit scales of {chunk.name}")

    def _streamed(self, chunk: Chunk, multiplier: float) -> tuple[list, StreamedLowBitUpdate]:
        in_memory = {family: chunk.optim[family].tensor for family in self.in_memory_families}
        if self.runtime.memory.disk.atomic_step:  # the new values replace these when the step commits
            in_memory = {family: tensor.clone() for family, tensor in in_memory.items()}
        layout = self._layouts[chunk.index]
        segments = self.segments(chunk)
        whole = [segment for _, segment in segments if not segment.cut]
        cut = [(layout.cut_index(piece, segment), segment) for piece, segment in segments if segment.cut]
        return [], StreamedLowBitUpdate(whole, cut, multiplier, in_memory,
                                        self._random(chunk, device_of_tier(Tier.HOST)))

    def streamed_settle(self) -> Settle | None:
        """On several ranks, where shard boundaries cut blocks: :func:`~chunkmem.optim.low_bit_streamed.
        settle_cut_blocks` over every trainable chunk with cut blocks, in chunk order (the same on every rank)."""
        cut = [(chunk, len(self._layouts[chunk.index].cut_blocks))
               for chunk in sorted(self.runtime.trainable_chunks(), key=lambda chunk: chunk.index)
               if chunk.shards.sharded and self._layouts[chunk.index].cut_blocks]
        return partial(settle_cut_blocks, cut) if cut else None

    def updates_in_backward(self, chunk: Chunk) -> bool:
        """Not a chunk whose state is in memory and whose shard boundaries cut blocks (several ranks): its update
        all-reduces the cut blocks' scales, a collective that ``step()`` runs in chunk order on every rank, where
        the backward could not promise the same order and the same chunks kept on every rank."""
        return not (chunk.shards.sharded and self._layouts[chunk.index].cut_blocks)

    def completed(self, update: ChunkUpdate) -> None:
        super().completed(update)
        for family, values in update.rule.in_memory.items():
            if values is not update.chunk.optim[family].tensor:  # an atomic step's new values
                update.chunk.optim[family].tensor.copy_(values)

    # ---- state dicts: torchao's format, or plain tensors (HybridAdam) ------------------------------------

    def state_entries(self, chunk: Chunk, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        layout = self._layouts[chunk.index]
        state = Moments(*(chunk.optim[family].read() for family in LOW_BIT_FAMILIES))
        codes, scales, plain = gathered_state(layout, state, chunk.shard_numel, chunk.gather, lambda scales: (
            scales.copy_(largest_over(chunk.shards, scales, f"the 8-bit moments' scales of {chunk.name}"))))
        entries = {}
        for slot in chunk.slots:
            if id(slot.param) not in index_of or chunk.step_of(slot) == 0:  # torch keeps no state for one never stepped
                continue
            held = whole_moments(layout, slot.index_in_chunk, slot.offset, slot.numel, codes, scales, plain)
            entries[index_of[id(slot.param)]] = state_entry(chunk.step_of(slot), held, slot.shape, self.plain_state)
        return entries

    def state_keys(self, slot: ParamSlot) -> tuple[str, ...]:
        if self.plain_state and quantizes(slot.numel):
            return low_bit_param.CODES + low_bit_param.SCALES
        return _STATE_KEYS

    def check_entry(self, index: Any, name: str, entry: Any, slot: ParamSlot) -> int:
        return check_low_bit_entry(index, name, entry, slot, self.plain_state)

    def loaded_families(self, chunk: Chunk, entries: list[tuple[ParamSlot, Mapping[str, Any]]]) -> dict[str, torch.Tensor]:
        return self.families_of_moments(chunk, ((slot, entry_moments(entry, slot.numel, self.plain_state))
                                                for slot, entry in entries))

    def families_of_moments(self, chunk: Chunk,
                            moments: Iterable[tuple[ParamSlot, WholeMoments]]) -> dict[str, torch.Tensor]:
        """This rank's state families of ``chunk`` (each buffer's elements and dtype) cut from the whole state of
        its parameters: ``moments`` yields ``(slot, (exp_avg, exp_avg_sq))``, as :data:`WholeMoments` says, one
        parameter at a time (the parameters without one: zero). What a loaded state dict and a sharded checkpoint
        loaded into another layout write (:func:`cut_families`)."""
        buffers = {family: (chunk.optim[family].numel, chunk.optim[family].dtype) for family in LOW_BIT_FAMILIES}
        return cut_families(self._layouts[chunk.index], buffers,
                            ((slot.index_in_chunk, saved) for slot, saved in moments))

    def saved_state(self, chunk: Chunk, save: Callable[[Any], Any]) -> dict[str, Any]:
        return {"state": {family: save(chunk.optim[family]) for family in LOW_BIT_FAMILIES}}

    def keep_entry(self, slot: ParamSlot, entry: dict[str, Any], scalars: KeptState, whole: KeptState) -> None:
        """Nothing: the step count is the chunk's, the moments are in the families."""


def store_cut_blocks(layout: ChunkStateLayout, shards: Any, moments: Moments,
                     cut: list[tuple[StatePiece, Segment, tuple[torch.Tensor, torch.Tensor]]], what: str) -> None:
    """Quantize the parts of ``layout``'s cut blocks stepped on this rank (``cut``: each with its new moments, from
    :func:`~chunkmem.optim.low_bit_adam.step_cut_segment_`) with their whole blocks' scales: the largest magnitude
    of each block's new moments over every rank's part, agreed over ``shards`` (:func:`largest_over`, named
    ``what``; every rank calls it for every cut block of the chunk, whether or not its parameter stepped)."""
    if not layout.cut_blocks:
        return
    largest = torch.zeros(2, len(layout.cut_blocks), dtype=torch.float32, device=moments.scales_m.device)
    for piece, segment, new in cut:
        index = layout.cut_index(piece, segment)
        for row, values in enumerate(new):
            largest[row, index] = values.abs().amax()
    largest = largest_over(shards, largest, what)
    for piece, segment, new in cut:
        index = layout.cut_index(piece, segment)
        store_cut_segment_(moments, segment, new, (largest[0, index], largest[1, index]))


def state_entry(step: int, held: WholeMoments, shape: Sequence[int], plain_state: bool) -> dict[str, Any]:
    """One parameter's state-dict entry, as ``optim.state_dict()`` writes it, from its ``step`` count and its whole
    moments ``held`` (``(exp_avg, exp_avg_sq)``, :data:`WholeMoments`): torchao's (a float ``step`` tensor,
    ``OptimState8bit`` or plain tensors shaped like the parameter), or :mod:`chunkmem.optim.low_bit_param`'s plain
    tensors (``plain_state``). Copies on the CPU."""
    entry: dict[str, Any] = {"step": torch.tensor(float(step), dtype=torch.float32)}
    if plain_state:
        entry.update(low_bit_param.exported(held, torch.Size(shape)))
        return entry
    for row, key in enumerate(_STATE_KEYS):
        value = held[row]
        entry[key] = (_quantized_state(value[0].view(tuple(shape)), value[1], dynamic_map(row == 0), row == 0)
                      if isinstance(value, tuple) else value.to("cpu", copy=True).view(tuple(shape)))
    return entry


def family_buffers(layout: ChunkStateLayout, shard_numel: int,
                   stochastic_round: bool = False) -> dict[str, tuple[int, torch.dtype]]:
    """The elements and dtype of each state family of a shard of ``shard_numel`` elements laid out as ``layout``
    (a buffer holds at least one element: a shard may have no quantized or no plain parameter); the plain moments
    are bf16 beside bf16 parameters that are their own masters (``stochastic_round``), as torchao keeps a small
    bf16 tensor's state."""
    codes, scales = (shard_numel, torch.uint8), (layout.scale_numel, torch.float32)
    small = (layout.plain_numel, torch.bfloat16 if stochastic_round else torch.float32)
    return {CODES_M: codes, CODES_V: codes, SCALES_M: scales, SCALES_V: scales, PLAIN_M: small, PLAIN_V: small}


def gathered_state(layout: ChunkStateLayout, state: Moments, shard_numel: int,
                   gather: Callable[[torch.Tensor], torch.Tensor], reduce_max: Callable[[torch.Tensor], Any]
                   ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor] | None]:
    """A chunk's whole state from every rank's shard ``state`` (laid out as ``layout``), by collectives in this
    order on every rank: ``gather`` (a shard-sized tensor -> the whole chunk's, rank by rank) of the codes of each
    moment, ``reduce_max`` (in place, elementwise over the ranks) of the scales of both moments (rows) by block in
    the layout's chunk-wide numbering (each rank fills the blocks it touches, the others 0; a cut block's scale is
    the same on the ranks that hold it: the maximum is it), then ``gather`` of the plain moments by element.
    Returns the codes, the scales and the plain moments (``None``: the chunk has no plain parameter)."""
    codes = [gather(state.codes_m), gather(state.codes_v)]
    scales = torch.zeros(2, layout.chunk_blocks, dtype=torch.float32, device=state.scales_m.device)
    by_element = [torch.zeros(shard_numel, dtype=state.plain_m.dtype, device=state.plain_m.device) for _ in range(2)]
    for piece in layout.pieces.values():
        if piece.quantized:
            first = layout.block_bases[piece.slot] + piece.first_block
            for row, held in enumerate((state.scales_m, state.scales_v)):
                scales[row, first:first + piece.blocks] = held[piece.state_base:piece.state_base + piece.blocks]
        else:
            for local, held in zip(by_element, (state.plain_m, state.plain_v)):
                local[piece.start:piece.start + piece.numel] = held[piece.state_base:piece.state_base + piece.numel]
    if layout.chunk_blocks:
        reduce_max(scales)
    plain = [gather(local) for local in by_element] if layout.plain_slots else None
    return codes, scales, plain


def whole_moments(layout: ChunkStateLayout, position: int, offset: int, numel: int, codes: list[torch.Tensor],
                  scales: torch.Tensor, plain: list[torch.Tensor] | None) -> WholeMoments:
    """The whole state of the parameter at ``position`` in a chunk (``numel`` elements from ``offset``), cut from
    the chunk's gathered state (:func:`gathered_state`'s ``codes``, ``scales`` and ``plain``)."""
    if quantizes(numel):
        first = layout.block_bases[position]
        return tuple((codes[row][offset:offset + numel], scales[row, first:first + numel // BLOCK_SIZE])
                     for row in range(2))
    return tuple(plain[row][offset:offset + numel] for row in range(2))


def cut_families(layout: ChunkStateLayout, buffers: Mapping[str, tuple[int, torch.dtype]],
                 moments: Iterable[tuple[int, WholeMoments]]) -> dict[str, torch.Tensor]:
    """A shard's state families (``buffers``: each family's elements and dtype, :func:`family_buffers`) cut from
    the whole state of its chunk's parameters: ``moments`` yields ``(position in the chunk, (exp_avg,
    exp_avg_sq))``, as :data:`WholeMoments` says (the parameters without one: zero). A plain moment in another
    dtype is cast to the buffer's, as torch's ``Optimizer.load_state_dict`` casts state to the parameter's dtype."""
    families = {family: torch.zeros(numel, dtype=dtype) for family, (numel, dtype) in buffers.items()}
    state = Moments(*(families[family] for family in LOW_BIT_FAMILIES))
    for position, saved in moments:
        piece = layout.pieces.get(position)
        if piece is None:
            continue
        elements = slice(piece.first, piece.first + piece.numel)
        for value, codes, scales, plain in ((saved[0], state.codes_m, state.scales_m, state.plain_m),
                                            (saved[1], state.codes_v, state.scales_v, state.plain_v)):
            if piece.quantized:
                codes[piece.start:piece.start + piece.numel] = value[0][elements]
                scales[piece.state_base:piece.state_base + piece.blocks] = \
                    value[1][piece.first_block:piece.first_block + piece.blocks]
            else:
                plain[piece.state_base:piece.state_base + piece.numel] = value[elements]
    return families


def entry_moments(entry: Mapping[str, Any], numel: int, plain_state: bool) -> WholeMoments:
    """The whole moments of a checked state-dict entry (:func:`check_low_bit_entry`) of a parameter of ``numel``
    elements: torchao's, or :mod:`chunkmem.optim.low_bit_param`'s plain tensors (``plain_state``)."""
    if plain_state:
        return low_bit_param.moments_of(entry)
    return tuple((entry[key].codes.reshape(-1), entry[key].scale.reshape(-1)) if quantizes(numel)
                 else entry[key].detach().reshape(-1) for key in _STATE_KEYS)


def check_low_bit_entry(index: Any, name: str, entry: Any, slot: Any, plain_state: bool) -> int:
    """The step count of a saved state-dict entry of the parameter ``slot`` describes (its ``numel`` and ``shape``),
    after checking it is an 8-bit Adam's: torchao's (``OptimState8bit`` where the state is quantized, else fp32
    tensors), or :mod:`chunkmem.optim.low_bit_param`'s plain tensors (``plain_state``). Raises
    :class:`~chunkmem.InvalidArgumentError` naming ``index`` and ``name``."""
    if plain_state:
        return low_bit_param.check_entry(index, name, entry, slot.numel, tuple(slot.shape))
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


def _quantized_state(codes: torch.Tensor, scales: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """One quantized moment as torchao keeps it: an ``OptimState8bit`` of CPU copies of ``codes`` (shaped like the
    parameter) and its block ``scales``."""
    from torchao.optim.subclass_8bit import OptimState8bit  # the optimizer's own package: installed

    codes, scales = (t.detach().to("cpu", copy=True) for t in (codes, scales))
    return OptimState8bit(codes, scales, qmap.clone(), signed, dtype=torch.float32)
