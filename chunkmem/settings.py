"""Configuration as data: the settings of a wrapped model and of its optimizer, as frozen dataclasses.

Every way of configuring chunkmem arrives here and is checked once: the reference signatures
(``ShardedModelV2(...)``, ``ShardedOptimizerV2(...)`` parse their arguments with
:meth:`ModelSettings.from_arguments` / :meth:`OptimizerSettings.from_arguments`), the ColossalAI
``zero=dict(model_config=..., optimizer_config=...)`` form (its keys are those of :data:`MODEL_KEYWORDS`
and :data:`OPTIMIZER_KEYWORDS`) and the DeepSpeed JSON (:mod:`chunkmem.configs` builds the same
objects). A value that is refused raises :class:`~chunkmem.ArgumentTypeError` or
:class:`~chunkmem.InvalidArgumentError` naming the reference argument, before anything is built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .core.disk_tier import DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE, check_disk_arguments
from .errors import InvalidArgumentError, check_number, check_type
from .distributed.shard_strategy import BaseShardStrategy
from .runtime.placement import PlacementPolicy, make_policy

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"


def check_dtype(argument: str, dtype: Any) -> None:
    """Raise unless ``dtype`` is one chunks can store: a ``torch.dtype`` among :data:`SUPPORTED_DTYPES`."""
    check_type(argument, dtype, torch.dtype, SUPPORTED_DTYPE_NAMES)
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(argument, dtype, SUPPORTED_DTYPE_NAMES)


def check_grad_accum_dtype(grad_accum_dtype: Any, dtype: torch.dtype | None) -> None:
    """Raise :class:`~chunkmem.InvalidArgumentError` naming ``grad_accum_dtype`` unless it is ``None``,
    ``torch.float32`` or the model's ``dtype`` (with ``dtype`` ``None``, not known yet: any 16-bit dtype):
    ``ShardedModelV2``'s check, shared with :func:`chunkmem.plan` and :func:`chunkmem.choose`."""
    if grad_accum_dtype is not None and (
            not isinstance(grad_accum_dtype, torch.dtype) or
            grad_accum_dtype not in (torch.float32, torch.float16, torch.bfloat16) or
            dtype is not None and grad_accum_dtype not in (torch.float32, dtype)):
        raise InvalidArgumentError("grad_accum_dtype", grad_accum_dtype,
                                   "None or torch.float32 (sum 16-bit gradients over backwards in fp32), or the "
                                   "model's dtype (sum them in it: 2 bytes a parameter fewer while accumulating)")


def check_chunk_size(chunk_size: Any, dtype: torch.dtype | None = None, min_elements: int = 1) -> None:
    """Raise unless ``chunk_size`` is ``None`` or a positive byte count; given ``dtype``, also unless it
    is a whole number of elements of ``dtype``, at least ``min_elements`` of them."""
    allowed = "None (searched) or a positive byte count"
    if chunk_size is None:
        return
    check_type("chunk_size", chunk_size, int, allowed)
    if chunk_size <= 0:
        raise InvalidArgumentError("chunk_size", chunk_size, allowed)
    if dtype is not None:
        size = dtype.itemsize
        if chunk_size % size or chunk_size < min_elements * size:
            least = f", at least {min_elements * size} bytes" if min_elements > 1 else ""
            raise InvalidArgumentError("chunk_size", chunk_size,
                                       f"None or a multiple of {size} bytes (the element size of {dtype}){least}")


def check_param_dtypes(named_params: Any, argument: str = "module") -> None:
    """Raise unless every ``(name, parameter)`` has a dtype chunks can hold (16- or 32-bit floating
    point): an integer, float64 or complex parameter would be silently rounded into the chunk."""
    for name, param in named_params:
        if param is not None and param.dtype not in SUPPORTED_DTYPES:
            raise InvalidArgumentError(f"{argument} parameter {name!r} of dtype", param.dtype,
                                       f"a parameter of dtype {SUPPORTED_DTYPE_NAMES} (convert the module, "
                                       f"e.g. with .float(), or keep it as a buffer)")


def _check_bool(argument: str, value: Any) -> None:
    check_type(argument, value, bool, "True or False")


