"""A model's full state dict out of its chunks and into them: what ``ShardedModelV2.state_dict``,
``full_values`` and ``unwrap`` read, what ``ShardedModelV2.load_state_dict`` does, and the checks checkpoints
share.

A *full* state dict holds every parameter whole, under the wrapped module's own keys, whatever the
number of ranks the chunks are sharded over. Each rank owns elements ``[chunk.shard_offset,
chunk.shard_offset + chunk.shard_numel)`` of every chunk; loading writes only that range of each
parameter (``chunk.write_own_part``), so loading needs no collective.

Loading is done in two phases: a *plan* checks everything and changes nothing (so a bad state dict
leaves the model as it was), then ``apply()`` writes. The plan checks every value so that the writes
cannot fail: a tensor with data (not on the ``meta`` device), dense, of a real floating dtype where the
chunks need one, of the right size. Writing a parameter's values bumps its autograd version counter,
as ``param.copy_`` does in plain PyTorch, so that a backward through a graph built before the load
raises torch's "modified by an inplace operation" error instead of mixing old activations with new
weights. The optimizers' state dicts are :mod:`chunkmem.optim.state_dict`'s.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from .core.chunk import MASTER, Chunk, ParamSlot
from .core.param_guard import slot_of
from .errors import ArgumentTypeError, CheckpointError, InvalidArgumentError, check_type


# ---- shared checks -------------------------------------------------------------------------------


def refuse_grads_in_param_memory(model: Any, what: str) -> None:
    """Raise :class:`CheckpointError` while a chunk's parameter memory holds gradients
    (``reuse_fp16_shard`` between backward and step): the parameter values are not there."""
    holding = [c.name for c in model.chunks if c.param.holds_grads]
    if holding:
        raise CheckpointError(
            f"{what}: the parameters' memory of {len(holding)} chunks holds the gradients of the last backward "
            f"(reuse_fp16_shard=True), not parameter values; call optim.step() or optim.zero_grad() first")


def refuse_chunks_in_use(model: Any, what: str) -> None:
    """Raise :class:`CheckpointError` while a forward is running or a backward started and did not
    finish (a chunk is in use or held for backward): its parameters cannot be written then."""
    busy = [c.name for c in model.chunks if c.users or c.held_for_backward]
    if busy:
        raise CheckpointError(
            f"{what}: {len(busy)} chunks are in use by a forward that is running or a backward that started and "
            f"did not finish ({first_few(busy)}); load between iterations, or after a complete forward (a backward of "
            f"that forward then raises, as in plain PyTorch)")


def check_tensor_data(where: str, value: Any, *, floating: bool = False, numel: int | None = None) -> torch.Tensor:
    """Raise :class:`InvalidArgumentError` naming ``where`` unless ``value`` is a dense tensor with
    data (not on the ``meta`` device) and, as asked, of a real floating dtype and ``numel`` elements;
    the checks that make copying it into a chunk unable to fail."""
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(where, type(value).__name__, "a tensor")
    if value.is_meta:
        raise InvalidArgumentError(where, f"a tensor on the meta device (shape {tuple(value.shape)}, no data)",
                                   "a tensor with data")
    if value.layout != torch.strided:
        raise InvalidArgumentError(where, f"a tensor of layout {value.layout}", "a dense (torch.strided) tensor")
    if floating and not value.is_floating_point():
        raise InvalidArgumentError(where, f"a tensor of dtype {value.dtype}", "a floating-point tensor")
    if numel is not None and value.numel() != numel:
        raise InvalidArgumentError(where, f"a tensor of {value.numel()} elements", f"{numel} elements")
    return value


def bump_versions(params: Any) -> None:
    """Mark ``params`` as modified in place for autograd (what ``param.copy_`` does in plain PyTorch):
    a graph that saved them before a load can no longer be run backward."""
    torch.autograd.graph.increment_version(list(params))


def warn_if_masters_lose_precision(chunk: Chunk, key: str, value: torch.Tensor) -> None:
    """Warn when a 16-bit chunk without allocated masters (no optimizer yet) receives values its
    dtype cannot hold exactly: the masters will be widened from the rounded values."""
    if not (chunk.has_master and not chunk.optim[MASTER].allocated and value.dtype == torch.float32):
        return
    if not torch.equal(value.to(chunk.dtype).to(torch.float32), value):
        warnings.warn(
            f"{key!r}: the fp32 values are rounded to {chunk.dtype} because no ShardedOptimizerV2 (which holds "
            f"the fp32 masters) is attached yet; to keep them exactly, build the optimizer first, then load",
            stacklevel=4)


# ---- the model: reading ---------------------------------------------------------------------------


def full_values(chunk: Chunk) -> torch.Tensor:
    """The chunk's whole current parameter values in fp32 on the CPU: from the fp32 masters where they
    exist. Gathers the shards when sharded (a collective: every rank calls it in the same order)."""
    if chunk.optim[MASTER].allocated:
        local = chunk.optim[MASTER].read()
    elif chunk.param.holds_grads:
        raise RuntimeError(f"{chunk.name}: the parameter memory holds gradients and there is no master")
    else:
        local = chunk.param.local()
    return chunk.gather(local.detach()).to(device="cpu", dtype=torch.float32)


def parameter_values(model: Any, chunks: Iterable[Chunk], keep: bool = True) -> dict[int, torch.Tensor]:
    """``id(parameter)`` -> a copy of its whole current value in fp32 on the CPU, for every parameter of
    ``chunks``, read a chunk at a time by ``model.full_values`` (collectives when sharded: every rank calls
    it); ``keep=False``: the chunks are still read, for the collectives, but nothing is kept."""
    values: dict[int, torch.Tensor] = {}
    for chunk in chunks:
        full = model.full_values(chunk)
        if keep:
            for slot in chunk.slots:
                values[id(slot.param)] = slot.view(full).clone()
    return values


def full_state_dict(model: Any, destination: Any, prefix: str, rank0_only: bool, trainable_only: bool) -> Any:
    """What ``ShardedModelV2.state_dict`` returns (see there): the wrapped module's keys, parameters from
    :func:`parameter_values`, buffers copied to the CPU; empty on the ranks other than 0 with ``rank0_only``."""
    keep = not rank0_only or model.data_parallel.rank == 0
    # laid out frozen: the same chunks on every rank, so the gathers still match
    values = parameter_values(model, [c for c in model.chunks if c.trainable or not trainable_only], keep)
    out = OrderedDict() if destination is None else destination
    if not keep:
        return out
    for key, value in model.module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and id(value) in values:
            out[prefix + key] = values[id(value)]
        elif not trainable_only:
            out[prefix + key] = value.detach().to("cpu", copy=True)
    return out


# ---- the model: loading ---------------------------------------------------------------------------


class ModelLoad:
    """A checked plan to load a full state dict into a :class:`~chunkmem.ShardedModelV2`."""

    def __init__(self, model: Any, writes: dict[Chunk, list[tuple[ParamSlot, str, torch.Tensor]]],
                 buffers: list[tuple[torch.Tensor, torch.Tensor]], missing: list[str], unexpected: list[str]) -> None:
        self.model = model
        self.writes = writes
        self.buffers = buffers
        self.incompatible = _IncompatibleKeys(missing, unexpected)

    def apply(self) -> _IncompatibleKeys:
        """Write this rank's part of every parameter (16-bit copy and fp32 master) and every buffer."""
        runtime = self.model.runtime
        with torch.no_grad():
            for chunk, writes in self.writes.items():
                values = chunk.param.local().clone()
                master_buf = chunk.optim[MASTER] if chunk.has_master and chunk.optim[MASTER].allocated else None
                master = master_buf.read().clone() if master_buf is not None else None
                for slot, key, value in writes:
                    chunk.write_own_part(slot, values, value)
                    if master is not None:
                        chunk.write_own_part(slot, master, value)
                    else:
                        warn_if_masters_lose_precision(chunk, key, value)
                if master_buf is not None:
                    master_buf.write(master)
                runtime.write_params(chunk, values)
                bump_versions(slot.param for slot, _, _ in writes)
            for target, value in self.buffers:
                target.copy_(value)
        return self.incompatible


