"""chunkmem.choose against real runs: every candidate's bytes per tier (disk included), files, disk traffic
and host peak equal what a real run's ledger counts, at 1 and 2 ranks; the recommended candidate of a
sweep of budgets trains under those budgets; the recommendation is the fastest predicted candidate that
fits; the command line; initialize(plan=...). Times come from a fixed MachineProfile: no timing here. 8-bit
optimizer state: tests/test_choose_low_bit.py."""
from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.plan.cost_model import trace_compute
from chunkmem.plan.machine_profile import MachineProfile
from distributed import run_ranks
from models import resting_tier_bytes

CHUNK = 64 * 256 * 4
IO = 32768  # the disk tier's buffer_size in these tests (bytes)
PROFILE = dict(matmul_flops={"float32": 5e10, "bfloat16": 2e11, "float16": 2e9}, elementwise_bytes_per_s=5e9,
               adam_elements_per_s={"float32": 1e9, "bfloat16": 1.5e9, "float16": 1.5e9}, copy_bytes_per_s=5e9,
               disk_read_bytes_per_s=1e9, disk_write_bytes_per_s=5e8, collective_bytes_per_s=1e9,
               low_bit_adam_elements_per_s={"float32": 2.5e8, "bfloat16": 2.5e8, "float16": 2.5e8},
               rounded_adam_elements_per_s=2e8)


def profile(**changes) -> MachineProfile:
    return MachineProfile(**{**PROFILE, **changes})


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 8))


def real_run(candidate: cm.Candidate, batch: torch.Tensor, nvme_path: str, steps: int = 3) -> dict:
    """Build the candidate for real, train ``steps`` steps, return what its ledger counted (the last step's
    moves and disk traffic)."""
    model = cm.ShardedModelV2(build(), cm.TensorShardStrategy(), **candidate.model_config(nvme_path))
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3), initial_scale=2**8)
    return counted_training(model, optim, batch, steps)


def counted_training(model: cm.ShardedModelV2, optim: cm.ShardedOptimizerV2, batch: torch.Tensor, steps: int) -> dict:
    """Train ``steps`` steps; what the ledger counted: the bytes per tier, the last step's moves and disk traffic,
    the disk files and the host peak."""
    ledger = model.runtime.ledger
    for _ in range(steps):
        before = (ledger.moved_to_device, ledger.moved_to_host, ledger.read_from_disk, ledger.written_to_disk)
        optim.backward(model(batch).float().mean())
        optim.step()
        optim.zero_grad()
    after = (ledger.moved_to_device, ledger.moved_to_host, ledger.read_from_disk, ledger.written_to_disk)
    return {"tier_bytes": resting_tier_bytes(model), "moved": tuple(a - b for a, b in zip(after, before)),
            "files": model.disk_file_bytes(), "host_peak": ledger.peak_host_bytes}


def planned(c: cm.Candidate) -> dict:
    return {"tier_bytes": c.tier_bytes, "files": c.disk_file_bytes,
            "moved": (c.moved_to_device_per_step, c.moved_to_host_per_step, c.disk_read_per_step,
                      c.disk_written_per_step)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_candidate_equals_a_real_run(dtype, tmp_path):
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 10 * 2**20, disk_memory=2**30, dtype=dtype, profile=profile(),
                       chunk_size=CHUNK, buffer_count=2, buffer_size=IO)
    names = [c.name for c in choice.candidates]
    assert {"cuda", "cpu", "auto", "static(0.5,0.5)", "cpu+optim@disk", "cpu+param@disk", "auto+optim@disk+param@disk",
            "static(0.5,0.5)+optim@disk+param@disk"} <= set(names)
    assert ("cpu+optim@disk+reuse" in names) == (dtype != torch.float32)
    assert "cpu+param@disk+reuse" not in names  # refused by ShardedModelV2: not offered
    cm.set_device_memory_capacity(10 * 2**20)
    for c in choice.candidates:
        assert c.fits and c.time is not None, c.name
        real = real_run(c, batch, str(tmp_path))
        assert {k: real[k] for k in ("tier_bytes", "moved", "files")} == planned(c), c.name
        # the host peak: exact except that 'static' and the parameters' own reads from disk are bounded
        # from above (by at most one chunk)
        if c.policy == "static" or "param@disk" in c.name:
            assert real["host_peak"] <= c.host_peak_bytes <= real["host_peak"] + CHUNK, c.name
        else:
            assert real["host_peak"] == c.host_peak_bytes, c.name
    numel = 16384 * 3 + 640  # fp32 chunks of 16384 elements, the last trimmed (see test_plan.py)
    if dtype == torch.float32:
        disk = {c.name: c for c in choice.candidates}["cpu+optim@disk"]
        # the I/O buffers: 2 x 3 of the streamed step and the in-line one
        assert disk.tier_bytes == {"device": {}, "host": {"disk_io": (2 * 3 + 1) * IO, "param": numel * 4},
                                   "disk": {"exp_avg": numel * 4, "exp_avg_sq": numel * 4}}
        # two moment files of 2 slots x 4 chunks of 16384 x 4 bytes, and the fp32 journal (1 slot)
        assert disk.disk_file_bytes == 2 * 2 * 4 * 65536 + 4 * 65536


