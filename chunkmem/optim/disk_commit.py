"""The step's all-or-nothing part: the streamed update of the chunks whose optimizer state rests on disk, and
what is left when it fails.

:meth:`DiskCommit.run` updates every such chunk in one :class:`~chunkmem.optim.disk_step.StreamedStep` (with
``step_in_backward``, the one the backward started, completed with any chunk it did not get, or redone where the
step decided otherwise), then advances their step counts and marks their parameters updated. With
``atomic_step=True`` a failure leaves everything as before the step; with ``atomic_step=False`` the chunks are
written in place, a failure cannot be undone and the optimizer refuses to step (:attr:`DiskCommit.broken_by`)
until a state dict or checkpoint is loaded.
"""
from __future__ import annotations

from typing import NoReturn

from ..core.chunk import Chunk
from ..core.tiers import Tier
from ..errors import ChunkmemError, UnsupportedOperationError
from ..runtime.runtime import ChunkRuntime
from .backward_accounting import BackwardAccounting
from .backward_step import BackwardStep
from .disk_step import ChunkUpdate, DiskStepError, StreamedStep
from .mixed_precision import MixedPrecisionStep
from .update_rule import UpdateRule


class DiskCommit:
    """One optimizer's streamed disk step and its commit (see the module docstring).

    Args:
        runtime: the model's runtime.
        rule: the chunk update rule (what each chunk's update is, and its completion).
        backward: what the backward started under ``step_in_backward`` (and whether it could be undone).
        mixed: the mixed-precision step (the ranks' agreement on a failure).
        accounting: the optimizer's backward accounting (gradients dropped with a failed step).
    """

    def __init__(self, runtime: ChunkRuntime, rule: UpdateRule, backward: BackwardStep, mixed: MixedPrecisionStep,
                 accounting: BackwardAccounting) -> None:
        self.runtime = runtime
        self.rule = rule
        self.backward = backward
        self.mixed = mixed
        self.accounting = accounting
        self.broken_by: ChunkmemError | None = None  # a failed step that could not be undone

    def run(self, chunks: list[Chunk], multiplier: float) -> None:
        """Update ``chunks`` (their optimizer state on disk) in one streamed step: all of them, or none (then
        :class:`~chunkmem.optim.disk_step.DiskStepError`). With ``step_in_backward``, the step the backward
        started, completed with any chunk it did not get."""
        if not self.runtime.policy.optimizer_on_disk:
            return  # (with a disk tier every rank runs the step below, even with no chunk on disk: it agrees)
        backward = self.backward
        stale = backward.in_flight is not None and not backward.holds(multiplier)
        if backward.settings.step_in_backward:  # every rank keeps, redoes or refuses the backward's updates alike
            stale = self.mixed.any_rank(stale)
        if stale:
            reason = backward.no_speculation
            if reason is not None:  # (fp16 and clipping were refused: the hyper-parameters changed)
                self._refuse_redo(reason)
            backward.abandon_in_flight()  # clipped, or the hyper-parameters changed: redone below
        step = backward.take_in_flight()
        kept = 0 if step is None else len(step.updates)
        if step is None:
            step = StreamedStep.over(self.runtime.memory.disk, [self.rule.disk_update(c, multiplier) for c in chunks],
                                     self.mixed.any_rank, self.rule.streamed_settle())
            finish = step.run
        else:
            started = {id(update.chunk) for update in step.updates}
            for chunk in chunks:
                if id(chunk) not in started:
                    step.add(self.rule.disk_update(chunk, multiplier))
            finish = step.finish
        updates = step.updates
        try:
            finish()
        except BaseException as exc:  # an I/O error (DiskStepError), or a crash, which an atomic step undid too
            undone = exc.undone if isinstance(exc, DiskStepError) else self.runtime.memory.disk.atomic_step
            if not undone:
                self.broken_by = exc if isinstance(exc, DiskStepError) else _broken_by_crash(exc)
            elif self.runtime.gradients.overwritten_by_update:
                self.accounting.discard_gradients()  # the update overwrote them in place
            else:
                for update in updates:
                    if update.updated_to and update.param is not None:
                        self.runtime.mark_updated(update.chunk, Tier.HOST)
            raise
        backward.kept += kept
        self._completed(updates)

    def _completed(self, updates: list[ChunkUpdate]) -> None:
        """The streamed step wrote ``updates``: their chunks' step counts, kept state and parameters."""
        for update in updates:
            self.rule.completed(update)
            self.runtime.mark_updated(update.chunk, Tier.DISK if update.param is None else Tier.HOST)

    def _refuse_redo(self, reason: str) -> NoReturn:
        """The backward's disk updates are not this step's (hyper-parameters or trainable parameters changed
        in between) and cannot be redone (``reason``): raise, leaving the state as before the backward where
        the updates can be undone, else the optimizer broken until a state is loaded (as a failed step)."""
        message = ("optim.step() after a backward with step_in_backward=True: the hyper-parameters, the "
                   "trainable parameters or (stochastic rounding) the default random generator's state changed "
                   "between the backward and the step (on one rank at least), but the backward's updates of the "
                   f"chunks on disk used the old ones and with {reason} they cannot be redone; change hyper-parameters after optim.step(), "
                   "as LR schedulers do, and draw no random numbers between the backward and the step. ")
        if self.runtime.memory.disk.atomic_step:
            self.backward.abandon_in_flight()
            self.backward.undo_in_memory()
            self.accounting.discard_gradients()
            raise UnsupportedOperationError(message + "The step was skipped: parameters and optimizer state are "
                                            "as before the backward, its gradients dropped")
        step = self.backward.take_in_flight()
        step.finish()  # the chunks it started are written in place: complete them, nothing else
        self._completed(step.updates)
        self.broken_by = UnsupportedOperationError(
            message + "The chunks the backward started were updated in place with the old values, the others "
                      "not: load a checkpoint (chunkmem.load_checkpoint) to step again")
        raise self.broken_by

    def after_failed_backward(self) -> bool:
        """A backward raised part-way after starting updates in place on disk (``atomic_step=False``): they
        cannot be undone, so those it started are completed (its I/O buffers returned), every other update it
        made is undone, the gradients are dropped and the optimizer is broken until a state is loaded. Returns
        whether that was the case (``False``: nothing done, the caller drops the step as ``zero_grad`` does)."""
        if self.backward.in_flight is None or self.runtime.memory.disk.atomic_step:
            return False
        step = self.backward.take_in_flight()
        try:
            step.finish()
        finally:
            self._completed(step.updates)
            self.broken_by = UnsupportedOperationError(
                "a backward raised after step_in_backward=True had updated chunks in place on disk "
                "(atomic_step=False): those updates cannot be undone and the other chunks were not updated; "
                "load a checkpoint (chunkmem.load_checkpoint) or a state dict to step again")
            self.backward.undo_in_memory()
            self.accounting.discard_gradients()
        return True


def _broken_by_crash(crash: BaseException) -> UnsupportedOperationError:
    """What the next step raises after ``crash`` (an exception other than an I/O error) interrupted a streamed
    step writing the chunks on disk in place: some chunks were updated, the others not."""
    error = UnsupportedOperationError(
        f"an earlier optim.step() raised {type(crash).__name__} ({crash}) while it updated the chunks on disk in "
        "place (atomic_step=False): the chunks before it were updated, the others not, and that cannot be undone; "
        "load a checkpoint (chunkmem.load_checkpoint) or a state dict to step again")
    error.__cause__ = crash
    return error