@dataclass(frozen=True)
class PlacementSettings:
    """Where chunks rest: ``tensor_placement_policy`` (``"cuda"``, ``"cpu"``, ``"auto"``, ``"static"``) and,
    with ``"static"``, the fractions in [0, 1] of parameter chunks and of optimizer chunk groups that rest
    on the host (``offload_param_frac``, ``offload_optim_frac``)."""

    tensor_placement_policy: str = "cuda"
    offload_param_frac: float = 0.0
    offload_optim_frac: float = 0.0

    def __post_init__(self) -> None:
        make_policy(self.tensor_placement_policy, self.offload_param_frac, self.offload_optim_frac)


@dataclass(frozen=True)
class DiskSettings:
    """The disk tier (``offload_optimizer`` / ``offload_param`` ``"disk"`` or ``None``; ``nvme_path`` the
    directory; ``buffer_count`` I/O buffers per streamed family; ``buffer_size`` bytes per I/O buffer;
    ``atomic_step``). Checked against the placement in :class:`ModelSettings`."""

    offload_optimizer: str | None = None
    offload_param: str | None = None
    nvme_path: str | os.PathLike | None = None
    buffer_count: int = DEFAULT_BUFFER_COUNT
    buffer_size: int = DEFAULT_BUFFER_SIZE
    atomic_step: bool = True

    @property
    def enabled(self) -> bool:
        return self.nvme_path is not None

    @property
    def optimizer_on_disk(self) -> bool:
        return self.offload_optimizer == "disk"

    @property
    def params_on_disk(self) -> bool:
        return self.offload_param == "disk"


@dataclass(frozen=True)
class ReductionSettings:
    """How gradients are reduce-scattered over the ranks: at most ``reduce_scatter_bucket_size_mb`` MiB
    of collective input at a time, in fp32 (``fp32_reduce_scatter``) or the model dtype, each rank's
    gradient divided by ``gradient_predivide_factor`` first; at most ``reductions_in_flight`` chunks'
    reduce-scatters left running while the backward goes on (``0``: each waited for at once); with
    ``quantized_gradients``, exchanged as blockwise int8 instead (ZeRO++'s qgZ,
    :class:`~chunkmem.distributed.reduction.GradientReduction`)."""

    reduce_scatter_bucket_size_mb: float = 25
    fp32_reduce_scatter: bool = False
    gradient_predivide_factor: float = 1.0
    reductions_in_flight: int = 0
    quantized_gradients: bool = False

    def __post_init__(self) -> None:
        check_number("reduce_scatter_bucket_size_mb", self.reduce_scatter_bucket_size_mb, low=0, low_open=True,
                     high=2**43, finite=True, allowed="a finite number > 0 and <= 2**43 (MB)")
        _check_bool("fp32_reduce_scatter", self.fp32_reduce_scatter)
        check_number("gradient_predivide_factor", self.gradient_predivide_factor, low=0.0, low_open=True,
                     finite=True)
        check_number("reductions_in_flight", self.reductions_in_flight, low=0, integer=True)
        _check_bool("quantized_gradients", self.quantized_gradients)

    @property
    def bucket_bytes(self) -> int:
        return int(self.reduce_scatter_bucket_size_mb * 2**20)


@dataclass(frozen=True)
class ShardingSettings:
    """How the chunks are sharded and gathered over several ranks and nodes (ZeRO-3's multi-node knobs):
    ``shard_group_size`` ranks per shard group, each group a replica of the model's shards (MiCS; ``None``:
    one group of every rank); ``quantized_weights``: gathers for compute move blockwise int8 (ZeRO++'s qwZ:
    ``True``, or ``"nontrainable"`` for the frozen chunks only); ``secondary_partition_size`` ranks share a
    secondary partition the backward gathers from (ZeRO++'s hpZ; ``None`` or 1: none); ``gather_node_size``
    ranks per node for the two-stage gather (MiCS's hierarchical gather; ``None``: flat). Each is checked here,
    and hpZ against shard groups; :class:`ModelSettings` checks the combinations that involve the shard strategy
    or the placement (the hierarchical gather's with quantized or bucketed gathers in one check)."""

    shard_group_size: int | None = None
    quantized_weights: bool | str = False
    secondary_partition_size: int | None = None
    gather_node_size: int | None = None

    def __post_init__(self) -> None:
        if self.shard_group_size is not None:
            check_number("shard_group_size", self.shard_group_size, low=1, integer=True,
                         allowed="None or an integer dividing the data-parallel ranks")
        if self.quantized_weights not in QUANTIZED_WEIGHTS or type(self.quantized_weights) not in (bool, str):
            raise InvalidArgumentError("quantized_weights", self.quantized_weights,
                                       "False, True or 'nontrainable' (only the frozen parameters' gathers)")
        if self.secondary_partition_size not in (None, 1):
            check_number("secondary_partition_size", self.secondary_partition_size, low=1, integer=True,
                         allowed="None, 1 or a divisor of the ranks the chunks are sharded over")
            if self.shard_group_size is not None:
                raise InvalidArgumentError("secondary_partition_size", self.secondary_partition_size,
                                           "None or 1 with shard_group_size (the gathers already stay inside a group)")
        if self.gather_node_size is not None:
            check_number("gather_node_size", self.gather_node_size, low=1, integer=True,
                         allowed="None or a divisor of the ranks the chunks are sharded over")


