"""Chunk-managed parameters that are always safe to touch.

A parameter packed into a chunk is a view into the chunk's device copy, whose memory exists only while
a module computes (and, sharded, holds other ranks' elements too). Reading such a view between uses
would read freed memory. So when a parameter enters a chunk its class becomes :class:`ChunkParameter`
(an ``nn.Parameter`` subclass; ``isinstance(p, nn.Parameter)`` still holds), whose
``__torch_function__`` sees every Python-level use of it and decides:

================================  =================================  ======================================
where the use happens             reads (print, sum, detach, clone,  in-place writes (``copy_``,
                                  ``.float()``, ``state_dict()``)    ``nn.init.*``, ``p[...] = v``)
================================  =================================  ======================================
inside a forward of its model     the parameter itself (a module     the parameter itself (as before)
                                  using another module's parameter
                                  fetches that chunk first)
inside the backward, while it     the parameter itself (a custom     as anywhere else
holds the chunk on the device     autograd Function's backward)
inside ``GatheredParameters``     the gathered parameter             the gathered parameter; with
                                                                     ``modifier_rank`` written back on exit
anywhere else, one rank           a copy of the current values;      written into the chunk if it has no
                                  plain tensors, no autograd: a use  separate fp32 master; otherwise
                                  that needs a gradient is refused   refused (use ``GatheredParameters``)
anywhere else, sharded chunk      refused unless gathered            refused (use ``GatheredParameters``)
================================  =================================  ======================================

Refusals raise :class:`ParameterAccessError` naming the parameter and the documented way. Metadata
(``shape``, ``dtype``, ``requires_grad`` and ``requires_grad_``, hook registration...) always passes through.
``param.data`` outside a forward gives a copy whose in-place changes are applied to the parameter by
the rules above. ``param.grad`` is ``None`` until a backward gives the parameter a gradient, then a
:class:`ChunkGradient` stand-in on which torch's gradient idioms work (``clip_grad_norm_``, reads:
:mod:`chunkmem.optim.gradient_idioms`); setting it to ``None`` zeroes the parameter's gradient. ``copy.deepcopy`` and pickling of a chunk-managed parameter are refused.

A tensor that a module's forward got from a parameter and kept past the forward (``w = p.data`` inside
``forward``, stored on ``self``) still views chunk memory: keep copies, not views.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves, tree_map

from .chunk import MASTER, ParamSlot
from ..errors import ParameterAccessError

SLOT_ATTR = "_chunkmem_slot"

READ_HELP = ("read it inside `with chunkmem.GatheredParameters([param]):` (every rank enters it), or take "
             "a copy with `model.full_parameter(param)` or `model.state_dict()`")
WRITE_HELP = ("change it inside `with chunkmem.GatheredParameters([param], modifier_rank=0):` (every rank "
              "enters it), which writes the new values into the chunk and its fp32 master")


# ---- adopting and releasing parameters -----------------------------------------------------------

EXTERNAL_ATTR = "_chunkmem_external_params"


def remember_external(module: nn.Module, param: nn.Parameter) -> None:
    """Record, before ``module``'s model is wrapped, that ``module``'s forward uses ``param`` of another
    module (read by the runtime when it is built: :func:`remembered_externals`)."""
    pending = module.__dict__.setdefault(EXTERNAL_ATTR, [])
    if not any(p is param for p in pending):
        pending.append(param)


def remembered_externals(module: nn.Module) -> list[nn.Parameter]:
    """The parameters :func:`remember_external` recorded for ``module``."""
    return list(module.__dict__.get(EXTERNAL_ATTR, ()))


def slot_of(param: Any) -> ParamSlot | None:
    """The slot of a chunk-managed parameter, or ``None`` for an ordinary one."""
    return getattr(param, SLOT_ATTR, None)


def adopt(param: nn.Parameter, slot: ParamSlot) -> None:
    """Make ``param`` a chunk-managed parameter living in ``slot``."""
    setattr(param, SLOT_ATTR, slot)
    if not isinstance(param, ChunkParameter):
        param.__class__ = _guarded_class(type(param))


def disown(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` back its plain class, holding ``value`` (its chunk no longer holds it)."""
    if isinstance(param, ChunkParameter):
        param.__class__ = _unguarded[type(param)]
    with DisableTorchFunctionSubclass():
        param.data = value
    if hasattr(param, SLOT_ATTR):
        delattr(param, SLOT_ATTR)


