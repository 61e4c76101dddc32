"""The moves planned when a new schedule was traced: the ranks agree on the traced peaks (the runtime's one
planning collective: every rank must fetch the same chunks in the same order), the scheduler plans the
moves (:meth:`~chunkmem.runtime.schedule.Scheduler.schedule_moves`), and the optimizer state of the chunks
it keeps in the device's margin moves there, each chunk's gradient buffer with it.
"""
from __future__ import annotations

import torch

from ..core.chunk import MASTER, Chunk
from ..core.tiers import Tier
from ..distributed.collectives import ShardGroup
from ..distributed.reduction import GradientReduction
from .executor import ChunkExecutor
from .gradients import GradientStore
from .schedule import MoveInputs, Scheduler


def schedule_traced_moves(scheduler: Scheduler, executor: ChunkExecutor, gradients: GradientStore,
                          reduction: GradientReduction, data_parallel: ShardGroup) -> None:
    """A new schedule was traced: agree on its peaks over ``data_parallel``, plan it, and move the margin's
    optimizer state to the device."""
    chunks = executor.chunks
    if not chunks:
        return
    peaks = [p.non_model_peak for p in scheduler.periods or []]
    shards = data_parallel
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
    inputs = MoveInputs(executor.memory.ledger.capacity, largest.param.nbytes,
                        _optimizer_group_bytes(largest_trainable, gradients) if optimizer_state else 0,
                        gradients.in_param_memory, reduction.shards.sharded, peaks)
    for index in scheduler.schedule_moves(inputs):
        gradients.flatten(chunks[index])  # its gradient buffer moves with the state
        executor.move_optimizer_state(chunks[index], Tier.DEVICE)
        executor.settle(chunks[index])


def _optimizer_group_bytes(chunk: Chunk, gradients: GradientStore) -> int:
    """Device bytes of one chunk kept there with its optimizer state: this rank's shard of the optimizer
    families (the master and the state, as allocated: 8-bit codes and scales too) and of the gradient, the full
    parameter copy, and (sharded) the parameter shard."""
    families = sum(chunk.optim[f].nbytes for f in chunk.state_families + ((MASTER,) if chunk.has_master else ()))
    shard_bytes = chunk.param.shard.nbytes
    return (families + chunk.param.nbytes + (shard_bytes if chunk.param.sharded else 0)
            + gradients.grad_bytes(chunk))
