"""``deepspeed.zero``: building a model straight into chunks (:class:`Init`), gathering parameters
(:class:`GatheredParameters`), registering parameters used outside their module
(:func:`register_external_parameter`) and a linear layer in tiles (:class:`~chunkmem.TiledLinear`), under
DeepSpeed's names and signatures."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..configs.reading import read_config
from ..distributed.shard_strategy import TensorShardStrategy
from ..errors import InvalidArgumentError, NoEffectWarning, check_type
from ..faces.init_context import ZeroInitContext
from ..runtime.parameter_access import GatheredParameters, register_external_parameter
from ..faces.tiled_linear import TiledLinear
from .comm import get_world_size

__all__ = ["GatheredParameters", "Init", "TiledLinear", "register_external_parameter"]

_NO_EFFECT_DEFAULTS = {"mem_efficient_linear": True, "pin_memory": False, "zero_quantized_weights": False,
                       "zero_quantized_nontrainable_weights": False, "param_swapper": None}


class Init:
    """DeepSpeed's ``zero.Init``: modules built inside get their parameters packed into chunks at once
    (:class:`~chunkmem.ZeroInitContext`), sharded over the ranks when there are several.

    Args:
        module: ``None`` only (partitioning a module already built is not supported: build it inside).
        data_parallel_group: ``None`` only (the default group's ranks).
        remote_device: where the chunks are built: ``None`` (the device: the GPU, or the CPU without one),
            ``"cpu"`` (the host) or ``"nvme"`` (the disk tier, in the directory the config's
            ``zero_optimization.offload_param.nvme_path`` names: see ``ZeroInitContext(nvme_path=)``).
        config_dict_or_path, config: the DeepSpeed config; its ``fp16``/``bf16`` section sets the dtype when
            ``dtype`` is not given.
        enabled: ``False`` makes the block build an ordinary module.
        dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``; default: from the config, else
            ``torch.float16`` (DeepSpeed's default without a config).
        mem_efficient_linear, pin_memory, zero_quantized_weights, zero_quantized_nontrainable_weights,
        param_swapper: accepted; a value other than the default warns with :class:`~chunkmem.NoEffectWarning`.
        mpu, zero_param_parallel_group, sequence_data_parallel_group: ``None`` only.
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 zero_param_parallel_group: Any = None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group: Any = None,
                 param_swapper: Any = None, **unknown: Any) -> None:
        for name in unknown:
            raise InvalidArgumentError(name, unknown[name], "an argument of deepspeed.zero.Init")
        for name, value in (("module", module), ("data_parallel_group", data_parallel_group), ("mpu", mpu),
                            ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group)):
            if value is not None:
                raise InvalidArgumentError(name, type(value).__name__, "None (not supported by chunkmem)")
        check_type("enabled", enabled, bool, "True or False")
        if remote_device not in (None, "cpu", "cuda", "none", "nvme"):
            raise InvalidArgumentError("remote_device", remote_device, "None, 'cpu', 'cuda' or 'nvme'")
        passed = {"mem_efficient_linear": mem_efficient_linear, "pin_memory": pin_memory,
                  "zero_quantized_weights": zero_quantized_weights,
                  "zero_quantized_nontrainable_weights": zero_quantized_nontrainable_weights,
                  "param_swapper": param_swapper}
        for name, value in passed.items():
            if value != _NO_EFFECT_DEFAULTS[name]:
                warnings.warn(f"deepspeed.zero.Init({name}={value!r}) has no effect in chunkmem", NoEffectWarning,
                              stacklevel=2)
        if config_dict_or_path is not None and config is not None:
            raise InvalidArgumentError("config", "given with config_dict_or_path", "one of the two")
        source = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype if dtype is not None else _dtype_of(source)
        nvme_path = _nvme_path_of(source) if remote_device == "nvme" else None
        on_host = remote_device in ("cpu", "nvme") or not torch.cuda.is_available()
        target = "cpu" if on_host else torch.cuda.current_device()
        self._context = None if not enabled else ZeroInitContext(
            target_device=target, shard_strategy=TensorShardStrategy(), shard_param=get_world_size() > 1,
            dtype=self.dtype, nvme_path=nvme_path)

    def __enter__(self) -> "Init":
        if self._context is not None:
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


def _nvme_path_of(config: dict[str, Any] | str | os.PathLike | None) -> str:
    """``zero_optimization.offload_param.nvme_path`` of the config (``remote_device="nvme"`` needs it)."""
    offload = ((read_config(config) if config is not None else {}).get("zero_optimization") or {}).get(
        "offload_param") or {}
    path = offload.get("nvme_path")
    if path is None:
        raise InvalidArgumentError("remote_device", "nvme", "'nvme' with a config whose "
                                   "zero_optimization.offload_param.nvme_path names a directory")
    return path


def _dtype_of(config: dict[str, Any] | str | os.PathLike | None) -> torch.dtype:
    if config is None:
        return torch.float16
    config = read_config(config)
    fp16 = (config.get("fp16") or {}).get("enabled", False)
    bf16 = (config.get("bf16") or {}).get("enabled", False)
    if fp16 and bf16:
        raise InvalidArgumentError("config", "fp16 and bf16 both enabled", "at most one of them")
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
