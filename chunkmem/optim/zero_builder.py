"""Building a :class:`~chunkmem.LowLevelZeroOptimizer`: every check of its arguments, the ranks' agreement, then
the flat chunks it trains, as :mod:`chunkmem.optim.builder` is for :class:`~chunkmem.ShardedOptimizerV2`.

:func:`check_arguments` checks the constructor's arguments (the wrapped optimizer, the loss scaler's rules, the
reduction settings, the parameters: each once, trainable ones of one device and dtype, none already managed),
refusing together with the other ranks before anything changes. :func:`build_parts` runs it, agrees with the
other ranks on the trainable parameters and the settings, seals the wrapped optimizer's param groups and packs
the parameters into the flat chunks (:mod:`chunkmem.optim.zero_partition`), returning :class:`ZeroParts`.
:func:`choose_update` then picks the update rule once (:mod:`chunkmem.optim.zero_update`,
:mod:`chunkmem.optim.zero_low_bit`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..core.chunk import ADAM_STATE
from ..core.memory import TierMemory
from ..core.param_guard import slot_of
from ..distributed.agreement import ARGUMENTS, LayoutDescription, ParamRecord, agree, refuse_together
from ..distributed.collectives import ShardGroup
from ..errors import ChunkmemError, InvalidArgumentError, check_choice, check_number, check_type
from .adam import HybridAdam, check_supported_optimizer, runs_adam_kernel
from .any_optimizer import StateLayout, check_elementwise, probe_state
from .loss_scaler import DynamicGradScaler
from .low_bit_rule import check_low_bit_optimizer, low_bit_decoupled, stochastic_rounding
from .sealed import seal_param_groups
from .zero_gradient_store import GradientStores
from .zero_low_bit import LowBitUpdate
from .zero_partition import FlatChunk, FlatSlot, build_partition, partition_memory
from .zero_update import AdamUpdate, AnyOptimizerUpdate, ZeroUpdate

OWNER = "LowLevelZeroOptimizer"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The working dtypes a :class:`~chunkmem.LowLevelZeroOptimizer` trains (and communicates) in."""


@dataclass
class ZeroParts:
    """What :func:`build_parts` checked and built for one optimizer.

    Attributes:
        scaler: the loss scaler the arguments describe (used only with fp16 working parameters).
        shards: the data-parallel ranks.
        dtype: the working parameters' dtype.
        layout: what the wrapped optimizer keeps per parameter (``None``: Adam, run by chunkmem's kernel, or an
            8-bit Adam).
        low_bit: for an 8-bit Adam (:func:`~chunkmem.optim.low_bit_rule.low_bit_decoupled`), whether its weight
            decay is decoupled (AdamW's); ``None`` for any other optimizer.
        stochastic_round: the bf16 parameters are their own masters, rounded stochastically (an 8-bit Adam with
            ``bf16_stochastic_round=True`` over a bf16 model).
        separate_master: whether the masters are separate from the working parameters (fp32 masters of 16-bit
            parameters, or the masters on the host).
        chunks: the flat chunks of the trainable parameters.
        memory: the chunks' memory and its ledger (:func:`~chunkmem.optim.zero_partition.partition_memory`).
        params: every parameter of the wrapped optimizer's param groups, in index order (torch's numbering).
        slot_of: ``id(parameter)`` -> its place in the chunks, for each trainable one.
        not_packed: ``(index, parameter)`` of the parameters frozen when the optimizer was built (no place in
            the chunks, no master: they cannot be trained later).
    """

    scaler: DynamicGradScaler
    shards: ShardGroup
    dtype: torch.dtype
    layout: StateLayout | None
    low_bit: bool | None
    stochastic_round: bool
    separate_master: bool
    chunks: list[FlatChunk]
    memory: TierMemory
    params: list[nn.Parameter]
    slot_of: dict[int, FlatSlot]
    not_packed: list[tuple[int, nn.Parameter]]


