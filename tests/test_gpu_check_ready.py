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
