"""One call from a configuration to a wrapped model and optimizer: :func:`initialize`.

Two forms of configuration are read, as a dict or as the path of a JSON file:

* the ColossalAI form, ``{"zero": {"model_config": {...}, "optimizer_config": {...}}}``, whose two
  sections are the keyword arguments of :class:`~chunkmem.ShardedModelV2` and
  :class:`~chunkmem.ShardedOptimizerV2` (``shard_strategy`` may also be the name of a strategy class);
* the DeepSpeed form, with the sections ``zero_optimization``, ``fp16``, ``bf16``, ``data_types`` and
  ``optimizer`` (plus the training-loop keys DeepSpeed reads, which chunkmem leaves to the loop).

Every key is checked before anything is built. An unknown key, a key chunkmem cannot honour and two
keys that contradict each other raise :class:`~chunkmem.InvalidArgumentError` naming the key path
(``zero_optimization.offload_param.device``) and the allowed values; a value of the wrong type (a string
for a number, a bool for a count) raises its subclass :class:`~chunkmem.ArgumentTypeError`. A key that
chunkmem accepts but that changes nothing here warns with :class:`NoEffectWarning`, naming it.
``KEY_TABLE`` lists the DeepSpeed keys and what each becomes.
"""
from __future__ import annotations

import inspect
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from .core.param_guard import slot_of
from .optim.adam import HybridAdam, check_supported_optimizer, params_mismatch
from .optim.loss_scaler import DynamicGradScaler
from .builder import compute_dtype
from .errors import ArgumentTypeError, InvalidArgumentError, NoEffectWarning, check_number
from .model import ShardedModelV2
from .optim.low_level_zero import LowLevelZeroOptimizer
from .optim.sharded_optimizer import ShardedOptimizerV2
from .settings import MODEL_KEYWORDS, OPTIMIZER_KEYWORDS, ModelSettings, OptimizerSettings
from .distributed.shard_strategy import BaseShardStrategy, BucketTensorShardStrategy, TensorShardStrategy

__all__ = ["NoEffectWarning", "initialize", "KEY_TABLE"]


