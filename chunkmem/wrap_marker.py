"""Which modules a ShardedModelV2 already wraps, so that a module is never wrapped twice.

A wrapped module's parameters are views into its wrapper's chunks and its hooks move those chunks; a
second wrapper over the same module (or over a module that contains it, or one of its submodules)
would re-pack parameters the first one still uses.
"""
from __future__ import annotations

import torch.nn as nn

from .core.errors import InvalidArgumentError

WRAPPED_ATTR = "_chunkmem_wrapped"
"""Set to ``True`` on a wrapped module and on each of its submodules."""


def check_not_wrapped(module: nn.Module) -> None:
    """Raise :class:`InvalidArgumentError` if ``module`` or any of its submodules is already wrapped."""
    for name, sub in module.named_modules():
        if getattr(sub, WRAPPED_ATTR, False):
            which = "it is" if not name else f"its submodule {name!r} is"
            raise InvalidArgumentError("module", type(module).__name__,
                                       f"a module no ShardedModelV2 wraps yet ({which} already wrapped; wrap a "
                                       f"module once and use the wrapper)")


def mark_wrapped(module: nn.Module) -> None:
    """Record that ``module`` and every submodule of it are now wrapped."""
    for sub in module.modules():
        setattr(sub, WRAPPED_ATTR, True)


def mark_unwrapped(module: nn.Module) -> None:
    """Forget that ``module`` was wrapped (``ShardedModelV2.unwrap`` gave it back as a plain module)."""
    for sub in module.modules():
        sub.__dict__.pop(WRAPPED_ATTR, None)
