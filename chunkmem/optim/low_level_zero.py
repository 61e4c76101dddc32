"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 over a plain module's parameters.

The module stays an ordinary module (replicated parameters, no hooks that move them). What is sharded
over the data-parallel ranks is the optimizer's: the fp32 masters and optimizer state (stage 1) and, with
``partition_grad=True``, the gradients (stage 2). With ``cpu_offload=True`` the masters and moments
live on the host and chunkmem's host Adam kernel updates them (ZeRO-Offload).

This module is the optimizer's face and its step (the ranks' agreement, the loss scaler's decision, each chunk
updated, the parameters all-gathered). The rest lives with its concept: the checks, the agreement and the flat
chunks it is built from, :mod:`chunkmem.optim.zero_builder` (layout: :mod:`chunkmem.optim.zero_partition`); the
gradient stores, :mod:`chunkmem.optim.zero_gradient_store`, filled by the backward
(:mod:`chunkmem.optim.zero_backward`) through the runtime's gradient reduction in its bucketed mode
(:mod:`chunkmem.distributed.bucketed_reduction`) and read through ``param.grad``'s stand-ins
(:mod:`chunkmem.optim.zero_gradient_view`); how a chunk is updated, :mod:`chunkmem.optim.zero_update`; the state
dicts, :mod:`chunkmem.optim.zero_state_dict`.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn

