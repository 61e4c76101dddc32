"""Building a wrapped model's runtime from a module and its :class:`~chunkmem.settings.ModelSettings`.

:func:`build_runtime` checks everything first (the module, the groups, the dtypes, the ranks'
agreement on the layout, the device and host capacities, the disk space) and only then changes the
module: its parameters move into chunks laid out once (:class:`~chunkmem.core.layout.ChunkLayout`), its
buffers are cast, and the :class:`~chunkmem.runtime.runtime.ChunkRuntime` hooks it. Also here: freeing
chunks a model no longer uses (:func:`free_chunk`), which ``unwrap`` shares.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..core.chunk import PARAM, Chunk, ChunkKey, ParamSlot
from ..core.disk_tier import DiskTier
from ..storage.disk_io import aligned_nbytes
from ..errors import HostCapacityError, InvalidArgumentError, check_type
from ..core.layout import ChunkLayout, aligned_numel, plan_layout, search_chunk_numel, staged_buffers
from ..core.memory import TierMemory
from ..core.param_guard import adopt, disown, remembered_externals, slot_of
from ..core.tiers import Tier, device_memory_capacity, device_of_tier, host_memory_capacity
from ..distributed.agreement import LayoutDescription, ParamRecord, agree, agree_on_settings_before_groups
from ..distributed.collectives import SINGLE_PROCESS, ShardGroup
from ..distributed.gathers import gather_for
from ..distributed.reduction import GradientReduction
from ..distributed.shard_groups import GroupLayout, gather_hierarchy, group_layout, secondary_group
from ..runtime.capacity import CapacityCheck
from ..runtime.placement import PlacementPolicy
from ..runtime.runtime import ChunkRuntime
from ..settings import ModelSettings, check_chunk_size, check_param_dtypes

WRAPPED_ATTR = "_chunkmem_wrapped"
"""Set to ``True`` on a wrapped module and on each of its submodules: a second wrapper over the same
module (or over one containing it, or one of its submodules) would re-pack parameters the first uses."""


@dataclass
class BuiltModel:
    """What :func:`build_runtime` gives the model: its runtime, compute dtype, data-parallel groups (the
    ranks it trains over, those its chunks are sharded over, and their replicas), layout and parameter
    names (``id(parameter)`` -> name)."""

    runtime: ChunkRuntime
    dtype: torch.dtype
    groups: GroupLayout
    layout: ChunkLayout
    param_names: dict[int, str]


def _process_groups(settings: ModelSettings
                    ) -> tuple[GroupLayout, ShardGroup, ShardGroup | None, tuple[ShardGroup, ShardGroup] | None]:
    """The groups the model trains over, made before anything is packed (a refused size leaves the module as
    it was): the layout of shard groups and replicas, the group gradients are reduce-scattered over, hpZ's
    secondary group (``None`` without) and the hierarchical gather's groups (``None`` without)."""
    data_parallel = ShardGroup.of(settings.process_group, "process_group")
    reduce_shards = data_parallel.of_same_ranks(settings.reduce_scatter_process_group, "reduce_scatter_process_group",
                                                "process_group")
    sharding = settings.sharding
    agree_on_settings_before_groups(data_parallel, "the ShardedModelV2", [
        ("shard_group_size", sharding.shard_group_size), ("secondary_partition_size", sharding.secondary_partition_size),
        ("gather_node_size", sharding.gather_node_size)])
    groups = group_layout(data_parallel, sharding.shard_group_size)
    secondary = secondary_group(groups.shards, sharding.secondary_partition_size)
    hierarchy = gather_hierarchy(groups.shards, sharding.gather_node_size)
    if groups.replicas is not None and settings.persistence_threshold:
        raise InvalidArgumentError("persistence_threshold", settings.persistence_threshold,
                                   f"0 with shard_group_size={sharding.shard_group_size} (persistent parameters are "
                                   f"not combined with shard groups)")
    return groups, reduce_shards, secondary, hierarchy


@dataclass
class _Packing:
    """How the module's parameters are packed: the named parameters, the ``ZeroInitContext`` slots among
    them (all of them, some: a base built in the context and adapters added to it afterwards, or none), the
    compute dtype, the layout, and what becomes of the context's chunks and memory."""

    named: list[tuple[str, nn.Parameter]]
    context_slots: list[ParamSlot]
    dtype: torch.dtype
    layout: ChunkLayout
    context_memory: TierMemory | None
    reuse_context: bool  # the context's chunks and memory are the model's, as they are
    from_context_disk: bool  # the context built them onto its own disk tier: packed into the model's own


