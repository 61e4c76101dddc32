"""The DeepSpeed form of a configuration read into settings: the sections ``zero_optimization``, ``fp16``,
``bf16``, ``data_types`` and ``optimizer`` (plus the training-loop keys DeepSpeed reads, which chunkmem leaves to
the loop: :mod:`chunkmem.configs.loop_settings`).

Every key is checked before anything is built. An unknown key, a key chunkmem cannot honour and two
keys that contradict each other raise :class:`~chunkmem.InvalidArgumentError` naming the key path
(``zero_optimization.offload_param.device``) and the allowed values; a value of the wrong type (a string
for a number, a bool for a count) raises its subclass :class:`~chunkmem.ArgumentTypeError`. A key that
chunkmem accepts but that changes nothing warns with :class:`~chunkmem.NoEffectWarning`, naming it.
``KEY_TABLE`` lists the DeepSpeed keys and what each becomes.

:func:`parse` reads the config (stage, precision, offload, clipping, buckets, the ``optimizer`` section);
:func:`stage3_settings` then gives stage 3's :class:`~chunkmem.settings.ModelSettings` and
:class:`~chunkmem.settings.OptimizerSettings`, :func:`stages_1_and_2_arguments` the keyword arguments of
:class:`~chunkmem.LowLevelZeroOptimizer`, and :func:`build_optimizer` the optimizer of an ``optimizer``
section. :func:`chunkmem.initialize` checks the optimizer it is given between the two and wraps.
"""
from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed.shard_strategy import TensorShardStrategy
from ..errors import ArgumentTypeError, InvalidArgumentError, check_number
from ..optim.adam import HybridAdam
from ..optim.loss_scaler import DynamicGradScaler
from ..settings import ModelSettings, OptimizerSettings
from .loop_settings import LOOP_KEYS
from .reading import check_bool, check_count, check_keys, get_section, listing, no_effect, rename_errors