from ..core.chunk import GRAD, MASTER, PARAM
from ..distributed.agreement import HYPER_PARAMETERS_FIELD, agree_on_point, held_on_any_rank, hyper_parameter_digest
from ..distributed.collectives import start_all_gather
from ..distributed.gathers import gather_whole
from ..errors import InvalidArgumentError, UnscaledBackwardError, UnsupportedOperationError, check_type, warn_renamed
from ..runtime.hooks import watch_gradients
from . import zero_builder, zero_state_dict
from .any_optimizer import StateLayout
from .closure import run_closure
from .loss_scaler import DynamicGradScaler
from .mixed_precision import MixedPrecisionStep
from .zero_backward import ZeroBackward
from .zero_gradient_store import GradientStores
from .zero_partition import FlatChunk, FlatSlot
from .zero_update import ZeroUpdate


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
    :mod:`chunkmem.optim.zero_gradient_view`. A step updates the parameters given a gradient since the last
    step or ``zero_grad()`` (on any rank; zeros after ``zero_grad(set_to_none=False)``, and also when frozen
    since, as torch's optimizers step every parameter whose ``.grad`` is set); one without (a branch not taken)
    is left alone (no weight decay, no moment update, as torch's optimizers leave a parameter without a
    gradient): its step count, and another optimizer's scalar state (NAdam's
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
            holds pieces of parameters), or an 8-bit Adam (torchao's ``AdamW8bit`` / ``Adam8bit``,
            ``HybridAdam(state_dtype="8bit")``: its codes and block scales in this rank's shard, on any number of
            ranks, bit for bit torchao's step run eagerly: :mod:`chunkmem.optim.zero_low_bit`); its param groups
            give the hyper-parameters, read at every step. Its own ``step`` must not be called.
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
        parts = zero_builder.build_parts(
            optimizer, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
            clip_grad_norm, verbose, reduce_bucket_size, communication_dtype, overlap_communication, partition_grad,
            cpu_offload, forced_dtype, dp_process_group, grad_accum_dtype)
        dtype, shards = parts.dtype, parts.shards
        self.optim = optimizer
        self.mixed = MixedPrecisionStep(parts.scaler if dtype == torch.float16 else None,
                                        (shards.group if shards.sharded else None,), verbose)
        self.clip_grad_norm = float(clip_grad_norm)
        self.verbose = verbose
        self.reduce_bucket_size = reduce_bucket_size
        self.communication_dtype = communication_dtype or dtype
        self.overlap_communication = overlap_communication
        self.partition_grad = partition_grad
        self.cpu_offload = cpu_offload
        self.dtype = dtype
        self.dp_process_group = dp_process_group
        self.shards = shards
        self.separate_master = parts.separate_master
        self._layout = parts.layout  # None: the Adam kernel or an 8-bit Adam; else any_optimizer's stand-in step
        self.chunks = parts.chunks
        self.memory = parts.memory  # the chunks' memory: its ledger counts every family (model_state_bytes)
        self._slot_of = parts.slot_of
        self.params = parts.params  # every parameter of the param groups, in index order (torch's numbering)
        self._not_packed = parts.not_packed  # frozen when built: no place in the chunks, no master
        self._stores = GradientStores(self.chunks, shards, self.mixed, dtype, partition_grad,
                                      grad_accum_dtype in (None, torch.float32) and dtype != torch.float32)
        self._backward = ZeroBackward(self._stores, self._slot_of, self.communication_dtype, reduce_bucket_size,
                                      overlap_communication)
        self.buckets = self._backward.buckets
        self._rule = zero_builder.choose_update(optimizer, parts, self._stores)
        # the runtime's gradient hooks, calling this optimizer (not its parts): a parameter keeps its optimizer
        # alive, as optimizer_of says
        self._hooks = watch_gradients([slot.param for slot in self._slot_of.values()], self._on_grad)
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
        zero_builder.check_arguments(**arguments, cast_to=cast_to)

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
        Adam's moments, or an 8-bit Adam's families; see :mod:`chunkmem.optim.any_optimizer`)."""
        return self._layout

    @property
    def update_rule(self) -> ZeroUpdate:
        """How each chunk is updated, chosen once (:mod:`chunkmem.optim.zero_update`; an 8-bit Adam's:
        :mod:`chunkmem.optim.zero_low_bit`)."""
        return self._rule

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
        return self._stores.grads_sharded

    def grad_part(self, slot: FlatSlot) -> torch.Tensor | None:
        """This rank's elements of ``slot``'s reduced gradient in its chunk's store, as a flat view (the whole
        parameter unless :attr:`grads_sharded`; possibly empty), in the store's units (times the loss
        scale with fp16); ``None`` while the chunk has no store."""
        return self._stores.grad_part(slot)

    @property
    def grads_pending(self) -> bool:
        """Whether gradients were reduced (or deferred inside :meth:`no_sync`) since the last step or zero_grad."""
        return self._backward.pending

    # ---- backward ----------------------------------------------------------------------------------

    def _on_grad(self, param: nn.Parameter) -> None:
        """Autograd's hook: ``param``'s gradient is final in this backward (:mod:`chunkmem.optim.zero_backward`)."""
        self._backward.on_grad(param)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` times the loss scale; the gradients are reduced over the ranks into the
        stores (inside :meth:`no_sync` over several ranks: left to accumulate locally in ``param.grad``)."""
        check_type("loss", loss, torch.Tensor, "a scalar torch.Tensor")
        self._backward.run(loss)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate the local gradients in ``param.grad`` without any
        collective; the first backward outside reduces their sum with its own gradients (as DDP's
        ``no_sync``). Every rank must use it alike. With one rank there is nothing to defer: the gradients
        go to the stores as outside, summed in the order torch sums ``.grad``."""
        with self._backward.no_sync.scope():
            yield

    # ---- the step ----------------------------------------------------------------------------------

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
                       [("optimizer steps so far", self._backward.steps), ("gradients pending", self.grads_pending),
                        ("loss scale", self.loss_scale), ("unscaled backward", self._backward.unscaled),
                        (HYPER_PARAMETERS_FIELD, hyper_parameter_digest(self.optim.param_groups))])
        self._backward.steps += 1
        self._rule.check_unchanged()
        if self._backward.unscaled:
            raise UnscaledBackwardError(
                "a backward pass of the fp16 parameters did not go through the loss scaler (loss.backward()?): "
                f"its gradients are not multiplied by the loss scale ({self.loss_scale}). Call optim.backward(loss) "
                "instead; call optim.zero_grad() to drop the gradients already reduced")
        self._refuse_unfrozen()
        self._backward.finish()
        if not self.grads_pending:
            self.mixed.nothing_to_step()
            return False
        multiplier = self.mixed.decide(lambda: [self._stores.own(c) for c in self.chunks], self.clip_grad_norm)
        if multiplier is None:
            self.zero_grad()
            return False
        self._agree_on_gradients()
        self._rule.begin_step()
        gathers = []
        for chunk in self.chunks:
            self._rule.update(chunk, multiplier)
            if self.shards.sharded:  # in place (the shard is this rank's slot); runs while the next chunk is updated
                gathers.append(start_all_gather(self.shards, chunk.param, chunk.own(chunk.param),
                                                what=f"chunk{chunk.index} updated parameters"))
        for gathering in gathers:
            gathering.wait()
        self._rule.end_step()
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
        given = [s.index_in_chunk in c.slots_with_grads for c in self.chunks for s in c.slots]
        flags = iter(held_on_any_rank(self.shards, given, "the parameters given a gradient in this step"))
        for chunk in self.chunks:
            chunk.slots_with_grads = {slot.index_in_chunk for slot in chunk.slots if next(flags)}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero the reduced gradients, and drop gradients accumulated inside
        :meth:`no_sync` and collectives in flight."""
        check_type("set_to_none", set_to_none, bool, "True or False")
        self._backward.zero_grad(set_to_none)

    # ---- inspection --------------------------------------------------------------------------------

    def model_state_bytes(self) -> dict[str, int]:
        """Exact bytes this rank holds per family: ``"params"`` (the working flat chunks, whole), ``"grads"`` (the
        gradient stores allocated now, the ones kept for the next backward after ``zero_grad`` included),
        ``"master"`` (separate fp32 masters; 0 when the fp32 working shard is its own master) and each per-element
        optimizer state family (``"exp_avg"``, ``"exp_avg_sq"`` for Adam; another optimizer's keys, e.g.
        ``"momentum_buffer"``); as the chunks' ledger counts them (:attr:`memory`). Not
        counted: the reduction's scratch buffers (a few buckets) and another optimizer's scalar state (a few
        numbers per parameter)."""
        counted = self.memory.ledger.breakdown().values()

        def total(family: str) -> int:
            return sum(by_family.get(family, 0) for by_family in counted)
        return {"params": total(PARAM),
                "grads": total(GRAD),
                "master": total(MASTER), **{family: total(family) for family in self.chunks[0].state_families}}

    def master_of(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU fp32 copy of ``param``'s full master value (gathered over the ranks: every rank calls
        it, for the parameters in the same order)."""
        slot = self._slot_of.get(id(param))
        if slot is None:
            raise InvalidArgumentError("param", tuple(param.shape), "a trainable parameter of this optimizer")
        return slot.view(self.gather_shards(slot.chunk, slot.chunk.master)).clone()

    def slot_of(self, param: nn.Parameter) -> FlatSlot | None:
        """Where ``param`` lives in this optimizer's flat chunks (``None``: not one of its trainable ones)."""
        return self._slot_of.get(id(param))

    def state_shard(self, slot: FlatSlot, family: str) -> tuple[torch.Tensor, float] | None:
        """This rank's shard (``shard_numel`` elements) of ``slot``'s chunk for ``family`` (``"fp32"``: the
        masters; ``"grad"``: the reduced gradient; an optimizer state family) and the factor that
        unscales and clips it (1 but for the gradient); ``None`` where there is no value (no gradient
        since the last step; no moments before the first step). An 8-bit Adam's state is not per element:
        :class:`~chunkmem.UnsupportedOperationError` (read it from :meth:`state_dict`)."""
        chunk = slot.chunk
        if family == "fp32":
            return chunk.master, 1.0
        if family == "grad":
            return None if chunk.grad is None else (self._stores.own(chunk), self.mixed.multiplier)
        if self._rule.state_dict_form is not None:
            raise UnsupportedOperationError(f"reading the 8-bit optimizer state {family!r} of a parameter element by "
                                            "element (its moments are codes with a scale per block of 256): read "
                                            "optim.state_dict() instead")
        if chunk.step_of(slot) == 0:
            return None
        return chunk.state[family], 1.0

    def gather_shards(self, chunk: FlatChunk, shard: torch.Tensor) -> torch.Tensor:
        """The whole chunk (fp32, CPU) from every rank's ``shard`` (a collective when sharded)."""
        return gather_whole(self.shards, shard.detach().to("cpu", torch.float32), f"chunk{chunk.index} state")

    # ---- checkpoints (chunkmem.optim.zero_state_dict) ---------------------------------------------------

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The full optimizer state in torch's layout (as :meth:`ShardedOptimizerV2.state_dict`):
        ``"state"`` ``{index: {"step", "exp_avg", "exp_avg_sq"}}`` for Adam, the wrapped optimizer's own
        keys for another (fp32, on the CPU, shaped like the parameters; parameters not stepped yet have
        none), ``"param_groups"`` and ``"loss_scaler"``. Loadable by the wrapped optimizer's torch class,
        by :class:`~chunkmem.ShardedOptimizerV2` and by :meth:`load_state_dict` at any world size. The
        state is gathered: every rank calls it; with ``rank0_only`` the others get ``{}``."""
        return zero_state_dict.optimizer_state_dict(self, rank0_only)

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
        return zero_state_dict.prepare_optimizer_load(self, state_dict)

    def check_module(self, module: Any, argument: str = "module") -> None:
        """Raise unless ``module`` is the module this optimizer trains: every parameter of the wrapped
        optimizer's param groups is a parameter of ``module`` and every parameter of ``module`` that
        requires grad is one of them (compared by identity; frozen parameters the optimizer does not hold
        are fine). :class:`~chunkmem.ArgumentTypeError` / :class:`~chunkmem.InvalidArgumentError` naming
        ``argument``. No collective (every rank decides alike)."""
        zero_state_dict.check_module(self, module, argument)

    def model_state_dict(self, module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` on the CPU with every parameter this optimizer trains replaced by its
        fp32 master (gathered: every rank calls it; ``rank0_only``: the others get ``{}``). Loadable by
        the plain module in fp32, by :class:`~chunkmem.ShardedModelV2` and by
        :meth:`load_model_state_dict`. ``module`` must be the module this optimizer trains
        (:meth:`check_module`)."""
        return zero_state_dict.model_state_dict(self, module, rank0_only)

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
        return zero_state_dict.prepare_model_load(self, module, state_dict)