# What each DeepSpeed key becomes: "map" (honoured), "warn" (accepted; warns when it asks for
# something chunkmem does not do), "error" (refused unless it has its default value).
KEY_TABLE: dict[str, tuple[str, str]] = {
    "zero_optimization.stage": ("map", "3: ShardedModelV2 + ShardedOptimizerV2; 1, 2: LowLevelZeroOptimizer "
                                       "(2: partition_grad=True); 0: refused"),
    "zero_optimization.offload_optimizer.device": ("map", "none: optimizer state on the device; cpu: on the host "
                                                          "(placement 'cpu' or 'static'); nvme: the disk tier"),
    "zero_optimization.offload_optimizer.nvme_path": ("map", "ShardedModelV2(nvme_path=)"),
    "zero_optimization.offload_optimizer.buffer_count": ("map", "ShardedModelV2(buffer_count=) with nvme"),
    "zero_optimization.offload_optimizer.ratio": ("map", "stage 3: placement 'static' with offload_optim_frac=ratio"),
    "zero_optimization.offload_optimizer.pin_memory": ("warn", "no effect: with a GPU chunkmem pins the host buffers "
                                                               "that cross PCIe itself (chunkmem.set_pinned_memory_budget)"),
    "zero_optimization.offload_optimizer.pipeline_read": ("warn", "chunkmem always pipelines; False has no effect"),
    "zero_optimization.offload_optimizer.pipeline_write": ("warn", "chunkmem always pipelines; False has no effect"),
    "zero_optimization.offload_optimizer.fast_init": ("warn", "no effect"),
    "zero_optimization.offload_param.device": ("map", "none: parameters rest on the device; cpu: on the host; "
                                                      "nvme: the disk tier (stage 3 only)"),
    "zero_optimization.offload_param.nvme_path": ("map", "ShardedModelV2(nvme_path=)"),
    "zero_optimization.offload_param.buffer_count": ("map", "ShardedModelV2(buffer_count=) with nvme"),
    "zero_optimization.offload_param.buffer_size": ("warn", "no effect: the chunk is the unit of transfer "
                                                            "(model chunk_size)"),
    "zero_optimization.offload_param.max_in_cpu": ("warn", "no effect: bound the host tier in bytes with "
                                                           "chunkmem.set_host_memory_capacity"),
    "zero_optimization.offload_param.pin_memory": ("warn", "no effect (as offload_optimizer.pin_memory)"),
    "zero_optimization.reduce_bucket_size": ("map", "stage 3: reduce_scatter_bucket_size_mb (elements x element "
                                                    "size); stages 1, 2: reduce_bucket_size (elements); an "
                                                    "integral float (5e8) is taken as that integer"),
    "zero_optimization.overlap_comm": ("map", "stages 1, 2: overlap_communication; stage 3: true gives "
                                              "ShardedModelV2(reductions_in_flight=2), absent or false 0 (in line: "
                                              "chunkmem's default, not DeepSpeed's, keeps the staging memory bound; "
                                              "the results are the same bits)"),
    "zero_optimization.contiguous_gradients": ("warn", "chunks are always contiguous; False has no effect"),
    "zero_optimization.reduce_scatter": ("warn", "chunkmem always reduce-scatters; False has no effect"),
    "zero_optimization.zero_quantized_weights": ("map", "stage 3: ShardedModelV2(quantized_weights=True); stages 1, "
                                                        "2: only false"),
    "zero_optimization.zero_quantized_nontrainable_weights": ("map", "stage 3: quantized_weights='nontrainable' "
                                                                     "(True when zero_quantized_weights is true "
                                                                     "too); stages 1, 2: only false"),
    "zero_optimization.zero_hpz_partition_size": ("map", "stage 3: ShardedModelV2(secondary_partition_size=) (1 or "
                                                         "absent: none); stages 1, 2: only 1"),
    "zero_optimization.zero_quantized_gradients": ("map", "stage 3: ShardedModelV2(quantized_gradients=); stages 1, "
                                                          "2: only false"),
    "zero_optimization.mics_shard_size": ("map", "stage 3: ShardedModelV2(shard_group_size=) (-1 or absent: None, "
                                                 "flat ZeRO-3)"),
    "zero_optimization.mics_hierarchical_params_gather": ("map", "stage 3: true gives ShardedModelV2("
                                                                "gather_node_size=the LOCAL_WORLD_SIZE environment "
                                                                "variable, which torchrun sets; refused without it); "
                                                                "stages 1, 2: only false"),
    "zero_optimization.legacy_stage1": ("error", "only False"),
    "zero_optimization.cpu_offload": ("error", "deprecated by DeepSpeed: use offload_optimizer"),
    "zero_optimization.cpu_offload_param": ("error", "deprecated by DeepSpeed: use offload_param"),
    "zero_optimization.cpu_offload_use_pin_memory": ("error", "deprecated by DeepSpeed: use offload_*.pin_memory"),
    "zero_optimization.(stage3_)prefetch_bucket_size, (stage3_)max_live_parameters": (
        "map", "stage 3: ShardedModelV2(prefetch_numel=the smaller of the two, elements): chunks fetched ahead "
               "of use, in whole chunks; the chunks computing are on the device whatever the bound"),
    "zero_optimization.(stage3_)param_persistence_threshold, (stage3_)model_persistence_threshold": (
        "map", "stage 3: ShardedModelV2(persistence_threshold=, model_persistence_threshold=) (elements; absent: "
               "0, no persistent parameters, not DeepSpeed's 1e5); no effect with the disk tier or at stages 1, 2"),
    "zero_optimization.(stage3_)max_reuse_distance": (
        "warn", "no effect: the traced schedule knows each chunk's next use (Belady's plan), no distance to tune"),
    "zero_optimization.elastic_checkpoint": (
        "map", "the engine's load_checkpoint(elastic=): absent or true, a sharded checkpoint loads at any world size "
               "and chunk layout (resharded exactly, not DeepSpeed's false default: chunkmem loses nothing by it); "
               "false refuses that; chunkmem.initialize (no engine): no effect, pass elastic= to load_checkpoint"),
    "zero_optimization.<tuning keys>": ("warn", "no effect: allgather_partitions, allgather_bucket_size, "
                                                "use_multi_rank_bucket_allreduce, load_from_fp32_weights, "
                                                "ignore_unused_parameters, round_robin_gradients, "
                                                "sub_group_size, (stage3_)gather_16bit_weights_on_model_"
                                                "save, stage3_gather_fp16_weights_on_model_save, "
                                                "memory_efficient_linear, override_module_apply, "
                                                "pipeline_loading_checkpoint"),
    "fp16.enabled": ("map", "dtype torch.float16 with dynamic loss scaling"),
    "fp16.initial_scale_power": ("map", "initial_scale = 2**initial_scale_power"),
    "fp16.loss_scale_window": ("map", "growth_interval"),
    "fp16.hysteresis": ("map", "hysteresis"),
    "fp16.min_loss_scale": ("map", "min_scale"),
    "fp16.loss_scale": ("error", "only 0 (dynamic); a static loss scale is not implemented"),
    "fp16.consecutive_hysteresis": ("warn", "no effect"),
    "fp16.auto_cast": ("warn", "no effect: inputs are always cast to the model dtype"),
    "bf16.enabled": ("map", "dtype torch.bfloat16 (unscaled)"),
    "data_types.grad_accum_dtype": ("map", "what 16-bit gradients of several backwards are summed in: stage 3: "
                                           "ShardedModelV2(grad_accum_dtype=); stages 1, 2: LowLevelZeroOptimizer("
                                           "grad_accum_dtype=). 'fp32' (or absent/null: chunkmem's default, fp32), "
                                           "or the model's dtype ('bf16' with bf16.enabled, 'fp16' with "
                                           "fp16.enabled); DeepSpeed's other spellings (float32, bfloat16, half, "
                                           "torch.float16, ...) too"),
    "optimizer.type": ("map", "Adam, AdamW, HybridAdam, CPUAdam: HybridAdam (Adam: adam_w_mode, default True); "
                              "another torch.optim class name (SGD, ...): that class, as DeepSpeed builds it "
                              "(with several ranks an elementwise one: see chunkmem.optim.any_optimizer)"),
    "optimizer.params": ("map", "lr, betas, eps, weight_decay, bias_correction, adam_w_mode"),
    "gradient_clipping": ("map", "stages 1, 2: clip_grad_norm; stage 3: ShardedOptimizerV2(max_norm=), applied in "
                                 "step(); absent: 1.0, DeepSpeed's default (0.19.8; 0 turns clipping off)"),
    "zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer": (
        "map", "accepted (true or false), silently: chunkmem steps any torch optimizer where its state lives, so "
               "the switches DeepSpeed needs to run one have nothing to switch"),
    "<loop keys>": ("warn", "honoured by the engine of chunkmem.deepspeed.initialize; no effect in "
                            "chunkmem.initialize, which returns no engine: train_batch_size, "
                            "train_micro_batch_size_per_gpu, gradient_accumulation_steps, steps_per_print, "
                            "wall_clock_breakdown, scheduler"),
}

_ZERO_NO_EFFECT = {
    "allgather_partitions", "allgather_bucket_size", "use_multi_rank_bucket_allreduce", "load_from_fp32_weights",
    "ignore_unused_parameters", "round_robin_gradients", "sub_group_size",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "memory_efficient_linear", "override_module_apply",
    "pipeline_loading_checkpoint",
}
_PREFETCH_KEYS = ("prefetch_bucket_size", "stage3_prefetch_bucket_size", "max_live_parameters",
                  "stage3_max_live_parameters")
_REUSE_DISTANCE_KEYS = ("max_reuse_distance", "stage3_max_reuse_distance")
_PERSISTENCE_KEYS = {"param_persistence_threshold": "persistence_threshold",
                     "stage3_param_persistence_threshold": "persistence_threshold",
                     "model_persistence_threshold": "model_persistence_threshold",
                     "stage3_model_persistence_threshold": "model_persistence_threshold"}
