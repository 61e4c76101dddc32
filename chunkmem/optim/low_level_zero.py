"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 over a plain module's parameters.

The module stays an ordinary module (replicated parameters, no hooks that move them). What is sharded
over the data-parallel ranks is the optimizer's: the fp32 masters and optimizer state (stage 1) and, with
``partition_grad=True``, the gradients (stage 2). With ``cpu_offload=True`` the masters and moments
live on the host and chunkmem's host Adam kernel updates them (ZeRO-Offload). Layout:
:mod:`chunkmem.optim.zero_partition`; gradient reduction: :mod:`chunkmem.optim.zero_buckets`.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn

from .adam import check_supported_optimizer, hyper_of_group, params_mismatch, runs_adam_kernel
from .any_optimizer import (LayoutWatch, ParamView, StateLayout, check_elementwise, probe_state,
                            step_parameters)
from .adam_kernels import adam_update_, param_spans
from ..distributed.agreement import (ARGUMENTS, HYPER_PARAMETERS_FIELD, LayoutDescription, ParamRecord, agree,
                                    agree_on_point, held_on_any_rank, hyper_parameter_digest, refuse_together)
from ..distributed.collectives import ShardGroup, start_all_gather
from ..core.chunk import ADAM_STATE
from ..core.layout import join_runs
from ..errors import (ChunkmemError, InvalidArgumentError, UnscaledBackwardError, UnsupportedOperationError,
                      check_choice, check_number, check_type, warn_renamed)
from .closure import run_closure
from .loss_scaler import DynamicGradScaler
from .mixed_precision import MixedPrecisionStep
from .sealed import seal_param_groups
from ..core.param_guard import slot_of
from ..state_dicts import check_tensor_data
from .zero_buckets import GradientBuckets
from .zero_gradient_view import GradientViews
from .zero_partition import FlatChunk, FlatSlot, build_partition

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_OPTIMIZER_OF: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, its optimizer), both weak


def optimizer_of(param: nn.Parameter) -> "LowLevelZeroOptimizer | None":
    """The :class:`LowLevelZeroOptimizer` that trains ``param`` (the last one built over it), or ``None``."""
    found = _OPTIMIZER_OF.get(id(param))
    if found is None or found[0]() is not param:
        return None
    return found[1]()