__all__ = ["DEEPSPEED_KEYS", "KEY_TABLE", "SCALER_KEYS", "DeepSpeedConfig", "build_optimizer", "parse",
           "stage3_settings", "stages_1_and_2_arguments"]


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
_LOOP_KEYS = set(LOOP_KEYS)  # the training loop's: chunkmem.initialize warns that they do nothing there
_OPTIMIZER_GATES = ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer")
"""DeepSpeed's switches that let a client or torch optimizer run under ZeRO (-Offload): accepted (bools),
no effect (chunkmem steps any torch optimizer where its state lives)."""
DEEPSPEED_KEYS = ({"zero_optimization", "fp16", "bf16", "data_types", "optimizer", "gradient_clipping",
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
SCALER_KEYS = {"initial_scale": "fp16.initial_scale_power", "growth_interval": "fp16.loss_scale_window",
                "hysteresis": "fp16.hysteresis", "min_scale": "fp16.min_loss_scale"}

@dataclass(frozen=True)
class _Offload:
    """``zero_optimization.offload_optimizer`` and ``offload_param``, checked: the sections, their devices
    (``"none"``, ``"cpu"`` or ``"nvme"``) and the optimizer's offload ``ratio``."""

    optimizer: dict[str, Any]
    param: dict[str, Any]
    optim_device: str
    param_device: str
    ratio: float


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config as :func:`parse` read it, every key checked but those the stage decides
    (:func:`stage3_settings`, :func:`stages_1_and_2_arguments`).

    Attributes:
        zero: the ``zero_optimization`` section.
        stage: 1, 2 or 3.
        dtype: the model's dtype (``fp16`` / ``bf16``, else fp32).
        scaler: the loss scaler's keyword arguments (``{}`` unless ``fp16`` is enabled).
        grad_accum_dtype: ``data_types.grad_accum_dtype`` (``None``: absent or null).
        offload: the offload sections, checked.
        clipping: ``gradient_clipping`` (absent: :data:`DEEPSPEED_GRADIENT_CLIPPING`).
        bucket: ``zero_optimization.reduce_bucket_size`` in elements (``None``: absent).
        overlap: ``zero_optimization.overlap_comm`` (``None``: absent).
        optimizer_section: the ``optimizer`` section (``{}``: none).
    """

    zero: dict[str, Any]
    stage: int
    dtype: torch.dtype
    scaler: dict[str, Any]
    grad_accum_dtype: torch.dtype | None
    offload: _Offload
    clipping: Any
    bucket: int | None
    overlap: bool | None
    optimizer_section: dict[str, Any]


def parse(config: dict[str, Any]) -> DeepSpeedConfig:
    """Read a DeepSpeed ``config`` (a dict): its keys, the ZeRO stage, the precision, the offload sections,
    clipping and the reduction bucket, warning for the keys that change nothing here."""
    check_keys(config, DEEPSPEED_KEYS, "")
    for key in _OPTIMIZER_GATES:
        if key in config:
            check_bool(config[key], key)
    for key in sorted(_LOOP_KEYS & set(config)):
        no_effect(key, "the training loop decides it (chunkmem.deepspeed.initialize returns an engine that "
                       "honours it)")
    zero, stage = _zero_section(config)
    dtype, scaler = _precision(config)
    grad_accum_dtype = _grad_accum_dtype(config, dtype)
    offload = _offload_sections(zero)
    clipping = config.get("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)
    check_number("gradient_clipping", clipping, low=0, allowed="a number >= 0 (0: no clipping)")
    bucket = zero.get("reduce_bucket_size")
    if bucket is not None:
        bucket = check_count("zero_optimization.reduce_bucket_size", bucket, "elements")
    overlap = zero.get("overlap_comm")
    if overlap is not None:
        check_bool(overlap, "zero_optimization.overlap_comm")
    optimizer_section = get_section(config, "optimizer", "optimizer")
    return DeepSpeedConfig(zero, stage, dtype, scaler, grad_accum_dtype, offload, clipping, bucket, overlap,
                           optimizer_section)


def stage3_settings(parsed: DeepSpeedConfig) -> tuple[ModelSettings, OptimizerSettings, dict[str, str]]:
    """Stage 3's model and optimizer settings, and the config key each model argument comes from (for the
    errors of the wrapping)."""
    kwargs, model_keys = _stage3_arguments(parsed.zero, parsed.offload, parsed.dtype, parsed.bucket, parsed.overlap,
                                           parsed.grad_accum_dtype)
    model_settings = rename_errors(
        "zero_optimization.", lambda: ModelSettings.from_arguments(TensorShardStrategy(), dtype=parsed.dtype,
                                                                   **kwargs),
        model_keys)
    optimizer_settings = rename_errors("fp16.", lambda: OptimizerSettings.from_arguments(
        **parsed.scaler, max_norm=float(parsed.clipping)), dict(SCALER_KEYS, max_norm="gradient_clipping"))
    return model_settings, optimizer_settings, model_keys


def stages_1_and_2_arguments(parsed: DeepSpeedConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """Stages 1 and 2 (the model stays a plain module): the settings only stage 3 has refused (a warning for
    those that would change nothing), then :class:`~chunkmem.LowLevelZeroOptimizer`'s keyword arguments and the
    config key each comes from (for its errors)."""
    _refuse_stage3_keys(parsed.zero, parsed.offload)
    kwargs = dict(parsed.scaler, clip_grad_norm=float(parsed.clipping), partition_grad=parsed.stage == 2,
                  cpu_offload=parsed.offload.optim_device == "cpu")
    if parsed.bucket is not None:
        kwargs["reduce_bucket_size"] = parsed.bucket
    if parsed.overlap is not None:
        kwargs["overlap_communication"] = parsed.overlap
    if parsed.grad_accum_dtype is not None:
        kwargs["grad_accum_dtype"] = parsed.grad_accum_dtype
    keys = dict(SCALER_KEYS, clip_grad_norm="gradient_clipping", grad_accum_dtype="data_types.grad_accum_dtype")
    return kwargs, keys


def _zero_section(config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``zero_optimization``, its keys and switches checked, and its stage (1, 2 or 3)."""
    zero = get_section(config, "zero_optimization", "zero_optimization")
    check_keys(zero, _ZERO_KEYS, "zero_optimization")
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise ArgumentTypeError("zero_optimization.stage", stage, "1, 2 or 3")
    if stage not in (1, 2, 3):
        raise InvalidArgumentError("zero_optimization.stage", stage,
                                   "1, 2 or 3 (stage 0, no ZeRO, is plain PyTorch: use torch's DDP)")
    _check_zero_switches(zero)
    return zero, stage


def _offload_sections(zero: dict[str, Any]) -> _Offload:
    offload_optimizer = get_section(zero, "offload_optimizer", "zero_optimization.offload_optimizer")
    offload_param = get_section(zero, "offload_param", "zero_optimization.offload_param")
    check_keys(offload_optimizer, _OFFLOAD_OPTIMIZER_KEYS, "zero_optimization.offload_optimizer")
    check_keys(offload_param, _OFFLOAD_PARAM_KEYS, "zero_optimization.offload_param")
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
        check_bool(zero.get(key, False), f"zero_optimization.{key}")
    if check_bool(zero.get("mics_hierarchical_params_gather", False),
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
        no_effect(f"zero_optimization.{key}", "stage 3 only (at stages 1 and 2 every parameter stays on the device)")
    if offload.param_device != "none":
        raise InvalidArgumentError("zero_optimization.offload_param.device", offload.param_device,
                                   "'none' with stage 1 or 2 (parameter offload needs stage 3)")
    if offload.optim_device == "nvme":
        raise InvalidArgumentError("zero_optimization.offload_optimizer.device", "nvme",
                                   "'none' or 'cpu' with stage 1 or 2 (the disk tier needs stage 3)")
    if offload.ratio != 1.0:
        raise InvalidArgumentError("zero_optimization.offload_optimizer.ratio", offload.ratio, "1.0 with stage 1 or 2")


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
        if key in zero and not check_bool(zero[key], f"zero_optimization.{key}"):
            no_effect(f"zero_optimization.{key}", "chunkmem always does it (False is ignored)")
    for key in sorted(_ZERO_NO_EFFECT & set(zero)):
        no_effect(f"zero_optimization.{key}", "a DeepSpeed tuning knob without a chunkmem counterpart")
    if "elastic_checkpoint" in zero:
        check_bool(zero["elastic_checkpoint"], "zero_optimization.elastic_checkpoint")
        no_effect("zero_optimization.elastic_checkpoint", "chunkmem.initialize returns no engine: pass elastic= to "
                                                           "chunkmem.load_checkpoint (the engine of "
                                                           "chunkmem.deepspeed.initialize honours the key)")
    for key in sorted(set(_REUSE_DISTANCE_KEYS) & set(zero)):
        no_effect(f"zero_optimization.{key}", "the traced schedule knows each chunk's next use (Belady's plan)")


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
                no_effect(f"zero_optimization.{key}", "persistent parameters are not placed on the disk tier")
                continue
            kwargs[argument] = check_count(f"zero_optimization.{key}", zero[key], "parameter elements", zero_allowed=True)
    return kwargs


def _prefetch_numel(zero: dict[str, Any]) -> int | None:
    """ShardedModelV2's ``prefetch_numel`` from DeepSpeed's prefetch bucket and live-parameter bounds
    (elements; the smaller of those given; ``None`` when neither is)."""
    bounds = [check_count(f"zero_optimization.{key}", zero[key], "parameter elements", zero_allowed=True)
              for key in _PREFETCH_KEYS if key in zero]
    return min(bounds) if bounds else None


def _offload_device(section: dict[str, Any], path: str) -> str:
    device = section.get("device", "none")
    if device is None:
        device = "none"
    if device not in _OFFLOAD_DEVICES:
        error = InvalidArgumentError if isinstance(device, str) else ArgumentTypeError
        raise error(f"{path}.device", device, listing(_OFFLOAD_DEVICES))
    nvme_path = section.get("nvme_path")
    if device == "nvme" and not isinstance(nvme_path, str):
        error = InvalidArgumentError if nvme_path is None else ArgumentTypeError
        raise error(f"{path}.nvme_path", nvme_path, f"a directory path (a string) when {path}.device is 'nvme'")
    return device


def _check_offload_switches(offload_optimizer: dict[str, Any], offload_param: dict[str, Any]) -> None:
    sections = (("zero_optimization.offload_optimizer", offload_optimizer),
                ("zero_optimization.offload_param", offload_param))
    for path, section in sections:
        if "pin_memory" in section and check_bool(section["pin_memory"], f"{path}.pin_memory"):
            no_effect(f"{path}.pin_memory", "with a GPU the parameter shards and gradients on the host are pinned "
                                             "within chunkmem.set_pinned_memory_budget, whatever this says")
        if "nvme_path" in section and section.get("device", "none") != "nvme":
            no_effect(f"{path}.nvme_path", f"{path}.device is not 'nvme'")
        count = section.get("buffer_count")
        if count is not None:
            check_number(f"{path}.buffer_count", count, low=1, integer=True)
    for key in ("pipeline_read", "pipeline_write"):
        if key in offload_optimizer and not check_bool(offload_optimizer[key],
                                                        f"zero_optimization.offload_optimizer.{key}"):
            no_effect(f"zero_optimization.offload_optimizer.{key}", "chunkmem always overlaps reads and writes "
                                                                     "with compute (False is ignored)")
    if "fast_init" in offload_optimizer:
        no_effect("zero_optimization.offload_optimizer.fast_init", "optimizer state is created in its chunk")
    for key, why in (("buffer_size", "the chunk is the unit of transfer (set the chunk size instead)"),
                     ("max_in_cpu", "bound the host tier in bytes with chunkmem.set_host_memory_capacity")):
        if key in offload_param:
            no_effect(f"zero_optimization.offload_param.{key}", why)


def _disk_keys(optim_device: str, param_device: str) -> dict[str, str]:
    """The config keys behind ShardedModelV2's disk-tier arguments: those of the offload section that
    asked for the disk tier (both sections name the same values, see :func:`_stage3_model_kwargs`)."""
    section = "zero_optimization.offload_optimizer" if optim_device == "nvme" else "zero_optimization.offload_param"
    return {"nvme_path": f"{section}.nvme_path", "buffer_count": f"{section}.buffer_count"}


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
    section = get_section(config, "data_types", "data_types")
    check_keys(section, {"grad_accum_dtype"}, "data_types")
    name = section.get("grad_accum_dtype")
    if name is None:
        return None
    path = "data_types.grad_accum_dtype"
    if not isinstance(name, str):
        raise ArgumentTypeError(path, name, "a dtype name: 'fp32', 'fp16' or 'bf16' (DeepSpeed's names)")
    if name not in _GRAD_ACCUM_DTYPES:
        raise InvalidArgumentError(path, name, "'fp32', 'fp16' or 'bf16' (DeepSpeed's names; also "
                                               + listing(set(_GRAD_ACCUM_DTYPES) - {"fp32", "fp16", "bf16"}) + ")")
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
    fp16 = get_section(config, "fp16", "fp16")
    bf16 = get_section(config, "bf16", "bf16")
    check_keys(fp16, _FP16_KEYS, "fp16")
    check_keys(bf16, {"enabled"}, "bf16")
    fp16_on = check_bool(fp16.get("enabled", False), "fp16.enabled")
    bf16_on = check_bool(bf16.get("enabled", False), "bf16.enabled")
    if fp16_on and bf16_on:
        raise InvalidArgumentError("bf16.enabled", True, "false when fp16.enabled is true (one 16-bit dtype)")
    if not fp16_on:
        set_keys = sorted(set(fp16) - {"enabled"})
        if set_keys:
            no_effect(f"fp16.{set_keys[0]}", "fp16 is not enabled")
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
            no_effect(f"fp16.{key}", "chunkmem's scaler and input casting have no such switch")
    try:  # checked before anything is built
        DynamicGradScaler(**scaler)
    except InvalidArgumentError as e:
        if e.argument != "initial_scale":
            raise type(e)(SCALER_KEYS.get(e.argument, f"fp16.{e.argument}"), e.value, e.allowed) from e
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
    check_keys(section, {"type", "params"}, "optimizer")
    kind = section.get("type")
    if not isinstance(kind, str) or kind.lower() not in {t.lower() for t in _OPTIMIZER_TYPES}:
        torch_class = _torch_optimizer_class(kind)
        if torch_class is None:
            error = InvalidArgumentError if isinstance(kind, str) else ArgumentTypeError
            raise error("optimizer.type", kind, listing(_OPTIMIZER_TYPES) + " (case-insensitive), or the name of a "
                                                "torch.optim optimizer class such as 'SGD'")
        options = dict(get_section(section, "params", "optimizer.params"))
        check_keys(options, set(inspect.signature(torch_class.__init__).parameters) - {"self", "params"},
                    "optimizer.params")
        if isinstance(options.get("betas"), list):
            options["betas"] = tuple(options["betas"])
        try:
            return torch_class(params, **options)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError("optimizer.params", options, f"arguments torch.optim.{kind} takes ({e})") from e
    options = dict(get_section(section, "params", "optimizer.params"))
    check_keys(options, _OPTIMIZER_PARAMS, "optimizer.params")
    adamw = options.pop("adam_w_mode", True)
    check_bool(adamw, "optimizer.params.adam_w_mode")
    if kind.lower() == "adamw" and not adamw:
        raise InvalidArgumentError("optimizer.params.adam_w_mode", False, "true (or absent) with type 'AdamW'")
    if "betas" in options and isinstance(options["betas"], list):
        options["betas"] = tuple(options["betas"])
    return rename_errors("optimizer.params.", lambda: HybridAdam(params, adamw_mode=adamw, **options))
