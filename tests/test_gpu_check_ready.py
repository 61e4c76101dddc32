"""The GPU check's training rows (benchmarks/gpu_step.py) run end to end on the CPU, so a session that is lent a
GPU finds them working: the CUDA calls the child makes are stood in for, the copy engine is the deferred one
(the path CUDA takes: copies complete late, step_in_backward's updates run off autograd's thread), and the row
it returns carries the figures and the host timeline the table prints."""
from __future__ import annotations

import faulthandler
import importlib
import sys
from pathlib import Path

import pytest
import torch

from chunkmem.core import copy_engine

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def gpu_step(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("gpu_step")
    monkeypatch.setitem(module.SIZES, "tiny", dict(vocab=128, d=32, layers=3, heads=2, seq=16, batch=2))
    for name, value in [("set_device", lambda device: None), ("reset_peak_memory_stats", lambda: None),
                        ("synchronize", lambda: None), ("max_memory_allocated", lambda: 0),
                        ("get_device_name", lambda: "CPU stand-in")]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    monkeypatch.setenv(copy_engine.ENGINE_ENV, "deferred")
    yield module
    faulthandler.cancel_dump_traceback_later()  # (the child arms it for a hanging row)
    sys.modules.pop("gpu_step", None)


@pytest.mark.parametrize("row", ["cm-cpu:fp32", "cm-cpu:bf16:sib"])
def test_a_chunkmem_row_runs_and_reports_its_host_timeline(gpu_step, row):
    result = gpu_step.child(row, "tiny", warmup=1, steps=2, limit=600, margin=0.0)
    assert "error" not in result, result
    config, dtype, sib = gpu_step.parse_row(row)
    assert len(result["times"]) == 2 and result["copy_engine"]["engine"] == "deferred"
    assert result["traces"].startswith("1 of ")  # traced once, then followed (a row that retraced every step says so)
    timeline = result["host_timeline_ms"]
    assert timeline["forward returned"] <= timeline["backward returned"] <= timeline["step returned"]
    if sib:  # the updates ran in the backward, on the update thread, in the order the gradients landed
        jobs = timeline["backward jobs"]
        assert jobs and not timeline["updates"]
        assert all(handed <= began <= ended for _, handed, began, ended in jobs)
        assert timeline["backward joined"][1] <= timeline["backward returned"]
    else:  # the step's, one per trainable chunk, after the backward returned
        assert len(timeline["updates"]) == result["chunks"] and "backward jobs" not in timeline
        assert all(timeline["backward returned"] <= start <= end for _, start, end in timeline["updates"])
    plain = dict(step_ms=1.0)
    table_row = gpu_step.make_row(config, dtype, sib, "tiny", result, plain, None, 1.0)
    assert table_row["host_timeline_ms"] == timeline and table_row["ratio"] is not None
    gpu_step.print_row(table_row)


@pytest.mark.parametrize("row", ["cm-cpu:bf16", "plain:fp32"])
def test_a_profiled_row_reports_where_its_step_went(gpu_step, row, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    result = gpu_step.child(row, "tiny", warmup=1, steps=1, limit=600, margin=0.0, profile=True)
    summary = result["profile"]
    assert "error" not in summary, summary
    expected = ["forward", "backward", "step"] if row.startswith("cm-") else ["step"]
    assert list(summary["phases"]) == expected
    assert all(p["host_ms"] > 0 and p["device_ms"] == 0 for p in summary["phases"].values())  # no GPU here
    assert sum(p["host_ms"] for p in summary["phases"].values()) <= summary["wall_ms"] * 1.01
    assert summary["device_busy_ms"] == 0 and summary["copies"]["count"] == 0
    assert summary["top_host_ops"] and all(op["self_ms"] >= 0 for op in summary["top_host_ops"])
    assert Path(summary["trace"]).stat().st_size > 0
    assert "wall" in gpu_step._step_profile.format_summary(summary)


def test_the_profile_counts_overlapping_device_intervals_once(gpu_step):
    class Range:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Event:
        def __init__(self, start, end):
            self.time_range = Range(start, end)

    events = [Event(0, 1000), Event(500, 1500), Event(600, 700), Event(3000, 3250)]  # microseconds
    assert gpu_step._step_profile._union_ms(events) == 1.75
