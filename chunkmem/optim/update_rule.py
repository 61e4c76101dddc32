"""The chunk update rule: how a :class:`~chunkmem.ShardedOptimizerV2` updates each chunk's optimizer state.

The rule is chosen once, when the optimizer is built (:func:`chunkmem.optim.builder.choose_update_rule`):

* :class:`AdamRule`: chunkmem's Adam kernel over runs of each chunk (``HybridAdam``, ``CPUAdam``, plain
  ``torch.optim.Adam`` / ``AdamW``), its moments the chunk families ``exp_avg`` and ``exp_avg_sq``;
* :class:`AnyOptimizerRule`: any other torch optimizer's own step on views of the chunks
  (:mod:`chunkmem.optim.any_optimizer`), its per-element state in chunk families named as its keys and its
  scalar (and whole-parameter) state kept per parameter here.

Each rule updates a chunk whose state is in memory (:meth:`UpdateRule.update`), describes a chunk's update to
the streamed disk step (:meth:`UpdateRule.disk_update`: Adam's runs or another optimizer's pieces; the disk
step itself is :mod:`chunkmem.optim.disk_step`, its commit :mod:`chunkmem.optim.disk_commit`), and answers
what the state dicts, checkpoints and resharding need to know about the state it keeps, so that none of them
asks again which optimizer runs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.optim import Optimizer

from ..core.chunk import ADAM_STATE, EXP_AVG, EXP_AVG_SQ, MASTER, Chunk, ParamSlot
from ..core.layout import join_runs
from ..core.tiers import Tier
from ..runtime.runtime import ChunkRuntime
from .adam import hyper_of_group
from .adam_kernels import adam_update_, adam_update_pieces_, param_spans
from .adam_math import AdamHyper
from .any_optimizer import LayoutWatch, ParamView, PieceStep, StateLayout, step_parameters
from .disk_step import ChunkUpdate, Settle, gaps
from .host_updates import HostUpdates
from .speculation import UndoCopies, UndoCopy
from .state_dict import adam_entry, any_entry, check_entry, scalar_copy

Stepped = tuple[ParamSlot, int, "tuple[int, int] | None"]
"""``(slot, group, part)``: a parameter a step updates, its param group's index and its elements in this rank's
shard ``(start, end)`` (``None``: none of them are here)."""

KeptState = dict[int, dict[str, Any]]
"""Per-parameter state of one chunk, by each parameter's position in the chunk (``index_in_chunk``)."""


