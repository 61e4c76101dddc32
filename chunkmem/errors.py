"""Exceptions raised by chunkmem, and the helpers that build their messages.

Every error raised at the API boundary names the argument, the value given and what is allowed. A value
of the wrong type raises :class:`ArgumentTypeError` (a ``TypeError``); a value of the right type that is
not allowed raises :class:`InvalidArgumentError` (a ``ValueError``). ``ArgumentTypeError`` is also an
``InvalidArgumentError``, so ``except InvalidArgumentError`` catches both.
"""
from __future__ import annotations

import math
from typing import Any


class ChunkmemError(Exception):
    """Base class of every error chunkmem raises on purpose."""


class InvalidArgumentError(ChunkmemError, ValueError):
    """An argument of a public call has a value that is not allowed."""

    def __init__(self, argument: str, value: Any, allowed: str) -> None:
        self.argument = argument
        self.value = value
        self.allowed = allowed
        super().__init__(f"{argument}={_shown(value)} is not allowed: expected {allowed}")


def _shown(value: Any, limit: int = 200) -> str:
    """``repr(value)``, or for a long one (a module's repr runs to pages) its type and the repr's start."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"<{type(value).__name__}: {text[:limit].splitlines()[0][:limit]}...>"


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of a public call has a type that is not allowed (a ``TypeError``; for compatibility
    also an :class:`InvalidArgumentError`)."""


class DeviceCapacityError(ChunkmemError, MemoryError):
    """The device tier cannot hold what a step needs within its capacity (bytes)."""


class HostCapacityError(ChunkmemError, MemoryError):
    """The host tier cannot hold what was asked of it under its capacity (``CHUNKMEM_HOST_MEMORY`` or
    :func:`~chunkmem.set_host_memory_capacity`); rest more state on the disk tier or raise the capacity."""


class GradientAccumulationError(ChunkmemError, RuntimeError):
    """Gradients were accumulated over two backward passes while ``reuse_fp16_shard=True``."""


class UnscaledBackwardError(ChunkmemError, RuntimeError):
    """fp16 gradients came from a backward pass that bypassed the loss scaler (``loss.backward()``
    instead of ``optim.backward(loss)``); stepping on them would divide them by the loss scale."""


class UnsupportedOperationError(ChunkmemError, RuntimeError):
    """A ``torch.optim.Optimizer`` operation that a chunked optimizer cannot honour (its chunk layout is
    fixed once attached)."""


class CheckpointError(ChunkmemError, RuntimeError):
    """A state dict or checkpoint cannot be taken or restored in the current state of training (the
    parameters' memory holds gradients), or another rank failed its part of a checkpoint."""


def check_type(argument: str, value: Any, expected: type | tuple[type, ...], allowed: str) -> None:
    """Raise :class:`ArgumentTypeError` unless ``value`` is an instance of ``expected`` (a ``bool`` only
    where ``bool`` is expected itself)."""
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in _as_tuple(expected)):
        raise ArgumentTypeError(argument, value, allowed)


def check_choice(argument: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise unless ``value`` is one of ``choices``: :class:`ArgumentTypeError` when its type is none of
    the choices' types, else :class:`InvalidArgumentError`."""
    allowed = "one of " + ", ".join(repr(c) for c in choices)
    if not any(isinstance(value, type(c)) for c in choices):
        raise ArgumentTypeError(argument, value, allowed)
    if value not in choices:
        raise InvalidArgumentError(argument, value, allowed)


def check_number(argument: str, value: Any, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, integer: bool = False, finite: bool = False,
                 allowed: str | None = None) -> None:
    """Raise unless ``value`` is a real number within the bounds.

    A value that is not an ``int`` (``integer=True``) or an ``int``/``float`` (a ``bool`` is neither)
    raises :class:`ArgumentTypeError`; NaN, a value outside the bounds and, with ``finite=True``, an
    infinity raise :class:`InvalidArgumentError`. ``allowed`` replaces the generated description of
    what is allowed in the message.
    """
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    bound_low = "" if low is None else (f"> {low}" if low_open else f">= {low}")
    bound_high = "" if high is None else f"<= {high}"
    bounds = " and ".join(b for b in (bound_low, bound_high) if b)
    kind = "an integer" if integer else ("a finite number" if finite else "a number")
    allowed = allowed or f"{kind} {bounds}".strip()
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise ArgumentTypeError(argument, value, allowed)
    ok = value == value  # not NaN
    if ok and finite and isinstance(value, float):
        ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise InvalidArgumentError(argument, value, allowed)


def _as_tuple(expected: type | tuple[type, ...]) -> tuple[type, ...]:
    return expected if isinstance(expected, tuple) else (expected,)
