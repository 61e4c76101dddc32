"""The ColossalAI form of a configuration, ``{"zero": {"model_config": {...}, "optimizer_config": {...}}}``,
read into settings: the two sections are the keyword arguments of :class:`~chunkmem.ShardedModelV2` and
:class:`~chunkmem.ShardedOptimizerV2` (``shard_strategy`` may also be the name of a strategy class, ``dtype``
and ``grad_accum_dtype`` the name of a dtype, as :meth:`chunkmem.plan.Candidate.config` writes them). Errors
name the key path (``zero.model_config.<argument>``)."""
from __future__ import annotations

from typing import Any

import torch

from ..distributed.shard_strategy import BaseShardStrategy, BucketTensorShardStrategy, TensorShardStrategy
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..settings import MODEL_KEYWORDS, OPTIMIZER_KEYWORDS, ModelSettings, OptimizerSettings
from .reading import check_keys, get_section, listing, rename_errors

__all__ = ["read_sections", "to_settings"]

_STRATEGIES = {"TensorShardStrategy": TensorShardStrategy, "BucketTensorShardStrategy": BucketTensorShardStrategy}


def read_sections(zero: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``zero``'s ``model_config`` and ``optimizer_config`` (copies), their keys checked."""
    if not isinstance(zero, dict):
        raise ArgumentTypeError("config.zero", zero, "a dict with 'model_config' and 'optimizer_config'")
    check_keys(zero, {"model_config", "optimizer_config"}, "zero")
    model_config = dict(get_section(zero, "model_config", "zero.model_config"))
    optimizer_config = dict(get_section(zero, "optimizer_config", "zero.optimizer_config"))
    check_keys(model_config, set(MODEL_KEYWORDS), "zero.model_config")
    check_keys(optimizer_config, set(OPTIMIZER_KEYWORDS), "zero.optimizer_config")
    return model_config, optimizer_config


def to_settings(model_config: dict[str, Any], optimizer_config: dict[str, Any]) -> tuple[ModelSettings,
                                                                                          OptimizerSettings]:
    """The model's and the optimizer's settings from the two sections of :func:`read_sections`
    (``model_config`` is consumed: its ``shard_strategy`` is taken out)."""
    strategy = model_config.pop("shard_strategy", TensorShardStrategy())
    if isinstance(strategy, str):
        if strategy not in _STRATEGIES:
            raise InvalidArgumentError("zero.model_config.shard_strategy", strategy, listing(_STRATEGIES))
        strategy = _STRATEGIES[strategy]()
    elif not isinstance(strategy, BaseShardStrategy):
        raise ArgumentTypeError("zero.model_config.shard_strategy", strategy,
                                "a shard strategy instance or " + listing(_STRATEGIES))
    for key in ("dtype", "grad_accum_dtype"):  # (by name too, as Candidate.config writes them)
        if isinstance(model_config.get(key), str):
            model_config[key] = _dtype_named(model_config[key], f"zero.model_config.{key}")
    model_settings = rename_errors("zero.model_config.",
                                   lambda: ModelSettings.from_arguments(strategy, **model_config))
    optimizer_settings = rename_errors("zero.optimizer_config.",
                                       lambda: OptimizerSettings.from_arguments(**optimizer_config))
    return model_settings, optimizer_settings


def _dtype_named(name: str, path: str) -> torch.dtype:
    names = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32}
    if name not in names:
        raise InvalidArgumentError(path, name, listing(names))
    return names[name]