def test_auto_with_the_optimizer_on_disk_keeps_what_the_host_capacity_allows(tmp_path):
    batch = torch.randn(4, 64)
    # the parameters (199,168 bytes), the gradients of the step (4 x 65,536), 2 x 3 I/O buffers of 32 KiB and
    # the state of two of the four chunks (2 x 131,072)
    host = 950_000
    choice = cm.choose(build, batch, 10 * 2**20, host_memory=host, disk_memory=2**30, dtype=torch.float32,
                       profile=profile(), chunk_size=CHUNK, buffer_count=2, buffer_size=IO, static_fractions=())
    c = {c.name: c for c in choice.candidates}["auto+optim@disk"]
    assert c.tier_bytes["host"]["exp_avg"] == 2 * 65536 and c.tier_bytes["disk"]["exp_avg"] == 65536 + 640 * 4
    cm.set_device_memory_capacity(10 * 2**20)
    cm.set_host_memory_capacity(host)
    try:
        real = real_run(c, batch, str(tmp_path))
    finally:
        cm.set_host_memory_capacity(None)
    assert {k: real[k] for k in ("tier_bytes", "moved", "files")} == planned(c)
    assert real["host_peak"] == c.host_peak_bytes <= host


@pytest.mark.parametrize("host", [50_000_000, 800_000])
def test_auto_with_the_optimizer_on_disk_all_or_part_on_the_host(host, tmp_path):
    """bf16: a host capacity that keeps every chunk's state on the host (the disk tier then streams
    nothing: no I/O buffers unless parameters are on disk, and their update reads them), and one that
    keeps part of it; every optimizer-on-disk candidate of 'auto' against a real run under it."""
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 10 * 2**20, host_memory=host, disk_memory=2**30, dtype=torch.bfloat16,
                       profile=profile(), chunk_size=CHUNK, buffer_count=2, buffer_size=IO, policies=("auto",))
    on_disk = [c for c in choice.candidates if "optim@disk" in c.name]
    assert len(on_disk) == 3
    if host == 50_000_000:
        assert all("exp_avg" not in c.tier_bytes["disk"] for c in on_disk)
    cm.set_device_memory_capacity(10 * 2**20)
    cm.set_host_memory_capacity(host)
    try:
        for c in on_disk:
            real = real_run(c, batch, str(tmp_path))
            assert {k: real[k] for k in ("tier_bytes", "moved", "files")} == planned(c), c.name
            assert real["host_peak"] == c.host_peak_bytes, c.name
    finally:
        cm.set_host_memory_capacity(None)


def _two_ranks_worker(rank, world, nvme_path, expected):
    batch = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    cm.set_device_memory_capacity(10 * 2**20)
    return {name: real_run(c, batch, nvme_path, steps=2) for name, c in expected.items()}


