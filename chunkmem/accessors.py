"""DeepSpeed-style accessors of one parameter's fp32 value, gradient and optimizer state.

The model states of a chunk-managed parameter are scattered over chunk buffers (and, sharded, over
ranks). These functions read and change them one parameter at a time, under the names of DeepSpeed's
``deepspeed.utils``:

* ``safe_get_full_fp32_param(p)``, ``safe_get_full_grad(p)``, ``safe_get_full_optimizer_state(p, key)``:
  the whole value, shaped like ``p``, fp32, on the CPU. **Collective** when the model is sharded: every
  rank calls them for the same parameters in the same order (a chunk is gathered per call).
* ``safe_get_local_*``: this rank's part only: a flat fp32 CPU tensor of the parameter's elements that
  lie in this rank's shard (the whole parameter, flattened, with one rank; possibly empty). No collective.
* ``safe_set_full_fp32_param(p, value)``, ``safe_set_full_optimizer_state(p, value, key)``: ``value`` is
  the whole new value (shaped like ``p``); every rank writes its own part. No collective, but every rank
  must pass the same value for the chunks to stay consistent.
* ``safe_set_local_fp32_param(p, value)``, ``safe_set_local_optimizer_state(p, value, key)``: ``value`` has
  as many elements as ``safe_get_local_*`` returns.

When each value exists (the getters return ``None`` otherwise, as DeepSpeed does where it has none):

* fp32 parameter: a 16-bit model has fp32 masters once its :class:`~chunkmem.ShardedOptimizerV2` is
  built (``None`` before); an fp32 model's parameters are their own masters (always there); a frozen
  (``requires_grad=False``) 16-bit parameter has no master: its 16-bit value, widened, is returned.
* gradient: after a backward, until the gradients are dropped: ``optim.zero_grad()`` (set to none)
  or the step (applied or skipped: it releases the gradients it consumed, as the reference does). Between backward and step the value is the one the step will
  apply: unscaled (divided by the loss scale) and clipped if ``optim.clip_grad_norm`` ran, as
  ``p.grad`` is in plain PyTorch after ``scaler.unscale_`` and ``clip_grad_norm_``. Sharded, it is the
  mean over the data-parallel ranks (what the step applies). 16-bit models keep gradients in 16 bits:
  the fp32 value is their exact widening (times the multiplier).
* optimizer state (``"exp_avg"``, ``"exp_avg_sq"``; with another optimizer than Adam, its own per-element
  keys, such as SGD's ``"momentum_buffer"``): after the parameter's first step (``None`` before,
  as ``torch.optim.Adam`` has no state then); its setters are refused before the first step.

Parameters trained by a :class:`~chunkmem.LowLevelZeroOptimizer` (ZeRO-1/2, the module a plain one) are
read the same way: the fp32 master, the reduced gradient (unscaled, clipped if ``clip_grad_norm`` ran) and
the moments, from the optimizer's flat partitions (full: gathered over the ranks, so collective). Their
setters are refused (:class:`~chunkmem.UnsupportedOperationError`).

Setting an fp32 parameter writes the fp32 master and keeps the 16-bit copy equal to its rounding (what
``GatheredParameters(modifier_rank=...)`` leaves); a 16-bit model without optimizer has no master, so
only the rounded copy is kept. Parameter setters are refused while the parameters' memory holds
gradients (``reuse_fp16_shard`` between backward and step). Nothing is valid inside the model's forward.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .core.chunk import EXP_AVG, EXP_AVG_SQ, MASTER, Chunk, ParamSlot
from .errors import ArgumentTypeError, InvalidArgumentError, ParameterAccessError, UnsupportedOperationError, check_type
from .core.param_guard import slot_of
from .optim.low_level_zero import optimizer_of
from .state_dicts import bump_versions

OPTIMIZER_STATE_KEYS = (EXP_AVG, EXP_AVG_SQ)
"""The optimizer-state keys the accessors take: Adam's first and second moments."""

__all__ = [
    "OPTIMIZER_STATE_KEYS", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
]


# ---- finding a parameter's chunk ---------------------------------------------------------------------