_guarded_classes: dict[type, type] = {}  # a parameter class -> its guarded subclass
_unguarded: dict[type, type] = {}  # and back


def _guarded_class(cls: type) -> type:
    if cls not in _guarded_classes:
        guarded = ChunkParameter if cls is nn.Parameter else type(f"Chunk{cls.__name__}", (ChunkParameter, cls), {})
        _guarded_classes[cls], _unguarded[guarded] = guarded, cls
    return _guarded_classes[cls]


# ---- classifying torch functions -----------------------------------------------------------------

METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "names", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize", "nbytes",
    "output_nr", "_version", "_backward_hooks", "_post_accumulate_grad_hooks", "__dict__", "_base", "is_xpu",
    "is_mps", "_cdata", "__class__"})
"""Tensor attributes whose reading tells what a tensor is, not what it holds (the guards let them pass)."""
METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "stride", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "get_device", "__hash__", "__len__", "_is_view", "is_signed", "_has_compatible_shallow_copy_type",
    "__setstate__", "_increment_version", "increment_version"})
"""Tensor methods of the same kind."""
INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})


def attribute_of(func: Any) -> tuple[str, str] | None:
    """``(name, "get" | "set")`` when ``func`` is a tensor attribute's getter or setter."""
    kind = getattr(func, "__name__", "")
    if kind not in ("__get__", "__set__"):
        return None
    return getattr(getattr(func, "__self__", None), "__name__", ""), kind[2:5]


_METADATA = ("metadata",)
_kinds: dict[Any, Any] = {}  # func -> _METADATA, an attribute's (name, "get"|"set"), or () (a call)


_modifies: dict[Any, bool] = {}  # func -> whether it writes its first argument in place (by its name, once)


def _guarded_in(values: Any, found: list["ChunkParameter"]) -> list["ChunkParameter"]:
    """The chunk-managed parameters among ``values`` (a call's arguments), looked for inside tuples, lists and
    dicts as torch's own argument parsing does, appended to ``found``. (``tree_leaves`` finds the same: it
    took a third of the guard's time on every call.)"""
    for value in values:
        if isinstance(value, ChunkParameter):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            _guarded_in(value, found)
        elif isinstance(value, dict):
            _guarded_in(value.values(), found)
    return found


def _kind_of(func: Any) -> Any:
    """What ``func`` is to the guard, classified once per function."""
    kind = _kinds.get(func)
    if kind is None:
        attribute = attribute_of(func)
        kind = _kinds[func] = _METADATA if _is_metadata(func, attribute) else (attribute or ())
    return kind


def _is_metadata(func: Any, attribute: tuple[str, str] | None) -> bool:
    if attribute is not None:
        return attribute[0] in METADATA_ATTRIBUTES and attribute[1] == "get"
    return getattr(func, "__name__", "") in METADATA_METHODS


def written_target(func: Any, args: tuple, kwargs: dict) -> Any:
    """What an in-place call modifies (its first argument: a tensor, or a list of them for the ``_foreach_``
    and ``_amp_`` kernels; or ``out=``), or ``None``."""
    out = kwargs.get("out")
    if out is not None:
        return out
    modifies = _modifies.get(func)
    if modifies is None:
        name = getattr(func, "__name__", "")
        modifies = _modifies[func] = (getattr(func, "__module__", "") == "torch.nn.init" or name in INPLACE_DUNDERS
                                      or (name.endswith("_") and not name.endswith("__")))
    if not modifies:
        return None
    if args:
        return args[0]
    return next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)