def build_runtime(module: nn.Module, settings: ModelSettings) -> BuiltModel:
    """Wrap ``module`` as ``settings`` say (see the module docstring). Raises before the module changes."""
    check_type("module", module, nn.Module, "a torch.nn.Module")
    check_not_wrapped(module)
    groups, reduce_shards, secondary, hierarchy = _process_groups(settings)
    shards = groups.shards
    policy = settings.policy()
    packing = _plan_packing(module, settings, groups)
    layout, dtype, context_slots = packing.layout, packing.dtype, packing.context_slots
    capacity = device_memory_capacity()
    host_capacity = host_memory_capacity()
    check_capacity = CapacityCheck(layout, policy, shards, settings.reuse_fp16_shard, capacity)
    check_capacity(module_users(module))
    _check_host_capacity(layout, policy, shards, host_capacity)

    memory, params_on_host, params_to_disk = _tier_memory(settings, packing, policy, shards, capacity, host_capacity)
    param_names = {id(p): name for name, p in packing.named}
    chunks = _chunks_for(layout, _unique_chunks(context_slots), dtype, memory, shards, params_to_disk, param_names,
                         reuse=packing.reuse_context)
    if context_slots:  # chunks of parameters replaced after creation (the original weight of a tied head)
        for chunk in context_slots[0].chunk.built_with:
            if chunk not in chunks:
                free_chunk(chunk)
    if packing.from_context_disk:
        packing.context_memory.disk.close()
    _cast_buffers(module, dtype)
    reduction = GradientReduction(reduce_shards if groups.replicas is None else shards, settings.reduction.bucket_bytes,
                                  settings.reduction.fp32_reduce_scatter, settings.reduction.gradient_predivide_factor,
                                  groups.replicas, settings.reduction.quantized_gradients)
    runtime = ChunkRuntime(module, chunks, memory, policy, settings.reuse_fp16_shard, reduction,
                           settings.shard_strategy.bucketed, check_capacity, groups.data_parallel,
                           settings.reduction.reductions_in_flight,
                           accumulate_in_fp32=settings.grad_accum_dtype in (None, torch.float32))
    runtime.state.param_host_chunks = params_on_host
    _choose_gathers(chunks, settings, secondary, hierarchy)
    if memory.disk is not None:
        weakref.finalize(runtime, memory.disk.close)
    if settings.prefetch_numel is not None:
        runtime.executor.prefetch_chunks = settings.prefetch_numel // layout.chunk_numel
    runtime.executor.settle_all()
    runtime.executor.bind_views_to_device()
    for sub in module.modules():
        setattr(sub, WRAPPED_ATTR, True)
    return BuiltModel(runtime, dtype, groups, layout, param_names)


def _plan_packing(module: nn.Module, settings: ModelSettings, groups: GroupLayout) -> _Packing:
    """Check the parameters and lay them out once (the ranks agree on the layout); nothing changes yet."""
    shards = groups.shards
    named = list(module.named_parameters())
    if not named:
        raise InvalidArgumentError("module", type(module).__name__, "a module with at least one parameter")
    check_param_dtypes(named)
    slots = [slot_of(p) for _, p in named]
    # Parameters of a ZeroInitContext, all of them or some: a base built in the context and adapters
    # (LoRA) added to it afterwards. In the second case everything is packed into the model's own chunks.
    context_slots = [s for s in slots if s is not None]
    from_context = len(context_slots) == len(slots)
    dtype = _dtype(settings, context_slots[0].chunk.dtype if context_slots else None)
    check_chunk_size(settings.chunk_size, dtype)
    element_size = dtype.itemsize
    chunk_numel = _chunk_numel(settings, named, slots if from_context else None, element_size, shards.sharded)
    chunk_numel = aligned_numel(chunk_numel, shards.world) if shards.sharded else chunk_numel
    # A ZeroInitContext's chunks are reused as they are (untrimmed tails included) when built at a given
    # size, except those it built onto its own disk tier: they are packed into the model's own chunks.
    context_memory = context_slots[0].chunk.memory if context_slots else None
    from_context_disk = context_memory is not None and context_memory.disk is not None
    reuse_context = from_context and not from_context_disk
    sized_by_context = reuse_context and all(s.chunk.size_was_given for s in slots)
    layout = plan_layout(named, [p.requires_grad for _, p in named], chunk_numel, element_size,
                         _persistent(named, settings) if shards.sharded else None,
                         world=shards.world if shards.sharded else 1, trim_tails=not sized_by_context)
    _agree_on_layout(settings, layout, groups, dtype, context_slots or None, from_context)
    return _Packing(named, context_slots, dtype, layout, context_memory, reuse_context, from_context_disk)