_ZERO_ONLY_DEFAULT = {  # key -> the only value accepted (DeepSpeed's default)
    "legacy_stage1": False,
}
_ZERO_DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                    "cpu_offload_use_pin_memory": "offload_optimizer.pin_memory / offload_param.pin_memory"}
_ZERO_KEYS = ({"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "overlap_comm",
               "contiguous_gradients", "reduce_scatter", "elastic_checkpoint", "mics_shard_size",
               "zero_quantized_gradients", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
               "zero_hpz_partition_size", "mics_hierarchical_params_gather",
               *_PREFETCH_KEYS,
               *_REUSE_DISTANCE_KEYS,
               *_PERSISTENCE_KEYS} | _ZERO_NO_EFFECT | set(_ZERO_ONLY_DEFAULT) | set(_ZERO_DEPRECATED))
_OFFLOAD_OPTIMIZER_KEYS = {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                           "fast_init", "ratio"}
_OFFLOAD_PARAM_KEYS = {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_LOOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "steps_per_print", "wall_clock_breakdown", "scheduler"}
_OPTIMIZER_GATES = ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer")
"""DeepSpeed's switches that let a client or torch optimizer run under ZeRO (-Offload): accepted (bools),
no effect (chunkmem steps any torch optimizer where its state lives)."""
_DEEPSPEED_KEYS = ({"zero_optimization", "fp16", "bf16", "data_types", "optimizer", "gradient_clipping",
                    *_OPTIMIZER_GATES} | _LOOP_KEYS)
_GRAD_ACCUM_DTYPES = {  # DeepSpeed's names of data_types.grad_accum_dtype (its DtypeEnum spellings) -> the dtype
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
}
OVERLAP_COMM_REDUCTIONS_IN_FLIGHT = 2
"""``ShardedModelV2(reductions_in_flight=)`` for ``zero_optimization.overlap_comm: true`` at stage 3: the
reduce-scatter of a chunk runs on while the next chunk's gradients are computed, with one more in reserve."""
DEEPSPEED_GRADIENT_CLIPPING = 1.0
"""The clipping norm of a DeepSpeed config without ``gradient_clipping``: DeepSpeed's default (1.0 in 0.19.8,
since its pull request 8068; 0.0 before), so a config trains as it does under DeepSpeed today."""
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "auto_cast"}
_OPTIMIZER_TYPES = ("Adam", "AdamW", "HybridAdam", "CPUAdam")
_OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode"}
_SCALER_KEYS = {"initial_scale": "fp16.initial_scale_power", "growth_interval": "fp16.loss_scale_window",
                "hysteresis": "fp16.hysteresis", "min_scale": "fp16.min_loss_scale"}
_STRATEGIES = {"TensorShardStrategy": TensorShardStrategy, "BucketTensorShardStrategy": BucketTensorShardStrategy}


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
            ``fp16``, ``bf16``, ``optimizer``); see the module docstring and ``KEY_TABLE``.
        plan: instead of ``config``, a candidate of :func:`chunkmem.choose` (``choose(...).recommended``):
            the model is wrapped with the settings it was planned with (``candidate.config(nvme_path)``).
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
        config = plan.config(nvme_path)
    elif nvme_path is not None:
        raise InvalidArgumentError("nvme_path", nvme_path, "None unless plan is given (a config names its own)")
    config = read_config(config)
    if "zero" in config:
        extra = sorted(set(config) - {"zero"})
        if extra:
            raise InvalidArgumentError(f"config.{extra[0]}", config[extra[0]],
                                       "no other top-level key beside 'zero' (the ColossalAI form); use either "
                                       "'zero' or the DeepSpeed sections " + _listing(_DEEPSPEED_KEYS))
        return _initialize_colossal(model, optimizer, config["zero"])
    return _initialize_deepspeed(model, optimizer, config)


# ---- reading ----------------------------------------------------------------------------------------

