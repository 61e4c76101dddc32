"""Reading and changing chunk-managed parameters outside the forward, DeepSpeed's way.

:class:`GatheredParameters` makes whole parameters available for a ``with`` block: every rank enters
it with the same parameters (their chunks are gathered, a collective when sharded); with
``modifier_rank`` the values that rank leaves in them are broadcast and written into the chunks on
exit: this rank's part of the 16-bit (or fp32) copy and of the fp32 master. A master element is
rewritten only where the new value differs from its current rounding, so the parameters nobody
changed keep their fp32 masters bit for bit.

:func:`register_external_parameter` tells a module that its forward uses a parameter of another
module, so its chunk is fetched with that module (chunkmem also finds such uses by itself during the
forward; registering makes it explicit and needs no first discovery).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..core.chunk import MASTER, Chunk, ChunkHost, ParamSlot
from ..errors import InvalidArgumentError, check_type
from ..core.param_guard import ParameterAccessError, remember_external, slot_of


class GatheredParameters:
    """Context manager: inside it the given chunk-managed parameters hold their full current values.

    Args:
        params: a parameter or an iterable of tensors; ordinary (not chunk-managed) tensors are ignored.
            Every rank must pass the same parameters in the same order (their chunks are gathered with
            collectives when the model is sharded).
        modifier_rank: ``None``: read only (an in-place change inside the block is refused where it could
            not be kept, see :mod:`chunkmem.core.param_guard`). An int: the rank, in the model's data-parallel
            group, whose changes are broadcast to every rank and written into the chunks and the fp32
            masters on exit.
        fwd_module: if given, the parameters are registered as used by this module's forward
            (:func:`register_external_parameter`).
        enabled: ``False`` makes the block do nothing.

    Refused inside the model's forward, and between a backward and ``optim.step()`` with
    ``reuse_fp16_shard`` (the parameters' memory holds gradients then).
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        check_type("enabled", enabled, bool, "True or False")
        if modifier_rank is not None:
            check_type("modifier_rank", modifier_rank, int, "None or a rank (int)")
        if fwd_module is not None:
            check_type("fwd_module", fwd_module, nn.Module, "None or a torch.nn.Module")
        if isinstance(params, torch.Tensor):
            params = [params]
        try:
            params = list(params)
        except TypeError:
            raise InvalidArgumentError("params", type(params).__name__, "a parameter or an iterable of parameters") \
                from None
        for p in params:
            check_type("params", p, torch.Tensor, "a parameter or an iterable of parameters")
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.slots = [s for s in (slot_of(p) for p in params) if s is not None and s.chunk.host is not None]
        # the same gathers in the same order on every rank: models in the order their parameters come,
        # each model's chunks in packing order
        models = {id(s.chunk.host): n for n, s in reversed(list(enumerate(self.slots)))}
        self.chunks = sorted({id(s.chunk): s.chunk for s in self.slots}.values(),
                             key=lambda c: (models[id(c.host)], c.index))
        self._entered = False
        self._users: dict[int, int] = {}  # chunk -> tensors viewing its device copy when the block began
        if enabled and modifier_rank is not None:
            for chunk in self.chunks:
                world = chunk.host.data_parallel.world
                if not 0 <= modifier_rank < world:
                    raise InvalidArgumentError("modifier_rank", modifier_rank,
                                               f"None or a rank in [0, {world}) of the model's data-parallel group")

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for chunk in self.chunks:
            if chunk.host.in_forward:
                raise ParameterAccessError("GatheredParameters inside the model's forward: use it outside")
            if self.modifier_rank is not None:
                chunk.host.check_no_step_in_flight("GatheredParameters(modifier_rank=...)")
        for host, chunks in _by_host(self.chunks):
            host.open_chunks(chunks, for_writing=self.modifier_rank is not None)
        self._users = {id(chunk): chunk.param.storage_users() for chunk in self.chunks}
        self._entered = True
        if self.fwd_module is not None:
            for slot in self.slots:
                register_external_parameter(self.fwd_module, slot.param)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._entered:
            return
        self._entered = False
        writable = self.modifier_rank is not None
        new_values: dict[int, torch.Tensor] = {}
        if writable and exc[0] is None:
            with torch.no_grad():
                for chunk in self.chunks:  # over every rank: shard groups and replicated chunks hold copies too
                    chunk.host.data_parallel.broadcast_(chunk.param.device, self.modifier_rank,
                                                        what=f"{chunk.name} parameters")
                for slot in self.slots:
                    new_values[id(slot)] = slot.view(slot.chunk.param.device).clone()
        for chunk in self.chunks:  # views kept from inside the block (a state_dict(), p.detach(), p.data)
            if chunk.param.storage_users() > self._users[id(chunk)]:
                chunk.leave_device_memory_to_viewers()
        for host, chunks in _by_host(self.chunks):
            host.close_chunks(chunks, for_writing=writable)
        if new_values:
            for host, chunks in _by_host(self.chunks):
                for chunk in chunks:
                    _write_back(host, chunk, [s for s in self.slots if s.chunk is chunk], new_values)


def _by_host(chunks: list[Chunk]) -> list[tuple[ChunkHost, list[Chunk]]]:
    groups: dict[int, tuple[ChunkHost, list[Chunk]]] = {}
    for chunk in chunks:
        host = chunk.host
        groups.setdefault(id(host), (host, []))[1].append(chunk)
    return list(groups.values())


def _write_back(host: ChunkHost, chunk: Chunk, slots: list[ParamSlot], new_values: dict[int, torch.Tensor]) -> None:
    """Write this rank's part of the new values into the chunk's parameter copy, and into its fp32 master
    where the master's rounding differs from the new value."""
    master_buf = chunk.optim[MASTER] if chunk.has_master and chunk.optim[MASTER].allocated else None
    master = master_buf.read().clone() if master_buf is not None else None
    with torch.no_grad():
        values = chunk.param.local().clone()
        for slot in slots:
            full = new_values[id(slot)]
            chunk.write_own_part(slot, values, full)
            run = chunk.own_run(slot)
            if master is not None and run is not None:
                start, end, first = run
                own_master = master[start:end]
                new = full.reshape(-1)[first:first + end - start]
                changed = own_master.to(chunk.dtype) != new
                own_master[changed] = new[changed].float()
        if master_buf is not None:
            master_buf.write(master)
        host.write_params(chunk, values)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it (a tied
    weight, ``F.linear(x, other.weight)``): its chunk is then fetched for ``module``'s forward and
    backward. Call it on a model built inside :class:`~chunkmem.ZeroInitContext` (it takes effect when
    the model is wrapped) or on a submodule of a wrapped :class:`~chunkmem.ShardedModelV2`."""
    check_type("module", module, nn.Module, "a torch.nn.Module")
    check_type("parameter", parameter, nn.Parameter, "a chunk-managed torch.nn.Parameter")
    slot = slot_of(parameter)
    if slot is None:
        raise InvalidArgumentError("parameter", tuple(parameter.shape),
                                   "a parameter created inside ZeroInitContext or wrapped by ShardedModelV2")
    host = slot.chunk.host
    if host is None:
        remember_external(module, parameter)
    else:
        host.register_external(module, parameter)
