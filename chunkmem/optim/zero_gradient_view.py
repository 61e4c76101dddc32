"""``param.grad`` of the parameters a :class:`~chunkmem.LowLevelZeroOptimizer` trains (ZeRO-1/2).

The optimizer takes each gradient out of ``param.grad`` as autograd finishes it and reduces it over the
data-parallel ranks into a flat store per chunk: whole at stage 1, only this rank's shard at stage 2
(``partition_grad=True``), multiplied by the loss scale with fp16. In its place ``param.grad`` holds a
:class:`ZeroGradient`: a stand-in with the parameter's shape, dtype and device whose uses reach that
store, so that what plain loops, Hugging Face ``Trainer``, Accelerate and Lightning do with ``.grad``
gives plain PyTorch's numbers:

=============================================  ========================================================
the use                                        what it does
=============================================  ========================================================
``torch.linalg.vector_norm(g, p)``,            the parameter's unscaled gradient norm (of the mean over
``g.norm(p)``, ``torch._foreach_norm(gs, p)``  the ranks: the gradient the step applies), a 0-d fp32
                                               tensor on the parameter's device, for an order p in
                                               (0, inf]. The first such call after the gradients changed
                                               computes every parameter's norm in one pass; at stage 2
                                               over several ranks that pass ends with one all-reduce, so
                                               every rank makes the call (as every rank calls
                                               ``clip_grad_norm_``).
``g.mul_(c)``, ``g.div_(c)``, ``g *= c``,      multiplies (divides) the gradient in the store, ``c`` a
``torch._foreach_mul_`` / ``_foreach_div_``    number or a one-element tensor (at stage 2, this rank's
                                               part: every rank scales its own)
``g.clamp_(lo, hi)``, ``clamp_min_`` /         clamps the gradient in the store (bounds in unscaled
``clamp_max_``, ``torch._foreach_clamp_*_``    units). With fp16 an element that overflowed (inf/NaN)
                                               is left as it is, so the step still sees the overflow
                                               and skips, as ``GradScaler`` would have.
``g.zero_()``, ``torch._foreach_zero_``        zeros it in the store (the parameter still has a
                                               gradient, of zeros, as in torch)
``g.data``, ``g.detach()``                     ``g`` itself (an alias, as torch's)
any other read (``g.clone()``, ``g.sum()``,    runs on a copy of the unscaled gradient in the
``print(g)``, ``torch.save(g)``...)            parameter's dtype. Refused at stage 2 over several ranks
                                               (each rank holds a piece): read it with
                                               ``chunkmem.utils.safe_get_full_grad(param)``.
any other in-place change (``g.add_(x)``,      applied to that copy and written back into the store;
``g.copy_(x)``, ``g[i] = v``, ``g.data = x``)  refused at stage 2 over several ranks
=============================================  ========================================================

So ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` returns torch's total norm (unscaled:
the loss scale is accounted for) and scales the gradients the step applies, and ``clip_grad_value_``
clamps them: the training is plain PyTorch's within fp32 reassociation. A read gives a copy: an
in-place change of a piece of it (``g[0].zero_()``, ``g.view(-1).mul_(2)``) changes the copy only.

When ``param.grad`` is what: ``None`` until a backward gives the parameter a gradient (and for a
parameter no backward reached), then the stand-in until ``optim.zero_grad()`` or ``optim.step()`` (which
releases the gradients it used, as the reference does) sets it to ``None`` again; ``zero_grad(set_to_none=
False)`` keeps it, reading zeros. Setting ``param.grad = None`` (``model.zero_grad()``) drops that
parameter's gradient from the store, as in torch; assigning a tensor replaces it. A later backward
accumulates into the stand-in as autograd always does (its ``+=`` reaches ``__torch_dispatch__``, which
hands the new gradient to the optimizer): gradient accumulation is torch's sum. Inside ``no_sync()`` over
several ranks (with one it defers nothing: ``ZeroBackward.deferring``) the local gradients accumulate in
``param.grad`` as plain tensors (as under DDP); a parameter that already has a reduced gradient keeps its
stand-in, which then reads as the reduced gradient plus the local sum (DDP's ``p.grad``), and norms, clamps
and other in-place changes of it are refused until the backward outside ``no_sync`` reduces the sum (clip
after the last backward of the step). A stand-in kept past the gradient it stood for (after ``zero_grad``,
``step`` or a new ``param.grad``) refuses every use.

The reductions of a backward are complete when it ends (the optimizer waits for them in the backward's
final callback, ``overlap_communication`` included), so the stand-ins read finished stores.

What cannot be exact raises :class:`~chunkmem.UnsupportedOperationError` naming the alternative: the
optimizer's own clipping (``LowLevelZeroOptimizer(clip_grad_norm=max_norm)``; in a DeepSpeed config,
``"gradient_clipping": max_norm``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves, tree_map

from ..core.param_guard import METADATA_ATTRIBUTES, METADATA_METHODS, attribute_of, plain_call, written_target
from ..distributed.collectives import reduce_over_groups
from ..errors import UnsupportedOperationError

if TYPE_CHECKING:
    from .zero_gradient_store import GradientStores
    from .zero_partition import FlatSlot

OWN_CLIPPING = ("the optimizer's own clipping: LowLevelZeroOptimizer(clip_grad_norm=max_norm) (in a DeepSpeed "
                "config, \"gradient_clipping\": max_norm)")

# what a stand-in passes through as it is: the guards' metadata (chunkmem.core.param_guard), and the gradient's
# own attributes a gradient is asked for
_METADATA_ATTRIBUTES = METADATA_ATTRIBUTES | {"is_sparse_csr", "grad", "_grad", "_grad_fn", "retains_grad"}
_METADATA_METHODS = METADATA_METHODS | {"is_inference", "storage_offset"}
_NORMS = frozenset({"linalg_vector_norm", "_foreach_norm", "norm"})
_MULTIPLIES = frozenset({"mul_", "__imul__", "_foreach_mul_"})
_DIVIDES = frozenset({"div_", "__itruediv__", "__idiv__", "_foreach_div_"})
_CLAMPS = frozenset({"clamp_", "clip_", "clamp_min_", "clamp_max_", "_foreach_clamp_min_", "_foreach_clamp_max_"})
_ZEROS = frozenset({"zero_", "_foreach_zero_"})


class ZeroGradient(torch.Tensor):
    """What ``param.grad`` of a :class:`~chunkmem.LowLevelZeroOptimizer`'s parameter holds once a backward
    gave it a gradient: a stand-in with the parameter's shape, dtype and device for the gradient in the
    optimizer's store (reduced over the ranks, possibly sharded, scaled by the loss scale with fp16).
    torch's idioms work on it; :mod:`chunkmem.optim.zero_gradient_view` says what each does. ``slot``: where
    its parameter lives; ``pending``: this rank's local gradient that autograd added and the optimizer has
    not reduced yet (inside ``no_sync``), or ``None``."""

    slot: "FlatSlot"
    pending: torch.Tensor | None
    views: "GradientViews"

    @staticmethod
    def __new__(cls, views: "GradientViews", slot: "FlatSlot") -> "ZeroGradient":
        param = slot.param
        stand_in = torch.Tensor._make_wrapper_subclass(cls, slot.shape, dtype=param.dtype, device=param.device)
        stand_in.slot, stand_in.pending, stand_in.views = slot, None, views
        return stand_in

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        stand_ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, ZeroGradient)]
        return stand_ins[0].views.run(func, args, kwargs, stand_ins)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], ZeroGradient) else None
        if (func is torch.ops.aten.add_.Tensor and target is not None and len(args) == 2
                and not isinstance(args[1], ZeroGradient)):
            # autograd's AccumulateGrad adding a backward's gradient to the .grad it finds (gradient accumulation)
            target.views.accumulate(target, args[1], kwargs.get("alpha", 1))
            return target
        if func is torch.ops.aten.add.Tensor and target is not None:
            raise UnsupportedOperationError(
                f"backward(create_graph=True) adding to the gradient of {target.views.describe(target.slot)}, which a "
                "LowLevelZeroOptimizer holds in its store: call optim.zero_grad() before a backward that creates a "
                "graph of the gradients (or take them with torch.autograd.grad)")
        raise UnsupportedOperationError(
            f"{func} on a LowLevelZeroOptimizer's gradient stand-in below torch's Python API (inside "
            "DisableTorchFunctionSubclass or a compiled region): read param.grad in eager code "
            "(chunkmem.optim.zero_gradient_view says what works)")


class GradientViews:
    """The stand-ins' side of one :class:`~chunkmem.LowLevelZeroOptimizer` (module docstring): which
    parameter has one, what each use of them does to the optimizer's stores."""

    def __init__(self, stores: "GradientStores") -> None:
        self._stores = stores
        self._current: dict[int, ZeroGradient] = {}  # slot.index -> its stand-in while its gradient lives
        self._version = 0  # bumped whenever a store may have changed (the norms' cache key)
        self._norms: tuple[tuple[int, float], dict[int, torch.Tensor]] | None = None

    # ---- what the optimizer calls -------------------------------------------------------------------

    def current(self, slot: "FlatSlot") -> ZeroGradient | None:
        """``slot``'s stand-in while its gradient is in the store, else ``None``."""
        return self._current.get(slot.index)

    def install(self, slot: "FlatSlot") -> None:
        """``slot``'s gradient is in the store now: ``param.grad`` is its stand-in (the same object as long
        as the gradient lives, so a reference to ``p.grad`` kept over an accumulating backward stays valid)."""
        stand_in = self._current.get(slot.index)
        if stand_in is None:
            stand_in = self._current[slot.index] = ZeroGradient(self, slot)
        stand_in.pending = None
        slot.param.grad = stand_in
        self.changed()

    def settle(self, slot: "FlatSlot", take: bool) -> torch.Tensor | None:
        """Bring ``slot``'s store in line with ``param.grad`` and return the local gradient to reduce
        (``take``: outside ``no_sync``), or ``None``. ``param.grad`` is the truth: set to ``None`` or
        to another tensor by the user, the stand-in's gradient is dropped from the store (a tensor then is
        the new local gradient); the stand-in itself gives what autograd added to it."""
        grad = slot.param.grad
        mine = self._current.get(slot.index)
        if grad is not None and grad is mine:
            if not take:
                return None
            pending, mine.pending = mine.pending, None
            return pending
        if isinstance(grad, ZeroGradient):
            raise UnsupportedOperationError(
                f"the .grad of {self.describe(slot)} holds a gradient stand-in of a gradient already dropped "
                "(kept from before optim.zero_grad() or optim.step(), or of another parameter): set it to None or "
                "to a tensor")
        if mine is not None:  # the user set param.grad: its gradient in the store is gone
            self.drop(slot)
        return grad if take else None

    def drop(self, slot: "FlatSlot") -> None:
        """Forget ``slot``'s gradient: zero its part of the store; the step does not update it."""
        part = self._stores.grad_part(slot)
        if part is not None:
            part.zero_()
        slot.chunk.slots_with_grads.discard(slot.index_in_chunk)
        self._current.pop(slot.index, None)
        self.changed()

    def clear(self, keep: bool) -> None:
        """The stores were dropped (``keep=False``) or zeroed (``keep``: the stand-ins stay, reading zeros)."""
        if keep:
            for stand_in in self._current.values():
                stand_in.pending = None
        else:
            self._current.clear()
        self.changed()

    def changed(self) -> None:
        """The stores may hold other values now: norms are computed again."""
        self._version += 1
        self._norms = None

    def accumulate(self, stand_in: ZeroGradient, grad: torch.Tensor, alpha: Any) -> None:
        """autograd adds ``grad`` (times ``alpha``) to ``stand_in``: keep it as local, unreduced gradient
        until the optimizer takes it (at once after the backward, or outside ``no_sync``)."""
        self._check_live(stand_in, "a backward adding to it")
        grad = grad if alpha == 1 else grad * alpha
        stand_in.pending = grad if stand_in.pending is None else stand_in.pending + grad
        self.changed()

    def describe(self, slot: "FlatSlot") -> str:
        return f"the parameter at index {slot.index} of the optimizer's param groups (shape {tuple(slot.shape)})"

    # ---- torch functions on stand-ins ---------------------------------------------------------------

    def run(self, func: Any, args: tuple, kwargs: dict, stand_ins: list[ZeroGradient]) -> Any:
        """What ``func(*args, **kwargs)`` does when some argument is a stand-in (module docstring)."""
        name = getattr(func, "__name__", "")
        attribute = attribute_of(func)
        if attribute is not None:
            return self._attribute_use(func, attribute, args, kwargs, stand_ins)
        if name in _METADATA_METHODS:
            return plain_call(func, args, kwargs)
        if name in ("detach", "detach_") and args and isinstance(args[0], ZeroGradient):
            return args[0]
        if name == "__repr__" and isinstance(args[0], ZeroGradient) and (
                self._stores.grads_sharded or not self._live(args[0])):
            why = ("dropped: read param.grad again" if not self._live(args[0]) else
                   f"sharded over {self._stores.shards.world} ranks: chunkmem.utils.safe_get_full_grad(param) "
                   "reads it")
            return f"ZeroGradient({self.describe(args[0].slot)}, dtype={args[0].dtype}, {why})"
        for stand_in in stand_ins:
            self._check_live(stand_in, name)
        if name in _NORMS:
            return self._norm(name, args, kwargs)
        if name in _ZEROS and len(args) == 1 and not kwargs:
            return self._zero(name, args[0])
        if name in _MULTIPLIES | _DIVIDES and _scalar_arguments(name, args, kwargs):
            return self._scale(name, args[0], args[1])
        if name in _CLAMPS and _scalar_arguments(name, args, kwargs):
            return self._clamp(name, args, kwargs)
        targets = [t for t in tree_leaves(written_target(func, args, kwargs)) if isinstance(t, ZeroGradient)]
        if targets:
            return self._write(func, name, args, kwargs, targets, stand_ins)
        return self._read(func, args, kwargs, stand_ins)

    def value(self, stand_in: ZeroGradient) -> torch.Tensor:
        """A copy of the gradient ``stand_in`` stands for: unscaled, in the parameter's dtype, shaped like it
        (the reduced gradient plus what autograd added since, inside ``no_sync``)."""
        stores, slot = self._stores, stand_in.slot
        if stores.grads_sharded:
            raise UnsupportedOperationError(
                f"reading the gradient of {self.describe(slot)}: at ZeRO stage 2 (partition_grad=True) over "
                f"{stores.shards.world} ranks each rank holds a piece of it. Read it whole with "
                "chunkmem.utils.safe_get_full_grad(param) (every rank calls it) or this rank's piece with "
                "safe_get_local_grad(param); torch.nn.utils.clip_grad_norm_ and clip_grad_value_ work as they are")
        part = stores.grad_part(slot)
        out = (torch.zeros(slot.numel, dtype=torch.float32, device=slot.param.device) if part is None
               else part.to(torch.float32, copy=True))
        if stand_in.pending is not None:
            out.add_(stand_in.pending.reshape(-1).to(out.device, torch.float32))
        if stores.loss_scale != 1.0:
            out.div_(stores.loss_scale)
        return out.view(slot.shape).to(slot.param.dtype)

    def _attribute_use(self, func: Any, attribute: tuple[str, str], args: tuple, kwargs: dict,
                       stand_ins: list[ZeroGradient]) -> Any:
        name, kind = attribute
        if kind == "get":
            if name in _METADATA_ATTRIBUTES:
                return plain_call(func, args, kwargs)
            if name == "data":
                return args[0]
        elif name == "requires_grad":
            return plain_call(func, args, kwargs)
        elif name == "data":
            self._check_live(args[0], "setting .data")
            if tuple(args[1].shape) != tuple(args[0].shape):
                raise UnsupportedOperationError(
                    f"setting .grad.data of {self.describe(args[0].slot)} to a tensor of shape "
                    f"{tuple(args[1].shape)}: the gradient keeps the parameter's shape")
            return self._write(func, "data", args, kwargs, [args[0]], stand_ins)
        else:
            raise UnsupportedOperationError(
                f"setting .{name} of the gradient of {self.describe(args[0].slot)} (a LowLevelZeroOptimizer's "
                "gradient stand-in)")
        for stand_in in stand_ins:
            self._check_live(stand_in, f".{name}")
        return self._read(func, args, kwargs, stand_ins)

    def _live(self, stand_in: ZeroGradient) -> bool:
        """Whether ``stand_in`` still stands for its parameter's gradient (its ``.grad``, not dropped)."""
        slot = stand_in.slot
        return self._current.get(slot.index) is stand_in and slot.param.grad is stand_in

    def _check_live(self, stand_in: ZeroGradient, what: str) -> None:
        slot = stand_in.slot
        if not self._live(stand_in):
            raise UnsupportedOperationError(
                f"{what} on a .grad of {self.describe(slot)} kept from before its gradient was dropped "
                "(optim.zero_grad(), optim.step(), which releases the gradients, or a new param.grad): read "
                "param.grad again")

    def _refuse_pending(self, stand_ins: list[ZeroGradient], what: str) -> None:
        for stand_in in stand_ins:
            if stand_in.pending is not None:
                raise UnsupportedOperationError(
                    f"{what} on the gradient of {self.describe(stand_in.slot)}, which holds a reduced gradient "
                    "plus local gradients of backwards inside no_sync() not reduced yet: torch's result would "
                    "differ from rank to rank. Clip after the last backward of the step, outside no_sync(), or "
                    f"use {OWN_CLIPPING}")

    def _read(self, func: Any, args: tuple, kwargs: dict, stand_ins: list[ZeroGradient]) -> Any:
        copies = {id(s): self.value(s) for s in stand_ins}
        swapped = tree_map(lambda t: copies.get(id(t), t) if isinstance(t, ZeroGradient) else t, (args, kwargs))
        with DisableTorchFunctionSubclass():
            return func(*swapped[0], **swapped[1])

    def _write(self, func: Any, name: str, args: tuple, kwargs: dict, targets: list[ZeroGradient],
               stand_ins: list[ZeroGradient]) -> Any:
        if self._stores.grads_sharded:
            raise UnsupportedOperationError(
                f"{name} on the gradient of {self.describe(targets[0].slot)}: at ZeRO stage 2 (partition_grad=True) "
                f"over {self._stores.shards.world} ranks each rank holds a piece of it; in place, only "
                "mul_/div_ by a number, clamp_ and zero_ (what clip_grad_norm_ and clip_grad_value_ do) work. "
                f"Clip with torch.nn.utils.clip_grad_norm_ or {OWN_CLIPPING}")
        self._refuse_pending(stand_ins, name)
        copies = {id(s): self.value(s) for s in stand_ins}
        swapped = tree_map(lambda t: copies.get(id(t), t) if isinstance(t, ZeroGradient) else t, (args, kwargs))
        with DisableTorchFunctionSubclass():
            result = func(*swapped[0], **swapped[1])
        for target in targets:
            self._store(target, copies[id(target)])
        back = {id(copies[id(s)]): s for s in stand_ins}
        return tree_map(lambda t: back.get(id(t), t) if isinstance(t, torch.Tensor) else t, result)

    def _store(self, stand_in: ZeroGradient, value: torch.Tensor) -> None:
        """Write an unscaled value of the whole gradient into the store."""
        stores = self._stores
        part = stores.grad_part(stand_in.slot)
        if part is None:
            return
        value = value.detach().reshape(-1).to(part.device, torch.float32)
        part.copy_(value * stores.loss_scale if stores.loss_scale != 1.0 else value)
        self.changed()

    def _norm(self, name: str, args: tuple, kwargs: dict) -> Any:
        tensors = list(args[0]) if name == "_foreach_norm" else [args[0]]
        order = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else 2.0))
        dtype = kwargs.get("dtype")
        extra = {k: v for k, v in kwargs.items() if k not in ("ord", "p", "dtype") and v not in (None, False)}
        if order is None or order == "fro":
            order = 2.0
        if len(args) > 2 or extra or isinstance(order, (bool, str)) or not isinstance(order, (int, float)) \
                or not order > 0:
            raise UnsupportedOperationError(
                f"{name} of a LowLevelZeroOptimizer's gradient with these arguments: the norm over every element "
                "(an order p in (0, inf], no dim, no out) is supported, as torch.nn.utils.clip_grad_norm_ takes it")
        order = float(order)
        ours = [t for t in tensors if isinstance(t, ZeroGradient)]
        self._refuse_pending(ours, name)
        table = self._slot_norms(order) if ours else {}
        out = []
        for t in tensors:
            if isinstance(t, ZeroGradient):
                norm = table[t.slot.index].clone()
                out.append(norm if dtype is None else norm.to(dtype))
            else:
                with DisableTorchFunctionSubclass():
                    out.append(torch.linalg.vector_norm(t, order, dtype=dtype))
        return out if name == "_foreach_norm" else out[0]

    def _slot_norms(self, order: float) -> dict[int, torch.Tensor]:
        """Every parameter's unscaled gradient norm of ``order`` (one pass; at stage 2 over several ranks,
        one all-reduce), as 0-d fp32 tensors on the parameters' device, by parameter index."""
        key = (self._version, order)
        if self._norms is not None and self._norms[0] == key:
            return self._norms[1]
        stores = self._stores
        slots = [s for c in stores.chunks for s in c.slots if s.index_in_chunk in c.slots_with_grads]
        device = stores.chunks[0].param.device
        norms = []
        for slot in slots:
            part = stores.grad_part(slot)
            if part is None or part.numel() == 0:
                norms.append(torch.zeros((), dtype=torch.float32, device=device))
            else:
                norms.append(torch.linalg.vector_norm(part, order, dtype=torch.float32))
        local = torch.stack(norms).double() if norms else torch.zeros(0, dtype=torch.float64, device=device)
        if stores.grads_sharded:
            local = _reduce_norms(stores.mixed.groups, local, order)
        totals = (local / stores.loss_scale).float()
        self._norms = (key, {s.index: totals[i] for i, s in enumerate(slots)})
        return self._norms[1]

    def _scale(self, name: str, target: Any, factor: Any) -> Any:
        divide = name in _DIVIDES
        tensors = list(target) if name.startswith("_foreach") else [target]
        factors = list(factor) if isinstance(factor, (list, tuple)) else [factor] * len(tensors)
        for t, f in zip(tensors, factors):
            if not isinstance(t, ZeroGradient):
                with DisableTorchFunctionSubclass():
                    t.div_(f) if divide else t.mul_(f)
                continue
            if isinstance(f, torch.Tensor):
                f = f.detach().reshape(())
            part = self._stores.grad_part(t.slot)
            if part is not None and part.numel():
                f_here = f.to(part.device) if isinstance(f, torch.Tensor) else f
                part.div_(f_here) if divide else part.mul_(f_here)
            if t.pending is not None:
                f_here = f.to(t.pending.device) if isinstance(f, torch.Tensor) else f
                t.pending = t.pending / f_here if divide else t.pending * f_here
        self.changed()
        return None if name.startswith("_foreach") else target

    def _zero(self, name: str, target: Any) -> Any:
        for t in (list(target) if name.startswith("_foreach") else [target]):
            if not isinstance(t, ZeroGradient):
                with DisableTorchFunctionSubclass():
                    t.zero_()
                continue
            part = self._stores.grad_part(t.slot)
            if part is not None:
                part.zero_()
            t.pending = None
        self.changed()
        return None if name.startswith("_foreach") else target

    def _clamp(self, name: str, args: tuple, kwargs: dict) -> Any:
        foreach = name.startswith("_foreach")
        tensors = list(args[0]) if foreach else [args[0]]
        if name.endswith("clamp_min_"):
            bounds = [(b, None) for b in _each(args[1] if len(args) > 1 else kwargs.get("min"), len(tensors))]
        elif name.endswith("clamp_max_"):
            bounds = [(None, b) for b in _each(args[1] if len(args) > 1 else kwargs.get("max"), len(tensors))]
        else:
            low = args[1] if len(args) > 1 else kwargs.get("min")
            high = args[2] if len(args) > 2 else kwargs.get("max")
            bounds = [(low, high)]
        self._refuse_pending([t for t in tensors if isinstance(t, ZeroGradient)], name)
        stores = self._stores
        scale = stores.loss_scale
        for t, (low, high) in zip(tensors, bounds):
            low = None if low is None else float(low)
            high = None if high is None else float(high)
            if not isinstance(t, ZeroGradient):
                with DisableTorchFunctionSubclass():
                    t.clamp_(low, high)
                continue
            part = stores.grad_part(t.slot)
            if part is None or part.numel() == 0:
                continue
            if scale == 1.0:
                part.clamp_(low, high)
                continue
            # in the store's scaled units; an overflowed element stays inf/NaN so that the step skips
            wide = part.float()
            clamped = wide.clamp(None if low is None else low * scale, None if high is None else high * scale)
            part.copy_(torch.where(torch.isfinite(wide), clamped, wide))
        self.changed()
        return None if foreach else args[0]


