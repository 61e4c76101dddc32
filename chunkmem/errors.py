"""Exceptions raised by chunkmem, and the helpers that build their messages.

Every error raised at the API boundary names the argument, the value given and what is allowed. A value
of the wrong type raises :class:`ArgumentTypeError` (a ``TypeError``); a value of the right type that is
not allowed raises :class:`InvalidArgumentError` (a ``ValueError``). ``ArgumentTypeError`` is also an
``InvalidArgumentError``, so ``except InvalidArgumentError`` catches both.
"""
from __future__ import annotations

import enum
import errno as errno_codes
import math
import os
import warnings
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


class DiskStepError(ChunkmemError, RuntimeError):
    """An optimizer step over disk-resident state failed. ``undone`` says whether the state is as it
    was before the step (``atomic_step``); ``cause`` is the I/O error (``None`` on a rank that undid
    its step because another rank failed)."""

    def __init__(self, message: str, undone: bool, cause: DiskIOError | None) -> None:
        super().__init__(message)
        self.undone = undone
        self.cause = cause


class NoEffectWarning(UserWarning):
    """A configuration key was accepted but changes nothing in chunkmem (the message names it)."""


class DiskIOError(ChunkmemError, OSError):
    """A read or write of the disk tier failed.

    ``path``: the file; ``what``: what was being moved (e.g. ``"chunk3.exp_avg"``, or the file's name
    for ``"create"``); ``operation``: ``"read"``, ``"write"`` or ``"create"``; ``errno``: the system
    error number, or ``None`` for a short read; ``cause``: the errno's text or
    ``"short read: got N of M bytes"``.
    """

    def __init__(self, path: str, what: str, operation: str, cause: str, errno: int | None = None) -> None:
        super().__init__(f"disk tier {operation} of {what} failed on {path!r}: {cause}")
        self.path = path
        self.what = what
        self.operation = operation
        self.cause = cause
        self.errno = errno
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.what, self.operation, self.cause, self.errno)

    @classmethod
    def from_os_error(cls, path: str, what: str, operation: str, error: OSError) -> "DiskIOError":
        """The :class:`DiskIOError` for ``error`` raised by a system call on ``path``."""
        code = error.errno
        text = os.strerror(code) if code is not None else str(error)
        cause = f"{text} (errno {errno_codes.errorcode.get(code, code)})" if code is not None else text
        return cls(path, what, operation, cause, code)


class LayoutMismatchError(ChunkmemError, RuntimeError):
    """The ranks of a data-parallel group hold different models or settings. Raised on every rank with
    the same message, which names each setting and the first parameters that differ, rank by rank."""


class StepMismatchError(LayoutMismatchError):
    """The ranks of a data-parallel group reached different points of training (one skipped or repeated
    ``step()``, a forward or a backward; one called ``clip_grad_norm`` and another did not) or hold
    different per-step values (the loss scale, the clipping). Raised on every rank, at the first point
    where they differ, before any collective of that point pairs mismatched data."""


class CollectiveError(ChunkmemError, RuntimeError):
    """A collective over the data-parallel group failed on this rank: ``collective`` (e.g.
    ``"all_gather"``), ``what`` it moved, this process's ``rank`` in the group of ``world`` ranks."""

    def __init__(self, message: str, collective: str, what: str, rank: int, world: int) -> None:
        super().__init__(message)
        self.collective = collective
        self.what = what
        self.rank = rank
        self.world = world


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within :func:`collective_timeout` seconds (``timeout``; this rank
    ``waited`` seconds): some rank of the group never joined it. The process group is unusable
    afterwards; end the processes."""

    def __init__(self, message: str, collective: str, what: str, rank: int, world: int, timeout: float,
                 waited: float) -> None:
        super().__init__(message, collective, what, rank, world)
        self.timeout = timeout
        self.waited = waited


class ChunkStateError(ChunkmemError, RuntimeError):
    """Internal error: a chunk buffer was asked for a transition its current state does not allow."""

    def __init__(self, what: str, action: str, state: enum.Enum, allowed: tuple[enum.Enum, ...], rank: int) -> None:
        self.what = what
        self.action = action
        self.state = state
        self.allowed = allowed
        self.rank = rank
        names = ", ".join(s.name for s in allowed)
        super().__init__(f"internal error on rank {rank}: {what} is {state.name}; {action} needs one of {names}")


class ParameterAccessError(UnsupportedOperationError):
    """A use of a chunk-managed parameter (or a conversion of the model) that chunkmem cannot serve
    correctly; the message names the parameter and the documented way."""


class LedgerError(ChunkmemError, RuntimeError):
    """Internal error: the ledger was asked to release bytes it never reserved."""


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


_RENAMED_WARNED: set[str] = set()


def warn_renamed(old: str, new: str) -> None:
    """A ``FutureWarning`` that ``old`` (a public name) is now ``new``, the first time ``old`` is used in
    the process; the old name keeps working."""
    if old in _RENAMED_WARNED:
        return
    _RENAMED_WARNED.add(old)
    warnings.warn(f"{old} is renamed {new}; the old name will be removed", FutureWarning, stacklevel=3)
