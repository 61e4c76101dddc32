"""What a mixed-precision step decides before any update, the same for both optimizers.

:class:`MixedPrecisionStep` holds the loss scaler (fp16 only: bf16 and fp32 train unscaled and never
skip a step, as plain PyTorch) and the clipping of the step to come. :meth:`MixedPrecisionStep.decide`
takes this rank's gradient shards and returns the multiplier the update applies to them (unscaling
and clipping folded into one factor), or ``None`` when the step is skipped: some rank's gradients hold
inf or NaN while a loss scaler is in use. The gradient norm is reduced over the data-parallel ranks
(and a model-parallel group) with one small all-reduce, so every rank decides the same.

Clipping follows ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))`` over the
unscaled gradients; a non-finite norm (possible without a scaler) clips nothing.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from ..distributed.collectives import all_reduce_over
from .loss_scaler import DynamicGradScaler
from .norms import SUMMED_DTYPES, sum_of_squares


class KeyedGradient(NamedTuple):
    """A gradient for :meth:`MixedPrecisionStep.total_norm` with the place of its term in the norm's sums
    (``key``: a tuple; terms are added in the order of their keys) and, where it was taken ahead
    (:mod:`chunkmem.optim.squares_ahead`), its sum of squares (the 2-norm's term of a CPU tensor)."""

    key: tuple[int, ...]
    tensor: torch.Tensor | None
    squares: float | None = None


class MixedPrecisionStep:
    """The scaler and clipping of one optimizer (see the module docstring). ``groups``: the process groups
    the norm is reduced over (``None`` entries and groups of one rank are skipped)."""

    def __init__(self, scaler: DynamicGradScaler | None, groups: Iterable[Any], verbose: bool = False) -> None:
        self.scaler = scaler
        self.groups = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
        self.verbose = verbose
        self.clip_coef = 1.0
        self.factors: dict[int, float] = {}  # id(slot) -> what torch's in-place idioms multiplied its gradient by
        self.factors_since: int | None = None  # the model's backward count when the first factor came
        self.scaled_by = 1.0  # the one factor of ``factors`` the coming step applies (set by the step)
        self.norm: float | None = None  # the unscaled norm an explicit clip computed for the coming step
        self.last_norm: float | None = None  # the unscaled norm the last step computed (clipping, overflow check)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def multiplier(self) -> float:
        """What the coming step multiplies the gradients by: the clipping coefficient (and the factor of
        torch's in-place idioms, :mod:`chunkmem.optim.gradient_idioms`) over the loss scale."""
        return self.clip_coef * self.scaled_by / self.loss_scale

    def total_norm(self, grads: Iterable[torch.Tensor | KeyedGradient | None], norm_type: float = 2.0) -> float:
        """The ``norm_type`` norm of all unscaled gradients (this rank's shards of them, reduced over the
        ranks): inf or NaN when some rank's gradients overflowed. One host synchronisation per device
        holding gradients and one all-reduce per group. The 2-norm of CPU tensors comes from
        :func:`~chunkmem.optim.norms.sum_of_squares` (exact squares, a fixed order, the bandwidth bound).

        The gradients are read in the order ``grads`` gives them (reading one may wait for its copy to the
        host, so a caller gives first those that landed first); a :class:`KeyedGradient` says where its term
        comes in the sums (plain tensors come in the order given), so the bits do not depend on the reading
        order."""
        host_terms: list[tuple[Any, float]] = []  # the 2-norm's sums of squares of CPU gradients, exact squares
        device_terms: list[tuple[Any, torch.Tensor]] = []
        for position, item in enumerate(grads):
            item = item if isinstance(item, KeyedGradient) else KeyedGradient((position,), item)
            key, grad = item.key, item.tensor
            if grad is None:
                continue
            if norm_type == 2.0 and grad.device.type == "cpu" and grad.dtype in SUMMED_DTYPES:
                host_terms.append((key, item.squares if item.squares is not None else sum_of_squares(grad)))
                continue
            device_terms.append((key, torch.linalg.vector_norm(grad, norm_type, dtype=torch.float32)))
        host_squares = 0.0
        for _, squares in sorted(host_terms, key=lambda term: term[0]):
            host_squares += squares
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, norm in sorted(device_terms, key=lambda term: term[0]):
            by_device.setdefault(norm.device, []).append(norm)
        if math.isinf(norm_type):
            local = max((torch.stack(ns).max().item() for ns in by_device.values()), default=0.0)
        else:
            local = host_squares + sum(torch.stack(ns).double().pow(norm_type).sum().item()
                                       for ns in by_device.values())
        total = self._reduce_over_ranks(local, maximum=math.isinf(norm_type))
        if not math.isinf(norm_type):
            total = total ** (1 / norm_type)
        return total / self.loss_scale * abs(self.scaled_by)

    def clip(self, grads: Iterable[torch.Tensor | KeyedGradient | None], max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the coming step's gradients to total norm ``max_norm``; returns the unscaled total norm."""
        norm = self.total_norm(grads, norm_type)
        self.norm = norm
        self.clip_coef = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        return norm

    def decide(self, grads: Callable[[], Iterable[torch.Tensor | KeyedGradient | None]], max_norm: float = 0.0,
               norm_type: float = 2.0) -> float | None:
        """The multiplier of the coming update, or ``None`` when the step is skipped (an overflow with a
        loss scaler: the scale backs off). ``grads()`` gives the gradients, and is called only where the
        norm is needed: reading a gradient waits for its copy to the host, and a step that needs no norm
        waits for each one only as it updates it. ``max_norm`` > 0 clips, unless :meth:`clip` already ran
        for this step (the explicit clipping is the one applied)."""
        if max_norm > 0 and self.norm is None:
            self.clip(grads(), max_norm, norm_type)
        self.last_norm = self.norm
        if self.scaler is not None:
            norm = self.norm if self.norm is not None else self.total_norm(grads())
            self.last_norm = norm
            if not math.isfinite(norm):
                if self.verbose:
                    print(f"chunkmem: gradient overflow, step skipped (loss scale {self.loss_scale})")
                self.scaler.update(overflow=True)
                self.forget()
                return None
        return self.multiplier

    def takes_norm_next(self, max_norm: float, norm_type: float) -> bool:
        """Whether the next step will likely take the 2-norm of the gradients: fp16's overflow check, clipping to
        ``max_norm`` (of ``norm_type``), or an explicit clipping as the last step had."""
        return self.scaler is not None or self.last_norm is not None or (norm_type == 2.0 and max_norm > 0)

    def nothing_to_step(self) -> None:
        """A step found no gradients: it computed no norm (``last_norm`` is ``None``, not the last step's)."""
        self.last_norm = None

    def stepped(self) -> None:
        """The update ran: the scaler counts a good step and the clipping is forgotten."""
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        self.forget()

    def forget(self) -> None:
        """The gradients are gone (stepped, skipped or dropped): no clipping decided for the next step."""
        self.clip_coef, self.norm, self.scaled_by = 1.0, None, 1.0
        self.factors, self.factors_since = {}, None

    def any_rank(self, failed: bool) -> bool:
        """Whether ``failed`` holds on any rank of the groups (one small all-reduce)."""
        return math.isnan(self._reduce_over_ranks(float("nan") if failed else 0.0, maximum=True))

    def _reduce_over_ranks(self, local: float, maximum: bool) -> float:
        """Sum (or max) of ``local`` over the groups; a rank whose value is inf or NaN makes the result NaN
        (a max reduction would drop a NaN)."""
        if not self.groups:
            return local
        pair = torch.tensor([local if math.isfinite(local) else 0.0, 0.0 if math.isfinite(local) else 1.0],
                            dtype=torch.float64)
        for group in self.groups:
            all_reduce_over(group, pair, dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM,
                            what="the gradient norm and its non-finite flag")
        return float("nan") if pair[1].item() else pair[0].item()


def counts_in_norm(chunk: Any) -> bool:
    """Whether this rank's gradients of ``chunk`` are terms of the global norm: its shard, or a replicated chunk's
    whole gradients on the first rank only (every rank holds the same; the norm sums over the ranks)."""
    return chunk.replicas is None or chunk.replicas.rank == 0


def landed_gradients(runtime: Any, ahead: Any = None) -> Iterator[KeyedGradient]:
    """This rank's gradients of ``runtime``'s chunks for the global norm (:func:`counts_in_norm`), yielded in the
    order they landed, each read only when the norm gets to it: the norm of the first to land is taken while the
    backward still computes the last; keyed by packing order, in which the norm adds them; with the sums of
    squares ``ahead`` (a :class:`~chunkmem.optim.squares_ahead.SquaresAhead`) took of them."""
    for chunk in runtime.trainable_chunks_as_gradients_landed():
        if counts_in_norm(chunk):
            for i, tensor in enumerate(runtime.grad_tensors(chunk)):
                key = (chunk.index, i)
                yield KeyedGradient(key, tensor, None if ahead is None else ahead.squares(key, tensor))