def test_two_ranks_bytes_per_rank_equal_real_ranks(tmp_path):
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 10 * 2**20, disk_memory=2**30, ranks=2, dtype=torch.float32, profile=profile(),
                       chunk_size=CHUNK, buffer_count=2, buffer_size=IO)
    picked = {c.name: c for c in choice.candidates}
    assert len(picked) == 13  # cuda, and cpu, auto, static(0.5,0.5) each with and without the disk tier's 3 uses
    one = cm.choose(build, batch, 10 * 2**20, dtype=torch.float32, profile=profile(), chunk_size=CHUNK,
                    static_fractions=())
    assert picked["cpu"].total("host") * 2 == one.candidates[1].total("host")  # each rank keeps half
    assert picked["cpu"].collective_bytes_per_step > 0 and picked["cpu"].time.collectives > 0
    results = run_ranks(_two_ranks_worker, 2, str(tmp_path), picked)
    for rank_result in results:
        for name, c in picked.items():
            real = rank_result[name]
            assert {k: real[k] for k in ("tier_bytes", "moved", "files")} == planned(c), name
            assert real["host_peak"] <= c.host_peak_bytes <= real["host_peak"] + CHUNK, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_recommendation_of_a_sweep_of_budgets_trains_within_them(dtype, tmp_path):
    """Device, host and disk budgets from roomy to tight: the recommended candidate (when there is one)
    is built and trained three steps under exactly those capacities without running out; a candidate
    that does not fit is never recommended, and the recommendation is the fastest predicted fit."""
    batch = torch.randn(4, 64)
    seen = set()
    for device in (4 * 2**20, 1 * 2**20, 400_000, 200_000):
        for host in (None, 2 * 2**20, 500_000, 250_000):
            for disk in (None, 2**30, 1_000_000):
                choice = cm.choose(build, batch, device, host_memory=host, disk_memory=disk, dtype=dtype,
                                   profile=profile(), chunk_size=CHUNK, buffer_count=2, buffer_size=IO,
                                   static_fractions=((0.5, 0.5), (0.25, 0.75)))
                r = choice.recommended
                fits = [c for c in choice.candidates if c.fits]
                if r is None:
                    assert not fits
                    continue
                assert r.fits and r.recommended and sum(c.recommended for c in choice.candidates) == 1
                assert r.seconds_per_step == min(c.seconds_per_step for c in fits)
                seen.add(r.name)
                cm.set_device_memory_capacity(device)
                cm.set_host_memory_capacity(host)
                try:
                    real = real_run(r, batch, str(tmp_path))
                finally:
                    cm.set_host_memory_capacity(None)
                assert real["tier_bytes"] == r.tier_bytes
                assert real["host_peak"] <= r.host_peak_bytes
                assert disk is None or real["files"] <= disk
    assert len(seen) >= 3, seen  # the budgets do change the choice


def test_recommendation_follows_the_profile():
    """Copies cost: with room on the device 'cuda' (no moves) wins; a copy bandwidth far above the rest
    changes nothing there, but on a device too small for 'cuda' the fastest fit is chosen among the rest."""
    batch = torch.randn(4, 64)
    roomy = cm.choose(build, batch, 10 * 2**20, dtype=torch.float32, profile=profile(), chunk_size=CHUNK)
    assert roomy.recommended.name == "cuda"
    tight = cm.choose(build, batch, 600_000, dtype=torch.float32, profile=profile(), chunk_size=CHUNK)
    assert not {c.name: c for c in tight.candidates}["cuda"].fits
    assert tight.recommended.name in ("auto", "static(0.5,0.5)")
    # the disk's bandwidth decides between disk candidates: a slow disk makes them slower than the host
    slow = cm.choose(build, batch, 600_000, disk_memory=2**30, dtype=torch.float32, chunk_size=CHUNK,
                     profile=profile(disk_read_bytes_per_s=1e3, disk_write_bytes_per_s=1e3))
    assert "disk" not in slow.recommended.name
    # no disk figures in the profile: disk candidates get no time and are not recommended
    no_disk = cm.choose(build, batch, 600_000, disk_memory=2**30, dtype=torch.float32, chunk_size=CHUNK,
                        profile=profile(disk_read_bytes_per_s=None, disk_write_bytes_per_s=None))
    assert all(c.time is None for c in no_disk.candidates if c.uses_disk)
    assert not no_disk.recommended.uses_disk


