"""ShardedOptimizerV2: mixed-precision Adam over the chunks of a ShardedModelV2."""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.nn as nn
from torch.optim import Optimizer

from ..core.chunk import ADAM_STATE, EXP_AVG, EXP_AVG_SQ, MASTER, Chunk, ParamSlot
from ..core.disk_tier import JOURNAL
from ..core.layout import join_runs
from ..errors import (ArgumentTypeError, ChunkmemError, DeviceCapacityError, GradientAccumulationError,
                      InvalidArgumentError, UnscaledBackwardError, UnsupportedOperationError, check_number,
                      check_type)
from ..core.param_guard import slot_of
from ..core.tiers import Tier
from ..distributed.agreement import (ARGUMENTS, HYPER_PARAMETERS_FIELD, LayoutDescription, ParamRecord, agree,
                                    held_on_any_rank, hyper_parameter_digest, refuse_together)
from ..distributed.collectives import ShardGroup
from ..model import ShardedModelV2
from ..builder import compute_dtype
from ..settings import ModelSettings, OptimizerSettings
from .adam import check_supported_optimizer, hyper_of_group, runs_adam_kernel
from .any_optimizer import (LayoutWatch, ParamView, PieceStep, StateLayout, check_elementwise, probe_state,
                            step_parameters)
from .adam_kernels import adam_update_, adam_update_pieces_, param_spans
from .adam_math import AdamHyper
from .backward_step import BackwardStep, check_step_in_backward, check_undo_room, why_no_speculation
from .speculation import UndoCopies, UndoCopy
from .disk_step import ChunkUpdate, DiskStepError, StreamedStep, gaps, streamed_count
from .loss_scaler import DynamicGradScaler
from .closure import run_closure
from .gradient_idioms import GradientIdioms
from .host_updates import HostUpdates
from .mixed_precision import MixedPrecisionStep
from .sealed import seal_param_groups


