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
agreement on the traced peaks that planning needs (:func:`~chunkmem.runtime.traced_moves.schedule_traced_moves`),
and the ranks' agreement on the point of training (:meth:`agree`) that opens every sharded forward and step.
One rule keeps chunkmem's own memory out of the traced non-model memory: every entry point runs with the
tracer paused (:func:`_untraced`).

The runtime owns its collaborators and delegates to them: which chunks each module's call fetches
(:mod:`chunkmem.runtime.module_chunks`), where a backward's gradients land and when they are final
(:mod:`chunkmem.runtime.gradient_landing`), how long a backward holds the frozen chunks
(:mod:`chunkmem.runtime.frozen_chunks`) and the moves planned after a trace
(:mod:`chunkmem.runtime.traced_moves`). The optimizer is told of each chunk whose gradients are final
through a declared listener (:class:`~chunkmem.runtime.optimizer_link.OptimizerListener`, attached with
:meth:`attach_optimizer` and held by :class:`~chunkmem.runtime.optimizer_link.OptimizerLink`), and
updates a chunk through :meth:`updating`. Code outside the step that meets a chunk-managed parameter (the
parameter guard, ``GatheredParameters``, the accessors) sees the runtime as the chunk's
:class:`~chunkmem.core.chunk.ChunkHost`.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_leaves

from ..core.chunk import Chunk, ParamSlot
from ..core.memory import TierMemory
from ..core.param_guard import slot_of
from ..core.tiers import Tier, device_of_tier
from ..distributed.agreement import agree_on_point
from ..distributed.collectives import CollectiveError, ShardGroup
from ..distributed.reduction import GradientReduction
from .acquisition import ChunkAcquisition
from .capacity import CapacityCheck
from .executor import ChunkExecutor
from .frozen_chunks import FrozenHolds, refuse_unfrozen, unfrozen_since_wrapping
from .gradient_landing import GradientLanding
from .gradients import gradient_store
from .hooks import ModelHooks, at_backward_end
from .module_chunks import ModuleChunks
from .open_chunks import OpenChunks
from .optimizer_link import OptimizerLink, OptimizerListener
from .placement import PlacementPolicy, PlacementState
from .recovery import recover_interrupted, refuse_after_failed_collective
from .schedule import Scheduler
from .traced_moves import schedule_traced_moves

