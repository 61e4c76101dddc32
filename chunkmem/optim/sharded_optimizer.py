"""ShardedOptimizerV2: mixed-precision Adam (or another torch optimizer) over the chunks of a ShardedModelV2.

The optimizer is the face the training loop calls (``backward``, ``step``, ``zero_grad``, clipping, state
dicts) and the runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener`; the work is done by its parts,
each in a module of its own: :mod:`chunkmem.optim.builder` checks the arguments and builds the parts, the chunk
update rule (:mod:`chunkmem.optim.update_rule`) updates each chunk, :mod:`chunkmem.optim.disk_commit` runs the
streamed disk step and its commit, :mod:`chunkmem.optim.backward_step` holds what ``step_in_backward`` starts,
:mod:`chunkmem.optim.backward_accounting` which backwards carried the loss scale, and
:mod:`chunkmem.optim.mixed_precision` scaling, norms and clipping.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.optim import Optimizer

from ..core.chunk import MASTER, Chunk, ParamSlot
from ..core.tiers import Tier
from ..distributed.agreement import HYPER_PARAMETERS_FIELD, held_on_any_rank, hyper_parameter_digest
from ..errors import UnsupportedOperationError, check_number, check_type
from ..model.sharded_model import ShardedModelV2
from ..runtime.runtime import ChunkRuntime
from ..settings import ModelSettings, OptimizerSettings
from .any_optimizer import StateLayout
from .backward_accounting import BackwardAccounting
from .backward_step import BackwardStep
from .builder import build_parts, check_arguments, check_before_wrapping
from .closure import run_closure
from .disk_commit import DiskCommit
from .gradient_idioms import GradientIdioms
from .loss_scaler import DynamicGradScaler
from .mixed_precision import MixedPrecisionStep, landed_gradients
from .sealed import seal_param_groups
from .squares_ahead import SquaresAhead
from .state_dict import optimizer_state_dict, prepare_optimizer_load
from .torch_face import WrappingOptimizer
from .update_rule import KeptState


class ShardedOptimizerV2(WrappingOptimizer):
    """Runs the optimizer over whole chunks where each chunk's optimizer state lives (Adam by chunkmem's
    kernel, any other torch optimizer by its own step on views of the chunks), with loss scaling.

    fp16 models get a :class:`~chunkmem.DynamicGradScaler` configured by the scaler arguments; bf16 and
    fp32 models train unscaled (``loss_scale`` stays 1) and, as in plain PyTorch, do not skip steps.
    With fp16, backward must go through :meth:`backward` (or :meth:`backward_by_grad`): after a plain
    ``loss.backward()`` :meth:`step` and :meth:`clip_grad_norm` raise
    :class:`~chunkmem.UnscaledBackwardError`. bf16 and fp32 models may use either.
    A separate fp32 master exists only for 16-bit models; fp32 parameters are their own masters.

    It is a ``torch.optim.Optimizer``, so the schedulers of ``torch.optim.lr_scheduler`` take it
    directly. It holds no state of its own in torch's sense: ``param_groups`` and ``defaults`` are the
    wrapped optimizer's (every step reads each group's current hyper-parameters, ``lr`` and ``betas``
    included), step counts and moments live in the chunks (read them with :meth:`state_dict`; ``state``
    is the wrapped optimizer's and stays empty). Step pre/post hooks run around :meth:`step`, state-dict
    hooks around :meth:`state_dict` and :meth:`load_state_dict`. :meth:`add_param_group` and pickling
    are refused with :class:`~chunkmem.UnsupportedOperationError`. It is the model's runtime's
    :class:`~chunkmem.runtime.runtime.OptimizerListener`.

    Args:
        sharded_model: the :class:`~chunkmem.ShardedModelV2` whose parameters ``optimizer`` holds.
        optimizer: a torch optimizer over ``sharded_model.parameters()``. A :class:`~chunkmem.HybridAdam` /
            :class:`~chunkmem.CPUAdam` or ``torch.optim.Adam`` / ``AdamW`` with plain options runs chunkmem's
            Adam kernel; any other (SGD, RMSprop, Adagrad, AMSGrad, NAdam, ...) runs its own step on views of
            the chunks, with its per-element state in chunk families (:mod:`chunkmem.optim.any_optimizer`:
            what is refused, and why). State the optimizer made when built is dropped.
        gpu_margin_mem_ratio: share in [0, 1] of the device memory left after the traced peak that may
            hold optimizer state; only meaningful with placement ``"auto"`` (a warning otherwise).
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale:
            the loss scaler's rules (see :class:`~chunkmem.DynamicGradScaler`).
        dp_process_group: the data-parallel group the overflow flag and gradient norm are reduced over
            (``None``: the model's ``process_group``; otherwise a group of the same ranks).
        mp_process_group: a model-parallel group whose ranks hold different parts of the model: the
            overflow flag and the gradient norm are reduced over it too (``None``: no model parallelism).
        verbose: log skipped steps and scale changes.
        step_in_backward: (chunkmem addition, keyword only) update each chunk as soon as the backward has
            finished its gradients, as if nothing overflowed and nothing is clipped, so that the
            optimizer's work overlaps the rest of the backward: a chunk whose state rests on disk on a
            thread of its own, into the disk's other slot (its reads and writes overlap the backward); a
            chunk whose state is in memory (host or device tier) in place, after an undo copy of its fp32
            state on the host tier (ledger family ``undo``, released by :meth:`step`; see
            :mod:`chunkmem.optim.speculation`). :meth:`step` then decides (overflow, clipping, the
            hyper-parameters as they are now) and keeps each update or undoes it and updates again: the
            results are bitwise those of a step after the backward, with fp16, clipping and a learning
            rate changed in between. Refused at construction where an update could not be undone
            (``atomic_step=False`` with fp16 or clipping; ``reuse_fp16_shard=True``, whose gradients the
            update overwrites, with fp16, clipping or state in memory) and where the host has no room for
            the undo copies of the state in memory. Under ``auto`` with ``gpu_margin_mem_ratio`` > 0 a traced
            iteration's backward starts none (the plan made at its end moves state to the device). One
            backward per step starts updates: a second one
            before :meth:`step` is refused, unless the earlier ones ran inside :meth:`accumulating`.
            ``zero_grad()`` before :meth:`step` undoes the updates (refused with ``atomic_step=False``: those
            cannot be undone). Between the backward and :meth:`step` the updated chunks' parameters hold the
            new values: read them after the step. It pays off where the backward is longer than the host
            updates it hides (with their undo copies, about 40 bytes of memory traffic a parameter in memory);
            where it is shorter the backward ends waiting for them and the step is slower than without (the
            16-bit rows on an H200, docs/performance.md).
        max_norm, norm_type: (chunkmem additions, keyword only) clip the unscaled gradients to total norm
            ``max_norm`` (``norm_type`` norm) inside every :meth:`step` (0: no clipping); what DeepSpeed's
            ``gradient_clipping`` maps to.

    Param groups may share a chunk: each chunk is updated per contiguous range of one group, with that
    group's hyper-parameters. A parameter given no gradient since the last step (or ``zero_grad()``) is
    not updated (no weight decay, no moment update), as torch's optimizers skip a parameter whose ``.grad`` is
    ``None``; one given a gradient is updated as torch's are, also when it was frozen (``requires_grad_(False)``)
    after its backward, and with a zero gradient after ``zero_grad(set_to_none=False)``.

    ``update_rule`` is the chunk update rule chosen when it is built (:mod:`chunkmem.optim.update_rule`: the
    Adam kernel or the wrapped optimizer's own step); state dicts, checkpoints and resharding ask it.
    """

    def __init__(self, sharded_model: ShardedModelV2, optimizer: Any, gpu_margin_mem_ratio: float = 0.0,
                 initial_scale: float = 2**32, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, dp_process_group: Any = None, mp_process_group: Any = None,
                 verbose: bool = False, *, max_norm: float = 0.0, norm_type: float = 2.0,
                 step_in_backward: bool = False) -> None:
        check_arguments(sharded_model, optimizer)
        settings = OptimizerSettings.from_arguments(
            gpu_margin_mem_ratio, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
            hysteresis, max_scale, dp_process_group, mp_process_group, verbose, max_norm=max_norm,
            norm_type=norm_type, step_in_backward=step_in_backward)
        self._attach(sharded_model, optimizer, settings)

    @classmethod
    def from_settings(cls, sharded_model: ShardedModelV2, optimizer: Any,
                      settings: OptimizerSettings) -> "ShardedOptimizerV2":
        """Build the optimizer as ``settings`` say (what the constructor does with its arguments parsed;
        :func:`chunkmem.initialize` builds the settings from a configuration)."""
        check_arguments(sharded_model, optimizer)
        check_type("settings", settings, OptimizerSettings, "a chunkmem.settings.OptimizerSettings")
        optim = cls.__new__(cls)
        optim._attach(sharded_model, optimizer, settings)
        return optim

    def _attach(self, sharded_model: ShardedModelV2, optimizer: Any, settings: OptimizerSettings) -> None:
        """Check everything against the model (:func:`chunkmem.optim.builder.build_parts`), then place the
        optimizer state in its chunks."""
        parts = build_parts(sharded_model, optimizer, settings)
        self.model = sharded_model
        self.optim = optimizer
        seal_param_groups(optimizer, "ShardedOptimizerV2")
        self.settings = settings
        self.runtime = sharded_model.runtime
        self.update_rule = parts.rule  # how each chunk is updated: chosen once, asked by the state dicts too
        self.mixed = MixedPrecisionStep(parts.scaler if sharded_model.dtype == torch.float16 else None,
                                        (parts.norm_group, settings.mp_process_group), settings.verbose)
        self._accounting = BackwardAccounting(self.runtime, self.mixed)
        self._backward = BackwardStep(self.runtime, parts.rule, self.mixed, settings,
                                      sharded_model.settings)  # step_in_backward: what the backward started
        self._disk = DiskCommit(self.runtime, parts.rule, self._backward, self.mixed, self._accounting)
        self._squares = SquaresAhead(self._backward.host_updates)  # the norm's terms, taken as gradients land
        # torch's idioms on the parameters' .grad stand-ins
        self._idioms = GradientIdioms(self.runtime, self.mixed, self._backward)
        self._init_optimizer_hooks()
        parts.rule.prepare_chunks()
        self.runtime.attach_optimizer(self, settings.gpu_margin_mem_ratio, parts.kept_on_host)

    # ---- the settings, under the reference's names --------------------------------------------------

    @property
    def gpu_margin_mem_ratio(self) -> float:
        return self.settings.gpu_margin_mem_ratio

    @property
    def dp_process_group(self) -> Any:
        return self.settings.dp_process_group

    @property
    def mp_process_group(self) -> Any:
        return self.settings.mp_process_group

    @property
    def verbose(self) -> bool:
        return self.settings.verbose

    @property
    def max_norm(self) -> float:
        return self.settings.max_norm

    @property
    def norm_type(self) -> float:
        return self.settings.norm_type

    @property
    def step_in_backward(self) -> bool:
        return self.settings.step_in_backward

    @property
    def grad_scaler(self) -> DynamicGradScaler | None:
        """The loss scaler (fp16), or ``None``."""
        return self.mixed.scaler

    @classmethod
    def check_before_wrapping(cls, module: nn.Module, model_settings: ModelSettings,
                              settings: OptimizerSettings) -> None:
        """Raise as building this optimizer with ``settings`` over ``module`` wrapped with ``model_settings``
        would, for every check that needs no wrapped model: the process groups and ``step_in_backward``
        (:func:`chunkmem.initialize` runs it before wrapping; the optimizer itself is checked against the
        module there). Changes nothing. What only the wrapped model knows (room for the optimizer state on
        the device or the disk) is checked when the optimizer is built."""
        check_before_wrapping(module, model_settings, settings)

    # ---- torch.optim.Optimizer (the rest: chunkmem.optim.torch_face) ---------------------------------

    def __repr__(self) -> str:
        lines = [f"ShardedOptimizerV2 ({type(self.optim).__name__}, dtype={self.model.dtype}, "
                 f"loss_scale={self.loss_scale}"]
        for index, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {index}")
            lines.extend(f"    {key}: {group[key]}" for key in sorted(group) if key != "params")
        return "\n".join(lines) + "\n)"

    # ---- the training step -------------------------------------------------------------------------

    @property
    def state_layout(self) -> StateLayout | None:
        """What the wrapped optimizer keeps per parameter when it is not run by the Adam kernel (``None``:
        Adam's moments; see :mod:`chunkmem.optim.any_optimizer`)."""
        return self.update_rule.state_layout

    def group_of(self, param: nn.Parameter) -> int | None:
        """The index of ``param``'s group in the wrapped optimizer (``None``: not one of its parameters)."""
        return self.update_rule.group_of(param)

    def scalar_state(self, chunk: Chunk) -> KeptState:
        """An optimizer other than Adam: the scalar state (``step``, ...) of each of ``chunk``'s parameters
        that has stepped, by its position in the chunk (``index_in_chunk``; per parameter, as torch keeps
        it), changed in place."""
        return self.update_rule.scalar_state(chunk)

    def whole_state(self, chunk: Chunk) -> KeptState:
        """Another optimizer's whole-parameter state for ``chunk``'s parameters, by their position in the
        chunk (``state_layout.whole``; :mod:`chunkmem.optim.any_optimizer`)."""
        return self.update_rule.whole_state(chunk)

    def replace_kept_state(self, chunk: Chunk, scalars: KeptState, whole: KeptState) -> None:
        """Make ``scalars`` and ``whole`` (both by position in the chunk) another optimizer's scalar and
        whole-parameter state for ``chunk`` (loading a checkpoint; the caller's copies are kept)."""
        self.update_rule.replace_kept_state(chunk, scalars, whole)

    @property
    def global_grad_norm(self) -> float | None:
        """The total norm of the unscaled gradients the last step computed (before clipping; inf or NaN
        when they overflowed), or ``None`` when it computed none (no clipping and no loss scaler)."""
        return self.mixed.last_norm

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler)."""
        return self.mixed.loss_scale

    @property
    def grads_pending(self) -> bool:
        """Whether a backward since the last step left gradients that the next :meth:`step` consumes."""
        return self.runtime.grads_pending

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` times the loss scale; gradients land in the chunks."""
        check_type("loss", loss, torch.Tensor, "a scalar torch.Tensor")
        self._check_can_accumulate()
        self._accounting.run(lambda: (loss * self.loss_scale if self.grad_scaler else loss).backward())

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from ``tensor`` with the upstream gradient ``grad`` (not scaled: with fp16, ``grad``
        is expected to carry the loss scale already)."""
        check_type("tensor", tensor, torch.Tensor, "a torch.Tensor")
        check_type("grad", grad, torch.Tensor, "a torch.Tensor shaped like tensor")
        self._check_can_accumulate()
        self._accounting.run(lambda: torch.autograd.backward(tensor, grad))

    def _check_can_accumulate(self) -> None:
        self._backward.check_can_accumulate()
        self.runtime.check_can_accumulate()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """``with optim.accumulating(): optim.backward(loss)``: with ``step_in_backward``, the backwards run
        inside add to the gradients without starting the step's updates, so that several backwards accumulate
        before one :meth:`step`; run the last backward before :meth:`step` outside it (its updates start in
        that backward, over the summed gradients). Without ``step_in_backward`` it changes nothing."""
        return self._backward.accumulating_backwards()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the coming step to total norm ``max_norm``; returns the total norm of the
        unscaled gradients (inf or NaN if they overflowed). Clipping is folded into the update."""
        check_number("max_norm", max_norm, low=0.0, low_open=True)
        check_number("norm_type", norm_type, low=0.0, low_open=True)
        self.check_can_rescale("clip_grad_norm")
        self.runtime.agree("clip", "ShardedOptimizerV2.clip_grad_norm()",
                           [("optimizer steps so far", self.runtime.step_count), ("max_norm", max_norm),
                            ("norm_type", norm_type)])
        self._accounting.check_scaled()
        ahead = self._squares if norm_type == 2.0 else None
        return self.mixed.clip(landed_gradients(self.runtime, ahead), max_norm, float(norm_type))

    def check_can_rescale(self, what: str) -> None:
        """Refuse ``what`` (a clipping decided after the backward) where the backward's updates could not be
        redone with another multiplier."""
        self._backward.check_can_rescale(what)

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on the ``.grad`` stand-ins of this model's parameters (the runtime's
        :class:`~chunkmem.runtime.runtime.OptimizerListener` side; :mod:`chunkmem.optim.gradient_idioms`)."""
        return self._idioms.run(func, args, kwargs)

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        """What the coming step multiplies the gradients by: the clipping over the loss scale, and for
        ``slot`` the factor torch's in-place idioms gave its gradient (the runtime's
        :class:`~chunkmem.runtime.runtime.OptimizerListener` side, read by the accessors)."""
        return self.mixed.multiplier * (1.0 if slot is None else self._idioms.factor_of(slot))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale, check for overflow, clip, and update every chunk where its optimizer state lives.

        Returns ``True`` if the parameters were updated, ``False`` if the step was skipped (overflow, or no
        gradients since the last step); with ``closure`` (torch's argument: it recomputes the loss, run once
        before the update, :mod:`chunkmem.optim.closure`), what the closure returned. Either way the step
        releases the gradients it consumed, as the reference does, so a loop without ``zero_grad()`` trains like
        one with it; several backwards before one step accumulate. A skipped step leaves masters and optimizer
        state untouched. With ``max_norm`` the gradients are clipped to that total norm inside the step (unless
        :meth:`clip_grad_norm` was called since the backward: its clipping is the one applied). With fp16,
        gradients from a backward that bypassed :meth:`backward` raise :class:`~chunkmem.UnscaledBackwardError`
        and change nothing. Torch's step pre- and post-hooks run before and after."""
        loss = run_closure(closure)
        applied = self._step()
        self.optim._opt_called = True  # a schedule built on the wrapped optimizer reads it: it stepped
        return applied if closure is None else loss

    def _step(self) -> bool:
        self._backward.settle()  # (the backward's end did; a backward that stopped on a collective error did not)
        try:
            scaled_by, refused = self._idioms.uniform_factor(self.runtime.trainable_chunks()), None
        except UnsupportedOperationError as error:
            scaled_by, refused = float("nan"), error
        self.runtime.begin_step("ShardedOptimizerV2.step()", [("gradients pending", self.runtime.grads_pending),
                                                              ("loss scale", self.loss_scale),
                                                              ("max_norm", self.max_norm),
                                                              ("gradients scaled in place by", repr(scaled_by)),
                                                              (HYPER_PARAMETERS_FIELD,
                                                               hyper_parameter_digest(self.optim.param_groups))])
        if refused is not None:
            raise refused
        if not self.runtime.grads_pending:
            self.mixed.nothing_to_step()
            return False
        self.mixed.scaled_by = scaled_by
        self.runtime.refuse_unfrozen("ShardedOptimizerV2.step()")
        self.update_rule.check_unchanged()
        self._accounting.check_scaled()
        self._backward.kept = 0
        ahead = self._squares if self.norm_type == 2.0 or self.max_norm == 0 else None  # (the overflow check's: 2)
        multiplier = self.mixed.decide(partial(landed_gradients, self.runtime, ahead), self.max_norm, self.norm_type)
        self._squares.forget()  # (read: the step consumes or changes the gradients next)
        if multiplier is None:
            self._backward.abandon_in_flight()  # made as if nothing overflowed
            self._backward.undo_in_memory()
            self._accounting.discard_gradients()
            return False
        if self._disk.broken_by is not None:
            raise self._disk.broken_by
        _agree_on_gradients(self.runtime)
        on_disk = [c for c in self.runtime.trainable_chunks() if self.runtime.optim_tier(c) is Tier.DISK]
        self.update_rule.begin_step()
        try:
            self._disk.run(on_disk, multiplier)  # first: the only part that can fail half-way
        except BaseException:
            self.update_rule.end_step(stepped=False)
            self._backward.undo_in_memory()  # the step did not happen: neither did the backward's updates
            raise
        for chunk in self.update_rule.update_order(self.runtime.trainable_chunks_as_gradients_landed()):
            if self.runtime.optim_tier(chunk) is not Tier.DISK and not self._backward.keep(chunk, multiplier):
                self.update_rule.update(chunk, multiplier)
        self.update_rule.end_step(stepped=True)
        self.mixed.stepped()
        self.runtime.end_step(release_gradients=True)
        self._accounting.forget()
        return True

    step = Optimizer.profile_hook_step(step)  # runs torch's step pre/post hooks around it
    step.hooked = True  # type: ignore[attr-defined]  # tells torch not to wrap it again

    def on_grads_final(self, chunk: Chunk) -> None:
        """``chunk``'s gradients are final (the runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener`
        side): the norm's term is taken ahead (:mod:`chunkmem.optim.squares_ahead`), then, with
        ``step_in_backward``, the chunk updated (:meth:`~chunkmem.optim.backward_step.BackwardStep.on_grads_final`),
        unless a failed step left the optimizer broken."""
        norm_next = self.mixed.takes_norm_next(self.max_norm, self.norm_type) and not self._backward.accumulating
        self._squares.take(self.runtime, chunk, norm_next)  # (first: its job runs before the chunk's update job)
        if self._disk.broken_by is None:
            self._backward.on_grads_final(chunk)

    @property
    def kept_backward_updates(self) -> int:
        """With ``step_in_backward``: how many of the updates the backward made the last :meth:`step` kept
        as its own (the others it undid and redid, or undid when it skipped); 0 before any step."""
        return self._backward.kept

    @property
    def backward_updates(self) -> int:
        """With ``step_in_backward``: how many chunks' updates the running (or last) backward started and
        :meth:`step` has not completed yet (0 when none)."""
        return self._backward.started

    def state_loaded(self) -> None:
        """A state dict or checkpoint was loaded: a step over disk-resident state that had failed half-way
        (``atomic_step=False``, after which the optimizer refused to step) is forgotten."""
        self._disk.broken_by = None

    def check_no_step_in_flight(self, action: str) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` if a backward with ``step_in_backward``
        started updates that :meth:`step` has not completed yet (``action``: what was attempted)."""
        self._backward.check_none_pending(action)

    def on_backward_end(self) -> None:
        """The backward is over (the runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener` side):
        complete the updates it handed off autograd's thread (:mod:`chunkmem.optim.host_updates`) and keep the
        sums of squares taken as its gradients landed."""
        self._backward.settle()
        self._squares.join()

    def on_backward_failed(self) -> None:
        """A backward raised part-way (the runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener`
        side): as :meth:`zero_grad`, every pending gradient is dropped and the updates the backward started
        (``step_in_backward``) are undone, so the next :meth:`step` has nothing to apply. Updates the backward
        made in place on disk (``atomic_step=False``) cannot be undone: those it started are completed (its
        I/O buffers returned), and the optimizer refuses to step until a checkpoint or state dict is loaded, as
        after a failed step."""
        self._squares.forget()
        if not self._disk.after_failed_backward():
            self.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (``set_to_none``) or zero them. With ``reuse_fp16_shard`` and no step since
        the backward, the parameters are restored from the masters. With ``step_in_backward`` and no
        step since the backward, the updates the backward started are undone (``atomic_step=True``) or,
        as they cannot be (``atomic_step=False``), :class:`~chunkmem.UnsupportedOperationError` is raised
        with nothing changed."""
        check_type("set_to_none", set_to_none, bool, "True or False")
        self._backward.undo_all()
        self._squares.forget()
        self.runtime.drop_gradients(set_to_none)
        self.mixed.forget()
        self._accounting.forget()

    def get_memory_usage(self, with_disk: bool = False) -> tuple[int, ...]:
        """``(device_bytes, host_bytes)`` of the fp32 masters (the fp32 parameters when there is no
        separate master) and the per-element optimizer state (Adam: exp_avg and exp_avg_sq; another
        optimizer: its :attr:`state_layout` families); with ``with_disk=True``, ``(device_bytes,
        host_bytes, disk_bytes)``, the third being what rests on the disk tier (the buffers' own bytes;
        the files' size is ``model.disk_file_bytes()``)."""
        check_type("with_disk", with_disk, bool, "True or False")
        usage = _optimizer_bytes_by_tier(self.runtime)
        if with_disk:
            return usage[Tier.DEVICE], usage[Tier.HOST], usage[Tier.DISK]
        return usage[Tier.DEVICE], usage[Tier.HOST]

    # ---- checkpoints -------------------------------------------------------------------------------

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The full optimizer state in ``torch.optim.Adam``/``AdamW`` layout, loadable by those and by
        :meth:`load_state_dict` at any number of ranks and any placement:

        * ``"state"``: ``{index: {"step": tensor(float32 scalar), "exp_avg": fp32 tensor shaped like the
          parameter, "exp_avg_sq": the same}}`` on the CPU; indices number the parameters of
          ``self.optim.param_groups`` in order, as torch does. Parameters whose chunk has not stepped
          yet have no entry (torch creates state at the first step). A chunk's parameters share its step.
        * ``"param_groups"``: each group's hyper-parameters and ``"params"`` (its indices); the
          decoupled-weight-decay flag is given both as ``adamw_mode`` and as ``decoupled_weight_decay``.
        * ``"loss_scaler"``: :meth:`DynamicGradScaler.state_dict` (fp16), or ``None``. torch's
          ``Optimizer.load_state_dict`` reads only the two keys above and ignores this one.

        The fp32 masters are not here: they are the model's parameters, in ``model.state_dict()``.
        The moments of each chunk are gathered over the data-parallel ranks, so every rank must call
        it; with ``rank0_only=True`` the other ranks get ``{}``.
        """
        check_type("rank0_only", rank0_only, bool, "True or False")
        self.check_no_step_in_flight("optim.state_dict()")
        return self._hooked_state_dict(lambda: optimizer_state_dict(self, rank0_only))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state dict: this object's :meth:`state_dict` or
        ``torch.optim.Adam``/``AdamW.state_dict()`` over the same parameters in the same group order.

        Sets each chunk's step and this rank's part of exp_avg and exp_avg_sq, every group's
        hyper-parameters (all saved keys but ``"params"``; the decoupled-weight-decay flag in the
        wrapped optimizer's spelling) and, when present and the model is fp16, the loss scaler. All
        parameters of one chunk must have the same step (a parameter without state counts as step 0);
        otherwise, or for a wrong group count, group size, moment shape or an option the chunked
        update does not run (amsgrad, maximize...), :class:`~chunkmem.InvalidArgumentError` is raised
        before anything changes. Saved state of parameters that are frozen in this model is ignored.
        The fp32 masters come with the model: ``model.load_state_dict``. No collective.
        """
        self.check_no_step_in_flight("optim.load_state_dict()")
        self._hooked_load(state_dict, lambda loaded: prepare_optimizer_load(self, loaded).apply())


def _agree_on_gradients(runtime: ChunkRuntime) -> None:
    """With several ranks, a parameter has a gradient in this step when any rank produced one for it (as
    under DDP), so every rank steps the same parameters: one small all-reduce of which parameters got one."""
    chunks = runtime.trainable_chunks()
    flags = iter(held_on_any_rank(runtime.data_parallel,
                                  [s.index_in_chunk in c.slots_with_grads for c in chunks for s in c.slots],
                                  "the parameters given a gradient in this step"))
    for chunk in chunks:
        chunk.slots_with_grads = {slot.index_in_chunk for slot in chunk.slots if next(flags)}


def _optimizer_bytes_by_tier(runtime: ChunkRuntime) -> dict[Tier, int]:
    """The bytes of the trainable chunks' fp32 masters (their fp32 parameters where there is no separate master)
    and per-element optimizer state, by the tier holding them."""
    usage = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    for chunk in runtime.trainable_chunks():
        tier = runtime.compute_tier(chunk)
        for family in chunk.state_families + ((MASTER,) if chunk.has_master else ()):
            buf = chunk.optim[family]
            if buf.allocated:
                usage[buf.tier] += buf.nbytes
        if not chunk.has_master:  # the parameters are the master: where they rest (disk), else where it updates
            usage[Tier.DISK if chunk.param.shard.on_disk else tier] += chunk.param.shard.nbytes
    return usage
