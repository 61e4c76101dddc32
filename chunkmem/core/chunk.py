"""A chunk: one fixed-size flat buffer per state family, holding a run of whole parameters.

Every state family of a chunk (16-bit or fp32 ``param``, ``grad``, fp32 ``master``, ``exp_avg``,
``exp_avg_sq``) has the same length and layout, so a parameter's slot is one (chunk, offset, numel) for
all of them and the optimizer updates a chunk with one call over flat buffers.

The ``param`` family is special: parameters are views (``param.data``) into its device-tier buffer,
whose storage is freed (0 bytes) when the chunk is not resident and given memory again, in place,
when it is fetched. Views made by autograd during forward stay valid through such a round trip. When
the CPU holds both tiers, every family's memory comes from the model's
:class:`~chunkmem.core.block_pool.BlockPool`, else from torch's allocators (the storage is then resized).

States (:mod:`chunkmem.core.states`). Each copy of a chunk's memory has a :class:`~chunkmem.core.states.CopyState`,
changed only by the transitions of its :class:`~chunkmem.core.states.CopyLife`, which the class owning the
copy calls (:class:`ParamBuffer` for the device copy and the shard, :class:`FlatBuffer` for the others):

====================  ============  ==========  ========================================================
transition            from          to          when
====================  ============  ==========  ========================================================
``allocated``         FREED         STALE       memory given (device copy fetched, shard or grad made)
``fill_started``      STALE         FETCHING    a transfer into the copy issued (returns a handle)
``fill_finished``     FETCHING      CURRENT     the handle waited on: the copy may be used
``written``           STALE,        CURRENT     new contents written in place (the update, a gradient
                      CURRENT                   reduced into the shard, a checkpoint loaded)
``outdated``          CURRENT       STALE       the other copy was written (the device copy after an
                                                update of the shard, the shard after one on the device)
``freed``             STALE,        FREED       memory returned (a CURRENT device copy whose shard is
                      CURRENT                   not current is first written back to the shard)
====================  ============  ==========  ========================================================

A FETCHING copy is waited on before anything else happens to it. A chunk *rests* with one CURRENT
copy on its resting tier; it is *resident* while its device copy is CURRENT. What the parameter memory
holds is a second, smaller machine owned by :class:`ParamBuffer`: :class:`~chunkmem.core.states.Contents`
``VALUES`` -> ``GRADS`` when a backward with ``reuse_fp16_shard`` finishes the chunk's gradients in it,
``GRADS`` -> ``VALUES`` when the optimizer step (or a skipped step, or a checkpoint load) writes values.
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from ..distributed.collectives import SINGLE_PROCESS, ShardGroup
from ..distributed.gathers import FlatGather, GatherStarted, ParamGather, gather_joined, gather_whole
from .chunk_slots import ChunkSlots, ParamSlot
from .copy_engine import nothing_to_wait_for
from .disk_tier import DiskRegion
from .memory import TierMemory
from .states import ChunkStateError, Contents, CopyLife, CopyState
from .tiers import Tier, device_of_tier
from .transfer import Transfer

PARAM = "param"
GRAD = "grad"
GRAD_STAGING = "grad_staging"
MASTER = "master"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
OPTIM_FAMILIES = (MASTER, EXP_AVG, EXP_AVG_SQ)
ADAM_STATE = (EXP_AVG, EXP_AVG_SQ)
"""The per-element optimizer state a chunk keeps unless its optimizer says otherwise (Adam's moments)."""


@dataclass(frozen=True)
class ChunkKey:
    """What all parameters of one chunk share: whether they were trainable when the chunk was laid out
    (a frozen chunk has no gradient or optimizer state)."""

    trainable: bool


class ChunkHost(Protocol):
    """The runtime that owns a model's chunks, as the code that meets a chunk-managed parameter outside
    the runtime sees it: the parameter guard (:mod:`chunkmem.core.param_guard`), ``GatheredParameters``
    and the ``chunkmem.accessors`` functions. A runtime attaches itself to its chunks
    (:meth:`Chunk.attach_host`); a chunk without a host belongs to a model still being built."""

    @property
    def in_forward(self) -> bool:
        """Whether the model's forward is running."""

    @property
    def grads_pending(self) -> bool:
        """Whether a backward left gradients that no step or ``zero_grad`` consumed yet."""

    steady: bool
    """Whether the running iteration follows its schedule with every chunk resident on the device throughout
    (its modules' calls fetch, hold and release nothing)."""

    @property
    def data_parallel(self) -> ShardGroup:
        """Every rank the model trains on (a chunk's own ``shards`` may be fewer: shard groups, or one
        process for a replicated chunk)."""

    def owns(self, chunk: "Chunk") -> bool:
        """Whether ``chunk`` is one of this model's chunks now."""

    def use_in_forward(self, param: nn.Parameter) -> None:
        """``param`` is used by the running module although that module does not hold its chunk."""

    def is_open(self, chunk: "Chunk", for_writing: bool) -> bool:
        """Whether a ``GatheredParameters`` block opened the chunk (for writing, if asked)."""

    def open_chunks(self, chunks: list["Chunk"], for_writing: bool) -> None:
        """Fetch the chunks for a ``GatheredParameters`` block and open them."""

    def close_chunks(self, chunks: list["Chunk"], for_writing: bool) -> None:
        """Close what :meth:`open_chunks` opened and release the chunks."""

    def write_params(self, chunk: "Chunk", local: torch.Tensor) -> None:
        """Make ``local`` (this rank's elements) the chunk's parameter values."""

    def check_no_step_in_flight(self, action: str) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` while updates that a backward started
        (``step_in_backward``) wait for ``optim.step()`` to keep or redo them: ``action`` (a write of parameters
        or optimizer state) would be overwritten or lost by that decision."""

    def grad_of(self, chunk: "Chunk") -> torch.Tensor | None:
        """This rank's shard of the chunk's finished gradient, or ``None``."""

    def gradient_released(self, chunk: "Chunk") -> bool:
        """Whether the chunk's finished gradient was freed by its update before the step (``step_in_backward``
        with ``atomic_step=False``): its parameters' ``.grad`` is ``None`` from then on."""

    def grad_multiplier(self, slot: "ParamSlot | None" = None) -> float:
        """What the next step multiplies the gradients by (unscaling and clipping; 1 without optimizer;
        for ``slot``, with the factor torch's in-place idioms gave its gradient)."""

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on the ``.grad`` stand-ins of this model's parameters (clip_grad_norm_ ...)."""

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        """Fetch ``param``'s chunk with ``module`` (a submodule of the model) from now on."""


class FlatBuffer:
    """One state family of one chunk: a flat buffer on one tier at a time, its memory from ``memory``.

    ``life`` is the buffer's :class:`~chunkmem.core.states.CopyLife` (read it; only this class's methods
    change it). ``region`` is where it lies in the disk tier's files when it rests there. ``device`` (``None``:
    the tier's own device) pins the buffer to one device (ZeRO-1/2's masters and state, beside the parameters):
    allocated and widened there, never moved to another tier.
    """

    def __init__(self, family: str, numel: int, dtype: torch.dtype, memory: TierMemory, owner: str,
                 rank: int = 0, index: int = 0, device: torch.device | None = None) -> None:
        self.family = family
        self.numel = numel
        self.dtype = dtype
        self.base_dtype = dtype  # what the buffer holds when next allocated (``widen`` changes ``dtype`` until freed)
        self.memory = memory
        self.owner = owner
        self.region = DiskRegion(family, index, numel, dtype, f"{owner}.{family}")
        self.tensor: torch.Tensor | None = None  # None while FREED or resting on the disk tier
        self.tier: Tier | None = None
        self.disk_slot = 0  # on the disk tier: which of the chunk's regions holds the current contents
        self.life = CopyLife(f"{owner}.{family}", rank)
        self.device = device

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer when allocated."""
        return self.numel * self.element_size

    @property
    def on_disk(self) -> bool:
        return self.tier is Tier.DISK

    def read(self) -> torch.Tensor:
        """The current contents: the buffer itself on the device or host (do not write into it), a new
        host tensor read from the disk tier's file otherwise."""
        self.life.check("be read", CopyState.CURRENT)
        return self.memory.disk.load(self.region, self.disk_slot) if self.on_disk else self.tensor

    def write(self, values: torch.Tensor) -> None:
        """Make ``values`` (``numel`` elements) the current contents, wherever the buffer rests (-> CURRENT).
        On the disk tier the current slot is overwritten in place (not part of an atomic step)."""
        self.life.check("be written", CopyState.CURRENT, CopyState.STALE)
        if self.on_disk:
            self.memory.disk.store(self.region, self.disk_slot, values.reshape(-1))
        else:
            self.before_host_write()
            self.tensor.copy_(values.reshape(-1))
        self.life.written()

    def before_host_write(self) -> None:
        """The host is about to write the buffer in place: wait for a copy still reading it (a fetch)."""
        self.host_write_wait()()

    def host_write_wait(self) -> Callable[[], None]:
        """:meth:`before_host_write` whose wait the caller runs later, on any thread (see
        :meth:`~chunkmem.core.copy_engine.CopyEngine.host_write_wait`)."""
        if self.tier is not Tier.HOST:
            return nothing_to_wait_for
        return self.memory.copies.host_write_wait(self.tensor, f"{self.family} write")

    def switch_disk_slot(self) -> None:
        """An atomic step wrote the new contents into the other slot and committed: it is current now."""
        self.life.check("switch its disk slot", CopyState.CURRENT)
        self.disk_slot = 1 - self.disk_slot

    @property
    def allocated(self) -> bool:
        return self.life.holds_memory

    @property
    def state(self) -> CopyState:
        return self.life.state

    def allocate(self, tier: Tier, zero: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Allocate the buffer on ``tier`` (FREED -> STALE; zero-filled and CURRENT if ``zero``), in ``dtype``
        (a wider one until freed, see :meth:`widen`; default the buffer's own); returns the tensor, or
        ``None`` on the disk tier (its region in the file; see :meth:`write`)."""
        self.life.check("allocate", CopyState.FREED)
        self.dtype = dtype or self.base_dtype
        self.tensor = self.memory.take(tier, self.family, self.numel, self.dtype, self.region.label, self.device)
        self.tier = tier
        if tier is Tier.DISK:
            self.disk_slot = 0
            self.life.allocated()
            if zero:
                self.memory.disk.store(self.region, self.disk_slot, None)
                self.life.written()
            return None
        self.life.allocated()
        if zero:
            self.tensor.zero_()
            self.life.written()
        return self.tensor

    def mark_written(self) -> None:
        """The buffer now holds the chunk's current contents of its family (-> CURRENT)."""
        self.life.written()

    def mark_outdated(self) -> None:
        """Another copy now holds the current contents (CURRENT -> STALE)."""
        self.life.outdated()

    def move_to(self, tier: Tier) -> None:
        """Copy the buffer into a new buffer on ``tier`` and free the old one (its state is kept)."""
        self.life.check("move to another tier", CopyState.CURRENT, CopyState.STALE)
        if tier is self.tier:
            return
        if self.device is not None:
            raise ValueError(f"internal error: {self.region.label} is kept on {self.device}, not moved between tiers")
        old, old_tier, old_slot = self.tensor, self.tier, self.disk_slot
        new = self.memory.take(tier, self.family, self.numel, self.dtype, self.region.label)
        try:
            if tier is Tier.DISK:
                self.memory.disk.store(self.region, 0, old)
            elif old_tier is Tier.DISK:
                self.memory.disk.read_all(self.region, old_slot, new)
            else:
                new.copy_(old)
        except BaseException:
            self.memory.give_back(tier, self.family, self.nbytes, new)
            raise
        if Tier.DISK not in (tier, old_tier):
            self.memory.ledger.count_move(tier, self.nbytes)
        self.tensor, self.tier = new, tier
        if tier is Tier.DISK:
            self.disk_slot = 0
        self.memory.give_back(old_tier, self.family, self.nbytes, old)

    def widen(self, dtype: torch.dtype) -> None:
        """Hold the contents in ``dtype`` (wider: fp32 for a 16-bit sum of gradients) from now on, on the same
        tier: a new buffer, the contents copied, the old one returned; until the buffer is freed."""
        self.life.check("be widened", CopyState.CURRENT, CopyState.STALE)
        if dtype == self.dtype or self.tier is Tier.DISK:
            return
        wide = self.memory.take(self.tier, self.family, self.numel, dtype, self.region.label, self.device)
        wide.copy_(self.tensor)
        self.memory.give_back(self.tier, self.family, self.nbytes, self.tensor)
        self.tensor, self.dtype = wide, dtype

    def free(self) -> None:
        """Return the buffer's memory (-> FREED); nothing to do when it has none."""
        if not self.life.holds_memory:
            return
        self.life.freed()
        old, tier, self.tensor, self.tier = self.tensor, self.tier, None, None
        self.memory.give_back(tier, self.family, self.nbytes, old)
        self.dtype = self.base_dtype


class ParamBuffer:
    """The ``param`` family of a chunk: a full device-tier copy that parameters view, and this rank's shard.

    ``device`` holds all ``numel`` elements (gathered from every rank's shard when the chunk is
    sharded); its storage is freed (0 bytes) when the chunk is not resident. ``shard`` holds this rank's
    ``shard_numel`` elements on the host tier, or on the device tier when the chunk is sharded and rests
    there (with one rank the shard is the whole chunk, and a chunk resting on the device keeps only its
    full copy). The two copies' states (``device_state``, ``shard_state``; see the module docstring)
    say which holds the current contents; ``device_valid`` / ``shard_valid`` are their CURRENT-ness.
    ``contents`` (``holds_grads``) says whether the memory holds values or, with ``reuse_fp16_shard``,
    gradients. When sharded, parameters change only through the shard, so the shard is always current
    and the full copy is either a gathered copy of it or stale. How it is gathered is ``gather``, a strategy
    of :mod:`chunkmem.distributed.gathers` the builder chooses once; the buffer is its
    :class:`~chunkmem.distributed.gathers.GatherSource` and keeps the copy states. ZeRO-1/2's working chunk is
    a third mode, :meth:`replicated_resident`: the full copy on every rank, never freed, its shard a view of it.
    """

    def __init__(self, numel: int, dtype: torch.dtype, memory: TierMemory, owner: str,
                 shards: ShardGroup = SINGLE_PROCESS, index: int = 0, device: torch.device | None = None) -> None:
        self.numel = numel
        self.dtype = dtype
        self.memory = memory
        self.owner = owner
        self.shards = shards
        self.shard_numel = numel // shards.world
        self.shard_offset = shards.rank * self.shard_numel
        self.nbytes = numel * dtype.itemsize
        self.device = torch.empty(numel, dtype=dtype, device=device or device_of_tier(Tier.DEVICE))
        self.device.untyped_storage().resize_(0)
        self.resident = False  # replicated-resident (:meth:`replicated_resident`): the device copy is never freed
        self._lent: torch.Tensor | None = None  # with a block pool: holds the 0 bytes while memory is lent
        self._device_life = CopyLife(f"{owner}.param device copy", shards.rank)
        self._transfer: Transfer | None = None
        self._contents = Contents.VALUES
        self.shard = FlatBuffer(PARAM, self.shard_numel, dtype, memory, owner, shards.rank, index)
        # how the device copy is gathered (the builder's choice, distributed.gathers.gather_for); None with one
        # rank: the device copy is a copy of the shard
        self.gather: ParamGather | None = FlatGather(shards) if shards.sharded else None
        self._approximate = False  # the device copy came from a quantized gather

    @classmethod
    def replicated_resident(cls, numel: int, dtype: torch.dtype, memory: TierMemory, owner: str, shards: ShardGroup,
                            device: torch.device, index: int = 0) -> "ParamBuffer":
        """ZeRO-1/2's working chunk: all ``numel`` elements on ``device`` (the parameters' own device, which may be
        the CPU on a CUDA machine) on every rank, allocated here zero-filled, CURRENT and never freed. This rank's
        shard is a view of it (:meth:`local`), with no memory of its own, so the ledger counts the chunk once
        (``numel`` elements, on the device tier). Nothing gathers it: its owner writes every rank's updated part
        into it in place."""
        buffer = cls(numel, dtype, memory, owner, shards, index, device)
        buffer.gather = None
        buffer.resident = True
        buffer.allocate_device()
        buffer.device.zero_()
        buffer._device_life.written()
        return buffer

    # ---- state (read-only views of the two machines) --------------------------------------------------

    @property
    def device_state(self) -> CopyState:
        return self._device_life.state

    @property
    def shard_state(self) -> CopyState:
        return self.shard.life.state

    @property
    def contents(self) -> Contents:
        return self._contents

    @property
    def device_valid(self) -> bool:
        """Whether the full device copy is allocated and holds the current contents."""
        return self._device_life.current

    @property
    def shard_valid(self) -> bool:
        """Whether the shard holds the current contents."""
        return self.shard.life.current

    @property
    def holds_grads(self) -> bool:
        """Whether the parameter memory holds gradients (``reuse_fp16_shard``), not values."""
        return self._contents is Contents.GRADS

    @property
    def sharded(self) -> bool:
        return self.shards.sharded

    @property
    def device_allocated(self) -> bool:
        return self._device_life.holds_memory

    @property
    def fetching(self) -> bool:
        """Whether a transfer into the device copy is in flight (wait it with :meth:`wait`)."""
        return self._device_life.state is CopyState.FETCHING

    def own_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a full-length flat tensor."""
        return full[self.shard_offset:self.shard_offset + self.shard_numel]

    # ---- the device copy -----------------------------------------------------------------------------

    def allocate_device(self) -> None:
        """Give the device copy its memory back (FREED -> STALE, contents undefined until written)."""
        if self._device_life.holds_memory:
            return
        self._lent = self.memory.fill_storage(self.device.untyped_storage(), PARAM, self.nbytes,
                                              f"{self.owner}.{PARAM}")
        self._device_life.allocated()

    def storage_users(self) -> int:
        """How many tensors view the device copy's memory (this buffer's and its parameters' among them)."""
        return torch._C._storage_Use_Count(self.device.untyped_storage()._cdata)

    def leave_device_memory_to_viewers(self) -> torch.Tensor:
        """Tensors outside chunkmem view the device copy (kept from a ``GatheredParameters`` block): leave
        them its memory for good, and continue with a new device copy holding the same values (returned:
        the chunk points its parameters at it). Freeing the device copy later then cannot take memory from
        under them; the memory they keep is theirs, off the ledger, freed by torch with the last of them."""
        self.wait()
        fresh = torch.empty(self.numel, dtype=self.dtype, device=self.device.device)
        fresh.untyped_storage().resize_(0)
        lent = self.memory.fill_storage(fresh.untyped_storage(), PARAM, self.nbytes, f"{self.owner}.{PARAM}")
        fresh.copy_(self.device)
        self.memory.ledger.release(Tier.DEVICE, PARAM, self.nbytes)  # the old memory is the viewers' now
        self.device, self._lent = fresh, lent
        return fresh

    @property
    def approximate(self) -> bool:
        """Whether the device copy holds dequantized values of a quantized gather (for compute only)."""
        return self._approximate and self._device_life.holds_memory

    def start_fetch(self, exact: bool = True) -> Transfer:
        """Issue the transfer that makes the device copy current (-> FETCHING): a copy of the shard (read on
        the disk tier's fetch thread when it rests there), or when sharded the chunk's gather (collectives
        started asynchronously: a prefetched gather runs while the current period computes). :meth:`wait`
        before use. ``exact=False`` (a fetch for compute) lets the gather give dequantized values of a
        quantized gather (:attr:`approximate`) or gather from hpZ's secondary partition."""
        self._device_life.check("be fetched", CopyState.FREED, CopyState.STALE)
        self.shard.life.check("be fetched from", CopyState.CURRENT)
        self.allocate_device()
        self._device_life.fill_started()
        self._approximate = False
        if self.gather is not None:
            started = self.gather.start(self.device, self, exact)
            self._approximate = started.approximate
            transfer = Transfer(lambda: self._gathered(started))
        elif self.shard.on_disk:  # read on the disk tier's fetch thread: overlaps compute when prefetched
            read = self.start_shard_read(self.device)
            transfer = Transfer(lambda: self._read_and_fetched(read))
        else:
            transfer = self.memory.copies.to_device(self.device, self.shard.tensor, self._fetched)
        if self.shard.tier is Tier.HOST:
            self.memory.ledger.count_move(Tier.DEVICE, self.shard.nbytes)
        self._transfer = transfer
        return transfer

    # ---- what a gather reads (:class:`~chunkmem.distributed.gathers.GatherSource`) -------------------

    @property
    def shard_on_disk(self) -> bool:
        return self.shard.on_disk

    def read_shard(self) -> torch.Tensor:
        return self.shard.read()

    def start_shard_read(self, out: torch.Tensor) -> Callable[[], None]:
        """Start reading the shard from the disk tier into ``out``; the returned call waits for the read. A
        failed read leaves the device copy freed and raises the :class:`~chunkmem.DiskIOError` naming the
        file and the chunk."""
        reading = self.memory.disk.start_read_all(self.shard.region, self.shard.disk_slot, out)

        def wait_for_read() -> None:
            try:
                reading.result()
            except BaseException:
                self._fetched()
                self._device_life.outdated()
                self._drop_device()
                raise
        return wait_for_read

    SECONDARY = "param_secondary"
    """The ledger family of hpZ's secondary partitions (device tier)."""

    def reserve_secondary(self, nbytes: int) -> None:
        self.memory.ledger.reserve(Tier.DEVICE, self.SECONDARY, nbytes, f"{self.owner}.secondary")

    def release_secondary(self, nbytes: int) -> None:
        self.memory.ledger.release(Tier.DEVICE, self.SECONDARY, nbytes)

    # ---- the secondary partition (hpZ) ---------------------------------------------------------------

    def keep_secondary(self) -> None:
        """A forward computed with the current device copy and a backward follows: keep what the chunk's
        gather reads in the backward (hpZ's part of the secondary partition)."""
        if self.gather is not None and self._device_life.current:
            self.gather.keep_for_backward(self.device, self, self._approximate)

    def drop_secondary(self) -> None:
        """Forget what :meth:`keep_secondary` kept (the backward used it, or the values changed)."""
        if self.gather is not None:
            self.gather.drop_kept(self)

    def _fetched(self) -> None:
        self._transfer = None
        self._device_life.fill_finished()

    def _gathered(self, started: GatherStarted) -> None:
        started.complete()
        self._fetched()

    def _read_and_fetched(self, read: Callable[[], None]) -> None:
        read()
        self._fetched()

    def filled_together(self) -> None:
        """The device copy was written by a gather of several chunks at once (:func:`gather_together`)."""
        self.allocate_device()
        self._device_life.fill_started()
        self._transfer = Transfer(self._fetched)

    def wait(self) -> None:
        """Wait for the transfer into the device copy, if one is in flight (FETCHING -> CURRENT)."""
        if self._transfer is not None:
            self._transfer.wait()

    def fetch_to_device(self) -> None:
        """Make the full device copy current (fetching it if needed) and wait for it."""
        if self._device_life.state is CopyState.CURRENT:
            return
        if self._device_life.state is not CopyState.FETCHING:
            self.start_fetch()
        self.wait()

    def mark_device_written(self) -> None:
        """The device copy holds new contents written in place; a held shard is now out of date."""
        self._device_life.written()
        if self.shard.life.current:
            self.shard.mark_outdated()

    def free_device(self) -> None:
        """Free the device copy, first copying it to the shard if the shard is not current."""
        if not self._device_life.holds_memory:
            return
        self.wait()
        if self._device_life.current and not self.shard.life.current:
            self.write_back_shard()
        self._drop_device()

    def drop_device_copy(self) -> None:
        """Free the device copy without writing it back: the shard is current (its contents are what
        the device copy held before a backward part-overwrote it with gradients)."""
        self.shard.life.check("stand for the dropped device copy", CopyState.CURRENT)
        if self._device_life.holds_memory:
            self._drop_device()

    def _drop_device(self) -> None:
        """Free the device copy's memory whatever it holds (-> FREED)."""
        if self.resident:
            raise ChunkStateError(f"{self.owner}.param device copy", "be freed (replicated-resident: the working "
                                  "chunk stays whole on every rank)", self.device_state, (), self.shards.rank)
        self.wait()
        self.memory.empty_storage(self.device.untyped_storage(), PARAM, self.nbytes, self._lent)
        self._lent = None
        self._device_life.freed()

    # ---- the shard -----------------------------------------------------------------------------------

    def write_back_shard(self) -> None:
        """Copy this rank's part of the current device copy into the shard (allocated on the host if
        missing) and mark the shard current."""
        self._device_life.check("be written back", CopyState.CURRENT)
        if self.approximate:
            raise ChunkStateError(f"{self.owner}.param device copy", "be written back (it holds dequantized "
                                  "values of a quantized gather)", self.device_state, (), self.shards.rank)
        if not self.shard.allocated:
            self.shard.allocate(Tier.HOST)
        self.shard.write(self.own_slice(self.device))
        if self.shard.tier is Tier.HOST:
            self.memory.ledger.count_move(Tier.HOST, self.shard.nbytes)

    def free_shard(self) -> None:
        """Free the shard, first making the device copy current if the shard is the only current copy
        (one rank only: a sharded chunk always keeps its shard)."""
        if not self.shard.allocated:
            return
        if self.sharded:
            raise ChunkStateError(f"{self.owner}.param shard", "be freed (a sharded chunk keeps its shard)",
                                  self.shard_state, (), self.shards.rank)
        if self.shard.life.current and not self._device_life.current:
            self.fetch_to_device()
        self.shard.free()

    def first_copy(self, tier: Tier) -> torch.Tensor:
        """Allocate the chunk's first parameter copy on ``tier`` and return it, CURRENT (the caller writes
        the values at once): the shard, or with one rank on the device tier the device copy."""
        if tier is Tier.DEVICE and not self.sharded:
            self.allocate_device()
            self._device_life.written()
            return self.device
        self.shard.allocate(tier)
        self.shard.mark_written()
        return self.shard.tensor

    # ---- values and gradients ------------------------------------------------------------------------

    def load_values(self, local: torch.Tensor) -> None:
        """Make ``local`` (this rank's elements) the values: written into the shard (allocated on the
        host if missing), the device copy dropped."""
        if not self.shard.allocated:
            self.shard.allocate(Tier.HOST)
        self.shard.write(local)
        self._contents = Contents.VALUES
        if self._device_life.holds_memory:
            self._drop_device()

    def grads_in_device_copy(self) -> None:
        """One rank, ``reuse_fp16_shard``: the device copy now holds the finished gradients (VALUES ->
        GRADS); a held shard is out of date."""
        self._take_grads()
        self.mark_device_written()

    def grads_in_shard(self, reduced: torch.Tensor) -> None:
        """Sharded, ``reuse_fp16_shard``: ``reduced`` (this rank's shard of the reduced gradients) is
        written into the shard (VALUES -> GRADS); the gathered device copy is out of date."""
        self._take_grads()
        self.shard.before_host_write()
        self.shard.tensor.copy_(reduced)
        self.shard.mark_written()
        if self._device_life.current:
            self._device_life.outdated()

    def _take_grads(self) -> None:
        if self._contents is not Contents.VALUES:
            raise ChunkStateError(f"{self.owner}.param memory", "take gradients", self._contents,
                                  (Contents.VALUES,), self.shards.rank)
        self._contents = Contents.GRADS

    def updated_on(self, tier: Tier, keep_device_copy: bool) -> None:
        """The optimizer wrote new values into the copy on ``tier`` (the shard when sharded): it becomes
        the current copy (contents VALUES); the other is freed, or with ``keep_device_copy`` (sharded)
        kept, out of date."""
        self._contents = Contents.VALUES
        if self.sharded or tier in (Tier.HOST, Tier.DISK):
            self.shard.mark_written()
            if self._device_life.current:
                self._device_life.outdated()
            if self._device_life.holds_memory and not (self.sharded and keep_device_copy):
                self._drop_device()
        else:
            self._device_life.written()
            self.shard.free()

    def free_all(self) -> None:
        """Free both copies (the chunk is no longer used)."""
        if self._device_life.holds_memory:
            self._drop_device()
        self.shard.free()

    def current(self) -> torch.Tensor:
        """A full-length tensor holding the current contents (one rank only): the device copy if current,
        else the shard."""
        if self.sharded:
            raise ChunkStateError(f"{self.owner}.param", "be read whole without a gather (sharded)",
                                  self.shard_state, (), self.shards.rank)
        self.wait()
        if self._device_life.current:
            return self.device
        self.shard.life.check("be read (no copy of the parameters is current)", CopyState.CURRENT)
        return self.shard.read()

    def local(self) -> torch.Tensor:
        """This rank's ``shard_numel`` elements of the current contents (the whole chunk with one rank)."""
        if self.shard.life.current:
            return self.shard.read()
        self.wait()
        self._device_life.check("be read (no copy of the parameters is current)", CopyState.CURRENT)
        return self.own_slice(self.device)


def gather_together(buffers: list[ParamBuffer]) -> None:
    """Make the full device copies of several sharded chunks current with one all-gather (what
    :class:`~chunkmem.BucketTensorShardStrategy` does for the chunks of one module). Every rank sends its
    shards one after the other; a trimmed tail's shard is shorter than the others."""
    shards = buffers[0].shards
    by_rank = gather_joined(shards, [b.shard.tensor for b in buffers], buffers[0].device.device,
                            "parameters of " + ", ".join(b.owner for b in buffers))
    offset = 0
    for buf in buffers:
        buf.filled_together()
        buf.device.view(shards.world, buf.shard_numel).copy_(by_rank[:, offset:offset + buf.shard_numel])
        offset += buf.shard_numel
        if buf.shard.tier is Tier.HOST:
            buf.memory.ledger.count_move(Tier.DEVICE, buf.shard.nbytes)
        buf.wait()


class _Use(enum.Enum):
    UNUSED = "unused"
    USED = "used"


class Chunk(ChunkSlots):
    """A fixed number of elements (``numel``) holding whole parameters of one :class:`ChunkKey`; its slots, shard
    and per-parameter steps are :class:`~chunkmem.core.chunk_slots.ChunkSlots`'."""

    def __init__(self, index: int, numel: int, dtype: torch.dtype, key: ChunkKey, memory: TierMemory,
                 shards: ShardGroup = SINGLE_PROCESS) -> None:
        if numel % shards.world:
            raise ValueError(f"chunk of {numel} elements cannot be split into {shards.world} equal shards")
        super().__init__()
        self.index = index
        self.numel = numel
        self.shards = shards
        self.dtype = dtype
        self.key = key
        self.memory = memory
        self.name = f"chunk{index}"
        self.used_numel = 0
        self.size_was_given = False
        self.built_with: list["Chunk"] = [self]  # the chunks built together with this one
        self._host: weakref.ref | None = None
        self.param = ParamBuffer(numel, dtype, memory, self.name, shards, index)
        # Finished gradients and optimizer state are per shard; the staging buffer the backward writes
        # into is full-length (reduce-scattered into ``grad`` when sharded).
        self.grad = FlatBuffer(GRAD, self.shard_numel, dtype, memory, self.name, shards.rank, index)
        self.grad_staging = FlatBuffer(GRAD_STAGING, numel, dtype, memory, self.name, shards.rank, index)
        self.optim: dict[str, FlatBuffer] = {
            family: FlatBuffer(family, self.shard_numel, torch.float32, memory, self.name, shards.rank, index)
            for family in OPTIM_FAMILIES}
        self.state_families: tuple[str, ...] = ADAM_STATE  # per-element optimizer state (see use_state_families)
        # state families that stay in host memory when the chunk's optimizer state rests on disk: small ones not
        # indexed by element (the 8-bit Adams' block scales), which the streamed step does not read in pieces
        self.in_memory_families: tuple[str, ...] = ()
        self._buffer_sizes = {self.param.nbytes, *(b.nbytes for b in self.flat_buffers())}  # bytes
        if memory.blocks is not None:
            memory.blocks.use_sizes(self._buffer_sizes)
        # Per-backward bookkeeping, reset by the manager.
        self.grad_slots_received: set[int] = set()
        self.grads_expected = 0  # trainable slots when this backward's first gradient came
        self.grads_finished = False
        self.accumulator_fresh = False
        self._users = 0  # modules computing with the chunk now
        self._held = False  # kept on the device until its gradients of this backward are finished
        # persistent parameters (ShardedModelV2's persistence_threshold): the chunk is whole on every rank
        # of this group (its own ``shards`` are one process) and its gradients are all-reduced over it
        self.replicas: ShardGroup | None = None
        # a 16-bit chunk whose optimizer keeps no fp32 master: its parameters are their own masters (torchao's
        # 8-bit Adams with bf16_stochastic_round)
        self.masters_in_params = False

    def leave_device_memory_to_viewers(self) -> None:
        """See :meth:`ParamBuffer.leave_device_memory_to_viewers`; the parameters view the new device copy."""
        fresh = self.param.leave_device_memory_to_viewers()
        with torch._C.DisableTorchFunctionSubclass():
            for slot in self.slots:
                slot.param.data = slot.view(fresh)

    # ---- the owning runtime ---------------------------------------------------------------------------

    @property
    def host(self) -> ChunkHost | None:
        """The runtime that owns the chunk (held weakly), or ``None`` while its model is being built."""
        return None if self._host is None else self._host()

    def attach_host(self, host: ChunkHost | None) -> None:
        """Make ``host`` the chunk's owner (``None``: the chunk leaves its model)."""
        self._host = None if host is None else weakref.ref(host)

    # ---- use (changed only here) ---------------------------------------------------------------------

    @property
    def users(self) -> int:
        """Modules whose forward is computing with the chunk now."""
        return self._users

    @property
    def held_for_backward(self) -> bool:
        """Whether the backward keeps the chunk on the device until its gradients are finished."""
        return self._held

    @property
    def in_use(self) -> bool:
        return self._users > 0 or self._held

    def add_user(self) -> None:
        self._users += 1

    def remove_user(self) -> None:
        if self._users <= 0:
            raise ChunkStateError(f"{self.name} use count", "lose a user", _Use.UNUSED, (_Use.USED,),
                                  self.shards.rank)
        self._users -= 1

    def hold(self) -> None:
        self._held = True

    def unhold(self) -> None:
        self._held = False

    @property
    def trainable(self) -> bool:
        return self.key.trainable

    def use_state_families(self, names: tuple[str, ...]) -> None:
        """Keep ``names`` as the chunk's per-element optimizer state (fp32, this rank's shard each) instead
        of Adam's moments: another optimizer's own (SGD's ``momentum_buffer``, ...). Buffers are made for
        new names, unallocated; call before the optimizer state is placed."""
        self.use_state_buffers({name: (self.shard_numel, torch.float32) for name in names})

    def use_state_buffers(self, buffers: dict[str, tuple[int, torch.dtype]]) -> None:
        """Keep ``buffers`` (name -> elements and dtype of this rank's buffer) as the chunk's optimizer state
        instead of Adam's fp32 moments: the 8-bit optimizers' codes, block scales and the fp32 moments of their
        small parameters (:mod:`chunkmem.optim.low_bit_rule`). Buffers are made unallocated; call before the
        optimizer state is placed."""
        for name, (numel, dtype) in buffers.items():
            kept = self.optim.get(name)
            if kept is None or kept.numel != numel or kept.dtype != dtype:
                self.optim[name] = FlatBuffer(name, numel, dtype, self.memory, self.name, self.shards.rank, self.index)
        self.state_families = tuple(buffers)
        sizes = {self.optim[name].nbytes for name in buffers} - self._buffer_sizes
        if sizes and self.memory.blocks is not None:
            self.memory.blocks.use_sizes(sizes)
        self._buffer_sizes |= sizes

    def flat_buffers(self) -> tuple[FlatBuffer, ...]:
        """Every family's buffer but the device copy of the parameters."""
        return (self.param.shard, self.grad, self.grad_staging, *self.optim.values())

    def free_all(self) -> None:
        """Free every buffer of a chunk that is no longer used (a re-pack replaced it); the block pool
        stops keeping blocks of its sizes unless another chunk has them."""
        self.param.free_all()
        for buf in self.flat_buffers():
            buf.free()
        if self.memory.blocks is not None:
            self.memory.blocks.stop_using_sizes(self._buffer_sizes)
            self._buffer_sizes = set()

    @property
    def shard_numel(self) -> int:
        """Elements of the chunk this rank keeps in every family (all of them with one rank)."""
        return self.param.shard_numel

    @property
    def shard_offset(self) -> int:
        """Where this rank's elements start in the chunk (elements)."""
        return self.param.shard_offset

    @property
    def has_master(self) -> bool:
        """Whether the fp32 master is a separate family (16-bit params) or the params themselves (fp32, or 16-bit
        parameters that are their own masters: :attr:`masters_in_params`)."""
        return self.trainable and self.dtype != torch.float32 and not self.masters_in_params

    @property
    def element_size(self) -> int:
        return self.param.nbytes // self.numel

    def fits(self, numel: int) -> bool:
        return self.used_numel + numel <= self.numel

    def add_slot(self, param: nn.Parameter, name: str) -> ParamSlot:
        slot = ParamSlot(param, name, self, self.used_numel, param.numel(), param.shape, len(self.slots))
        self.slots.append(slot)
        self.used_numel += slot.numel
        return slot

    def bind_views(self, flat: torch.Tensor, slots: list[ParamSlot] | None = None) -> None:
        """Point the ``.data`` of every parameter (or of those in ``slots``) at its slice of ``flat``. A
        view can only be cut from allocated storage, so storage freed to 0 bytes is given its size for
        the moment of cutting."""
        storage = flat.untyped_storage()
        freed = storage.nbytes() == 0
        if freed:
            storage.resize_(flat.numel() * flat.element_size())
        with torch._C.DisableTorchFunctionSubclass():  # chunkmem's own write, past the parameter guard
            for slot in self.slots if slots is None else slots:
                slot.param.data = slot.view(flat)
        if freed:
            storage.resize_(0)

    def trainable_slots(self) -> list[ParamSlot]:
        """The slots whose parameters require grad now (read past the parameter guard: this runs for
        every gradient of a backward)."""
        with torch._C.DisableTorchFunctionSubclass():
            return [s for s in self.slots if s.param.requires_grad]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """A new full-length tensor from every rank's ``local`` shard (a collective when sharded: every
        rank calls it for the same chunks in the same order)."""
        return gather_whole(self.shards, local, self.name)

    def __repr__(self) -> str:
        return (f"Chunk({self.index}, numel={self.numel}, used={self.used_numel}, dtype={self.dtype}, "
                f"key={self.key}, params={len(self.slots)})")
