"""The 8-bit Adams in a :class:`~chunkmem.LowLevelZeroOptimizer` (ZeRO-1/2): torchao's ``AdamW8bit`` /
``Adam8bit`` and ``HybridAdam(state_dtype="8bit")``, their moments in this rank's shard of each flat chunk.

The state is :mod:`chunkmem.optim.low_bit_rule`'s families (``exp_avg_codes`` / ``exp_avg_sq_codes``: one ``uint8``
code per element; ``exp_avg_scales`` / ``exp_avg_sq_scales``: one fp32 scale per block of 256 elements the shard
touches; ``exp_avg_fp32`` / ``exp_avg_sq_fp32``: the moments of the parameters kept plain), laid out as
:mod:`chunkmem.optim.low_bit_layout` says: whether a parameter's state is quantized, and where its blocks start,
are decided on the whole parameter, as torchao decides them on the unsharded model. A block that a shard boundary
cuts is stepped by each rank holding a part of it (:func:`~chunkmem.optim.low_bit_adam.step_cut_segment_`); the
ranks then agree on its scale, the largest magnitude of its new moments over every part (one small all-reduce per
chunk and step, for the chunks with such blocks, in chunk order on every rank), and each quantizes its part with it
(:func:`~chunkmem.optim.low_bit_adam.store_cut_segment_`). The update is
:func:`~chunkmem.optim.low_bit_adam.update_segments_`, in the order and with the roundings of torchao's step run
eagerly; its ``lr``, ``betas``, ``eps`` and ``weight_decay`` are read from the param groups at every step.

**Masters.** A 16-bit model keeps fp32 masters (as under every optimizer a ``LowLevelZeroOptimizer`` runs; the
update writes the master and rounds it to the 16-bit parameter). With ``bf16_stochastic_round=True`` (torchao's, or
``HybridAdam``'s with 8-bit state) over a bf16 model the bf16 parameters are their own masters, as in torchao (no
fp32 master; with ``cpu_offload`` a bf16 copy on the host), and each step's result is rounded stochastically with
the numbers torchao's step draws for each parameter from the default generator of the parameters' device, in
torchao's order (the param groups, then each group's parameters:
:class:`~chunkmem.optim.rounding_draws.DrawSequence`); each rank uses its part's numbers of each draw, and every
generator is left where torchao's step leaves it.

**State dicts.** ``state_dict()`` gathers torchao's (per parameter a float ``step`` and ``exp_avg`` /
``exp_avg_sq`` as ``OptimState8bit`` or fp32 tensors for the small parameters), or ``HybridAdam``'s plain tensors
(:mod:`chunkmem.optim.low_bit_param`): :meth:`LowBitUpdate.state_entries`, a collective. Loading cuts each saved
parameter's whole state for this rank's shard (:meth:`LowBitUpdate.loaded_families`), with no collective.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..distributed.collectives import ShardGroup
from ..distributed.gathers import gather_whole
from ..errors import InvalidArgumentError
from .low_bit_adam import LowBitHyper, Moments, Segment, random_part, step_cut_segment_, update_segments_
from .low_bit_layout import ChunkStateLayout, StatePiece
from .low_bit_rule import (LOW_BIT_FAMILIES, check_low_bit_entry, cut_families, entry_moments, family_buffers,
                           gathered_state, largest_over, state_entry, store_cut_blocks, whole_moments)
from .rounding_draws import DrawSequence, default_generator, numbers_buffer
from .zero_gradient_store import GradientStores
from .zero_partition import FlatChunk, FlatSlot
from .zero_update import ZeroUpdate, stepped

_GROUP = "a param group with lr, betas (two numbers), eps and weight_decay"


class LowBitUpdate(ZeroUpdate):
    """An 8-bit Adam over a :class:`~chunkmem.LowLevelZeroOptimizer`'s flat chunks (module docstring); gives each
    chunk its state families (zero) on the masters' device.

    Args:
        optimizer: the wrapped optimizer (torchao's ``AdamW8bit`` / ``Adam8bit``, or a ``HybridAdam`` with
            ``state_dtype="8bit"``).
        stores: the gradient stores the updates read.
        chunks: the optimizer's flat chunks, in order.
        shards: the data-parallel ranks.
        separate_master: the masters are not the working shard (16-bit parameters with fp32 masters, or the
            masters on the host).
        decoupled: AdamW's weight decay (``AdamW8bit``), else Adam's L2 term; a param group's ``adamw_mode``
            (HybridAdam) overrides it.
        stochastic_round: bf16 parameters are their own masters, rounded stochastically.
        plain_state: the state dict holds :mod:`chunkmem.optim.low_bit_param`'s plain tensors (HybridAdam), not
            torchao's ``OptimState8bit``.
    """

    def __init__(self, optimizer: Any, stores: GradientStores, chunks: Sequence[FlatChunk], shards: ShardGroup, *,
                 separate_master: bool, decoupled: bool, stochastic_round: bool, plain_state: bool) -> None:
        super().__init__(optimizer, stores, separate_master)
        self.state_dict_form = "plain-8bit" if plain_state else "torchao-8bit"
        self.chunks = list(chunks)
        self.shards = shards
        self.decoupled = decoupled
        self.stochastic_round = stochastic_round
        self.plain_state = plain_state
        self._layouts: dict[int, ChunkStateLayout] = {}
        for chunk in self.chunks:
            layout = ChunkStateLayout.of_shard([(s.offset, s.numel) for s in chunk.slots], chunk.shard_offset,
                                               chunk.shard_numel, chunk.world)
            self._layouts[chunk.index] = layout
            chunk.use_state_buffers(family_buffers(layout, chunk.shard_numel, stochastic_round))
        self._hyper: list[LowBitHyper] = []
        self._draws: DrawSequence | None = None

    def layout(self, chunk: FlatChunk) -> ChunkStateLayout:
        """Where ``chunk``'s state lies in this rank's shard."""
        return self._layouts[chunk.index]

    # ---- the step ------------------------------------------------------------------------------------------

    def check_unchanged(self) -> None:
        """Raise :class:`~chunkmem.InvalidArgumentError` naming the param group's entry, with nothing changed, where
        a group now asks for what the 8-bit update does not run (``amsgrad``, ``bias_correction=False``) or holds
        an unreadable hyper-parameter."""
        self._hyper = hyper_of_groups(self.optimizer.param_groups, self.decoupled, "optimizer.param_groups")

    def begin_step(self) -> None:
        self._hyper = hyper_of_groups(self.optimizer.param_groups, self.decoupled, "optimizer.param_groups")
        if self.stochastic_round:  # torchao's order: the param groups, then each group's parameters with a gradient
            order = sorted((slot.index, slot.numel) for chunk in self.chunks for slot in stepped(chunk))
            self._draws = DrawSequence(self.chunks[0].param.device, order)

    def end_step(self) -> None:
        if self._draws is not None:  # where torchao's step leaves the generator: past every parameter's draw
            default_generator(self._draws.device).set_state(self._draws.end_state())
            self._draws = None

    def update(self, chunk: FlatChunk, multiplier: float) -> None:
        layout, hyper = self._layouts[chunk.index], self._hyper[chunk.group]
        slots = stepped(chunk)
        segments = [(piece, segment) for slot in slots
                    for piece in (layout.pieces.get(slot.index_in_chunk),) if piece is not None
                    for segment in piece.segments(hyper, chunk.step_of(slot) + 1)]
        master = chunk.master
        grad = self.gradient_by_master(chunk)
        own = chunk.own(chunk.param)
        out = own if self.separate_master and own.device == master.device else None  # the update writes it
        moments = Moments(*(chunk.state[family] for family in LOW_BIT_FAMILIES))
        random = self._random(chunk, slots, master.device)
        cut = [(piece, s, step_cut_segment_(master, grad, moments, s, multiplier, out, random_part(random, s)))
               for piece, s in segments if s.cut]
        update_segments_(master, grad, moments, [s for _, s in segments if not s.cut], multiplier, out, random)
        self._store_cut(chunk, moments, cut)
        chunk.advance_steps(slots)
        if out is None:
            self.write_working(chunk, [(s.start, s.start + s.numel) for _, s in segments])

    def _random(self, chunk: FlatChunk, slots: list[FlatSlot], device: torch.device) -> torch.Tensor | None:
        """The stochastic rounding's numbers of this rank's shard of ``chunk`` (int32 on ``device``, indexed like
        the shard; elements no stepped parameter covers are not read), or ``None`` without stochastic rounding."""
        if self._draws is None:
            return None
        shard = numbers_buffer(chunk.shard_numel, self._draws.device)
        for slot in slots:
            run = chunk.own_run(slot)
            if run is not None:
                start, end, first = run
                self._draws.draw(slot.index, (first, first + end - start), shard[start:end])
        return shard.to(device)

    def _store_cut(self, chunk: FlatChunk, moments: Moments,
                   cut: list[tuple[StatePiece, Segment, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Quantize ``chunk``'s cut blocks (:func:`~chunkmem.optim.low_bit_rule.store_cut_blocks`)."""
        store_cut_blocks(self._layouts[chunk.index], self.shards, moments, cut,
                         f"the cut blocks' 8-bit scales of chunk {chunk.index}")

    # ---- state dicts ---------------------------------------------------------------------------------------

    def state_entries(self, chunk: FlatChunk) -> dict[int, dict[str, Any]]:
        """The state-dict entries of ``chunk``'s parameters that have stepped, by their index in the param groups:
        gathered over the ranks (collectives: every rank calls it for the same chunks in the same order)."""
        layout = self._layouts[chunk.index]
        state = Moments(*(chunk.state[family].detach().cpu() for family in LOW_BIT_FAMILIES))
        codes, scales, plain = gathered_state(
            layout, state, chunk.shard_numel,
            lambda local: gather_whole(self.shards, local, f"chunk {chunk.index}'s 8-bit state"),
            lambda scales: scales.copy_(largest_over(self.shards, scales, f"the 8-bit moments' scales of chunk "
                                                                          f"{chunk.index}")))
        entries = {}
        for position, slot in enumerate(chunk.slots):
            if chunk.step_of(slot) == 0:  # torch keeps no state for a parameter never stepped
                continue
            held = whole_moments(layout, position, slot.offset, slot.numel, codes, scales, plain)
            entries[slot.index] = state_entry(chunk.step_of(slot), held, slot.shape, self.plain_state)
        return entries

    def check_groups(self, saved_groups: Sequence[Mapping[str, Any]]) -> None:
        """Raise :class:`~chunkmem.InvalidArgumentError` naming the entry unless every saved param group is one the
        8-bit update runs (no ``amsgrad``, ``bias_correction`` not ``False``, readable hyper-parameters)."""
        hyper_of_groups(saved_groups, self.decoupled, "state_dict['param_groups']")

    def check_entry(self, index: Any, name: str, entry: Any, slot: FlatSlot) -> int:
        """The step count of a saved entry of ``slot``'s parameter, after checking it is this optimizer's form."""
        return check_low_bit_entry(index, name, entry, slot, self.plain_state)

    def loaded_families(self, chunk: FlatChunk,
                        entries: list[tuple[FlatSlot, Mapping[str, Any]]]) -> dict[str, torch.Tensor]:
        """This rank's state families of ``chunk`` (on the CPU) cut from checked entries ``(slot, entry)`` (the
        parameters without one: zero)."""
        buffers = {family: (value.numel(), value.dtype) for family, value in chunk.state.items()}
        return cut_families(self._layouts[chunk.index], buffers,
                            ((slot.index_in_chunk, entry_moments(entry, slot.numel, self.plain_state))
                             for slot, entry in entries))


