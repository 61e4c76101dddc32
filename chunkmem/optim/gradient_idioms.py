"""torch's gradient idioms on the ``.grad`` of chunk-managed parameters, for one :class:`~chunkmem.ShardedOptimizerV2`.

A chunk-managed parameter's ``.grad`` is a :class:`~chunkmem.ChunkGradient` stand-in: the gradient itself
lives in its chunk, possibly multiplied by the loss scale (fp16) and sharded over ranks. What plain loops,
Hugging Face ``Trainer``, Accelerate and Lightning do with ``.grad`` reaches :meth:`GradientIdioms.run`:

=============================================  ========================================================
the use                                        what it does
=============================================  ========================================================
``torch.linalg.vector_norm(g, p)``,            the parameter's unscaled gradient norm over every rank,
``torch._foreach_norm(gs, p)``, ``g.norm(p)``  as a 0-d fp32 tensor. The first such call after a
                                               backward computes every parameter's norm in one pass
                                               over the chunks and one all-reduce; the others read it.
``g.mul_(c)``, ``torch._foreach_mul_(gs, c)``  records the factor ``c`` (a number or a one-element
                                               tensor) for those parameters. The step folds it into
                                               its update multiplier, the place it folds its own
                                               clipping, so the update is the one torch would make
                                               with the scaled gradient, without writing gradients.
``g.clamp_(min, max)``,                        clamps the gradient in its chunk (bounds in unscaled
``torch._foreach_clamp_min_/max_``             units): ``clip_grad_value_``.
any other read (``g.sum()``, ``g.clone()``,    runs on a copy of the unscaled gradient (times the
``print(g)``, ``g.float()``...)                recorded factors), for a chunk that is whole on this
                                               rank; refused for a sharded one (each rank holds a
                                               piece): read it with ``chunkmem.utils.safe_get_full_grad``
any other in-place change                      refused, naming ``clip_grad_norm_`` / ``optim.zero_grad()``
=============================================  ========================================================

So ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` returns torch's total norm (the norm
of the per-parameter norms: equal to the global norm within fp32 rounding) and the step applies torch's
``min(1, max_norm / (norm + 1e-6))``: the same training as plain PyTorch, within reassociation.

The step takes one factor for all gradients, so it refuses (:class:`~chunkmem.UnsupportedOperationError`,
nothing changed) gradients that were scaled by different factors (a ``clip_grad_norm_`` over some of the
parameters only: clip them all, or use ``optim.clip_grad_norm``), and a backward that added gradients
after they were scaled (torch would scale only the earlier ones: scale after the last backward).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..core.chunk import Chunk, ParamSlot
from ..core.param_guard import ChunkGradient, ParameterAccessError, plain_call, written_target
from ..distributed.collectives import reduce_over_groups
from ..errors import UnsupportedOperationError
from ..runtime.runtime import ChunkRuntime
from .backward_step import BackwardStep
from .mixed_precision import MixedPrecisionStep
from .norms import SUMMED_DTYPES, sum_of_squares

_NORMS = {"linalg_vector_norm", "_foreach_norm", "norm"}
_SCALINGS = {"mul_", "_foreach_mul_"}
_CLAMPS = {"clamp_", "_foreach_clamp_min_", "_foreach_clamp_max_", "clamp_min_", "clamp_max_"}


class GradientIdioms:
    """The stand-ins' side of one optimizer (see the module docstring).

    Args:
        runtime: the model's runtime (its gradients and backward and step counts).
        mixed: the optimizer's mixed-precision step (the loss scale, the step's multiplier, the factors folded
            into it, the groups a norm sums over).
        backward: what the backward started under ``step_in_backward`` (which refuses a rescaling it could not
            redo).
    """

    def __init__(self, runtime: ChunkRuntime, mixed: MixedPrecisionStep, backward: BackwardStep) -> None:
        self._runtime = runtime
        self._mixed = mixed
        self._backward = backward
        self._norms: dict[tuple[int, int, float], dict[int, float]] = {}  # (backward, step, p) -> slot -> norm

    # ---- what the step and the accessors ask -------------------------------------------------------

    def factor_of(self, slot: ParamSlot) -> float:
        """The factor torch's in-place idioms multiplied ``slot``'s gradient by since the backward."""
        return self._mixed.factors.get(id(slot), 1.0)

    def uniform_factor(self, chunks: list[Chunk]) -> float:
        """The one factor the coming step applies for the idioms: every parameter given a gradient has the
        same (see the module docstring for what is refused)."""
        mixed = self._mixed
        factors = mixed.factors
        if not factors:
            return 1.0
        self.check_scaled_last("optim.step()")
        # (a non-finite factor is one: clip_grad_norm_ of gradients that overflowed gives inf / inf, a NaN per
        # parameter, and the step then skips the update as torch's GradScaler would)
        seen = {_finite_or_nan(factors.get(id(slot), 1.0)) for chunk in chunks for slot in chunk.slots
                if slot.index_in_chunk in chunk.slots_with_grads}
        if len(seen) > 1 and any(math.isnan(f) for f in seen):
            seen = {f for f in seen if math.isnan(f)}
        if len(seen) > 1:
            raise UnsupportedOperationError(
                f"optim.step() with gradients scaled by different factors ({sorted(seen)[:4]}): torch's in-place "
                "idioms on .grad (clip_grad_norm_ over some of the parameters, .grad.mul_) reach the step as one "
                "factor for all gradients. Clip all the model's parameters at once "
                "(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)) or use optim.clip_grad_norm(max_norm)")
        return seen.pop() if seen else 1.0

    def check_scaled_last(self, action: str) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` (``action``: what is refused) if a backward added
        gradients to gradients already scaled in place: the factors recorded apply to the earlier ones only,
        so neither the step, a norm, a read nor another scaling can be what torch gives."""
        mixed = self._mixed
        if mixed.factors and mixed.factors_since != self._runtime.backward_count:
            raise UnsupportedOperationError(
                f"{action} after a backward that added gradients to gradients already scaled in place "
                "(clip_grad_norm_ or .grad.mul_ before that backward): torch would have scaled only the earlier "
                "ones, which the chunks cannot tell apart. Clip after the last backward of the step; call "
                "optim.zero_grad() to drop these gradients")

    # ---- the stand-ins ------------------------------------------------------------------------------

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """What ``func(*args, **kwargs)`` does when some argument is a stand-in (module docstring)."""
        name = getattr(func, "__name__", "")
        stand_ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, ChunkGradient)]
        self.check_scaled_last(f"{name} of the gradient of {stand_ins[0].slot.name!r}" if stand_ins else name)
        if name in _NORMS:
            return self._norm(name, args, kwargs)
        if name in _SCALINGS and isinstance(args[0], (ChunkGradient, list, tuple)) and len(args) == 2:
            return self._scale(args[0], args[1])
        if name in _CLAMPS:
            return self._clamp(name, args, kwargs)
        if any(isinstance(t, ChunkGradient) for t in tree_leaves(written_target(func, args, kwargs))):
            raise ParameterAccessError(
                f"{name} on the gradient of the chunk-managed parameter {stand_ins[0].slot.name!r}: gradients "
                "live in chunks; torch's clip_grad_norm_ / clip_grad_value_ (or .grad.mul_) work on them, "
                "optim.zero_grad() (or param.grad = None) drops them")
        copies = {id(g): self.value(g.slot) for g in stand_ins}
        swapped = tree_map(lambda t: copies.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        return plain_call(func, *swapped)

    def value(self, slot: ParamSlot) -> torch.Tensor:
        """A copy of the parameter's unscaled gradient (times the recorded factor), shaped like it, in its
        dtype, where its chunk's gradient rests; refused when the chunk is sharded."""
        chunk = slot.chunk
        if chunk.param.sharded:
            raise ParameterAccessError(
                f"reading the gradient of {slot.name!r}, whose chunk is sharded over {chunk.param.shards.world} "
                "ranks (this rank holds a piece of it): read it whole with chunkmem.utils.safe_get_full_grad(param) "
                "(every rank calls it), or this rank's piece with safe_get_local_grad(param); torch's "
                "clip_grad_norm_ / clip_grad_value_ work as they are")
        grad = self._runtime.grad_of(chunk)
        if grad is None or slot.index_in_chunk not in chunk.slots_with_grads:
            return torch.zeros(slot.shape, dtype=chunk.dtype)
        multiplier = self._mixed.multiplier * self.factor_of(slot)
        return slot.view(grad).to(torch.float32, copy=True).mul_(multiplier).to(chunk.dtype)

    def _norm(self, name: str, args: tuple, kwargs: dict) -> Any:
        grads = args[0] if name == "_foreach_norm" else [args[0]]
        p = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else 2.0))
        extra = {k: v for k, v in kwargs.items() if k not in ("ord", "p", "dtype") and v not in (None, False)}
        if len(args) > 2 or extra or not all(isinstance(g, ChunkGradient) for g in grads) or not (
                p == "fro" or _is_order(p)):
            raise ParameterAccessError(
                f"{name} of chunk-managed gradients with these arguments: the norm over every element (an order "
                "p in (0, inf], no dim) of each gradient is supported, as torch.nn.utils.clip_grad_norm_ takes it")
        order = 2.0 if p == "fro" else float(p)
        norms = self._slot_norms(order)
        out = []
        for g in grads:
            factor = self.factor_of(g.slot)
            if factor != 1.0 and self._as_torch():  # the norm of the scaled gradient, as torch rounds it
                norm = float(_torch_norm(self._runtime, g.slot, order, factor))
                out.append(torch.tensor(norm, dtype=torch.float32, device=g.device))
            else:
                out.append(torch.tensor(norms[id(g.slot)] * abs(factor), dtype=torch.float32, device=g.device))
        return out if name == "_foreach_norm" else out[0]

    def _as_torch(self) -> bool:
        """Whether norms and scalings can be torch's bit for bit: one process, no loss scale, fp32 gradients."""
        return not self._mixed.groups and self._mixed.loss_scale == 1.0 and all(
            c.dtype == torch.float32 for c in self._runtime.trainable_chunks())

    def _slot_norms(self, p: float) -> dict[int, float]:
        """Every trainable parameter's unscaled gradient norm of order ``p`` over the ranks (one all-reduce).

        In one process without a loss scale, an fp32 gradient's norm is the one torch computes of ``p.grad``
        (:func:`_torch_norm`), bit for bit, so that ``clip_grad_norm_`` clips by torch's coefficient."""
        runtime = self._runtime
        key = (runtime.backward_count, runtime.step_count, p)
        if key not in self._norms:
            self._norms.clear()
            slots = [s for c in runtime.trainable_chunks() for s in c.slots]
            if self._as_torch():
                norms = [_torch_norm(runtime, slot, p) for slot in slots]
                self._norms[key] = {id(s): v for s, v in zip(slots, _on_host(norms).tolist())}
                return self._norms[key]
            local = _on_host([_local_power_sum(runtime, slot, p) for slot in slots])
            maximum = math.isinf(p)
            local = reduce_over_groups(self._mixed.groups, local, maximum, "the gradient norms of clip_grad_norm_")
            totals = local if maximum else local.pow(1 / p)
            scale = self._mixed.loss_scale
            self._norms[key] = {id(s): totals[i].item() / scale for i, s in enumerate(slots)}
        return self._norms[key]

    def _scale(self, target: Any, factor: Any) -> Any:
        grads = list(target) if isinstance(target, (list, tuple)) else [target]
        if not all(isinstance(g, ChunkGradient) for g in grads):
            raise ParameterAccessError("_foreach_mul_ over chunk-managed gradients mixed with other tensors: "
                                       "scale the model's gradients in one call of their own")
        if isinstance(factor, (list, tuple)) or (isinstance(factor, torch.Tensor) and factor.numel() != 1):
            raise ParameterAccessError(
                "multiplying a chunk-managed gradient by a tensor of several elements: only a scalar factor (as "
                "clip_grad_norm_ applies) can be folded into the step")
        self._backward.check_can_rescale("scaling gradients in place (clip_grad_norm_, .grad.mul_)")
        value = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
        mixed = self._mixed
        as_torch = self._as_torch()
        for g in grads:
            earlier = mixed.factors.get(id(g.slot), 1.0)
            if earlier != 1.0 and as_torch:  # a second scaling: the first into the gradient, rounded as torch's
                self._fold(g.slot, earlier)
                earlier = 1.0
            mixed.factors[id(g.slot)] = earlier * value
        if mixed.factors_since is None:
            mixed.factors_since = self._runtime.backward_count
        return None if isinstance(target, (list, tuple)) else target

    def _fold(self, slot: ParamSlot, factor: float) -> None:
        """Multiply ``slot``'s gradient in its chunk by ``factor`` (recorded for it until now): torch rounds each
        in-place scaling of ``.grad`` to fp32, so a second one applies to the rounded product of the first."""
        grad = self._runtime.grad_of(slot.chunk)
        part = _local_part(slot, grad) if grad is not None else None
        if part is not None:
            part.mul_(factor)
        self._mixed.factors[id(slot)] = 1.0
        self._norms.clear()

    def _clamp(self, name: str, args: tuple, kwargs: dict) -> Any:
        grads = args[0] if name.startswith("_foreach") else [args[0]]
        if name in ("_foreach_clamp_min_", "clamp_min_"):
            low, high = args[1], None
        elif name in ("_foreach_clamp_max_", "clamp_max_"):
            low, high = None, args[1]
        else:
            low, high = kwargs.get("min", args[1] if len(args) > 1 else None), kwargs.get(
                "max", args[2] if len(args) > 2 else None)
        if any(isinstance(b, torch.Tensor) and b.numel() != 1 for b in (low, high)):
            raise ParameterAccessError("clamping a chunk-managed gradient by tensors of bounds: only numbers (as "
                                       "clip_grad_value_ passes) are supported")
        if self._backward.settings.step_in_backward:
            raise UnsupportedOperationError(
                "clamping gradients in place (clip_grad_value_) with step_in_backward=True: the backward already "
                "started the updates with the unclamped gradients; build the ShardedOptimizerV2 without "
                "step_in_backward to clamp gradients")
        for g in grads:
            slot = g.slot
            multiplier = self._mixed.multiplier * self.factor_of(slot)
            grad = self._runtime.grad_of(slot.chunk)
            part = _local_part(slot, grad) if grad is not None else None
            if part is None or part.numel() == 0 or multiplier == 0:
                continue
            bounds = [None if b is None else float(b) / multiplier for b in (low, high)]
            if multiplier < 0:
                bounds.reverse()
            part.clamp_(*bounds)
        self._norms.clear()
        return None if name.startswith("_foreach") else grads[0]


