"""Shared pieces of the memory and scaling benchmarks: the GPT they train (:mod:`chunkmem.gpt`, named
here for the scripts), the machine header, RSS helpers and a log-log fit."""
from __future__ import annotations

import math
import os
import platform
import resource
import sys
import psutil
import torch

from chunkmem.gpt import (GPT, GPTConfig, UpcastLinear, chunk_layout, count_params, param_numels,  # noqa: F401
                          params_per_layer)


# ---- measurements --------------------------------------------------------------------------------------

def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb * 1024 if sys.platform != "darwin" else kb


def loglog_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- the header ------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_kind() -> str:
    """The CPU model and the vector extensions that set the figures' kind (from /proc/cpuinfo)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16")
    return f"{cpu_model()} ({', '.join(f for f in wanted if f in flags) or 'no AVX2'})"


def machine_header() -> str:
    vm = psutil.virtual_memory()
    load = os.getloadavg()
    cuda = torch.cuda.is_available()
    return (f"machine: {cpu_kind()}, {os.cpu_count()} cores, {vm.total / 2**30:.1f} GiB RAM "
            f"({vm.available / 2**30:.1f} GiB available), torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads, "
            f"CUDA {'available' if cuda else 'not available (the device tier is the CPU under a capacity)'}, "
            f"1-min load average {load[0]:.2f}")


def run_two_gloo_ranks(target, *args) -> dict:
    """Run ``target(rank, port, *args, results)`` on two spawned processes that form a gloo group on a
    free local port; returns what they put into ``results`` (a shared dict)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(target, args=(port, *args, results), nprocs=2)
    return dict(results)
