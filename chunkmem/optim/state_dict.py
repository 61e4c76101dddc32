"""The optimizers' full state dicts: ``ShardedOptimizerV2`` / ``LowLevelZeroOptimizer``'s ``state_dict`` and
``load_state_dict``, in ``torch.optim`` layout.

The moments of each chunk are gathered to export them (``chunk.gather``, called by every rank in chunk
order); loading writes only this rank's elements, with no collective. Loading is planned first (every
value checked, nothing changed), then applied.

The format is ``torch.optim.Optimizer.state_dict()``'s:

* ``"state"``: ``{index: {"step": tensor(float32 scalar), "exp_avg": fp32 tensor shaped like the
  parameter, "exp_avg_sq": the same}}``, indices numbered over ``optimizer.param_groups`` in order;
  a parameter that has never stepped has no entry (torch creates state at its first step). Another
  optimizer's entries hold its own keys, each parameter's scalars (``step``, ...) its own.
* ``"param_groups"``: each group's hyper-parameters with ``"params"`` the group's indices. The
  decoupled-weight-decay flag is written in both spellings, ``adamw_mode`` (HybridAdam) and
  ``decoupled_weight_decay`` (torch), so that ``torch.optim.Adam`` and ``AdamW`` read it.
* ``"loss_scaler"`` (chunkmem's addition): the :class:`~chunkmem.DynamicGradScaler` state, or
  ``None`` when the model trains unscaled. ``torch.optim.Optimizer.load_state_dict`` reads only
  ``"state"`` and ``"param_groups"`` and ignores it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..core.chunk import ADAM_STATE, Chunk, ParamSlot
from ..errors import InvalidArgumentError, check_type
from ..state_dicts import check_tensor_data
from .adam_math import UNSUPPORTED_OPTIONS, hyper_of_group
_HYPER = "a param group with lr, betas (two numbers), eps and weight_decay"


def export_group(group: Mapping[str, Any], indices: list[int]) -> dict[str, Any]:
    """One packed param group: its hyper-parameters, the decoupled-weight-decay flag in both
    spellings, and ``"params"``: ``indices``."""
    packed = {k: v for k, v in group.items() if k != "params"}
    if "adamw_mode" in packed and "decoupled_weight_decay" not in packed:
        packed["decoupled_weight_decay"] = bool(packed["adamw_mode"])
    packed["params"] = list(indices)
    return packed


def export_param_groups(optim: Any) -> tuple[list[dict[str, Any]], list[nn.Parameter]]:
    """The packed param groups of ``optim.optim`` and its parameters in index order (torch's
    numbering: consecutive over the groups in order)."""
    groups, params = [], []
    for group in optim.optim.param_groups:
        groups.append(export_group(group, list(range(len(params), len(params) + len(group["params"])))))
        params.extend(group["params"])
    return groups, params


def adam_entry(step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, shape: Any) -> dict[str, torch.Tensor]:
    """One parameter's state as ``torch.optim.Adam`` keeps it: a float32 scalar ``step`` and fp32
    moments shaped like the parameter (copies, on the CPU)."""
    return {"step": torch.tensor(float(step), dtype=torch.float32),
            "exp_avg": exp_avg.detach().to("cpu", torch.float32, copy=True).view(tuple(shape)),
            "exp_avg_sq": exp_avg_sq.detach().to("cpu", torch.float32, copy=True).view(tuple(shape))}


def any_entry(scalars: Mapping[str, Any], whole: Mapping[str, torch.Tensor], view: Any,
              shape: Any) -> dict[str, Any]:
    """One parameter's state as another torch optimizer keeps it: copies of its ``scalars`` and,
    for each per-element key, its part of the chunk-long ``whole[key]`` (cut by ``view``) as an fp32 CPU
    tensor shaped like the parameter."""
    entry: dict[str, Any] = scalar_copy(scalars)
    for key, full in whole.items():
        entry[key] = view(full).detach().to("cpu", torch.float32, copy=True).view(tuple(shape))
    return entry


def scalar_copy(state: Mapping[str, Any], leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A copy of the entries of ``state`` not in ``leave_out`` (tensors copied to the CPU)."""
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in state.items() if k not in leave_out}