def build_parts(optimizer: Any, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                growth_interval: int, hysteresis: int, max_scale: float, clip_grad_norm: float, verbose: bool,
                reduce_bucket_size: int, communication_dtype: torch.dtype | None, overlap_communication: bool,
                partition_grad: bool, cpu_offload: bool, forced_dtype: torch.dtype | None, dp_process_group: Any,
                grad_accum_dtype: torch.dtype | None) -> ZeroParts:
    """Check the constructor's arguments (:func:`check_arguments`), agree with the other ranks, seal the wrapped
    optimizer's param groups and pack its trainable parameters into flat chunks (the parameters become views
    into them)."""
    scaler, shards, groups, layout = check_arguments(
        optimizer, initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
        clip_grad_norm, verbose, reduce_bucket_size, communication_dtype, overlap_communication, partition_grad,
        cpu_offload, forced_dtype, dp_process_group, grad_accum_dtype)
    trainable = [p for group in groups for p in group]
    for p in trainable:
        p._low_level_zero = True  # type: ignore[attr-defined]
    dtype = forced_dtype or trainable[0].dtype
    low_bit = low_bit_decoupled(optimizer)
    stochastic = low_bit is not None and stochastic_rounding(optimizer, dtype)
    agree_on_settings(shards, groups, dict(
        optimizer=type(optimizer).__name__, dtype=dtype, communication_dtype=communication_dtype or dtype,
        low_bit_state=(low_bit, stochastic),
        reduce_bucket_size=reduce_bucket_size,
        overlap_communication=overlap_communication, partition_grad=partition_grad, cpu_offload=cpu_offload,
        clip_grad_norm=clip_grad_norm,
        loss_scaler=(initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                     max_scale) if dtype == torch.float16 else None))
    device = trainable[0].device
    master_device = torch.device("cpu") if cpu_offload else device
    separate = (dtype != torch.float32 and not stochastic) or master_device != device
    seal_param_groups(optimizer, OWNER)
    families = () if low_bit is not None else ADAM_STATE if layout is None else layout.families  # 8-bit: the rule's
    params = [p for group in optimizer.param_groups for p in group["params"]]  # index order (each once)
    memory = partition_memory()
    chunks = build_partition(groups, {id(p): i for i, p in enumerate(params)}, dtype, shards, memory,
                             master_device, separate, families, dtype if stochastic else torch.float32)
    if layout is not None or low_bit is not None:
        optimizer.state.clear()  # what its constructor made (Adagrad's sums): the chunks keep the state
    slots = {id(s.param): s for c in chunks for s in c.slots}
    not_packed = [(i, p) for i, p in enumerate(params) if id(p) not in slots]
    return ZeroParts(scaler, shards, dtype, layout, low_bit, stochastic, separate, chunks, memory, params, slots,
                     not_packed)


def choose_update(optimizer: Any, parts: ZeroParts, stores: GradientStores) -> ZeroUpdate:
    """The update rule for ``optimizer`` over ``parts``' chunks, chosen once: the 8-bit one for torchao's 8-bit
    Adams and ``HybridAdam(state_dtype="8bit")`` (it gives the chunks their state families), the Adam kernel where
    it runs the optimizer, else the optimizer's own step."""
    if parts.low_bit is not None:
        return LowBitUpdate(optimizer, stores, parts.chunks, parts.shards, separate_master=parts.separate_master,
                            decoupled=parts.low_bit, stochastic_round=parts.stochastic_round,
                            plain_state=isinstance(optimizer, HybridAdam))
    if parts.layout is None:
        return AdamUpdate(optimizer, stores, parts.separate_master)
    return AnyOptimizerUpdate(optimizer, stores, parts.separate_master, parts.layout, OWNER)


def check_arguments(optimizer: Any, initial_scale: float, min_scale: float, growth_factor: float,
                    backoff_factor: float, growth_interval: int, hysteresis: int, max_scale: float,
                    clip_grad_norm: float, verbose: bool, reduce_bucket_size: int,
                    communication_dtype: torch.dtype | None, overlap_communication: bool, partition_grad: bool,
                    cpu_offload: bool, forced_dtype: torch.dtype | None, dp_process_group: Any,
                    grad_accum_dtype: torch.dtype | None = None, cast_to: torch.dtype | None = None
                    ) -> tuple[DynamicGradScaler, ShardGroup, list[list[nn.Parameter]], StateLayout | None]:
    """Every check of the constructor's arguments (nothing changed): the scaler, the data-parallel
    group, the trainable parameters per param group and what the optimizer keeps (``None``: Adam).
    ``cast_to``: check the floating-point parameters as they will be once their module is cast to this dtype."""
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
                check_choice(name, value, DTYPES)
        for name, value in (("overlap_communication", overlap_communication), ("partition_grad", partition_grad),
                            ("cpu_offload", cpu_offload)):
            check_type(name, value, bool, "True or False")
        groups = check_params(optimizer, forced_dtype, cast_to)
        dtype = forced_dtype or cast_to or groups[0][0].dtype
        if grad_accum_dtype not in (None, torch.float32, dtype):
            raise InvalidArgumentError("grad_accum_dtype", grad_accum_dtype,
                                       f"None or torch.float32 (16-bit gradients of several backwards summed in "
                                       f"fp32), or the parameters' dtype {dtype} (summed in it)")
        layout = None
        if low_bit_decoupled(optimizer) is not None:  # an 8-bit Adam: its own rule, on any number of ranks
            check_low_bit_optimizer(optimizer, dtype=dtype)
        elif not runs_adam_kernel(optimizer):
            layout = probe_state(optimizer)
            if shards.sharded:
                check_elementwise(optimizer, "with several data-parallel ranks",
                                  "each rank owns pieces of parameters")
    except ChunkmemError as refused:
        refuse_together(shards, OWNER, refused)
    return scaler, shards, groups, layout


def check_params(optimizer: Any, forced_dtype: torch.dtype | None,
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
            if dtype not in DTYPES:
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


def agree_on_settings(shards: ShardGroup, groups: list[list[nn.Parameter]], settings: dict[str, Any]) -> None:
    """Sharded, every rank must reduce the same buckets in the same dtype and step with the same rules:
    agree, before anything changes, on the trainable parameters (shape, group, in order) and ``settings``
    (a rank with another bucket size or communication dtype would run mismatched collectives; another
    loss scale or clipping would update its shard differently)."""
    params = ParamRecord()
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            params.add(f"param group {g}, parameter {i}", p.shape, True)
    description = [(ARGUMENTS, "accepted")] + [(k, repr(v)) for k, v in settings.items()]
    agree(shards, LayoutDescription(OWNER, description, params))
