"""``deepspeed.comm``: the rank, world size, barrier and collectives a DeepSpeed script calls, over
``torch.distributed``. Without an initialised process group there is one process: rank 0 of 1, and the
collectives leave their tensors as they are (the sum, mean, max or gather over one rank)."""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.collectives import distributed_ready

ReduceOp = dist.ReduceOp

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "get_local_rank",
           "get_rank", "get_world_size", "init_distributed", "is_initialized", "reduce_scatter_tensor"]


def is_initialized() -> bool:
    """Whether ``torch.distributed`` has a process group."""
    return distributed_ready()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise ``torch.distributed`` unless it already is (DeepSpeed's signature). The backend defaults
    to ``nccl`` with CUDA, else ``gloo``. With a launcher's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``; ``MASTER_ADDR`` defaults to localhost, ``MASTER_PORT`` to
    ``distributed_port``) or an explicit ``rank``/``world_size`` the group is the launcher's; without
    either, one process forms a group of its own (in memory: no port is opened). ``auto_mpi_discovery``,
    ``verbose`` and ``config`` change nothing; ``dist_init_required=False`` does nothing."""
    if is_initialized() or dist_init_required is False:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank == -1 and "RANK" not in os.environ and init_method is None:  # no launcher: a group of one
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout, "init_method": init_method}
    if rank != -1:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


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
