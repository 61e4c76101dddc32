"""The gradient norm's sums of squares, taken as the gradients land on the host.

A step that clips (``max_norm``, ``optim.clip_grad_norm``) or checks fp16 gradients for an overflow needs the
norm of every gradient before its first update. Taken in ``step()``, that is one more pass over every
gradient byte on the host (for a 336M model in fp32, 1.3 GB: tens of milliseconds) after the backward, while
the GPU waits. Where a gradient's copy to the host completes after it is issued (the ``cuda`` copy engine,
and the ``deferred`` test engine), :class:`SquaresAhead` instead hands each chunk's flat gradient, as soon as
it is final, to a thread (a :class:`~chunkmem.optim.host_updates.HostUpdates`), which waits for the copy and
computes its :func:`~chunkmem.optim.norms.sum_of_squares` (a job that fails leaves no term). The backward's
end joins the jobs; ``step()`` then reads each term instead of computing it. The norm adds the terms in
packing order whichever computed them (:meth:`~chunkmem.optim.mixed_precision.MixedPrecisionStep.total_norm`),
and the sum of squares does not depend on the thread, so the bits are the same.

A term is used only for the tensor it was taken of: the same memory, length and dtype, and the same version, so
no in-place write through it or a view of it since (``clip_grad_value_``'s clamp, a folded scaling of ``.grad``,
``p.grad = None`` zeroing its part). A later backward reaching the chunk replaces it, and where gradient memory
may be freed and used again (``zero_grad``, the step once it has read the norm, a failed backward) every term is
forgotten (:meth:`SquaresAhead.forget`). A term that is missing is computed by the step as before. With plain copies (a
CPU-only machine) nothing is taken ahead: the device and the host are the same cores.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..core.chunk import Chunk
from ..core.tiers import Tier
from .host_updates import HostUpdates
from .mixed_precision import counts_in_norm
from .norms import SUMMED_DTYPES, sum_of_squares


class SquaresAhead:
    """One optimizer's sums of squares taken as gradients land (see the module docstring), as jobs of ``jobs``:
    the thread of the updates ``step_in_backward`` runs off autograd's, so that one thread at a time waits for a
    gradient's copy, and an update reads its gradient after its term was taken. ``used``: how many terms norms
    have read instead of computing them (since the optimizer was built)."""

    def __init__(self, jobs: HostUpdates) -> None:
        self._jobs = jobs
        self._terms: dict[tuple[int, int], tuple[tuple, float]] = {}  # key -> (what it was taken of, squares)
        self.used = 0

    @staticmethod
    def _identity(tensor: torch.Tensor) -> tuple:
        """What a term stands for: the tensor's memory, length and dtype, and its version (torch counts every
        in-place write through it or a view of it: ``p.grad = None`` zeroes its part of the chunk's gradient)."""
        return tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor._version

    def take(self, runtime: Any, chunk: Chunk, norm_next: bool) -> None:
        """``chunk``'s gradients are final: where the next step takes the norm (``norm_next``) and the gradient's
        copy to the host completes late, have the sum of squares of its flat gradient taken as soon as it lands.
        Not for a gradient kept in pieces, one on the device, nor one the disk step reads on its own thread."""
        if not (norm_next and runtime.memory.copies.asynchronous and chunk.trainable and counts_in_norm(chunk)
                and runtime.optim_tier(chunk) is not Tier.DISK and runtime.grad_pieces(chunk) is None):
            return
        grad, landed = runtime.grad_landing(chunk)
        if grad.device.type == "cpu" and grad.dtype in SUMMED_DTYPES:
            self.submit((chunk.index, 0), grad, landed)

    def submit(self, key: tuple[int, int], tensor: torch.Tensor, landed: Callable[[], None]) -> None:
        """Take the sum of squares of ``tensor`` (the norm's term ``key``) on the thread, once ``landed()`` (which
        waits for its copy to the host) returns; it replaces an earlier term of ``key``."""
        self._terms.pop(key, None)
        result: list[tuple[tuple, float]] = []

        def work() -> None:
            try:
                landed()
                squares = sum_of_squares(tensor)
                result.append((self._identity(tensor), squares))  # (the version after the copy's write)
            except Exception:  # noqa: BLE001 - no term: the step computes it, and meets the error itself
                pass

        def then() -> None:
            if result:
                self._terms[key] = result[0]

        self._jobs.submit(work, then, f"sum of squares {key}")

    def join(self) -> None:
        """Wait for the jobs and keep their terms (the backward's end: nothing writes the gradients before)."""
        if self._jobs.pending:
            self._jobs.join()

    def squares(self, key: tuple[int, int], tensor: torch.Tensor) -> float | None:
        """The term ``key`` taken ahead of ``tensor``, or ``None`` (not taken, or of other memory)."""
        term = self._terms.get(key)
        if term is None or term[0] != self._identity(tensor):
            return None
        self.used += 1
        return term[1]

    def forget(self) -> None:
        """The gradients may have changed: wait for the jobs and drop every term."""
        self.join()
        self._terms.clear()