# ---- the guarded parameter -----------------------------------------------------------------------

class ChunkParameter(nn.Parameter):
    """An ``nn.Parameter`` whose values live in a chunk; see the module docstring for what each use
    does. Created by chunkmem (``ZeroInitContext``, ``ShardedModelV2``), never directly."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _kind_of(func)
        if kind is _METADATA:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        attribute = kind
        params = _guarded_in(args, [])
        if kwargs:
            _guarded_in(kwargs.values(), params)
        if attribute:
            return _attribute_access(params[0], attribute, func, args, kwargs)
        target = written_target(func, args, kwargs)
        if all(_passes(p, p is target) for p in params):
            return plain_call(func, args, kwargs)
        if isinstance(target, ChunkParameter):
            return _write_outside_compute(target, func, args, kwargs)
        return _read_outside_compute(params, func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        raise ParameterAccessError(
            f"copy.deepcopy of the chunk-managed parameter {_name(self)!r}: its values live in a chunk shared "
            "with other parameters. Copy the model's weights with model.state_dict() (and build a new model "
            "from them), or take a plain module back with model.unwrap()")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ParameterAccessError(
            f"pickling (torch.save) the chunk-managed parameter {_name(self)!r} directly: save "
            "model.state_dict() or use chunkmem.save_checkpoint")


def plain_call(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` with the guards' ``__torch_function__`` off (on the tensors as they are)."""
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _name(param: Any) -> str:
    slot = slot_of(param)
    return slot.name if slot is not None else "<parameter>"


def _passes(param: ChunkParameter, written: bool) -> bool:
    """Whether a use of ``param`` runs on the parameter itself (see the module docstring)."""
    slot = slot_of(param)
    if slot is None:
        return True
    host = slot.chunk.host
    if host is None:  # built in ZeroInitContext, not wrapped yet: views hold the values
        with DisableTorchFunctionSubclass():
            return param.untyped_storage().nbytes() > 0
    if host.in_forward:
        host.use_in_forward(param)
        return True
    if not written and _held_by_the_backward(slot.chunk):
        return True
    return host.is_open(slot.chunk, for_writing=written)


def _held_by_the_backward(chunk: Any) -> bool:
    """Whether the backward holds ``chunk`` on the device with its parameters' values: a read there (a custom
    autograd Function's backward reading its saved weight) runs on the parameter itself, as autograd's own
    nodes read it, instead of on a copy of the chunk's values made for each use. A steady iteration holds
    nothing for its backward: every chunk stays on the device throughout, so inside autograd's execution
    each one is held."""
    buf = chunk.param
    if not buf.device_valid or buf.holds_grads:
        return False
    return chunk.held_for_backward or (chunk.host.steady and torch._C._current_graph_task_id() != -1)


def _attribute_access(param: ChunkParameter, attribute: tuple[str, str], func: Any, args: tuple,
                      kwargs: dict) -> Any:
    name, kind = attribute
    slot = slot_of(param)
    if slot is not None and name == "grad" and slot.chunk.host is not None:
        return _gradient_stand_in(param, slot) if kind == "get" else _set_gradient(slot, args[1], func, args)
    if slot is None or name == "requires_grad" or _passes(param, written=kind == "set" or name == "data"):
        return plain_call(func, args, kwargs)  # requires_grad: metadata, settable as requires_grad_() is (freezing)
    if name == "data" and kind == "get":
        return _DataCopy.of(param, _current_values(slot))
    if kind == "set":
        raise ParameterAccessError(
            f"assigning .{name} of the chunk-managed parameter {slot.name!r}: its memory belongs to a chunk. "
            f"To change its values, {WRITE_HELP}; dtype and placement are chunkmem's (ShardedModelV2 arguments)")
    return plain_call(func, (_current_values(slot),) + tuple(args[1:]), kwargs)


