"""The runtime of one wrapped model: the one owner of every edge of a training step.

Everything that happens to a model's chunks during a step enters here, each edge through one method:

==========================  =======================================  =====================================
edge                        called by                                what it does
==========================  =======================================  =====================================
:meth:`begin_iteration`     ``ShardedModelV2.forward``               sharded: the ranks agree; recover an
                                                                     interrupted iteration; the scheduler
                                                                     decides trace or follow
:meth:`abandon_iteration`   ``ShardedModelV2.forward`` and the       release what a raising forward or
                            optimizer's backward, when they raise    backward held; leave the trace
:meth:`pre_forward`         a module's forward pre-hook              the period's orders, then fetch
:meth:`use_in_forward`      the parameter guard                      fetch a chunk used from elsewhere
:meth:`post_forward`        a module's forward hook                  release the module's chunks
:meth:`pre_backward`        the gradient hook of a module's output   the period's orders, then hold
:meth:`gradient_ready`      a parameter's post-accumulate hook       the gradient into its chunk
:meth:`post_backward`       autograd's end-of-backward callback      finish every chunk, plan the schedule
:meth:`backward_returned`   the optimizer's ``backward``             close finished traces
:meth:`begin_step` /        the optimizer's ``step``                 close traces; the ranks agree; settle;
:meth:`end_step`                                                     release the gradients the step consumed
==========================  =======================================  =====================================

The scheduler (:mod:`chunkmem.runtime.schedule`) decides and returns orders; the executor
(:mod:`chunkmem.runtime.executor`) moves; the gradient strategy (:mod:`chunkmem.runtime.gradients`) takes
gradients in; the runtime passes between them and runs the collectives no edge can do without: the
agreement on the traced peaks that planning needs, and the ranks' agreement on the point of training
(:meth:`agree`) that opens every sharded forward and step. One rule keeps chunkmem's own memory out of the traced non-model
memory: every entry point runs with the tracer paused (:func:`_untraced`).

The optimizer is told of each chunk whose gradients are final through a declared listener
(:class:`OptimizerListener`, attached with :meth:`attach_optimizer`), and updates a chunk through
:meth:`updating`. Code outside the step that meets a chunk-managed parameter (the parameter guard,
``GatheredParameters``, the accessors) sees the runtime as the chunk's
:class:`~chunkmem.core.chunk.ChunkHost`.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter, deque
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves

from ..core.chunk import MASTER, Chunk, ParamSlot
from ..errors import GradientAccumulationError, InvalidArgumentError, UnsupportedOperationError
from ..core.memory import TierMemory
from ..core.param_guard import ParameterAccessError, remembered_externals, slot_of
from ..core.tiers import Tier, device_of_tier
from ..distributed.agreement import agree_on_point
from ..distributed.collectives import CollectiveError, ShardGroup
from ..distributed.reduction import GradientReduction
from .capacity import CapacityCheck
from .executor import ChunkExecutor
from .gradients import gradient_store
from .hooks import ModelHooks
from .placement import PlacementPolicy, PlacementState
from .schedule import MoveInputs, Scheduler


class OptimizerListener(Protocol):
    """What the runtime tells the optimizer attached to its model, and asks of it."""

    def on_grads_final(self, chunk: Chunk) -> None:
        """``chunk``'s gradients of this backward are reduced and rest where its update runs (outside
        ``no_sync``)."""

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        """What the next step multiplies the gradients by (unscaling and clipping; for ``slot``, with the
        factor torch's in-place idioms gave its gradient)."""

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on ``.grad`` stand-ins of the model's parameters (:mod:`chunkmem.optim.gradient_idioms`)."""

    def on_backward_failed(self) -> None:
        """A backward raised part-way: drop every pending gradient and undo what the backward started."""

    def on_backward_end(self) -> None:
        """The backward is over: finish the updates it started off autograd's thread (raising what failed)."""


def _untraced(method: Callable) -> Callable:
    """The one tracer rule: chunkmem's own allocations are not the model's non-model memory, so every
    entry point of the runtime runs with the tracer paused (what a traced period counts is what the
    model's own code allocates between the runtime's edges)."""
    @functools.wraps(method)
    def run(self: "ChunkRuntime", *args: Any, **kwargs: Any) -> Any:
        if self.scheduler.trace is None:
            return method(self, *args, **kwargs)
        with self.scheduler.paused():
            return method(self, *args, **kwargs)
    return run


class _Running:
    """One module call in progress: the module and the chunks it holds."""

    __slots__ = ("module", "chunks")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.chunks: list[Chunk] = []


class ChunkRuntime:
    """The runtime of one model (see the module docstring). Built by the model's builder; read-only
    attributes for inspection: ``chunks``, ``memory`` (``ledger``), ``policy``, ``state`` (the
    :class:`~chunkmem.runtime.placement.PlacementState`), ``scheduler``, ``executor``, ``reduction``,
    ``gradients`` (the strategy), ``backward_count``, ``grads_pending``.
    """

    def __init__(self, root: nn.Module, chunks: list[Chunk], memory: TierMemory, policy: PlacementPolicy,
                 gradients_in_param_memory: bool, reduction: GradientReduction, gather_together: bool,
                 check_capacity: CapacityCheck, data_parallel: ShardGroup, reductions_in_flight: int = 0,
                 accumulate_in_fp32: bool = True) -> None:
        self.root = root
        self._check_capacity = check_capacity
        self.policy = policy
        self.state = PlacementState()
        self.executor = ChunkExecutor(chunks, memory, policy, self.state, gather_together)
        self.scheduler = Scheduler(memory.ledger, policy, self.state, device_of_tier(Tier.DEVICE))
        self.reduction = reduction
        self.data_parallel = data_parallel  # every rank of the model (agreement and planning collectives)
        self.gradients = gradient_store(gradients_in_param_memory, self.executor, reduction, self.scheduler.adopt,
                                        accumulate_in_fp32)
        self.grads_pending = False
        self.reductions_in_flight = reductions_in_flight  # the bound (see ShardedModelV2's argument)
        self._reducing: deque[Chunk] = deque()  # chunks whose gradient reductions run, oldest first
        self._final_order: dict[Chunk, None] = {}  # chunks whose gradients became final since they were dropped
        self.backward_count = 0  # backward passes finished (autograd's end of backward) so far
        self.forward_count = 0  # forwards of the wrapped model begun so far
        self.step_count = 0  # optimizer steps begun so far (skipped ones too)
        self.group_failed: CollectiveError | None = None  # the collective error that ended an iteration
        self._no_sync = False
        self._listener: weakref.ref | None = None
        self._stack: list[_Running] = []
        self._end_of_backward_queued = False
        self._backward_began = False  # a backward of this iteration reached the model (cleared at its end)
        self._open_for_reading: Counter[Chunk] = Counter()
        self._open_for_writing: Counter[Chunk] = Counter()
        # Frozen chunks held for backward: how many module calls whose backward runs use each, and those a
        # call without a FrozenBackward tracker uses (kept to the end of the backward).
        self._frozen_users: Counter[Chunk] = Counter()
        self._frozen_kept: set[Chunk] = set()
        self.module_names = {module: name or type(module).__name__ for name, module in root.named_modules()}
        self.module_chunks: dict[nn.Module, list[Chunk]] = {}
        self._foreign: dict[nn.Module, list[nn.Parameter]] = {}
        self.hooks = ModelHooks(self)
        for module in root.modules():
            owns = any(slot_of(p) is not None for p in module.parameters(recurse=False))
            external = remembered_externals(module)
            if owns or external or module is root:
                self._hook(module)
            for param in external:
                self._add_foreign(module, param)
        self.hooks.watch_gradients(p for p in root.parameters() if p.requires_grad and slot_of(p) is not None)
        for chunk in chunks:
            chunk.attach_host(self)

    # ---- inspection --------------------------------------------------------------------------------

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks, in packing order."""
        return self.executor.chunks

    @property
    def memory(self) -> TierMemory:
        return self.executor.memory

    @property
    def ledger(self) -> Any:
        """The byte counts of the chunks' memory (:class:`~chunkmem.core.ledger.TierLedger`)."""
        return self.executor.memory.ledger

    def trainable_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.trainable]

    def trainable_chunks_as_gradients_landed(self) -> list[Chunk]:
        """The trainable chunks in the order their gradients became final in the backward (the last
        layers first), then those whose gradients did not (no backward reached them, or ``no_sync``
        deferred them), in packing order. A step that updates in this order starts on the gradients that
        reached the host first, while the GPU still computes those of the first layers; updating in
        packing order would first wait for the whole backward."""
        trainable = self.trainable_chunks()
        present = set(trainable)
        return [c for c in self._final_order if c in present] + [c for c in trainable if c not in self._final_order]

    def rest_tier(self, chunk: Chunk) -> Tier | None:
        return self.executor.rest_tier(chunk)

    def compute_tier(self, chunk: Chunk) -> Tier:
        return self.executor.compute_tier(chunk)

    def optim_tier(self, chunk: Chunk) -> Tier:
        return self.executor.optim_tier(chunk)

    @property
    def in_forward(self) -> bool:
        """Whether the model's forward is running."""
        return bool(self._stack)

    @property
    def no_sync(self) -> bool:
        """Whether backward passes accumulate sharded gradients unreduced now (``model.no_sync()``)."""
        return self._no_sync

    def owns(self, chunk: Chunk) -> bool:
        return chunk in self.executor.chunks

    # ---- the edges of a step -----------------------------------------------------------------------

    @_untraced
    def begin_iteration(self, inputs: Any, training: bool) -> None:
        """The wrapped model's forward begins with ``inputs`` (its arguments, already cast)."""
        if self.group_failed is not None:
            failed = self.group_failed
            raise CollectiveError(f"a forward after a failed collective ({failed}): the process group is unusable; "
                                  f"end every rank and restart from a checkpoint", failed.collective, failed.what,
                                  failed.rank, failed.world) from failed
        if any(c.param.holds_grads for c in self.chunks):
            raise GradientAccumulationError(
                "forward called while gradients from the last backward are still in the parameters' memory "
                "(reuse_fp16_shard=True): call optim.step() or optim.zero_grad() first; gradient "
                "accumulation needs reuse_fp16_shard=False")
        while self._stack:  # a forward interrupted where its post hooks could not run (KeyboardInterrupt)
            self.executor.release(self._stack.pop().chunks)
        self._end_of_backward_queued = False  # autograd drops the callback of a backward that raised
        if self.scheduler.running:  # the last iteration stopped on an error: release what it held
            self._recover_interrupted()
        unfrozen = self._unfrozen_since_wrapping() if training and self.optimizer_attached else []
        self.agree("forward", "the model's forward", [("forwards so far", self.forward_count),
                                                      ("optimizer steps so far", self.step_count),
                                                      ("autograd on", training),
                                                      ("parameters unfrozen since wrapping", len(unfrozen))])
        self.refuse_unfrozen("the model's forward", unfrozen)
        self.forward_count += 1
        self._drop_secondaries()
        if self.scheduler.begin_iteration(_shapes_of(inputs), training):
            self.executor.evict_unpinned()

    @_untraced
    def pre_forward(self, module: nn.Module) -> None:
        running = _Running(module)
        self._stack.append(running)  # first: the post hook runs even if what follows raises
        chunks = list(self.module_chunks[module])
        if chunks:
            self._begin_period(module, "forward", chunks)
        self._acquire(chunks)
        running.chunks = chunks

    @_untraced
    def use_in_forward(self, param: nn.Parameter) -> None:
        """``param`` is used while the innermost running module does not hold its chunk: fetch it for that
        module now and from then on (a parameter of another module: a tied head, ``F.linear(x, w)``)."""
        running = self._stack[-1]
        chunk = slot_of(param).chunk
        if chunk in running.chunks:
            return
        self._check_capacity_with(running.module, param, "found in a forward")
        self._acquire([chunk])  # refuses a chunk whose memory holds gradients (reuse_fp16_shard)
        running.chunks.append(chunk)
        self._add_foreign(running.module, param)

    @_untraced
    def post_forward(self, module: nn.Module) -> bool:
        """The module's forward returned (or raised): release its chunks. Returns ``False`` when the call
        is not the running one (the stack was cleared by a later forward), so nothing is to be watched."""
        if not self._stack or self._stack[-1].module is not module:
            return False
        if torch.is_grad_enabled():  # hpZ: the backward gathers these inside the secondary group
            for chunk in self._stack[-1].chunks:
                chunk.param.keep_secondary()
        self.executor.release(self._stack.pop().chunks)
        if module is self.root and not torch.is_grad_enabled():
            self.executor.flush_stale()  # no backward will come to free what the forward left stale
        return True

    @_untraced
    def pre_backward(self, module: nn.Module, first: bool, tracked: bool = False) -> None:
        """A gradient of one of ``module``'s outputs arrived (``first``: the first of that forward call's
        outputs): the call's backward begins. ``tracked``: :meth:`frozen_backward_done` will say when it is
        over for the chunks without trainable parameters (else they stay until the end of the backward)."""
        self._backward_began = True
        if module is self.root and not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.post_backward)
        if not first:
            return
        chunks = self.module_chunks[module]
        if chunks:
            self._begin_period(module, "backward", chunks)
        self._hold_for_backward(chunks)
        for chunk in chunks:
            if not chunk.trainable:
                if tracked:
                    self._frozen_users[chunk] += 1
                else:
                    self._frozen_kept.add(chunk)

    def uses_frozen_chunks(self, module: nn.Module) -> bool:
        """Whether ``module``'s forward uses a chunk without trainable parameters."""
        return any(not c.trainable for c in self.module_chunks.get(module, ()))

    @_untraced
    def frozen_backward_done(self, module: nn.Module) -> None:
        """Every autograd node of one of ``module``'s forward calls ran: its frozen chunks may leave the
        device once no other call whose backward runs uses them (a frozen base bigger than the device)."""
        for chunk in self.module_chunks[module]:
            if chunk.trainable or self._frozen_users[chunk] == 0:
                continue
            self._frozen_users[chunk] -= 1
            if self._frozen_users[chunk] == 0 and chunk not in self._frozen_kept and chunk.held_for_backward:
                self.executor.release_backward_hold(chunk)

    @_untraced
    def gradient_ready(self, param: nn.Parameter) -> None:
        """Autograd accumulated ``param``'s gradient: take it into the chunk."""
        with DisableTorchFunctionSubclass():
            grad = param.grad
            param.grad = None
        slot = slot_of(param)
        chunk = slot.chunk
        self._backward_began = True
        if not chunk.grad_slots_received:
            self.scheduler.grads_started(chunk.index)
            chunk.grads_expected = len(chunk.trainable_slots())  # once a backward: every slot is read
        self._hold_where_gradients_land(chunk)
        self.gradients.accumulate(chunk, slot, grad)
        chunk.grad_slots_received.add(slot.index_in_chunk)
        chunk.slots_with_grads.add(slot.index_in_chunk)
        if len(chunk.grad_slots_received) == chunk.grads_expected:
            self._finish_grads(chunk)

    @_untraced
    def post_backward(self) -> None:
        """After autograd finished: finish every trainable chunk not finished yet (parameters that got no
        gradient get zero), release what the backward held, close the iteration, plan a new schedule."""
        self._end_of_backward_queued = False
        self._backward_began = False
        self.executor.cancel_prefetch()
        for chunk in self.chunks:
            if chunk.trainable and not chunk.grads_finished:
                self._finish_grads(chunk)
            elif chunk.held_for_backward:
                self.executor.release_backward_hold(chunk)
        self._complete_reductions(0)
        optimizer = self._optimizer()
        if optimizer is not None:  # before anything is freed, moved or planned
            optimizer.on_backward_end()
        self._drop_secondaries()
        self._frozen_users.clear()
        self._frozen_kept.clear()
        for chunk in self.chunks:
            chunk.grads_finished = False
        self.executor.flush_stale()
        self.backward_count += 1
        if self.scheduler.end_iteration():
            self._schedule_moves()
        self.memory.ledger.context = ""

    @_untraced
    def abandon_iteration(self, error: BaseException) -> None:
        """The model's forward, or the optimizer's backward, raised ``error``: release what the iteration
        held, drop its unfinished gradients and leave the tracer's dispatch mode now (not at the next
        forward), so no mode, hold or chunk outlives the exception; the next iteration is traced again.

        After a failed collective the process group is unusable and a chunk's gather may still be in
        flight in it: nothing is released (nothing can be), the tracer's mode is left, and the next
        forward raises a :class:`~chunkmem.CollectiveError` that names the first failure."""
        if isinstance(error, CollectiveError):
            self.group_failed = self.group_failed or error
        elif self.scheduler.running:
            self._recover_interrupted()
        if self.scheduler.running:
            self.scheduler.interrupt()
        self.scheduler.close_finished_traces()

    @_untraced
    def backward_returned(self) -> None:
        """The optimizer's backward returned: no backward is running, so finished traces can leave
        autograd's dispatch-mode stack."""
        self.scheduler.close_finished_traces()

    @_untraced
    def begin_step(self, where: str, fields: list[tuple[str, float]]) -> None:
        """The optimizer's step begins (``where`` names it): finished traces leave the dispatch-mode stack,
        and, sharded, the ranks check that they all are at this step with equal ``fields`` (the first
        collective of every step, see :meth:`agree`)."""
        if self._backward_began and self.scheduler.running:  # a bare loss.backward() raised, no forward since
            self._recover_interrupted()
            self.scheduler.interrupt()
        self.scheduler.close_finished_traces()
        self.agree("step", where, [("optimizer steps so far", self.step_count), *fields])
        self.step_count += 1

    def agree(self, point: str, where: str, fields: list[tuple[str, float]]) -> None:
        """Sharded: raise :class:`~chunkmem.StepMismatchError` on every rank unless all reached ``point``
        (:data:`~chunkmem.distributed.agreement.POINTS`) with equal ``fields`` (one small all-reduce; the
        first collective of every forward, ``clip_grad_norm`` and step, so ranks that skipped or repeated
        a call meet here and stop, instead of pairing mismatched collectives)."""
        agree_on_point(self.data_parallel, point, where, fields)

    @_untraced
    def end_step(self, release_gradients: bool) -> None:
        """The optimizer's step is over: free what it left stale on the device and, when it consumed the
        gradients (applied or skipped), release them."""
        self.executor.flush_stale()
        if release_gradients:
            self.drop_gradients(set_to_none=True)

    def _unfrozen_since_wrapping(self) -> list[str]:
        """Names of the parameters of chunks laid out frozen that require grad now."""
        with DisableTorchFunctionSubclass():  # read past the parameter guard
            return [slot.name for c in self.chunks if not c.trainable for slot in c.slots if slot.param.requires_grad]

    def refuse_unfrozen(self, where: str, unfrozen: list[str] | None = None) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` (``where`` names the call refused) if a parameter
        that was frozen when the model was wrapped requires grad now (``unfrozen``: their names, when already
        read): it sits in a chunk without gradient or optimizer state, so it cannot train, and leaving it alone
        silently is not what torch would do."""
        unfrozen = self._unfrozen_since_wrapping() if unfrozen is None else unfrozen
        if unfrozen:
            raise UnsupportedOperationError(
                f"{where}: parameter {unfrozen[0]!r}{f' and {len(unfrozen) - 1} more' if len(unfrozen) > 1 else ''} "
                f"requires grad now but was frozen (requires_grad=False) when the model was wrapped, so its chunk has "
                f"no gradient or optimizer state and it cannot be trained: wrap the model with it trainable and "
                f"freeze it after wrapping instead (a parameter frozen after wrapping keeps its optimizer state and is "
                f"stepped again once unfrozen), or freeze it again; nothing was changed")

    # ---- the optimizer's side ----------------------------------------------------------------------

    def attach_optimizer(self, listener: OptimizerListener, margin_ratio: float,
                         optim_host_chunks: Iterable[int] = ()) -> None:
        """Attach the model's optimizer (held weakly: the model may outlive it), with its
        ``gpu_margin_mem_ratio`` and the chunks whose optimizer state stays on the host under ``auto``
        with the disk tier; then place every trainable chunk's optimizer state."""
        self._listener = weakref.ref(listener)
        self.state.margin_ratio = margin_ratio
        self.state.optim_host_chunks = frozenset(optim_host_chunks)
        for chunk in self.trainable_chunks():
            self._place_optimizer_state(chunk)

    @_untraced
    def _place_optimizer_state(self, chunk: Chunk) -> None:
        self.executor.place_optimizer_state(chunk)

    def detach_optimizer(self) -> None:
        self._listener = None

    @property
    def optimizer_attached(self) -> bool:
        return self._listener is not None

    def _optimizer(self) -> OptimizerListener | None:
        return None if self._listener is None else self._listener()

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        optimizer = self._optimizer()
        return 1.0 if optimizer is None else optimizer.grad_multiplier(slot)

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on ``.grad`` stand-ins of this model's parameters: the optimizer's to serve."""
        optimizer = self._optimizer()
        if optimizer is None:
            raise ParameterAccessError(
                f"{getattr(func, '__name__', func)} on the gradient of a chunk-managed parameter of a model without "
                "a chunkmem optimizer: build ShardedOptimizerV2 (or chunkmem.initialize with an optimizer) first")
        return optimizer.run_gradient_idiom(func, args, kwargs)

    def grad_of(self, chunk: Chunk) -> torch.Tensor | None:
        """This rank's shard of the chunk's finished gradient (where it rests), or ``None``."""
        return self.gradients.grad_of(chunk)

    def grad_landing(self, chunk: Chunk) -> tuple[torch.Tensor, Callable[[], None]]:
        """The chunk's finished flat gradient where it rests and a function that waits for its copy there
        (callable from another thread; no bookkeeping: a later :meth:`grad_of` does that)."""
        return self.gradients.landing(chunk)

    def grad_pieces(self, chunk: Chunk) -> list[tuple[int, torch.Tensor]] | None:
        """The chunk's finished gradient as ``(offset, tensor)`` pieces where it is kept so (see
        :mod:`chunkmem.runtime.gradients`), else ``None`` (:meth:`grad_of` has it)."""
        return self.gradients.pieces(chunk)

    def grad_tensors(self, chunk: Chunk) -> list[torch.Tensor]:
        """The tensors holding the chunk's finished gradient, whichever form it has (for norms)."""
        return self.gradients.tensors(chunk)

    def untraced(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the tracer does not count allocations: the optimizer's own work run inside the
        backward (``step_in_backward``) is not the model's non-model memory."""
        return self.scheduler.paused()

    @contextlib.contextmanager
    def updating(self, chunk: Chunk, tier: Tier) -> Iterator[torch.Tensor]:
        """``with runtime.updating(chunk, tier) as target:`` the copy of this rank's parameters on ``tier``
        that an update running there writes; when the block ends normally it holds the new values."""
        target = self.update_target(chunk, tier)
        yield target
        self.mark_updated(chunk, tier)

    @_untraced
    def update_target(self, chunk: Chunk, tier: Tier) -> torch.Tensor:
        """The first half of :meth:`updating`, alone for updates that complete later, per chunk (the
        streamed disk step, whose updates run on a thread of its own and commit in ``step()``)."""
        return self.executor.update_target(chunk, tier)

    @_untraced
    def update_target_waiting_later(self, chunk: Chunk, tier: Tier) -> tuple[torch.Tensor, Callable[[], None]]:
        """:meth:`update_target` and the wait for the copies still reading that copy, for the caller to run
        before it writes (on the thread that runs the update)."""
        return self.executor.update_target_waiting_later(chunk, tier)

    @_untraced
    def mark_updated(self, chunk: Chunk, tier: Tier) -> None:
        """The second half of :meth:`updating` (see :meth:`update_target`)."""
        self.executor.mark_updated(chunk, tier)

    @_untraced
    def release_gradients(self, chunk: Chunk) -> None:
        """Free ``chunk``'s finished gradient now: its update used it and no step will read it again."""
        self.gradients.release(chunk)

    @_untraced
    def drop_gradients(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero every finished gradient, and what ``no_sync`` accumulated. Zeroed
        gradients still count as gradients for the next step (torch steps a parameter whose ``.grad`` is a
        zero tensor); dropped ones do not."""
        self.gradients.drop(set_to_none)
        if set_to_none:
            for chunk in self.chunks:
                chunk.slots_with_grads.clear()
        self.grads_pending = False
        self._final_order.clear()

    def check_can_accumulate(self) -> None:
        self.gradients.check_can_accumulate()

    @contextlib.contextmanager
    def deferring_reduction(self) -> Any:
        """``model.no_sync()``: sharded gradients accumulate locally, unreduced, inside."""
        self.gradients.check_can_defer()
        if self._no_sync:
            raise InvalidArgumentError("no_sync", "a nested no_sync()", "one no_sync() at a time")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    # ---- the parameter guard's side (ChunkHost) ----------------------------------------------------

    def is_open(self, chunk: Chunk, for_writing: bool) -> bool:
        return chunk in (self._open_for_writing if for_writing else self._open_for_reading)

    @_untraced
    def open_chunks(self, chunks: list[Chunk], for_writing: bool) -> None:
        self._acquire(chunks, exact=True)
        for chunk in chunks:
            self._open_for_reading[chunk] += 1
            if for_writing:
                self._open_for_writing[chunk] += 1

    @_untraced
    def close_chunks(self, chunks: list[Chunk], for_writing: bool) -> None:
        for chunk in chunks:
            self._open_for_reading[chunk] -= 1
            if for_writing:
                self._open_for_writing[chunk] -= 1
        self._open_for_reading = +self._open_for_reading  # (drops the chunks no block holds open)
        self._open_for_writing = +self._open_for_writing
        self.executor.release(chunks)
        # A released chunk's device copy is only marked stale, to be freed at the next period boundary of
        # an iteration; outside one there is none, so free it now.
        self.executor.flush_stale()

    @_untraced
    def write_params(self, chunk: Chunk, local: torch.Tensor) -> None:
        self.executor.write_params(chunk, local)

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        if module not in self.module_names:
            raise InvalidArgumentError("module", type(module).__name__,
                                       "a submodule of the model that owns the parameter")
        self._check_capacity_with(module, param, "declared with register_external_parameter")
        self._hook(module)
        self._add_foreign(module, param)

    # ---- the model's side --------------------------------------------------------------------------

    def remove_hooks(self) -> None:
        """The model is being unwrapped: no hook of the runtime stays, and the chunks leave it."""
        self.hooks.remove()
        for chunk in self.chunks:
            chunk.attach_host(None)

    # ---- inside ------------------------------------------------------------------------------------

    def _hook(self, module: nn.Module) -> None:
        if module not in self.module_chunks:
            self.module_chunks[module] = []
            for param in module.parameters(recurse=False):
                slot = slot_of(param)
                if slot is not None and slot.chunk not in self.module_chunks[module]:
                    self.module_chunks[module].append(slot.chunk)
            self.hooks.watch_module(module)

    def _check_capacity_with(self, module: nn.Module, param: nn.Parameter, how: str) -> None:
        """Before ``module`` fetches another module's ``param`` from now on: the device tier must still hold
        the step (the chunk now stays there from ``module``'s backward on); raises DeviceCapacityError, with
        nothing registered, when it does not."""
        if any(p is param for p in self._foreign.get(module, ())):
            return
        foreign = dict(self._foreign)
        foreign[module] = foreign.get(module, []) + [param]
        named = list(self.module_names.items())
        users = [(name, [p for p in sub.parameters(recurse=False) if slot_of(p) is not None] + foreign.get(sub, []))
                 for sub, name in named[:1] + list(reversed(named[1:]))]
        param_name = next((name for name, p in self.root.named_parameters() if p is param), "a parameter")
        self._check_capacity(users, f" ({how}: module {self.module_names[module]!r} uses parameter {param_name!r})")

    def _add_foreign(self, module: nn.Module, param: nn.Parameter) -> None:
        """Fetch ``param``'s chunk with ``module`` from now on."""
        params = self._foreign.setdefault(module, [])
        if not any(p is param for p in params):
            params.append(param)
        chunk = slot_of(param).chunk
        if chunk not in self.module_chunks[module]:
            self.module_chunks[module].append(chunk)
            self.scheduler.module_chunks_changed()

    def _begin_period(self, module: nn.Module, phase: str, chunks: list[Chunk]) -> None:
        required = [c.index for c in self.chunks if c.in_use]
        name = self.module_names[module]
        orders = self.scheduler.begin_period(name, phase, [c.index for c in chunks], required)
        period = self.scheduler.index - 1
        self.memory.ledger.context = f"period {period} ({name} {phase})"
        self.executor.log_event("period", period, name, phase)
        self.executor.execute(orders)

    def _need(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self.executor.check_free_of_grads(chunk)
        for chunk in chunks:
            if self.scheduler.need(chunk.index):
                self.executor.evict_unpinned()

    def _acquire(self, chunks: list[Chunk], exact: bool = False) -> None:
        self._need(chunks)
        self.executor.acquire(chunks, exact)

    def _hold_for_backward(self, chunks: list[Chunk]) -> None:
        chunks = [c for c in chunks if not c.held_for_backward]
        self._need(chunks)
        self.executor.hold_for_backward(chunks)

    def _hold_where_gradients_land(self, chunk: Chunk) -> None:
        """Gradients written into the parameters' memory need the chunk's device copy until they are finished."""
        if self.gradients.in_param_memory:
            self._hold_for_backward([chunk])

    def _finish_grads(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are complete: reduce them over the ranks (sharded; left
        running when reductions may be in flight), let the parameters go back to their resting tier, and,
        once the reduction is done, let the gradients rest where the update runs and tell the optimizer."""
        deferred = self._no_sync and chunk.param.sharded
        self._hold_where_gradients_land(chunk)
        running = self.gradients.finish(chunk, deferred, overlap=self.reductions_in_flight > 0)
        chunk.grad_slots_received.clear()
        chunk.grads_finished = True
        chunk.unhold()
        self.grads_pending = self.grads_pending or not deferred
        if running:
            self._reducing.append(chunk)
            self.executor.log_event("reduce", chunk.index, "started")
            self._complete_reductions(self.reductions_in_flight)
        else:
            self._grads_final(chunk)

    def _complete_reductions(self, keep: int) -> None:
        """Wait for the oldest reductions in flight until at most ``keep`` remain."""
        while len(self._reducing) > keep:
            chunk = self._reducing.popleft()
            self.gradients.complete(chunk)
            self.executor.log_event("reduce", chunk.index, "done")
            self._grads_final(chunk)

    def _grads_final(self, chunk: Chunk) -> None:
        """The chunk's gradients are reduced: they rest where its update runs; the optimizer hears of it."""
        self.scheduler.grads_finished(chunk.index)
        self._final_order.setdefault(chunk)
        self.executor.settle(chunk)
        optimizer = self._optimizer()
        if optimizer is not None and not self._no_sync:
            optimizer.on_grads_final(chunk)

    def _drop_secondaries(self) -> None:
        """hpZ's secondary partitions live from a forward to its backward only."""
        for chunk in self.chunks:
            chunk.param.drop_secondary()

    def _recover_interrupted(self) -> None:
        """The last iteration stopped on an error (e.g. :class:`~chunkmem.DeviceCapacityError` in its
        backward): release what its backward held, drop its unfinished gradients, and put every chunk
        where it rests, so the next iteration starts as after a finished one. Where the error came in the
        backward, every pending gradient is dropped too, those of the chunks it had finished and those
        accumulated by earlier backwards (they share the buffers its partial sums went into), and the
        optimizer undoes the updates it started (:meth:`OptimizerListener.on_backward_failed`): the next
        ``step()`` has nothing to apply, as if the failed iteration had not happened. (Before 2026-11-27 the
        finished chunks' gradients stayed and joined the next step.)"""
        failed_backward, self._backward_began = self._backward_began, False
        self.executor.cancel_prefetch()
        self._complete_reductions(0)  # a started collective cannot be called back; its result is kept
        optimizer = self._optimizer()
        if failed_backward and optimizer is not None:
            try:  # the updates still running read gradients and write chunks: let them end first
                optimizer.on_backward_end()
            except Exception:  # (the backward failed already: on_backward_failed below undoes what they did)
                pass
        self._drop_secondaries()
        self._frozen_users.clear()
        self._frozen_kept.clear()
        for chunk in self.chunks:
            chunk.unhold()
            self.gradients.abandon(chunk)
            chunk.grad_slots_received.clear()
            chunk.grads_finished = False
        self.executor.settle_all()
        self.executor.flush_stale()
        if failed_backward:
            optimizer = self._optimizer()
            if optimizer is not None:
                optimizer.on_backward_failed()
            else:
                self.drop_gradients(set_to_none=True)
            self.grads_pending = False

    def _schedule_moves(self) -> None:
        """A new schedule was traced: agree on its peaks over the ranks, plan it, and move the margin's
        optimizer state to the device."""
        chunks = self.chunks
        if not chunks:
            return
        peaks = [p.non_model_peak for p in self.scheduler.periods or []]
        shards = self.data_parallel
        if shards.sharded and peaks:  # every rank must fetch the same chunks in the same order
            agreed = torch.tensor(peaks, dtype=torch.int64)
            shards.all_reduce_(agreed, torch.distributed.ReduceOp.MAX, what="the traced non-model memory peaks")
            peaks = [int(p) for p in agreed.tolist()]
        # Every chunk gets a slot of the largest chunk's bytes (a trimmed last chunk is smaller).
        largest = max(chunks, key=lambda c: c.numel)
        trainable = [c for c in chunks if c.trainable]
        largest_trainable = max(trainable, key=lambda c: c.numel, default=None)
        optimizer_state = largest_trainable is not None and any(
            buf.allocated for buf in largest_trainable.optim.values())
        inputs = MoveInputs(self.memory.ledger.capacity, largest.param.nbytes,
                            self._optimizer_group_bytes(largest_trainable) if optimizer_state else 0,
                            self.gradients.in_param_memory, self.reduction.shards.sharded, peaks)
        for index in self.scheduler.schedule_moves(inputs):
            self.gradients.flatten(chunks[index])  # its gradient buffer moves with the state
            self.executor.move_optimizer_state(chunks[index], Tier.DEVICE)
            self.executor.settle(chunks[index])

    def _optimizer_group_bytes(self, chunk: Chunk) -> int:
        """Device bytes of one chunk kept there with its optimizer state: this rank's shard of the optimizer
        families (the master and the state) and of the gradient, the full parameter copy, and (sharded) the
        parameter shard."""
        families = sum(chunk.optim[f].nbytes for f in chunk.state_families + ((MASTER,) if chunk.has_master else ()))
        shard_bytes = chunk.param.shard.nbytes
        return (families + chunk.param.nbytes + (shard_bytes if chunk.param.sharded else 0)
                + self.gradients.grad_bytes(chunk))


def _shapes_of(tree: Any) -> tuple:
    """What must stay the same for a recorded schedule to apply: the shapes and dtypes of the inputs."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in tree_leaves(tree))