def read_config(config: Any) -> dict[str, Any]:
    """``config`` as a dict: a dict as it is, a path read as JSON (errors name ``config``)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except OSError as e:
            raise InvalidArgumentError("config", os.fspath(config), f"a readable JSON file ({e.strerror})") from e
        except json.JSONDecodeError as e:
            raise InvalidArgumentError("config", os.fspath(config), f"a valid JSON file ({e})") from e
    if not isinstance(config, dict):
        raise ArgumentTypeError("config", type(config).__name__, "a dict or the path of a JSON file")
    return config


def _listing(keys: Any) -> str:
    return "one of " + ", ".join(repr(k) for k in sorted(keys))


def _section(parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = parent.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArgumentTypeError(path, value, "a dict (a JSON object)")
    return value


def _check_keys(section: dict[str, Any], allowed: set[str], path: str) -> None:
    for key in section:
        if key not in allowed:
            raise InvalidArgumentError(f"{path}.{key}" if path else key, section[key], "a key " + _listing(allowed))


def _check_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(path, value, "true or false")
    return value


def _count(path: str, value: Any, unit: str, zero_allowed: bool = False) -> int:
    """``value`` as an int > 0 (``zero_allowed``: >= 0); an integral float (``5e8``, as DeepSpeed's
    documentation writes sizes) is taken as that integer."""
    bound = ">= 0" if zero_allowed else "> 0"
    allowed = f"an integer {bound} ({unit}; an integral float such as 5e8 is taken as that integer)"
    check_number(path, value, low=0, low_open=not zero_allowed, allowed=allowed)
    if isinstance(value, float) and not value.is_integer():  # NaN and infinities are not integers either
        raise InvalidArgumentError(path, value, allowed)
    return int(value)


def _disk_keys(optim_device: str, param_device: str) -> dict[str, str]:
    """The config keys behind ShardedModelV2's disk-tier arguments: those of the offload section that
    asked for the disk tier (both sections name the same values, see :func:`_stage3_model_kwargs`)."""
    section = "zero_optimization.offload_optimizer" if optim_device == "nvme" else "zero_optimization.offload_param"
    return {"nvme_path": f"{section}.nvme_path", "buffer_count": f"{section}.buffer_count"}


def _no_effect(path: str, why: str) -> None:
    warnings.warn(f"config key {path} has no effect in chunkmem: {why}", NoEffectWarning, stacklevel=4)


def _rename_errors(prefix: str, build: Callable[[], Any], keys: dict[str, str] | None = None) -> Any:
    """Run ``build``; an argument error names the config key (``keys[argument]``, else ``prefix`` +
    argument)."""
    try:
        return build()
    except InvalidArgumentError as e:
        raise type(e)((keys or {}).get(e.argument, f"{prefix}{e.argument}"), e.value, e.allowed) from e


# ---- the ColossalAI form ------------------------------------------------------------------------------

def _initialize_colossal(model: nn.Module, optimizer: Any, zero: Any) -> tuple[nn.Module, Any]:
    if not isinstance(zero, dict):
        raise ArgumentTypeError("config.zero", zero, "a dict with 'model_config' and 'optimizer_config'")
    _check_keys(zero, {"model_config", "optimizer_config"}, "zero")
    model_config = dict(_section(zero, "model_config", "zero.model_config"))
    optimizer_config = dict(_section(zero, "optimizer_config", "zero.optimizer_config"))
    _check_keys(model_config, set(MODEL_KEYWORDS), "zero.model_config")
    _check_keys(optimizer_config, set(OPTIMIZER_KEYWORDS), "zero.optimizer_config")
    if optimizer_config and optimizer is None:
        raise InvalidArgumentError("optimizer", None, "a torch optimizer over model.parameters() when "
                                                      "zero.optimizer_config is given")
    strategy = model_config.pop("shard_strategy", TensorShardStrategy())
    if isinstance(strategy, str):
        if strategy not in _STRATEGIES:
            raise InvalidArgumentError("zero.model_config.shard_strategy", strategy, _listing(_STRATEGIES))
        strategy = _STRATEGIES[strategy]()
    elif not isinstance(strategy, BaseShardStrategy):
        raise ArgumentTypeError("zero.model_config.shard_strategy", strategy,
                                "a shard strategy instance or " + _listing(_STRATEGIES))
    for key in ("dtype", "grad_accum_dtype"):  # (by name too, as Candidate.config writes them)
        if isinstance(model_config.get(key), str):
            model_config[key] = _dtype_named(model_config[key], f"zero.model_config.{key}")
    model_settings = _rename_errors("zero.model_config.",
                                    lambda: ModelSettings.from_arguments(strategy, **model_config))
    optimizer_settings = _rename_errors("zero.optimizer_config.",
                                        lambda: OptimizerSettings.from_arguments(**optimizer_config))
    def renamed(build: Callable[[], Any]) -> Any:
        return _rename_errors("zero.model_config.", build)
    if optimizer is None:
        return renamed(lambda: ShardedModelV2.from_settings(model, model_settings)), None
    _check_optimizer(model, optimizer)
    _rename_errors("zero.optimizer_config.",
                   lambda: ShardedOptimizerV2.check_before_wrapping(model, model_settings, optimizer_settings))
    return _wrap_all_or_nothing(model, model_settings, renamed, lambda wrapped: _rename_errors(
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


def _dtype_named(name: str, path: str) -> torch.dtype:
    names = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32}
    if name not in names:
        raise InvalidArgumentError(path, name, _listing(names))
    return names[name]


# ---- the DeepSpeed form -------------------------------------------------------------------------------

def _initialize_deepspeed(model: nn.Module, optimizer: Any, config: dict[str, Any]) -> tuple[nn.Module, Any]:
    _check_keys(config, _DEEPSPEED_KEYS, "")
    for key in _OPTIMIZER_GATES:
        if key in config:
            _check_bool(config[key], key)
    for key in sorted(_LOOP_KEYS & set(config)):
        _no_effect(key, "the training loop decides it (chunkmem.deepspeed.initialize returns an engine that "
                        "honours it)")
    zero, stage = _zero_section(config)
    dtype, scaler = _precision(config)
    grad_accum_dtype = _grad_accum_dtype(config, dtype)
    offload = _offload_sections(zero)
    clipping = config.get("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)
    check_number("gradient_clipping", clipping, low=0, allowed="a number >= 0 (0: no clipping)")
    bucket = zero.get("reduce_bucket_size")
    if bucket is not None:
        bucket = _count("zero_optimization.reduce_bucket_size", bucket, "elements")
    overlap = zero.get("overlap_comm")
    if overlap is not None:
        _check_bool(overlap, "zero_optimization.overlap_comm")

    optimizer_section = _section(config, "optimizer", "optimizer")
    if optimizer_section and optimizer is not None:
        raise InvalidArgumentError("optimizer", type(optimizer).__name__,
                                   "None when the config has an 'optimizer' section (give one or the other)")
    if optimizer_section:  # checked in full before anything is wrapped
        build_optimizer(optimizer_section, [torch.zeros(1, requires_grad=True)])
    if optimizer is not None:
        _check_optimizer(model, optimizer)

    if stage == 3:
        kwargs, model_keys = _stage3_arguments(zero, offload, dtype, bucket, overlap, grad_accum_dtype)
        model_settings = _rename_errors(
            "zero_optimization.", lambda: ModelSettings.from_arguments(TensorShardStrategy(), dtype=dtype, **kwargs),
            model_keys)
        optimizer_settings = _rename_errors("fp16.", lambda: OptimizerSettings.from_arguments(
            **scaler, max_norm=float(clipping)), dict(_SCALER_KEYS, max_norm="gradient_clipping"))
        return _stage3(model, optimizer, optimizer_section, model_settings, optimizer_settings, model_keys)

    # stages 1 and 2: the model stays a plain module
    _refuse_stage3_keys(zero, offload)
    if optimizer is None:
        if not optimizer_section:
            raise InvalidArgumentError("optimizer", None, "a torch optimizer or an 'optimizer' config section "
                                                          "with stage 1 or 2")
        optimizer = build_optimizer(optimizer_section, model.parameters())  # the cast below keeps the parameters
    kwargs = dict(scaler, clip_grad_norm=float(clipping), partition_grad=stage == 2,
                  cpu_offload=offload.optim_device == "cpu")
    if bucket is not None:
        kwargs["reduce_bucket_size"] = bucket
    if overlap is not None:
        kwargs["overlap_communication"] = overlap
    if grad_accum_dtype is not None:
        kwargs["grad_accum_dtype"] = grad_accum_dtype
    return _stages_1_and_2(model, optimizer, dtype, kwargs)


def _zero_section(config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``zero_optimization``, its keys and switches checked, and its stage (1, 2 or 3)."""
    zero = _section(config, "zero_optimization", "zero_optimization")
    _check_keys(zero, _ZERO_KEYS, "zero_optimization")
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise ArgumentTypeError("zero_optimization.stage", stage, "1, 2 or 3")
    if stage not in (1, 2, 3):
        raise InvalidArgumentError("zero_optimization.stage", stage,
                                   "1, 2 or 3 (stage 0, no ZeRO, is plain PyTorch: use torch's DDP)")
    _check_zero_switches(zero)
    return zero, stage


