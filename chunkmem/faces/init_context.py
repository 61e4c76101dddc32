"""ZeroInitContext: parameters created inside go straight into chunk storage in the training dtype."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from ..core.chunk import PARAM, Chunk, ChunkKey, ParamSlot
from ..core.disk_tier import DEFAULT_BUFFER_SIZE, DiskTier
from ..errors import ArgumentTypeError, InvalidArgumentError, check_type
from ..core.layout import ALIGN_ELEMENTS, aligned_numel
from ..core.memory import TierMemory
from ..core.param_guard import adopt, slot_of
from ..core.tiers import Tier, device_memory_capacity, device_of_tier, tier_of_device
from ..distributed.agreement import LayoutDescription, ParamRecord, agree
from ..distributed.collectives import SINGLE_PROCESS, ShardGroup
from ..distributed.shard_strategy import BaseShardStrategy
from ..io.pretrained import patched_from_pretrained
from ..runtime.sharded_init import ShardedParamWrites
from ..settings import check_chunk_size, check_dtype, check_param_dtypes

DEFAULT_INIT_CHUNK_BYTES = 64 * 2**20
INIT_DISK_BUFFERS = 2
MIN_INIT_CHUNK_ELEMENTS = ALIGN_ELEMENTS
"""The smallest ``chunk_size`` ZeroInitContext takes, in elements: chunks are laid out in whole groups of
this many elements, so a smaller size could not be kept as given."""


def check_device(argument: str, device: Any) -> None:
    """Raise :class:`ArgumentTypeError` unless ``device`` is a ``torch.device``, a str or a CUDA index."""
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise ArgumentTypeError(argument, device, "a torch.device, 'cpu', 'cuda' or a CUDA index")


class ZeroInitContext:
    """Build a model whose parameters go straight into chunks of ``dtype`` on ``target_device``.

    Each module's parameters are converted as soon as the module's ``__init__`` returns (so its own
    initialisation ran in fp32), which keeps at most one module's parameters in fp32 at a time. Later
    ``nn.init`` calls write into the chunk storage and work as usual (sharded over several ranks, see
    :mod:`chunkmem.runtime.sharded_init`: the same values as on one process). Floating-point buffers are cast to
    ``dtype`` and moved to ``target_device``. While it is open (and transformers was imported before),
    ``SomeModel.from_pretrained(directory)`` of a Hugging Face model class reads a local safetensors
    checkpoint straight into the chunks, one tensor at a time (:mod:`chunkmem.io.pretrained`).

    Args:
        target_device: where the chunks are created: a CUDA device (device tier) or the CPU (host tier),
            as a ``torch.device``, a str or a CUDA index (``None`` is refused: name the device).
        shard_strategy: a :class:`~chunkmem.BaseShardStrategy`.
        shard_param: keep only this rank's shard of each chunk from creation on, so no rank ever holds
            the whole model (the ranks of ``torch.distributed``'s default group; one rank: no effect).
            Every rank must build the same model with the same seed: each computes a module's initial
            values in full (one module at a time) and keeps its part.
        dtype: parameter storage and compute dtype: torch.float16, torch.bfloat16 or torch.float32.
            Parameters created inside must be of one of these dtypes too (others are refused, naming
            the parameter): an integer, float64 or complex value would be rounded into the chunk.
        chunk_size: bytes per chunk while building (a parameter larger than that gets a chunk of its
            own size); ``ShardedModelV2`` keeps it, or re-packs with the searched size if ``None``. A
            multiple of the element size of ``dtype`` and at least 64 elements (128 bytes for 16-bit,
            256 for fp32 chunks).
        model_numel_tensor: if given, a one-element tensor that receives the number of parameter
            elements created inside the context (a parameter later replaced, such as the original
            weight of a tied lm head, counts too), written when the context closes. Its dtype must hold
            the count exactly: an integer dtype (``torch.int64``; ``torch.int32`` as ColossalAI's
            examples use, up to 2**31 - 1) or ``torch.float64`` (exact up to 2**53). Other dtypes are
            refused here (fp16 would write ``inf`` above 65504, fp32 rounds above 2**24); a count larger
            than an integer dtype holds raises :class:`~chunkmem.InvalidArgumentError` when the context
            closes, leaving the tensor as it was.
        nvme_path: (an addition; DeepSpeed's ``zero.Init(remote_device="nvme")``) a directory: build onto
            the disk tier. Each chunk's parameters go to a file in a private scratch directory under it as
            soon as the next parameter does not fit in the chunk (the open chunks when the context
            closes), so host memory holds only the chunks being filled: a model larger than host memory
            can be built. Needs ``target_device`` ``"cpu"``; with ``shard_param`` each rank keeps its
            shards there. Parameters stay readable and writable as everywhere (a write outside a forward
            reads and rewrites its chunk's file region). ``ShardedModelV2`` then packs
            the parameters into its own chunks, one chunk at a time, on the disk tier with
            ``offload_param="disk"`` (else in host memory), and the context's files are removed.
    """

    def __init__(self, target_device: torch.device | str | int, shard_strategy: BaseShardStrategy,
                 shard_param: bool = False, dtype: torch.dtype = torch.float16, chunk_size: int | None = None,
                 model_numel_tensor: torch.Tensor | None = None,
                 nvme_path: str | os.PathLike | None = None) -> None:
        check_device("target_device", target_device)
        self.tier = tier_of_device(target_device, "target_device")
        if nvme_path is not None:
            check_type("nvme_path", nvme_path, (str, os.PathLike), "None or a directory (str or os.PathLike)")
            if self.tier is not Tier.HOST:
                raise InvalidArgumentError("target_device", target_device,
                                           "'cpu' with nvme_path (chunks are filled in host memory, then rest "
                                           "on the disk tier)")
        check_type("shard_strategy", shard_strategy, BaseShardStrategy,
                   "an instance of TensorShardStrategy or BucketTensorShardStrategy")
        check_type("shard_param", shard_param, bool, "True or False")
        check_dtype("dtype", dtype)
        check_chunk_size(chunk_size, dtype, MIN_INIT_CHUNK_ELEMENTS)
        if model_numel_tensor is not None:
            check_type("model_numel_tensor", model_numel_tensor, torch.Tensor, "None or a one-element tensor")
            if model_numel_tensor.numel() != 1:
                raise InvalidArgumentError("model_numel_tensor", model_numel_tensor, "None or a one-element tensor")
            if _largest_exact_count(model_numel_tensor.dtype) is None:
                raise InvalidArgumentError("model_numel_tensor", model_numel_tensor,
                                           "None or a one-element tensor of an integer dtype (torch.int64, "
                                           "torch.int32, ...) or torch.float64, which hold a parameter count "
                                           f"exactly, not {model_numel_tensor.dtype}")
        self.shard_strategy = shard_strategy
        self.shard_param = shard_param
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.model_numel_tensor = model_numel_tensor
        self.shards = ShardGroup.of(None) if shard_param else SINGLE_PROCESS
        element_size = dtype.itemsize
        self.chunk_numel = aligned_numel((chunk_size or DEFAULT_INIT_CHUNK_BYTES) // element_size, self.shards.world)
        self.memory = TierMemory.for_this_machine(device_memory_capacity())
        if nvme_path is not None:
            # Two I/O buffers: a full chunk is written while the next one fills (nothing else streams).
            self.memory.disk = DiskTier(nvme_path, INIT_DISK_BUFFERS, DEFAULT_BUFFER_SIZE, atomic_step=False,
                                        ledger=self.memory.ledger)
        self.chunks: list[Chunk] = []
        self._open: dict[ChunkKey, Chunk] = {}
        self._init_depth: dict[int, int] = {}
        self._patched: dict[type, Any] = {}
        self._numel = 0
        self._writes: ShardedParamWrites | None = None
        self._agreement: InitAgreement | None = None

    # ---- patching module constructors --------------------------------------------------------------

    def __enter__(self) -> "ZeroInitContext":
        for cls in _all_module_classes():
            self._wrap_init(cls)
        context = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(nn.Module, cls).__init_subclass__(**kwargs)
            context._wrap_init(cls)

        self._saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")
        nn.Module.__init_subclass__ = classmethod(init_subclass)
        if self.shards.sharded:
            self._agreement = InitAgreement(self)  # the ranks compare what they built before each gather
            self._writes = ShardedParamWrites(before_gather=self._agreement.before_gather)
            self._writes.__enter__()
        self._pretrained = patched_from_pretrained(self)  # Model.from_pretrained(path) loads into chunks
        self._pretrained.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._pretrained.__exit__(None, None, None)
        if self._writes is not None:
            self._writes.__exit__(*exc)
            self._writes = None
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched.clear()
        if self._saved_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._saved_init_subclass
        agreement, self._agreement = self._agreement, None
        if agreement is not None and exc[0] is None:
            agreement.at_exit()
        for chunk in self._open.values():
            self._park(chunk)
        self._open.clear()
        if self.memory.disk is not None:
            self.memory.disk.release_buffers()
        if self.model_numel_tensor is not None:
            self._write_numel(self.model_numel_tensor, raising=exc[0] is None)

    def _write_numel(self, target: torch.Tensor, raising: bool) -> None:
        """Write the count into ``target``, or (``raising``) refuse a count its dtype cannot hold exactly."""
        largest = _largest_exact_count(target.dtype)
        if largest is not None and self._numel <= largest:
            target.fill_(self._numel)
        elif raising:
            raise InvalidArgumentError("model_numel_tensor", target,
                                       f"a dtype that holds the {self._numel} parameter elements created, not "
                                       f"{target.dtype} (at most {largest}): torch.int64 or torch.float64; the "
                                       f"tensor was left as it was")

    def _wrap_init(self, cls: type) -> None:
        if "__init__" not in cls.__dict__ or cls in self._patched:
            return
        original = cls.__dict__["__init__"]
        context = self

        def init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            context._init_depth[key] = context._init_depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                context._init_depth[key] -= 1
            if context._init_depth[key] == 0:
                del context._init_depth[key]
                context._convert(module)

        init.__wrapped__ = original  # type: ignore[attr-defined]
        self._patched[cls] = original
        cls.__init__ = init

    # ---- moving a finished module into chunks ------------------------------------------------------

    def _convert(self, module: nn.Module) -> None:
        own = list(module.named_parameters(recurse=False))
        check_param_dtypes(((f"{type(module).__name__}.{name}", p) for name, p in own), "ZeroInitContext: module")
        for name, param in own:
            if slot_of(param) is None:
                self._add_param(f"{type(module).__name__}.{name}", param)
        device = device_of_tier(self.tier)
        for name, buf in list(module.named_buffers(recurse=False)):
            dtype = self.dtype if buf.is_floating_point() else buf.dtype
            setattr(module, name, buf.to(device=device, dtype=dtype))

    def _add_param(self, name: str, param: nn.Parameter) -> None:
        key = ChunkKey(param.requires_grad)
        chunk = self._open.get(key)
        if chunk is None or not chunk.fits(param.numel()):
            if chunk is not None:
                self._park(chunk)
            numel = max(self.chunk_numel, aligned_numel(param.numel(), self.shards.world))
            if self.memory.disk is not None:  # its file region first: a full disk is refused here
                self.memory.disk.add_region(PARAM, numel // self.shards.world * self.dtype.itemsize)
            chunk = Chunk(len(self.chunks), numel, self.dtype, key, self.memory, self.shards)
            chunk.size_was_given = self.chunk_size is not None and numel == self.chunk_numel
            chunk.built_with = self.chunks
            chunk.param.first_copy(self.tier).zero_()
            self.chunks.append(chunk)
            self._open[key] = chunk
        local = chunk.param.shard.tensor if chunk.param.shard_valid else chunk.param.device
        slot = chunk.add_slot(param, name)
        with torch.no_grad():
            chunk.write_own_part(slot, local, param.data)
        chunk.bind_views(chunk.param.device if chunk.param.sharded else local, [slot])
        adopt(param, slot)
        self._numel += slot.numel

    def _park(self, chunk: Chunk) -> None:
        """A chunk the next parameter does not fit in (or an open one when the context closes) goes to the
        disk tier, if building onto it."""
        if self.memory.disk is None or chunk.param.shard.on_disk:
            return
        chunk.param.shard.move_to(Tier.DISK)
        chunk.bind_views(chunk.param.device)


def _largest_exact_count(dtype: torch.dtype) -> int | None:
    """The largest count a tensor of ``dtype`` holds exactly (every smaller one too), or ``None`` for a dtype
    that is no counter (bool, complex, floating point below 64 bits)."""
    if dtype == torch.float64:
        return 2**53
    if dtype == torch.bool or dtype.is_complex or dtype.is_floating_point:
        return None
    return torch.iinfo(dtype).max


def _all_module_classes() -> list[type]:
    seen: list[type] = []
    todo = [nn.Module]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


class InitAgreement:
    """The agreements of a sharded :class:`~chunkmem.ZeroInitContext`: :meth:`before_gather` (called
    before each gather its parameter writes run) and :meth:`at_exit`. Each compares the context's
    settings and every parameter created so far; the record of parameters grows as the model does."""

    def __init__(self, context: ZeroInitContext) -> None:
        self.context = context
        self.params = ParamRecord()
        self._recorded: dict[int, int] = {}  # chunk index -> slots recorded

    def before_gather(self, slot: ParamSlot) -> None:
        """Agree before gathering ``slot``'s chunk (what is gathered is part of the step compared)."""
        self._agree(f"ZeroInitContext: gather of {slot.chunk.name} for parameter {slot.name!r}")

    def at_exit(self) -> None:
        """Agree when the context closes (not when it closes with an exception)."""
        self._agree("ZeroInitContext: exit")

    def _agree(self, step: str) -> None:
        context = self.context
        for chunk in context.chunks:  # only the slots added since the last agreement
            for slot in chunk.slots[self._recorded.get(chunk.index, 0):]:
                self.params.add(slot.name, slot.shape, chunk.key.trainable)
            self._recorded[chunk.index] = len(chunk.slots)
        settings = [
            ("world size", str(context.shards.world)),
            ("dtype", str(context.dtype)),
            ("chunk size", f"{context.chunk_numel} elements"),
            ("shard strategy", type(context.shard_strategy).__name__),
            ("chunks", ", ".join(str(c.numel) for c in context.chunks) + " elements"),
        ]
        agree(context.shards, LayoutDescription(step, settings, self.params))