@dataclass(frozen=True)
class ModelSettings:
    """Everything :class:`~chunkmem.ShardedModelV2` is configured with (see its docstring for each)."""

    shard_strategy: BaseShardStrategy
    process_group: Any = None
    reduce_scatter_process_group: Any = None
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    reduction: ReductionSettings = field(default_factory=ReductionSettings)
    reuse_fp16_shard: bool = False
    dtype: torch.dtype | None = None
    chunk_size: int | None = None
    disk: DiskSettings = field(default_factory=DiskSettings)
    prefetch_numel: int | None = None
    persistence_threshold: int = 0
    model_persistence_threshold: int | None = None
    sharding: ShardingSettings = field(default_factory=ShardingSettings)
    grad_accum_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_type("shard_strategy", self.shard_strategy, BaseShardStrategy,
                   "an instance of TensorShardStrategy or BucketTensorShardStrategy")
        _check_bool("reuse_fp16_shard", self.reuse_fp16_shard)
        if self.prefetch_numel is not None:
            check_number("prefetch_numel", self.prefetch_numel, low=0, integer=True,
                         allowed="None or an integer >= 0 (parameter elements fetched ahead of use)")
        check_number("persistence_threshold", self.persistence_threshold, low=0, integer=True,
                     allowed="an integer >= 0 (elements: parameters with fewer stay whole on every rank)")
        sharding = self.sharding
        if sharding.quantized_weights and self.shard_strategy.bucketed:
            raise InvalidArgumentError("quantized_weights", sharding.quantized_weights,
                                       "False with BucketTensorShardStrategy (its gathers of several chunks at once "
                                       "are exact); use TensorShardStrategy")
        if sharding.secondary_partition_size not in (None, 1) and self.placement.tensor_placement_policy == "auto":
            raise InvalidArgumentError("secondary_partition_size", sharding.secondary_partition_size,
                                       f"None or 1 with tensor_placement_policy="
                                       f"{self.placement.tensor_placement_policy!r} (its plan does not count "
                                       f"the secondary partitions); use 'cpu', 'cuda' or 'static'")
        if sharding.gather_node_size is not None and (sharding.quantized_weights or self.shard_strategy.bucketed):
            raise InvalidArgumentError("gather_node_size", sharding.gather_node_size,
                                       "None with quantized_weights or BucketTensorShardStrategy (their gathers "
                                       "are not hierarchical)")
        if self.reduction.reductions_in_flight and self.reuse_fp16_shard:
            raise InvalidArgumentError("reductions_in_flight", self.reduction.reductions_in_flight,
                                       "0 with reuse_fp16_shard=True (the gradients are reduced out of the "
                                       "parameters' memory, which the backward needs back at once)")
        if self.model_persistence_threshold is not None:
            check_number("model_persistence_threshold", self.model_persistence_threshold, low=0, integer=True,
                         allowed="None or an integer >= 0 (elements of persistent parameters in all)")
        if self.persistence_threshold > 0 and self.disk.enabled:
            raise InvalidArgumentError("persistence_threshold", self.persistence_threshold,
                                       "0 with the disk tier (persistent parameters are not placed on disk)")
        check_chunk_size(self.chunk_size)
        if self.dtype is not None:
            check_dtype("dtype", self.dtype)
        check_grad_accum_dtype(self.grad_accum_dtype, self.dtype)
        disk = self.disk
        check_disk_arguments(disk.offload_optimizer, disk.offload_param, disk.nvme_path, disk.buffer_count,
                             disk.buffer_size, disk.atomic_step, self.placement.tensor_placement_policy,
                             self.reuse_fp16_shard)

    @staticmethod
    def from_arguments(shard_strategy: Any, process_group: Any = None, reduce_scatter_process_group: Any = None,
                       reduce_scatter_bucket_size_mb: float = 25, fp32_reduce_scatter: bool = False,
                       tensor_placement_policy: str = "cuda", gradient_predivide_factor: float = 1.0,
                       reuse_fp16_shard: bool = False, *, dtype: torch.dtype | None = None,
                       chunk_size: int | None = None, offload_param_frac: float = 0.0,
                       offload_optim_frac: float = 0.0, offload_optimizer: str | None = None,
                       offload_param: str | None = None, nvme_path: str | os.PathLike | None = None,
                       buffer_count: int = DEFAULT_BUFFER_COUNT, buffer_size: int = DEFAULT_BUFFER_SIZE,
                       atomic_step: bool = True, prefetch_numel: int | None = None, persistence_threshold: int = 0,
                       model_persistence_threshold: int | None = None,
                       reductions_in_flight: int = 0, shard_group_size: int | None = None,
                       quantized_gradients: bool = False, quantized_weights: bool | str = False,
                       secondary_partition_size: int | None = None,
                       gather_node_size: int | None = None,
                       grad_accum_dtype: torch.dtype | None = None) -> "ModelSettings":
        """The settings named by ``ShardedModelV2``'s arguments (the same names and defaults)."""
        return ModelSettings(
            shard_strategy, process_group, reduce_scatter_process_group,
            PlacementSettings(tensor_placement_policy, offload_param_frac, offload_optim_frac),
            ReductionSettings(reduce_scatter_bucket_size_mb, fp32_reduce_scatter, gradient_predivide_factor,
                              reductions_in_flight, quantized_gradients),
            reuse_fp16_shard, dtype, chunk_size,
            DiskSettings(offload_optimizer, offload_param, nvme_path, buffer_count, buffer_size, atomic_step),
            prefetch_numel, persistence_threshold, model_persistence_threshold,
            ShardingSettings(shard_group_size, quantized_weights, secondary_partition_size, gather_node_size),
            grad_accum_dtype)

    def policy(self) -> PlacementPolicy:
        """The placement policy these settings choose."""
        p = self.placement
        return make_policy(p.tensor_placement_policy, p.offload_param_frac, p.offload_optim_frac,
                           self.disk.optimizer_on_disk, self.disk.params_on_disk)