def plan_model_load(model: Any, state_dict: Any, strict: bool) -> ModelLoad:
    """Check ``state_dict`` against ``model`` (keys, shapes, dtypes, tied parameters) without
    changing anything. Missing or unexpected keys raise only when ``strict``; a wrong shape always."""
    check_type("state_dict", state_dict, Mapping, "a mapping from the wrapped module's state_dict() keys to tensors")
    check_type("strict", strict, bool, "True or False")
    refuse_grads_in_param_memory(model, "load_state_dict")
    refuse_chunks_in_use(model, "load_state_dict")
    model.runtime.check_no_step_in_flight("model.load_state_dict()")
    own = model.module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise InvalidArgumentError(
            "state_dict", f"a state dict with missing keys {first_few(missing)} and unexpected keys {first_few(unexpected)}",
            "exactly the keys of the wrapped module's state_dict(), or strict=False")
    writes: dict[Chunk, list[tuple[ParamSlot, str, torch.Tensor]]] = {}
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    buffers = []
    for key, target in own.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        slot = slot_of(target) if isinstance(target, nn.Parameter) else None
        _check_value(key, value, tuple(slot.shape) if slot is not None else tuple(target.shape), slot is not None)
        if slot is None:
            buffers.append((target, value))
            continue
        if id(slot) in seen:
            first_key, first = seen[id(slot)]
            if not torch.equal(first.detach().cpu().double(), value.detach().cpu().double()):
                raise InvalidArgumentError(f"state_dict[{key!r}]", f"a value different from state_dict[{first_key!r}]",
                                           "equal values: both keys name one (tied) parameter")
            continue
        seen[id(slot)] = (key, value)
        writes.setdefault(slot.chunk, []).append((slot, key, value))
    return ModelLoad(model, writes, buffers, missing, unexpected)


def _check_value(key: str, value: Any, shape: tuple[int, ...], floating: bool) -> None:
    check_tensor_data(f"state_dict[{key!r}]", value, floating=floating)
    if tuple(value.shape) != shape:
        raise InvalidArgumentError(f"state_dict[{key!r}]", f"a tensor of shape {tuple(value.shape)}",
                                   f"shape {shape}, the model's")


def first_few(names: list[str]) -> list[str]:
    """The first five of ``names`` (and ``"..."`` when there are more), for a message."""
    return names[:5] + (["..."] if len(names) > 5 else [])