class UpdateRule:
    """What every rule shares: the wrapped torch optimizer, which parameters a step updates, and the scalar and
    whole-parameter state kept per parameter (empty under Adam, whose step count is the chunk's).

    Args:
        optimizer: the wrapped torch optimizer (its ``param_groups`` hold the hyper-parameters read at every step).
        runtime: the model's runtime (where each chunk's parameters, gradients and state are).
        group_of: ``id(parameter)`` -> the index of its param group.
    """

    state_layout: StateLayout | None = None
    """What another optimizer keeps per parameter; ``None`` under Adam."""
    keeps_slot_state = False
    """Whether the rule keeps scalar (``step``, ...) or whole-parameter state per parameter beside the chunk
    families: what a checkpoint saves as ``slot_scalars`` and ``whole``."""
    state_field = True
    """Whether a sharded checkpoint's chunk entry holds the rule's families under ``"state"`` (else Adam's moments
    as its own fields ``exp_avg`` and ``exp_avg_sq``)."""
    adam_hyper_parameters = False
    """Whether the param groups hold Adam's hyper-parameters (what a loaded state dict's groups are checked
    for and how their flags are spelled)."""
    in_memory_families: tuple[str, ...] = ()
    """State families kept in host memory when the chunk's state rests on disk (``Chunk.in_memory_families``)."""
    streams_whole_chunks = False
    """Whether the streamed disk step must hand the rule each chunk's shard as one piece (its state is laid out
    in blocks that a piece boundary must not cut); else pieces of the disk tier's ``buffer_size``."""
    state_dict_form: str | None = None
    """How the full state dict writes the per-parameter state, where its keys are not the chunk families cut by
    parameter: ``"torchao-8bit"`` (torchao's ``OptimState8bit``) or ``"plain-8bit"``
    (:mod:`chunkmem.optim.low_bit_param`) for an 8-bit Adam; ``None`` otherwise. A sharded checkpoint records it,
    so that :func:`~chunkmem.consolidate_checkpoint` writes the full state dict's form."""

    def __init__(self, optimizer: Optimizer, runtime: ChunkRuntime, group_of: dict[int, int]) -> None:
        self.optimizer = optimizer
        self.runtime = runtime
        self._group_of = group_of
        self._scalars: dict[int, KeptState] = {}  # chunk index -> its parameters' scalar state
        self._whole: dict[int, KeptState] = {}  # chunk index -> its parameters' whole-parameter state

    @property
    def families(self) -> tuple[str, ...]:
        """The per-element state families each trainable chunk holds (fp32, one element per parameter element)."""
        raise NotImplementedError

    def keeps_master(self, chunk: Chunk) -> bool:
        """Whether the trainable ``chunk`` gets an fp32 master family (its parameters are 16-bit)."""
        return chunk.dtype != torch.float32

    def family_buffers(self, chunk: Chunk) -> dict[str, tuple[int, torch.dtype]]:
        """Each state family of the trainable ``chunk`` (not the master): the elements and dtype of this rank's
        buffer (fp32, one element per element of the shard, unless the rule lays its state out otherwise)."""
        return {family: (chunk.shard_numel, torch.float32) for family in self.families}

    def state_nbytes(self, chunk: Chunk) -> int:
        """Bytes of this rank's state families of the trainable ``chunk`` (not the master), as the rule lays them out."""
        return sum(numel * dtype.itemsize for numel, dtype in self.family_buffers(chunk).values())

    # ---- which parameters a step updates ---------------------------------------------------------------

    def group_of(self, param: nn.Parameter) -> int | None:
        """The index of ``param``'s group in the wrapped optimizer (``None``: not one of its parameters)."""
        return self._group_of.get(id(param))

    def stepped_slots(self, chunk: Chunk) -> list[Stepped]:
        """The parameters of ``chunk`` the step updates (in a param group and given a gradient since the last
        step: torch skips a parameter whose ``.grad`` is None, its state and step count unchanged, and updates
        one whose ``.grad`` is set, also when it was frozen since, or zeroed by ``zero_grad(set_to_none=False)``)."""
        stepped = []
        for slot in chunk.slots:
            group = self._group_of.get(id(slot.param))
            if group is not None and slot.index_in_chunk in chunk.slots_with_grads:
                stepped.append((slot, group, chunk.own_range(slot)))
        return stepped

    def assumptions(self, chunk: Chunk) -> tuple[Any, ...]:
        """What an update of ``chunk`` made now assumes besides its multiplier: the parameters it steps
        (trainable, in which group, which part) and every group's hyper-parameters."""
        stepped = tuple((slot.index_in_chunk, group, part) for slot, group, part in self.stepped_slots(chunk))
        groups = tuple(tuple((k, repr(v)) for k, v in sorted(g.items()) if k != "params")
                       for g in self.optimizer.param_groups)
        return stepped, groups

    # ---- the state kept per parameter ----------------------------------------------------------------

    def scalar_state(self, chunk: Chunk) -> KeptState:
        """The scalar state (``step``, ...) of each of ``chunk``'s parameters that has stepped, changed in place."""
        return self._scalars.setdefault(chunk.index, {})

    def whole_state(self, chunk: Chunk) -> KeptState:
        """The whole-parameter state of ``chunk``'s parameters (``state_layout.whole``)."""
        return self._whole.setdefault(chunk.index, {})

    def replace_kept_state(self, chunk: Chunk, scalars: KeptState, whole: KeptState) -> None:
        """Make ``scalars`` and ``whole`` ``chunk``'s kept state (the caller's dicts' contents are copied in)."""
        for kept, loaded in ((self.scalar_state(chunk), scalars), (self.whole_state(chunk), whole)):
            kept.clear()
            kept.update(loaded)

    # ---- the update ------------------------------------------------------------------------------------

    def prepare_chunks(self) -> None:
        """Give the trainable chunks the rule's state families (at the optimizer's construction)."""

    def check_unchanged(self) -> None:
        """Raise, with nothing changed, where the wrapped optimizer's hyper-parameters now ask for state the
        chunks have no family for (before each step)."""

    def update_order(self, chunks: list[Chunk]) -> list[Chunk]:
        """The order in which the step updates ``chunks`` (given in the order their gradients landed)."""
        return chunks

    def begin_step(self) -> None:
        """``step()`` starts updating: every chunk's gradients are final."""

    def end_step(self, stepped: bool) -> None:
        """``step()`` ends: it updated every chunk (``stepped``), or raised with the state as before it."""

    def update(self, chunk: Chunk, multiplier: float) -> None:
        """Update ``chunk``, whose optimizer state is in memory, with its gradients times ``multiplier``, where
        its state lives; its parameters' step counts advance."""
        raise NotImplementedError

    def updates_off_thread(self, chunk: Chunk) -> bool:
        """Whether the backward may hand ``chunk``'s update to :mod:`chunkmem.optim.host_updates`."""
        return False

    def start_update_off_thread(self, chunk: Chunk, multiplier: float, updates: HostUpdates,
                                first: Callable[[], None], undo: UndoCopy) -> None:
        """:meth:`update` as a job of ``updates`` (only where :meth:`updates_off_thread` allows it)."""
        raise NotImplementedError

    def disk_update(self, chunk: Chunk, multiplier: float) -> ChunkUpdate:
        """What the streamed disk step needs to update ``chunk`` (its gradients final)."""
        param = None if chunk.param.shard.on_disk else self.runtime.update_target(chunk, Tier.HOST)
        ranges, rule = self._streamed(chunk, multiplier)
        grad = self.runtime.grad_of(chunk)
        stepped = [slot for slot, _, _ in self.stepped_slots(chunk)]
        return ChunkUpdate(chunk, grad, param, stepped, ranges, param_spans(chunk.slots, chunk.shard_offset),
                           multiplier, rule, whole=self.streams_whole_chunks)

    def _streamed(self, chunk: Chunk, multiplier: float) -> tuple[list[tuple[int, int, AdamHyper, int]], Any]:
        """The disk step's ``(ranges, rule)`` for ``chunk``: Adam's runs, or another optimizer's pieces."""
        raise NotImplementedError

    def streamed_settle(self) -> Settle | None:
        """What completes the streamed step's updates before it commits, on every rank
        (:data:`~chunkmem.optim.disk_step.Settle`; ``None``: nothing, each update is complete when streamed)."""
        return None

    def updates_in_backward(self, chunk: Chunk) -> bool:
        """Whether ``step_in_backward`` may update ``chunk``, whose state is in memory, in the backward (else
        ``step()`` does)."""
        return True

    def completed(self, update: ChunkUpdate) -> None:
        """The streamed step wrote ``update``: its chunk's step counts (and kept state) are the new ones."""
        update.chunk.advance_steps(update.stepped)

    # ---- state dicts -----------------------------------------------------------------------------------

    def state_entries(self, chunk: Chunk, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        """The ``torch.optim`` state-dict entries of ``chunk``'s parameters (by index in ``index_of``, keyed by
        ``id(parameter)``): its per-element state gathered over the ranks (collectives, in chunk order)."""
        raise NotImplementedError

    def state_keys(self, slot: ParamSlot) -> tuple[str, ...]:
        """The per-element keys of the parameter of ``slot`` in a state-dict entry."""
        raise NotImplementedError

    def check_entry(self, index: Any, name: str, entry: Any, slot: ParamSlot) -> int:
        """The step count of a saved state-dict entry, after checking it (raises naming ``index`` and ``name``)."""
        raise NotImplementedError

    def keep_entry(self, slot: ParamSlot, entry: dict[str, Any], scalars: KeptState, whole: KeptState) -> None:
        """Add what a loaded ``entry`` holds besides its per-element keys to ``scalars`` or ``whole``."""

    def loaded_families(self, chunk: Chunk, entries: list[tuple[ParamSlot, Any]]) -> dict[str, torch.Tensor]:
        """This rank's state families of ``chunk`` as checked state-dict ``entries`` (``(slot, entry)``) give them
        (zero for the parameters without an entry): fp32, each key's part of every entry."""
        families = {key: torch.zeros(chunk.shard_numel, dtype=torch.float32) for key in chunk.state_families}
        for slot, entry in entries:
            for key in self.state_keys(slot):
                chunk.write_own_part(slot, families[key], entry[key])
        return families

    def per_group_keys(self) -> list[list[str]] | None:
        """Each param group's per-element keys, as a checkpoint records them (``None`` under Adam)."""
        return None

    def saved_state(self, chunk: Chunk, save: Callable[[Any], Any]) -> dict[str, Any]:
        """A sharded checkpoint's fields for ``chunk``'s optimizer state, each state buffer passed through ``save``."""
        raise NotImplementedError


class AdamRule(UpdateRule):
    """chunkmem's Adam kernel over contiguous runs of each chunk (see the module docstring)."""

    adam_hyper_parameters = True
    state_field = False

    @property
    def families(self) -> tuple[str, ...]:
        return ADAM_STATE

    def ranges(self, chunk: Chunk) -> list[tuple[int, int, AdamHyper, int]]:
        """``(start, end, hyper, step)``: the runs of this rank's shard of ``chunk`` (elements) whose parameters
        the step updates, are in one param group and have taken the same number of steps, with that group's
        current hyper-parameters and the step number after this update."""
        pieces = [(run[0], run[1], (group, chunk.step_of(slot) + 1)) for slot, group, _ in self.stepped_slots(chunk)
                  for run in (chunk.own_run(slot),) if run is not None]
        return [(a, b, hyper_of_group(self.optimizer.param_groups[g]), step) for a, b, (g, step) in join_runs(pieces)]

    def update(self, chunk: Chunk, multiplier: float) -> None:
        tier = self.runtime.compute_tier(chunk)
        pieces = self.runtime.grad_pieces(chunk)  # autograd's tensors, where the runtime kept them
        grad = self.runtime.grad_of(chunk) if pieces is None else None
        with self.runtime.updating(chunk, tier) as target:
            self._adam(chunk, target, grad, pieces, self.ranges(chunk), multiplier)
            chunk.advance_steps(slot for slot, _, _ in self.stepped_slots(chunk))

    def updates_off_thread(self, chunk: Chunk) -> bool:
        """Adam's kernel on the host, over the flat gradient whose copy to the host completes late (CUDA)."""
        return (self.runtime.memory.copies.asynchronous and self.runtime.compute_tier(chunk) is Tier.HOST
                and self.runtime.grad_pieces(chunk) is None)

    def start_update_off_thread(self, chunk: Chunk, multiplier: float, updates: HostUpdates,
                                first: Callable[[], None], undo: UndoCopy) -> None:
        """The bookkeeping now; on the job's thread the waits for the gradient's copy and for the fetch still
        reading the parameters the update writes, ``first()``, and the update, which fills ``undo`` as it
        reads the state; the copy marked updated and the step counts advanced when ``updates`` is joined."""
        tier = self.runtime.compute_tier(chunk)
        grad, landed = self.runtime.grad_landing(chunk)
        target, target_free = self.runtime.update_target_waiting_later(chunk, tier)
        ranges = self.ranges(chunk)
        stepped = [slot for slot, _, _ in self.stepped_slots(chunk)]

        def work() -> None:
            landed()
            target_free()
            first()
            self._adam(chunk, target, grad, None, ranges, multiplier, undo)

        def then() -> None:
            self.runtime.mark_updated(chunk, tier)
            chunk.advance_steps(stepped)

        updates.submit(work, then, chunk.name)

    def _adam(self, chunk: Chunk, target: torch.Tensor, grad: torch.Tensor | None,
              pieces: list[tuple[int, torch.Tensor]] | None, ranges: list[tuple[int, int, AdamHyper, int]],
              multiplier: float, undo: UndoCopy | None = None) -> None:
        """Adam over ``ranges`` of this rank's shard of ``chunk`` into ``target`` (the copy of the parameters
        the update writes), from the flat ``grad`` or from autograd's ``pieces``; tensors only, no runtime
        state, except where pieces fall back to the flat gradient. ``undo``: an undo copy to fill with the
        values before the update (by the kernel as it reads them, where it can)."""
        if grad is not None:
            grad = grad.to(target.device)
        master = chunk.optim[MASTER].tensor if chunk.has_master else target
        exp_avg, exp_avg_sq = chunk.optim[EXP_AVG].tensor, chunk.optim[EXP_AVG_SQ].tensor
        spans = param_spans(chunk.slots, chunk.shard_offset)
        saved = undo.adam_copies() if undo is not None and pieces is None else None
        if undo is not None and saved is None:
            UndoCopies.fill(undo)
        reached = 0  # ranges whose update was started: their undo values are in (adam_update_ sees to that)
        try:
            for a, b, hyper, step in ranges:
                reached += 1
                out = target[a:b] if chunk.has_master else None
                relative_spans = [(s - a, e - a) for s, e in spans]
                if pieces is not None:
                    inside = [(offset - a, t) for offset, t in pieces if a <= offset < b]
                    if adam_update_pieces_(master[a:b], inside, exp_avg[a:b], exp_avg_sq[a:b], step, hyper,
                                           multiplier, out, relative_spans):
                        continue
                    pieces, grad = None, self.runtime.grad_of(chunk).to(target.device)  # flat from here on
                adam_update_(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step, hyper,
                             grad_multiplier=multiplier, param_out=out, param_spans=relative_spans,
                             undo=None if saved is None else (saved[0][a:b], saved[1][a:b], saved[2][a:b]))
        finally:
            if saved is not None:  # the values no update read: between the ranges, and past a failed one
                UndoCopies.fill(undo, outside=gaps(ranges[:reached], 0, chunk.shard_numel))
        if chunk.has_master:  # the copy written may be new memory: what no range wrote is the master's rounding
            for a, b in gaps(ranges, 0, chunk.shard_numel):
                target[a:b].copy_(master[a:b])

    def _streamed(self, chunk: Chunk, multiplier: float) -> tuple[list[tuple[int, int, AdamHyper, int]], Any]:
        return self.ranges(chunk), None

    def state_entries(self, chunk: Chunk, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        exp_avg = chunk.gather(chunk.optim[EXP_AVG].read())  # collectives, in chunk order on every rank
        exp_avg_sq = chunk.gather(chunk.optim[EXP_AVG_SQ].read())
        entries = {}
        for slot in chunk.slots:
            if id(slot.param) in index_of and chunk.step_of(slot) > 0:  # torch keeps no state for one never stepped
                entries[index_of[id(slot.param)]] = adam_entry(chunk.step_of(slot), slot.view(exp_avg),
                                                               slot.view(exp_avg_sq), slot.shape)
        return entries

    def state_keys(self, slot: ParamSlot) -> tuple[str, ...]:
        return ADAM_STATE

    def check_entry(self, index: Any, name: str, entry: Any, slot: ParamSlot) -> int:
        return check_entry(index, name, entry, slot)

    def saved_state(self, chunk: Chunk, save: Callable[[Any], Any]) -> dict[str, Any]:
        return {"exp_avg": save(chunk.optim[EXP_AVG]), "exp_avg_sq": save(chunk.optim[EXP_AVG_SQ])}


class AnyOptimizerRule(UpdateRule):
    """Another torch optimizer's own step on stand-ins for the chunks' parameters (see the module docstring).

    Args:
        layout: what the optimizer keeps per parameter (:func:`~chunkmem.optim.any_optimizer.probe_state`).
        owner: the chunked optimizer's class name, for the messages of refused layout changes.
    """

    keeps_slot_state = True

    def __init__(self, optimizer: Optimizer, runtime: ChunkRuntime, group_of: dict[int, int], layout: StateLayout,
                 owner: str) -> None:
        super().__init__(optimizer, runtime, group_of)
        self.state_layout = layout
        self._watch = LayoutWatch(optimizer, layout, owner)

    @property
    def families(self) -> tuple[str, ...]:
        return self.state_layout.families

    def prepare_chunks(self) -> None:
        self.optimizer.state.clear()  # what its constructor made (Adagrad's sums): the chunks keep the state
        for chunk in self.runtime.trainable_chunks():
            chunk.use_state_families(self.state_layout.families)

    def check_unchanged(self) -> None:
        self._watch.check()

    def _param_views(self, chunk: Chunk) -> list[ParamView]:
        """The stepped parameters' parts of this rank's shard of ``chunk`` (shaped where whole; those with
        none :meth:`~chunkmem.optim.any_optimizer.ParamView.elsewhere`), keyed by their position in the chunk."""
        return [ParamView.elsewhere(group, slot.index_in_chunk) if part is None else
                ParamView.of_part(slot.offset, slot.numel, slot.shape, part, chunk.shard_offset, group,
                                  slot.index_in_chunk)
                for slot, group, part in self.stepped_slots(chunk)]

    def update(self, chunk: Chunk, multiplier: float) -> None:
        tier = self.runtime.compute_tier(chunk)
        grad = self.runtime.grad_of(chunk)
        views = self._param_views(chunk)
        with self.runtime.updating(chunk, tier) as target:
            master = chunk.optim[MASTER].tensor if chunk.has_master else target
            grad32 = grad.to(device=target.device, dtype=torch.float32, copy=True).mul_(multiplier)
            families = {key: chunk.optim[key].tensor for key in self.state_layout.families}
            step_parameters(self.optimizer, self.state_layout, views, master, grad32, families,
                            self.scalar_state(chunk), whole_state=self.whole_state(chunk))
            chunk.advance_steps(slot for slot, _, _ in self.stepped_slots(chunk))
            if chunk.has_master:
                target.copy_(master)

    def _streamed(self, chunk: Chunk, multiplier: float) -> tuple[list[tuple[int, int, AdamHyper, int]], Any]:
        return [], PieceStep(self.optimizer, self.state_layout, self._param_views(chunk), self.scalar_state(chunk),
                             multiplier)

    def completed(self, update: ChunkUpdate) -> None:
        super().completed(update)
        self._scalars[update.chunk.index] = update.rule.scalars_after

    def state_entries(self, chunk: Chunk, index_of: dict[int, int]) -> dict[int, dict[str, Any]]:
        layout = self.state_layout
        gathered = {key: chunk.gather(chunk.optim[key].read()) for key in layout.families}
        scalars, whole = self.scalar_state(chunk), self.whole_state(chunk)
        entries = {}
        for slot in chunk.slots:
            if id(slot.param) not in index_of:
                continue
            if layout.whole:
                if slot.index_in_chunk in whole:
                    entries[index_of[id(slot.param)]] = scalar_copy(whole[slot.index_in_chunk])
                continue
            if slot.index_in_chunk not in scalars:  # never stepped: torch keeps no state for it
                continue
            entries[index_of[id(slot.param)]] = any_entry(
                scalars[slot.index_in_chunk], {key: gathered[key] for key in self.state_keys(slot)}, slot.view,
                slot.shape)
        return entries

    def state_keys(self, slot: ParamSlot) -> tuple[str, ...]:
        return self.state_layout.per_group[self.group_of(slot.param)]

    def check_entry(self, index: Any, name: str, entry: Any, slot: ParamSlot) -> int:
        return check_entry(index, name, entry, slot, self.state_keys(slot), counts_steps=False,
                           whole=self.state_layout.whole)

    def keep_entry(self, slot: ParamSlot, entry: dict[str, Any], scalars: KeptState, whole: KeptState) -> None:
        if self.state_layout.whole:
            whole[slot.index_in_chunk] = scalar_copy(entry)
        else:  # its own (older state dicts hold the group's in each entry)
            scalars[slot.index_in_chunk] = scalar_copy(entry, self.state_keys(slot))

    def per_group_keys(self) -> list[list[str]] | None:
        return [list(keys) for keys in self.state_layout.per_group]

    def saved_state(self, chunk: Chunk, save: Callable[[Any], Any]) -> dict[str, Any]:
        return {"state": {key: save(chunk.optim[key]) for key in chunk.state_families},
                "slot_scalars": {k: scalar_copy(v) for k, v in self.scalar_state(chunk).items()},
                "whole": {k: scalar_copy(v) for k, v in self.whole_state(chunk).items()}}