def _finite_or_nan(factor: float) -> float:
    return factor if math.isfinite(factor) else math.nan


def _is_order(p: Any) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0


def _local_part(slot: ParamSlot, shard: torch.Tensor) -> torch.Tensor | None:
    """The parameter's elements in this rank's shard of the chunk's gradient, or ``None``."""
    run = slot.chunk.own_run(slot)
    return None if run is None else shard[run[0]:run[1]]


def _on_host(values: list[float | torch.Tensor]) -> torch.Tensor:
    """``values`` (numbers, and 0-d tensors where the gradients rest) as one float64 CPU tensor: one copy to
    the host for the tensors of each device, not one wait per parameter."""
    local = torch.tensor([v if isinstance(v, float) else 0.0 for v in values], dtype=torch.float64)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        local[indices] = torch.stack([values[i] for i in indices]).cpu().double()
    return local


def _torch_norm(runtime: ChunkRuntime, slot: ParamSlot, p: float, factor: float = 1.0) -> float | torch.Tensor:
    """The parameter's gradient norm of order ``p`` as torch's ``clip_grad_norm_`` takes it of ``p.grad``
    (``torch.linalg.vector_norm`` in the gradient's dtype, so rounded as torch rounds it; of the gradient times
    ``factor``, the product rounded as torch's in-place scaling rounds it), where the rank holds the whole chunk
    and no loss scale multiplies it: a 0-d tensor where the gradient rests, or 0.0 for a parameter without a
    gradient."""
    chunk = slot.chunk
    if slot.index_in_chunk not in chunk.slots_with_grads:
        return 0.0
    grad = runtime.grad_of(chunk)
    part = None if grad is None else _local_part(slot, grad)
    if part is None or part.numel() == 0:
        return 0.0
    return torch.linalg.vector_norm(part if factor == 1.0 else part * factor, p)


def _local_power_sum(runtime: ChunkRuntime, slot: ParamSlot, p: float) -> float | torch.Tensor:
    """This rank's share of ``sum |g|**p`` (the max of ``|g|`` for p = inf) of the parameter's raw gradient,
    counted once over the ranks that hold the same copy (a replicated chunk on its first replica): a number,
    or a 0-d float64 tensor on the device where the gradient rests. A 2-norm of host gradients comes from
    :func:`~chunkmem.optim.norms.sum_of_squares` (exact squares, at the memory bandwidth)."""
    chunk = slot.chunk
    if slot.index_in_chunk not in chunk.slots_with_grads:
        return 0.0
    if chunk.replicas is not None and chunk.replicas.rank != 0:
        return 0.0
    grad = runtime.grad_of(chunk)
    part = None if grad is None else _local_part(slot, grad)
    if part is None or part.numel() == 0:
        return 0.0
    if p == 2.0 and part.device.type == "cpu" and part.dtype in SUMMED_DTYPES:
        return sum_of_squares(part)
    if math.isinf(p):
        return part.abs().max().double()
    return torch.linalg.vector_norm(part, p, dtype=torch.float64) ** p
