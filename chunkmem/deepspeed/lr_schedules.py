"""The learning-rate schedules a DeepSpeed config's ``scheduler`` section names: ``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR`` and ``OneCycle``, with DeepSpeed's formulas, defaults and state.

Each is stepped once per optimizer step (the engine steps it at each gradient-accumulation boundary
whose step was applied) and writes the learning rate of every param group of the optimizer it was
built over (any object with ``param_groups``: a torch optimizer, :class:`~chunkmem.ShardedOptimizerV2`,
:class:`~chunkmem.LowLevelZeroOptimizer`). ``last_batch_iteration`` counts the steps taken (-1: none);
building one at -1 sets the first learning rate at once, as DeepSpeed does. Their ``state_dict()`` is
``{"last_batch_iteration": n}``, DeepSpeed's, so checkpoints carry over.

The formulas, with ``t = last_batch_iteration`` and ``W = max(2, warmup_num_steps)``:

* warm-up factor ``g(t)``: ``log(t + 1) / log(W)`` (``warmup_type="log"``) or ``t / W`` (``"linear"``)
  while ``t < W``, else 1 (before the first step, ``t = -1``, the learning rate is the minimum);
* ``WarmupLR``: ``min_lr + (max_lr - min_lr) * g(t)`` (``warmup_max_lr`` defaults to the group's lr);
* ``WarmupDecayLR``: the same during warm-up, then ``(max_lr - min_lr) * max(0, (T - t) / max(1, T - W))``
  above ``min_lr`` (``T = total_num_steps``);
* ``WarmupCosineLR``: the group's initial lr times a ratio: ``min_ratio + (1 - min_ratio) * g(t)`` during
  warm-up, then ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (t - W + 1) / max(1, T - W))``; 0 before the first step;
* ``OneCycle``: a triangle between ``cycle_min_lr`` and ``cycle_max_lr`` over ``cycle_first_step_size``
  up and ``cycle_second_step_size`` down (optionally in stairs), then ``cycle_min_lr / (1 + decay_lr_rate
  * k / decay_step_size)`` for the k-th step after the cycle; with ``cycle_momentum`` the first beta
  cycles the other way between ``cycle_max_mom`` and ``cycle_min_mom`` (the second beta is set to 0.99).
"""
from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..errors import ArgumentTypeError, InvalidArgumentError, check_number

__all__ = ["OneCycle", "SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "schedule_from_config"]

_WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: Any, value: Any, name: str) -> list[float]:
    """One value per param group: a number broadcast, or a list/tuple with one per group."""
    groups = len(optimizer.param_groups)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * groups
    if len(values) != groups:
        raise InvalidArgumentError(name, value, f"a number or a list of {groups} numbers (one per param group)")
    for v in values:
        check_number(name, v, allowed="a number or a list of numbers, one per param group")
    return [float(v) for v in values]