MODEL_KEYWORDS = ("shard_strategy", "process_group", "reduce_scatter_process_group", "reduce_scatter_bucket_size_mb",
                  "fp32_reduce_scatter", "tensor_placement_policy", "gradient_predivide_factor", "reuse_fp16_shard",
                  "dtype", "chunk_size", "offload_param_frac", "offload_optim_frac", "offload_optimizer",
                  "offload_param", "nvme_path", "buffer_count", "buffer_size", "atomic_step", "prefetch_numel",
                  "persistence_threshold", "model_persistence_threshold", "reductions_in_flight",
                  "shard_group_size", "quantized_gradients", "quantized_weights", "secondary_partition_size",
                  "gather_node_size", "grad_accum_dtype")
"""The keyword arguments of :meth:`ModelSettings.from_arguments` (``ShardedModelV2``'s, and the keys of
the ColossalAI form's ``model_config``)."""


QUANTIZED_WEIGHTS = (False, True, "nontrainable")
"""The values of ``quantized_weights``: no quantized gathers, every chunk's, or only frozen chunks'."""


MIN_SCALE_BOUND = 2.0**-126
"""The smallest loss scale allowed: the smallest normal fp32 number."""
MAX_SCALE_BOUND = 2.0**126
"""The largest loss scale allowed: a scale and its reciprocal (which unscales the gradients) both stay
normal fp32 numbers within [MIN_SCALE_BOUND, MAX_SCALE_BOUND]."""