def _tier_memory(settings: ModelSettings, packing: _Packing, policy: PlacementPolicy, shards: ShardGroup,
                 capacity: int, host_capacity: int | None) -> tuple[TierMemory, frozenset[int], frozenset[int]]:
    """The model's memory (the context's, reused, or this machine's), its capacities set and its disk tier
    made; with the chunks whose parameters rest on the host, and those whose parameters rest on disk."""
    layout = packing.layout
    memory = packing.context_memory if packing.reuse_context else TierMemory.for_this_machine(capacity)
    memory.ledger.capacity, memory.ledger.host_capacity = capacity, host_capacity
    if staged_buffers(settings.placement.tensor_placement_policy, shards.sharded):
        memory.device_block_nbytes = max(layout.numels) * packing.dtype.itemsize
    disk = settings.disk
    params_on_host = _param_chunks_kept_on_host(layout, policy, shards, host_capacity, settings)
    params_to_disk = frozenset(i for i in range(layout.num_chunks) if policy.params_on_disk and i not in params_on_host)
    if disk.enabled:
        memory.disk = DiskTier(disk.nvme_path, disk.buffer_count, disk.buffer_size, disk.atomic_step, memory.ledger)
        if policy.params_on_disk:
            memory.disk.reserve_chunks(PARAM, [layout.chunk_bytes // shards.world if i in params_to_disk else 0
                                               for i in range(layout.num_chunks)])
    return memory, params_on_host, params_to_disk


def _choose_gathers(chunks: list[Chunk], settings: ModelSettings, secondary: ShardGroup | None,
                    hierarchy: tuple[ShardGroup, ShardGroup] | None) -> None:
    """Each sharded chunk's gather, chosen once (:func:`~chunkmem.distributed.gathers.gather_for`)."""
    for chunk in chunks:
        if chunk.param.sharded:
            quantized = settings.sharding.quantized_weights is True or (
                settings.sharding.quantized_weights == "nontrainable" and not chunk.trainable)
            chunk.param.gather = gather_for(chunk.shards, quantized, secondary, hierarchy)


# ---- wrapped once --------------------------------------------------------------------------------------

def check_not_wrapped(module: nn.Module) -> None:
    """Raise :class:`InvalidArgumentError` if ``module`` or any of its submodules is already wrapped."""
    for name, sub in module.named_modules():
        if getattr(sub, WRAPPED_ATTR, False):
            which = "it is" if not name else f"its submodule {name!r} is"
            raise InvalidArgumentError("module", type(module).__name__,
                                       f"a module no ShardedModelV2 wraps yet ({which} already wrapped; wrap a "
                                       f"module once and use the wrapper)")


def mark_unwrapped(module: nn.Module) -> None:
    """Forget that ``module`` was wrapped (``ShardedModelV2.unwrap`` gave it back as a plain module)."""
    for sub in module.modules():
        sub.__dict__.pop(WRAPPED_ATTR, None)


# ---- the layout ----------------------------------------------------------------------------------------

def compute_dtype(module: nn.Module, settings: ModelSettings) -> torch.dtype:
    """The compute dtype :func:`build_runtime` gives ``module`` with ``settings`` (raises as it does when
    they contradict the ``ZeroInitContext`` the module was built in); changes nothing."""
    context_slots = [s for s in map(slot_of, module.parameters()) if s is not None]
    return _dtype(settings, context_slots[0].chunk.dtype if context_slots else None)


def _dtype(settings: ModelSettings, context_dtype: torch.dtype | None) -> torch.dtype:
    """The compute dtype: the context's for a module built in ``ZeroInitContext``, else ``dtype`` (fp16)."""
    dtype = settings.dtype
    if context_dtype is not None:
        if dtype is not None and dtype != context_dtype:
            raise InvalidArgumentError("dtype", dtype, f"None or {context_dtype} (the ZeroInitContext dtype)")
        dtype = context_dtype
    dtype = dtype or torch.float16
    if settings.reuse_fp16_shard and dtype == torch.float32:
        raise InvalidArgumentError("reuse_fp16_shard", True,
                                   "False with dtype torch.float32 (the fp32 parameters are the masters)")
    return dtype