def _gradient_stand_in(param: ChunkParameter, slot: ParamSlot) -> Any:
    host = slot.chunk.host
    if (host is None or not host.grads_pending or not slot.chunk.trainable
            or slot.index_in_chunk not in slot.chunk.slots_with_grads or host.gradient_released(slot.chunk)):
        return None  # (torch's .grad is None for a parameter no backward reached; a frozen one keeps its own;
        # and here where the update in the backward freed it, as safe_get_full_grad says)
    return ChunkGradient(slot, slot.chunk.param.device.device)


def _set_gradient(slot: ParamSlot, value: Any, func: Any, args: tuple) -> None:
    if value is not None:
        raise ParameterAccessError(
            f"assigning .grad of the chunk-managed parameter {slot.name!r}: gradients live in chunks and are "
            "written by backward; torch.nn.utils.clip_grad_norm_ and clip_grad_value_ clip them where they are")
    host = slot.chunk.host
    grad = host.grad_of(slot.chunk) if host is not None else None
    run = slot.chunk.own_run(slot)
    if grad is not None and run is not None:  # its part zeroed for a later backward to add to
        grad[run[0]:run[1]].zero_()
    slot.chunk.slots_with_grads.discard(slot.index_in_chunk)  # no gradient: .grad reads None, the step skips it
    plain_call(func, args, {})


def _current_values(slot: ParamSlot) -> torch.Tensor:
    """A new tensor with the parameter's current values (its chunk's dtype, where the chunk is)."""
    chunk = slot.chunk
    buf = chunk.param
    with torch.no_grad():
        if buf.holds_grads:  # reuse_fp16_shard between backward and step: the values are in the master
            master = chunk.optim[MASTER]
            if buf.sharded or not master.allocated:
                raise ParameterAccessError(
                    f"the chunk of parameter {slot.name!r} holds gradients until optim.step() "
                    f"(reuse_fp16_shard=True); read it after the step, or {READ_HELP}")
            return slot.view(master.read()).to(chunk.dtype)
        if buf.device_valid:
            return slot.view(buf.device).clone()
        if buf.sharded:
            raise ParameterAccessError(
                f"parameter {slot.name!r} is sharded over {buf.shards.world} ranks and not gathered now: {READ_HELP}")
        return slot.view(buf.current()).clone()


def _read_outside_compute(params: list[ChunkParameter], func: Any, args: tuple, kwargs: dict) -> Any:
    """Run a reading call on copies of the parameters' current values (see the module docstring)."""
    copies: dict[int, torch.Tensor] = {}
    needs_grad = False
    for param in params:
        slot = slot_of(param)
        if slot is None or id(param) in copies or _passes(param, written=False):
            continue
        value = _current_values(slot)
        with DisableTorchFunctionSubclass():
            if torch.is_grad_enabled() and param.requires_grad:
                value.requires_grad_(True)
                needs_grad = True
        copies[id(param)] = value
    swapped = tree_map(lambda x: copies.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    result = plain_call(func, *swapped)
    if needs_grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(result)):
        names = ", ".join(repr(_name(p)) for p in params if id(p) in copies)
        raise ParameterAccessError(
            f"{getattr(func, '__name__', func)} of the chunk-managed parameter {names} outside the model's forward "
            "would need a gradient, which chunkmem delivers only for uses inside the forward. Use it inside the "
            "forward, or read it without autograd (torch.no_grad() or param.detach())")
    return result


