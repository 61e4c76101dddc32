"""One call from a configuration to a wrapped model and optimizer: :func:`initialize`.

Two forms of configuration are read, as a dict or as the path of a JSON file (:mod:`chunkmem.configs`
reads them into settings; this module wraps):

* the ColossalAI form, ``{"zero": {"model_config": {...}, "optimizer_config": {...}}}``, whose two
  sections are the keyword arguments of :class:`~chunkmem.ShardedModelV2` and
  :class:`~chunkmem.ShardedOptimizerV2` (``shard_strategy`` may also be the name of a strategy class;
  :mod:`chunkmem.configs.colossalai`);
* the DeepSpeed form, with the sections ``zero_optimization``, ``fp16``, ``bf16``, ``data_types`` and
  ``optimizer`` (plus the training-loop keys DeepSpeed reads, which chunkmem leaves to the loop;
  :mod:`chunkmem.configs.deepspeed`).

Every key is checked before anything is built. An unknown key, a key chunkmem cannot honour and two
keys that contradict each other raise :class:`~chunkmem.InvalidArgumentError` naming the key path
(``zero_optimization.offload_param.device``) and the allowed values; a value of the wrong type (a string
for a number, a bool for a count) raises its subclass :class:`~chunkmem.ArgumentTypeError`. A key that
chunkmem accepts but that changes nothing warns with :class:`~chunkmem.NoEffectWarning`, naming it.
``chunkmem.configs.deepspeed.KEY_TABLE`` lists the DeepSpeed keys and what each becomes.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.nn as nn

from ..configs import colossalai
from ..configs.deepspeed import DEEPSPEED_KEYS, build_optimizer, parse, stage3_settings, stages_1_and_2_arguments
from ..configs.reading import listing, read_config, rename_errors
from ..core.param_guard import slot_of
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..model.builder import compute_dtype
from ..model.sharded_model import ShardedModelV2
from ..optim.adam import check_supported_optimizer, params_mismatch
from ..optim.low_bit_rule import low_bit_decoupled, stochastic_rounding
from ..optim.low_level_zero import LowLevelZeroOptimizer
from ..optim.sharded_optimizer import ShardedOptimizerV2
from ..settings import ModelSettings, OptimizerSettings

__all__ = ["initialize"]


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               config: dict[str, Any] | str | os.PathLike | None = None, *, plan: Any = None,
               nvme_path: str | os.PathLike | None = None) -> tuple[nn.Module, Any]:
    """Wrap ``model`` (and ``optimizer``) as ``config`` says; returns ``(model, optimizer)``.

    Args:
        model: the module, built plainly or inside :class:`~chunkmem.ZeroInitContext`.
        optimizer: a torch optimizer over ``model.parameters()`` (any: see
            :mod:`chunkmem.optim.any_optimizer` for what is refused), or ``None``: built from the
            config's ``optimizer`` section (DeepSpeed form), or no optimizer (the second value returned is
            then ``None``).
        config: a dict or the path of a JSON file, in the ColossalAI form (``zero`` with
            ``model_config`` / ``optimizer_config``) or the DeepSpeed form (``zero_optimization``,
            ``fp16``, ``bf16``, ``optimizer``); see the module docstring and
            ``chunkmem.configs.deepspeed.KEY_TABLE``.
        plan: instead of ``config``, a candidate of :func:`chunkmem.choose` (``choose(...).recommended``):
            the model is wrapped with the settings it was planned with (``candidate.config(nvme_path)``); a
            candidate planned with 8-bit optimizer state needs an 8-bit Adam as ``optimizer`` (with
            ``bf16_stochastic_round=True`` exactly when it was planned with ``"8bit-bf16"``).
        nvme_path: with ``plan``, the disk tier's directory when the candidate uses it.

    Stage 3 (and the ColossalAI form) returns a :class:`~chunkmem.ShardedModelV2` and a
    :class:`~chunkmem.ShardedOptimizerV2`; stages 1 and 2 return the model unwrapped (cast to the
    configured dtype) and a ``chunkmem.LowLevelZeroOptimizer``.

    All or nothing: the optimizer is checked against ``model`` (one chunkmem can step, over ``model``'s
    parameters: each of its parameters one of ``model``'s, each parameter of ``model`` that requires grad
    in it; else :class:`~chunkmem.InvalidArgumentError` naming ``optimizer``) and every optimizer argument
    is checked before the module is cast or wrapped; a failure only the wrapped model can detect (room
    for the optimizer state) undoes the wrapping before it is re-raised.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError("model", type(model).__name__, "a torch.nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError("optimizer", type(optimizer).__name__, "a torch.optim.Optimizer or None")
    if plan is not None:
        if config is not None:
            raise InvalidArgumentError("plan", getattr(plan, "name", plan),
                                       "None when config is given (one or the other)")
        if not callable(getattr(plan, "config", None)) or not isinstance(getattr(plan, "settings", None), dict):
            raise ArgumentTypeError("plan", type(plan).__name__,
                                    "a candidate of chunkmem.choose() (a chunkmem.plan.Candidate)")
        if optimizer is not None:
            _check_planned_optimizer(plan, optimizer)
        config = plan.config(nvme_path)
    elif nvme_path is not None:
        raise InvalidArgumentError("nvme_path", nvme_path, "None unless plan is given (a config names its own)")
    config = read_config(config)
    if "zero" in config:
        extra = sorted(set(config) - {"zero"})
        if extra:
            raise InvalidArgumentError(f"config.{extra[0]}", config[extra[0]],
                                       "no other top-level key beside 'zero' (the ColossalAI form); use either "
                                       "'zero' or the DeepSpeed sections " + listing(DEEPSPEED_KEYS))
        return _initialize_colossal(model, optimizer, config["zero"])
    return _initialize_deepspeed(model, optimizer, config)


def _check_planned_optimizer(plan: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that does not keep the optimizer state ``plan`` (a :class:`~chunkmem.plan.Candidate`)
    was planned with: an 8-bit candidate needs an 8-bit Adam; one planned with bf16 parameters as their own masters
    (``"8bit-bf16"``) needs ``bf16_stochastic_round=True``, and one planned with fp32 masters (``"8bit"`` over a bf16
    model) needs it off."""
    state = getattr(plan, "optimizer_state", "fp32")
    if state == "fp32":
        return
    name = type(optimizer).__name__
    if low_bit_decoupled(optimizer) is None:
        allowed = ("an 8-bit Adam with bf16_stochastic_round=True (chunkmem.HybridAdam(..., state_dtype='8bit', "
                   "bf16_stochastic_round=True), torchao's AdamW8bit or Adam8bit)" if state == "8bit-bf16" else
                   "an 8-bit Adam (chunkmem.HybridAdam(..., state_dtype='8bit'), torchao's AdamW8bit or Adam8bit)")
        raise InvalidArgumentError("optimizer", name, f"{allowed}: candidate {plan.name} was planned with 8-bit state")
    rounding = stochastic_rounding(optimizer, plan.settings.get("dtype", torch.float32))
    if rounding != (state == "8bit-bf16"):
        raise InvalidArgumentError(
            f"optimizer ({name}).bf16_stochastic_round", bool(getattr(optimizer, "bf16_stochastic_round", False)),
            f"{state == '8bit-bf16'}: candidate {plan.name} was planned with "
            + ("bf16 parameters as their own masters" if state == "8bit-bf16" else
               "fp32 masters (plan the bf16 parameters as their own masters with optimizer_states=(..., '8bit-bf16'))"))


# ---- the ColossalAI form ------------------------------------------------------------------------------

def _initialize_colossal(model: nn.Module, optimizer: Any, zero: Any) -> tuple[nn.Module, Any]:
    model_config, optimizer_config = colossalai.read_sections(zero)
    if optimizer_config and optimizer is None:
        raise InvalidArgumentError("optimizer", None, "a torch optimizer over model.parameters() when "
                                                      "zero.optimizer_config is given")
    model_settings, optimizer_settings = colossalai.to_settings(model_config, optimizer_config)
    def renamed(build: Callable[[], Any]) -> Any:
        return rename_errors("zero.model_config.", build)
    if optimizer is None:
        return renamed(lambda: ShardedModelV2.from_settings(model, model_settings)), None
    _check_optimizer(model, optimizer)
    rename_errors("zero.optimizer_config.",
                  lambda: ShardedOptimizerV2.check_before_wrapping(model, model_settings, optimizer_settings))
    return _wrap_all_or_nothing(model, model_settings, renamed, lambda wrapped: rename_errors(
        "zero.optimizer_config.", lambda: ShardedOptimizerV2.from_settings(wrapped, optimizer, optimizer_settings)))


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Refuse, before anything changes, an optimizer chunkmem cannot step (not a torch optimizer) or one
    that is not over ``model``'s parameters (each of its parameters one of ``model``'s, each trainable
    parameter of ``model`` in it: what ShardedOptimizerV2 and LowLevelZeroOptimizer require)."""
    check_supported_optimizer(optimizer)
    why = params_mismatch(model, [p for group in optimizer.param_groups for p in group["params"]])
    if why is not None:
        raise InvalidArgumentError("optimizer", f"a {type(optimizer).__name__} ({why})",
                                   "an optimizer over model.parameters(): each of its parameters a parameter of model, "
                                   "each parameter of model that requires grad in it (freeze the others with "
                                   "requires_grad_(False))")


def _wrap_all_or_nothing(model: nn.Module, model_settings: ModelSettings, renamed: Callable[[Callable[[], Any]], Any],
                         attach: Callable[[ShardedModelV2], Any]) -> tuple[ShardedModelV2, Any]:
    """Wrap the model with ``model_settings`` (its errors ``renamed``) and ``attach(wrapped)`` its
    optimizer; if attaching fails (what only the wrapped model can check: room for the optimizer state on
    the device or the disk), give the module back as it was and re-raise.

    ``ShardedModelV2.unwrap`` returns fp32 CPU values, exact where the wrapped dtype held the values; a
    plain module's parameters are then put back in their own dtype and on their own device, and those of
    another dtype than the wrapped one (which the cast may have rounded) get their original tensors back:
    those are kept (referenced, not copied) until the optimizer is attached. The buffers, which wrapping
    casts and moves, are the original tensors again. A module built in ``ZeroInitContext`` comes back as
    a plain module holding its values in fp32 on the CPU."""
    dtype = renamed(lambda: compute_dtype(model, model_settings))  # raises as the wrapping would, before it
    kept: list[tuple[nn.Parameter, torch.Tensor | None, torch.dtype, torch.device]] = []
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    if not any(slot_of(p) is not None for p in model.parameters()):
        kept = [(p, p.data if p.dtype != dtype else None, p.dtype, p.device) for p in model.parameters()]
        buffers = [(sub, name, buf) for sub in model.modules() for name, buf in sub._buffers.items() if buf is not None]
    wrapped = renamed(lambda: ShardedModelV2.from_settings(model, model_settings))
    try:
        return wrapped, attach(wrapped)
    except BaseException:
        wrapped.unwrap()
        with torch.no_grad():
            for p, data, dtype, device in kept:
                p.data = data if data is not None else p.data.to(device=device, dtype=dtype)
        for sub, name, buf in buffers:
            setattr(sub, name, buf)
        raise


# ---- the DeepSpeed form -------------------------------------------------------------------------------

def _initialize_deepspeed(model: nn.Module, optimizer: Any, config: dict[str, Any]) -> tuple[nn.Module, Any]:
    parsed = parse(config)
    optimizer_section = parsed.optimizer_section
    if optimizer_section and optimizer is not None:
        raise InvalidArgumentError("optimizer", type(optimizer).__name__,
                                   "None when the config has an 'optimizer' section (give one or the other)")
    if optimizer_section:  # checked in full before anything is wrapped
        build_optimizer(optimizer_section, [torch.zeros(1, requires_grad=True)])
    if optimizer is not None:
        _check_optimizer(model, optimizer)

    if parsed.stage == 3:
        model_settings, optimizer_settings, model_keys = stage3_settings(parsed)
        return _stage3(model, optimizer, optimizer_section, model_settings, optimizer_settings, model_keys)

    # stages 1 and 2: the model stays a plain module
    kwargs, keys = stages_1_and_2_arguments(parsed)
    if optimizer is None:
        if not optimizer_section:
            raise InvalidArgumentError("optimizer", None, "a torch optimizer or an 'optimizer' config section "
                                                          "with stage 1 or 2")
        optimizer = build_optimizer(optimizer_section, model.parameters())  # the cast below keeps the parameters
    return _stages_1_and_2(model, optimizer, parsed.dtype, kwargs, keys)


def _stage3(model: nn.Module, optimizer: Any, optimizer_section: dict[str, Any], model_settings: ModelSettings,
            optimizer_settings: OptimizerSettings, model_keys: dict[str, str]) -> tuple[nn.Module, Any]:
    """A ShardedModelV2 and a ShardedOptimizerV2 over ``optimizer`` (already checked against the model),
    or over one built from ``optimizer_section``, or no optimizer; everything checked before the module is
    wrapped, and the wrapping undone if the optimizer cannot be attached. ``model_keys``: the config key
    each model argument comes from (for the errors)."""
    def renamed(build: Callable[[], Any]) -> Any:
        return rename_errors("zero_optimization.", build, model_keys)
    if optimizer is None and not optimizer_section:
        return renamed(lambda: ShardedModelV2.from_settings(model, model_settings)), None
    ShardedOptimizerV2.check_before_wrapping(model, model_settings, optimizer_settings)

    def attach(wrapped: ShardedModelV2) -> ShardedOptimizerV2:
        optim = optimizer if optimizer is not None else build_optimizer(optimizer_section, wrapped.parameters())
        return ShardedOptimizerV2.from_settings(wrapped, optim, optimizer_settings)
    return _wrap_all_or_nothing(model, model_settings, renamed, attach)


def _stages_1_and_2(model: nn.Module, optimizer: Any, dtype: torch.dtype, kwargs: dict[str, Any],
                    keys: dict[str, str]) -> tuple[nn.Module, LowLevelZeroOptimizer]:
    """The module cast to ``dtype`` and a LowLevelZeroOptimizer with ``kwargs``, every argument checked
    (against the parameters as the cast will leave them) before the module is cast."""
    rename_errors("zero_optimization.", lambda: LowLevelZeroOptimizer.check_arguments(optimizer, cast_to=dtype,
                                                                                      **kwargs), keys)
    model.to(dtype)
    return model, rename_errors("zero_optimization.", lambda: LowLevelZeroOptimizer(optimizer, **kwargs), keys)