@dataclass(frozen=True)
class _Offload:
    """``zero_optimization.offload_optimizer`` and ``offload_param``, checked: the sections, their devices
    (``"none"``, ``"cpu"`` or ``"nvme"``) and the optimizer's offload ``ratio``."""

    optimizer: dict[str, Any]
    param: dict[str, Any]
    optim_device: str
    param_device: str
    ratio: float


def _offload_sections(zero: dict[str, Any]) -> _Offload:
    offload_optimizer = _section(zero, "offload_optimizer", "zero_optimization.offload_optimizer")
    offload_param = _section(zero, "offload_param", "zero_optimization.offload_param")
    _check_keys(offload_optimizer, _OFFLOAD_OPTIMIZER_KEYS, "zero_optimization.offload_optimizer")
    _check_keys(offload_param, _OFFLOAD_PARAM_KEYS, "zero_optimization.offload_param")
    optim_device = _offload_device(offload_optimizer, "zero_optimization.offload_optimizer")
    param_device = _offload_device(offload_param, "zero_optimization.offload_param")
    _check_offload_switches(offload_optimizer, offload_param)
    ratio = offload_optimizer.get("ratio", 1.0)
    check_number("zero_optimization.offload_optimizer.ratio", ratio, low=0.0, high=1.0, allowed="a number in [0, 1]")
    if ratio != 1.0 and optim_device != "cpu":
        raise InvalidArgumentError("zero_optimization.offload_optimizer.ratio", ratio,
                                   "1.0 unless zero_optimization.offload_optimizer.device is 'cpu'")
    return _Offload(offload_optimizer, offload_param, optim_device, param_device, ratio)


def _stage3_arguments(zero: dict[str, Any], offload: _Offload, dtype: torch.dtype, bucket: int | None,
                      overlap: bool | None, grad_accum_dtype: torch.dtype | None) -> tuple[dict[str, Any], dict[str, str]]:
    """Stage 3's :class:`~chunkmem.ShardedModelV2` keyword arguments from the config, and the config key each
    comes from (for the errors)."""
    kwargs = _stage3_model_kwargs(offload.optim_device, offload.param_device, offload.ratio, offload.optimizer,
                                  offload.param)
    if overlap:
        kwargs["reductions_in_flight"] = OVERLAP_COMM_REDUCTIONS_IN_FLIGHT
    mics = zero.get("mics_shard_size", -1)
    if mics != -1:
        kwargs["shard_group_size"] = mics
    if "zero_quantized_gradients" in zero:
        kwargs["quantized_gradients"] = zero["zero_quantized_gradients"]
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        _check_bool(zero.get(key, False), f"zero_optimization.{key}")
    if _check_bool(zero.get("mics_hierarchical_params_gather", False),
                   "zero_optimization.mics_hierarchical_params_gather"):
        kwargs["gather_node_size"] = _ranks_per_node()
    hpz = zero.get("zero_hpz_partition_size", 1)
    if isinstance(hpz, bool) or not isinstance(hpz, int):
        raise ArgumentTypeError("zero_optimization.zero_hpz_partition_size", hpz, "an integer >= 1")
    if hpz != 1:
        kwargs["secondary_partition_size"] = hpz
    if zero.get("zero_quantized_weights", False):
        kwargs["quantized_weights"] = True
    elif zero.get("zero_quantized_nontrainable_weights", False):
        kwargs["quantized_weights"] = "nontrainable"
    prefetch = _prefetch_numel(zero)
    if prefetch is not None:
        kwargs["prefetch_numel"] = prefetch
    kwargs.update(_persistence(zero, disk="nvme" in (offload.optim_device, offload.param_device)))
    if bucket is not None:
        kwargs["reduce_scatter_bucket_size_mb"] = bucket * dtype.itemsize / 2**20
    if grad_accum_dtype is not None:
        kwargs["grad_accum_dtype"] = grad_accum_dtype
    model_keys = {"dtype": "fp16.enabled/bf16.enabled",
                  "grad_accum_dtype": "data_types.grad_accum_dtype",
                  "reduce_scatter_bucket_size_mb": "zero_optimization.reduce_bucket_size",
                  "shard_group_size": "zero_optimization.mics_shard_size",
                  "quantized_gradients": "zero_optimization.zero_quantized_gradients",
                  "quantized_weights": "zero_optimization.zero_quantized_weights",
                  "secondary_partition_size": "zero_optimization.zero_hpz_partition_size",
                  "gather_node_size": "zero_optimization.mics_hierarchical_params_gather",
                  **_disk_keys(offload.optim_device, offload.param_device)}
    return kwargs, model_keys