def _slot(param: Any) -> ParamSlot:
    """The slot of a parameter of a wrapped model; refuses others and calls inside the forward."""
    check_type("param", param, nn.Parameter, "a parameter of a chunkmem.ShardedModelV2")
    _refuse_zero12_setter(param)
    slot = slot_of(param)
    host = None if slot is None else slot.chunk.host
    if host is None or not host.owns(slot.chunk):
        raise InvalidArgumentError("param", f"a parameter of shape {tuple(param.shape)}",
                                   "a parameter of a chunkmem.ShardedModelV2 (built inside ZeroInitContext "
                                   "or wrapped) or of a LowLevelZeroOptimizer")
    if host.in_forward:
        raise ParameterAccessError("the chunkmem.accessors (chunkmem.utils) functions inside the model's forward: call them outside")
    return slot


def _check_key(optim_state_key: Any, keys: tuple[str, ...] = OPTIMIZER_STATE_KEYS) -> str:
    """``optim_state_key`` if it is one of ``keys`` (Adam's moments, or the per-element state of the
    parameter's optimizer: SGD's ``"momentum_buffer"``, ...)."""
    allowed = " or ".join(repr(k) for k in keys) if keys else "nothing (this optimizer keeps no per-element state)"
    check_type("optim_state_key", optim_state_key, str, allowed)
    if optim_state_key not in keys:
        raise InvalidArgumentError("optim_state_key", optim_state_key, allowed)
    return optim_state_key


# ---- the chunk buffers (the one place optimizer families are read and written) -------------------------

def _read_family(chunk: Chunk, family: str) -> torch.Tensor | None:
    """This rank's ``shard_numel`` fp32 elements of an optimizer family of ``chunk`` (MASTER, EXP_AVG or
    EXP_AVG_SQ), or ``None`` when it holds no values. Every read of optimizer state goes through here."""
    buf = chunk.optim[family]
    return buf.read() if buf.allocated else None


def _write_family(chunk: Chunk, family: str, start: int, values: torch.Tensor) -> None:
    """Write ``values`` into an optimizer family of ``chunk`` from element ``start`` of this rank's
    shard (the buffer must hold values: see :func:`_read_family`)."""
    buf = chunk.optim[family]
    if not buf.on_disk:
        buf.tensor[start:start + values.numel()].copy_(values.reshape(-1).to(buf.dtype))
        return
    current = buf.read()  # a copy read from the disk tier's file: changed, then written back
    current[start:start + values.numel()].copy_(values.reshape(-1).to(current.dtype))
    buf.write(current)


def _local_part(slot: ParamSlot, shard: torch.Tensor) -> torch.Tensor:
    """The parameter's elements within this rank's shard of a chunk buffer (``shard_numel`` elements)."""
    run = slot.chunk.own_run(slot)
    return shard[:0] if run is None else shard[run[0]:run[1]]


def _fp32_shard(slot: ParamSlot) -> torch.Tensor | None:
    chunk = slot.chunk
    if chunk.has_master:
        return _read_family(chunk, MASTER)
    if chunk.param.holds_grads:  # not reachable for fp32 chunks (reuse_fp16_shard needs 16 bits); kept safe
        return None
    return chunk.param.local()


def _grad_shard(slot: ParamSlot) -> tuple[torch.Tensor, float] | None:
    """This rank's shard of the chunk's finished gradient and the factor that unscales/clips it."""
    host, chunk = slot.chunk.host, slot.chunk
    grad = host.grad_of(chunk) if chunk.trainable else None
    if grad is None:
        return None
    return grad, host.grad_multiplier(slot)


def _state_shard(slot: ParamSlot, key: str) -> torch.Tensor | None:
    chunk = slot.chunk
    if not chunk.trainable or chunk.step_of(slot) == 0:  # no state before the parameter's first step, as torch
        return None
    return _read_family(chunk, key)


