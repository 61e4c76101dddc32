"""Dynamic loss scaling for fp16 training."""
from __future__ import annotations

from dataclasses import asdict

from ..settings import ScalerSettings


class DynamicGradScaler:
    """The loss scale of fp16 training and its update rules.

    After an overflowing step the hysteresis count goes up; once ``hysteresis`` overflows have been
    seen since the last growth, every further overflow multiplies the scale by ``backoff_factor`` (not
    below ``min_scale``). After ``growth_interval`` consecutive clean steps the scale is multiplied by
    ``growth_factor`` (not above ``max_scale``) and the hysteresis count starts again. An overflow
    restarts the count of clean steps.

    The rules are checked as :class:`~chunkmem.settings.ScalerSettings` checks them (every reachable
    scale and its reciprocal stay finite in fp32). A wrong type raises :class:`~chunkmem.ArgumentTypeError`,
    a value out of range :class:`~chunkmem.InvalidArgumentError`.
    """

    def __init__(self, initial_scale: float = 2**32, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32) -> None:
        ScalerSettings(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                       max_scale)
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.overflows_since_growth = 0
        self.clean_steps = 0

    @staticmethod
    def from_settings(rules: ScalerSettings) -> "DynamicGradScaler":
        """A new scaler with ``rules``."""
        return DynamicGradScaler(**asdict(rules))

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