def _write_outside_compute(param: ChunkParameter, func: Any, args: tuple, kwargs: dict) -> Any:
    """An in-place call on a parameter outside a forward: into the chunk where no fp32 master needs
    the change too (one rank), else refused (see the module docstring)."""
    slot = slot_of(param)
    chunk, buf = slot.chunk, slot.chunk.param
    if chunk.host is not None and chunk.host.is_open(chunk, for_writing=False):
        raise ParameterAccessError(
            f"{getattr(func, '__name__', func)} would change the parameter {slot.name!r} inside a read-only "
            "GatheredParameters block: give it modifier_rank= to keep the change")
    if buf.sharded or buf.holds_grads or chunk.optim[MASTER].allocated:
        why = ("it is sharded over ranks" if buf.sharded else
               "its chunk holds gradients until optim.step()" if buf.holds_grads else "it has an fp32 master copy")
        raise ParameterAccessError(
            f"{getattr(func, '__name__', func)} would change the chunk-managed parameter {slot.name!r} outside the "
            f"model's forward, and {why}: {WRITE_HELP}")
    if chunk.host is not None:
        chunk.host.check_no_step_in_flight(f"{getattr(func, '__name__', func)} on the parameter {slot.name!r}")
    with torch.no_grad():
        current = buf.current()
        view = slot.view(current)
        swapped = tree_map(lambda x: view if x is param else x, (args, kwargs))
        others = [p for p in tree_leaves(swapped) if isinstance(p, ChunkParameter)]
        if others:
            result = _read_outside_compute(others, func, *swapped)
        else:
            result = plain_call(func, *swapped)
        if buf.shard.on_disk:  # ``current`` was read from the disk, or is the device copy: the file follows
            buf.shard.write(current)
        elif buf.device_valid and buf.shard.allocated:  # a host copy that is current too stays current
            slot.view(buf.shard.tensor).copy_(view)
    return param if result is view else result


# ---- stand-ins handed out instead of chunk memory ------------------------------------------------

class _DataCopy(torch.Tensor):
    """What ``param.data`` gives outside a forward: a copy of the values; in-place changes of it are
    applied to the parameter (by the parameter's write rules) and copied back."""

    _param: ChunkParameter

    @staticmethod
    def of(param: ChunkParameter, values: torch.Tensor) -> "_DataCopy":
        copy = torch.Tensor._make_subclass(_DataCopy, values, False)
        copy._param = param
        return copy

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = written_target(func, args, kwargs)
        if isinstance(target, _DataCopy):
            param = target._param
            with torch.no_grad():
                new_args, new_kwargs = tree_map(lambda x: param if x is target else x, (args, kwargs))
                result = func(*new_args, **new_kwargs)
                with DisableTorchFunctionSubclass():
                    target.copy_(_current_values(slot_of(param)))
            return target if result is param else result
        return plain_call(func, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


class ChunkGradient(torch.Tensor):
    """What ``param.grad`` of a chunk-managed parameter gives once a backward gave it a gradient: a
    stand-in with the gradient's shape, dtype and device (the gradient lives in its chunk, possibly
    scaled by the loss scale and sharded over ranks). torch's idioms work on it
    (``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``, norms, reads of a whole chunk's gradient);
    :mod:`chunkmem.optim.gradient_idioms` says what each does. ``slot`` is where its parameter lives."""

    slot: ParamSlot

    @staticmethod
    def __new__(cls, slot: ParamSlot, device: torch.device) -> "ChunkGradient":
        stand_in = torch.Tensor._make_wrapper_subclass(cls, slot.shape, dtype=slot.chunk.dtype, device=device)
        stand_in.slot = slot
        return stand_in

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _kind_of(func) is _METADATA:
            return plain_call(func, args, kwargs)
        if getattr(func, "__name__", "") == "__repr__":
            return f"ChunkGradient({args[0].slot.name!r}, shape={tuple(args[0].shape)}, dtype={args[0].dtype})"
        stand_in = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, ChunkGradient))
        host = stand_in.slot.chunk.host
        if host is None or not host.owns(stand_in.slot.chunk):
            raise ParameterAccessError(
                f"{getattr(func, '__name__', func)} on a gradient of {stand_in.slot.name!r} kept from a model that "
                "was unwrapped: read .grad again")
        return host.run_gradient_idiom(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise ParameterAccessError(f"{func} on a chunk-managed parameter's gradient stand-in: see ChunkGradient")