def _chunk_numel(settings: ModelSettings, named: list[tuple[str, nn.Parameter]], context_slots: list[Any] | None,
                 element_size: int, sharded: bool) -> int:
    """Elements per chunk: ``chunk_size`` when given (it must hold the largest parameter), the context's
    when every chunk of it was built at a given size, else searched for the fewest bytes of padding and
    of the chunk-sized buffers a step stages on the device tier under this placement."""
    numels = [p.numel() for _, p in named]
    if settings.chunk_size is not None:
        chunk_numel = settings.chunk_size // element_size
        largest = max(numels)
        if chunk_numel < largest:
            name = named[numels.index(largest)][0]
            raise InvalidArgumentError("chunk_size", settings.chunk_size,
                                       f">= {largest * element_size} bytes (parameter {name!r} has {largest} "
                                       f"elements of {element_size} bytes)")
        return chunk_numel
    if context_slots is not None and all(s.chunk.size_was_given for s in context_slots):
        return context_slots[0].chunk.numel
    staged = staged_buffers(settings.placement.tensor_placement_policy, sharded)
    return search_chunk_numel(numels, [p.requires_grad for _, p in named], element_size, staged_buffers=staged)


def _agree_on_layout(settings: ModelSettings, layout: ChunkLayout, groups: GroupLayout, dtype: torch.dtype,
                     context_slots: list[Any] | None, wholly_from_context: bool = True) -> None:
    """Sharded or replicated, every rank must build the same chunks before any collective depends on them:
    agree (over all data-parallel ranks) on the settings and on the parameters in packing order, plus
    where the parameters come from (re-packing the chunks of a ``ZeroInitContext`` gathers them)."""
    shards = groups.shards
    if not groups.data_parallel.sharded:
        return
    params = ParamRecord()
    for name, param, trainable in layout.entries:
        params.add(name, param.shape, trainable)
    if context_slots is not None:
        chunks = {s.chunk.index: s.chunk for s in context_slots}
        numels = ", ".join(str(chunks[i].numel) for i in sorted(chunks))
        source = f"ZeroInitContext chunks of {numels} elements sharded over {context_slots[0].chunk.shards.world} ranks"
        if not wholly_from_context:
            source += " and parameters added outside it"
    else:
        source = "a module built outside ZeroInitContext"
    disk, reduction = settings.disk, settings.reduction
    description = [
        ("world size", str(groups.data_parallel.world)),
        ("shard group size", str(shards.world)),
        ("dtype", str(dtype)),
        ("chunk size", f"{layout.chunk_numel} elements"),
        ("tensor_placement_policy", repr(settings.placement.tensor_placement_policy)),
        ("offload fractions", f"{settings.placement.offload_param_frac}, {settings.placement.offload_optim_frac}"),
        ("reuse_fp16_shard", str(settings.reuse_fp16_shard)),
        ("shard strategy", type(settings.shard_strategy).__name__),
        ("fp32_reduce_scatter", str(reduction.fp32_reduce_scatter)),
        ("reduce_scatter_bucket_size_mb", str(reduction.reduce_scatter_bucket_size_mb)),
        ("gradient_predivide_factor", str(reduction.gradient_predivide_factor)),
        ("quantized_gradients", str(reduction.quantized_gradients)),
        ("quantized_weights", str(settings.sharding.quantized_weights)),
        ("secondary_partition_size", str(settings.sharding.secondary_partition_size)),
        ("gather_node_size", str(settings.sharding.gather_node_size)),
        ("grad_accum_dtype", str(settings.grad_accum_dtype)),
        ("reductions_in_flight", str(reduction.reductions_in_flight)),
        ("offload_optimizer", repr(disk.offload_optimizer)),
        ("offload_param", repr(disk.offload_param)),
        ("disk buffers", f"{disk.buffer_count} x {disk.buffer_size} bytes" if disk.enabled else "none"),
        ("atomic_step", str(disk.atomic_step) if disk.enabled else "none"),
        ("prefetch_numel", str(settings.prefetch_numel)),
        ("persistence", f"{settings.persistence_threshold}, {settings.model_persistence_threshold}"),
        ("parameters from", source),
    ]
    agree(groups.data_parallel, LayoutDescription("ShardedModelV2", description, params))