class LowLevelZeroOptimizer:
    """ZeRO-1/2 mixed-precision training of a plain module's parameters with Adam (chunkmem's kernel) or
    any other torch optimizer (its own step on this rank's shard; :mod:`chunkmem.optim.any_optimizer`).

    Build the model as usual (parameters in fp16, bf16 or fp32, all on one device), then wrap its Adam::

        optim = LowLevelZeroOptimizer(HybridAdam(model.parameters(), lr=1e-3), partition_grad=True)
        optim.backward(loss_fn(model(x), y))   # scales the loss (fp16), reduces the gradients
        optim.step()
        optim.zero_grad()

    The parameters are packed into flat chunks (every rank holds them whole; each parameter becomes a
    view into its chunk) and each rank owns an equal contiguous shard of every chunk: it keeps the fp32
    master, ``exp_avg`` and ``exp_avg_sq`` of that shard only, updates it, and all-gathers the updated
    parameters after the step. Gradients are reduced (mean over the ranks) in buckets during the
    backward and kept in a store per chunk: whole (stage 1) or only this rank's shard (stage 2); they
    are complete when the backward ends. ``param.grad`` then holds a :class:`~chunkmem.ZeroGradient`
    stand-in for the gradient in the store, on which torch's idioms work
    (``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` returns the unscaled norm and clips what the
    step applies, ``clip_grad_value_``, reads; ``None`` where torch's ``.grad`` is ``None``):
    :mod:`chunkmem.optim.zero_gradient_view`. A step updates the parameters that require grad and were given
    a gradient since the last step (on any rank); one without (a branch not taken) or whose ``requires_grad``
    is ``False`` at the step is left alone (no weight decay, no moment update, as torch's optimizers leave a
    parameter without a gradient): its step count, and another optimizer's scalar state (NAdam's
    ``mu_product``, ...), stay, both per parameter as torch keeps them. A parameter frozen when the optimizer
    is built has no master and cannot be trained: if it requires grad at a step, :meth:`step` raises
    :class:`~chunkmem.UnsupportedOperationError`. All ranks must run the same backward graph (the buckets are
    filled in the order autograd finishes gradients). It is not a ``torch.optim.Optimizer``: attach
    learning-rate schedulers to the wrapped optimizer, whose param groups are the ones read.

    Loss scaling applies to fp16 working parameters only (bf16 and fp32 train unscaled and never skip):
    with fp16, backward must go through :meth:`backward`. A step whose gradients hold inf/NaN on any
    rank is skipped on every rank with nothing changed (the gradients are dropped) and the scale backs
    off.

    Args:
        optimizer: a :class:`~chunkmem.HybridAdam` / :class:`~chunkmem.CPUAdam`, ``torch.optim.Adam`` or
            ``torch.optim.AdamW`` (plain options: the Adam kernel), or another ``torch.optim.Optimizer``
            over the parameters (its own step runs on views of this rank's fp32 masters, its per-element
            state one fp32 shard per chunk and key, as in :class:`~chunkmem.ShardedOptimizerV2`: see
            :mod:`chunkmem.optim.any_optimizer`; with several ranks only elementwise ones, as the rank
            holds pieces of parameters); its param groups give the hyper-parameters, read at every
            step. Its own ``step`` must not be called.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale:
            the :class:`~chunkmem.DynamicGradScaler` rules (defaults: 2**16, 1, 2, 0.5, 2000, 2, 2**24).
        clip_grad_norm: clip the unscaled gradients to this global 2-norm before the update (0: no
            clipping); a finite number >= 0.
        verbose: print skipped steps.
        reduce_bucket_size: gradient elements (not bytes) collected before one reduction collective is
            started; an integer >= 1.
        communication_dtype: dtype of the reduction collectives (``None``: the working dtype);
            torch.float16, torch.bfloat16 or torch.float32.
        overlap_communication: start each bucket's collective asynchronously and wait for all of them at
            the end of the backward, so communication overlaps the rest of the backward.
        partition_grad: stage 2: keep only this rank's shard of the gradients (reduce-scatter instead of
            all-reduce).
        cpu_offload: keep the fp32 masters and Adam moments on the host and update them with the host
            Adam kernel; the working parameters stay where the module is.
        forced_dtype: cast the working parameters to this dtype (torch.float16, torch.bfloat16 or
            torch.float32; ``None``: keep the parameters' dtype, which must be the same for all). The
            fp32 masters start from the values before the cast. Inputs must then match it: the module is
            not wrapped.
        dp_process_group: the data-parallel group (``None``: the default group once
            ``torch.distributed`` is initialised, else one process). Keyword only.
        grad_accum_dtype: (addition) what 16-bit gradients of several backwards are summed in: ``None`` or
            ``torch.float32`` (default: a store holding an earlier backward's sum is widened to fp32, 2 more
            bytes an element while accumulating), or the parameters' dtype (summed in it). Inside
            :meth:`no_sync` the gradients accumulate in ``param.grad`` as autograd sums them. Keyword only.

    A wrong type raises :class:`~chunkmem.ArgumentTypeError`, a value out of range
    :class:`~chunkmem.InvalidArgumentError`; nothing is changed then.
    """

    def __init__(self, optimizer: Any, initial_scale: float = 2**16, min_scale: float = 1,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 hysteresis: int = 2, max_scale: float = 2**24, clip_grad_norm: float = 0.0, verbose: bool = False,
                 reduce_bucket_size: int = 1024 * 1024, communication_dtype: torch.dtype | None = None,
                 overlap_communication: bool = False, partition_grad: bool = False, cpu_offload: bool = False,
                 forced_dtype: torch.dtype | None = None, *, dp_process_group: Any = None,
                 grad_accum_dtype: torch.dtype | None = None) -> None:
        scaler, shards, groups, layout = self._checked(
            optimizer, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
            clip_grad_norm, verbose, reduce_bucket_size, communication_dtype, overlap_communication, partition_grad,
            cpu_offload, forced_dtype, dp_process_group, grad_accum_dtype)
        for params in groups:
            for p in params:
                p._low_level_zero = True  # type: ignore[attr-defined]
        trainable = [p for group in groups for p in group]
        dtype = forced_dtype or trainable[0].dtype
        _agree_on_settings(shards, groups, dict(
            optimizer=type(optimizer).__name__, dtype=dtype, communication_dtype=communication_dtype or dtype,
            reduce_bucket_size=reduce_bucket_size,
            overlap_communication=overlap_communication, partition_grad=partition_grad, cpu_offload=cpu_offload,
            clip_grad_norm=clip_grad_norm,
            loss_scaler=(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                         max_scale) if dtype == torch.float16 else None))
        for p in trainable:
            p._low_level_zero = True  # type: ignore[attr-defined]
        device = trainable[0].device
        master_device = torch.device("cpu") if cpu_offload else device
        separate = dtype != torch.float32 or master_device != device

        self.optim = optimizer
        seal_param_groups(optimizer, "LowLevelZeroOptimizer")
        self.mixed = MixedPrecisionStep(scaler if dtype == torch.float16 else None,
                                        (shards.group if shards.sharded else None,), verbose)
        self.clip_grad_norm = float(clip_grad_norm)
        self.verbose = verbose
        self.reduce_bucket_size = reduce_bucket_size
        self.communication_dtype = communication_dtype or dtype
        self.overlap_communication = overlap_communication
        self.partition_grad = partition_grad
        self.cpu_offload = cpu_offload
        self.dtype = dtype
        self._accumulate_in_fp32 = grad_accum_dtype in (None, torch.float32) and dtype != torch.float32
        # backwards begun so far: a store last added to in an earlier one holds that backward's sum (the reductions
        # of one backward may complete after it ends, with overlap_communication)
        self._backwards_begun = 0
        self.dp_process_group = dp_process_group
        self.shards = shards
        self.separate_master = separate
        self._layout = layout  # None: the Adam kernel; else any_optimizer's stand-in step
        self._layout_watch = None if layout is None else LayoutWatch(optimizer, layout, "LowLevelZeroOptimizer")
        self.chunks = build_partition(groups, dtype, shards.world, shards.rank, master_device, separate,
                                      ADAM_STATE if layout is None else layout.families)
        if layout is not None:
            optimizer.state.clear()  # what its constructor made (Adagrad's sums): the chunks keep the state
        self._slot_of = {id(s.param): s for c in self.chunks for s in c.slots}
        self._index_of = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._index_of.setdefault(id(p), len(self._index_of))
        for slot in self._slot_of.values():
            slot.index = self._index_of[id(slot.param)]
        self._params = [p for group in optimizer.param_groups for p in group["params"]]  # index order
        # frozen when built: no place in the chunks, no master; they cannot be trained later
        self._not_packed = [(i, p) for i, p in enumerate(self._params) if id(p) not in self._slot_of]
        self.buckets = GradientBuckets(shards, partition_grad, self.communication_dtype, reduce_bucket_size,
                                       overlap_communication, self._grad_store)
        self._no_sync = False
        self._in_backward = False
        self._unscaled_backward = False
        self.grads_pending = False
        self._backwards = 0  # backward passes with gradients so far
        self._steps = 0  # step() calls so far
        self._backward_agreed = False  # the running backward's agreement ran
        self._views = GradientViews(self)  # param.grad: stand-ins for the gradients in the stores
        self._hooks = [slot.param.register_post_accumulate_grad_hook(self._on_grad)
                       for slot in self._slot_of.values()]
        for slot in self._slot_of.values():
            _OPTIMIZER_OF[id(slot.param)] = (weakref.ref(slot.param), weakref.ref(self))

    @classmethod
    def check_arguments(cls, optimizer: Any, *, cast_to: torch.dtype | None = None, **kwargs: Any) -> None:
        """Raise as ``LowLevelZeroOptimizer(optimizer, **kwargs)`` would, with nothing built and nothing
        changed. ``cast_to``: check the floating-point parameters as they will be once their module is cast
        to this dtype (:func:`chunkmem.initialize` checks, then casts, then builds)."""
        bound = inspect.signature(cls.__init__).bind(None, optimizer, **kwargs)  # a TypeError for an unknown keyword
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        cls._checked(**arguments, cast_to=cast_to)

    @classmethod
    def _checked(cls, optimizer: Any, initial_scale: float, min_scale: float, growth_factor: float,
                 backoff_factor: float, growth_interval: int, hysteresis: int, max_scale: float, clip_grad_norm: float,
                 verbose: bool, reduce_bucket_size: int, communication_dtype: torch.dtype | None,
                 overlap_communication: bool, partition_grad: bool, cpu_offload: bool,
                 forced_dtype: torch.dtype | None, dp_process_group: Any, grad_accum_dtype: torch.dtype | None = None,
                 cast_to: torch.dtype | None = None
                 ) -> tuple[DynamicGradScaler, ShardGroup, list[list[nn.Parameter]], StateLayout | None]:
        """Every check of the constructor's arguments (nothing changed): the scaler, the data-parallel
        group, the trainable parameters per param group and what the optimizer keeps (``None``: Adam)."""
        shards = ShardGroup.of(dp_process_group, "dp_process_group")
        try:  # a rank refused here still meets the others' agreement (else they would wait for it)
            check_supported_optimizer(optimizer)
            scaler = DynamicGradScaler(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
                                       hysteresis, max_scale)
            check_number("clip_grad_norm", clip_grad_norm, low=0.0, finite=True)
            check_type("verbose", verbose, bool, "True or False")
            check_number("reduce_bucket_size", reduce_bucket_size, low=1, integer=True,
                         allowed="an integer >= 1 (gradient elements per reduction)")
            for name, value in (("communication_dtype", communication_dtype), ("forced_dtype", forced_dtype)):
                if value is not None:
                    check_choice(name, value, _DTYPES)
            for name, value in (("overlap_communication", overlap_communication), ("partition_grad", partition_grad),
                                ("cpu_offload", cpu_offload)):
                check_type(name, value, bool, "True or False")
            groups = cls._check_params(optimizer, forced_dtype, cast_to)
            dtype = forced_dtype or cast_to or groups[0][0].dtype
            if grad_accum_dtype not in (None, torch.float32, dtype):
                raise InvalidArgumentError("grad_accum_dtype", grad_accum_dtype,
                                           f"None or torch.float32 (16-bit gradients of several backwards summed in "
                                           f"fp32), or the parameters' dtype {dtype} (summed in it)")
            layout = None
            if not runs_adam_kernel(optimizer):
                layout = probe_state(optimizer)
                if shards.sharded:
                    check_elementwise(optimizer, "with several data-parallel ranks",
                                      "each rank owns pieces of parameters")
        except ChunkmemError as refused:
            refuse_together(shards, "LowLevelZeroOptimizer", refused)
        return scaler, shards, groups, layout

    @staticmethod
    def _check_params(optimizer: Any, forced_dtype: torch.dtype | None,
                      cast_to: torch.dtype | None = None) -> list[list[nn.Parameter]]:
        """The trainable parameters per param group, after checking them (nothing changed); ``cast_to``:
        the dtype the floating-point ones will have when the optimizer is built."""
        seen: set[int] = set()
        groups: list[list[nn.Parameter]] = []
        devices, dtypes = set(), set()
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if id(p) in seen:
                    raise InvalidArgumentError("optimizer", f"a parameter of shape {tuple(p.shape)} listed twice",
                                               "param_groups that hold each parameter once")
                seen.add(id(p))
                if slot_of(p) is not None or hasattr(p, "_low_level_zero"):
                    raise InvalidArgumentError("optimizer", f"a parameter of shape {tuple(p.shape)} already managed "
                                               "by chunkmem", "parameters of a plain module, not wrapped yet")
                if not p.requires_grad:
                    continue
                dtype = cast_to if cast_to is not None and (p.is_floating_point() or p.is_complex()) else p.dtype
                if dtype not in _DTYPES:
                    raise InvalidArgumentError("optimizer", f"a parameter of dtype {dtype}",
                                               "parameters of dtype torch.float16, torch.bfloat16 or torch.float32")
                devices.add(p.device)
                dtypes.add(dtype)
                params.append(p)
            groups.append(params)
        if not any(groups):
            raise InvalidArgumentError("optimizer", "an optimizer without trainable parameters",
                                       "an optimizer over at least one parameter that requires grad")
        if len(devices) > 1:
            raise InvalidArgumentError("optimizer", f"parameters on {sorted(map(str, devices))}",
                                       "parameters on one device")
        if forced_dtype is None and len(dtypes) > 1:
            raise InvalidArgumentError("forced_dtype", None, f"a dtype, as the parameters have several "
                                                             f"({sorted(map(str, dtypes))})")
        return groups

    # ---- torch.optim.Optimizer-like views ----------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (hyper-parameters are read from here at every step)."""
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optim.defaults

    @property
    def grad_scaler(self) -> DynamicGradScaler | None:
        """The loss scaler (fp16 working parameters), or ``None``."""
        return self.mixed.scaler

    @property
    def state_layout(self) -> StateLayout | None:
        """What the wrapped optimizer keeps per parameter, when it is not run by the Adam kernel (``None``:
        Adam's moments; see :mod:`chunkmem.optim.any_optimizer`)."""
        return self._layout

    @property
    def global_grad_norm(self) -> float | None:
        """The total norm of the unscaled gradients the last step computed (before clipping; inf or NaN
        when they overflowed), or ``None`` when it computed none (no clipping and no loss scaler)."""
        return self.mixed.last_norm

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler: bf16 and fp32)."""
        return self.mixed.loss_scale

    @property
    def grads_sharded(self) -> bool:
        """Whether each rank holds only its shard of the reduced gradients (stage 2 over several ranks)."""
        return self.partition_grad and self.shards.sharded

    def grad_part(self, slot: FlatSlot) -> torch.Tensor | None:
        """This rank's elements of ``slot``'s reduced gradient in its chunk's store, as a flat view (the whole
        parameter unless :attr:`grads_sharded`; possibly empty), in the store's units (times the loss
        scale with fp16); ``None`` while the chunk has no store."""
        store = slot.chunk.grad
        if store is None:
            return None
        if not self.partition_grad:
            return store[slot.offset:slot.offset + slot.numel]
        part = slot.owned()
        if part is None:
            return store[:0]
        start = slot.offset + part[0] - slot.chunk.own_start
        return store[start:start + part[1] - part[0]]

    # ---- backward ----------------------------------------------------------------------------------

    def _grad_store(self, chunk: FlatChunk) -> torch.Tensor:
        """Where ``chunk``'s reduced gradients of this backward are added: a 16-bit store holding an earlier
        backward's sum is widened to fp32 first (gradient accumulation summed in fp32, unless
        ``grad_accum_dtype`` is the parameters' dtype)."""
        if chunk.grad is None:
            if chunk.spare_grad is not None:  # memory already touched: no page faults, no allocator call
                chunk.grad, chunk.spare_grad = chunk.spare_grad.zero_(), None
            else:
                numel = chunk.shard_numel if self.partition_grad else chunk.numel
                chunk.grad = torch.zeros(numel, dtype=self.dtype, device=chunk.param.device)
        elif (self._accumulate_in_fp32 and chunk.grad_backward != self._backwards_begun
              and chunk.grad.dtype != torch.float32):
            chunk.grad = chunk.grad.float()
        chunk.grad_backward = self._backwards_begun
        return chunk.grad

    def _on_grad(self, param: nn.Parameter) -> None:
        """A parameter's gradient is final in this backward (autograd's hook): the first of a backward
        runs the ranks' agreement first, then the gradient goes to the buckets."""
        if not self._backward_agreed:
            self._backward_agreed = True
            self._backwards_begun += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            agree_on_point(self.shards, "backward", "LowLevelZeroOptimizer's backward",
                           [("backward passes so far", self._backwards), ("optimizer steps so far", self._steps),
                            ("inside no_sync", self._no_sync)])
        self._take_grad(param)

    def _backward_ended(self) -> None:
        """The backward's final callback (every rank runs the same backward): its reductions complete here,
        ``loss.backward()`` as :meth:`backward`, so the ``.grad`` stand-ins read finished stores."""
        self._backward_agreed = False
        self._backwards += 1
        self._finish_reduction()

    def _take_grad(self, param: nn.Parameter) -> None:
        """Send ``param``'s local gradient (what autograd left in ``param.grad``, or added to its stand-in)
        to the buckets and leave the stand-in in ``param.grad``; inside :meth:`no_sync` it stays local."""
        slot = self._slot_of[id(param)]
        grad = self._views.settle(slot, take=not self._no_sync)
        if grad is None:
            return
        if self.grad_scaler is not None and not self._in_backward:
            self._unscaled_backward = True
        slot.chunk.slots_with_grads.add(slot.index)
        self.buckets.add(slot, grad)
        self._views.install(slot)
        self.grads_pending = True

    def _finish_reduction(self) -> None:
        """Take gradients autograd left in ``param.grad`` (accumulated inside :meth:`no_sync` and not
        touched since; a ``param.grad`` the user set), then reduce what is left and wait for every
        collective in flight."""
        if self._no_sync:
            return
        for slot in self._slot_of.values():
            self._take_grad(slot.param)
        self.buckets.finish()
        self._views.changed()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` times the loss scale; the gradients are reduced over the ranks into the
        stores (inside :meth:`no_sync`: left to accumulate locally in ``param.grad``)."""
        check_type("loss", loss, torch.Tensor, "a scalar torch.Tensor")
        self._in_backward = True
        try:
            (loss * self.loss_scale if self.grad_scaler is not None else loss).backward()
        finally:
            self._in_backward = False
        self._finish_reduction()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate the local gradients in ``param.grad`` without any
        collective; the first backward outside reduces their sum with its own gradients (as DDP's
        ``no_sync``). Every rank must use it alike."""
        if self._no_sync:
            raise InvalidArgumentError("no_sync", "a nested no_sync()", "one no_sync() at a time")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # ---- the step ----------------------------------------------------------------------------------

    def _own_grad(self, chunk: FlatChunk) -> torch.Tensor:
        store = self._grad_store(chunk)
        return store if self.partition_grad else chunk.own(store)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale, check for overflow, clip, update this rank's shard of every chunk with Adam, and
        all-gather the updated parameters. Returns ``True`` if the parameters changed; ``False`` when
        the step was skipped (an overflow on some rank, or no gradients since the last step); with
        ``closure`` (torch's argument, run once before the update: :mod:`chunkmem.optim.closure`), what the
        closure returned. Either way
        the gradients it consumed are released (as the reference's step does), so the next backward
        starts from zero without a ``zero_grad()``. With fp16,
        gradients from a backward that bypassed :meth:`backward` raise
        :class:`~chunkmem.UnscaledBackwardError` and change nothing. A learning-rate schedule built on the
        wrapped optimizer (``optim.optim``) sees the step as torch's own (no "scheduler before optimizer"
        warning)."""
        loss = run_closure(closure)
        applied = self._step()
        self.optim._opt_called = True  # what torch's schedulers read to tell that the optimizer stepped
        return applied if closure is None else loss

    def _step(self) -> bool:
        agree_on_point(self.shards, "step", "LowLevelZeroOptimizer.step()",
                       [("optimizer steps so far", self._steps), ("gradients pending", self.grads_pending),
                        ("loss scale", self.loss_scale), ("unscaled backward", self._unscaled_backward),
                        (HYPER_PARAMETERS_FIELD, hyper_parameter_digest(self.optim.param_groups))])
        self._steps += 1
        if self._layout_watch is not None:
            self._layout_watch.check()
        if self._unscaled_backward:
            raise UnscaledBackwardError(
                "a backward pass of the fp16 parameters did not go through the loss scaler (loss.backward()?): "
                f"its gradients are not multiplied by the loss scale ({self.loss_scale}). Call optim.backward(loss) "
                "instead; call optim.zero_grad() to drop the gradients already reduced")
        self._refuse_unfrozen()
        self._finish_reduction()
        if not self.grads_pending:
            return False
        multiplier = self.mixed.decide(lambda: [self._own_grad(c) for c in self.chunks], self.clip_grad_norm)
        if multiplier is None:
            self.zero_grad()
            return False
        self._agree_on_gradients()
        gathers = []
        for chunk in self.chunks:
            self._update(chunk, multiplier)
            if self.shards.sharded:  # in place (the shard is this rank's slot); runs while the next chunk is updated
                gathers.append(start_all_gather(self.shards, chunk.param, chunk.own(chunk.param),
                                                what=f"chunk{chunk.index} updated parameters"))
        for gathering in gathers:
            gathering.wait()
        self.mixed.stepped()
        self.zero_grad()  # the step releases the gradients it consumed, as the reference does
        return True

    def _refuse_unfrozen(self) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` if a parameter that was frozen when this
        optimizer was built requires grad now: it has no place in the flat chunks and no master, so it
        cannot be trained (silently leaving it alone would not be what the user asked)."""
        for index, param in self._not_packed:
            if param.requires_grad:
                raise UnsupportedOperationError(
                    f"the parameter at index {index} of the optimizer's param groups (shape {tuple(param.shape)}) "
                    f"requires grad now but was frozen (requires_grad=False) when the LowLevelZeroOptimizer was "
                    f"built, so it has no fp32 master and cannot be trained: build the LowLevelZeroOptimizer with it "
                    f"trainable (freeze it after building instead), or freeze it again; nothing was changed")

    def _agree_on_gradients(self) -> None:
        """With several ranks, a parameter has a gradient in this step when any rank produced one (as under
        DDP): one small all-reduce of which parameters got one."""
        flags = iter(held_on_any_rank(self.shards, [s.index in c.slots_with_grads for c in self.chunks for s in c.slots],
                                      "the parameters given a gradient in this step"))
        for chunk in self.chunks:
            chunk.slots_with_grads = {slot.index for slot in chunk.slots if next(flags)}

    def _stepped(self, chunk: FlatChunk) -> list[FlatSlot]:
        """The parameters of ``chunk`` the step updates: trainable now and given a gradient since the last step
        (torch skips a parameter whose ``.grad`` is None: its state and step count stay)."""
        return [slot for slot in chunk.slots if slot.param.requires_grad and slot.index in chunk.slots_with_grads]

    def _ranges(self, chunk: FlatChunk) -> list[tuple[int, int, int]]:
        """``(start, end, step)``: the runs of this rank's shard of ``chunk`` (elements from the shard's start)
        whose parameters the step updates (:meth:`_stepped`) and have taken the same number of steps, with the
        step number after this update; the rest (frozen or unused parameters, padding) is not updated."""
        pieces = []
        for slot in self._stepped(chunk):
            part = slot.owned()
            if part is None:
                continue
            start = slot.offset + part[0] - chunk.own_start
            pieces.append((start, start + part[1] - part[0], chunk.step_of(slot) + 1))
        return join_runs(pieces)

    def _update(self, chunk: FlatChunk, multiplier: float) -> None:
        if self._layout is not None:
            self._update_with_any_optimizer(chunk, multiplier)
            return
        hyper = hyper_of_group(self.optim.param_groups[chunk.group])
        grad = self._own_grad(chunk)
        if grad.device != chunk.master.device:
            grad = grad.to(chunk.master.device)
        own = chunk.own(chunk.param)
        same_device = own.device == chunk.master.device
        spans = param_spans(chunk.slots, chunk.own_start)
        exp_avg, exp_avg_sq = chunk.state["exp_avg"], chunk.state["exp_avg_sq"]
        for a, b, step in self._ranges(chunk):
            adam_update_(chunk.master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step, hyper,
                         grad_multiplier=multiplier,
                         param_out=own[a:b] if self.separate_master and same_device else None,
                         param_spans=[(s - a, e - a) for s, e in spans])
            if self.separate_master and not same_device:
                own[a:b].copy_(chunk.master[a:b], non_blocking=False)
        chunk.advance_steps(self._stepped(chunk))

    def _update_with_any_optimizer(self, chunk: FlatChunk, multiplier: float) -> None:
        """The wrapped optimizer's own step over this rank's shard of ``chunk`` on stand-ins (views of the
        masters, shaped where the rank owns a parameter whole; a stepped parameter none of whose elements the rank
        owns advances its scalar state on a one-element stand-in: :mod:`chunkmem.optim.any_optimizer`). The
        scalar state is per parameter (``chunk.scalars`` by its index), as torch keeps it."""
        stepped = self._stepped(chunk)
        views = [ParamView.elsewhere(chunk.group, slot.index) if part is None else
                 ParamView.of_part(slot.offset, slot.numel, slot.shape, part, chunk.own_start, chunk.group, slot.index)
                 for slot in stepped for part in (slot.owned(),)]
        grad = self._own_grad(chunk).to(device=chunk.master.device, dtype=torch.float32, copy=True).mul_(multiplier)
        step_parameters(self.optim, self._layout, views, chunk.master, grad, chunk.state, chunk.scalars,
                        whole_state=chunk.whole_state)
        chunk.advance_steps(stepped)
        if self.separate_master:
            own = chunk.own(chunk.param)
            for a, b, _ in self._ranges(chunk):
                own[a:b].copy_(chunk.master[a:b])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero the reduced gradients, and drop gradients accumulated inside
        :meth:`no_sync` and collectives in flight."""
        check_type("set_to_none", set_to_none, bool, "True or False")
        if not self.buckets.idle:  # the collectives every rank started must complete on every rank
            self.buckets.finish()
        if not set_to_none:  # a gradient whose .grad the user set to None is gone, not zeroed
            for slot in self._slot_of.values():
                self._views.settle(slot, take=False)
        for chunk in self.chunks:
            if set_to_none:  # zeroed gradients still count: torch steps a parameter whose .grad is zeros
                chunk.slots_with_grads.clear()
            if chunk.grad is not None:
                if set_to_none:  # (a store widened for accumulation is not kept: the next backward's is 16-bit)
                    chunk.grad, chunk.spare_grad = None, chunk.grad if chunk.grad.dtype == self.dtype else None
                else:
                    chunk.grad.zero_()
        self._views.clear(keep=not set_to_none)
        for slot in self._slot_of.values():  # zeroed: the stand-ins stay (reading zeros), as torch's zeroed .grad
            slot.param.grad = None if set_to_none else self._views.current(slot)
        self.grads_pending = False
        self._unscaled_backward = False

    # ---- inspection --------------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        """Exact bytes this rank holds per family: ``"params"`` (the working flat chunks, whole),
        ``"grads"`` (the gradient stores allocated now, the ones kept for the next backward after
        ``zero_grad`` included), ``"master"`` (separate fp32 masters; 0 when the fp32 working shard is its
        own master) and each per-element optimizer state family (``"exp_avg"``, ``"exp_avg_sq"`` for
        Adam; another optimizer's keys, e.g. ``"momentum_buffer"``). Not counted: the reduction's scratch
        buffers (a few buckets) and another optimizer's scalar state (a few numbers per parameter)."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        return {"params": sum(size(c.param) for c in self.chunks),
                "grads": sum(size(c.grad if c.grad is not None else c.spare_grad) for c in self.chunks),
                "master": sum(size(c.master) for c in self.chunks) if self.separate_master else 0,
                **{family: sum(size(c.state[family]) for c in self.chunks) for family in self.chunks[0].state}}

    def master_of(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU fp32 copy of ``param``'s full master value (gathered over the ranks: every rank calls
        it, for the parameters in the same order)."""
        slot = self._slot_of.get(id(param))
        if slot is None:
            raise InvalidArgumentError("param", tuple(param.shape), "a trainable parameter of this optimizer")
        return slot.view(self._gather(slot.chunk, slot.chunk.master)).clone()

    def slot_of(self, param: nn.Parameter) -> FlatSlot | None:
        """Where ``param`` lives in this optimizer's flat chunks (``None``: not one of its trainable ones)."""
        return self._slot_of.get(id(param))

    def state_shard(self, slot: FlatSlot, family: str) -> tuple[torch.Tensor, float] | None:
        """This rank's shard (``shard_numel`` elements) of ``slot``'s chunk for ``family`` (``"fp32"``: the
        masters; ``"grad"``: the reduced gradient; an optimizer state family) and the factor that
        unscales and clips it (1 but for the gradient); ``None`` where there is no value (no gradient
        since the last step; no moments before the first step)."""
        chunk = slot.chunk
        if family == "fp32":
            return chunk.master, 1.0
        if family == "grad":
            return None if chunk.grad is None else (self._own_grad(chunk), self.mixed.multiplier)
        if chunk.step_of(slot) == 0:
            return None
        return chunk.state[family], 1.0

    def gather_shards(self, chunk: FlatChunk, shard: torch.Tensor) -> torch.Tensor:
        """The whole chunk (fp32, CPU) from every rank's ``shard`` (a collective when sharded)."""
        return self._gather(chunk, shard)

    def _gather(self, chunk: FlatChunk, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(chunk.numel, dtype=torch.float32, device="cpu")
        self.shards.all_gather(full, shard.detach().to("cpu", torch.float32), what=f"chunk{chunk.index} state")
        return full

    # ---- checkpoints -------------------------------------------------------------------------------

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The full optimizer state in torch's layout (as :meth:`ShardedOptimizerV2.state_dict`):
        ``"state"`` ``{index: {"step", "exp_avg", "exp_avg_sq"}}`` for Adam, the wrapped optimizer's own
        keys for another (fp32, on the CPU, shaped like the parameters; parameters not stepped yet have
        none), ``"param_groups"`` and ``"loss_scaler"``. Loadable by the wrapped optimizer's torch class,
        by :class:`~chunkmem.ShardedOptimizerV2` and by :meth:`load_state_dict` at any world size. The
        state is gathered: every rank calls it; with ``rank0_only`` the others get ``{}``."""
        from .state_dict import adam_entry, any_entry, export_param_groups, scalar_copy

        check_type("rank0_only", rank0_only, bool, "True or False")
        groups, _ = export_param_groups(self)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for chunk in self.chunks:
            if not chunk.stepped:
                continue
            gathered = {family: self._gather(chunk, shard) for family, shard in chunk.state.items()}
            for slot in chunk.slots:
                if chunk.step_of(slot) == 0:  # torch keeps no state for a parameter never stepped
                    continue
                if self._layout is None:
                    state[slot.index] = adam_entry(chunk.step_of(slot), slot.view(gathered["exp_avg"]),
                                                   slot.view(gathered["exp_avg_sq"]), slot.shape)
                elif self._layout.whole:
                    if slot.index in chunk.whole_state:
                        state[slot.index] = scalar_copy(chunk.whole_state[slot.index])
                elif slot.index in chunk.scalars:  # its own scalar state (step, ...), as torch keeps it
                    state[slot.index] = any_entry(chunk.scalars[slot.index], gathered, slot.view, slot.shape)
        if rank0_only and self.shards.rank != 0:
            return {}
        scaler = self.grad_scaler.state_dict() if self.grad_scaler is not None else None
        return {"state": dict(sorted(state.items())), "param_groups": groups, "loss_scaler": scaler}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full optimizer state dict (this class's, :class:`~chunkmem.ShardedOptimizerV2`'s or the
        wrapped optimizer's torch class's over the same parameters in the same group order): each
        parameter's step, this rank's part of the per-element state, another optimizer's scalar state (each
        entry's own; a state dict written before 2026-11-27 holds its chunk and group's in each entry), the
        hyper-parameters and (fp16) the loss scaler. Everything is checked first
        (:class:`~chunkmem.InvalidArgumentError` naming the entry); nothing changes on an error. No
        collective."""
        self.prepare_load_state_dict(state_dict)()

    def state_loaded(self) -> None:
        """A state dict or checkpoint was loaded (nothing to forget here: every step is all or nothing)."""

    def plan_load_state_dict(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """The old name of :meth:`prepare_load_state_dict` (warns once)."""
        warn_renamed("LowLevelZeroOptimizer.plan_load_state_dict", "prepare_load_state_dict")
        return self.prepare_load_state_dict(state_dict)

    def prepare_load_state_dict(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """Check ``state_dict`` as :meth:`load_state_dict` does and return the function that loads it
        (nothing changes until it is called)."""
        from .state_dict import check_entry, prepare_hyper_load, scalar_copy

        allowed = "an optimizer state dict with 'state' and 'param_groups'"
        check_type("state_dict", state_dict, Mapping, allowed)
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise InvalidArgumentError("state_dict", f"a dict without {key!r}", allowed)
        plan = prepare_hyper_load(self, state_dict["param_groups"], state_dict.get("loss_scaler"),
                               adam=self._layout is None)
        state = state_dict["state"]
        check_type("state_dict['state']", state, Mapping, "a mapping from parameter index to its optimizer state")
        total = len(self._index_of)
        for index in state:
            if not isinstance(index, int) or not 0 <= index < total:
                raise InvalidArgumentError("state_dict['state']", f"a state for index {index!r}",
                                           f"indices of the param_groups' 'params' ({total} parameters)")
        writes: list[tuple[FlatChunk, dict[int, int], list[tuple[FlatSlot, Mapping[str, Any]]]]] = []
        for chunk in self.chunks:
            steps, entries = {}, []
            for slot in chunk.slots:
                entry = state.get(slot.index)
                if entry is None:
                    step = 0
                elif self._layout is None:
                    step = check_entry(slot.index, f"index {slot.index}", entry, slot)
                else:
                    step = check_entry(slot.index, f"index {slot.index}", entry, slot, chunk.state_families,
                                       counts_steps=False, whole=self._layout.whole)
                if step:
                    steps[slot.index] = step
                if entry is not None and step > 0:
                    entries.append((slot, entry))
            writes.append((chunk, steps, entries))

        def apply() -> None:
            plan.apply()
            with torch.no_grad():
                for chunk, step, entries in writes:
                    for shard in chunk.state.values():
                        shard.zero_()
                    chunk.scalars.clear()
                    chunk.whole_state.clear()
                    for slot, entry in entries:
                        for family, shard in chunk.state.items():
                            self._write_own(slot, shard, entry[family])
                        if self._layout is not None and self._layout.whole:
                            chunk.whole_state[slot.index] = scalar_copy(entry)
                        elif self._layout is not None:  # its own (older state dicts hold the group's in each)
                            chunk.scalars[slot.index] = scalar_copy(entry, chunk.state_families)
                    chunk.steps = dict(step)
        return apply

    @staticmethod
    def _write_own(slot: FlatSlot, shard: torch.Tensor, value: torch.Tensor) -> None:
        """Write the part of a parameter-shaped ``value`` this rank owns into ``shard``."""
        part = slot.owned()
        if part is None:
            return
        a, b = part
        start = slot.offset + a - slot.chunk.own_start
        shard[start:start + b - a].copy_(value.detach().reshape(-1)[a:b])

    def check_module(self, module: Any, argument: str = "module") -> None:
        """Raise unless ``module`` is the module this optimizer trains: every parameter of the wrapped
        optimizer's param groups is a parameter of ``module`` and every parameter of ``module`` that
        requires grad is one of them (compared by identity; frozen parameters the optimizer does not hold
        are fine). :class:`~chunkmem.ArgumentTypeError` / :class:`~chunkmem.InvalidArgumentError` naming
        ``argument``. No collective (every rank decides alike)."""
        allowed = ("the module whose parameters the optimizer holds (each parameter of its param_groups a "
                   "parameter of the module, each trainable parameter of the module in its param_groups)")
        check_type(argument, module, nn.Module, allowed)
        why = params_mismatch(module, self._params)
        if why is not None:
            raise InvalidArgumentError(argument, f"a {type(module).__name__} ({why})", allowed)

    def model_state_dict(self, module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` on the CPU with every parameter this optimizer trains replaced by its
        fp32 master (gathered: every rank calls it; ``rank0_only``: the others get ``{}``). Loadable by
        the plain module in fp32, by :class:`~chunkmem.ShardedModelV2` and by
        :meth:`load_model_state_dict`. ``module`` must be the module this optimizer trains
        (:meth:`check_module`)."""
        self.check_module(module)
        masters: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            full = self._gather(chunk, chunk.master)
            for slot in chunk.slots:
                masters[id(slot.param)] = slot.view(full).clone()
        if rank0_only and self.shards.rank != 0:
            return {}
        return {key: masters.get(id(value), value.detach().to("cpu", copy=True)) if isinstance(value, torch.Tensor)
                else value for key, value in module.state_dict(keep_vars=True).items()}

    def load_model_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any]) -> None:
        """Load a full state dict into ``module`` (the module this optimizer trains, :meth:`check_module`):
        the working parameters (cast to the working dtype) and this rank's part of the fp32 masters of the
        parameters this optimizer trains, the rest as ``module.load_state_dict`` does (strict). Every value
        is checked before anything is written (a dense tensor with data of the key's shape; of a real
        floating-point dtype where the module's value is floating-point): a bad one raises
        :class:`~chunkmem.InvalidArgumentError` naming its key and nothing changes. No collective."""
        self.prepare_load_model_state_dict(module, state_dict)()

    def plan_load_model_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """The old name of :meth:`prepare_load_model_state_dict` (warns once)."""
        warn_renamed("LowLevelZeroOptimizer.plan_load_model_state_dict", "prepare_load_model_state_dict")
        return self.prepare_load_model_state_dict(module, state_dict)

    def prepare_load_model_state_dict(self, module: nn.Module, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """Check as :meth:`load_model_state_dict` does and return the function that loads (nothing
        changes until it is called)."""
        self.check_module(module)
        check_type("state_dict", state_dict, Mapping, "a mapping from the module's state_dict() keys to tensors")
        own = module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if missing or unexpected:
            raise InvalidArgumentError("state_dict", f"a state dict with missing keys {missing[:5]} and unexpected "
                                       f"keys {unexpected[:5]}", "exactly the keys of module.state_dict()")
        for key, target in own.items():
            value = check_tensor_data(f"state_dict[{key!r}]", state_dict[key], floating=target.is_floating_point())
            if tuple(value.shape) != tuple(target.shape):
                raise InvalidArgumentError(f"state_dict[{key!r}]", f"a tensor of shape {tuple(value.shape)}",
                                           f"a tensor of shape {tuple(target.shape)}")

        def apply() -> None:
            with torch.no_grad():
                for key, target in own.items():
                    slot = self._slot_of.get(id(target))
                    target.copy_(state_dict[key])
                    if slot is not None and self.separate_master:
                        self._write_own(slot, slot.chunk.master, state_dict[key].float())
        return apply


def _agree_on_settings(shards: ShardGroup, groups: list[list[nn.Parameter]], settings: dict[str, Any]) -> None:
    """Sharded, every rank must reduce the same buckets in the same dtype and step with the same rules:
    agree, before anything changes, on the trainable parameters (shape, group, in order) and ``settings``
    (a rank with another bucket size or communication dtype would run mismatched collectives; another
    loss scale or clipping would update its shard differently)."""
    params = ParamRecord()
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            params.add(f"param group {g}, parameter {i}", p.shape, True)
    description = [(ARGUMENTS, "accepted")] + [(k, repr(v)) for k, v in settings.items()]
    agree(shards, LayoutDescription("LowLevelZeroOptimizer", description, params))
