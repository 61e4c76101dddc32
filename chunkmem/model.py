"""ShardedModelV2: wraps a module so that its parameters live in chunks placed by a policy."""
from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections import OrderedDict
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from .runtime import memstats
from .dist.agreement import agree_on_model_layout
from .io.atomic_file import write_json_atomically
from .core.chunk import MASTER, PARAM, Chunk, ChunkKey
from .core.errors import HostCapacityError, DeviceCapacityError, GradientAccumulationError, InvalidArgumentError, check_number, check_type
from .runtime.hooks import ChunkHooks
from .init_context import check_chunk_size, check_dtype, check_param_dtypes
from .wrap_marker import check_not_wrapped, mark_unwrapped, mark_wrapped
from .dist.collectives import ShardGroup
from .core.layout import aligned_numel, pack, search_chunk_numel
from .core.ledger import TierLedger
from .core.memory import TierMemory
from .runtime.manager import ChunkManager, GradientReduction, build_chunks, slot_of
from .core.param_guard import ParameterAccessError, disown
from .runtime.placement import make_policy
from .dist.shard_strategy import BaseShardStrategy
from .core.disk_tier import DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE, DiskTier, check_disk_arguments
from .core.tiers import Tier, device_memory_capacity, device_of_tier, host_memory_capacity

logger = logging.getLogger("chunkmem")


