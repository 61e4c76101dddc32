"""DeepSpeed's face: a DeepSpeed training script runs on chunkmem by changing its import,
``import chunkmem.deepspeed as deepspeed``.

:func:`initialize` takes DeepSpeed's arguments and config and returns ``(engine, optimizer,
training_dataloader, lr_scheduler)``; the engine (:class:`~chunkmem.TrainingEngine`) runs
DeepSpeed's loop (gradient accumulation, clipping, the config's schedule, checkpoints with a client state,
``save_16bit_model``) over :class:`~chunkmem.ShardedModelV2` / :class:`~chunkmem.ShardedOptimizerV2`
(stage 3) or :class:`~chunkmem.LowLevelZeroOptimizer` (stages 1, 2); as DeepSpeed's, ``engine.module`` is
the module passed in at every stage (``engine.sharded_model`` the wrapper at stage 3). The submodules
``zero``, ``utils``, ``comm`` and ``accelerator`` carry the DeepSpeed names scripts call. What a config key
becomes is in ``chunkmem.configs.deepspeed.KEY_TABLE``.
"""
from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from ..configs.deepspeed import build_optimizer
from ..configs.reading import read_config
from ..faces.config import initialize as _wrap
from ..errors import ArgumentTypeError, InvalidArgumentError
from . import accelerator, comm, utils, zero
from .comm import init_distributed
from ..faces.engine import TrainingEngine
from ..configs.loop_settings import LOOP_KEYS, LoopSettings
from .lr_schedules import schedule_from_config

DeepSpeedEngine = TrainingEngine
"""DeepSpeed's name of the engine :func:`initialize` returns (:class:`chunkmem.TrainingEngine`)."""

__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "comm", "init_distributed", "initialize", "utils",
           "zero"]


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: dict[str, Any] | str | os.PathLike | None = None,
               config_params: dict[str, Any] | str | None = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: wrap ``model`` as the config says and return ``(engine, optimizer,
    training_dataloader, lr_scheduler)``.

    Args:
        args: an ``argparse`` namespace whose ``deepspeed_config`` names the config when ``config`` is not
            given; a module passed here positionally (``initialize(model, ...)``) is taken as ``model``.
        model: the module (built plainly or in :class:`~chunkmem.deepspeed.zero.Init`).
        optimizer: a torch optimizer over the model's parameters, or ``None`` (built from the config's
            ``optimizer`` section over ``model_parameters``, or no optimizer).
        model_parameters: the parameters or param groups the config's optimizer is built over (default: all
            of the model's).
        training_data: a ``torch.utils.data.Dataset``: the third value returned is a ``DataLoader`` over it
            with the micro batch size (a ``DistributedSampler`` over the ranks, else shuffled; ``collate_fn``).
        lr_scheduler: a schedule object, or a callable taking the optimizer and returning one; otherwise the
            config's ``scheduler`` section (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``).
        mpu: model parallelism, not supported (``None`` only).
        dist_init_required: ``None`` or ``True`` initialise ``torch.distributed`` (:func:`init_distributed`:
            a group of one without a launcher) when it is not yet, as DeepSpeed does; ``False`` leaves it.
        config, config_params: the DeepSpeed config, a dict or a JSON file path (one of the two).

    The batch keys are checked as DeepSpeed checks them (:mod:`chunkmem.configs.loop_settings`);
    ``gradient_clipping`` absent clips at 1.0, DeepSpeed's default. Everything is checked before the model
    is wrapped.
    """
    if isinstance(args, nn.Module) and model is None:
        args, model = None, args
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError("model", type(model).__name__, "a torch.nn.Module")
    if mpu is not None:
        raise InvalidArgumentError("mpu", type(mpu).__name__, "None (chunkmem has no model parallelism)")
    if config is not None and config_params is not None:
        raise InvalidArgumentError("config_params", "given with config", "one of config and config_params")
    config = config if config is not None else config_params
    if config is None:
        config = getattr(args, "deepspeed_config", None)
        if config is None:
            raise InvalidArgumentError("config", None, "a DeepSpeed config (a dict or a JSON file path), or "
                                                       "args.deepspeed_config naming one")
    config = dict(read_config(config))
    if "zero" in config:
        raise InvalidArgumentError("config.zero", config["zero"], "a DeepSpeed config (zero_optimization, ...); "
                                                                  "the ColossalAI form goes to chunkmem.initialize")
    if dist_init_required is not False:  # DeepSpeed: None initialises torch.distributed when it is not yet
        init_distributed()
    loop = LoopSettings.from_config(config, comm.get_world_size())
    rest = {key: value for key, value in config.items() if key not in LOOP_KEYS}
    if isinstance(rest.get("zero_optimization"), dict):  # the engine honours it (loop.elastic_checkpoint)
        rest["zero_optimization"] = {k: v for k, v in rest["zero_optimization"].items() if k != "elastic_checkpoint"}
    if lr_scheduler is None and loop.scheduler is not None:  # checked on a stand-in before anything is wrapped
        groups = len(optimizer.param_groups) if optimizer is not None else 1
        with warnings.catch_warnings():  # its warnings come when the real one is built
            warnings.simplefilter("ignore")
            _check_schedule_steps(schedule_from_config(loop.scheduler, _stand_in(groups)), loop.scheduler)
    if optimizer is None and model_parameters is not None and "optimizer" in rest:
        optimizer = build_optimizer(rest.pop("optimizer"), model_parameters)
    module, optim = _wrap(model, optimizer, rest)
    stage = rest.get("zero_optimization", {}).get("stage")
    if lr_scheduler is None and loop.scheduler is not None and optim is not None:
        lr_scheduler = schedule_from_config(loop.scheduler, optim)
    elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        # as DeepSpeed, which calls it with the client's optimizer, not the ZeRO wrapper (the schedule's changes
        # to its param groups are the wrapper's)
        lr_scheduler = lr_scheduler(getattr(optim, "optim", optim))
    loader = None if training_data is None else _dataloader(training_data, loop.micro_batch, collate_fn)
    engine = DeepSpeedEngine(module, optim, lr_scheduler, loop, stage, loader)
    return engine, optim, loader, lr_scheduler


def _check_schedule_steps(schedule: Any, section: dict[str, Any]) -> None:
    """Step a schedule built over a stand-in a few times: an argument of the wrong type that only its ``step``
    reads (``StepLR``'s ``step_size="3"``) is refused here, before anything is wrapped, instead of at the first
    training step, after the weights were updated."""
    try:
        for _ in range(3):
            schedule.step()
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise InvalidArgumentError("scheduler.params", section.get("params"),
                                   f"arguments {section.get('type')} can step with ({type(e).__name__}: {e})") from e


def _stand_in(groups: int) -> torch.optim.Optimizer:
    """An optimizer with ``groups`` param groups, to check a schedule's arguments before the real one exists."""
    return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "betas": (0.9, 0.999)}
                            for _ in range(groups)], lr=0.0, momentum=0.9)


def _dataloader(data: Any, micro_batch: int, collate_fn: Any) -> torch.utils.data.DataLoader:
    if comm.get_world_size() > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(data)
    else:
        sampler = torch.utils.data.RandomSampler(data)
    return torch.utils.data.DataLoader(data, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line arguments (``--deepspeed``, ``--deepspeed_config``, and the older
    ``--deepscale``, ``--deepscale_config``) to ``parser``; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (chunkmem)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
