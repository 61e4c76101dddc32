"""``step_in_backward``: the updates a backward starts before ``step()`` decides, and how they are kept or undone.

As soon as a chunk's gradients are final the backward updates it as if nothing overflowed and nothing is
clipped, with the hyper-parameters of that moment (:meth:`BackwardStep.on_grads_final`):

* a chunk whose optimizer state rests on disk joins this backward's :class:`~chunkmem.optim.disk_step.StreamedStep`
  (started with the first such chunk), which writes into the disk's other slot (or in place with
  ``atomic_step=False``) on a thread of its own;
* a chunk whose state is in memory (host or device tier) is updated in place after an undo copy of its fp32
  state (:class:`~chunkmem.optim.speculation.UndoCopies`).

No update starts in a backward whose iteration ``auto`` traces with a margin for optimizer state
(``gpu_margin_mem_ratio`` > 0): the plan made when it ends may move a chunk's state to the device, where the step
must then update it.

``step()`` then keeps each update whose multiplier and assumptions (:meth:`BackwardStep.key`: the parameters
stepped, every group's hyper-parameters) are the step's, and undoes the others before updating again, so the
result is bitwise the step after the backward. The chunk update rule (:mod:`chunkmem.optim.update_rule`) makes
the updates themselves and :mod:`chunkmem.optim.disk_commit` commits the disk step; this module owns what the
backward started. It knows the optimizer only through the parts it is given (the runtime, the rule, the
mixed-precision step and the settings), never the optimizer itself.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..core.chunk import Chunk
from ..core.copy_engine import nothing_to_wait_for
from ..core.tiers import Tier, host_memory_available
from ..errors import GradientAccumulationError, InvalidArgumentError, UnsupportedOperationError
from ..model.sharded_model import ShardedModelV2
from ..runtime.runtime import ChunkRuntime
from ..settings import ModelSettings, OptimizerSettings
from .disk_step import StreamedStep, stream_shape
from .host_updates import HostUpdates
from .mixed_precision import MixedPrecisionStep
from .speculation import UndoCopies, UndoCopy
from .update_rule import UpdateRule

GRADIENTS_AHEAD_OF_THE_DISK_STEP = 2
"""With ``step_in_backward`` and ``atomic_step=False``: how many chunks' gradients may wait for the disk step
beyond the one it is computing before the backward waits for it (see :meth:`BackwardStep.gradients_used_once`)."""


def why_no_speculation(atomic_step: bool, gradients_overwritten: bool) -> str | None:
    """Why the backward's updates could not be undone if ``step()`` decides otherwise (``None``: they can).
    They are made assuming no overflow and no clipping; an atomic step writes them to the disk's other
    slot, so undoing them is not committing, and the gradients must survive them to redo the step
    (``gradients_overwritten``: they share the memory an update writes, ``reuse_fp16_shard=True``)."""
    if not atomic_step:
        return "atomic_step=False (the updates written in place on disk could not be undone)"
    if gradients_overwritten:
        return "reuse_fp16_shard=True (the updates overwrite the gradients a redone step needs)"
    return None


def check_step_in_backward(model_settings: ModelSettings, dtype: torch.dtype, settings: OptimizerSettings) -> None:
    """Refuse ``step_in_backward=True`` where an update made in the backward could not be undone when the step
    decides otherwise (fp16's skipped steps, clipping) or would overwrite the gradients in memory. (Before the
    model is wrapped: its settings say where the gradients will be.)"""
    if not settings.step_in_backward:
        return
    gradients_overwritten = model_settings.reuse_fp16_shard
    if gradients_overwritten and not model_settings.disk.optimizer_on_disk:
        raise InvalidArgumentError("step_in_backward", True, "False with reuse_fp16_shard=True and the optimizer "
                                   "state in memory (an update in the backward overwrites the gradients a redone "
                                   "step needs), or True with offload_optimizer='disk'")
    needs = "fp16 (its loss scaler may skip the step)" if dtype == torch.float16 else \
        f"max_norm={settings.max_norm} (clipping)" if settings.max_norm > 0 else None
    if needs is not None:
        reason = why_no_speculation(model_settings.disk.atomic_step, gradients_overwritten)
        if reason is not None:
            raise InvalidArgumentError("step_in_backward", True, f"False with {needs} and {reason}")


def check_undo_room(model: ShardedModelV2, rule: UpdateRule, settings: OptimizerSettings) -> None:
    """``step_in_backward`` with the optimizer state in memory (``rule``'s families): refuse before any change if
    the host has no room for one undo copy of it (see :mod:`chunkmem.optim.speculation`) besides the state
    itself: the host capacity when one is set, else the memory the system has available."""
    if not settings.step_in_backward or model.settings.disk.optimizer_on_disk:
        return
    ledger = model.runtime.ledger
    # the masters (or the parameters that are their own) and the rule's state: the state, and its undo copy
    state_bytes = undo = sum(rule.state_nbytes(chunk) + chunk.shard_numel * (4 if rule.keeps_master(chunk) else
                                                                            chunk.dtype.itemsize)
                             for chunk in model.runtime.trainable_chunks())
    if ledger.host_capacity is not None:
        room, what = ledger.host_capacity - ledger.tier_bytes(Tier.HOST) - state_bytes, "the host capacity"
    else:
        room, what = host_memory_available() - state_bytes, "the memory available"
    if undo > room:
        raise InvalidArgumentError(
            "step_in_backward", True,
            f"False, or room on the host for the undo copies of the optimizer state in memory: {undo} bytes, "
            f"where {max(room, 0)} bytes of {what} are left after the state itself (offload_optimizer='disk' "
            f"needs no copy: its other slot is the undo; or raise the host capacity)")


class BackwardStep:
    """What one optimizer's backwards started (see the module docstring). ``in_flight``: the streamed disk
    step this backward started, or ``None``; ``undo``: the undo copies of the chunks in memory it updated;
    ``kept``: how many of the backward's updates the last ``step()`` kept; ``accumulating``: inside
    ``optim.accumulating()`` (backwards start nothing); ``no_speculation``: why its updates could not be undone
    if ``step()`` decides otherwise (:func:`why_no_speculation`; ``None``: they can).

    Args:
        runtime: the model's runtime.
        rule: the optimizer's chunk update rule (it makes every update).
        mixed: the optimizer's mixed-precision step (the loss scale the updates unscale by, the ranks' agreement).
        settings: the optimizer's settings (``step_in_backward``, ``max_norm``).
        model_settings: the wrapped model's settings (``atomic_step``). Whether an update overwrites the
            gradients, the runtime's gradient store says (``overwritten_by_update``).
    """

    def __init__(self, runtime: ChunkRuntime, rule: UpdateRule, mixed: MixedPrecisionStep,
                 settings: OptimizerSettings, model_settings: ModelSettings) -> None:
        self.runtime = runtime
        self.rule = rule
        self.mixed = mixed
        self.settings = settings
        self.no_speculation = why_no_speculation(model_settings.disk.atomic_step,
                                                 runtime.gradients.overwritten_by_update)
        self.in_flight: StreamedStep | None = None
        self.speculated: dict[int, tuple[Any, ...]] = {}  # chunk index -> what its update in flight assumed
        self.undo = UndoCopies(self.runtime.memory)
        self.host_updates = HostUpdates()  # in-memory updates handed off autograd's thread (CUDA)
        self.kept = 0
        self.accumulating = False

    @property
    def pending(self) -> bool:
        """Whether updates started by a backward wait for ``step()`` to decide."""
        return self.in_flight is not None or len(self.undo) > 0

    @property
    def started(self) -> int:
        """How many chunks' updates the running (or last) backward started that ``step()`` has not decided."""
        return (0 if self.in_flight is None else len(self.in_flight.updates)) + len(self.undo)

    def check_can_accumulate(self) -> None:
        """Refuse a second backward after one that started this step's updates (outside ``accumulating()``)."""
        if self.pending:
            raise GradientAccumulationError(
                "step_in_backward=True: the last backward already started this step's updates of the chunks, so "
                "a second backward cannot add to their gradients; call optim.step() first, or run the backwards "
                "before the last one inside optim.accumulating()")

    @contextlib.contextmanager
    def accumulating_backwards(self) -> Iterator[None]:
        """The backwards run inside start no update (``optim.accumulating()``); not nested."""
        if self.accumulating:
            raise InvalidArgumentError("accumulating", "a nested accumulating()", "one accumulating() at a time")
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    def check_none_pending(self, action: str) -> None:
        """Raise :class:`~chunkmem.UnsupportedOperationError` if updates a backward started wait for ``step()``
        (``action``: what was attempted)."""
        if self.pending:
            raise UnsupportedOperationError(
                f"{action} between a backward and optim.step() with step_in_backward=True: the backward's "
                f"updates are not decided yet (optim.step() keeps or redoes them); call optim.step() first")

    def check_can_rescale(self, what: str) -> None:
        """Refuse ``what`` (a clipping decided after the backward) where the backward's updates could not be
        redone with another multiplier."""
        reason = self.no_speculation if self.settings.step_in_backward else None
        if reason is not None:
            raise UnsupportedOperationError(
                f"{what} with step_in_backward=True and {reason}: the chunks on disk are updated during the "
                f"backward, before the norm of all gradients exists, and clipping would have to redo them; build the "
                f"ShardedOptimizerV2 without step_in_backward to clip")

    def undo_all(self) -> None:
        """``zero_grad()``: undo every update the backward started, or, where some were written in place on
        disk (``atomic_step=False``), raise :class:`~chunkmem.UnsupportedOperationError` with nothing changed."""
        try:
            self.settle()
        except Exception:  # an update that failed off autograd's thread: undone below with the others
            pass
        if self.in_flight is not None:
            if not self.runtime.memory.disk.atomic_step:
                raise UnsupportedOperationError(
                    "zero_grad() after a backward with step_in_backward=True and atomic_step=False: the backward "
                    "already updated chunks in place on disk and that cannot be undone; call optim.step() to "
                    "complete the step")
            self.abandon_in_flight()
        self.undo_in_memory()

    def on_grads_final(self, chunk: Chunk) -> None:
        """As soon as ``chunk``'s gradients are final, update it as if nothing overflowed and nothing is
        clipped: hand a chunk whose optimizer state rests on disk to this backward's streamed step (started
        with the first such chunk), update one whose state is in memory after taking its undo copy. (The
        optimizer starts nothing while a failed step leaves it broken.)"""
        if not self.settings.step_in_backward or not chunk.trainable or self.accumulating:
            return
        if self.runtime.scheduler.placing_optimizer_state:
            # Where each chunk's state lives is decided when this traced iteration ends: an update here could
            # run on another tier (another kernel, other rounding) than step() would. The step updates all.
            return
        if self.runtime.optim_tier(chunk) is not Tier.DISK:
            self._update_in_memory(chunk)
            return
        step = self.in_flight
        if step is None:
            disk = self.runtime.memory.disk
            on_disk = [c for c in self.runtime.trainable_chunks() if self.runtime.optim_tier(c) is Tier.DISK]
            shape = stream_shape(on_disk, self.rule.streams_whole_chunks, disk)
            step = self.in_flight = StreamedStep(disk, self.mixed.any_rank, shape, self.rule.streamed_settle(),
                                                 self.runtime.release_copy_of_resting_values)
            step.start()
        elif any(update.chunk is chunk for update in step.updates):
            raise GradientAccumulationError(
                f"step_in_backward=True: {chunk.name} received gradients again before optim.step(), but its update "
                f"already started (a second backward, e.g. loss.backward() called twice); call optim.step() "
                f"after each backward")
        # As if nothing overflowed and nothing is clipped: step() checks both and redoes the step otherwise.
        self.speculated[chunk.index] = self.key(chunk)
        update = self.rule.disk_update(chunk, 1.0 / self.mixed.loss_scale)
        used_once = self.gradients_used_once()
        if used_once:  # the stream is at most a few chunks behind: those chunks' values may wait for it in memory
            update.resting_values = self.runtime.copy_of_resting_values(chunk)
        step.add(update)
        if used_once:
            for computed in step.wait_until_computed(GRADIENTS_AHEAD_OF_THE_DISK_STEP):
                if computed.grad is not None:
                    self.runtime.release_gradients(computed.chunk)
                    computed.grad = None
                if computed.resting_values is not None:
                    self.runtime.release_copy_of_resting_values(computed.resting_values)
                    computed.resting_values = None

    def gradients_used_once(self) -> bool:
        """Whether a disk chunk's gradient is read by its update in the backward and by nothing after: the
        update is written in place (``atomic_step=False``: never redone) and the step needs no gradient
        to decide (no loss scaler, no clipping: both are refused with it). The backward then frees each
        gradient once its update is computed and waits for the disk step when more than
        :data:`GRADIENTS_AHEAD_OF_THE_DISK_STEP` chunks' gradients are waiting for it, so the host holds a
        few chunks' gradients instead of all of them (2 bytes a 16-bit parameter)."""
        return (not self.runtime.memory.disk.atomic_step and self.mixed.scaler is None and self.settings.max_norm == 0
                and not self.runtime.gradients.overwritten_by_update)

    def _update_in_memory(self, chunk: Chunk) -> None:
        """Update ``chunk``, whose optimizer state is in memory, in this backward after taking its undo copy;
        without room on the host for the copy (or with the gradients in the parameters' memory, or where the rule
        leaves it to the step: :meth:`~chunkmem.optim.update_rule.UpdateRule.updates_in_backward`) it is left
        for ``step()``."""
        if chunk in self.undo:
            raise GradientAccumulationError(
                f"step_in_backward=True: {chunk.name} received gradients again before optim.step(), but it was "
                f"already updated (a second backward, e.g. loss.backward() called twice); call optim.step() "
                f"after each backward")
        if self.runtime.gradients.overwritten_by_update or not self.rule.updates_in_backward(chunk):
            return
        multiplier = 1.0 / self.mixed.loss_scale
        off_thread = self.rule.updates_off_thread(chunk)
        with self.runtime.untraced():
            params, params_free = None, nothing_to_wait_for
            if not chunk.has_master:  # the parameters are the master: the undo copy holds them too
                params, params_free = self.runtime.update_target_waiting_later(chunk, self.runtime.compute_tier(chunk))
            if not off_thread:
                params_free()
            if not self.undo.take(chunk, params, multiplier, self.key(chunk), self.rule.scalar_state(chunk),
                                  self.rule.whole_state(chunk), fill=not off_thread):
                params_free()  # step() writes them, and will not know of the fetch still reading them
                return
            if off_thread:
                self.rule.start_update_off_thread(chunk, multiplier, self.host_updates, params_free,
                                                  self.undo.get(chunk))
            else:
                self.rule.update(chunk, multiplier)

    def settle(self) -> None:
        """Wait for the updates running off autograd's thread and complete them (the backward's end; raises
        the first that failed: its chunk and every other updated one are undone by the caller)."""
        if self.host_updates.pending:
            self.host_updates.join()

    def keep(self, chunk: Chunk, multiplier: float) -> bool:
        """Whether the backward's update of ``chunk`` (state in memory) is this step's: the same multiplier
        and nothing else changed. Its undo copy is released; an update that is not the step's is undone."""
        undo = self.undo.get(chunk)
        if undo is None:
            return False
        if undo.multiplier == multiplier and undo.assumed == self.key(chunk):
            self.undo.release(chunk)
            self.kept += 1
            return True
        self._undo_update(undo)
        return False

    def _undo_update(self, undo: UndoCopy) -> None:
        """Put a chunk updated by the backward back as it was before (state, parameters, step count)."""
        chunk = undo.chunk
        with self.runtime.updating(chunk, self.runtime.compute_tier(chunk)) as target:
            self.undo.restore_into(undo, target)
        chunk.steps = dict(undo.steps)
        self.rule.replace_kept_state(chunk, undo.scalars, undo.whole)

    def undo_in_memory(self) -> None:
        """Undo every update the backward made of chunks whose state is in memory (a copy never filled: its
        update never began, nothing to put back)."""
        for undo in self.undo.copies():
            if undo.filled:
                self._undo_update(undo)
            else:
                self.undo.release(undo.chunk)

    def key(self, chunk: Chunk) -> tuple[Any, ...]:
        """What an update made in the backward assumed about ``chunk`` besides the multiplier: the parameters
        it steps (trainable, in which group, which part) and every group's hyper-parameters."""
        return self.rule.assumptions(chunk)

    def holds(self, multiplier: float) -> bool:
        """Whether the disk updates the backward started are the step's: the same multiplier (no clipping,
        the same loss scale) and nothing changed since (hyper-parameters, frozen parameters)."""
        return all(update.multiplier == multiplier and self.speculated.get(update.chunk.index) == self.key(update.chunk)
                   for update in self.in_flight.updates)

    def take_in_flight(self) -> StreamedStep | None:
        """The streamed step the backward started (``None`` if none), handed over to ``step()``."""
        step, self.in_flight = self.in_flight, None
        self.speculated.clear()
        return step

    def abandon_in_flight(self) -> None:
        """Undo the disk updates the backward started (their slots were never committed; the parameters they
        overwrote in host memory are put back bitwise), if any. The host copy each put back is then the
        parameters' current one: a device copy fetched from it meanwhile (a forward between the backward and the
        step) held the undone update's values, and a read after ``zero_grad()`` showed them."""
        step = self.take_in_flight()
        if step is None:
            return
        try:
            step.abandon()
        finally:
            for update in step.updates:
                if update.updated_to and update.param is not None:
                    self.runtime.mark_updated(update.chunk, Tier.HOST)
