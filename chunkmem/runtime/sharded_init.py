"""Writes into already-sharded parameters while a model is still being built.

Inside ``ZeroInitContext(shard_param=True)`` over several ranks, a module's parameters are sharded
as soon as its ``__init__`` returns: each rank keeps its part of the chunk, and the parameter is a
view into the chunk's full device copy, which is not allocated. A parent module's ``__init__`` often
initialises its children's parameters afterwards (``self.apply(init_weights)`` with ``nn.init``);
:class:`ShardedParamWrites` makes that work and give the values a single process would.

It sees every torch function while the context is open. A call that takes a parameter of a sharded
chunk runs instead on a full temporary of that parameter (its current values, gathered from the
ranks, unless the call overwrites every element, such as ``nn.init.normal_``); a call that modifies
its argument then writes this rank's part of the temporary back into the shard. A temporary has the
parameter's shape and dtype, so random initialisers draw exactly what they would draw on one process.
Every rank runs the same construction code, so the gathers line up. ``param.data`` gives the parameter
itself while the context is open, so ``module.weight.data.normal_()`` is seen too; other attribute
reads (``shape``, ``dtype``) need no values and pass through.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from ..core.chunk import ParamSlot
from ..core.param_guard import slot_of

# Tensor methods that overwrite every element, so the temporary needs no gathered values.
_OVERWRITING_METHODS = frozenset({
    "normal_", "uniform_", "zero_", "fill_", "random_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_"})


def _sharded_slot(value: Any) -> ParamSlot | None:
    slot = slot_of(value) if isinstance(value, torch.nn.Parameter) else None
    return slot if slot is not None and slot.chunk.param.sharded else None


def _target(args: tuple, kwargs: dict) -> Any:
    """The tensor a call acts on: its first argument (``nn.init`` functions pass it as ``tensor=``)."""
    if args:
        return args[0]
    return next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)


def _attribute_read(func: Any) -> str | None:
    """The attribute name when ``func`` reads a tensor attribute (a descriptor's ``__get__``)."""
    if getattr(func, "__name__", "") != "__get__":
        return None
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _modifies_target(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (getattr(func, "__module__", "") == "torch.nn.init"
            or name == "__setitem__" or (name.endswith("_") and not name.startswith("_")))


def _overwrites(func: Any) -> bool:
    return (getattr(func, "__module__", "") == "torch.nn.init"
            or getattr(func, "__name__", "") in _OVERWRITING_METHODS)


class ShardedParamWrites(TorchFunctionMode):
    """See the module docstring. Active only while a sharded ``ZeroInitContext`` is open.
    ``before_gather`` (if given) is called with the slot before each gather (the ranks' agreement,
    see :mod:`chunkmem.distributed.agreement`)."""

    def __init__(self, before_gather: Callable[[ParamSlot], None] | None = None) -> None:
        super().__init__()
        self.before_gather = before_gather

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        sharded = {id(leaf): (leaf, slot) for leaf in tree_leaves((args, kwargs))
                   if (slot := _sharded_slot(leaf)) is not None}
        if not sharded:
            return func(*args, **kwargs)
        attribute = _attribute_read(func)
        if attribute is not None:
            return args[0] if attribute == "data" else func(*args, **kwargs)
        first = _target(args, kwargs)
        temporaries: dict[int, torch.Tensor] = {}
        for key, (param, slot) in sharded.items():
            chunk = slot.chunk
            if param is first and _overwrites(func):
                # where the shard lives, so a CUDA target draws from the CUDA generator as on one process
                # (a shard resting on the disk tier was filled on the host)
                shard = chunk.param.shard
                device = shard.tensor.device if shard.tensor is not None else torch.device("cpu")
                temporaries[key] = torch.empty(slot.shape, dtype=chunk.dtype, device=device)
            else:
                if self.before_gather is not None:
                    self.before_gather(slot)
                temporaries[key] = slot.view(chunk.gather(chunk.param.local())).clone()
        swapped_args, swapped_kwargs = tree_map(
            lambda x: temporaries.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        result = func(*swapped_args, **swapped_kwargs)
        if first is not None and id(first) in sharded and _modifies_target(func):
            slot = sharded[id(first)][1]
            shard = slot.chunk.param.shard
            if shard.on_disk:  # the shard's file region is read, changed and written back
                local = shard.read()
                slot.chunk.write_own_part(slot, local, temporaries[id(first)])
                shard.write(local)
            else:
                slot.chunk.write_own_part(slot, shard.tensor, temporaries[id(first)])
            if result is temporaries[id(first)]:
                return first
        return result
