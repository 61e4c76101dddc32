"""One training step under torch's profiler, summed up for the GPU check's JSON: where a step's time goes.

A row of ``gpu_step.py`` named in ``--profile`` runs one more step under ``torch.profiler`` (CPU activity, and
CUDA activity where there is a GPU), each phase inside a ``record_function`` span named ``phase:<name>``. The
summary says, for the step and for each phase:

* ``host_ms``: how long the phase's calls took on the host (the span's wall time on the launching thread);
* ``device_ms``: the GPU time of the kernels and copies launched inside the span (where they ran);

and for the whole step: the wall time (``torch.cuda.synchronize()`` at the end), how long the GPU was busy
(the union of every kernel's and copy's interval: a phase that is bound by the host shows as a busy time far
below the wall time), the copies between host and GPU (count, bytes where the profiler records them,
milliseconds), and the host operators and GPU kernels that took the most time. The profiler's own overhead
lengthens the host side, so compare host times between rows of one call, not with the timed steps.

The trace itself (Chrome's format, gzip) goes to ``$OUT/profile-<row>.json.gz`` where ``$OUT`` is a directory,
for ``chrome://tracing`` or Perfetto.
"""
from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from typing import Callable

import torch

TOP = 12  # operators and kernels listed in each top list
PHASE_PREFIX = "phase:"


def profile_step(phases: list[tuple[str, Callable[[], None]]], row: str) -> dict:
    """Run ``phases`` (name, call) once, in order, under the profiler; returns the summary (module docstring).
    A profiler that fails leaves ``{"error": ...}``: the row's other figures stand."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for name, call in phases:
                with record_function(PHASE_PREFIX + name):
                    call()
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3
        summary = summarize(prof, wall_ms)
        summary["trace"] = _save_trace(prof, row)
        return summary
    except Exception as error:  # noqa: BLE001 - a figure missing is better than a row lost
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def summarize(prof, wall_ms: float) -> dict:
    """The figures of a finished ``torch.profiler.profile`` (see the module docstring)."""
    averages = prof.key_averages()
    phases = {}
    for avg in averages:
        if avg.key.startswith(PHASE_PREFIX):
            phases[avg.key[len(PHASE_PREFIX):]] = dict(host_ms=_ms(avg.cpu_time_total), device_ms=_ms(_device_total(avg)))
    device_events = [e for e in prof.events() if _on_device(e)]
    copies = [e for e in device_events if "memcpy" in e.name.lower()]
    host_ops = sorted((a for a in averages if not a.key.startswith(PHASE_PREFIX)),
                      key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP]
    kernels = sorted((a for a in averages if _device_self(a) > 0), key=_device_self, reverse=True)[:TOP]
    return dict(
        wall_ms=round(wall_ms, 2),
        device_busy_ms=round(_union_ms(device_events), 2),
        phases=phases,
        copies=dict(count=len(copies), ms=round(sum(e.time_range.elapsed_us() for e in copies) / 1e3, 2),
                    bytes=sum(int(getattr(e, "nbytes", 0) or 0) for e in copies) or None),
        top_host_ops=[dict(name=a.key[:80], count=a.count, self_ms=_ms(a.self_cpu_time_total)) for a in host_ops],
        top_device=[dict(name=a.key[:80], count=a.count, ms=_ms(_device_self(a))) for a in kernels],
    )


def format_summary(summary: dict) -> str:
    """Two or three lines for the table: the step's wall and busy times, each phase's host and device time."""
    if "error" in summary:
        return f"profile: {summary['error']}"
    phases = ", ".join(f"{name} {p['host_ms']}/{p['device_ms']}" for name, p in summary["phases"].items())
    host = ", ".join(f"{op['name']} {op['self_ms']}" for op in summary["top_host_ops"][:4])
    return (f"profile: wall {summary['wall_ms']} ms, GPU busy {summary['device_busy_ms']} ms; host/GPU ms by phase: "
            f"{phases}; copies {summary['copies']['count']} ({summary['copies']['ms']} ms)\n"
            f"         most host time: {host}")


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _device_total(avg) -> float:  # torch renamed cuda_* to device_* (2.4); either is microseconds
    return getattr(avg, "device_time_total", None) or getattr(avg, "cuda_time_total", 0) or 0


def _device_self(avg) -> float:
    return getattr(avg, "self_device_time_total", None) or getattr(avg, "self_cuda_time_total", 0) or 0


def _on_device(event) -> bool:
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def _union_ms(events) -> float:
    """Milliseconds covered by at least one of ``events``' intervals (overlapping kernels counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    covered, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        covered += b - max(a, end)
        end = b
    return covered / 1e3


def _save_trace(prof, row: str) -> str | None:
    out = os.environ.get("OUT")
    if not out or not os.path.isdir(out):
        return None
    path = os.path.join(out, f"profile-{row.replace(':', '-')}.json.gz")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        raw = tmp.name
    try:
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    finally:
        os.unlink(raw)
    return path
