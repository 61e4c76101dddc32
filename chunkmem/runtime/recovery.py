"""An iteration that stopped on an error, put behind so that the next one starts as after a finished one.

The runtime calls :func:`recover_interrupted` when an iteration is found still running (a forward or
backward raised: ``abandon_iteration``, or the next forward or step finds it so). Every hold is released,
the unfinished gradients are dropped, and every chunk goes back where it rests. Where the error came in the
backward, every pending gradient goes too, those of the chunks it had finished and those accumulated by
earlier backwards (they share the buffers its partial sums went into), and the optimizer undoes the updates
it started (:meth:`~chunkmem.runtime.optimizer_link.OptimizerListener.on_backward_failed`): the next
``step()`` has nothing to apply, as if the failed iteration had not happened. (Before 2026-11-27 the
finished chunks' gradients stayed and joined the next step.)

After a failed collective nothing is recovered (the process group is unusable, and a chunk's gather may
still be in flight in it): the next forward raises (:func:`refuse_after_failed_collective`).
"""
from __future__ import annotations

from ..distributed.collectives import CollectiveError
from .executor import ChunkExecutor
from .frozen_chunks import FrozenHolds
from .gradient_landing import GradientLanding
from .optimizer_link import OptimizerLink


def recover_interrupted(executor: ChunkExecutor, landing: GradientLanding, optimizer: OptimizerLink,
                        frozen: FrozenHolds, failed_backward: bool) -> None:
    """Release what the interrupted iteration held and drop its unfinished gradients (``failed_backward``:
    the error came in its backward; see the module docstring)."""
    executor.cancel_prefetch()
    landing.complete_reductions(0)  # a started collective cannot be called back; its result is kept
    listener = optimizer.listener()
    if failed_backward and listener is not None:
        try:  # the updates still running read gradients and write chunks: let them end first
            listener.on_backward_end()
        except Exception:  # (the backward failed already: on_backward_failed below undoes what they did)
            pass
    executor.drop_secondaries()
    frozen.clear()
    for chunk in executor.chunks:
        chunk.unhold()
        landing.abandon(chunk)
    executor.settle_all()
    executor.flush_stale()
    if failed_backward:
        landing.drop_after_failed_backward()


def refuse_after_failed_collective(failed: CollectiveError | None) -> None:
    """Raise a :class:`~chunkmem.CollectiveError` naming ``failed``, the first collective that failed, if any."""
    if failed is not None:
        raise CollectiveError(f"a forward after a failed collective ({failed}): the process group is unusable; "
                              f"end every rank and restart from a checkpoint", failed.collective, failed.what,
                              failed.rank, failed.world) from failed
