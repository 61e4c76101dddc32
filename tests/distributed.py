"""Run a function on several gloo processes on this machine and collect what each rank returns."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, workdir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes joined in a gloo group; returns each
    rank's result (anything ``torch.save`` takes). A rank that raises fails the call with its traceback."""
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_entry, args=(world, workdir, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(world)]
