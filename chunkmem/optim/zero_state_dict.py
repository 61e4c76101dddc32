"""The state dicts of a :class:`~chunkmem.LowLevelZeroOptimizer`: its optimizer state in ``torch.optim`` layout and
its module's state with the fp32 masters, each exported (gathered over the ranks) and loaded (checked first,
then applied, writing only this rank's elements, with no collective).

* :func:`optimizer_state_dict` / :func:`prepare_optimizer_load`: the format of :mod:`chunkmem.optim.state_dict`
  (torch's, shared with :class:`~chunkmem.ShardedOptimizerV2`: each loads the others' over the same parameters,
  at any world size): Adam's ``step``, ``exp_avg`` and ``exp_avg_sq`` per parameter, or another optimizer's own
  keys with its scalar state (``step``, ...) per parameter as torch keeps it, or an 8-bit Adam's entries as its
  rule writes and reads them (:mod:`chunkmem.optim.zero_low_bit`: torchao's, or HybridAdam's plain tensors); the
  param groups and the loss scaler.
* :func:`model_state_dict` / :func:`prepare_model_load`: ``module.state_dict()`` with the fp32 masters in place
  of the parameters the optimizer trains; loading writes the working parameters and this rank's masters.

Each function takes the optimizer itself and reads what it exposes (its chunks, ranks, state layout, parameters).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import InvalidArgumentError, check_type
from ..state_dicts import check_tensor_data
from .adam import params_mismatch
from .state_dict import adam_entry, any_entry, check_entry, export_param_groups, prepare_hyper_load, scalar_copy
from .zero_partition import FlatChunk, FlatSlot


def optimizer_state_dict(optim: Any, rank0_only: bool) -> dict[str, Any]:
    """The full optimizer state (``LowLevelZeroOptimizer.state_dict``): gathered, every rank calls it; with
    ``rank0_only`` the others get ``{}``."""
    check_type("rank0_only", rank0_only, bool, "True or False")
    layout, rule = optim.state_layout, optim.update_rule
    groups, _ = export_param_groups(optim)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for chunk in optim.chunks:
        if not chunk.stepped:
            continue
        if rule.state_dict_form is not None:  # an 8-bit Adam's (collectives, in chunk order)
            state.update(rule.state_entries(chunk))
            continue
        gathered = {family: optim.gather_shards(chunk, shard) for family, shard in chunk.state.items()}
        for slot in chunk.slots:
            if chunk.step_of(slot) == 0:  # torch keeps no state for a parameter never stepped
                continue
            if layout is None:
                state[slot.index] = adam_entry(chunk.step_of(slot), slot.view(gathered["exp_avg"]),
                                               slot.view(gathered["exp_avg_sq"]), slot.shape)
            elif layout.whole:
                if slot.index in chunk.whole_state:
                    state[slot.index] = scalar_copy(chunk.whole_state[slot.index])
            elif slot.index in chunk.scalars:  # its own scalar state (step, ...), as torch keeps it
                state[slot.index] = any_entry(chunk.scalars[slot.index], gathered, slot.view, slot.shape)
    if rank0_only and optim.shards.rank != 0:
        return {}
    scaler = optim.grad_scaler.state_dict() if optim.grad_scaler is not None else None
    return {"state": dict(sorted(state.items())), "param_groups": groups, "loss_scaler": scaler}


def prepare_optimizer_load(optim: Any, state_dict: Mapping[str, Any]) -> Callable[[], None]:
    """Check ``state_dict`` (``LowLevelZeroOptimizer.load_state_dict``) and return the function that loads it
    (nothing changes until it is called)."""
    allowed = "an optimizer state dict with 'state' and 'param_groups'"
    check_type("state_dict", state_dict, Mapping, allowed)
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise InvalidArgumentError("state_dict", f"a dict without {key!r}", allowed)
    layout, rule = optim.state_layout, optim.update_rule
    low_bit = rule.state_dict_form is not None
    plan = prepare_hyper_load(optim, state_dict["param_groups"], state_dict.get("loss_scaler"),
                              adam=layout is None and not low_bit)
    if low_bit:
        rule.check_groups(plan.groups)
    state = state_dict["state"]
    check_type("state_dict['state']", state, Mapping, "a mapping from parameter index to its optimizer state")
    total = len(optim.params)
    for index in state:
        if not isinstance(index, int) or not 0 <= index < total:
            raise InvalidArgumentError("state_dict['state']", f"a state for index {index!r}",
                                       f"indices of the param_groups' 'params' ({total} parameters)")
    writes = [(chunk, *_checked_entries(optim, chunk, state)) for chunk in optim.chunks]
    low_bit_families = [rule.loaded_families(chunk, entries) for chunk, _, entries in writes] if low_bit else None

    def apply() -> None:
        plan.apply()
        with torch.no_grad():
            for n, (chunk, step, entries) in enumerate(writes):
                chunk.steps = dict(step)
                if low_bit_families is not None:
                    for family, values in low_bit_families[n].items():
                        chunk.state[family].copy_(values)
                    continue
                for shard in chunk.state.values():
                    shard.zero_()
                chunk.scalars.clear()
                chunk.whole_state.clear()
                for slot, entry in entries:
                    for family, shard in chunk.state.items():
                        chunk.write_own_part(slot, shard, entry[family].detach())
                    if layout is not None and layout.whole:
                        chunk.whole_state[slot.index] = scalar_copy(entry)
                    elif layout is not None:  # its own (older state dicts hold the group's in each)
                        chunk.scalars[slot.index] = scalar_copy(entry, chunk.state_families)
    return apply


def _checked_entries(optim: Any, chunk: FlatChunk, state: Mapping[Any, Any]
                     ) -> tuple[dict[int, int], list[tuple[FlatSlot, Mapping[str, Any]]]]:
    """The step counts (by the slots' positions in the chunk, those > 0) and the entries to load of ``chunk``'s
    parameters from a state dict's ``state``, each entry checked as the optimizer's form asks (raises naming it)."""
    layout, rule = optim.state_layout, optim.update_rule
    steps, entries = {}, []
    for slot in chunk.slots:
        entry = state.get(slot.index)
        name = f"index {slot.index}"
        if entry is None:
            step = 0
        elif rule.state_dict_form is not None:
            step = rule.check_entry(slot.index, name, entry, slot)
        elif layout is None:
            step = check_entry(slot.index, name, entry, slot)
        else:
            step = check_entry(slot.index, name, entry, slot, chunk.state_families, counts_steps=False,
                               whole=layout.whole)
        if step:
            steps[slot.index_in_chunk] = step
        if entry is not None and step > 0:
            entries.append((slot, entry))
    return steps, entries


def check_module(optim: Any, module: Any, argument: str) -> None:
    """Raise unless ``module`` is the module ``optim`` trains (``LowLevelZeroOptimizer.check_module``)."""
    allowed = ("the module whose parameters the optimizer holds (each parameter of its param_groups a "
               "parameter of the module, each trainable parameter of the module in its param_groups)")
    check_type(argument, module, nn.Module, allowed)
    why = params_mismatch(module, optim.params)
    if why is not None:
        raise InvalidArgumentError(argument, f"a {type(module).__name__} ({why})", allowed)


def model_state_dict(optim: Any, module: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` on the CPU with the fp32 masters (``LowLevelZeroOptimizer.model_state_dict``)."""
    check_module(optim, module, "module")
    masters: dict[int, torch.Tensor] = {}
    for chunk in optim.chunks:
        full = optim.gather_shards(chunk, chunk.master)
        for slot in chunk.slots:
            masters[id(slot.param)] = slot.view(full).clone()
    if rank0_only and optim.shards.rank != 0:
        return {}
    return {key: masters.get(id(value), value.detach().to("cpu", copy=True)) if isinstance(value, torch.Tensor)
            else value for key, value in module.state_dict(keep_vars=True).items()}


def prepare_model_load(optim: Any, module: nn.Module, state_dict: Mapping[str, Any]) -> Callable[[], None]:
    """Check a full module state dict (``LowLevelZeroOptimizer.load_model_state_dict``) and return the function
    that loads it (nothing changes until it is called)."""
    check_module(optim, module, "module")
    check_type("state_dict", state_dict, Mapping, "a mapping from the module's state_dict() keys to tensors")
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if missing or unexpected:
        raise InvalidArgumentError("state_dict", f"a state dict with missing keys {missing[:5]} and unexpected "
                                   f"keys {unexpected[:5]}", "exactly the keys of module.state_dict()")
    for key, target in own.items():
        value = check_tensor_data(f"state_dict[{key!r}]", state_dict[key], floating=target.is_floating_point())
        if tuple(value.shape) != tuple(target.shape):
            raise InvalidArgumentError(f"state_dict[{key!r}]", f"a tensor of shape {tuple(value.shape)}",
                                       f"a tensor of shape {tuple(target.shape)}")

    def apply() -> None:
        with torch.no_grad():
            for key, target in own.items():
                slot = optim.slot_of(target)
                target.copy_(state_dict[key])
                if slot is not None and optim.separate_master:
                    slot.chunk.write_own_part(slot, slot.chunk.master, state_dict[key].float())
    return apply