@dataclass(frozen=True)
class ScalerSettings:
    """The dynamic loss scaler's rules (see :class:`~chunkmem.DynamicGradScaler`); the defaults are
    ``ShardedOptimizerV2``'s.

    Every scale the rules can reach lies in [``min_scale``, ``max_scale``], so requiring
    ``2**-126 <= min_scale <= max_scale <= 2**126`` keeps every reachable scale, and its reciprocal,
    finite (and normal) in fp32: no choice of knobs can make the scale infinite and skip every later
    step. All values must be finite; ``growth_factor`` > 1, ``backoff_factor`` in (0, 1],
    ``growth_interval`` and ``hysteresis`` integers >= 1, ``initial_scale`` within
    [``min_scale``, ``max_scale``]."""

    initial_scale: float = 2**32
    min_scale: float = 1
    growth_factor: float = 2
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2**32

    def __post_init__(self) -> None:
        for name in ("initial_scale", "min_scale", "max_scale"):
            check_number(name, getattr(self, name), low=MIN_SCALE_BOUND, high=MAX_SCALE_BOUND, finite=True,
                         allowed="a number within [2**-126, 2**126] (scale and 1/scale finite in fp32)")
        check_number("growth_factor", self.growth_factor, low=1.0, low_open=True, finite=True)
        check_number("backoff_factor", self.backoff_factor, low=0.0, high=1.0, low_open=True, finite=True)
        check_number("growth_interval", self.growth_interval, low=1, integer=True)
        check_number("hysteresis", self.hysteresis, low=1, integer=True)
        if self.min_scale > self.max_scale:
            raise InvalidArgumentError("min_scale", self.min_scale, f"<= max_scale ({self.max_scale})")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise InvalidArgumentError("initial_scale", self.initial_scale, f"within [min_scale, max_scale] = "
                                                                            f"[{self.min_scale}, {self.max_scale}]")


@dataclass(frozen=True)
class OptimizerSettings:
    """Everything :class:`~chunkmem.ShardedOptimizerV2` is configured with beside the wrapped optimizer
    (see its docstring for each)."""

    gpu_margin_mem_ratio: float = 0.0
    scaler: ScalerSettings = field(default_factory=ScalerSettings)
    dp_process_group: Any = None
    mp_process_group: Any = None
    verbose: bool = False
    max_norm: float = 0.0
    norm_type: float = 2.0
    step_in_backward: bool = False

    def __post_init__(self) -> None:
        check_number("gpu_margin_mem_ratio", self.gpu_margin_mem_ratio, low=0.0, high=1.0)
        _check_bool("verbose", self.verbose)
        check_number("max_norm", self.max_norm, low=0.0, finite=True, allowed="a finite number >= 0 (0: no clipping)")
        check_number("norm_type", self.norm_type, low=0.0, low_open=True)
        _check_bool("step_in_backward", self.step_in_backward)

    @staticmethod
    def from_arguments(gpu_margin_mem_ratio: float = 0.0, initial_scale: float = 2**32, min_scale: float = 1,
                       growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                       hysteresis: int = 2, max_scale: float = 2**32, dp_process_group: Any = None,
                       mp_process_group: Any = None, verbose: bool = False, *, max_norm: float = 0.0,
                       norm_type: float = 2.0, step_in_backward: bool = False) -> "OptimizerSettings":
        """The settings named by ``ShardedOptimizerV2``'s arguments (the same names and defaults)."""
        scaler = ScalerSettings(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
                                hysteresis, max_scale)
        return OptimizerSettings(gpu_margin_mem_ratio, scaler, dp_process_group, mp_process_group, verbose, max_norm,
                                 norm_type, step_in_backward)


OPTIMIZER_KEYWORDS = ("gpu_margin_mem_ratio", "initial_scale", "min_scale", "growth_factor", "backoff_factor",
                      "growth_interval", "hysteresis", "max_scale", "dp_process_group", "mp_process_group",
                      "verbose", "max_norm", "norm_type", "step_in_backward")
"""The keyword arguments of :meth:`OptimizerSettings.from_arguments` (``ShardedOptimizerV2``'s beside
``sharded_model`` and ``optimizer``, and the keys of the ColossalAI form's ``optimizer_config``)."""


def unknown_keyword(path: str, given: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Raise :class:`~chunkmem.InvalidArgumentError` for the first key of ``given`` not in ``allowed``
    (``path``: where the keys come from, e.g. ``"zero.model_config"``)."""
    for key in given:
        if key not in allowed:
            raise InvalidArgumentError(f"{path}.{key}", given[key],
                                       "a key among " + ", ".join(repr(k) for k in sorted(allowed)))


__all__ = ["DiskSettings", "ModelSettings", "MODEL_KEYWORDS", "OptimizerSettings", "OPTIMIZER_KEYWORDS",
           "PlacementSettings", "ReductionSettings", "ScalerSettings"]