def module_users(module: nn.Module) -> list[tuple[str, list[nn.Parameter]]]:
    """The modules of ``module`` that use parameters, in backward order (the root first, then the others in
    reverse registration order, the usual order of their backwards), each with its own parameters and
    those declared used with ``register_external_parameter``."""
    named = list(module.named_modules())
    order = named[:1] + list(reversed(named[1:]))
    return [(name or type(sub).__name__, list(sub.parameters(recurse=False)) + remembered_externals(sub))
            for name, sub in order]


def _persistent(named: list[tuple[str, nn.Parameter]], settings: ModelSettings) -> list[bool]:
    """Which parameters are persistent (whole on every rank): fewer elements than
    ``persistence_threshold``, the first in order up to ``model_persistence_threshold`` elements in all."""
    limit = settings.model_persistence_threshold
    total, marks = 0, []
    for _, param in named:
        keep = param.numel() < settings.persistence_threshold and (limit is None or total + param.numel() <= limit)
        total += param.numel() if keep else 0
        marks.append(keep)
    return marks


def _param_chunks_kept_on_host(layout: ChunkLayout, policy: PlacementPolicy, shards: ShardGroup,
                               host_capacity: int | None, settings: ModelSettings) -> frozenset[int]:
    """Under ``auto`` with ``offload_param="disk"`` and a host capacity: :func:`param_chunks_kept_on_host`."""
    if not (policy.plans_from_trace and policy.params_on_disk and host_capacity is not None):
        return frozenset()
    return param_chunks_kept_on_host([layout.shard_bytes(i, shards.world) for i in range(layout.num_chunks)],
                                     [layout.trainable(i) for i in range(layout.num_chunks)], layout.element_size,
                                     host_capacity, settings.disk.buffer_count, settings.disk.buffer_size)


def param_chunks_kept_on_host(shard_bytes: list[int], trainable: list[bool], element_size: int, host_capacity: int,
                              buffer_count: int, buffer_size: int) -> frozenset[int]:
    """The chunks whose parameters rest on the host under ``auto`` with ``offload_param="disk"`` and a host
    capacity (bytes): the first ones (``shard_bytes``: this rank's bytes of each chunk) that fit in it after
    the gradients of the ``trainable`` chunks (they rest on the host until the step) and the disk tier's I/O
    buffers (``buffer_count`` x ``buffer_size`` bytes for each family the streamed step of Adam reads, the
    fetch thread's and the in-line one); the others rest on disk. The parameters come before the optimizer
    state, which the optimizer fits in what is left: a parameter chunk kept in memory saves 3 bytes of disk
    traffic a step (two reads, one write) per byte of host memory, optimizer state 2. Which chunks does not
    change the bytes moved (each is read in the forward and the backward)."""
    grads = sum(b for b, t in zip(shard_bytes, trainable) if t)
    streamed = 4 if element_size != 4 else 3  # Adam's moments, the master (or fp32 parameters), the parameters
    free = host_capacity - grads - (buffer_count * streamed + 2) * aligned_nbytes(buffer_size)
    kept = []
    for i, nbytes in enumerate(shard_bytes):
        if nbytes > free:
            break
        kept.append(i)
        free -= nbytes
    return frozenset(kept)


def _check_host_capacity(layout: ChunkLayout, policy: PlacementPolicy, shards: ShardGroup,
                         host_capacity: int | None) -> None:
    """Refuse a host capacity below the parameter chunks that rest on the host (this rank's shards)."""
    if host_capacity is None or policy.params_on_disk:
        return
    count = layout.num_chunks
    resting = [i for i in range(count) if not policy.params_on_device_at_rest(i, count)]
    need = sum(layout.shard_bytes(i, shards.world) for i in resting)
    if need > host_capacity:
        raise HostCapacityError(
            f"host tier too small: the {len(resting)} parameter chunks resting on the host need {need} bytes, the "
            f"capacity is {host_capacity} bytes (set chunkmem.set_host_memory_capacity or "
            f"CHUNKMEM_HOST_MEMORY higher, or offload_param='disk')")


# ---- the chunks ----------------------------------------------------------------------------------------

