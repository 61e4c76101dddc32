"""How a :class:`~chunkmem.ShardedModelV2` passes for the module it wraps, where code that calls a model
looks: its ``forward`` shows the module's signature, and in 16-bit mode it takes and returns what the module
would (floating-point inputs cast to the model's dtype on the compute device, floating-point outputs back
to fp32). (Attributes the wrapper lacks come from the module: ``ShardedModelV2.__getattr__``.)

Libraries choose what to pass a model by ``inspect.signature(model.forward)`` (Hugging Face ``Trainer`` drops
every dataset column the forward does not name) and find the label names, and whether the model returns a
loss, on its class: :func:`show_forward_signature` puts the module's signature on both.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map


def show_forward_signature(model: nn.Module, module: nn.Module) -> None:
    """Make ``inspect.signature(model.forward)`` ``module.forward``'s, on the instance and on its class
    (``type(model).forward``, with ``self``): the model's class becomes a subclass of its own, under the same
    name, whose ``forward`` calls the class's. A forward ``inspect`` cannot read (a builtin) keeps
    ``(*args, **kwargs)``."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return
    base = type(model)

    def forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return base.forward(model, *args, **kwargs)

    forward.__doc__ = base.forward.__doc__
    forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                    *signature.parameters.values()])
    model.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                    "__qualname__": base.__qualname__})


def cast_inputs(inputs: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``inputs`` (any nesting) with every tensor on ``device``, the floating-point ones in ``dtype`` unless
    it is fp32."""
    def cast(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point() and dtype != torch.float32:
            return value.to(device=device, dtype=dtype)
        return value.to(device)
    return tree_map(cast, inputs)


def cast_outputs(output: Any, dtype: torch.dtype) -> Any:
    """``output`` with its floating-point tensors in fp32 when the model computes in ``dtype`` (16-bit)."""
    if dtype == torch.float32:
        return output
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
