"""Reading a configuration: a dict as it is or a JSON file, and the checks every section of it goes
through. An error names the key path (``zero_optimization.offload_param.device``) and the allowed values
(:class:`~chunkmem.InvalidArgumentError`, or its subclass :class:`~chunkmem.ArgumentTypeError` for a value of
the wrong type); a key chunkmem accepts but that changes nothing warns with :class:`~chunkmem.NoEffectWarning`."""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable

from ..errors import ArgumentTypeError, InvalidArgumentError, NoEffectWarning, check_number

__all__ = ["check_bool", "check_count", "check_keys", "get_section", "listing", "no_effect", "read_config",
           "rename_errors"]


def read_config(config: Any) -> dict[str, Any]:
    """``config`` as a dict: a dict as it is, a path read as JSON (errors name ``config``)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except OSError as e:
            raise InvalidArgumentError("config", os.fspath(config), f"a readable JSON file ({e.strerror})") from e
        except json.JSONDecodeError as e:
            raise InvalidArgumentError("config", os.fspath(config), f"a valid JSON file ({e})") from e
    if not isinstance(config, dict):
        raise ArgumentTypeError("config", type(config).__name__, "a dict or the path of a JSON file")
    return config


def listing(keys: Any) -> str:
    """``keys`` for an error's allowed values: ``one of 'a', 'b'``, sorted."""
    return "one of " + ", ".join(repr(k) for k in sorted(keys))


def get_section(parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    """``parent[key]``, a dict (absent or null: ``{}``; errors name ``path``)."""
    value = parent.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArgumentTypeError(path, value, "a dict (a JSON object)")
    return value


def check_keys(section: dict[str, Any], allowed: set[str], path: str) -> None:
    """Refuse a key of ``section`` (at ``path``) that is not in ``allowed``."""
    for key in section:
        if key not in allowed:
            raise InvalidArgumentError(f"{path}.{key}" if path else key, section[key], "a key " + listing(allowed))


def check_bool(value: Any, path: str) -> bool:
    """``value`` when it is a bool (errors name ``path``)."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(path, value, "true or false")
    return value


def check_count(path: str, value: Any, unit: str, zero_allowed: bool = False) -> int:
    """``value`` as an int > 0 (``zero_allowed``: >= 0); an integral float (``5e8``, as DeepSpeed's
    documentation writes sizes) is taken as that integer."""
    bound = ">= 0" if zero_allowed else "> 0"
    allowed = f"an integer {bound} ({unit}; an integral float such as 5e8 is taken as that integer)"
    check_number(path, value, low=0, low_open=not zero_allowed, allowed=allowed)
    if isinstance(value, float) and not value.is_integer():  # NaN and infinities are not integers either
        raise InvalidArgumentError(path, value, allowed)
    return int(value)


def no_effect(path: str, why: str) -> None:
    """Warn that config key ``path`` has no effect here (``why``). The warning is attributed five frames up:
    the reading functions are called through one entry point of :mod:`chunkmem.configs.deepspeed`
    (``parse``, ``stage3_settings``, ``stages_1_and_2_arguments``) from :func:`chunkmem.initialize`'s
    DeepSpeed branch, so a loop key's warning points at the caller of :func:`chunkmem.initialize`."""
    warnings.warn(f"config key {path} has no effect in chunkmem: {why}", NoEffectWarning, stacklevel=5)


def rename_errors(prefix: str, build: Callable[[], Any], keys: dict[str, str] | None = None) -> Any:
    """Run ``build``; an argument error names the config key (``keys[argument]``, else ``prefix`` +
    argument)."""
    try:
        return build()
    except InvalidArgumentError as e:
        raise type(e)((keys or {}).get(e.argument, f"{prefix}{e.argument}"), e.value, e.allowed) from e