def _chunks_for(layout: ChunkLayout, current: list[Chunk], dtype: torch.dtype, memory: TierMemory,
                shards: ShardGroup, to_disk: frozenset[int], param_names: dict[int, str],
                reuse: bool = True) -> list[Chunk]:
    """Chunks laid out as ``layout`` says: ``current`` (a ``ZeroInitContext``'s) if it already is and
    ``reuse`` allows, else new chunks in ``memory`` filled from the current values, one chunk of the
    current ones read at a time (the current chunks are freed)."""
    if reuse and _laid_out_as(layout, current, shards):
        for chunk in current:
            for slot in chunk.slots:
                slot.name = param_names[id(slot.param)]
        return current

    gathered: dict[Chunk, torch.Tensor] = {}

    def value_of(param: nn.Parameter) -> torch.Tensor:
        slot = slot_of(param)
        if slot is None:
            return param.data
        if slot.chunk not in gathered:  # sharded: the same gathers in the same order on every rank
            gathered.clear()
            buf = slot.chunk.param
            gathered[slot.chunk] = slot.chunk.gather(buf.local()) if buf.sharded else buf.current()
        return slot.view(gathered[slot.chunk])

    chunks = build_chunks(layout, dtype, memory, Tier.HOST, shards, value_of, to_disk=to_disk)
    gathered.clear()
    for chunk in current:
        free_chunk(chunk)
    return chunks


def _laid_out_as(layout: ChunkLayout, current: list[Chunk], shards: ShardGroup) -> bool:
    """Whether ``current`` already holds the parameters as ``layout`` says (nothing to re-pack)."""
    wanted_ids = [[id(layout.entries[i][1]) for i in group] for group in layout.groups]
    current_ids = [[id(s.param) for s in c.slots] for c in current]
    same_sharding = not layout.replicated and all(
        c.shards.same_ranks(shards) and (not shards.sharded or c.shards.group == shards.group) for c in current)
    return bool(current and current_ids == wanted_ids and [c.numel for c in current] == list(layout.numels)
                and same_sharding
                and all(c.trainable == layout.trainable(i) for i, c in enumerate(current)))


def build_chunks(layout: ChunkLayout, dtype: torch.dtype, memory: TierMemory, tier: Tier,
                 shards: ShardGroup, value_of: Callable[[nn.Parameter], torch.Tensor],
                 to_disk: frozenset[int] = frozenset()) -> list[Chunk]:
    """New chunks as ``layout`` says, each parameter pointed into its chunk.

    Each chunk keeps this rank's shard of the parameters on ``tier`` (one rank: the whole chunk, on
    the device tier as its device copy); parameters view the (freed) full device copy when sharded.
    ``value_of(param)`` gives the parameter's full current value; it is cast to ``dtype``. Padding
    elements are zero. ``to_disk``: the chunks whose shard goes to the disk tier as soon as it is filled
    (``offload_param="disk"``: host memory holds one of them at a time).
    """
    chunks = []
    for n, indices in enumerate(layout.groups):
        replicated = layout.is_replicated(n)
        chunk = Chunk(n, layout.numels[n], dtype, ChunkKey(layout.trainable(n)), memory,
                      SINGLE_PROCESS if replicated else shards)
        chunk.replicas = shards if replicated else None
        local = chunk.param.first_copy(tier)
        local.zero_()
        for i in indices:
            name, param, _ = layout.entries[i]
            chunk.write_own_part(chunk.add_slot(param, name), local, value_of(param))
        chunk.bind_views(chunk.param.device if chunk.param.sharded else local)
        if n in to_disk:
            chunk.param.shard.move_to(Tier.DISK)
            chunk.bind_views(chunk.param.device)
        for slot in chunk.slots:
            adopt(slot.param, slot)
        chunks.append(chunk)
    return chunks


def free_chunk(chunk: Chunk, values: dict[int, torch.Tensor] | None = None) -> None:
    """Free every buffer of a chunk that no longer holds the model's parameters. Parameters still in it
    become plain parameters holding ``values[id(param)]`` (``unwrap``), or else empty tensors (ones the
    model no longer uses), so the memory goes now, not at the next garbage collection."""
    chunk.free_all()
    for slot in chunk.slots:
        if slot_of(slot.param) is slot:
            value = values[id(slot.param)] if values is not None else torch.empty(0, dtype=slot.chunk.dtype)
            disown(slot.param, value)


def _unique_chunks(slots: list[Any]) -> list[Chunk]:
    chunks: list[Chunk] = []
    seen: set[int] = set()
    for slot in slots:
        if slot is not None and id(slot.chunk) not in seen:
            seen.add(id(slot.chunk))
            chunks.append(slot.chunk)
    return sorted(chunks, key=lambda c: c.index)


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers to the compute dtype, every buffer to the compute device (assigning a
    module's buffer by name keeps it a buffer, persistent or not)."""
    device = device_of_tier(Tier.DEVICE)
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, buf.to(device=device, dtype=dtype if buf.is_floating_point() else buf.dtype))
