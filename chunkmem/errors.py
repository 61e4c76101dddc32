"""Exceptions raised by chunkmem, and the helpers that build their messages.

Every error raised at the API boundary names the argument, the value given and what is allowed.
"""
from __future__ import annotations

from typing import Any


class ChunkmemError(Exception):
    """Base class of every error chunkmem raises on purpose."""


class InvalidArgumentError(ChunkmemError, ValueError):
    """An argument of a public call has a value that is not allowed."""

    def __init__(self, argument: str, value: Any, allowed: str) -> None:
        self.argument = argument
        self.value = value
        self.allowed = allowed
        super().__init__(f"{argument}={value!r} is not allowed: expected {allowed}")


class DeviceCapacityError(ChunkmemError, MemoryError):
    """The device tier cannot hold what a step needs within its capacity (bytes)."""


class GradientAccumulationError(ChunkmemError, RuntimeError):
    """Gradients were accumulated over two backward passes while ``reuse_fp16_shard=True``."""


class UnscaledBackwardError(ChunkmemError, RuntimeError):
    """fp16 gradients came from a backward pass that bypassed the loss scaler (``loss.backward()``
    instead of ``optim.backward(loss)``); stepping on them would divide them by the loss scale."""


class UnsupportedOperationError(ChunkmemError, RuntimeError):
    """A ``torch.optim.Optimizer`` operation that a chunked optimizer cannot honour (its chunk layout is
    fixed once attached)."""


def check_type(argument: str, value: Any, expected: type | tuple[type, ...], allowed: str) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is an instance of ``expected``."""
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in _as_tuple(expected)):
        raise InvalidArgumentError(argument, value, allowed)


def check_choice(argument: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InvalidArgumentError(argument, value, "one of " + ", ".join(repr(c) for c in choices))


def check_number(argument: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, integer: bool = False) -> None:
    """Raise :class:`InvalidArgumentError` unless ``value`` is a real number within the bounds."""
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and value != value:  # NaN
        ok = False
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bound_low = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        bound_high = "" if high is None else f"<= {high}"
        bounds = " and ".join(b for b in (bound_low, bound_high) if b)
        kind = "an integer" if integer else "a number"
        raise InvalidArgumentError(argument, value, f"{kind} {bounds}".strip())


def _as_tuple(expected: type | tuple[type, ...]) -> tuple[type, ...]:
    return expected if isinstance(expected, tuple) else (expected,)