def test_compute_trace_counts_the_matmuls_and_uses_measured_operators():
    with torch.device("meta"):
        model = nn.Linear(64, 32, bias=False)
    trace = trace_compute(model, (torch.empty(16, 64, device="meta"),), None, torch.float32)
    # forward x @ W^T and the backward's weight gradient (the input needs none): 2 x 16 x 64 x 32 each
    assert trace.flops == 2 * (2 * 16 * 64 * 32)
    p = profile()
    fallback = trace.seconds(p)
    assert fallback > 0
    p.op_seconds = {key: 1.0 for key in trace.operators}
    assert trace.seconds(p) == sum(op.calls for op in trace.operators.values())
    p2 = profile()
    p2.measure_operators(trace.replays())  # each operator timed on real tensors of its shapes
    assert set(p2.op_seconds) == set(trace.replays()) and all(s > 0 for s in p2.op_seconds.values())


def test_profile_round_trip_and_bad_values():
    p = profile()
    assert MachineProfile.from_dict(p.to_dict()) == p
    with pytest.raises(cm.InvalidArgumentError, match="copy_bytes_per_s"):
        profile(copy_bytes_per_s=0.0)
    with pytest.raises(cm.InvalidArgumentError, match="matmul_flops"):
        profile(matmul_flops={"int8": 1e9})
    with pytest.raises(cm.ArgumentTypeError, match="adam_elements_per_s"):
        profile(adam_elements_per_s={})


def test_bad_arguments_are_named_and_change_nothing():
    batch = torch.randn(4, 64)
    cm.set_device_memory_capacity(123_456_789)
    for kwargs, name in [(dict(ranks=0), "ranks"), (dict(static_fractions=((0.5, 2.0),)), "static_fractions"),
                         (dict(static_fractions=(0.5, 0.5)), "static_fractions"), (dict(profile="fast"), "profile"),
                         (dict(reuse_fp16_shard=True, dtype=torch.float32), "reuse_fp16_shard"),
                         (dict(buffer_size=1000), "buffer_size"), (dict(disk_memory="lots"), "disk_memory"),
                         (dict(nvme_path="/no/such/directory"), "nvme_path")]:
        with pytest.raises(cm.InvalidArgumentError, match=name):
            cm.choose(build, batch, 2**20, **{"profile": profile(), **kwargs})
    with pytest.raises(cm.InvalidArgumentError, match="policies"):
        cm.choose(build, batch, 2**20, profile=profile(), policies=("gpu",))
    assert cm.device_memory_capacity() == 123_456_789  # the setting is untouched by refused calls...
    disk = [c for c in cm.choose(build, batch, 2**20, disk_memory=2**30, dtype=torch.float32, profile=profile(),
                                 chunk_size=CHUNK, static_fractions=[[0.25, 0.5]]).candidates if c.uses_disk][0]
    assert cm.device_memory_capacity() == 123_456_789  # ...and restored after the meta runs
    with pytest.raises(cm.InvalidArgumentError, match="nvme_path"):
        disk.model_config()


def test_initialize_takes_the_recommendation(tmp_path):
    batch = torch.randn(4, 64)
    choice = cm.choose(build, batch, 600_000, disk_memory=2**30, dtype=torch.float32, profile=profile(),
                       chunk_size=CHUNK)
    cm.set_device_memory_capacity(600_000)
    r = choice.recommended
    assert not r.uses_disk
    module = build()
    model, optim = cm.initialize(module, torch.optim.AdamW(module.parameters(), lr=1e-3), plan=r)
    assert isinstance(model, cm.ShardedModelV2) and isinstance(optim, cm.ShardedOptimizerV2)
    assert model.settings.placement.tensor_placement_policy == r.policy and model.layout.chunk_bytes == r.chunk_bytes
    optim.backward(model(batch).float().mean())
    optim.step()
    assert resting_tier_bytes(model) == r.tier_bytes
    disk = {c.name: c for c in choice.candidates}["cpu+optim@disk"]
    module = build()
    model, optim = cm.initialize(module, torch.optim.AdamW(module.parameters(), lr=1e-3), plan=disk,
                                 nvme_path=str(tmp_path))
    optim.backward(model(batch).float().mean())
    optim.step()
    assert resting_tier_bytes(model) == disk.tier_bytes
    with pytest.raises(cm.InvalidArgumentError, match="plan"):
        cm.initialize(build(), None, {"zero": {"model_config": {}}}, plan=r)
    with pytest.raises(cm.ArgumentTypeError, match="plan"):
        cm.initialize(build(), None, plan="cpu")
    with pytest.raises(cm.InvalidArgumentError, match="nvme_path"):
        cm.initialize(build(), None, plan=disk)