def _is_scalar(value: Any) -> bool:
    if isinstance(value, ZeroGradient):
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float))


def _scalar_arguments(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call's arguments after the target are numbers or one-element tensors (one per target in
    a foreach list), with no other keyword than a clamp's bounds."""
    if not args or any(k not in ("min", "max") for k in kwargs) or (kwargs and name not in _CLAMPS):
        return False
    rest = list(args[1:]) + list(kwargs.values())
    if name in _MULTIPLIES | _DIVIDES and len(args) != 2:
        return False
    if name in _CLAMPS and not rest:
        return False
    count = len(args[0]) if name.startswith("_foreach") and isinstance(args[0], (list, tuple)) else 1
    for value in rest:
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        if isinstance(value, (list, tuple)) and len(values) != count:
            return False
        if not all(_is_scalar(v) for v in values):
            return False
    return True


def _each(value: Any, count: int) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * count


def _reduce_norms(groups: list[Any], local: torch.Tensor, order: float) -> torch.Tensor:
    """Per-parameter norms of this rank's pieces -> norms of the whole gradients, over the ranks."""
    what = "the gradient norms of clip_grad_norm_"
    if math.isinf(order):
        return reduce_over_groups(groups, local, True, what)
    return reduce_over_groups(groups, local.pow(order), False, what).pow(1.0 / order)