class ShardedOptimizerV2(Optimizer):
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
            new values: read them after the step.
        max_norm, norm_type: (chunkmem additions, keyword only) clip the unscaled gradients to total norm
            ``max_norm`` (``norm_type`` norm) inside every :meth:`step` (0: no clipping); what DeepSpeed's
            ``gradient_clipping`` maps to.

    Param groups may share a chunk: each chunk is updated per contiguous range of one group, with that
    group's hyper-parameters. A parameter whose ``requires_grad`` is ``False`` at the step is not updated
    (no weight decay, no moment update), as torch's optimizers skip a parameter without a gradient.
    """

    def __init__(self, sharded_model: ShardedModelV2, optimizer: Any, gpu_margin_mem_ratio: float = 0.0,
                 initial_scale: float = 2**32, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, dp_process_group: Any = None, mp_process_group: Any = None,
                 verbose: bool = False, *, max_norm: float = 0.0, norm_type: float = 2.0,
                 step_in_backward: bool = False) -> None:
        if not isinstance(sharded_model, ShardedModelV2):
            raise ArgumentTypeError("sharded_model", type(sharded_model).__name__, "a chunkmem.ShardedModelV2")
        check_supported_optimizer(optimizer)
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
        if not isinstance(sharded_model, ShardedModelV2):
            raise ArgumentTypeError("sharded_model", type(sharded_model).__name__, "a chunkmem.ShardedModelV2")
        check_supported_optimizer(optimizer)
        check_type("settings", settings, OptimizerSettings, "a chunkmem.settings.OptimizerSettings")
        optim = cls.__new__(cls)
        optim._attach(sharded_model, optimizer, settings)
        return optim

    def _attach(self, sharded_model: ShardedModelV2, optimizer: Any, settings: OptimizerSettings) -> None:
        """Check everything against the model, then place the optimizer state in its chunks."""
        if settings.gpu_margin_mem_ratio > 0 and sharded_model.tensor_placement_policy != "auto":
            warnings.warn(f"gpu_margin_mem_ratio={settings.gpu_margin_mem_ratio} has no effect with "
                          f"tensor_placement_policy={sharded_model.tensor_placement_policy!r}; it is used only "
                          f"with 'auto'", stacklevel=3)
        try:  # a rank refused here still meets the others' agreement (else they would wait for it)
            dp_shards = sharded_model.data_parallel.of_same_ranks(
                settings.dp_process_group, "dp_process_group", "the model's data-parallel ranks (its process_group)")
            if settings.mp_process_group is not None:
                ShardGroup.of(settings.mp_process_group, "mp_process_group")
            check_step_in_backward(sharded_model.settings, sharded_model.dtype, settings)
            if sharded_model.optimizer_attached:
                raise InvalidArgumentError("sharded_model", "a model that already has a ShardedOptimizerV2",
                                           "a ShardedModelV2 without an optimizer")
            scaler = DynamicGradScaler.from_settings(settings.scaler)
            group_of = self._groups_of(sharded_model, optimizer)
            layout = self._state_layout(sharded_model, optimizer)
            self._check_capacity(sharded_model, layout)
            check_undo_room(sharded_model, layout, settings)
        except ChunkmemError as refused:
            refuse_together(sharded_model.data_parallel, "ShardedOptimizerV2", refused)
        self._agree_on_settings(sharded_model, optimizer, settings, group_of)
        kept_on_host = self._optimizer_state_kept_on_host(sharded_model, layout)
        self._reserve_disk(sharded_model, layout, kept_on_host)

        self.model = sharded_model
        self.optim = optimizer
        seal_param_groups(optimizer, "ShardedOptimizerV2")
        self.settings = settings
        self.runtime = sharded_model.runtime
        self._group_of = group_of
        # The norm sums over the ranks holding one copy of the gradients: the shard group (with shard
        # groups every replica group holds the same reduced shards).
        norm_ranks = dp_shards if sharded_model.replicas is None else sharded_model.shards
        self.mixed = MixedPrecisionStep(scaler if sharded_model.dtype == torch.float16 else None,
                                        (norm_ranks.group if norm_ranks.sharded else None, settings.mp_process_group),
                                        settings.verbose)
        # backward passes of the model whose gradients may be stepped on (all of them without a scaler;
        # with one, those run by backward() / backward_by_grad())
        self._accounted_backwards = self.runtime.backward_count
        self._broken_by: ChunkmemError | None = None  # a failed step that could not be undone
        self._backward = BackwardStep(self)  # step_in_backward: what the backward started
        self._idioms = GradientIdioms(self)  # torch's idioms on the parameters' .grad stand-ins
        self._layout = layout  # None: the Adam kernel; else any_optimizer's stand-in step
        self._layout_watch = None if layout is None else LayoutWatch(optimizer, layout, "ShardedOptimizerV2")
        self._scalars: dict[int, dict[int, dict[str, Any]]] = {}  # any_optimizer: chunk -> slot -> scalar state
        self._whole_state: dict[int, dict[int, dict[str, Any]]] = {}  # any_optimizer: chunk -> slot -> its state
        self._init_optimizer_hooks()
        if layout is not None:
            optimizer.state.clear()  # what its constructor made (Adagrad's sums): the chunks keep the state
            for chunk in self.runtime.trainable_chunks():
                chunk.use_state_families(layout.families)
        self.runtime.attach_optimizer(self, settings.gpu_margin_mem_ratio, kept_on_host)

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
        check_type("settings", settings, OptimizerSettings, "a chunkmem.settings.OptimizerSettings")
        ShardGroup.of(model_settings.process_group, "process_group").of_same_ranks(
            settings.dp_process_group, "dp_process_group", "the model's data-parallel ranks (its process_group)")
        if settings.mp_process_group is not None:
            ShardGroup.of(settings.mp_process_group, "mp_process_group")
        if settings.step_in_backward:
            check_step_in_backward(model_settings, compute_dtype(module, model_settings), settings)

    @staticmethod
    def _groups_of(model: ShardedModelV2, optimizer: Any) -> dict[int, int]:
        """``id(parameter)`` -> the index of its param group; every trainable parameter must have one."""
        group_of: dict[int, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if slot_of(param) is None or model.parameter_name(param) is None:
                    raise InvalidArgumentError("optimizer", f"a parameter of shape {tuple(param.shape)}",
                                               "an optimizer over the ShardedModelV2's own parameters only")
                group_of[id(param)] = index
        missing = [name for name, p in model.module.named_parameters() if p.requires_grad and id(p) not in group_of]
        if missing:
            raise InvalidArgumentError("optimizer", f"param_groups without {missing[:5]}",
                                       "param_groups holding every parameter that requires grad "
                                       "(freeze the others with requires_grad_(False))")
        return group_of

    @staticmethod
    def _agree_on_settings(model: ShardedModelV2, optimizer: Any, settings: OptimizerSettings,
                           group_of: dict[int, int]) -> None:
        """Sharded, every rank must step with the same rules: agree (before anything changes) on the
        wrapped optimizer's class and groups, each parameter's group, the loss scaler's rules and the
        clipping (a rank with another initial scale would unscale its shard by another factor)."""
        params = ParamRecord()
        for name, param in model.module.named_parameters():
            params.add(name, param.shape, param.requires_grad)
        groups = ",".join(str(group_of.get(id(p), "-")) for _, p in model.module.named_parameters())
        description = [(ARGUMENTS, "accepted"), ("optimizer", type(optimizer).__name__),
                       ("param groups", str(len(optimizer.param_groups))),
                       ("param group of each parameter", groups),
                       ("loss scaler", repr(settings.scaler) if model.dtype == torch.float16 else "none"),
                       ("max_norm", str(settings.max_norm)), ("norm_type", str(settings.norm_type)),
                       ("gpu_margin_mem_ratio", str(settings.gpu_margin_mem_ratio)),
                       ("step_in_backward", str(settings.step_in_backward))]
        agree(model.data_parallel, LayoutDescription("ShardedOptimizerV2", description, params))

    @staticmethod
    def _state_layout(model: ShardedModelV2, optimizer: Any) -> StateLayout | None:
        """``None`` when the Adam kernel runs ``optimizer``; else what it keeps per parameter (refusing, before
        anything changes, what chunkmem cannot run: see :mod:`chunkmem.optim.any_optimizer`)."""
        if runs_adam_kernel(optimizer):
            return None
        layout = probe_state(optimizer)
        if model.shards.sharded:
            check_elementwise(optimizer, "on a sharded model (several ranks)", "each rank holds pieces")
        if model.settings.disk.optimizer_on_disk:
            check_elementwise(optimizer, "with the optimizer state on the disk tier",
                              "the disk step streams each chunk in pieces of its I/O buffers' size")
        return layout

    @staticmethod
    def _check_capacity(model: ShardedModelV2, state: StateLayout | None) -> None:
        """Refuse before any change if the optimizer state the policy puts on the device cannot fit."""
        layout, runtime = model.layout, model.runtime
        per_element = 2 if state is None else len(state.families)
        fp32_families = per_element + (1 if model.dtype != torch.float32 else 0)
        trainable = [i for i in range(layout.num_chunks) if layout.trainable(i)]
        need = sum(fp32_families * layout.shard_numel(i, model.shards.world) * 4
                   for k, i in enumerate(trainable) if runtime.policy.optim_on_device(k, len(trainable)))
        ledger = runtime.ledger
        free = ledger.capacity - ledger.tier_bytes(Tier.DEVICE)
        if need > free:
            raise DeviceCapacityError(
                f"the optimizer state placed on the device needs {need} bytes, but only {free} of the device "
                f"tier's capacity of {ledger.capacity} bytes are free; use placement 'cpu' or raise the capacity")

    @staticmethod
    def _reserve_disk(model: ShardedModelV2, state: StateLayout | None, kept_on_host: list[int]) -> None:
        """Preallocate the disk tier's files for the optimizer state: a region for each trainable chunk whose
        state rests on disk, none for frozen chunks, those ``kept_on_host`` and those whose state the policy
        keeps on the device (a full disk is refused here, before anything changes)."""
        disk = model.runtime.memory.disk
        if disk is None or not model.settings.disk.optimizer_on_disk:
            return
        layout, policy = model.layout, model.runtime.policy
        region = layout.chunk_numel // model.shards.world * 4  # fp32, a chunk of the full size
        trainable = [i for i in range(layout.num_chunks) if layout.trainable(i)]
        on_disk = {i for k, i in enumerate(trainable)
                   if i not in kept_on_host and not policy.optim_on_device(k, len(trainable))}
        regions = [region if i in on_disk else 0 for i in range(layout.num_chunks)]
        families = (ADAM_STATE if state is None else state.families) + (
            (MASTER,) if model.dtype != torch.float32 else ())
        for family in families:
            disk.reserve_chunks(family, regions)
        if model.dtype == torch.float32 and disk.atomic_step:
            disk.reserve_chunks(JOURNAL, regions, slots=1)

    @staticmethod
    def _optimizer_state_kept_on_host(model: ShardedModelV2, state: StateLayout | None) -> list[int]:
        """Under ``auto`` with ``offload_optimizer="disk"`` and a host capacity: the chunks whose optimizer
        state stays on the host, the first trainable ones that fit in the host capacity after what the
        host already holds, the gradients the step will hold there and the disk tier's I/O buffers; the
        rest rests on disk. (Each chunk's state is used once per step, so which chunks stay does not change
        the bytes moved. The first chunks stay: their gradients are finished last in the backward, so
        with ``step_in_backward`` the disk chunks' updates overlap the rest of the backward.)"""
        runtime, disk = model.runtime, model.runtime.memory.disk
        ledger = runtime.ledger
        if not (runtime.policy.plans_from_trace and runtime.policy.optimizer_on_disk and ledger.host_capacity):
            return []
        chunks = runtime.trainable_chunks()
        first = chunks[0]
        families = len(ADAM_STATE if state is None else state.families)
        state_bytes = (families + first.has_master) * first.shard_numel * 4
        grads = 0 if model.reuse_fp16_shard else len(chunks) * first.param.shard.nbytes
        streamed = streamed_count(families, first.has_master, runtime.policy.params_on_disk, disk.atomic_step)
        io_bytes = disk.buffer_count * streamed * disk.buffer_size
        free = ledger.host_capacity - ledger.tier_bytes(Tier.HOST) - grads - io_bytes
        count = min(max(free, 0) // state_bytes, len(chunks))
        return [c.index for c in chunks[:count]]

    def _trainable_chunks(self) -> list[Chunk]:
        return self.runtime.trainable_chunks()

    def _stepped_slots(self, chunk: Chunk) -> list[tuple[ParamSlot, int, tuple[int, int] | None]]:
        """``(slot, group, part)`` for each parameter of ``chunk`` the step updates (in a param group,
        trainable now, and given a gradient since the last step: torch skips a parameter whose ``.grad`` is
        None, its state and step count unchanged), ``part`` being its elements in this rank's shard
        ``(start, end)`` or ``None``."""
        stepped = []
        with torch._C.DisableTorchFunctionSubclass():  # requires_grad of a chunk-managed parameter
            for slot in chunk.slots:
                group = self._group_of.get(id(slot.param))
                if group is not None and slot.param.requires_grad and slot.index_in_chunk in chunk.slots_with_grads:
                    stepped.append((slot, group, chunk.own_range(slot)))
        return stepped

    def _ranges(self, chunk: Chunk) -> list[tuple[int, int, AdamHyper, int]]:
        """``(start, end, hyper, step)``: the runs of this rank's shard of ``chunk`` (elements) whose parameters
        the step updates (:meth:`_stepped_slots`), are in one param group and have taken the same number of
        steps, with that group's current hyper-parameters and the step number after this update."""
        pieces = []
        for slot, group, part in self._stepped_slots(chunk):
            if part is not None:
                start = slot.offset + part[0] - chunk.shard_offset
                pieces.append((start, start + part[1] - part[0], (group, chunk.step_of(slot) + 1)))
        return [(a, b, hyper_of_group(self.optim.param_groups[g]), step) for a, b, (g, step) in join_runs(pieces)]

    # ---- torch.optim.Optimizer ---------------------------------------------------------------------
    # Optimizer.__init__ is not called: it would build a second list of param groups and a second state.

    def _init_optimizer_hooks(self) -> None:
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups, the same list (hyper-parameters are read from here at
        every step, so a scheduler that changes ``lr`` or ``betas`` changes the next step)."""
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's default hyper-parameters."""
        return self.optim.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state, which stays empty: the step counts and moments
        live in the chunks; :meth:`state_dict` returns them in torch's layout."""
        return self.optim.state

    def add_param_group(self, param_group: dict[str, Any]) -> NoReturn:
        """Refused: every trainable parameter is in a param group from the start. Give the wrapped
        optimizer every group before building this one."""
        raise UnsupportedOperationError(
            "ShardedOptimizerV2.add_param_group is not supported: every trainable parameter is in a param group "
            "from the start; pass every param group to the wrapped optimizer before building ShardedOptimizerV2")

    def __getstate__(self) -> NoReturn:
        raise UnsupportedOperationError(
            "a ShardedOptimizerV2 cannot be pickled or copied (its state lives in the model's chunks); save "
            "optim.state_dict() or use chunkmem.save_checkpoint")

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
        return self._layout

    def group_of(self, param: nn.Parameter) -> int | None:
        """The index of ``param``'s group in the wrapped optimizer (``None``: not one of its parameters)."""
        return self._group_of.get(id(param))

    def scalar_state(self, chunk: Chunk) -> dict[int, dict[str, Any]]:
        """An optimizer other than Adam: the scalar state (``step``, ...) of each of ``chunk``'s parameters
        that has stepped, by its position in the chunk (``index_in_chunk``; per parameter, as torch keeps
        it), changed in place."""
        return self._scalars.setdefault(chunk.index, {})

    def whole_state(self, chunk: Chunk) -> dict[int, dict[str, Any]]:
        """Another optimizer's whole-parameter state for ``chunk``'s parameters, by their position in the
        chunk (``state_layout.whole``; :mod:`chunkmem.optim.any_optimizer`)."""
        return self._whole_state.setdefault(chunk.index, {})

    def replace_kept_state(self, chunk: Chunk, scalars: dict[int, dict[str, Any]],
                           whole: dict[int, dict[str, Any]]) -> None:
        """Make ``scalars`` and ``whole`` (both by position in the chunk) another optimizer's scalar and
        whole-parameter state for ``chunk`` (loading a checkpoint; the caller's copies are kept)."""
        for kept, loaded in ((self.scalar_state(chunk), scalars), (self.whole_state(chunk), whole)):
            kept.clear()
            kept.update(loaded)

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
        self._run_backward(lambda: (loss * self.loss_scale if self.grad_scaler else loss).backward())

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from ``tensor`` with the upstream gradient ``grad`` (not scaled: with fp16, ``grad``
        is expected to carry the loss scale already)."""
        check_type("tensor", tensor, torch.Tensor, "a torch.Tensor")
        check_type("grad", grad, torch.Tensor, "a torch.Tensor shaped like tensor")
        self._check_can_accumulate()
        self._run_backward(lambda: torch.autograd.backward(tensor, grad))

    def _run_backward(self, run: Callable[[], None]) -> None:
        """Run a backward and count the model's backward passes it made as scaled."""
        before = self.runtime.backward_count
        try:
            run()
        except BaseException as error:
            self.runtime.abandon_iteration(error)
            raise
        finally:
            self._accounted_backwards += self.runtime.backward_count - before
            self.runtime.backward_returned()

    def _check_backward_was_scaled(self) -> None:
        """With a loss scaler, raise if a backward pass of the model did not go through :meth:`backward`."""
        if self.grad_scaler is None:
            return
        unscaled = self.runtime.backward_count - self._accounted_backwards
        if unscaled:
            raise UnscaledBackwardError(
                f"{unscaled} backward pass(es) of the fp16 model since the last zero_grad() did not go through "
                f"the loss scaler (loss.backward()?): their gradients are not multiplied by the loss scale "
                f"({self.loss_scale}), so the step would divide them by it. Call optim.backward(loss) instead "
                f"of loss.backward(); call optim.zero_grad() to drop the gradients already accumulated")

    def _forget_backwards(self) -> None:
        """The gradients were dropped: earlier backward passes no longer matter."""
        self._accounted_backwards = self.runtime.backward_count

    def _check_can_accumulate(self) -> None:
        if self._backward.pending:
            raise GradientAccumulationError(
                "step_in_backward=True: the last backward already started this step's updates of the chunks, so "
                "a second backward cannot add to their gradients; call optim.step() first, or run the backwards "
                "before the last one inside optim.accumulating()")
        self.runtime.check_can_accumulate()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """``with optim.accumulating(): optim.backward(loss)``: with ``step_in_backward``, the backwards run
        inside add to the gradients without starting the step's updates, so that several backwards accumulate
        before one :meth:`step`; run the last backward before :meth:`step` outside it (its updates start in
        that backward, over the summed gradients). Without ``step_in_backward`` it changes nothing."""
        if self._backward.accumulating:
            raise InvalidArgumentError("accumulating", "a nested accumulating()", "one accumulating() at a time")
        self._backward.accumulating = True
        try:
            yield
        finally:
            self._backward.accumulating = False

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the coming step to total norm ``max_norm``; returns the total norm of the
        unscaled gradients (inf or NaN if they overflowed). Clipping is folded into the update."""
        check_number("max_norm", max_norm, low=0.0, low_open=True)
        check_number("norm_type", norm_type, low=0.0, low_open=True)
        self.check_can_rescale("clip_grad_norm")
        self.runtime.agree("clip", "ShardedOptimizerV2.clip_grad_norm()",
                           [("optimizer steps so far", self.runtime.step_count), ("max_norm", max_norm),
                            ("norm_type", norm_type)])
        self._check_backward_was_scaled()
        return self.mixed.clip(self._grads(), max_norm, float(norm_type))

    def check_can_rescale(self, what: str) -> None:
        """Refuse ``what`` (a clipping decided after the backward) where the backward's updates could not be
        redone with another multiplier."""
        reason = why_no_speculation(self.model.settings) if self.step_in_backward else None
        if reason is not None:
            raise UnsupportedOperationError(
                f"{what} with step_in_backward=True and {reason}: the chunks on disk are updated during the "
                f"backward, before the norm of all gradients exists, and clipping would have to redo them; build the "
                f"ShardedOptimizerV2 without step_in_backward to clip")

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on the ``.grad`` stand-ins of this model's parameters (the runtime's
        :class:`~chunkmem.runtime.runtime.OptimizerListener` side; :mod:`chunkmem.optim.gradient_idioms`)."""
        return self._idioms.run(func, args, kwargs)

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradients for the global norm: its shards, and a replicated chunk's whole gradients
        on the first rank only (every rank holds the same; the norm sums over the ranks)."""
        return [t for c in self._trainable_chunks() if c.replicas is None or c.replicas.rank == 0
                for t in self.runtime.grad_tensors(c)]

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        """What the coming step multiplies the gradients by: the clipping over the loss scale, and for
        ``slot`` the factor torch's in-place idioms gave its gradient (the runtime's
        :class:`~chunkmem.runtime.runtime.OptimizerListener` side, read by the accessors)."""
        return self.mixed.multiplier * (1.0 if slot is None else self._idioms.factor_of(slot))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale, check for overflow, clip, and update every chunk where its optimizer state lives.

        Returns ``True`` if the parameters were updated, ``False`` if the step was skipped (overflow,
        or no gradients since the last step); with ``closure`` (torch's argument: it recomputes the loss,
        run once before the update, :mod:`chunkmem.optim.closure`), what the closure returned. Either way the step releases the gradients it consumed,
        as the reference does, so a loop without ``zero_grad()`` trains like one with it; several
        backwards before one step accumulate. A skipped step leaves masters and optimizer state
        untouched. With ``max_norm`` the gradients are clipped to that total norm inside the step (unless
        :meth:`clip_grad_norm` was called since the backward: its clipping is the one applied). With
        fp16, gradients from a backward that bypassed :meth:`backward` raise
        :class:`~chunkmem.UnscaledBackwardError` and change nothing. Hooks registered with
        ``register_step_pre_hook`` / ``register_step_post_hook`` run before and after.
        """
        loss = run_closure(closure)
        applied = self._step()
        self.optim._opt_called = True  # a schedule built on the wrapped optimizer reads it: it stepped
        return applied if closure is None else loss

    def _step(self) -> bool:
        self._backward.settle()  # (the backward's end did; a backward that stopped on a collective error did not)
        try:
            scaled_by, refused = self._idioms.uniform_factor(self._trainable_chunks()), None
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
            return False
        self.mixed.scaled_by = scaled_by
        self.runtime.refuse_unfrozen("ShardedOptimizerV2.step()")
        if self._layout_watch is not None:
            self._layout_watch.check()
        self._check_backward_was_scaled()
        self._backward.kept = 0
        multiplier = self.mixed.decide(self._grads(), self.max_norm, self.norm_type)
        if multiplier is None:
            self._backward.abandon_in_flight()  # made as if nothing overflowed
            self._backward.undo_in_memory()
            self._discard_grads()
            return False
        if self._broken_by is not None:
            raise self._broken_by
        self._agree_on_gradients()
        on_disk = [c for c in self._trainable_chunks() if self.runtime.optim_tier(c) is Tier.DISK]
        try:
            self._update_on_disk(on_disk, multiplier)  # first: the only part that can fail half-way
        except BaseException:
            self._backward.undo_in_memory()  # the step did not happen: neither did the backward's updates
            raise
        for chunk in self._trainable_chunks():
            if self.runtime.optim_tier(chunk) is not Tier.DISK and not self._backward.keep(chunk, multiplier):
                self._update_chunk(chunk, multiplier)
        self.mixed.stepped()
        self.runtime.end_step(release_gradients=True)
        self._forget_backwards()
        return True

    step = Optimizer.profile_hook_step(step)  # runs torch's step pre/post hooks around it
    step.hooked = True  # type: ignore[attr-defined]  # tells torch not to wrap it again

    def _agree_on_gradients(self) -> None:
        """With several ranks, a parameter has a gradient in this step when any rank produced one for it (as
        under DDP), so every rank steps the same parameters: one small all-reduce of which parameters got one."""
        chunks = self._trainable_chunks()
        flags = iter(held_on_any_rank(self.runtime.data_parallel,
                                      [s.index_in_chunk in c.slots_with_grads for c in chunks for s in c.slots],
                                      "the parameters given a gradient in this step"))
        for chunk in chunks:
            chunk.slots_with_grads = {slot.index_in_chunk for slot in chunk.slots if next(flags)}

    def _update_chunk(self, chunk: Chunk, multiplier: float) -> None:
        if self._layout is not None:
            self._update_with_any_optimizer(chunk, multiplier)
            return
        tier = self.runtime.compute_tier(chunk)
        pieces = self.runtime.grad_pieces(chunk)  # autograd's tensors, where the runtime kept them
        grad = self.runtime.grad_of(chunk) if pieces is None else None
        with self.runtime.updating(chunk, tier) as target:
            self._adam(chunk, target, grad, pieces, self._ranges(chunk), multiplier)
            chunk.advance_steps(slot for slot, _, _ in self._stepped_slots(chunk))

    def updates_off_thread(self, chunk: Chunk) -> bool:
        """Whether the backward may hand ``chunk``'s update to :mod:`chunkmem.optim.host_updates`: Adam's
        kernel on the host, over the flat gradient whose copy to the host completes late (CUDA)."""
        return (self._layout is None and self.runtime.memory.copies.asynchronous
                and self.runtime.compute_tier(chunk) is Tier.HOST and self.runtime.grad_pieces(chunk) is None)

    def start_update_off_thread(self, chunk: Chunk, multiplier: float, updates: HostUpdates,
                                first: Callable[[], None], undo: UndoCopy) -> None:
        """:meth:`_update_chunk` of a chunk :meth:`updates_off_thread` allows, as a job of ``updates``: the
        bookkeeping now; on the job's thread the waits for the gradient's copy and for the fetch still reading
        the parameters the update writes, ``first()``, and the update, which fills ``undo`` as it reads the
        state; the copy marked updated and the step counts advanced when ``updates`` is joined."""
        tier = self.runtime.compute_tier(chunk)
        grad, landed = self.runtime.grad_landing(chunk)
        target, target_free = self.runtime.update_target_waiting_later(chunk, tier)
        ranges = self._ranges(chunk)
        stepped = [slot for slot, _, _ in self._stepped_slots(chunk)]

        def work() -> None:
            landed()
            target_free()
            first()
            self._adam(chunk, target, grad, None, ranges, multiplier, undo)

        def then() -> None:
            self.runtime.mark_updated(chunk, tier)
            chunk.advance_steps(stepped)

        updates.submit(work, then)

    def _adam(self, chunk: Chunk, target: torch.Tensor, grad: torch.Tensor | None,
              pieces: list[tuple[int, torch.Tensor]] | None, ranges: list[tuple[int, int, AdamHyper, int]],
              multiplier: float, undo: UndoCopy | None = None) -> None:
        """Adam over ``ranges`` of this rank's shard of ``chunk`` into ``target`` (the copy of the parameters
        the update writes), from the flat ``grad`` or from autograd's ``pieces``; tensors only, no runtime
        state, except where pieces fall back to the flat gradient. ``undo``: an undo copy to fill with the
        values before the update (by the kernel as it reads them, where it can)."""
        if grad is not None:
            grad = grad.to(target.device)
        master = chunk.optim[MASTER].tensor if chunk.has_master else target
        exp_avg, exp_avg_sq = chunk.optim[EXP_AVG].tensor, chunk.optim[EXP_AVG_SQ].tensor
        spans = param_spans(chunk.slots, chunk.shard_offset)
        saved = undo.adam_copies() if undo is not None and pieces is None else None
        if undo is not None and saved is None:
            UndoCopies.fill(undo)
        reached = 0  # ranges whose update was started: their undo values are in (adam_update_ sees to that)
        try:
            for a, b, hyper, step in ranges:
                reached += 1
                out = target[a:b] if chunk.has_master else None
                relative_spans = [(s - a, e - a) for s, e in spans]
                if pieces is not None:
                    inside = [(offset - a, t) for offset, t in pieces if a <= offset < b]
                    if adam_update_pieces_(master[a:b], inside, exp_avg[a:b], exp_avg_sq[a:b], step, hyper,
                                           multiplier, out, relative_spans):
                        continue
                    pieces, grad = None, self.runtime.grad_of(chunk).to(target.device)  # flat from here on
                adam_update_(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step, hyper,
                             grad_multiplier=multiplier, param_out=out, param_spans=relative_spans,
                             undo=None if saved is None else (saved[0][a:b], saved[1][a:b], saved[2][a:b]))
        finally:
            if saved is not None:  # the values no update read: between the ranges, and past a failed one
                UndoCopies.fill(undo, outside=gaps(ranges[:reached], 0, chunk.shard_numel))
        if chunk.has_master:  # the copy written may be new memory: what no range wrote is the master's rounding
            for a, b in gaps(ranges, 0, chunk.shard_numel):
                target[a:b].copy_(master[a:b])

    def _param_views(self, chunk: Chunk) -> list[ParamView]:
        """The stepped parameters' parts of this rank's shard of ``chunk`` (shaped where whole; those with
        none :meth:`~chunkmem.optim.any_optimizer.ParamView.elsewhere`), keyed by their position in the
        chunk, for :mod:`chunkmem.optim.any_optimizer`."""
        return [ParamView.elsewhere(group, slot.index_in_chunk) if part is None else
                ParamView.of_part(slot.offset, slot.numel, slot.shape, part, chunk.shard_offset, group,
                                  slot.index_in_chunk)
                for slot, group, part in self._stepped_slots(chunk)]

    def _update_with_any_optimizer(self, chunk: Chunk, multiplier: float) -> None:
        """The wrapped optimizer's own step over ``chunk`` on stand-ins (:mod:`chunkmem.optim.any_optimizer`)."""
        tier = self.runtime.compute_tier(chunk)
        grad = self.runtime.grad_of(chunk)
        views = self._param_views(chunk)
        with self.runtime.updating(chunk, tier) as target:
            master = chunk.optim[MASTER].tensor if chunk.has_master else target
            grad32 = grad.to(device=target.device, dtype=torch.float32, copy=True).mul_(multiplier)
            families = {key: chunk.optim[key].tensor for key in self._layout.families}
            step_parameters(self.optim, self._layout, views, master, grad32, families, self.scalar_state(chunk),
                            whole_state=self.whole_state(chunk))
            chunk.advance_steps(slot for slot, _, _ in self._stepped_slots(chunk))
            if chunk.has_master:
                target.copy_(master)

    def _disk_update(self, chunk: Chunk, multiplier: float) -> ChunkUpdate:
        """What the streamed step needs to update ``chunk`` (its gradients final)."""
        param = None if chunk.param.shard.on_disk else self.runtime.update_target(chunk, Tier.HOST)
        rule, ranges = None, []
        if self._layout is None:
            ranges = self._ranges(chunk)
        else:
            rule = PieceStep(self.optim, self._layout, self._param_views(chunk), self.scalar_state(chunk),
                             multiplier)
        return ChunkUpdate(chunk, self.runtime.grad_of(chunk), param, [slot for slot, _, _ in self._stepped_slots(chunk)],
                           ranges, param_spans(chunk.slots, chunk.shard_offset), multiplier, rule)

    def on_grads_final(self, chunk: Chunk) -> None:
        """``step_in_backward``: update ``chunk`` now that its gradients are final, as if nothing overflowed
        and nothing is clipped (:meth:`chunkmem.optim.backward_step.BackwardStep.on_grads_final`; the
        runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener` side)."""
        self._backward.on_grads_final(chunk)

    def _update_on_disk(self, chunks: list[Chunk], multiplier: float) -> None:
        """Update the chunks whose optimizer state rests on disk in one streamed step (see
        :mod:`chunkmem.optim.disk_step`): all of them, or none (then :class:`DiskStepError`). With
        ``step_in_backward``, the step the backward started, completed with any chunk it did not get."""
        if not self.runtime.policy.optimizer_on_disk:
            return  # (with a disk tier every rank runs the step below, even with no chunk on disk: it agrees)
        if self._backward.in_flight is not None and not self._backward.holds(multiplier):
            reason = why_no_speculation(self.model.settings)
            if reason is not None:  # (fp16 and clipping were refused: the hyper-parameters changed)
                self._refuse_redo(reason)
            self._backward.abandon_in_flight()  # clipped, or the hyper-parameters changed: redone below
        step = self._backward.take_in_flight()
        kept = 0 if step is None else len(step.updates)
        if step is None:
            step = StreamedStep.over(self.runtime.memory.disk, [self._disk_update(c, multiplier) for c in chunks],
                                     self.mixed.any_rank)
            finish = step.run
        else:
            started = {id(update.chunk) for update in step.updates}
            for chunk in chunks:
                if id(chunk) not in started:
                    step.add(self._disk_update(chunk, multiplier))
            finish = step.finish
        updates = step.updates
        try:
            finish()
        except DiskStepError as exc:
            if not exc.undone:
                self._broken_by = exc
            elif self.model.reuse_fp16_shard:
                self._discard_grads()  # the update overwrote them in place
            else:
                for update in updates:
                    if update.updated_to and update.param is not None:
                        self.runtime.mark_updated(update.chunk, Tier.HOST)
            raise
        self._backward.kept += kept
        self._completed(updates)

    def _completed(self, updates: list[ChunkUpdate]) -> None:
        """The streamed step wrote ``updates``: their chunks' step counts, scalar state and parameters."""
        for update in updates:
            update.chunk.advance_steps(update.stepped)
            if isinstance(update.rule, PieceStep):
                self._scalars[update.chunk.index] = update.rule.scalars_after
            self.runtime.mark_updated(update.chunk, Tier.DISK if update.param is None else Tier.HOST)

    def _refuse_redo(self, reason: str) -> NoReturn:
        """The backward's disk updates are not this step's (hyper-parameters or trainable parameters changed
        in between) and cannot be redone (``reason``): raise, leaving the state as before the backward where
        the updates can be undone, else the optimizer broken until a state is loaded (as a failed step)."""
        message = ("optim.step() after a backward with step_in_backward=True: the hyper-parameters or the "
                   "trainable parameters changed between the backward and the step, but the backward's updates "
                   f"of the chunks on disk used the old ones and with {reason} they cannot be redone; change "
                   "hyper-parameters after optim.step(), as LR schedulers do. ")
        if self.runtime.memory.disk.atomic_step:
            self._backward.abandon_in_flight()
            self._backward.undo_in_memory()
            self._discard_grads()
            raise UnsupportedOperationError(message + "The step was skipped: parameters and optimizer state are "
                                            "as before the backward, its gradients dropped")
        step = self._backward.take_in_flight()
        step.finish()  # the chunks it started are written in place: complete them, nothing else
        self._completed(step.updates)
        self._broken_by = UnsupportedOperationError(
            message + "The chunks the backward started were updated in place with the old values, the others "
                      "not: load a checkpoint (chunkmem.load_checkpoint) to step again")
        raise self._broken_by

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
        self._broken_by = None

    def check_no_step_in_flight(self, action: str) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` if a backward with ``step_in_backward``
        started updates that :meth:`step` has not completed yet (``action``: what was attempted)."""
        if self._backward.pending:
            raise UnsupportedOperationError(
                f"{action} between a backward and optim.step() with step_in_backward=True: the backward's "
                f"updates are not decided yet (optim.step() keeps or redoes them); call optim.step() first")

    def on_backward_end(self) -> None:
        """The backward is over (the runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener` side):
        complete the updates it handed off autograd's thread (:mod:`chunkmem.optim.host_updates`)."""
        self._backward.settle()

    def on_backward_failed(self) -> None:
        """A backward raised part-way (the runtime's :class:`~chunkmem.runtime.runtime.OptimizerListener`
        side): as :meth:`zero_grad`, every pending gradient is dropped and the updates the backward started
        (``step_in_backward``) are undone, so the next :meth:`step` has nothing to apply. Updates the backward
        made in place on disk (``atomic_step=False``) cannot be undone: those it started are completed (its
        I/O buffers returned), and the optimizer refuses to step until a checkpoint or state dict is loaded, as
        after a failed step (before 2026-11-27 every later step spun on the stream's buffers forever)."""
        if self._backward.in_flight is not None and not self.runtime.memory.disk.atomic_step:
            step = self._backward.take_in_flight()
            try:
                step.finish()
            finally:
                self._completed(step.updates)
                self._broken_by = UnsupportedOperationError(
                    "a backward raised after step_in_backward=True had updated chunks in place on disk "
                    "(atomic_step=False): those updates cannot be undone and the other chunks were not updated; "
                    "load a checkpoint (chunkmem.load_checkpoint) or a state dict to step again")
                self._backward.undo_in_memory()
                self.runtime.drop_gradients(set_to_none=True)
                self.mixed.forget()
                self._forget_backwards()
            return
        self.zero_grad(set_to_none=True)

    def _discard_grads(self) -> None:
        """Drop the gradients (a skipped step, a failed disk step that overwrote them): with
        ``reuse_fp16_shard`` the parameters' memory gets its values back from the masters."""
        self.runtime.drop_gradients(set_to_none=True)
        self.mixed.forget()
        self._forget_backwards()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (``set_to_none``) or zero them. With ``reuse_fp16_shard`` and no step since
        the backward, the parameters are restored from the masters. With ``step_in_backward`` and no
        step since the backward, the updates the backward started are undone (``atomic_step=True``) or,
        as they cannot be (``atomic_step=False``), :class:`~chunkmem.UnsupportedOperationError` is raised
        with nothing changed."""
        check_type("set_to_none", set_to_none, bool, "True or False")
        try:
            self._backward.settle()
        except Exception:  # an update that failed off autograd's thread: undone below with the others
            pass
        if self._backward.in_flight is not None:
            if not self.runtime.memory.disk.atomic_step:
                raise UnsupportedOperationError(
                    "zero_grad() after a backward with step_in_backward=True and atomic_step=False: the backward "
                    "already updated chunks in place on disk and that cannot be undone; call optim.step() to "
                    "complete the step")
            self._backward.abandon_in_flight()
        self._backward.undo_in_memory()
        self.runtime.drop_gradients(set_to_none)
        self.mixed.forget()
        self._forget_backwards()

    def get_memory_usage(self, with_disk: bool = False) -> tuple[int, ...]:
        """``(device_bytes, host_bytes)`` of the fp32 masters (the fp32 parameters when there is no
        separate master) and the per-element optimizer state (Adam: exp_avg and exp_avg_sq; another
        optimizer: its :attr:`state_layout` families); with ``with_disk=True``, ``(device_bytes,
        host_bytes, disk_bytes)``, the third being what rests on the disk tier (the buffers' own bytes;
        the files' size is ``model.disk_file_bytes()``)."""
        check_type("with_disk", with_disk, bool, "True or False")
        usage = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
        for chunk in self._trainable_chunks():
            tier = self.runtime.compute_tier(chunk)
            for family in chunk.state_families + ((MASTER,) if chunk.has_master else ()):
                buf = chunk.optim[family]
                if buf.allocated:
                    usage[buf.tier] += buf.nbytes
            if not chunk.has_master:
                usage[tier] += chunk.param.shard.nbytes
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
        from .state_dict import optimizer_state_dict

        check_type("rank0_only", rank0_only, bool, "True or False")
        self.check_no_step_in_flight("optim.state_dict()")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = optimizer_state_dict(self, rank0_only)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            replaced = post_hook(self, state)
            state = state if replaced is None else replaced
        return state

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
        from .state_dict import plan_optimizer_load

        self.check_no_step_in_flight("optim.load_state_dict()")
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            replaced = pre_hook(self, state_dict)
            state_dict = state_dict if replaced is None else replaced
        plan_optimizer_load(self, state_dict).apply()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
