"""The training-loop keys of a DeepSpeed config, which the engine (:mod:`chunkmem.faces.engine`) honours: the three batch sizes,
``steps_per_print``, ``wall_clock_breakdown`` and ``scheduler``.

The batch sizes follow DeepSpeed's rule: ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world_size``; any one or two of them may be left out and are derived
(integer division, then checked), at least one of the first two must be given, and the three must
agree. A wrong combination raises :class:`~chunkmem.InvalidArgumentError` naming ``train_batch_size``
with the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ArgumentTypeError, InvalidArgumentError, check_number

__all__ = ["LOOP_KEYS", "LoopSettings"]

LOOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "steps_per_print", "wall_clock_breakdown", "scheduler")
"""The top-level config keys the engine takes out of a DeepSpeed config before the rest is wrapped (and
``zero_optimization.elastic_checkpoint``, which its ``load_checkpoint`` honours)."""


@dataclass(frozen=True)
class LoopSettings:
    """What the engine's loop does, from a DeepSpeed config (see the module docstring).

    Attributes:
        train_batch_size: samples per optimizer step over all ranks (``None``: not configured, as in the
            ColossalAI form).
        micro_batch: samples per forward on each rank (``train_micro_batch_size_per_gpu``; ``None``: not
            configured).
        accumulation_steps: backwards per optimizer step (``gradient_accumulation_steps``).
        steps_per_print: a progress line every this many optimizer steps (``None``: never).
        wall_clock_breakdown: time the forward, backward and step and print the times with the progress.
        scheduler: the config's ``scheduler`` section (``None``: none).
        elastic_checkpoint: whether the engine's ``load_checkpoint`` loads a sharded checkpoint of another
            world size or chunk layout (``zero_optimization.elastic_checkpoint``; absent: ``True``).
    """

    train_batch_size: int | None
    micro_batch: int | None
    accumulation_steps: int
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    scheduler: dict[str, Any] | None = None
    elastic_checkpoint: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any], world_size: int) -> "LoopSettings":
        """Read the loop keys of ``config`` (a DeepSpeed config dict) for ``world_size`` ranks."""
        given = {key: config.get(key) for key in LOOP_KEYS[:3]}
        for key, value in given.items():
            if value is not None:
                check_number(key, value, low=1, integer=True)
        batch, micro, accumulation = given.values()
        if batch is None and micro is None:
            raise InvalidArgumentError("train_batch_size", None, "train_batch_size or train_micro_batch_size_per_gpu "
                                                                 "(or both) in the config")
        if accumulation is None:
            accumulation = 1 if batch is None or micro is None else batch // (micro * world_size)
        if micro is None:
            micro = batch // (world_size * accumulation)
        if batch is None:
            batch = micro * accumulation * world_size
        if micro < 1 or accumulation < 1 or batch != micro * accumulation * world_size:
            raise InvalidArgumentError(
                "train_batch_size", given["train_batch_size"],
                f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size: {batch} != {micro} * "
                f"{accumulation} * {world_size} (from the config's {', '.join(k for k, v in given.items() if v)})")
        steps_per_print = config.get("steps_per_print")
        if steps_per_print is not None:
            check_number("steps_per_print", steps_per_print, low=1, integer=True)
        breakdown = config.get("wall_clock_breakdown", False)
        if not isinstance(breakdown, bool):
            raise ArgumentTypeError("wall_clock_breakdown", breakdown, "true or false")
        scheduler = config.get("scheduler")
        if scheduler is not None and not isinstance(scheduler, dict):
            raise ArgumentTypeError("scheduler", scheduler, "a dict with 'type' and 'params'")
        zero = config.get("zero_optimization")
        elastic = zero.get("elastic_checkpoint", True) if isinstance(zero, dict) else True
        if not isinstance(elastic, bool):
            raise ArgumentTypeError("zero_optimization.elastic_checkpoint", elastic, "true or false")
        return cls(batch, micro, accumulation, steps_per_print, breakdown, scheduler, elastic)