def optimizer_state_dict(optim: Any, rank0_only: bool) -> dict[str, Any]:
    """The full optimizer state dict (module docstring). Gathers the moments of every chunk that has
    stepped: every rank must call it; with ``rank0_only`` the other ranks get ``{}``."""
    check_type("rank0_only", rank0_only, bool, "True or False")
    groups, params = export_param_groups(optim)
    index_of = {id(p): i for i, p in enumerate(params)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for chunk in optim.runtime.chunks:
        if chunk.trainable and chunk.stepped:
            state.update(optim.update_rule.state_entries(chunk, index_of))
    if rank0_only and optim.model.data_parallel.rank != 0:
        return {}
    scaler = optim.grad_scaler.state_dict() if optim.grad_scaler is not None else None
    return {"state": dict(sorted(state.items())), "param_groups": groups, "loss_scaler": scaler}


class OptimizerLoad:
    """A checked plan to load a full optimizer state dict into a :class:`~chunkmem.ShardedOptimizerV2` (or
    only its param groups and loss scaler into a ``LowLevelZeroOptimizer``). ``adam``: the groups hold Adam's
    hyper-parameters (their flags are set in the wrapped optimizer's spelling)."""

    def __init__(self, optim: Any, groups: list[Mapping[str, Any]],
                 chunks: list[tuple[Chunk, dict[int, int], list[tuple[ParamSlot, Mapping[str, Any]]]]],
                 scaler: Mapping[str, Any] | None, adam: bool) -> None:
        self.optim = optim
        self.groups = groups
        self.chunks = chunks
        self.scaler = scaler
        self.adam = adam

    def apply(self) -> None:
        """Write each chunk's step and this rank's part of the moments (or another optimizer's state),
        the hyper-parameters and the loss scaler state."""
        with torch.no_grad():
            for chunk, step, entries in self.chunks:  # (only a ShardedOptimizerV2's plan has chunks)
                rule = self.optim.update_rule
                families = rule.loaded_families(chunk, entries)
                scalars: dict[int, dict[str, Any]] = {}
                whole: dict[int, dict[str, Any]] = {}
                for slot, entry in entries:
                    rule.keep_entry(slot, entry, scalars, whole)
                for key, values in families.items():
                    chunk.optim[key].write(values)
                rule.replace_kept_state(chunk, scalars, whole)
                chunk.steps = {index: count for index, count in step.items() if count}
        for group, saved in zip(self.optim.optim.param_groups, self.groups):
            if self.adam:
                import_group(group, saved)
            else:  # another optimizer: its own keys, as torch's load_state_dict sets them
                group.update((k, v) for k, v in saved.items() if k != "params")
        if self.scaler is not None and self.optim.grad_scaler is not None:
            self.optim.grad_scaler.load_state_dict(self.scaler)
        self.optim.state_loaded()


def import_group(group: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Set ``group``'s hyper-parameters to ``saved``'s (every key but ``"params"``), with the
    decoupled-weight-decay and bias-correction flags in the spellings the wrapped optimizer uses."""
    hyper = hyper_of_group(saved)
    group.update((k, v) for k, v in saved.items() if k != "params")
    if "adamw_mode" in group:
        group["adamw_mode"] = hyper.adamw_mode
    if "decoupled_weight_decay" in group:
        group["decoupled_weight_decay"] = hyper.adamw_mode
    if "bias_correction" in group:
        group["bias_correction"] = hyper.bias_correction


def prepare_optimizer_load(optim: Any, state_dict: Any) -> OptimizerLoad:
    """Check an optimizer state dict (chunkmem's or ``torch.optim.Adam``/``AdamW``'s) against
    ``optim`` without changing anything."""
    allowed = "an optimizer state dict with 'state' and 'param_groups' (ShardedOptimizerV2.state_dict() or " \
              "torch.optim.AdamW.state_dict())"
    check_type("state_dict", state_dict, Mapping, allowed)
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise InvalidArgumentError("state_dict", f"a dict without {key!r} (keys {list(state_dict)[:5]})", allowed)
    rule = optim.update_rule
    plan = prepare_hyper_load(optim, state_dict["param_groups"], state_dict.get("loss_scaler"),
                           adam=rule.adam_hyper_parameters)
    param_of = {}
    for group, saved in zip(optim.optim.param_groups, plan.groups):
        param_of.update(zip(saved["params"], group["params"]))
    state = state_dict["state"]
    check_type("state_dict['state']", state, Mapping, "a mapping from parameter index to its Adam state")
    entry_of = {}
    for index, entry in state.items():
        if index not in param_of:
            raise InvalidArgumentError("state_dict['state']", f"a state for index {index!r}",
                                       f"indices of the param_groups' 'params' ({len(param_of)} parameters)")
        entry_of[id(param_of[index])] = (index, entry)
    for chunk in optim.runtime.chunks:
        if not chunk.trainable:
            continue
        steps: dict[int, int] = {}  # slot index -> its step count (a parameter without state: 0)
        entries = []
        for slot in chunk.slots:
            index, entry = entry_of.get(id(slot.param), (None, None))
            name = optim.model.parameter_name(slot.param) or slot.name
            if entry is None:
                step = 0
            else:
                step = rule.check_entry(index, name, entry, slot)
            steps[slot.index_in_chunk] = step
            if entry is not None and step > 0:
                entries.append((slot, entry))
        plan.chunks.append((chunk, steps, entries))
    return plan


def prepare_hyper_load(optim: Any, param_groups: Any, loss_scaler: Any, *, adam: bool) -> OptimizerLoad:
    """A checked plan that loads only the param groups' hyper-parameters and the loss scaler state
    (``None``: leave the scaler as it is); the caller may add chunk states to ``plan.chunks``. ``adam``: the
    groups are Adam's (checked as such), not another optimizer's own."""
    groups = _check_groups(optim.optim.param_groups, param_groups, adam=adam)
    if loss_scaler is not None:
        _check_loss_scaler(loss_scaler)
    return OptimizerLoad(optim, groups, [], loss_scaler, adam)


def _check_loss_scaler(state: Any) -> None:
    """Raise unless ``state`` is a loss scaler state a :class:`~chunkmem.DynamicGradScaler` can run
    from: a finite scale > 0 and counts that are non-negative integers."""
    where = "state_dict['loss_scaler']"
    check_type(where, state, Mapping, "None or DynamicGradScaler.state_dict()")
    for key in ("scale", "overflows_since_growth", "clean_steps"):
        if key not in state:
            raise InvalidArgumentError(where, f"a dict without {key!r}",
                                       "DynamicGradScaler.state_dict() (scale, overflows_since_growth, clean_steps)")
    scale = state["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise InvalidArgumentError(f"{where}['scale']", scale, "a finite number > 0")
    for key in ("overflows_since_growth", "clean_steps"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(f"{where}[{key!r}]", value, "an integer >= 0")


def _check_groups(groups: list[dict[str, Any]], saved_groups: Any, adam: bool = True) -> list[Mapping[str, Any]]:
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        count = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else type(saved_groups).__name__
        raise InvalidArgumentError("state_dict['param_groups']", f"{count} groups",
                                   f"{len(groups)} groups, as the optimizer has")
    for n, (group, saved) in enumerate(zip(groups, saved_groups)):
        where = f"state_dict['param_groups'][{n}]"
        check_type(where, saved, Mapping, "a param group dict")
        if len(saved.get("params", ())) != len(group["params"]):
            raise InvalidArgumentError(where, f"a group of {len(saved.get('params', ()))} parameters",
                                       f"{len(group['params'])} parameters, as the optimizer's group {n}")
        if not adam:  # another optimizer: its own hyper-parameters, whatever they are
            continue
        for option in UNSUPPORTED_OPTIONS:
            if saved.get(option):
                raise InvalidArgumentError(f"{where}[{option!r}]", saved[option],
                                           "False (not supported by the chunked Adam update)")
        if isinstance(saved.get("lr"), torch.Tensor):
            raise InvalidArgumentError(f"{where}['lr']", saved["lr"], "a Python float")
        try:
            hyper_of_group(saved)
        except KeyError as exc:
            raise InvalidArgumentError(where, f"a group without {exc}", _HYPER) from None
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(where, f"a group with an unreadable hyper-parameter ({exc})", _HYPER) from None
    return list(saved_groups)


def check_entry(index: Any, name: str, entry: Any, slot: ParamSlot, keys: tuple[str, ...] = ADAM_STATE,
                counts_steps: bool = True, whole: bool = False) -> int:
    """The step of one parameter's saved state, after checking its per-element ``keys`` (Adam's moments, or
    another optimizer's own), each of the parameter's size, and that it holds no other per-element tensor (the
    state of another optimizer class); raises naming both. ``counts_steps``: a ``"step"`` >= 0 is required
    (Adam); otherwise it may be absent (SGD counts none: 1 is returned) and, when there, is >= 1 (the state
    exists, so a step ran). ``whole``: the optimizer keeps all its state per parameter (any tensor goes)."""
    where = f"state_dict['state'][{index!r}] (parameter {name!r})"
    required = ("step", *keys) if counts_steps else keys
    listing = ", ".join(required[:-1]) + f" and {required[-1]}" if len(required) > 1 else ", ".join(required)
    check_type(where, entry, Mapping, f"a dict with {listing}" if required else "a dict of the optimizer's state")
    for key in required:
        if key not in entry:
            raise InvalidArgumentError(where, f"a state without {key!r}", listing)
    foreign = [] if whole else [key for key, value in entry.items() if key not in keys and isinstance(
        value, torch.Tensor) and value.numel() == slot.numel and value.numel() > 1]
    if foreign:  # e.g. an AdamW checkpoint loaded into SGD: its moments would be dropped, its lr taken
        raise InvalidArgumentError(where, f"a state with {', '.join(map(repr, foreign))}",
                                   f"the state this optimizer keeps ({listing or 'no per-element state'}): a state "
                                   f"dict of another optimizer class is not loaded; nothing was changed")
    for key in keys:
        value = entry[key]
        if isinstance(value, torch.Tensor) and value.numel() != slot.numel:
            raise InvalidArgumentError(f"{where}[{key!r}]", f"a tensor of shape {tuple(value.shape)}",
                                       f"a floating-point tensor of shape {tuple(slot.shape)}")
        check_tensor_data(f"{where}[{key!r}]", value, floating=True)
    if "step" not in entry:
        return 1
    step = entry["step"]
    if isinstance(step, torch.Tensor):
        check_tensor_data(f"{where}['step']", step)
    step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    low = 0 if counts_steps else 1
    if (isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step < low
            or step != int(step)):
        raise InvalidArgumentError(f"{where}['step']", entry["step"],
                                   "a non-negative whole number" if counts_steps else "a whole number >= 1")
    return int(step)