def _refuse_stage3_keys(zero: dict[str, Any], offload: _Offload) -> None:
    """Stages 1 and 2: refuse the settings only stage 3 has (warn for those that would change nothing)."""
    if zero.get("mics_shard_size", -1) != -1:
        raise InvalidArgumentError("zero_optimization.mics_shard_size", zero["mics_shard_size"],
                                   "-1 with stage 1 or 2 (shard groups shard stage 3's parameters)")
    if zero.get("mics_hierarchical_params_gather", False) is not False:
        raise InvalidArgumentError("zero_optimization.mics_hierarchical_params_gather",
                                   zero["mics_hierarchical_params_gather"], "false with stage 1 or 2")
    if zero.get("zero_hpz_partition_size", 1) != 1:
        raise InvalidArgumentError("zero_optimization.zero_hpz_partition_size", zero["zero_hpz_partition_size"],
                                   "1 with stage 1 or 2 (the secondary partition is of stage 3's parameters)")
    for key in ("zero_quantized_gradients", "zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if zero.get(key, False) is not False:
            raise InvalidArgumentError(f"zero_optimization.{key}", zero[key],
                                       "false with stage 1 or 2 (quantized collectives are stage 3's)")
    for key in sorted((set(_PREFETCH_KEYS) | set(_PERSISTENCE_KEYS)) & set(zero)):
        _no_effect(f"zero_optimization.{key}", "stage 3 only (at stages 1 and 2 every parameter stays on the device)")
    if offload.param_device != "none":
        raise InvalidArgumentError("zero_optimization.offload_param.device", offload.param_device,
                                   "'none' with stage 1 or 2 (parameter offload needs stage 3)")
    if offload.optim_device == "nvme":
        raise InvalidArgumentError("zero_optimization.offload_optimizer.device", "nvme",
                                   "'none' or 'cpu' with stage 1 or 2 (the disk tier needs stage 3)")
    if offload.ratio != 1.0:
        raise InvalidArgumentError("zero_optimization.offload_optimizer.ratio", offload.ratio, "1.0 with stage 1 or 2")


def _stage3(model: nn.Module, optimizer: Any, optimizer_section: dict[str, Any], model_settings: ModelSettings,
            optimizer_settings: OptimizerSettings, model_keys: dict[str, str]) -> tuple[nn.Module, Any]:
    """A ShardedModelV2 and a ShardedOptimizerV2 over ``optimizer`` (already checked against the model),
    or over one built from ``optimizer_section``, or no optimizer; everything checked before the module is
    wrapped, and the wrapping undone if the optimizer cannot be attached. ``model_keys``: the config key
    each model argument comes from (for the errors)."""
    def renamed(build: Callable[[], Any]) -> Any:
        return _rename_errors("zero_optimization.", build, model_keys)
    if optimizer is None and not optimizer_section:
        return renamed(lambda: ShardedModelV2.from_settings(model, model_settings)), None
    ShardedOptimizerV2.check_before_wrapping(model, model_settings, optimizer_settings)

    def attach(wrapped: ShardedModelV2) -> ShardedOptimizerV2:
        optim = optimizer if optimizer is not None else build_optimizer(optimizer_section, wrapped.parameters())
        return ShardedOptimizerV2.from_settings(wrapped, optim, optimizer_settings)
    return _wrap_all_or_nothing(model, model_settings, renamed, attach)


def _stages_1_and_2(model: nn.Module, optimizer: Any, dtype: torch.dtype,
                    kwargs: dict[str, Any]) -> tuple[nn.Module, LowLevelZeroOptimizer]:
    """The module cast to ``dtype`` and a LowLevelZeroOptimizer with ``kwargs``, every argument checked
    (against the parameters as the cast will leave them) before the module is cast."""
    keys = dict(_SCALER_KEYS, clip_grad_norm="gradient_clipping", grad_accum_dtype="data_types.grad_accum_dtype")
    _rename_errors("zero_optimization.", lambda: LowLevelZeroOptimizer.check_arguments(optimizer, cast_to=dtype,
                                                                                       **kwargs), keys)
    model.to(dtype)
    return model, _rename_errors("zero_optimization.", lambda: LowLevelZeroOptimizer(optimizer, **kwargs), keys)


def _check_zero_switches(zero: dict[str, Any]) -> None:
    for key, replacement in _ZERO_DEPRECATED.items():
        if key in zero:
            raise InvalidArgumentError(f"zero_optimization.{key}", zero[key],
                                       f"no such key (deprecated by DeepSpeed): use zero_optimization.{replacement}")
    for key, only in _ZERO_ONLY_DEFAULT.items():
        if key in zero and (zero[key] != only or type(zero[key]) is not type(only)):
            error = ArgumentTypeError if type(zero[key]) is not type(only) else InvalidArgumentError
            raise error(f"zero_optimization.{key}", zero[key],
                        f"{json.dumps(only)} (chunkmem does not implement this feature)")
    for key in ("contiguous_gradients", "reduce_scatter"):
        if key in zero and not _check_bool(zero[key], f"zero_optimization.{key}"):
            _no_effect(f"zero_optimization.{key}", "chunkmem always does it (False is ignored)")
    for key in sorted(_ZERO_NO_EFFECT & set(zero)):
        _no_effect(f"zero_optimization.{key}", "a DeepSpeed tuning knob without a chunkmem counterpart")
    if "elastic_checkpoint" in zero:
        _check_bool(zero["elastic_checkpoint"], "zero_optimization.elastic_checkpoint")
        _no_effect("zero_optimization.elastic_checkpoint", "chunkmem.initialize returns no engine: pass elastic= to "
                                                           "chunkmem.load_checkpoint (the engine of "
                                                           "chunkmem.deepspeed.initialize honours the key)")
    for key in sorted(set(_REUSE_DISTANCE_KEYS) & set(zero)):
        _no_effect(f"zero_optimization.{key}", "the traced schedule knows each chunk's next use (Belady's plan)")


def _ranks_per_node() -> int:
    """The ranks of this node, for ``mics_hierarchical_params_gather``: ``LOCAL_WORLD_SIZE`` (torchrun's)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not value.strip().isdigit() or int(value) < 1:
        raise InvalidArgumentError("zero_optimization.mics_hierarchical_params_gather", True,
                                   f"false, or true with the environment variable LOCAL_WORLD_SIZE set to the ranks "
                                   f"of a node (torchrun sets it; found {value!r})")
    return int(value)


def _persistence(zero: dict[str, Any], disk: bool) -> dict[str, int]:
    """ShardedModelV2's persistence arguments from DeepSpeed's persistence thresholds (elements)."""
    kwargs = {}
    for key, argument in _PERSISTENCE_KEYS.items():
        if key in zero:
            if disk:
                _no_effect(f"zero_optimization.{key}", "persistent parameters are not placed on the disk tier")
                continue
            kwargs[argument] = _count(f"zero_optimization.{key}", zero[key], "parameter elements", zero_allowed=True)
    return kwargs


def _prefetch_numel(zero: dict[str, Any]) -> int | None:
    """ShardedModelV2's ``prefetch_numel`` from DeepSpeed's prefetch bucket and live-parameter bounds
    (elements; the smaller of those given; ``None`` when neither is)."""
    bounds = [_count(f"zero_optimization.{key}", zero[key], "parameter elements", zero_allowed=True)
              for key in _PREFETCH_KEYS if key in zero]
    return min(bounds) if bounds else None


def _offload_device(section: dict[str, Any], path: str) -> str:
    device = section.get("device", "none")
    if device is None:
        device = "none"
    if device not in _OFFLOAD_DEVICES:
        error = InvalidArgumentError if isinstance(device, str) else ArgumentTypeError
        raise error(f"{path}.device", device, _listing(_OFFLOAD_DEVICES))
    nvme_path = section.get("nvme_path")
    if device == "nvme" and not isinstance(nvme_path, str):
        error = InvalidArgumentError if nvme_path is None else ArgumentTypeError
        raise error(f"{path}.nvme_path", nvme_path, f"a directory path (a string) when {path}.device is 'nvme'")
    return device


def _check_offload_switches(offload_optimizer: dict[str, Any], offload_param: dict[str, Any]) -> None:
    sections = (("zero_optimization.offload_optimizer", offload_optimizer),
                ("zero_optimization.offload_param", offload_param))
    for path, section in sections:
        if "pin_memory" in section and _check_bool(section["pin_memory"], f"{path}.pin_memory"):
            _no_effect(f"{path}.pin_memory", "with a GPU the parameter shards and gradients on the host are pinned "
                                             "within chunkmem.set_pinned_memory_budget, whatever this says")
        if "nvme_path" in section and section.get("device", "none") != "nvme":
            _no_effect(f"{path}.nvme_path", f"{path}.device is not 'nvme'")
        count = section.get("buffer_count")
        if count is not None:
            check_number(f"{path}.buffer_count", count, low=1, integer=True)
    for key in ("pipeline_read", "pipeline_write"):
        if key in offload_optimizer and not _check_bool(offload_optimizer[key],
                                                        f"zero_optimization.offload_optimizer.{key}"):
            _no_effect(f"zero_optimization.offload_optimizer.{key}", "chunkmem always overlaps reads and writes "
                                                                     "with compute (False is ignored)")
    if "fast_init" in offload_optimizer:
        _no_effect("zero_optimization.offload_optimizer.fast_init", "optimizer state is created in its chunk")
    for key, why in (("buffer_size", "the chunk is the unit of transfer (set the chunk size instead)"),
                     ("max_in_cpu", "bound the host tier in bytes with chunkmem.set_host_memory_capacity")):
        if key in offload_param:
            _no_effect(f"zero_optimization.offload_param.{key}", why)


def _stage3_model_kwargs(optim_device: str, param_device: str, ratio: float, offload_optimizer: dict[str, Any],
                         offload_param: dict[str, Any]) -> dict[str, Any]:
    """ShardedModelV2 keyword arguments for the offload devices (``nvme`` rests on the host first, then
    on the disk tier)."""
    params_off = param_device != "none"
    optim_off = optim_device != "none"
    kwargs: dict[str, Any]
    if params_off and optim_off and ratio == 1.0:
        kwargs = dict(tensor_placement_policy="cpu")
    elif not params_off and not optim_off:
        kwargs = dict(tensor_placement_policy="cuda")
    else:
        kwargs = dict(tensor_placement_policy="static", offload_param_frac=1.0 if params_off else 0.0,
                      offload_optim_frac=float(ratio) if optim_off else 0.0)
    if "nvme" in (optim_device, param_device):
        paths = {s["nvme_path"] for s, d in ((offload_optimizer, optim_device), (offload_param, param_device))
                 if d == "nvme"}
        if len(paths) > 1:
            raise InvalidArgumentError("zero_optimization.offload_param.nvme_path", offload_param.get("nvme_path"),
                                       f"the same directory as zero_optimization.offload_optimizer.nvme_path "
                                       f"({offload_optimizer.get('nvme_path')!r}): chunkmem has one disk tier")
        counts = {s["buffer_count"] for s, d in ((offload_optimizer, optim_device), (offload_param, param_device))
                  if d == "nvme" and "buffer_count" in s}
        if len(counts) > 1:
            raise InvalidArgumentError("zero_optimization.offload_param.buffer_count",
                                       offload_param.get("buffer_count"),
                                       "the same count as zero_optimization.offload_optimizer.buffer_count")
        kwargs.update(nvme_path=paths.pop(), offload_optimizer="disk" if optim_device == "nvme" else None,
                      offload_param="disk" if param_device == "nvme" else None)
        if counts:
            kwargs["buffer_count"] = counts.pop()
    return kwargs


def _grad_accum_dtype(config: dict[str, Any], dtype: torch.dtype) -> torch.dtype | None:
    """The dtype DeepSpeed's ``data_types.grad_accum_dtype`` names (``None``: absent or null), checked
    against the model's ``dtype``: chunkmem sums 16-bit gradients over backwards in fp32 or in the model's
    own dtype, nothing else."""
    section = _section(config, "data_types", "data_types")
    _check_keys(section, {"grad_accum_dtype"}, "data_types")
    name = section.get("grad_accum_dtype")
    if name is None:
        return None
    path = "data_types.grad_accum_dtype"
    if not isinstance(name, str):
        raise ArgumentTypeError(path, name, "a dtype name: 'fp32', 'fp16' or 'bf16' (DeepSpeed's names)")
    if name not in _GRAD_ACCUM_DTYPES:
        raise InvalidArgumentError(path, name, "'fp32', 'fp16' or 'bf16' (DeepSpeed's names; also "
                                               + _listing(set(_GRAD_ACCUM_DTYPES) - {"fp32", "fp16", "bf16"}) + ")")
    chosen = _GRAD_ACCUM_DTYPES[name]
    if chosen not in (torch.float32, dtype):
        why = "chunkmem sums the gradients of several backwards in fp32 or in the model's own dtype"
        if dtype == torch.float32:
            allowed = f"'fp32' (the model trains in fp32, neither fp16 nor bf16 being enabled: {why})"
        else:
            allowed = (f"'fp32' or the model's dtype {'fp16' if dtype == torch.float16 else 'bf16'!r} "
                       f"({'fp16' if dtype == torch.float16 else 'bf16'}.enabled): {why}")
        raise InvalidArgumentError(path, name, allowed)
    return chosen


def _precision(config: dict[str, Any]) -> tuple[torch.dtype, dict[str, Any]]:
    """The model dtype and the loss scaler's keyword arguments from ``fp16`` / ``bf16``."""
    fp16 = _section(config, "fp16", "fp16")
    bf16 = _section(config, "bf16", "bf16")
    _check_keys(fp16, _FP16_KEYS, "fp16")
    _check_keys(bf16, {"enabled"}, "bf16")
    fp16_on = _check_bool(fp16.get("enabled", False), "fp16.enabled")
    bf16_on = _check_bool(bf16.get("enabled", False), "bf16.enabled")
    if fp16_on and bf16_on:
        raise InvalidArgumentError("bf16.enabled", True, "false when fp16.enabled is true (one 16-bit dtype)")
    if not fp16_on:
        set_keys = sorted(set(fp16) - {"enabled"})
        if set_keys:
            _no_effect(f"fp16.{set_keys[0]}", "fp16 is not enabled")
        return (torch.bfloat16 if bf16_on else torch.float32), {}
    loss_scale = fp16.get("loss_scale", 0)
    static_scale = "0 (dynamic loss scaling; a static loss scale is not implemented)"
    check_number("fp16.loss_scale", loss_scale, allowed=static_scale)
    if loss_scale != 0:
        raise InvalidArgumentError("fp16.loss_scale", loss_scale, static_scale)
    power = fp16.get("initial_scale_power", 16)  # DeepSpeed's default: 2**16
    check_number("fp16.initial_scale_power", power, low=0, high=32, integer=True, allowed="an integer in [0, 32]")
    scaler: dict[str, Any] = {"initial_scale": float(2**power)}
    for key, argument in (("loss_scale_window", "growth_interval"), ("hysteresis", "hysteresis"),
                          ("min_loss_scale", "min_scale")):
        if key in fp16:
            scaler[argument] = fp16[key]
    for key in ("consecutive_hysteresis", "auto_cast"):
        if key in fp16:
            _no_effect(f"fp16.{key}", "chunkmem's scaler and input casting have no such switch")
    try:  # checked before anything is built
        DynamicGradScaler(**scaler)
    except InvalidArgumentError as e:
        if e.argument != "initial_scale":
            raise type(e)(_SCALER_KEYS.get(e.argument, f"fp16.{e.argument}"), e.value, e.allowed) from e
        # the user wrote the power, not the scale: name it, and the key on the other side of the comparison
        within = e.allowed.replace("min_scale", "fp16.min_loss_scale")
        raise type(e)("fp16.initial_scale_power", power,
                      f"a power whose scale 2**{power} = {2**power} is {within}") from e
    return torch.float16, scaler


def _torch_optimizer_class(kind: Any) -> type | None:
    """``torch.optim.<kind>`` when it names an optimizer class (DeepSpeed takes those too), else ``None``."""
    found = getattr(torch.optim, kind, None) if isinstance(kind, str) else None
    return found if isinstance(found, type) and issubclass(found, torch.optim.Optimizer) else None


def build_optimizer(section: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    """The optimizer a DeepSpeed ``optimizer`` section describes, over ``params`` (parameters or param
    groups): the Adam types as :class:`~chunkmem.HybridAdam`; another name of a ``torch.optim`` class
    (``"SGD"``, ``"RMSprop"``, ...) as that class with the section's ``params``, as DeepSpeed builds it.
    Errors name ``optimizer.type`` / ``optimizer.params.<name>``."""
    _check_keys(section, {"type", "params"}, "optimizer")
    kind = section.get("type")
    if not isinstance(kind, str) or kind.lower() not in {t.lower() for t in _OPTIMIZER_TYPES}:
        torch_class = _torch_optimizer_class(kind)
        if torch_class is None:
            error = InvalidArgumentError if isinstance(kind, str) else ArgumentTypeError
            raise error("optimizer.type", kind, _listing(_OPTIMIZER_TYPES) + " (case-insensitive), or the name of a "
                                                "torch.optim optimizer class such as 'SGD'")
        options = dict(_section(section, "params", "optimizer.params"))
        _check_keys(options, set(inspect.signature(torch_class.__init__).parameters) - {"self", "params"},
                    "optimizer.params")
        if isinstance(options.get("betas"), list):
            options["betas"] = tuple(options["betas"])
        try:
            return torch_class(params, **options)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError("optimizer.params", options, f"arguments torch.optim.{kind} takes ({e})") from e
    options = dict(_section(section, "params", "optimizer.params"))
    _check_keys(options, _OPTIMIZER_PARAMS, "optimizer.params")
    adamw = options.pop("adam_w_mode", True)
    _check_bool(adamw, "optimizer.params.adam_w_mode")
    if kind.lower() == "adamw" and not adamw:
        raise InvalidArgumentError("optimizer.params.adam_w_mode", False, "true (or absent) with type 'AdamW'")
    if "betas" in options and isinstance(options["betas"], list):
        options["betas"] = tuple(options["betas"])
    return _rename_errors("optimizer.params.", lambda: HybridAdam(params, adamw_mode=adamw, **options))