class ShardedModelV2(nn.Module):
    """A module whose parameters (and gradients) live in chunks that move between the device and host.

    Build the module inside :class:`~chunkmem.ZeroInitContext` (parameters go straight into chunks in
    the context's dtype), or pass an ordinary module: its parameters are then packed into chunks here,
    cast to ``dtype``. Either way the chunk size is searched to waste little padding unless
    ``chunk_size`` is given, and parameters are packed in ``named_parameters()`` order.

    In 16-bit mode, floating-point inputs are cast to ``dtype`` and floating-point outputs to fp32,
    and floating-point buffers are kept in ``dtype``. Parameters are views into chunk memory that is
    present only while a module computes; read weights through :meth:`state_dict`. ``param.grad``
    stays ``None``: gradients are collected into chunks for :class:`~chunkmem.ShardedOptimizerV2`.

    Args:
        module: the model: at least one parameter, every parameter of dtype torch.float16, torch.bfloat16
            or torch.float32, and not already wrapped (nor any of its submodules).
        shard_strategy: a :class:`~chunkmem.BaseShardStrategy`.
        process_group: data-parallel group (``None``: the default group if initialised, else one rank).
        reduce_scatter_process_group: group for gradient reduce-scatter (``None``: ``process_group``).
        reduce_scatter_bucket_size_mb: reduce-scatter bucket size in MB (> 0 and <= 2**43, finite).
        fp32_reduce_scatter: reduce gradients in fp32.
        tensor_placement_policy: ``"cuda"`` (everything on the device tier), ``"cpu"`` (everything rests
            on the host; parameters visit the device for compute), ``"auto"`` (traced first iteration,
            then Belady's eviction within the capacity) or ``"static"`` (fixed fractions offloaded);
            see :mod:`chunkmem.runtime.placement`.
        gradient_predivide_factor: gradients are divided by this before reduction (finite, > 0).
        reuse_fp16_shard: store each gradient in its 16-bit parameter's memory (no grad buffer; needs a
            16-bit dtype; no gradient accumulation).
        dtype: compute/storage dtype for a module built outside ZeroInitContext (default
            torch.float16); for a module built inside, ``None`` or the context's dtype.
        chunk_size: bytes per chunk (``None``: searched; a multiple of the element size of ``dtype``; a
            chunk holds at least the largest parameter).
        offload_param_frac, offload_optim_frac: with ``"static"``, the fractions in [0, 1] of parameter
            chunks and of optimizer chunk groups that rest on the host.
        offload_optimizer: ``"disk"``: the optimizer state the policy keeps on the host (fp32 master,
            exp_avg, exp_avg_sq) rests in files under ``nvme_path`` instead, and each step streams it
            through the host (:mod:`chunkmem.optim.disk_step`); ``None`` (default): no disk tier. Needs
            placement ``"cpu"``, ``"auto"`` or ``"static"``.
        offload_param: ``None`` only for now (parameters on the disk tier are not built yet).
        nvme_path: an existing writable directory on a fast disk; the model's files go into a private
            subdirectory removed with the model, at exit and after an exception (:mod:`chunkmem.io.disk_io`).
        buffer_count: I/O buffers per streamed family (>= 1; 2 or more overlap reads, updates and
            writes). Host memory of the disk tier: ``buffer_count`` × families × ``buffer_size`` bytes.
        buffer_size: bytes per I/O buffer and per piece of a streamed step (a multiple of 8192).
        atomic_step: a step over disk-resident state either completes for every chunk or is undone
            (two regions per chunk on disk: twice the files); ``False`` halves the files, and a step that
            fails half-way then asks for a checkpoint to be loaded.
    """

    def __init__(self, module: nn.Module, shard_strategy: BaseShardStrategy, process_group: Any = None,
                 reduce_scatter_process_group: Any = None, reduce_scatter_bucket_size_mb: int = 25,
                 fp32_reduce_scatter: bool = False, tensor_placement_policy: str = "cuda",
                 gradient_predivide_factor: float = 1.0, reuse_fp16_shard: bool = False, *,
                 dtype: torch.dtype | None = None, chunk_size: int | None = None,
                 offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0,
                 offload_optimizer: str | None = None, offload_param: str | None = None,
                 nvme_path: str | os.PathLike | None = None, buffer_count: int = DEFAULT_BUFFER_COUNT,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, atomic_step: bool = True) -> None:
        super().__init__()
        check_type("module", module, nn.Module, "a torch.nn.Module")
        if isinstance(module, ShardedModelV2):
            raise InvalidArgumentError("module", type(module).__name__, "a module that is not already wrapped")
        check_not_wrapped(module)
        check_type("shard_strategy", shard_strategy, BaseShardStrategy,
                   "an instance of TensorShardStrategy or BucketTensorShardStrategy")
        shards = ShardGroup.of(process_group, "process_group")
        reduce_shards = shards.of_same_ranks(reduce_scatter_process_group, "reduce_scatter_process_group",
                                             "process_group")
        check_number("reduce_scatter_bucket_size_mb", reduce_scatter_bucket_size_mb, low=0, low_open=True,
                     high=2**43, finite=True, allowed="a finite number > 0 and <= 2**43 (MB)")
        check_type("fp32_reduce_scatter", fp32_reduce_scatter, bool, "True or False")
        check_number("gradient_predivide_factor", gradient_predivide_factor, low=0.0, low_open=True, finite=True)
        check_type("reuse_fp16_shard", reuse_fp16_shard, bool, "True or False")
        check_chunk_size(chunk_size)
        if dtype is not None:
            check_dtype("dtype", dtype)
        policy = make_policy(tensor_placement_policy, offload_param_frac, offload_optim_frac)
        check_disk_arguments(offload_optimizer, offload_param, nvme_path, buffer_count, buffer_size, atomic_step,
                             tensor_placement_policy, reuse_fp16_shard)
        policy.optimizer_on_disk = offload_optimizer == "disk"
        policy.params_on_disk = offload_param == "disk"
        host_capacity = host_memory_capacity()

        named = list(module.named_parameters())
        if not named:
            raise InvalidArgumentError("module", type(module).__name__, "a module with at least one parameter")
        check_param_dtypes(named)
        slots = [slot_of(p) for _, p in named]
        from_context = all(s is not None for s in slots)
        if not from_context and any(s is not None for s in slots):
            raise InvalidArgumentError("module", type(module).__name__,
                                       "a module built wholly inside or wholly outside ZeroInitContext")
        if from_context:
            context_dtype = slots[0].chunk.dtype
            if dtype is not None and dtype != context_dtype:
                raise InvalidArgumentError("dtype", dtype, f"None or {context_dtype} (the ZeroInitContext dtype)")
            dtype = context_dtype
        else:
            dtype = dtype or torch.float16
        if reuse_fp16_shard and dtype == torch.float32:
            raise InvalidArgumentError("reuse_fp16_shard", True,
                                       "False with dtype torch.float32 (the fp32 parameters are the masters)")
        check_chunk_size(chunk_size, dtype)

        self.module = module
        self.shard_strategy = shard_strategy
        self.process_group = process_group
        self.reduce_scatter_process_group = reduce_scatter_process_group or process_group
        self.shards = shards
        self.reduce_scatter_bucket_size_mb = reduce_scatter_bucket_size_mb
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.tensor_placement_policy = tensor_placement_policy
        self.gradient_predivide_factor = gradient_predivide_factor
        self.reuse_fp16_shard = reuse_fp16_shard
        self.dtype = dtype
        self.compute_device = device_of_tier(Tier.DEVICE)
        self._element_size = torch.empty((), dtype=dtype).element_size()
        self._param_names = {id(p): name for name, p in named}
        numels = [p.numel() for _, p in named]
        keys = [ChunkKey(p.requires_grad, 0) for _, p in named]
        if chunk_size is not None:
            chunk_numel = chunk_size // self._element_size
            largest = max(numels, default=0)
            if chunk_numel < largest:
                name = named[numels.index(largest)][0]
                raise InvalidArgumentError("chunk_size", chunk_size,
                                           f">= {largest * self._element_size} bytes (parameter {name!r} "
                                           f"has {largest} elements of {self._element_size} bytes)")
        elif from_context and all(s.chunk.size_was_given for s in slots):
            chunk_numel = slots[0].chunk.numel
        else:
            chunk_numel = search_chunk_numel(numels, keys, self._element_size)
        chunk_numel = aligned_numel(chunk_numel, shards.world) if shards.sharded else chunk_numel
        self.chunk_numel = chunk_numel

        self.policy = policy
        plan = self._plan(named, keys)
        agree_on_model_layout(self, plan)  # sharded: every rank the same, before any layout collective
        capacity = device_memory_capacity()
        self._check_capacity(plan, capacity)
        memory = slots[0].chunk.memory if from_context else TierMemory.for_this_machine(capacity)
        memory.ledger.capacity = capacity
        memory.ledger.host_capacity = host_capacity
        self._check_host_capacity(plan, memory.ledger)
        if nvme_path is not None:
            memory.disk = DiskTier(nvme_path, buffer_count, buffer_size, atomic_step, memory.ledger)
            weakref.finalize(self, memory.disk.close)
        self._reserve_param_files(plan, memory)
        chunks = self._build(plan, _unique_chunks(slots) if from_context else [], memory)
        if from_context:  # chunks of parameters replaced after creation (the original weight of a tied head)
            for chunk in slots[0].chunk.built_with:
                if chunk not in chunks:
                    _free_chunk(chunk)
        self._cast_buffers()
        reduction = GradientReduction(reduce_shards, int(reduce_scatter_bucket_size_mb * 2**20), fp32_reduce_scatter,
                                      gradient_predivide_factor)
        self.chunk_manager = ChunkManager(chunks, memory, policy, reuse_fp16_shard, reduction,
                                          gather_together=shard_strategy.bucketed)
        self.chunk_manager.settle_all()
        self.chunk_manager.bind_views_to_device()
        self._hooks = ChunkHooks(module, self.chunk_manager)
        self.optimizer_attached = False
        mark_wrapped(module)

    # ---- layout ------------------------------------------------------------------------------------

    def _plan(self, named: list[tuple[str, nn.Parameter]], keys: list[ChunkKey]) -> "_LayoutPlan":
        """Parameters grouped by key (keys in order of first appearance), then packed in order."""
        rank = _first_seen_rank(keys)
        order = sorted(range(len(named)), key=lambda i: rank[keys[i]])
        entries = [(named[i][0], named[i][1], keys[i]) for i in order]
        groups = pack([p.numel() for _, p, _ in entries], [k for _, _, k in entries], self.chunk_numel)
        return _LayoutPlan(entries, groups, self.chunk_numel * self._element_size)

    def _laid_out_as(self, plan: "_LayoutPlan", current: list[Chunk]) -> bool:
        """Whether ``current`` already holds the parameters as ``plan`` says (nothing to re-pack)."""
        wanted_ids = [[id(plan.entries[i][1]) for i in group] for group in plan.groups]
        current_ids = [[id(s.param) for s in c.slots] for c in current]
        return bool(current and current_ids == wanted_ids and all(c.numel == self.chunk_numel for c in current)
                    and all(_same_sharding(c.shards, self.shards) for c in current)
                    and all(c.key == plan.entries[g[0]][2] for c, g in zip(current, plan.groups)))

    def _build(self, plan: "_LayoutPlan", current: list[Chunk], memory: TierMemory) -> list[Chunk]:
        """Chunks laid out as ``plan`` says: ``current`` if it already is, else new chunks (the current
        ones are freed)."""
        if self._laid_out_as(plan, current):
            for chunk in current:
                for slot in chunk.slots:
                    slot.name = self._param_names[id(slot.param)]
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

        chunks = build_chunks(plan.entries, self.chunk_numel, self.dtype, memory, Tier.HOST, self.shards,
                              value_of=value_of, to_disk=self.policy.params_on_disk)
        gathered.clear()
        for chunk in current:
            _free_chunk(chunk)
        return chunks

    def _reserve_param_files(self, plan: "_LayoutPlan", memory: TierMemory) -> None:
        """With ``offload_param="disk"``: preallocate the parameter file for the chunks of ``plan`` (a
        full disk is refused here, before the module changes)."""
        if self.policy.params_on_disk:
            memory.disk.reserve(PARAM, plan.chunk_bytes // self.shards.world, len(plan.groups))

    def _check_host_capacity(self, plan: "_LayoutPlan", ledger: TierLedger) -> None:
        """Refuse, before the module changes, a host capacity below the parameter chunks that rest on the
        host (this rank's shards)."""
        if ledger.host_capacity is None or self.policy.params_on_disk:
            return
        count = len(plan.groups)
        resting = sum(1 for i in range(count) if not self.policy.params_on_device_at_rest(i, count))
        need = resting * (plan.chunk_bytes // self.shards.world)
        if need > ledger.host_capacity:
            raise HostCapacityError(
                f"host tier too small: the {resting} parameter chunks resting on the host need {need} bytes, the "
                f"capacity is {ledger.host_capacity} bytes (set chunkmem.set_host_memory_capacity or "
                f"CHUNKMEM_HOST_MEMORY higher, or offload_param='disk')")

    def _plan_for_groups(self, group_of: dict[int, int]) -> "_LayoutPlan":
        """The layout in which no chunk mixes optimizer param groups."""
        named = list(self.module.named_parameters())
        keys = [ChunkKey(p.requires_grad, group_of.get(id(p), 0) if p.requires_grad else 0) for _, p in named]
        return self._plan(named, keys)

    def _repack(self, plan: "_LayoutPlan") -> None:
        """Adopt ``plan`` (called once, by the optimizer, before any optimizer state exists)."""
        if not self._laid_out_as(plan, self.chunk_manager.chunks):  # a re-pack gathers: the ranks must agree
            agree_on_model_layout(self, plan, step="ShardedOptimizerV2 re-pack")
        self._reserve_param_files(plan, self.chunk_manager.memory)
        chunks = self._build(plan, self.chunk_manager.chunks, self.chunk_manager.memory)
        if chunks is self.chunk_manager.chunks:
            return
        self.chunk_manager.chunks = chunks
        self.chunk_manager.settle_all()
        self.chunk_manager.bind_views_to_device()
        self._hooks.refresh_chunks()

    def _check_capacity(self, plan: "_LayoutPlan", capacity: int) -> None:
        """Refuse a capacity that cannot hold what the policy needs on the device at one time: the chunks
        resting there (with their gradients), plus the most any module's forward or backward holds.

        A module's forward holds its own chunks. Its backward holds them with their gradient staging,
        and also every chunk whose backward began earlier and whose gradients are not finished yet: a
        chunk stays on the device from the backward of its first user (in backward order) to that of
        its last (a tied embedding from the head's backward to the embedding's; a chunk without
        trainable parameters to the end of the backward). The backward order taken is the reverse of
        the modules' registration order, the usual execution order.
        """
        count = len(plan.groups)
        grads_per_chunk = 0 if self.reuse_fp16_shard else 1

        def need_of(chunk_indices: set[int], chunk_bytes: int, staging: set[int] | None = None) -> int:
            staged = chunk_indices if staging is None else chunk_indices & staging
            trainable = sum(1 for i in staged if plan.key_of(i).trainable)
            return (len(chunk_indices) + grads_per_chunk * trainable) * chunk_bytes

        # Sharded, what rests is one shard of each chunk, and every chunk a module uses is gathered.
        resting = {i for i in range(count) if self.policy.params_on_device_at_rest(i, count)}
        need = need_of(resting, plan.chunk_bytes // self.shards.world)
        what = f"the {len(resting)} chunks resting on the device with their gradients" if resting else ""
        chunk_of = plan.chunk_of_param()
        backward = []  # (module name, its parameters) in backward order
        for name, module in reversed(list(self.module.named_modules())):
            params = list(module.parameters(recurse=False))
            if params:
                backward.append((name or type(module).__name__, params))
        first: dict[int, int] = {}  # chunk -> backward position of its first user
        last: dict[int, int] = {}  # chunk -> position where its gradients are finished
        grad_at: dict[int, int] = {}  # parameter -> position of its last user (autograd's AccumulateGrad)
        for position, (_, params) in enumerate(backward):
            for p in params:
                c = chunk_of[id(p)]
                first.setdefault(c, position)
                last[c] = position if plan.key_of(c).trainable else len(backward)
                grad_at[id(p)] = position
        staging_from: dict[int, int] = {}  # chunk -> position where its first gradient arrives
        for param_id, position in grad_at.items():
            c = chunk_of[param_id]
            staging_from[c] = min(staging_from.get(c, position), position)
        visiting_need, visiting_what = 0, ""
        for position, (name, params) in enumerate(backward):
            own = {chunk_of[id(p)] for p in params}
            held = {c for c in first if first[c] <= position <= last[c]} | own
            staging = {c for c in held if staging_from.get(c, position) <= position} | own
            if not self.shards.sharded:
                held -= resting
                own = own - resting
            held_need = need_of(held, plan.chunk_bytes, staging)
            if held_need > visiting_need or (held_need == visiting_need > 0):  # ties: the first in forward order
                visiting_need = held_need
                others = len(held - own)
                visiting_what = f"the chunks of module {name!r} with their gradients" + (
                    f" and the {others} other chunk(s) its backward holds (first used by a later module's "
                    f"backward, their gradients not finished yet)" if others else "")
        need += visiting_need
        what = " and ".join(w for w in (what, visiting_what) if w)
        if need > capacity:
            remedy = "use placement 'cpu'" if resting else "use smaller chunks (chunk_size=)"
            raise DeviceCapacityError(
                f"the device tier capacity of {capacity} bytes is smaller than the {need} bytes of {what}; "
                f"raise it with chunkmem.set_device_memory_capacity or CHUNKMEM_DEVICE_MEMORY, or {remedy}")

    def _cast_buffers(self) -> None:
        for module in self.module.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    dtype = self.dtype if buf.is_floating_point() else buf.dtype
                    module._buffers[name] = buf.to(device=self.compute_device, dtype=dtype)

    # ---- forward -----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.reuse_fp16_shard and any(c.param.holds_grads for c in self.chunk_manager.chunks):
            raise GradientAccumulationError(
                "forward called while gradients from the last backward are still in the parameters' memory "
                "(reuse_fp16_shard=True): call optim.step() or optim.zero_grad() first; gradient "
                "accumulation needs reuse_fp16_shard=False")
        self._hooks.clear_interrupted()
        args, kwargs = tree_map(self._cast_input, (args, kwargs))
        self.chunk_manager.scheduler.begin_iteration(_shapes_of((args, kwargs)), torch.is_grad_enabled())
        output = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            self.chunk_manager.flush_stale()
        if self.dtype != torch.float32:
            output = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                              output)
        return output

    def _cast_input(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point() and self.dtype != torch.float32:
            return value.to(device=self.compute_device, dtype=self.dtype)
        return value.to(self.compute_device)

    # ---- what a plain module would do, refused or redirected ---------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> "ShardedModelV2":
        raise ParameterAccessError(
            "converting a ShardedModelV2 (.half(), .float(), .to(...), .cuda(), .cpu(), ...): the dtype and the "
            "placement of its parameters belong to chunkmem. Choose them when wrapping (ZeroInitContext / "
            "ShardedModelV2 dtype=, tensor_placement_policy=), or take a plain module back with model.unwrap()")

    def to(self, *args: Any, **kwargs: Any) -> "ShardedModelV2":
        """A no-op when it asks for the compute device (or the CPU's, without CUDA) and this model's
        dtype, as training loops written for plain modules do; any real conversion is refused (see
        :meth:`_apply`)."""
        device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        same_device = device is None or torch.device(device).type == self.compute_device.type
        if same_device and dtype in (None, self.dtype) and memory_format is None:
            return self
        return self._apply(None)

    def __deepcopy__(self, memo: dict) -> Any:
        raise ParameterAccessError(
            "copy.deepcopy of a ShardedModelV2: its parameters live in chunks tied to this model's memory "
            "manager. Build a second model and load model.state_dict() into it, or take a plain module back "
            "with model.unwrap()")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ParameterAccessError(
            "pickling (torch.save) a ShardedModelV2: save model.state_dict() or use chunkmem.save_checkpoint")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero the gradients held in the chunks. With ``reuse_fp16_shard`` the
        gradients share the parameters' memory: use ``optim.zero_grad()``, which restores the values."""
        check_type("set_to_none", set_to_none, bool, "True or False")
        if self.reuse_fp16_shard and any(c.param.holds_grads for c in self.chunks):
            raise GradientAccumulationError(
                "with reuse_fp16_shard=True the gradients are in the parameters' memory: call optim.zero_grad() "
                "(it restores the parameters from the fp32 masters), not model.zero_grad()")
        self.chunk_manager.zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate each chunk's full local gradient on the device tier without
        any collective (the chunks stay sharded; each holds a whole-chunk gradient buffer meanwhile); the
        first backward outside reduces the sum with its own gradients, as DDP's ``no_sync``. Every rank
        must use it alike. With one rank there is nothing to defer and it changes nothing. Refused with
        ``reuse_fp16_shard=True`` (:class:`~chunkmem.GradientAccumulationError`), which cannot accumulate."""
        if self.reuse_fp16_shard:
            raise GradientAccumulationError(
                "no_sync() accumulates gradients over several backward passes, which reuse_fp16_shard=True cannot "
                "do (the gradients share the parameters' memory); build ShardedModelV2 with reuse_fp16_shard=False")
        manager = self.chunk_manager
        if manager.no_sync:
            raise InvalidArgumentError("no_sync", "a nested no_sync()", "one no_sync() at a time")
        manager.no_sync = True
        try:
            yield
        finally:
            manager.no_sync = False

    def unwrap(self) -> nn.Module:
        """Give the wrapped module back as a plain module: every parameter an ordinary ``nn.Parameter``
        holding its full current value in fp32 on the CPU (from the fp32 masters where they exist, as
        :meth:`state_dict`), buffers as they are, chunkmem's hooks removed and the chunks freed. The
        parameter objects stay the same (an optimizer over them still names them). This model and its
        optimizer cannot be used afterwards. Sharded, the chunks are gathered: every rank calls it."""
        if self._hooks.stack:
            raise ParameterAccessError("model.unwrap() inside the model's forward")
        values: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            full = self._full_values(chunk)
            for slot in chunk.slots:
                values[id(slot.param)] = slot.view(full).clone()
        self._hooks.remove()
        for chunk in self.chunks:
            _free_chunk(chunk, values)
        self.chunk_manager.chunks = []
        mark_unwrapped(self.module)
        return self.module

    # ---- inspection --------------------------------------------------------------------------------

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks, in packing order."""
        return self.chunk_manager.chunks

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        """Exact bytes of chunk memory per tier and family: ``{"device": {"param": n, ...}, "host": ...}``."""
        return self.chunk_manager.memory.breakdown()

    @property
    def disk_path(self) -> str | None:
        """The private directory of the model's disk-tier files under ``nvme_path`` (``None`` without a
        disk tier). It is removed with the model, at exit and after an exception."""
        disk = self.chunk_manager.memory.disk
        return None if disk is None else disk.path

    def disk_file_bytes(self) -> int:
        """Bytes the disk tier's files occupy (preallocated: regions rounded up to 4096 bytes, two per
        chunk with ``atomic_step``, and the fp32 journal); 0 without a disk tier."""
        disk = self.chunk_manager.memory.disk
        return 0 if disk is None else disk.file_bytes

    def cached_bytes(self) -> int:
        """Bytes of freed chunk buffers the model's block pool keeps for reuse (CPU-only machines, see
        :mod:`chunkmem.core.block_pool`; 0 with CUDA, whose cache ``torch.cuda.memory_reserved`` reports)."""
        blocks = self.chunk_manager.memory.blocks
        return 0 if blocks is None else blocks.cached_bytes

    def empty_cache(self) -> None:
        """Unmap the freed chunk buffers the block pool keeps (CPU-only machines; with CUDA,
        ``torch.cuda.empty_cache()`` does this for the device). Buffers in use stay; the next step maps
        what it needs again."""
        blocks = self.chunk_manager.memory.blocks
        if blocks is not None:
            blocks.clear()

    def memory_stats(self) -> dict[str, Any]:
        """The memory statistics document (schema in :mod:`chunkmem.runtime.memstats`)."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        return memstats.collect(self.chunk_manager, rank, world)

    def dump_memory_stats(self, filename: str = "memstats.json") -> str:
        """Write :meth:`memory_stats` as JSON to ``filename`` (with ``.rank{N}`` before the extension when
        running distributed), log a text summary, and return the path written. Safe to call in an
        ``except`` handler after an out-of-memory error: it reads what was recorded so far."""
        doc = self.memory_stats()
        if doc["world_size"] > 1:
            root, ext = os.path.splitext(filename)
            filename = f"{root}.rank{doc['rank']}{ext}"
        write_json_atomically(doc, filename)
        logger.info("%s\n  written to %s", memstats.summary(doc), filename)
        return filename

    def _full_values(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's whole current parameter values in fp32 on the CPU: from the fp32 masters where they
        exist. Gathers the shards when sharded (a collective: every rank calls it in the same order)."""
        if chunk.optim[MASTER].allocated:
            local = chunk.optim[MASTER].read()
        elif chunk.param.holds_grads:
            raise RuntimeError(f"{chunk.name}: the parameter memory holds gradients and there is no master")
        else:
            local = chunk.param.local()
        return chunk.gather(local.detach()).to(device="cpu", dtype=torch.float32)

    def full_parameter(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU fp32 copy of ``param``'s current value: from the fp32 master where one exists. When the
        chunks are sharded this gathers the parameter's chunk: every rank must call it."""
        slot = slot_of(param)
        if slot is None or slot.chunk not in self.chunks:
            raise InvalidArgumentError("param", tuple(param.shape), "a parameter of this model")
        return slot.view(self._full_values(slot.chunk)).clone()

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                   rank0_only: bool = False) -> Any:
        """The wrapped module's full state under its own keys, on the CPU: parameters in fp32 (from the
        masters where masters exist), buffers as stored. Loadable by the plain module.

        Sharded, the chunks are gathered one at a time, so every rank must call it; with
        ``rank0_only=True`` the other ranks receive an empty dict (and keep no copy)."""
        check_type("rank0_only", rank0_only, bool, "True or False")
        keep = not rank0_only or self.shards.rank == 0
        values: dict[int, torch.Tensor] = {}
        for chunk in self.chunks:
            full = self._full_values(chunk)
            if keep:
                for slot in chunk.slots:
                    values[id(slot.param)] = slot.view(full).clone()
        out = OrderedDict() if destination is None else destination
        if not keep:
            return out
        for key, value in self.module.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter) and id(value) in values:
                out[prefix + key] = values[id(value)]
            else:
                out[prefix + key] = value.detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict under the wrapped module's keys (what :meth:`state_dict` or the plain
        module's ``state_dict()`` returns; parameters in any floating dtype). Each rank writes only its
        shard of every parameter: the 16-bit (or fp32) parameter copy and, where the optimizer keeps
        fp32 masters, the master, so fp32 values survive exactly. Buffers are copied (cast to their
        dtype). Tied parameters may appear under each of their keys (with equal values) or one.

        Everything is checked before anything changes. Returns ``(missing_keys, unexpected_keys)``;
        with ``strict`` either raises :class:`~chunkmem.InvalidArgumentError`, as does a wrong shape
        or dtype (naming the key). Refused (:class:`~chunkmem.CheckpointError`) between a backward and
        the step with ``reuse_fp16_shard``, while the parameters' memory holds gradients. Loading
        before a 16-bit model has its optimizer rounds the values to the 16-bit dtype (a warning says
        so when that loses bits): build :class:`~chunkmem.ShardedOptimizerV2` first to keep fp32
        masters. No collective: every rank may load on its own. ``assign`` must be ``False``.
        """
        from .io.state_dicts import plan_model_load

        if assign is not False:
            raise InvalidArgumentError("assign", assign, "False (values are always copied into the chunks)")
        return plan_model_load(self, state_dict, strict).apply()


class _LayoutPlan:
    """Which parameters go into which chunk: ``entries`` (name, param, key) in packing order and
    ``groups``, the entry indices of each chunk; every chunk has ``chunk_bytes`` bytes of parameters."""

    def __init__(self, entries: list[tuple[str, nn.Parameter, ChunkKey]], groups: list[list[int]],
                 chunk_bytes: int) -> None:
        self.entries = entries
        self.groups = groups
        self.chunk_bytes = chunk_bytes

    def key_of(self, chunk_index: int) -> ChunkKey:
        return self.entries[self.groups[chunk_index][0]][2]

    def chunk_of_param(self) -> dict[int, int]:
        return {id(self.entries[i][1]): c for c, group in enumerate(self.groups) for i in group}


def _shapes_of(tree: Any) -> tuple:
    """What must stay the same for a recorded schedule to apply: the shapes and dtypes of the inputs."""
    from torch.utils._pytree import tree_leaves

    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in tree_leaves(tree))


def _same_sharding(a: ShardGroup, b: ShardGroup) -> bool:
    return a.same_ranks(b) and (not a.sharded or a.group == b.group)


def _free_chunk(chunk: Chunk, values: dict[int, torch.Tensor] | None = None) -> None:
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


def _first_seen_rank(keys: list[ChunkKey]) -> dict[ChunkKey, int]:
    rank: dict[ChunkKey, int] = {}
    for key in keys:
        rank.setdefault(key, len(rank))
    return rank
