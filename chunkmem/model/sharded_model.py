"""ShardedModelV2: wraps a module so that its parameters live in chunks placed by a policy."""
from __future__ import annotations

import os
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from .builder import build_runtime, free_chunk, mark_unwrapped
from ..core.chunk import Chunk
from ..core.disk_tier import DEFAULT_BUFFER_COUNT, DEFAULT_BUFFER_SIZE
from ..errors import GradientAccumulationError, InvalidArgumentError, check_type
from ..core.param_guard import ParameterAccessError, slot_of
from ..core.tiers import Tier, device_of_tier
from ..distributed.shard_strategy import BaseShardStrategy
from .module_face import cast_inputs, cast_outputs, show_forward_signature
from ..runtime import memstats
from ..settings import ModelSettings
from ..state_dicts import full_state_dict, full_values, parameter_values, plan_model_load


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
        offload_param: ``"disk"``: the parameter shards rest in files under ``nvme_path`` and are read
            for compute (prefetched from the schedule) and streamed by the step; ``None`` (default): no.
        nvme_path: an existing writable directory on a fast disk; the model's files go into a private
            subdirectory removed with the model, at exit and after an exception (:mod:`chunkmem.storage.disk_io`).
        buffer_count: I/O buffers per streamed family (>= 1; 2 or more overlap reads, updates and
            writes). Host memory of the disk tier: ``buffer_count`` × families × ``buffer_size`` bytes.
        buffer_size: bytes per I/O buffer and per piece of a streamed step (a multiple of 8192).
        atomic_step: a step over disk-resident state either completes for every chunk or is undone
            (two regions per chunk on disk: twice the files); ``False`` halves the files, and a step that
            fails half-way then asks for a checkpoint to be loaded.
        prefetch_numel: (chunkmem addition) at most this many parameter elements are fetched ahead of
            their use, in whole chunks (rounded down to a multiple of the chunk's elements; ``0``: no
            prefetch, also none after the step); ``None`` (default): as many chunks of the next period (after
            ``step()``: of the next forward's first) as the device capacity allows. DeepSpeed's
            ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` map onto it
            (:mod:`chunkmem.configs.deepspeed`).
        persistence_threshold: (addition; DeepSpeed's ``stage3_param_persistence_threshold``) on several
            ranks, parameters of fewer elements are persistent: packed into chunks of their own that stay
            whole on every rank (never gathered; their gradients all-reduced instead of reduce-scattered;
            their optimizer state whole on every rank, stepped alike). ``0`` (default): none. Not with the
            disk tier. No effect in one process (every chunk is whole there).
        model_persistence_threshold: (addition; DeepSpeed's ``stage3_model_persistence_threshold``) at
            most this many elements of persistent parameters in all, the first in ``named_parameters()``
            order; ``None``: no limit.
        reductions_in_flight: (addition; DeepSpeed's ``overlap_comm`` at stage 3) on several ranks, at most
            this many chunks' gradient reduce-scatters keep running while the backward goes on, each
            waited for when a newer one would exceed the bound, or at the end of the backward; results
            are bitwise those of ``0`` (default: each waited for as it starts). Costs up to this many
            extra chunk-sized gradient staging buffers on the device tier. Replicated chunks (persistent
            parameters) are all-reduced at once. Needs ``reuse_fp16_shard=False``.
        shard_group_size: (addition; DeepSpeed's ``mics_shard_size``) shard each chunk over groups of this
            many consecutive data-parallel ranks and replicate it across the groups (MiCS: gathers stay
            inside a group, gradients are reduce-scattered inside it and all-reduced across the groups;
            :mod:`chunkmem.distributed.shard_groups`). A divisor of the data-parallel ranks; ``None``
            (default): all of them (flat ZeRO-3). Every rank creates the sub-groups
            (``torch.distributed.new_group``) when the model is built. Not with ``persistence_threshold``.
        quantized_gradients: (addition; DeepSpeed's ``zero_quantized_gradients``, ZeRO++'s qgZ) on several
            ranks, exchange each chunk's gradients as blockwise int8 (one fp32 scale per 2048 elements) in
            one all-to-all and sum them dequantized in fp32, instead of reduce-scattering them: about a
            half (16-bit) or a quarter (fp32) of the bytes; each element's mean is off by at most the mean
            over the ranks of half its block's scale (``max |x| / 254``; an inf or NaN still reaches the
            loss scaler). Persistent chunks are all-reduced exactly.
        quantized_weights: (addition; DeepSpeed's ``zero_quantized_weights`` / ``..._nontrainable_weights``,
            ZeRO++'s qwZ) on several ranks, the forward's and backward's parameter gathers carry each
            rank's shard as blockwise int8 (one fp32 scale per 2048 elements) and the modules compute with
            the dequantized values (each off by at most ``max |x| / 254`` of its block); ``"nontrainable"``:
            only the chunks of frozen parameters (a LoRA base). The shards, the fp32 masters, the optimizer
            state, ``state_dict`` and ``GatheredParameters`` stay exact. ``True`` needs
            ``TensorShardStrategy``.
        secondary_partition_size: (addition; DeepSpeed's ``zero_hpz_partition_size``, ZeRO++'s hpZ) on several
            ranks, after a module's forward each rank keeps its part of the gathered chunk split over this
            many consecutive ranks (``chunk bytes / size`` more on the device tier per chunk, from the
            forward to the backward), and the backward gathers the chunk inside that group (a node)
            instead of over every rank; bitwise the same training. A divisor of the ranks the chunks are
            sharded over, below it; ``None`` or 1: off. Not with ``auto`` placement (its plan does not count
            the secondary parts) nor with ``shard_group_size``.
        gather_node_size: (addition; DeepSpeed's ``mics_hierarchical_params_gather``) the ranks of each node,
            when the ranks a chunk is sharded over span several nodes: every parameter gather runs in two
            stages, across the nodes among the ranks at the same place in their node (each rank sends its
            shard over the network once, to ``nodes - 1`` peers), then inside the node; the gathered values
            are the same bits. A divisor of the ranks the chunks are sharded over, below it; ``None``
            (default): one flat gather. Holds one more chunk-sized buffer while a gather completes.
        grad_accum_dtype: (addition; DeepSpeed's ``data_types.grad_accum_dtype``) what 16-bit gradients are
            summed in over several backwards before a step (gradient accumulation, ``no_sync``): ``None`` or
            ``torch.float32`` (default), the sum is kept in fp32 from the second backward on (the chunk's
            gradient buffer is widened then: 2 more bytes a parameter while accumulating, counted on the
            ledger), as DeepSpeed's bf16 ZeRO does; the model's ``dtype`` keeps the sum in 16 bits (32 bf16
            micro-batches were 0.59% off an fp32 sum). One backward's gradients are the dtype's, as in torch.
    """

    def __init__(self, module: nn.Module, shard_strategy: BaseShardStrategy, process_group: Any = None,
                 reduce_scatter_process_group: Any = None, reduce_scatter_bucket_size_mb: int = 25,
                 fp32_reduce_scatter: bool = False, tensor_placement_policy: str = "cuda",
                 gradient_predivide_factor: float = 1.0, reuse_fp16_shard: bool = False, *,
                 dtype: torch.dtype | None = None, chunk_size: int | None = None,
                 offload_param_frac: float = 0.0, offload_optim_frac: float = 0.0,
                 offload_optimizer: str | None = None, offload_param: str | None = None,
                 nvme_path: str | os.PathLike | None = None, buffer_count: int = DEFAULT_BUFFER_COUNT,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, atomic_step: bool = True,
                 prefetch_numel: int | None = None, persistence_threshold: int = 0,
                 model_persistence_threshold: int | None = None, reductions_in_flight: int = 0,
                 shard_group_size: int | None = None, quantized_gradients: bool = False,
                 quantized_weights: bool | str = False, secondary_partition_size: int | None = None,
                 gather_node_size: int | None = None, grad_accum_dtype: torch.dtype | None = None) -> None:
        check_type("module", module, nn.Module, "a torch.nn.Module")
        if isinstance(module, ShardedModelV2):
            raise InvalidArgumentError("module", type(module).__name__, "a module that is not already wrapped")
        settings = ModelSettings.from_arguments(
            shard_strategy, process_group, reduce_scatter_process_group, reduce_scatter_bucket_size_mb,
            fp32_reduce_scatter, tensor_placement_policy, gradient_predivide_factor, reuse_fp16_shard, dtype=dtype,
            chunk_size=chunk_size, offload_param_frac=offload_param_frac, offload_optim_frac=offload_optim_frac,
            offload_optimizer=offload_optimizer, offload_param=offload_param, nvme_path=nvme_path,
            buffer_count=buffer_count, buffer_size=buffer_size, atomic_step=atomic_step, prefetch_numel=prefetch_numel,
            persistence_threshold=persistence_threshold, model_persistence_threshold=model_persistence_threshold,
            reductions_in_flight=reductions_in_flight, shard_group_size=shard_group_size,
            quantized_gradients=quantized_gradients, quantized_weights=quantized_weights,
            secondary_partition_size=secondary_partition_size, gather_node_size=gather_node_size,
            grad_accum_dtype=grad_accum_dtype)
        super().__init__()
        self._wrap(module, settings)

    @classmethod
    def from_settings(cls, module: nn.Module, settings: ModelSettings) -> "ShardedModelV2":
        """Wrap ``module`` as ``settings`` say (what ``ShardedModelV2(module, ...)`` does with its
        arguments parsed; :func:`chunkmem.initialize` builds the settings from a configuration)."""
        check_type("settings", settings, ModelSettings, "a chunkmem.settings.ModelSettings")
        check_type("module", module, nn.Module, "a torch.nn.Module")
        if isinstance(module, ShardedModelV2):
            raise InvalidArgumentError("module", type(module).__name__, "a module that is not already wrapped")
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._wrap(module, settings)
        return model

    def _wrap(self, module: nn.Module, settings: ModelSettings) -> None:
        built = build_runtime(module, settings)
        self.module = module
        self.settings = settings
        self.runtime = built.runtime
        self.dtype = built.dtype
        self.shards = built.groups.shards
        self.data_parallel = built.groups.data_parallel
        self.replicas = built.groups.replicas
        self.layout = built.layout
        self.compute_device = device_of_tier(Tier.DEVICE)
        self._param_names = built.param_names
        show_forward_signature(self, module)  # inspect.signature(self.forward) is the module's

    def __getattr__(self, name: str) -> Any:
        """Attributes this wrapper does not have come from the wrapped module (``config``,
        ``save_pretrained``, ``gradient_checkpointing_enable``, ``main_input_name``, ...), as libraries that
        look at the model expect; parameters, buffers and submodules are this wrapper's own (``module.``)."""
        try:
            return super().__getattr__(name)
        except AttributeError as missing:
            modules = self.__dict__.get("_modules", {})
            if name.startswith("__") or "module" not in modules:
                raise
            try:
                return getattr(modules["module"], name)
            except AttributeError:
                raise missing from None

    # ---- the reference's attributes, read from the settings ----------------------------------------

    @property
    def shard_strategy(self) -> BaseShardStrategy:
        return self.settings.shard_strategy

    @property
    def process_group(self) -> Any:
        return self.settings.process_group

    @property
    def reduce_scatter_process_group(self) -> Any:
        return self.settings.reduce_scatter_process_group or self.settings.process_group

    @property
    def reduce_scatter_bucket_size_mb(self) -> float:
        return self.settings.reduction.reduce_scatter_bucket_size_mb

    @property
    def fp32_reduce_scatter(self) -> bool:
        return self.settings.reduction.fp32_reduce_scatter

    @property
    def tensor_placement_policy(self) -> str:
        return self.settings.placement.tensor_placement_policy

    @property
    def gradient_predivide_factor(self) -> float:
        return self.settings.reduction.gradient_predivide_factor

    @property
    def secondary_partition_size(self) -> int:
        """The ranks hpZ's secondary partition is split over (1: none)."""
        return self.settings.sharding.secondary_partition_size or 1

    @property
    def quantized_weights(self) -> bool | str:
        """Which compute gathers travel as blockwise int8 (``False``, ``True`` or ``"nontrainable"``)."""
        return self.settings.sharding.quantized_weights

    @property
    def quantized_gradients(self) -> bool:
        """Whether gradients are exchanged as blockwise int8 (qgZ)."""
        return self.settings.reduction.quantized_gradients

    @property
    def shard_group_size(self) -> int:
        """The ranks each chunk is sharded over (MiCS' shard size; all data-parallel ranks without it)."""
        return self.shards.world

    @property
    def reductions_in_flight(self) -> int:
        """At most this many chunks' gradient reduce-scatters run on during the backward (0: in line)."""
        return self.settings.reduction.reductions_in_flight

    @property
    def reuse_fp16_shard(self) -> bool:
        return self.settings.reuse_fp16_shard

    @property
    def chunk_numel(self) -> int:
        """Elements per chunk (every rank's shards together)."""
        return self.layout.chunk_numel

    @property
    def optimizer_attached(self) -> bool:
        """Whether a :class:`~chunkmem.ShardedOptimizerV2` was built over this model."""
        return self.runtime.optimizer_attached

    def parameter_name(self, param: nn.Parameter) -> str | None:
        """The name of ``param`` in the wrapped module (``named_parameters()``), or ``None`` for a tensor
        that is not one of its parameters."""
        return self._param_names.get(id(param))

    # ---- forward -----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (its signature: ``inspect.signature(model.forward)``), its chunks
        fetched as it runs; in 16-bit mode floating inputs cast to the model's dtype, outputs to fp32."""
        args, kwargs = cast_inputs((args, kwargs), self.dtype, self.compute_device)
        self.runtime.begin_iteration((args, kwargs), torch.is_grad_enabled())
        try:
            output = self.module(*args, **kwargs)
        except BaseException as error:
            self.runtime.abandon_iteration(error)
            raise
        return cast_outputs(output, self.dtype)

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
        if any(c.param.holds_grads for c in self.chunks):
            raise GradientAccumulationError(
                "with reuse_fp16_shard=True the gradients are in the parameters' memory: call optim.zero_grad() "
                "(it restores the parameters from the fp32 masters), not model.zero_grad()")
        self.runtime.drop_gradients(set_to_none)

    def no_sync(self) -> ContextManager[None]:
        """Inside, backward passes accumulate each chunk's full local gradient on the device tier without
        any collective (the chunks stay sharded; each holds a whole-chunk gradient buffer meanwhile); the
        first backward outside reduces the sum with its own gradients, as DDP's ``no_sync``. Every rank
        must use it alike. With one rank there is nothing to defer and it changes nothing. Refused with
        ``reuse_fp16_shard=True`` (:class:`~chunkmem.GradientAccumulationError`), which cannot accumulate."""
        return self.runtime.deferring_reduction()

    def unwrap(self) -> nn.Module:
        """Give the wrapped module back as a plain module: every parameter an ordinary ``nn.Parameter``
        holding its full current value in fp32 on the CPU (from the fp32 masters where they exist, as
        :meth:`state_dict`), buffers as they are, chunkmem's hooks removed and the chunks freed. The
        parameter objects stay the same (an optimizer over them still names them). This model and its
        optimizer cannot be used afterwards. Sharded, the chunks are gathered: every rank calls it."""
        if self.runtime.in_forward:
            raise ParameterAccessError("model.unwrap() inside the model's forward")
        values = parameter_values(self, self.chunks)
        chunks = self.chunks
        self.runtime.remove_hooks()
        for chunk in chunks:
            free_chunk(chunk, values)
        self.runtime.executor.chunks = []
        mark_unwrapped(self.module)
        return self.module

    # ---- inspection --------------------------------------------------------------------------------

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks, in packing order."""
        return self.runtime.chunks

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        """Exact bytes of chunk memory per tier and family: ``{"device": {"param": n, ...}, "host": ...}``."""
        return self.runtime.memory.breakdown()

    @property
    def disk_path(self) -> str | None:
        """The private directory of the model's disk-tier files under ``nvme_path`` (``None`` without a
        disk tier). It is removed with the model, at exit and after an exception."""
        disk = self.runtime.memory.disk
        return None if disk is None else disk.path

    def disk_file_bytes(self) -> int:
        """Bytes the disk tier's files occupy (preallocated: regions rounded up to 4096 bytes, two per
        chunk with ``atomic_step``, and the fp32 journal); 0 without a disk tier."""
        disk = self.runtime.memory.disk
        return 0 if disk is None else disk.file_bytes

    def cached_bytes(self) -> int:
        """Bytes of freed chunk buffers the model's block pool keeps for reuse (CPU-only machines, see
        :mod:`chunkmem.core.block_pool`; 0 with CUDA, whose cache ``torch.cuda.memory_reserved`` reports)."""
        blocks = self.runtime.memory.blocks
        return 0 if blocks is None else blocks.cached_bytes

    def empty_cache(self) -> None:
        """Unmap the freed chunk buffers the block pool keeps (CPU-only machines; with CUDA,
        ``torch.cuda.empty_cache()`` does this for the device). Buffers in use stay; the next step maps
        what it needs again."""
        blocks = self.runtime.memory.blocks
        if blocks is not None:
            blocks.clear()

    def memory_stats(self) -> dict[str, Any]:
        """The memory statistics document (schema in :mod:`chunkmem.runtime.memstats`)."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        return memstats.collect(self.runtime, rank, world)

    def dump_memory_stats(self, filename: str | os.PathLike = "memstats.json") -> str:
        """Write :meth:`memory_stats` as JSON to ``filename`` (a str or os.PathLike path; with ``.rank{N}``
        before the extension when running distributed), log a text summary, and return the path written
        (a str). Safe to call in an ``except`` handler after an out-of-memory error: it reads what was
        recorded so far."""
        check_type("filename", filename, (str, os.PathLike), "a str or os.PathLike path of the JSON file to write")
        return memstats.dump(self.memory_stats(), os.fspath(filename))

    def full_values(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's whole current parameter values in fp32 on the CPU: from the fp32 masters where they
        exist. Gathers the shards when sharded (a collective: every rank calls it in the same order)."""
        return full_values(chunk)

    def full_parameter(self, param: nn.Parameter) -> torch.Tensor:
        """A CPU fp32 copy of ``param``'s current value: from the fp32 master where one exists. When the
        chunks are sharded this gathers the parameter's chunk: every rank must call it."""
        check_type("param", param, torch.Tensor, "a parameter of this model (not its name: pass "
                   "model.module.get_parameter(name))")
        slot = slot_of(param)
        if slot is None or slot.chunk not in self.chunks:
            raise InvalidArgumentError("param", tuple(param.shape), "a parameter of this model")
        return slot.view(self.full_values(slot.chunk)).clone()

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                   rank0_only: bool = False, trainable_only: bool = False) -> Any:
        """The wrapped module's full state under its own keys, on the CPU: parameters in fp32 (from the
        masters where masters exist), buffers as stored. Loadable by the plain module.

        Sharded, the chunks are gathered one at a time, so every rank must call it; with
        ``rank0_only=True`` the other ranks receive an empty dict (and keep no copy).
        ``trainable_only=True`` (an addition): only the parameters that required grad when the model was
        wrapped (the ones the optimizer can train; no buffers), gathering only their chunks: a LoRA
        adapter's weights without reading the frozen base, for ``PeftModel.save_pretrained(directory,
        state_dict=...)``. Refused between a ``step_in_backward`` backward and ``optim.step()``: the parameters
        then hold the backward's speculative updates, which the step may still undo and redo."""
        check_type("rank0_only", rank0_only, bool, "True or False")
        check_type("trainable_only", trainable_only, bool, "True or False")
        self.runtime.check_no_step_in_flight("model.state_dict()")
        return full_state_dict(self, destination, prefix, rank0_only, trainable_only)

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
        if assign is not False:
            raise InvalidArgumentError("assign", assign, "False (values are always copied into the chunks)")
        return plan_model_load(self, state_dict, strict).apply()
