"""Building a :class:`~chunkmem.ShardedOptimizerV2`: every check against the wrapped model, then the parts it runs
with, as :mod:`chunkmem.model.builder` is for the model.

:func:`build_parts` checks the arguments (process groups, ``step_in_backward``, the wrapped optimizer's
param groups and state, room for its state on the device, on the host for the undo copies and on the disk),
refusing together with the other ranks before anything changes, agrees with them on the settings, chooses the
chunk update rule once (:func:`choose_update_rule`) and reserves the disk tier's regions for the state.
:func:`check_before_wrapping` runs the checks that need no wrapped model.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.builder import compute_dtype
from ..core.chunk import MASTER, Chunk
from ..core.disk_tier import JOURNAL
from ..core.param_guard import slot_of
from ..core.tiers import Tier
from ..distributed.agreement import ARGUMENTS, LayoutDescription, ParamRecord, agree, refuse_together
from ..distributed.collectives import ShardGroup
from ..errors import ArgumentTypeError, ChunkmemError, DeviceCapacityError, InvalidArgumentError, check_type
from ..model.sharded_model import ShardedModelV2
from ..settings import ModelSettings, OptimizerSettings
from .adam import HybridAdam, check_supported_optimizer, runs_adam_kernel
from .any_optimizer import check_elementwise, probe_state
from .backward_step import check_step_in_backward, check_undo_room
from .disk_step import streamed_count
from .loss_scaler import DynamicGradScaler
from .low_bit_rule import LowBitAdamRule, check_low_bit_optimizer, low_bit_decoupled, stochastic_rounding
from .update_rule import AdamRule, AnyOptimizerRule, UpdateRule

OWNER = "ShardedOptimizerV2"


@dataclass
class OptimizerParts:
    """What :func:`build_parts` checked and chose for one optimizer.

    Attributes:
        scaler: the loss scaler its settings describe (used only by fp16 models).
        norm_group: the process group the gradient norm and overflow flag sum over (``None``: one rank).
        rule: the chunk update rule.
        kept_on_host: indices of the trainable chunks whose optimizer state stays on the host under ``auto``
            with ``offload_optimizer="disk"`` (the runtime's placement reads it).
    """

    scaler: DynamicGradScaler
    norm_group: Any
    rule: UpdateRule
    kept_on_host: list[int]


def check_arguments(sharded_model: Any, optimizer: Any) -> None:
    """Refuse a ``sharded_model`` that is not a :class:`~chunkmem.ShardedModelV2`, and an ``optimizer`` chunkmem
    cannot run."""
    if not isinstance(sharded_model, ShardedModelV2):
        raise ArgumentTypeError("sharded_model", type(sharded_model).__name__, "a chunkmem.ShardedModelV2")
    check_supported_optimizer(optimizer)


def check_before_wrapping(module: nn.Module, model_settings: ModelSettings, settings: OptimizerSettings) -> None:
    """Raise as building the optimizer with ``settings`` over ``module`` wrapped with ``model_settings`` would,
    for every check that needs no wrapped model (:meth:`chunkmem.ShardedOptimizerV2.check_before_wrapping`)."""
    check_type("settings", settings, OptimizerSettings, "a chunkmem.settings.OptimizerSettings")
    ShardGroup.of(model_settings.process_group, "process_group").of_same_ranks(
        settings.dp_process_group, "dp_process_group", "the model's data-parallel ranks (its process_group)")
    if settings.mp_process_group is not None:
        ShardGroup.of(settings.mp_process_group, "mp_process_group")
    if settings.step_in_backward:
        check_step_in_backward(model_settings, compute_dtype(module, model_settings), settings)


def build_parts(model: ShardedModelV2, optimizer: Any, settings: OptimizerSettings) -> OptimizerParts:
    """Check everything against ``model`` (a rank refused still meets the others' agreement), agree with the
    other ranks, and reserve the disk tier's regions for the optimizer state; nothing else changes."""
    if settings.gpu_margin_mem_ratio > 0 and model.tensor_placement_policy != "auto":
        warnings.warn(f"gpu_margin_mem_ratio={settings.gpu_margin_mem_ratio} has no effect with "
                      f"tensor_placement_policy={model.tensor_placement_policy!r}; it is used only "
                      f"with 'auto'", stacklevel=4)  # the line that built the optimizer
    try:  # a rank refused here still meets the others' agreement (else they would wait for it)
        dp_shards = model.data_parallel.of_same_ranks(
            settings.dp_process_group, "dp_process_group", "the model's data-parallel ranks (its process_group)")
        if settings.mp_process_group is not None:
            ShardGroup.of(settings.mp_process_group, "mp_process_group")
        check_step_in_backward(model.settings, model.dtype, settings)
        if model.optimizer_attached:
            raise InvalidArgumentError("sharded_model", "a model that already has a ShardedOptimizerV2",
                                       "a ShardedModelV2 without an optimizer")
        scaler = DynamicGradScaler.from_settings(settings.scaler)
        group_of = _groups_of(model, optimizer)
        rule = choose_update_rule(model, optimizer, group_of)
        check_capacity(model, rule)
        check_undo_room(model, rule, settings)
    except ChunkmemError as refused:
        refuse_together(model.data_parallel, OWNER, refused)
    _agree_on_settings(model, optimizer, settings, group_of)
    kept_on_host = _optimizer_state_kept_on_host(model, rule)
    _reserve_disk(model, rule, kept_on_host)
    # The norm sums over the ranks holding one copy of the gradients: the shard group (with shard
    # groups every replica group holds the same reduced shards).
    norm_ranks = dp_shards if model.replicas is None else model.shards
    return OptimizerParts(scaler, norm_ranks.group if norm_ranks.sharded else None, rule, kept_on_host)


def choose_update_rule(model: ShardedModelV2, optimizer: Any, group_of: dict[int, int]) -> UpdateRule:
    """The chunk update rule for ``optimizer``: the Adam kernel where it runs it, the 8-bit one for torchao's 8-bit
    Adams and ``HybridAdam(state_dtype="8bit")``, else the optimizer's own step (refusing, before anything changes,
    what chunkmem cannot run: see
    :mod:`chunkmem.optim.any_optimizer` and :mod:`chunkmem.optim.low_bit_rule`)."""
    decoupled = low_bit_decoupled(optimizer)
    if decoupled is not None:
        check_low_bit_optimizer(optimizer, dtype=model.dtype, reuse_fp16_shard=model.reuse_fp16_shard)
        return LowBitAdamRule(optimizer, model.runtime, group_of, decoupled, stochastic_rounding(optimizer, model.dtype),
                              plain_state=isinstance(optimizer, HybridAdam))
    if runs_adam_kernel(optimizer):
        return AdamRule(optimizer, model.runtime, group_of)
    layout = probe_state(optimizer)
    if model.shards.sharded:
        check_elementwise(optimizer, "on a sharded model (several ranks)", "each rank holds pieces")
    if model.settings.disk.optimizer_on_disk:
        check_elementwise(optimizer, "with the optimizer state on the disk tier",
                          "the disk step streams each chunk in pieces of its I/O buffers' size")
    return AnyOptimizerRule(optimizer, model.runtime, group_of, layout, OWNER)


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
    agree(model.data_parallel, LayoutDescription(OWNER, description, params))


def check_capacity(model: ShardedModelV2, rule: UpdateRule) -> None:
    """Refuse before any change if the optimizer state (``rule``'s families and the fp32 masters of a 16-bit
    model) that the policy puts on the device cannot fit."""
    runtime = model.runtime
    trainable = runtime.trainable_chunks()
    need = sum(rule.state_nbytes(chunk) + (4 * chunk.shard_numel if rule.keeps_master(chunk) else 0)
               for k, chunk in enumerate(trainable) if runtime.policy.optim_on_device(k, len(trainable)))
    ledger = runtime.ledger
    free = ledger.capacity - ledger.tier_bytes(Tier.DEVICE)
    if need > free:
        raise DeviceCapacityError(
            f"the optimizer state placed on the device needs {need} bytes, but only {free} of the device "
            f"tier's capacity of {ledger.capacity} bytes are free; use placement 'cpu' or raise the capacity")


def _reserve_disk(model: ShardedModelV2, rule: UpdateRule, kept_on_host: list[int]) -> None:
    """Preallocate the disk tier's files for the optimizer state: a region for each trainable chunk whose
    state rests on disk, none for frozen chunks, those ``kept_on_host`` and those whose state the policy
    keeps on the device (a full disk is refused here, before anything changes). A family with one fp32
    element per element gets a full-size chunk's region; one the rule lays out otherwise (the 8-bit Adams'
    codes) its own buffer's bytes, except those it keeps in memory (``rule.in_memory_families``)."""
    disk = model.runtime.memory.disk
    if disk is None or not model.settings.disk.optimizer_on_disk:
        return
    layout, policy = model.layout, model.runtime.policy
    full = layout.chunk_numel // model.shards.world  # elements of a full-size chunk's shard
    trainable = [c for c in model.chunks if c.trainable]
    on_disk = {c.index for k, c in enumerate(trainable)
               if c.index not in kept_on_host and not policy.optim_on_device(k, len(trainable))}
    by_index = {c.index: c for c in trainable}

    def regions(nbytes_of: Callable[[Chunk], int]) -> list[int]:
        return [nbytes_of(by_index[i]) if i in on_disk else 0 for i in range(layout.num_chunks)]

    def family_nbytes(chunk: Chunk, family: str) -> int:
        numel, dtype = rule.family_buffers(chunk)[family]
        return (full if numel == chunk.shard_numel and dtype == torch.float32 else numel) * dtype.itemsize

    for family in rule.families:
        if family not in rule.in_memory_families:
            disk.reserve_chunks(family, regions(lambda chunk, family=family: family_nbytes(chunk, family)))
    if any(rule.keeps_master(c) for c in trainable):
        disk.reserve_chunks(MASTER, regions(lambda chunk: full * 4))
    # the old values of parameters that are their own masters (fp32, or bf16 rounded stochastically), which an
    # atomic step overwrites in host memory
    if disk.atomic_step and (model.dtype == torch.float32 or not all(rule.keeps_master(c) for c in trainable)):
        disk.reserve_chunks(JOURNAL, regions(lambda chunk: full * 4), slots=1)


def _optimizer_state_kept_on_host(model: ShardedModelV2, rule: UpdateRule) -> list[int]:
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
    keeps_master = rule.keeps_master(first)
    state_bytes = rule.state_nbytes(first) + keeps_master * first.shard_numel * 4
    grads = len(chunks) * runtime.gradients.grad_bytes(first)
    streamed = streamed_count(len(rule.families) - len(rule.in_memory_families), keeps_master,
                              runtime.policy.params_on_disk, disk.atomic_step)
    # a rule streaming whole chunks takes buffers of one shard (4 bytes an element at most) where larger
    buffer_bytes = max(4 * first.shard_numel, disk.buffer_size) if rule.streams_whole_chunks else disk.buffer_size
    io_bytes = disk.buffer_count * streamed * buffer_bytes
    free = ledger.host_capacity - ledger.tier_bytes(Tier.HOST) - grads - io_bytes
    count = min(max(free, 0) // state_bytes, len(chunks))
    return [c.index for c in chunks[:count]]
