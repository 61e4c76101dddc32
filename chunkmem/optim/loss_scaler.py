"""Dynamic loss scaling for fp16 training."""
from __future__ import annotations

from ..core.errors import InvalidArgumentError, check_number

MIN_SCALE_BOUND = 2.0**-126
"""The smallest loss scale allowed: the smallest normal fp32 number."""
MAX_SCALE_BOUND = 2.0**126
"""The largest loss scale allowed: a scale and its reciprocal (which unscales the gradients) both stay
normal fp32 numbers within [MIN_SCALE_BOUND, MAX_SCALE_BOUND]."""


class DynamicGradScaler:
    """The loss scale of fp16 training and its update rules.

    After an overflowing step the hysteresis count goes up; once ``hysteresis`` overflows have been
    seen since the last growth, every further overflow multiplies the scale by ``backoff_factor`` (not
    below ``min_scale``). After ``growth_interval`` consecutive clean steps the scale is multiplied by
    ``growth_factor`` (not above ``max_scale``) and the hysteresis count starts again. An overflow
    restarts the count of clean steps.

    Every scale the rules can reach lies in [``min_scale``, ``max_scale``], so requiring
    ``2**-126 <= min_scale <= max_scale <= 2**126`` keeps every reachable scale, and its reciprocal,
    finite (and normal) in fp32: no choice of knobs can make the scale infinite and skip every later
    step. All arguments must be finite; ``growth_factor`` > 1, ``backoff_factor`` in (0, 1],
    ``growth_interval`` and ``hysteresis`` integers >= 1, ``initial_scale`` within
    [``min_scale``, ``max_scale``]. A wrong type raises :class:`~chunkmem.ArgumentTypeError`, a value
    out of range :class:`~chunkmem.InvalidArgumentError`.
    """

    def __init__(self, initial_scale: float = 2**32, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32) -> None:
        for name, value in (("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)):
            check_number(name, value, low=MIN_SCALE_BOUND, high=MAX_SCALE_BOUND, finite=True,
                         allowed="a number within [2**-126, 2**126] (scale and 1/scale finite in fp32)")
        check_number("growth_factor", growth_factor, low=1.0, low_open=True, finite=True)
        check_number("backoff_factor", backoff_factor, low=0.0, high=1.0, low_open=True, finite=True)
        check_number("growth_interval", growth_interval, low=1, integer=True)
        check_number("hysteresis", hysteresis, low=1, integer=True)
        if min_scale > max_scale:
            raise InvalidArgumentError("min_scale", min_scale, f"<= max_scale ({max_scale})")
        if not min_scale <= initial_scale <= max_scale:
            raise InvalidArgumentError("initial_scale", initial_scale, f"within [min_scale, max_scale] = "
                                                                       f"[{min_scale}, {max_scale}]")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.overflows_since_growth = 0
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        """Apply the rules after one step that did (``overflow``) or did not see inf/NaN gradients."""
        if overflow:
            self.clean_steps = 0
            self.overflows_since_growth += 1
            if self.overflows_since_growth >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:  # >=: a loaded count may exceed a smaller interval
                self.clean_steps = 0
                self.overflows_since_growth = 0
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "overflows_since_growth": self.overflows_since_growth,
                "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.overflows_since_growth = int(state["overflows_since_growth"])
        self.clean_steps = int(state["clean_steps"])