def _set_lrs(optimizer: Any, lrs: Sequence[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """What the four schedules share: the step counter, ``step``, ``get_last_lr`` and the state dict."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:  # pragma: no cover - every schedule defines it
        raise NotImplementedError

    def _after_step(self) -> None:
        """What a schedule sets beside the learning rate (OneCycle's momentum)."""

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next step) and set every group's lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        check_number("last_batch_iteration", last_batch_iteration, low=-1, integer=True)
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())
        self._after_step()

    def get_last_lr(self) -> list[float]:
        """The learning rates the last :meth:`step` (or the construction) set, one per param group."""
        if self._last_lr is None:
            raise InvalidArgumentError("get_last_lr", None, "a call after the first step()")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the step count of :meth:`state_dict` (the learning rates are set at the next step)."""
        if not isinstance(state_dict, dict) or "last_batch_iteration" not in state_dict:
            raise InvalidArgumentError("state_dict", state_dict, "a dict with 'last_batch_iteration'")
        check_number("state_dict['last_batch_iteration']", state_dict["last_batch_iteration"], low=-1, integer=True)
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])


class _Warmup(_Schedule):
    def _init_warmup(self, optimizer: Any, warmup_num_steps: int, warmup_type: str,
                     last_batch_iteration: int) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise ArgumentTypeError("optimizer", type(optimizer).__name__, "an optimizer (an object with param_groups)")
        check_number("warmup_num_steps", warmup_num_steps, low=1, integer=True)
        if warmup_type not in _WARMUP_TYPES:
            raise InvalidArgumentError("warmup_type", warmup_type, "'log' or 'linear'")
        check_number("last_batch_iteration", last_batch_iteration, low=-1, integer=True)
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.last_batch_iteration = int(last_batch_iteration)

    def _warmup_factor(self) -> float:
        """``g(t)`` of the module docstring (1 once the warm-up is over)."""
        t = self.last_batch_iteration
        if t >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps


class WarmupLR(_Warmup):
    """Raise the lr from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps (log or
    linear), then hold it (DeepSpeed's ``WarmupLR``; formulas in the module docstring).

    Args:
        optimizer: whose param groups' ``lr`` it sets.
        warmup_min_lr, warmup_max_lr: a number or one per param group (``warmup_max_lr=None``: each
            group's lr when the schedule is built).
        warmup_num_steps: steps of the warm-up (at least 2 are used).
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the steps already taken (-1: start; the lr is set to the minimum now).
    """

    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self._init_warmup(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.get_lr())

    def _gamma(self) -> float:
        return self._warmup_factor()

    def get_lr(self) -> list[float]:
        """The learning rates at ``last_batch_iteration``, one per param group."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay back to ``warmup_min_lr`` at ``total_num_steps``
    (DeepSpeed's ``WarmupDecayLR``; here ``warmup_max_lr`` defaults to 0.001, as there)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        check_number("total_num_steps", total_num_steps, low=1, integer=True)
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{self.warmup_num_steps}", stacklevel=2)

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return self._warmup_factor()
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Warmup):
    """Scale each group's initial lr by a ratio rising from ``warmup_min_ratio`` to 1 over the warm-up,
    then falling along a half cosine to ``cos_min_ratio`` at ``total_num_steps`` (DeepSpeed's
    ``WarmupCosineLR``; formulas in the module docstring)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self._init_warmup(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        check_number("total_num_steps", total_num_steps, low=1, integer=True)
        check_number("warmup_min_ratio", warmup_min_ratio)
        check_number("cos_min_ratio", cos_min_ratio)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{self.warmup_num_steps}", stacklevel=2)
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The ratio applied to each group's initial lr at ``last_batch_iteration``."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_factor() * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """DeepSpeed's ``OneCycle``: the lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` and back over one
    cycle, then decays; with ``cycle_momentum`` (and optimizers with ``betas``) the first beta moves the
    other way. Arguments and defaults are DeepSpeed's (module docstring)."""

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise ArgumentTypeError("optimizer", type(optimizer).__name__, "an optimizer (an object with param_groups)")
        check_number("cycle_first_step_size", cycle_first_step_size, low=0, low_open=True)
        if cycle_second_step_size is not None:
            check_number("cycle_second_step_size", cycle_second_step_size, low=0)
        for name, value in (("cycle_first_stair_count", cycle_first_stair_count), ("decay_step_size", decay_step_size)):
            check_number(name, value, low=0, integer=True)
        check_number("last_batch_iteration", last_batch_iteration, low=-1, integer=True)
        if cycle_second_stair_count is not None:
            check_number("cycle_second_stair_count", cycle_second_stair_count, low=0, integer=True)
        check_number("decay_lr_rate", decay_lr_rate)
        check_number("decay_mom_rate", decay_mom_rate)
        if not isinstance(cycle_momentum, bool):
            raise ArgumentTypeError("cycle_momentum", cycle_momentum, "True or False")
        self.optimizer = optimizer
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (self.first_step_size if cycle_second_step_size is None
                                 else float(cycle_second_step_size))
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else int(cycle_second_stair_count))
        self.decay_step_size = int(decay_step_size)
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.cycle_momentum = cycle_momentum and all("betas" in group for group in optimizer.param_groups)
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"OneCycle: cycle_momentum is off: the param groups of {type(optimizer).__name__} have no "
                          "'betas'", stacklevel=2)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.last_batch_iteration = int(last_batch_iteration)
        if self.last_batch_iteration == -1:
            _set_lrs(optimizer, self.min_lrs)
            if self.cycle_momentum:
                self._set_first_betas(self.min_moms)

    def _set_first_betas(self, values: Sequence[float]) -> None:
        for group, beta1 in zip(self.optimizer.param_groups, values):
            group["betas"] = (beta1, 0.99)

    def _scale(self) -> float:
        """Where in the cycle the next batch is: 0 at ``cycle_min_lr``, 1 at ``cycle_max_lr``."""
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:  # from the integer position, so a boundary never lands a stair low
            position = batch % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_factor(self, rate: float) -> float:
        k = self.last_batch_iteration - self.total_size + 1
        return 1 + rate * k / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The learning rates at ``last_batch_iteration``, one per param group."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        return [low / self._decay_factor(self.decay_lr_rate) for low in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` at ``last_batch_iteration`` (``None`` without momentum cycling)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(high - (high - low) * scale, 0.99) for low, high in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return [(high, 0.99) for high in self.max_moms]
        return [(high * self._decay_factor(self.decay_mom_rate), 0.99) for high in self.max_moms]

    def _after_step(self) -> None:
        moms = self.get_mom()
        if moms is not None:
            self._set_first_betas([beta1 for beta1, _ in moms])


SCHEDULES: dict[str, type] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
                              "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle}
"""The ``scheduler.type`` names a config may give, and their classes."""


def schedule_from_config(section: dict[str, Any], optimizer: Any) -> Any:
    """The schedule a DeepSpeed ``scheduler`` section describes (``{"type": name, "params": {...}}``),
    built over ``optimizer``: one of :data:`SCHEDULES`, or (as DeepSpeed does) a class of
    ``torch.optim.lr_scheduler`` by name (over a LowLevelZeroOptimizer's wrapped torch optimizer, whose
    groups it reads); a missing or unknown type or parameter raises
    :class:`~chunkmem.InvalidArgumentError` naming ``scheduler.type`` / ``scheduler.params.<name>``."""
    if not isinstance(section, dict):
        raise ArgumentTypeError("scheduler", section, "a dict with 'type' and 'params'")
    unknown = sorted(set(section) - {"type", "params"})
    if unknown:
        raise InvalidArgumentError(f"scheduler.{unknown[0]}", section[unknown[0]], "a key 'type' or 'params'")
    kind = section.get("type")
    schedule = SCHEDULES.get(kind) if isinstance(kind, str) else None
    torch_schedule = getattr(torch.optim.lr_scheduler, kind, None) if isinstance(kind, str) else None
    if schedule is None and isinstance(torch_schedule, type) and issubclass(torch_schedule, LRScheduler):
        schedule = torch_schedule
        if not isinstance(optimizer, torch.optim.Optimizer):  # LowLevelZeroOptimizer: its torch optimizer's groups
            optimizer = optimizer.optim
    if schedule is None:
        raise InvalidArgumentError("scheduler.type", kind, "one of " + ", ".join(repr(k) for k in SCHEDULES)
                                   + ", or the name of a torch.optim.lr_scheduler class such as 'StepLR'")
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ArgumentTypeError("scheduler.params", params, "a dict of the schedule's arguments")
    accepted = set(inspect.signature(schedule).parameters) - {"optimizer"}
    for key in params:
        if key not in accepted:
            raise InvalidArgumentError(f"scheduler.params.{key}", params[key],
                                       f"an argument of {kind}: " + ", ".join(sorted(accepted)))
    try:
        return schedule(optimizer, **params)
    except InvalidArgumentError as e:
        raise type(e)(f"scheduler.params.{e.argument}", e.value, e.allowed) from e
    except (TypeError, ValueError) as e:  # a required argument missing (total_num_steps, ...), a torch refusal
        raise InvalidArgumentError("scheduler.params", params, f"the arguments {kind} requires ({e})") from e