def test_command_line_prints_times_fits_and_the_recommendation(capsys, tmp_path):
    plan_module = importlib.import_module("chunkmem.plan.cli")
    path = tmp_path / "profile.json"
    import json

    path.write_text(json.dumps(profile().to_dict()))
    plan_module.main(["--preset", "tiny", "--seq-len", "8", "--batch-size", "1", "--device-memory", "32MiB",
                       "--dtype", "fp32", "--candidates", "--profile", str(path), "--disk-memory", "1GiB"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["candidate", "fits", "s/step"]
    marked = [line for line in lines if line.endswith("<== recommended")]
    assert len(marked) == 1
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.split() and line.split()[1] in ("yes", "no")}
    assert {"cuda", "cpu", "auto", "cpu+optim@disk"} <= set(rows)
    assert rows["cuda"][1] == "no"  # 38 MiB of parameters, gradients and moments do not fit in 32 MiB
    fastest = min(float(r[2]) for r in rows.values() if r[1] == "yes" and r[2] != "-")
    assert marked[0].split()[1] == "yes" and float(marked[0].split()[2]) == fastest


def test_step_time_adds_its_parts():
    from chunkmem.plan.cost_model import step_time

    p = profile()  # copies 5 GB/s, fp32 Adam 1G elements/s, disk 1 GB/s read, 0.5 GB/s write
    t = step_time(p, 1.0, torch.float32, moved_bytes=5 * 10**9, adam_elements=3 * 10**9,
                  disk_adam_elements=10**9, disk_read_step=10**9, disk_written_step=5 * 10**8,
                  disk_read_compute=3 * 10**9, collective_bytes_sent=2 * 10**9)
    # compute 1; copies 1; Adam of the chunks not on disk 2; the streamed step max(1 + 1, 1) plus the
    # parameter reads of the forward and backward 3; collectives 2
    assert (t.compute, t.copies, t.adam, t.disk, t.collectives) == (1.0, 1.0, 2.0, 5.0, 2.0) and t.total == 11.0
    measured_step = profile(disk_step_bytes_per_s=3e9)  # the streamed step measured as a whole: 1.5 GB / 3 GB/s
    t = step_time(measured_step, 1.0, torch.float32, moved_bytes=0, adam_elements=10**9, disk_adam_elements=10**9,
                  disk_read_step=10**9, disk_written_step=5 * 10**8)
    assert t.disk == 1.0 and t.adam == 0.0  # max(0.5 of I/O, 1 of updates)
    no_disk = profile(disk_read_bytes_per_s=None, disk_write_bytes_per_s=None)
    assert step_time(no_disk, 1.0, torch.float32, moved_bytes=0, adam_elements=1, disk_read_step=1) is None
    assert step_time(profile(collective_bytes_per_s=None), 1.0, torch.float32, moved_bytes=0, adam_elements=1,
                     collective_bytes_sent=1.0) is None


def test_measuring_the_machine_gives_every_figure(tmp_path):
    from chunkmem.plan.machine_profile import _disk_step_bytes_per_s

    p = MachineProfile.measure(dtypes=(torch.float32, torch.bfloat16))
    assert set(p.matmul_flops) == set(p.adam_elements_per_s) == set(p.low_bit_adam_elements_per_s) == {"float32",
                                                                                                      "bfloat16"}
    assert all(v > 0 for v in [*p.matmul_flops.values(), *p.adam_elements_per_s.values(), p.copy_bytes_per_s,
                               p.elementwise_bytes_per_s, *p.low_bit_adam_elements_per_s.values(),
                               p.rounded_adam_elements_per_s])
    assert p.disk_read_bytes_per_s is None and p.collective_bytes_per_s is None and p.threads == torch.get_num_threads()
    # the streamed disk step's rate, on a small model: its files are made and removed under the directory
    assert _disk_step_bytes_per_s(str(tmp_path), width=256, layers=2) > 0
    assert os.listdir(tmp_path) == []
    with pytest.raises(cm.InvalidArgumentError, match="dtypes"):
        MachineProfile.measure(dtypes=(torch.int8,))
    with pytest.raises(cm.InvalidArgumentError, match="ranks"):
        MachineProfile.measure(ranks=0)


def accumulating_real_run(candidate: cm.Candidate, batch: torch.Tensor, nvme_path: str, backwards: int,
                          steps: int = 3) -> dict:
    """``real_run`` with ``backwards`` backwards before each step; ``device_peak``: the ledger's device peak
    read before the last step."""
    model = cm.ShardedModelV2(build(), cm.TensorShardStrategy(), **candidate.model_config(nvme_path))
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3), initial_scale=2**8)
    ledger = model.runtime.ledger
    for _ in range(steps):
        before = (ledger.moved_to_device, ledger.moved_to_host, ledger.read_from_disk, ledger.written_to_disk)
        for _ in range(backwards):
            optim.backward(model(batch).float().mean())
        device_peak = ledger.peak_device_bytes
        optim.step()
        optim.zero_grad()
    after = (ledger.moved_to_device, ledger.moved_to_host, ledger.read_from_disk, ledger.written_to_disk)
    return {"tier_bytes": resting_tier_bytes(model), "moved": tuple(a - b for a, b in zip(after, before)),
            "files": model.disk_file_bytes(), "host_peak": ledger.peak_host_bytes, "device_peak": device_peak}


