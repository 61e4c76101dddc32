"""How a :class:`~chunkmem.LowLevelZeroOptimizer` updates this rank's shard of a flat chunk: the update rule,
chosen once when the optimizer is built (:func:`chunkmem.optim.zero_builder.choose_update`), as
:mod:`chunkmem.optim.update_rule` is for :class:`~chunkmem.ShardedOptimizerV2`'s chunks.

* :class:`AdamUpdate`: chunkmem's Adam kernel over the runs of the shard (``HybridAdam``, ``CPUAdam``, plain
  ``torch.optim.Adam`` / ``AdamW``), its moments the chunk's ``exp_avg`` and ``exp_avg_sq``;
* :class:`AnyOptimizerUpdate`: the wrapped optimizer's own step on stand-ins for the parameters
  (:mod:`chunkmem.optim.any_optimizer`), its per-element state the chunk's families named as its keys;
* the 8-bit Adams (torchao's ``AdamW8bit`` / ``Adam8bit``, ``HybridAdam(state_dtype="8bit")``):
  :class:`chunkmem.optim.zero_low_bit.LowBitUpdate`, a :class:`ZeroUpdate` of its own module.

Each updates the parameters that require grad and were given a gradient since the last step
(:func:`stepped`), advances their step counts, and copies the new masters into the working shard where they are
separate; the rest of the shard (frozen or unused parameters, padding) is left alone. With ``cpu_offload`` on a GPU
both moves of a step cross PCIe through the chunk runtime's copy engine (:mod:`chunkmem.core.copy_engine`, chosen
when the optimizer is built): this rank's gradient shard into a host buffer kept from step to step (pinned), the
updated masters into the working shard (:meth:`ZeroUpdate.gradient_by_master`, :meth:`ZeroUpdate.write_working`).
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.copy_engine import engine_for_new_model
from ..core.layout import join_runs
from ..core.pinned import PinnedHostMemory
from .adam import hyper_of_group
from .adam_kernels import adam_update_, param_spans
from .any_optimizer import LayoutWatch, ParamView, StateLayout, step_parameters
from .zero_gradient_store import GradientStores
from .zero_partition import FlatChunk, FlatSlot


def stepped(chunk: FlatChunk) -> list[FlatSlot]:
    """The parameters of ``chunk`` the step updates: given a gradient since the last step (torch skips a
    parameter whose ``.grad`` is None, its state and step count unchanged, and updates one whose ``.grad`` is
    set, also when it was frozen since, or zeroed by ``zero_grad(set_to_none=False)``)."""
    return [slot for slot in chunk.slots if slot.index_in_chunk in chunk.slots_with_grads]


def ranges(chunk: FlatChunk) -> list[tuple[int, int, int]]:
    """``(start, end, step)``: the runs of this rank's shard of ``chunk`` (elements from the shard's start)
    whose parameters the step updates (:func:`stepped`) and have taken the same number of steps, with the
    step number after this update; the rest (frozen or unused parameters, padding) is not updated."""
    return join_runs([(run[0], run[1], chunk.step_of(slot) + 1)
                      for slot in stepped(chunk) for run in (chunk.own_run(slot),) if run is not None])


class ZeroUpdate:
    """What every rule shares. ``optimizer``: the wrapped torch optimizer (its param groups hold the
    hyper-parameters, read at every step); ``stores``: the gradient stores the updates read; ``separate_master``:
    the masters are not the working shard.

    A step calls :meth:`check_unchanged` before anything changes, then, once it updates, :meth:`begin_step`,
    :meth:`update` for every chunk in order and :meth:`end_step`."""

    state_dict_form: str | None = None
    """How the full state dict writes the per-parameter state where its keys are not the chunk families cut by
    parameter (``"torchao-8bit"`` or ``"plain-8bit"``: :mod:`chunkmem.optim.zero_low_bit`), else ``None``."""

    def __init__(self, optimizer: Any, stores: GradientStores, separate_master: bool) -> None:
        self.optimizer = optimizer
        self.stores = stores
        self.separate_master = separate_master
        self.copies = engine_for_new_model()
        self._host = PinnedHostMemory(pin=self.copies.pins_host)  # exact-size blocks kept by size
        self._host_grads: dict[int, torch.Tensor] = {}  # chunk index -> its gradient shard's host buffer

    def gradient_by_master(self, chunk: FlatChunk) -> torch.Tensor:
        """This rank's shard of ``chunk``'s gradient store where the masters are: the store itself, or (masters on
        the host, ``cpu_offload``) a host buffer kept for the chunk from step to step, copied into by the copy
        engine and waited for."""
        grad = self.stores.own(chunk)
        if grad.device == chunk.master.device:
            return grad
        kept = self._host_grads.get(chunk.index)
        if kept is None or kept.dtype != grad.dtype:  # first step, or the store was widened for accumulation
            if kept is not None:
                self._host.give_back(kept)
            kept = self._host_grads[chunk.index] = self._host.empty(grad.numel(), grad.dtype)
        self.copies.to_host(kept, grad, "grad read").wait()
        return kept

    def write_working(self, chunk: FlatChunk, runs: list[tuple[int, int]]) -> None:
        """Copy the new masters of ``runs`` (``(start, end)`` in this rank's shard) into the working shard, where
        they are separate, through the copy engine (the all-gather after the step reads the working chunk)."""
        if not self.separate_master:
            return
        own = chunk.own(chunk.param)
        for transfer in [self.copies.to_device(own[a:b], chunk.master[a:b]) for a, b in runs]:
            transfer.wait()

    def check_unchanged(self) -> None:
        """Raise, with nothing changed, where the wrapped optimizer's hyper-parameters now ask for what this rule
        cannot run (before each step)."""

    def begin_step(self) -> None:
        """The step updates now: every chunk's gradients are reduced, and which parameters it steps is agreed."""

    def end_step(self) -> None:
        """The step updated every chunk."""

    def update(self, chunk: FlatChunk, multiplier: float) -> None:
        """Update this rank's shard of ``chunk`` from its gradient store times ``multiplier`` (what unscales and
        clips it)."""
        raise NotImplementedError


class AdamUpdate(ZeroUpdate):
    """chunkmem's Adam kernel over the runs of the shard (module docstring)."""

    def update(self, chunk: FlatChunk, multiplier: float) -> None:
        hyper = hyper_of_group(self.optimizer.param_groups[chunk.group])
        grad = self.gradient_by_master(chunk)
        own = chunk.own(chunk.param)
        in_place = self.separate_master and own.device == chunk.master.device  # the kernel writes the working copy
        spans = param_spans(chunk.slots, chunk.shard_offset)
        exp_avg, exp_avg_sq = chunk.state["exp_avg"], chunk.state["exp_avg_sq"]
        runs = ranges(chunk)
        for a, b, step in runs:
            adam_update_(chunk.master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step, hyper,
                         grad_multiplier=multiplier, param_out=own[a:b] if in_place else None,
                         param_spans=[(s - a, e - a) for s, e in spans])
        if not in_place:
            self.write_working(chunk, [(a, b) for a, b, _ in runs])
        chunk.advance_steps(stepped(chunk))


class AnyOptimizerUpdate(ZeroUpdate):
    """The wrapped optimizer's own step over this rank's shard on stand-ins (views of the masters, shaped where
    the rank owns a parameter whole; a stepped parameter none of whose elements the rank owns advances its scalar
    state on a one-element stand-in: :mod:`chunkmem.optim.any_optimizer`). The scalar state is per parameter
    (``chunk.scalars`` by its index), as torch keeps it. ``layout``: what the optimizer keeps per parameter, held
    to by a :class:`~chunkmem.optim.any_optimizer.LayoutWatch` before each step (``owner``: the optimizer's name,
    for its error)."""

    def __init__(self, optimizer: Any, stores: GradientStores, separate_master: bool, layout: StateLayout,
                 owner: str) -> None:
        super().__init__(optimizer, stores, separate_master)
        self.layout = layout
        self._watch = LayoutWatch(optimizer, layout, owner)

    def check_unchanged(self) -> None:
        self._watch.check()

    def update(self, chunk: FlatChunk, multiplier: float) -> None:
        slots = stepped(chunk)
        views = [ParamView.elsewhere(chunk.group, slot.index) if part is None else
                 ParamView.of_part(slot.offset, slot.numel, slot.shape, part, chunk.shard_offset, chunk.group,
                                   slot.index)
                 for slot in slots for part in (slot.owned(),)]
        grad = self.gradient_by_master(chunk).to(dtype=torch.float32, copy=True).mul_(multiplier)
        step_parameters(self.optimizer, self.layout, views, chunk.master, grad, chunk.state, chunk.scalars,
                        whole_state=chunk.whole_state)
        chunk.advance_steps(slots)
        self.write_working(chunk, [(a, b) for a, b, _ in ranges(chunk)])

