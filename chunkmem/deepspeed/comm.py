"""``deepspeed.comm``: the rank, world size, barrier and collectives a DeepSpeed script calls, over
``torch.distributed``. Without an initialised process group there is one process: rank 0 of 1, and the
collectives leave their tensors as they are (the sum, mean, max or gather over one rank)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "get_local_rank",
           "get_rank", "get_world_size", "init_distributed", "is_initialized", "reduce_scatter_tensor"]


def is_initialized() -> bool:
    """Whether ``torch.distributed`` has a process group."""
    return dist.is_available() and dist.is_initialized()


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """:func:`chunkmem.deepspeed.init_distributed`."""
    from . import init_distributed as init
    init(*args, **kwargs)


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def _many(group: Any) -> bool:
    return is_initialized() and dist.get_world_size(group) > 1


def barrier(group: Any = None) -> None:
    if _many(group):
        dist.barrier(group)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """In place over ``group`` (nothing to do on one rank)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op) if _many(group) else None


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op) if _many(group) else None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    if _many(group):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    if _many(group):
        return dist.all_gather_into_tensor(output, tensor, group=group, async_op=async_op)
    output.copy_(tensor.reshape(output.shape))
    return None


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Any:
    if _many(group):
        return dist.reduce_scatter_tensor(output, tensor, op=op, group=group, async_op=async_op)
    output.copy_(tensor.reshape(output.shape))
    return None
