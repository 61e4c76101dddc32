"""Run a function on several gloo processes on this machine and collect what each rank returns.

The ranks are fresh processes forked from a ``forkserver`` that imported torch and chunkmem once (and nothing
else: no test's state), instead of interpreters that each import torch again (a 2-rank test measured 0.6 s
instead of 4.9 s on this 2-core machine under load). Each rank takes the caller's environment at the call
(as a spawned one would), not the server's."""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# imported by the server before any rank is forked from it: modules a rank would import first anyway
PRELOAD = ["torch", "torch.distributed", "chunkmem"]


def _entry(rank: int, world: int, workdir: str, fn: Callable[..., Any], args: tuple,
           environment: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment at the call, not the server's at its start
    os.environ.update(environment)
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w")  # what a rank that dies leaves behind
    faulthandler.enable(log)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    open(os.path.join(workdir, f"joined{rank}"), "w").close()
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
        _wait_for_all_results(workdir, world)
    except BaseException:
        traceback.print_exc(file=log)
        log.flush()
        raise
    finally:
        dist.destroy_process_group()
    # The result is saved and every rank is done: leave without the interpreter's teardown, in which
    # gloo's threads occasionally abort the process ("terminate called without an active exception",
    # no Python frame left) after all of chunkmem's work finished.
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wait_for_all_results(workdir: str, world: int, limit: float = 120.0) -> None:
    """No rank tears the group down while another still runs its last collective. The wait goes through
    files, not the group: a test may leave the group unusable on purpose (a timed-out collective)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(workdir, f"result{r}.pt")) for r in range(world)):
            return
        time.sleep(0.02)


class _GroupNeverFormed(Exception):
    pass


def run_ranks(fn: Callable[..., Any], world: int = 2, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes joined in a gloo group; returns each
    rank's result (anything ``torch.save`` takes). A rank that raises fails the call with its traceback.

    gloo's rendezvous occasionally aborts a process here (``terminate called without an active
    exception``) before any chunkmem code runs; only that case, a rank dying before every rank joined
    the group, is retried (twice at most). A rank dying later fails the call."""
    for attempt in range(3):
        try:
            return _spawn_once(fn, world, args)
        except _GroupNeverFormed:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _spawn_once(fn: Callable[..., Any], world: int, args: tuple) -> list[Any]:
    with tempfile.TemporaryDirectory() as workdir:
        try:
            context = mp.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
            mp.start_processes(_entry, args=(world, workdir, fn, args, dict(os.environ)), nprocs=world, join=True,
                               start_method="forkserver")
        except Exception as exc:
            joined = all(os.path.exists(os.path.join(workdir, f"joined{r}")) for r in range(world))
            if not joined and isinstance(exc, mp.ProcessExitedException):
                raise _GroupNeverFormed(str(exc)) from exc
            logs = [open(os.path.join(workdir, f"rank{r}.log")).read() for r in range(world)
                    if os.path.exists(os.path.join(workdir, f"rank{r}.log"))]
            raise RuntimeError(f"{exc}\n" + "\n".join(f"--- rank {r} ---\n{text}" for r, text in enumerate(logs))) \
                from exc
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(world)]