__all__ = ["ChunkRuntime", "OptimizerListener"]


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
    ``gradients`` (the strategy), ``backward_count``, ``grads_pending``; its collaborators: ``watched``
    (:class:`~chunkmem.runtime.module_chunks.ModuleChunks`), ``acquisition``, ``landing``, ``frozen``, ``hooks``.
    """

    def __init__(self, root: nn.Module, chunks: list[Chunk], memory: TierMemory, policy: PlacementPolicy,
                 gradients_in_param_memory: bool, reduction: GradientReduction, gather_together: bool,
                 check_capacity: CapacityCheck, data_parallel: ShardGroup, reductions_in_flight: int = 0,
                 accumulate_in_fp32: bool = True) -> None:
        self.root = root
        self.policy = policy
        self.state = PlacementState()
        self.executor = ChunkExecutor(chunks, memory, policy, self.state, gather_together)
        self.scheduler = Scheduler(memory.ledger, policy, self.state, device_of_tier(Tier.DEVICE), len(chunks))
        self.reduction = reduction
        self.data_parallel = data_parallel  # every rank of the model (agreement and planning collectives)
        self.gradients = gradient_store(gradients_in_param_memory, self.executor, reduction, self.scheduler.adopt,
                                        accumulate_in_fp32)
        self.backward_count = 0  # backward passes finished (autograd's end of backward) so far
        self.forward_count = 0  # forwards of the wrapped model begun so far
        self.step_count = 0  # optimizer steps begun so far (skipped ones too)
        self.group_failed: CollectiveError | None = None  # the collective error that ended an iteration
        self._stack: list[_Running] = []
        self.steady = False  # every chunk resident throughout: only the root's hooks act (read by every module call)
        self._end_of_backward_queued = False
        self._backward_began = False  # a backward of this iteration reached the model (cleared at its end)
        self._open = OpenChunks()
        self.frozen = FrozenHolds()
        self._optimizer = OptimizerLink()
        self.hooks = ModelHooks(self)
        self.watched = ModuleChunks(root, self.hooks, check_capacity, self.scheduler.module_chunks_changed)
        self.module_names = self.watched.names
        self.module_chunks = self.watched.chunks
        self.acquisition = ChunkAcquisition(self.scheduler, self.executor, self.module_names)
        self.landing = GradientLanding(self.gradients, self.executor, self.scheduler, self._optimizer,
                                       self.acquisition.hold_for_backward, reductions_in_flight)
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
        return self.landing.in_landing_order(self.trainable_chunks())

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
        return self.landing.no_sync.active

    @property
    def grads_pending(self) -> bool:
        """Whether a backward left gradients that no step or ``zero_grad`` consumed yet."""
        return self.landing.grads_pending

    @property
    def reductions_in_flight(self) -> int:
        """The bound on the gradient reductions left running during a backward (see ShardedModelV2's argument)."""
        return self.landing.reductions_in_flight

    def owns(self, chunk: Chunk) -> bool:
        return chunk in self.executor.chunks

    # ---- the edges of a step -----------------------------------------------------------------------

    @_untraced
    def begin_iteration(self, inputs: Any, training: bool) -> None:
        """The wrapped model's forward begins with ``inputs`` (its arguments, already cast)."""
        refuse_after_failed_collective(self.group_failed)
        self.landing.refuse_forward_over_gradients()
        while self._stack:  # a forward interrupted where its post hooks could not run (KeyboardInterrupt)
            self.executor.release(self._stack.pop().chunks)
        self._end_of_backward_queued = False  # autograd drops the callback of a backward that raised
        if self.scheduler.running:  # the last iteration stopped on an error: release what it held
            self._recover_interrupted()
        unfrozen = unfrozen_since_wrapping(self.chunks) if training and self.optimizer_attached else []
        self.agree("forward", "the model's forward", [("forwards so far", self.forward_count),
                                                      ("optimizer steps so far", self.step_count),
                                                      ("autograd on", training),
                                                      ("parameters unfrozen since wrapping", len(unfrozen))])
        self.refuse_unfrozen("the model's forward", unfrozen)
        self.forward_count += 1
        self.frozen.begin_iteration(self.chunks)
        self.executor.drop_secondaries()
        if self.scheduler.begin_iteration(_shapes_of(inputs), training):
            self.executor.evict_unpinned()
        self.steady = self.scheduler.follow_steadily(
            self.executor.resident_throughout(self.scheduler.moves, self.gradients.in_param_memory))

    @_untraced
    def pre_forward(self, module: nn.Module) -> None:
        running = _Running(module)
        self._stack.append(running)  # first: the post hook runs even if what follows raises
        if self.steady:  # (the root's call: the others' hooks return at once)
            return
        chunks = list(self.module_chunks[module])
        if chunks:
            self.acquisition.begin_period(module, "forward", chunks)
        self.acquisition.acquire(chunks)
        running.chunks = chunks

    @_untraced
    def use_in_forward(self, param: nn.Parameter) -> None:
        """``param`` is used while the innermost running module does not hold its chunk: fetch it for that
        module now and from then on (a parameter of another module: a tied head, ``F.linear(x, w)``)."""
        running = self._stack[-1]
        chunk = slot_of(param).chunk
        if self.steady or chunk in running.chunks:  # (steady: every chunk is on the device throughout)
            return
        self.watched.check_capacity_with(running.module, param, "found in a forward")
        self.acquisition.acquire([chunk])  # refuses a chunk whose memory holds gradients (reuse_fp16_shard)
        running.chunks.append(chunk)
        self.watched.add_foreign(running.module, param)

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
            at_backward_end(self.post_backward)
        if not first or self.steady:
            return
        chunks = self.module_chunks[module]
        if chunks:
            self.acquisition.begin_period(module, "backward", chunks)
        self.acquisition.hold_for_backward(chunks)
        self.frozen.held(chunks, tracked)

    def uses_frozen_chunks(self, module: nn.Module) -> bool:
        """Whether ``module``'s forward uses a chunk without trainable parameters (:meth:`FrozenHolds.frozen`)."""
        return any(self.frozen.frozen(c) for c in self.module_chunks.get(module, ()))

    @_untraced
    def frozen_backward_done(self, module: nn.Module) -> None:
        """Every autograd node of one of ``module``'s forward calls ran: its frozen chunks may leave the
        device once no other call whose backward runs uses them (a frozen base bigger than the device)."""
        self.frozen.done(self.module_chunks[module], self.executor.release_backward_hold)

    @_untraced
    def gradient_ready(self, param: nn.Parameter) -> None:
        """Autograd accumulated ``param``'s gradient: take it into the chunk."""
        with DisableTorchFunctionSubclass():
            grad = param.grad
            param.grad = None
        slot = slot_of(param)
        self._backward_began = True
        self.landing.receive(slot.chunk, slot, grad)

    @_untraced
    def post_backward(self) -> None:
        """After autograd finished: finish every trainable chunk not finished yet (parameters that got no
        gradient get zero), release what the backward held, close the iteration, plan a new schedule."""
        self._end_of_backward_queued = False
        self._backward_began = False
        self.executor.cancel_prefetch()
        for chunk in self.chunks:
            if chunk.trainable and not chunk.grads_finished:
                self.landing.finish(chunk)
            elif chunk.held_for_backward:
                self.executor.release_backward_hold(chunk)
        self.landing.complete_reductions(0)
        optimizer = self._optimizer.listener()
        if optimizer is not None:  # before anything is freed, moved or planned
            optimizer.on_backward_end()
        self.executor.drop_secondaries()
        self.frozen.clear()
        for chunk in self.chunks:
            chunk.grads_finished = False
        self.executor.flush_stale()
        self.backward_count += 1
        self.steady = False
        if self.scheduler.end_iteration():
            schedule_traced_moves(self.scheduler, self.executor, self.gradients, self.reduction, self.data_parallel)
        self.memory.ledger.context = ""

    @_untraced
    def abandon_iteration(self, error: BaseException) -> None:
        """The model's forward, or the optimizer's backward, raised ``error``: release what the iteration
        held, drop its unfinished gradients and leave the tracer's dispatch mode now (not at the next
        forward), so no mode, hold or chunk outlives the exception; the next iteration is traced again.

        After a failed collective the process group is unusable and a chunk's gather may still be in
        flight in it: nothing is released (nothing can be), the tracer's mode is left, and the next
        forward raises a :class:`~chunkmem.CollectiveError` that names the first failure."""
        self.steady = False
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
        """The optimizer's step is over: free what it left stale on the device, when it consumed the
        gradients (applied or skipped) release them, and start fetching the next forward's first chunks."""
        self.executor.flush_stale()
        if release_gradients:
            self.drop_gradients(set_to_none=True)
        self.scheduler.fetched_ahead(self.executor.prefetch_next_forward(self.scheduler.next_forward_start()))

    def refuse_unfrozen(self, where: str, unfrozen: list[str] | None = None) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` (``where`` names the call refused) if a parameter
        that was frozen when the model was wrapped requires grad now (``unfrozen``: their names, when already
        read): it sits in a chunk without gradient or optimizer state, so it cannot train, and leaving it alone
        silently is not what torch would do."""
        refuse_unfrozen(where, unfrozen_since_wrapping(self.chunks) if unfrozen is None else unfrozen)

    # ---- the optimizer's side ----------------------------------------------------------------------

    def attach_optimizer(self, listener: OptimizerListener, margin_ratio: float,
                         optim_host_chunks: Iterable[int] = ()) -> None:
        """Attach the model's optimizer (held weakly: the model may outlive it), with its
        ``gpu_margin_mem_ratio`` and the chunks whose optimizer state stays on the host under ``auto``
        with the disk tier; then place every trainable chunk's optimizer state."""
        self._optimizer.attach(listener)
        self.state.margin_ratio = margin_ratio
        self.state.optim_host_chunks = frozenset(optim_host_chunks)
        for chunk in self.trainable_chunks():
            self._place_optimizer_state(chunk)

    @_untraced
    def _place_optimizer_state(self, chunk: Chunk) -> None:
        self.executor.place_optimizer_state(chunk)

    def detach_optimizer(self) -> None:
        self._optimizer.detach()

    @property
    def optimizer_attached(self) -> bool:
        return self._optimizer.attached

    def grad_multiplier(self, slot: ParamSlot | None = None) -> float:
        return self._optimizer.grad_multiplier(slot)

    def check_no_step_in_flight(self, action: str) -> None:
        """Refuse ``action`` (a write from outside: a setter, ``load_state_dict``, a writing ``GatheredParameters``)
        while ``step_in_backward``'s updates wait for ``step()``, which would lose the write or overwrite it."""
        self._optimizer.check_no_step_in_flight(action)

    def run_gradient_idiom(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch function on ``.grad`` stand-ins of this model's parameters: the optimizer's to serve."""
        return self._optimizer.run_gradient_idiom(func, args, kwargs)

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
    def copy_of_resting_values(self, chunk: Chunk) -> torch.Tensor | None:
        """A host copy of this rank's values of ``chunk``'s parameters, resting on disk as their own masters,
        from the copy the backward computed with (``None`` where there is none: see
        :meth:`~chunkmem.runtime.executor.ChunkExecutor.copy_of_resting_values`); on the host ledger until
        :meth:`release_copy_of_resting_values`."""
        return self.executor.copy_of_resting_values(chunk)

    def release_copy_of_resting_values(self, values: torch.Tensor) -> None:
        """Give back a copy :meth:`copy_of_resting_values` made, once the disk step no longer reads it."""
        self.executor.release_copy_of_resting_values(values)

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

    def gradient_released(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s finished gradient was freed by its update before the step (:meth:`release_gradients`)."""
        return self.gradients.released(chunk)

    @_untraced
    def drop_gradients(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero every finished gradient, and what ``no_sync`` accumulated. Zeroed
        gradients still count as gradients for the next step (torch steps a parameter whose ``.grad`` is a
        zero tensor); dropped ones do not."""
        self.landing.drop(set_to_none)

    def check_can_accumulate(self) -> None:
        self.gradients.check_can_accumulate()

    def deferring_reduction(self) -> contextlib.AbstractContextManager[None]:
        """``model.no_sync()``: sharded gradients accumulate locally, unreduced, inside."""
        return self.landing.deferring()

    # ---- the parameter guard's side (ChunkHost) ----------------------------------------------------

    def is_open(self, chunk: Chunk, for_writing: bool) -> bool:
        return self._open.is_open(chunk, for_writing)

    @_untraced
    def open_chunks(self, chunks: list[Chunk], for_writing: bool) -> None:
        self.acquisition.acquire(chunks, exact=True)
        self._open.open(chunks, for_writing)

    @_untraced
    def close_chunks(self, chunks: list[Chunk], for_writing: bool) -> None:
        self._open.close(chunks, for_writing)
        self.executor.release(chunks)
        # A released chunk's device copy is only marked stale, to be freed at the next period boundary of
        # an iteration; outside one there is none, so free it now.
        self.executor.flush_stale()

    @_untraced
    def write_params(self, chunk: Chunk, local: torch.Tensor) -> None:
        self.executor.write_params(chunk, local)

    def register_external(self, module: nn.Module, param: nn.Parameter) -> None:
        self.watched.register_external(module, param)

    # ---- the model's side --------------------------------------------------------------------------

    def remove_hooks(self) -> None:
        """The model is being unwrapped: no hook of the runtime stays, and the chunks leave it."""
        self.hooks.remove()
        for chunk in self.chunks:
            chunk.attach_host(None)

    # ---- inside ------------------------------------------------------------------------------------

    def _recover_interrupted(self) -> None:
        """The last iteration stopped on an error (e.g. :class:`~chunkmem.DeviceCapacityError` in its
        backward): put it behind (:func:`~chunkmem.runtime.recovery.recover_interrupted`)."""
        failed_backward, self._backward_began = self._backward_began, False
        self.steady = False
        recover_interrupted(self.executor, self.landing, self._optimizer, self.frozen, failed_backward)


def _shapes_of(tree: Any) -> tuple:
    """What must stay the same for a recorded schedule to apply: the shapes and dtypes of the inputs."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in tree_leaves(tree))