def _to_fp32_cpu(tensor: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
    out = tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
    return out.mul_(multiplier) if multiplier != 1.0 else out


def _full(slot: ParamSlot, shard: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
    """Gather a chunk buffer (collective when sharded) and cut the parameter out of it."""
    full = slot.chunk.gather(shard.detach())
    return _to_fp32_cpu(slot.view(full), multiplier)


# ---- parameters of a LowLevelZeroOptimizer (ZeRO-1/2) ------------------------------------------------

def _zero12(param: Any, family: str, full: bool) -> tuple[bool, torch.Tensor | None]:
    """``(True, value)`` when ``param`` is trained by a :class:`~chunkmem.LowLevelZeroOptimizer`: the whole
    value (``full``: gathered, shaped like it) or this rank's part (flat) of ``family``, fp32 on the CPU;
    ``(False, None)`` for any other parameter."""
    optimizer = optimizer_of(param) if isinstance(param, nn.Parameter) else None
    slot = None if optimizer is None else optimizer.slot_of(param)
    if slot is None:
        return False, None
    if family not in ("fp32", "grad"):
        family = _check_key(family, slot.chunk.state_families)
    found = optimizer.state_shard(slot, family)
    if found is None:
        return True, None
    shard, multiplier = found
    if full:
        return True, _to_fp32_cpu(slot.view(optimizer.gather_shards(slot.chunk, shard)), multiplier)
    run = slot.chunk.own_run(slot)
    if run is None:
        return True, _to_fp32_cpu(shard[:0])
    return True, _to_fp32_cpu(shard[run[0]:run[1]], multiplier)


def _refuse_zero12_setter(param: Any) -> None:
    if isinstance(param, nn.Parameter) and optimizer_of(param) is not None:
        raise UnsupportedOperationError("the safe_set_* accessors for parameters of a LowLevelZeroOptimizer "
                                        "(ZeRO-1/2): only the getters are supported; load a state dict instead")


# ---- getters ----------------------------------------------------------------------------------------

def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 value of ``param`` (its fp32 master; an fp32 model's parameter itself), shaped like
    it, on the CPU; ``None`` for a 16-bit model without optimizer. Collective when sharded."""
    handled, value = _zero12(param, "fp32", True)
    if handled:
        return value
    slot = _slot(param)
    shard = _fp32_shard(slot)
    return None if shard is None else _full(slot, shard)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 gradient of ``param`` as the next step applies it (unscaled, clipped; the mean over
    the ranks), shaped like it, on the CPU; ``None`` when there is none (module docstring). Collective
    when sharded."""
    handled, value = _zero12(param, "grad", True)
    if handled:
        return value
    slot = _slot(param)
    found = _grad_shard(slot)
    return None if found is None else _full(slot, *found)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (``"exp_avg"`` or ``"exp_avg_sq"``) of
    ``param``, shaped like it, on the CPU; ``None`` before its first step. Collective when sharded."""
    handled, value = _zero12(param, optim_state_key, True)
    if handled:
        return value
    slot = _slot(param)
    shard = _state_shard(slot, _check_key(optim_state_key, slot.chunk.state_families))
    return None if shard is None else _full(slot, shard)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of :func:`safe_get_full_fp32_param` (flat fp32 CPU tensor; no collective)."""
    handled, value = _zero12(param, "fp32", False)
    if handled:
        return value
    slot = _slot(param)
    shard = _fp32_shard(slot)
    return None if shard is None else _to_fp32_cpu(_local_part(slot, shard))


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of :func:`safe_get_full_grad` (flat fp32 CPU tensor; no collective)."""
    handled, value = _zero12(param, "grad", False)
    if handled:
        return value
    slot = _slot(param)
    found = _grad_shard(slot)
    return None if found is None else _to_fp32_cpu(_local_part(slot, found[0]), found[1])


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of :func:`safe_get_full_optimizer_state` (flat fp32 CPU tensor; no collective)."""
    handled, value = _zero12(param, optim_state_key, False)
    if handled:
        return value
    slot = _slot(param)
    shard = _state_shard(slot, _check_key(optim_state_key, slot.chunk.state_families))
    return None if shard is None else _to_fp32_cpu(_local_part(slot, shard))


# ---- setters ----------------------------------------------------------------------------------------

def _check_value(slot: ParamSlot, value: Any, numel: int, shape: tuple[int, ...] | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError("value", type(value).__name__, "a floating-point tensor")
    if not value.is_floating_point() or value.is_meta:
        raise InvalidArgumentError("value", f"a tensor of dtype {value.dtype} on {value.device}",
                                   "a floating-point tensor with data")
    if shape is not None and tuple(value.shape) != shape:
        raise InvalidArgumentError("value", f"a tensor of shape {tuple(value.shape)}",
                                   f"a tensor of the parameter's shape {shape}")
    if value.numel() != numel:
        raise InvalidArgumentError("value", f"a tensor of {value.numel()} elements",
                                   f"{numel} elements (this rank's part of parameter {slot.name!r})")
    return value.detach().reshape(-1)


def _local_numel(slot: ParamSlot) -> int:
    run = slot.chunk.own_run(slot)
    return 0 if run is None else run[1] - run[0]


def _set_fp32(slot: ParamSlot, local: torch.Tensor) -> None:
    """Write this rank's part (``local``: its elements, flat) as the new fp32 value of the parameter."""
    chunk = slot.chunk
    chunk.host.check_no_step_in_flight(f"setting parameter {slot.name!r}")
    if chunk.param.holds_grads:
        raise UnsupportedOperationError(
            f"setting parameter {slot.name!r}: its memory holds the gradients of the last backward "
            f"(reuse_fp16_shard=True); call optim.step() or optim.zero_grad() first")
    run = chunk.own_run(slot)
    if run is None:
        return
    start, end, _ = run
    with torch.no_grad():
        if chunk.has_master and _read_family(chunk, MASTER) is not None:
            _write_family(chunk, MASTER, start, local.to(torch.float32))
        values = chunk.param.local().clone()
        values[start:end].copy_(local.to(torch.float32).to(chunk.dtype))
        chunk.host.write_params(chunk, values)
    bump_versions([slot.param])


def _set_state(slot: ParamSlot, key: str, local: torch.Tensor) -> None:
    slot.chunk.host.check_no_step_in_flight(f"setting {key!r} of parameter {slot.name!r}")
    if _state_shard(slot, key) is None:
        raise UnsupportedOperationError(
            f"setting {key!r} of parameter {slot.name!r}: it has no optimizer state before its first "
            f"optim.step() (torch.optim.Adam creates it there)")
    run = slot.chunk.own_run(slot)
    if run is not None:
        with torch.no_grad():
            _write_family(slot.chunk, key, run[0], local)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (shaped like ``param``, any float dtype) the parameter's fp32 value: the master
    becomes ``value`` in fp32, the 16-bit copy its rounding. Each rank writes its part; no collective."""
    slot = _slot(param)
    flat = _check_value(slot, value, slot.numel, tuple(slot.shape))
    part = slot.chunk.own_range(slot)
    if part is not None:
        _set_fp32(slot, flat[part[0]:part[1]])


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Make ``value`` (shaped like ``param``) the optimizer state ``optim_state_key`` of ``param``
    (after its first step). Each rank writes its part; no collective."""
    slot = _slot(param)
    key = _check_key(optim_state_key, slot.chunk.state_families)
    flat = _check_value(slot, value, slot.numel, tuple(slot.shape))
    part = slot.chunk.own_range(slot)
    _set_state(slot, key, flat[part[0]:part[1]] if part is not None else flat[:0])


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (as many elements as :func:`safe_get_local_fp32_param` returns) this rank's part
    of the parameter's fp32 value (the 16-bit copy gets its rounding)."""
    slot = _slot(param)
    _set_fp32(slot, _check_value(slot, value, _local_numel(slot), None))


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Make ``value`` (as many elements as :func:`safe_get_local_optimizer_state` returns) this rank's
    part of the optimizer state ``optim_state_key`` of ``param`` (after its first step)."""
    slot = _slot(param)
    key = _check_key(optim_state_key, slot.chunk.state_families)
    _set_state(slot, key, _check_value(slot, value, _local_numel(slot), None))
