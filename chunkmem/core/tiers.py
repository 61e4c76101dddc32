"""Memory tiers: the logical places a chunk can live, and what they map to physically.

A chunk's buffers live in a :class:`Tier`. ``Tier.DEVICE`` is the compute device: the current CUDA
device when CUDA is available, otherwise the CPU under an explicit capacity. ``Tier.HOST`` is CPU
memory: with CUDA the parameter shards and gradients resting there are pinned at their exact sizes under a
budget (:mod:`chunkmem.core.pinned`), the rest pageable. Moving a buffer between tiers is always a copy into a newly
allocated buffer, also when both tiers are the CPU, so the same code path runs with and without a GPU.
"""
from __future__ import annotations

import enum
import math
import numbers
import os
import re
from fractions import Fraction

import psutil
import torch

from ..errors import ArgumentTypeError, InvalidArgumentError

DEVICE_MEMORY_ENV = "CHUNKMEM_DEVICE_MEMORY"
HOST_MEMORY_ENV = "CHUNKMEM_HOST_MEMORY"

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_capacity_override: int | None = None
_host_capacity_override: int | None = None


class Tier(str, enum.Enum):
    """A logical memory tier. ``DEVICE`` computes; ``HOST`` holds what does not fit; ``DISK`` (files under
    the model's ``nvme_path``, see :mod:`chunkmem.core.disk_tier`) holds what does not fit in the host."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


def parse_size(text: str | int, argument: str = "size", minimum: int = 0) -> int:
    """Parse a byte count such as ``1048576``, ``"512MiB"`` or ``"2GB"`` into bytes.

    Units: B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (powers of 1024), case-insensitive. The
    result must be a whole number of bytes (``"1.5KB"`` is 1500 bytes; ``"1.5B"`` and ``"0.5B"`` are
    refused), at least ``minimum``. A float is taken only when it is a whole number (``1e9``).
    Raises :class:`ArgumentTypeError` for a value that is neither a str nor a number, else
    :class:`InvalidArgumentError`, naming ``argument``.
    """
    allowed = (f"a whole number of bytes >= {minimum}, as an int or a size such as '2GiB' (units B, KB, MB, "
               f"GB, TB, KiB, MiB, GiB, TiB)")
    if isinstance(text, bool) or not isinstance(text, (str, numbers.Real)):
        raise ArgumentTypeError(argument, text, allowed)
    if isinstance(text, numbers.Integral):
        nbytes = int(text)
    elif isinstance(text, numbers.Real):
        if not (math.isfinite(text) and float(text).is_integer()):
            raise InvalidArgumentError(argument, text, allowed)
        nbytes = int(text)
    else:
        match = _SIZE_RE.match(text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidArgumentError(argument, text, allowed)
        exact = Fraction(match.group(1)) * _UNITS[unit]
        if exact.denominator != 1:
            raise InvalidArgumentError(argument, text, allowed + f" (it is {float(exact)} bytes)")
        nbytes = int(exact)
    if nbytes < minimum:
        raise InvalidArgumentError(argument, text, allowed)
    return nbytes


def set_device_memory_capacity(nbytes: int | str | None) -> None:
    """Set the capacity of the device tier in bytes: a positive whole number, as an int or a size such
    as ``"2GiB"`` (see :func:`parse_size`). A refused value leaves the capacity as it was.

    ``None`` restores the default: the environment variable ``CHUNKMEM_DEVICE_MEMORY`` if set, else
    the free CUDA memory when CUDA is available, else the available host memory psutil reports.
    Takes effect for models wrapped afterwards.
    """
    global _capacity_override
    _capacity_override = None if nbytes is None else parse_size(nbytes, "nbytes", minimum=1)


def device_memory_capacity_setting() -> int | None:
    """What :func:`set_device_memory_capacity` set (bytes), or ``None`` when the default rule applies (to
    put a caller's setting back after changing it for a while)."""
    return _capacity_override


def device_memory_capacity() -> int:
    """The capacity of the device tier in bytes, as set by :func:`set_device_memory_capacity`."""
    if _capacity_override is not None:
        return _capacity_override
    env = os.environ.get(DEVICE_MEMORY_ENV)
    if env:
        return parse_size(env, DEVICE_MEMORY_ENV, minimum=1)
    if torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    return host_memory_available()


def host_memory_available() -> int:
    """Bytes of memory the system can give this process now without swapping (psutil's ``available``)."""
    return int(psutil.virtual_memory().available)


def set_host_memory_capacity(nbytes: int | str | None) -> None:
    """Set the capacity of the host tier in bytes (a positive whole number, or a size such as
    ``"12GiB"``): what chunk buffers and the disk tier's I/O buffers may occupy in host memory. A refused
    value leaves the capacity as it was. ``None`` restores the default: ``CHUNKMEM_HOST_MEMORY`` if set,
    else no bound. Takes effect for models wrapped afterwards."""
    global _host_capacity_override
    _host_capacity_override = None if nbytes is None else parse_size(nbytes, "nbytes", minimum=1)


def host_memory_capacity() -> int | None:
    """The capacity of the host tier in bytes, or ``None`` for no bound (see
    :func:`set_host_memory_capacity`)."""
    if _host_capacity_override is not None:
        return _host_capacity_override
    env = os.environ.get(HOST_MEMORY_ENV)
    if env:
        return parse_size(env, HOST_MEMORY_ENV, minimum=1)
    return None


def device_of_tier(tier: Tier) -> torch.device:
    """The ``torch.device`` a tier maps to on this machine."""
    if tier is Tier.DEVICE and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tier_of_device(device: torch.device | str | int | None, argument: str = "target_device") -> Tier:
    """The tier a user-facing ``torch.device`` names: CUDA devices are the device tier, the CPU the host."""
    if device is None:
        return Tier.DEVICE
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(argument, device, "a torch.device, 'cpu', 'cuda' or a CUDA index") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(argument, device, "'cpu' (CUDA is not available on this machine)")
        return Tier.DEVICE
    if dev.type == "cpu":
        return Tier.HOST
    raise InvalidArgumentError(argument, device, "a CPU or CUDA device")


def pin_host_memory() -> bool:
    """Whether host memory is pinned for copies to and from the device (only when CUDA is available: the
    parameter shards and gradients on the host, see :mod:`chunkmem.core.pinned`)."""
    return torch.cuda.is_available()


def empty_on_tier(tier: Tier, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialised flat buffer of ``numel`` elements on ``tier`` (the device or the host)."""
    if tier is Tier.DISK:
        raise ValueError("internal error: disk-tier buffers are file regions, not tensors")
    if tier is Tier.HOST:
        return torch.empty(numel, dtype=dtype, device="cpu")
    return torch.empty(numel, dtype=dtype, device=device_of_tier(Tier.DEVICE))