def test_every_candidate_with_gradient_accumulation_equals_a_real_run(tmp_path):
    """bf16, two backwards per step, the sums in fp32: every candidate's bytes, moves per step (both passes),
    files, device peak and host peak against a real run that accumulates; no reuse_fp16_shard candidate (it
    cannot accumulate); the time counts two passes' compute."""
    batch = torch.randn(4, 64)
    kwargs = dict(disk_memory=2**30, dtype=torch.bfloat16, profile=profile(), chunk_size=CHUNK, buffer_count=2,
                  buffer_size=IO)
    one = {c.name: c for c in cm.choose(build, batch, 10 * 2**20, **kwargs).candidates}
    choice = cm.choose(build, batch, 10 * 2**20, gradient_accumulation_steps=2, **kwargs)
    assert [c.name for c in choice.candidates] == [name for name in one if "reuse" not in name]
    cm.set_device_memory_capacity(10 * 2**20)
    for c in choice.candidates:
        assert c.fits and c.gradient_accumulation_steps == 2 and "grad_accum_dtype" not in c.settings, c.name
        real = accumulating_real_run(c, batch, str(tmp_path), 2)
        assert {k: real[k] for k in ("tier_bytes", "moved", "files")} == planned(c), c.name
        assert real["device_peak"] == c.device_peak_bytes, c.name
        if c.policy == "static" or "param@disk" in c.name:  # bounded from above, as with one backward
            assert real["host_peak"] <= c.host_peak_bytes <= real["host_peak"] + CHUNK, c.name
        else:
            assert real["host_peak"] == c.host_peak_bytes, c.name
        assert c.time.compute == 2 * one[c.name].time.compute == 2 * choice.compute_seconds, c.name
        assert c.predict(choice.profile, choice.compute_seconds) == c.time, c.name
    # where the fp32 sums rest: the device under 'cuda', the host under 'cpu'
    by_name = {c.name: c for c in choice.candidates}
    assert by_name["cuda"].device_peak_bytes > one["cuda"].device_peak_bytes
    assert by_name["cpu"].host_peak_bytes > one["cpu"].host_peak_bytes
    assert by_name["cpu"].device_peak_bytes == one["cpu"].device_peak_bytes