def hyper_of_groups(groups: Sequence[Mapping[str, Any]], decoupled: bool, where: str) -> list[LowBitHyper]:
    """Each param group's 8-bit Adam hyper-parameters; raise :class:`~chunkmem.InvalidArgumentError` naming
    ``where[n]``'s entry for a group the 8-bit update does not run (``amsgrad``, ``bias_correction=False``) or whose
    hyper-parameters cannot be read."""
    hyper = []
    for n, group in enumerate(groups):
        at = f"{where}[{n}]"
        if group.get("amsgrad"):
            raise InvalidArgumentError(f"{at}['amsgrad']", group["amsgrad"],
                                       "False (the 8-bit Adam keeps no max_exp_avg_sq); nothing was changed")
        if not group.get("bias_correction", True):
            raise InvalidArgumentError(f"{at}['bias_correction']", group["bias_correction"],
                                       "True (the 8-bit Adam always corrects the moments' bias); nothing was changed")
        try:
            hyper.append(LowBitHyper.of_group(dict(group), decoupled))
        except KeyError as missing:
            raise InvalidArgumentError(at, f"a group without {missing}", _GROUP) from None
        except (TypeError, ValueError) as unreadable:
            raise InvalidArgumentError(at, f"a group with an unreadable hyper-parameter ({unreadable})", _GROUP) from None
    return hyper