def test_choose_stops_fitting_when_accumulation_widens_the_sums(tmp_path):
    """A device budget between the 'cuda' peaks of one and two backwards per step: with one 'cuda' fits and is
    recommended (it moves nothing), with two it does not and 'cpu' is; a host budget between the 'cpu' host
    peaks: 'cpu' fits with one backward per step, not with two. Summed in bf16 (grad_accum_dtype) they fit
    again; the recommendation carries grad_accum_dtype into the model it builds."""
    batch = torch.randn(4, 64)
    kwargs = dict(dtype=torch.bfloat16, profile=profile(), chunk_size=CHUNK, static_fractions=(),
                  policies=("cuda", "cpu"), reuse_fp16_shard=False)
    one = {c.name: c for c in cm.choose(build, batch, 10 * 2**20, **kwargs).candidates}
    two = {c.name: c for c in cm.choose(build, batch, 10 * 2**20, gradient_accumulation_steps=2,
                                        **kwargs).candidates}
    device = (one["cuda"].device_peak_bytes + two["cuda"].device_peak_bytes) // 2 + one["cuda"].non_model_peak
    assert cm.choose(build, batch, device, **kwargs).recommended.name == "cuda"
    tight = cm.choose(build, batch, device, gradient_accumulation_steps=2, **kwargs)
    assert tight.recommended.name == "cpu"
    cuda = {c.name: c for c in tight.candidates}["cuda"]
    assert not cuda.fits and cuda.reason.startswith("device")
    kept = cm.choose(build, batch, device, gradient_accumulation_steps=2, grad_accum_dtype=torch.bfloat16, **kwargs)
    r = kept.recommended
    assert r.name == "cuda" and r.settings["grad_accum_dtype"] == torch.bfloat16
    assert r.config()["zero"]["model_config"]["grad_accum_dtype"] == "bfloat16"
    module = build()
    cm.set_device_memory_capacity(device)
    model, optim = cm.initialize(module, torch.optim.AdamW(module.parameters(), lr=1e-3), plan=r)
    assert model.settings.grad_accum_dtype == torch.bfloat16
    for _ in range(2):  # two backwards in bf16 within the budget
        optim.backward(model(batch).float().mean())
    optim.step()
    assert resting_tier_bytes(model) == r.tier_bytes
    cm.set_device_memory_capacity(None)

    host = (one["cpu"].host_peak_bytes + two["cpu"].host_peak_bytes) // 2
    cpu_only = dict(kwargs, policies=("cpu",))
    assert cm.choose(build, batch, 10 * 2**20, host_memory=host, **cpu_only).recommended.name == "cpu"
    refused = cm.choose(build, batch, 10 * 2**20, host_memory=host, gradient_accumulation_steps=2, **cpu_only)
    assert refused.recommended is None
    assert not refused.candidates[0].fits and refused.candidates[0].reason.startswith("host")
    cm.set_host_memory_capacity(host)  # the real runtime agrees
    try:
        accumulating_real_run(one["cpu"], batch, str(tmp_path), 1)
        with pytest.raises(cm.HostCapacityError):
            accumulating_real_run(two["cpu"], batch, str(tmp_path), 2)
    finally:
        cm.set_host_memory_capacity(None)


def test_bad_accumulation_arguments_are_named_in_choose(capsys, tmp_path):
    batch = torch.randn(4, 64)
    for kwargs, name in [(dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
                         (dict(gradient_accumulation_steps=1.5), "gradient_accumulation_steps"),
                         (dict(gradient_accumulation_steps=2, reuse_fp16_shard=True), "gradient_accumulation_steps"),
                         (dict(dtype=torch.bfloat16, grad_accum_dtype=torch.float16), "grad_accum_dtype"),
                         (dict(dtype=torch.float32, grad_accum_dtype=torch.bfloat16), "grad_accum_dtype")]:
        with pytest.raises(cm.InvalidArgumentError, match=name):
            cm.choose(build, batch, 2**20, **{"profile": profile(), **kwargs})
    # the command line's options reach both
    plan_module = importlib.import_module("chunkmem.plan.cli")
    path = tmp_path / "profile.json"
    import json

    path.write_text(json.dumps(profile().to_dict()))
    common = ["--preset", "tiny", "--seq-len", "8", "--batch-size", "1", "--device-memory", "64MiB", "--dtype", "bf16"]
    plan_module.main(common + ["--candidates", "--profile", str(path), "--static-fractions", "",
                               "--gradient-accumulation-steps", "2"])
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:4]]
    assert rows == ["cuda", "cpu", "auto"]  # no '+reuse' candidates: they cannot accumulate
    with pytest.raises(cm.InvalidArgumentError, match="grad_accum_dtype"):
        plan_module.main(common + ["--grad-accum-dtype", "fp16"])
    with pytest.raises(cm.InvalidArgumentError, match="gradient_accumulation_steps"):
        plan_module.main(common + ["--gradient-accumulation-steps", "0"])
