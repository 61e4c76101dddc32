"""auto placement: traced schedule, Belady's eviction, gpu_margin_mem_ratio, re-tracing, capacity errors;
static placement; the memory-stats dump."""
import copy
import json

import pytest
import torch

import chunkmem as cm
from models import TinyGPT, batches, build_sharded, lm_loss, train

DTYPES = [(torch.float32, False), (torch.bfloat16, True)]


def staging_counts(periods, reuse, excluded=()):
    if reuse:
        return [0] * len(periods)
    live, counts = 0, []
    for p in periods:
        started = [c for c in p["grads_started"] if c not in excluded]
        counts.append(live + len(started))
        live += len(started) - len([c for c in p["grads_finished"] if c not in excluded])
    return counts


def belady_fetches(periods, slots, forced):
    """An independent O(n^2) statement of Belady's rule: before each period evict, among resident chunks
    the period does not need, the one whose next use is furthest (ties: the lowest id). Returns the ids
    of the chunks fetched, in order."""
    resident, fetched = set(), []
    for i, p in enumerate(periods):
        need = set(p)
        assert len(need) <= slots[i]

        def next_use(c):
            return next((j for j in range(i + 1, len(periods)) if c in periods[j]), len(periods))

        while len(resident | need) > slots[i]:
            victim = max(sorted(resident - need), key=next_use)
            resident.discard(victim)
        fetched += sorted(need - resident)
        resident |= need
        resident -= set(forced[i])
    return fetched


def cpu_reference(reference, dtype, reuse, data, chunk_size=16384):
    model, optim = build_sharded(reference, "cpu", dtype, reuse=reuse, chunk_size=chunk_size)
    losses = train(model, optim, data)
    return model, losses


@pytest.mark.parametrize("dtype,reuse", DTYPES)
def test_auto_equals_cpu_within_capacity_and_moves_belady_bytes(dtype, reuse, tmp_path):
    torch.manual_seed(0)
    reference = TinyGPT(d=16 if dtype != torch.float32 else 32)
    data = batches(5, seq=8 if dtype != torch.float32 else 16)
    chunk_size = 16384 if dtype == torch.float32 else 2048
    cpu_model, cpu_losses = cpu_reference(reference, dtype, reuse, data, chunk_size)
    traced = cpu_model.memory_stats()
    S = traced["chunks"]["param_bytes"]
    staging = staging_counts(traced["periods"], reuse)
    need = max(p["non_model_peak_bytes"] + (len(p["chunks"]) + s) * S for p, s in zip(traced["periods"], staging))
    capacity = need + 2 * S
    cm.set_device_memory_capacity(capacity)
    model, optim = build_sharded(reference, "auto", dtype, reuse=reuse, chunk_size=chunk_size)
    assert train(model, optim, data) == cpu_losses
    for name, value in cpu_model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name

    path = model.dump_memory_stats(str(tmp_path / "memstats.json"))
    doc = json.load(open(path))
    assert doc["schema"] == "chunkmem.memstats/1" and doc["policy"] == "auto" and doc["capacity_bytes"] == capacity
    assert doc["traces"] == 2 and doc["iterations"] == 5  # the second trace follows the discovery of side.weight
    periods = doc["periods"]
    for p in periods:
        assert p["device_model_bytes"] + p["non_model_peak_bytes"] <= capacity, p
    assert doc["totals"]["peak_device_with_non_model_bytes"] <= capacity
    staging = staging_counts(periods, reuse)
    slots = [(capacity - p["non_model_peak_bytes"] - s * S) // S for p, s in zip(periods, staging)]
    forced = [p["grads_finished"] if reuse else [] for p in periods]
    fetched = belady_fetches([p["chunks"] for p in periods], slots, forced)
    numels = doc["chunks"]["numels"]  # the last is trimmed to its parameters: fewer bytes to move
    assert numels[:-1] == [S // dtype.itemsize] * (len(numels) - 1) and numels[-1] < S // dtype.itemsize
    assert doc["totals"]["moved_to_device_bytes"] == sum(numels[c] for c in fetched) * dtype.itemsize
    assert doc["chunks"]["count"] < len(fetched) < len(periods)  # chunks were evicted and fetched again, but
    # not once per period: they stayed on the device while there was room


def test_non_model_peaks_of_an_mlp_by_hand():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    model = cm.ShardedModelV2(mlp, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              chunk_size=1024 * 4)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    x = torch.randn(4, 16)
    optim.backward(model(x).sum())
    periods = model.memory_stats()["periods"]
    assert [(p["name"], p["phase"]) for p in periods][:2] == [("0", "forward"), ("2", "forward")]
    f32 = 4
    # period "0 forward": Linear(16, 32) output (4 x 32) is alive while ReLU writes its output (4 x 32)
    assert periods[0]["non_model_peak_bytes"] == 2 * 4 * 32 * f32
    # period "2 forward" (until backward starts): ReLU output (saved) + Linear(32, 8) output + the sum
    assert periods[1]["non_model_peak_bytes"] == 4 * 32 * f32 + 4 * 8 * f32 + f32


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_gpu_margin_mem_ratio_places_optimizer_groups_by_the_rule(ratio):
    torch.manual_seed(1)
    reference = TinyGPT()
    data = batches(4)
    cm.set_device_memory_capacity(2**20)
    base, base_optim = build_sharded(reference, "auto", torch.float32)
    base_losses = train(base, base_optim, data)
    model, optim = build_sharded(reference, "auto", torch.float32, gpu_margin_mem_ratio=ratio)
    assert train(model, optim, data) == base_losses
    for name, value in base.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    doc = model.memory_stats()
    S = doc["chunks"]["param_bytes"]
    numel = doc["chunks"]["numel"]
    staging = staging_counts(doc["periods"], reuse=False)
    peak = max(p["non_model_peak_bytes"] + (len(p["chunks"]) + s) * S for p, s in zip(doc["periods"], staging))
    margin = 2**20 - peak
    group = 2 * 4 * numel + S + S  # exp_avg + exp_avg_sq (fp32 params are the masters) + param + grad
    want = min(int(ratio * margin) // group, len(doc["chunks"]["trainable"]))
    assert doc["optimizer"]["margin_bytes"] == margin
    assert doc["optimizer"]["device_chunks"] == doc["chunks"]["trainable"][:want]
    assert (ratio == 0) == (want == 0)
    device_bytes, host_bytes = optim.get_memory_usage()
    # params (the fp32 masters), exp_avg, exp_avg_sq of each chunk there (the last chunk is trimmed)
    assert device_bytes == 3 * 4 * sum(doc["chunks"]["numels"][c] for c in doc["chunks"]["trainable"][:want])
    for p in doc["periods"]:
        assert p["device_model_bytes"] + p["non_model_peak_bytes"] <= 2**20


def test_changing_sequence_length_retraces_and_trains_correctly():
    torch.manual_seed(2)
    reference = TinyGPT()
    data = batches(3, seq=16) + batches(3, seq=8, seed=1)
    cm.set_device_memory_capacity(2**20)
    model, optim = build_sharded(reference, "auto", torch.float32)
    plain = copy.deepcopy(reference)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    for i, x in enumerate(data):
        loss = lm_loss(model(x), x)
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        ref_loss = lm_loss(plain(x), x)
        ref_loss.backward()
        popt.step()
        popt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
        if i == 2:
            assert model.runtime.scheduler.traces == 2
    assert model.runtime.scheduler.traces == 3
    assert model.memory_stats()["last_iteration_mode"] == "idle"


def test_capacity_too_small_for_one_period_falls_back_to_cpu_for_it():
    # Before issue #10 this raised DeviceCapacityError at the end of the traced backward; auto now runs a
    # period that does not fit its plan as cpu does (fetch, compute, release) and trains like cpu.
    torch.manual_seed(3)
    reference = TinyGPT()
    data = batches(3)
    cpu_model, cpu_losses = cpu_reference(reference, torch.float32, False, data)
    traced = cpu_model.memory_stats()
    S = traced["chunks"]["param_bytes"]
    staging = staging_counts(traced["periods"], False)
    worst = max(range(len(staging)), key=lambda i: traced["periods"][i]["non_model_peak_bytes"]
                + (len(traced["periods"][i]["chunks"]) + staging[i]) * S)
    p = traced["periods"][worst]
    cm.set_device_memory_capacity(p["non_model_peak_bytes"] + (len(p["chunks"]) + staging[worst]) * S - 1)
    model, optim = build_sharded(reference, "auto", torch.float32)
    assert train(model, optim, data) == cpu_losses
    for name, value in cpu_model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    plan = model.runtime.scheduler.moves
    assert plan is not None and plan.periods[worst].fallback


def test_static_placement_fractions():
    torch.manual_seed(4)
    reference = TinyGPT()
    data = batches(3)
    _, cpu_losses = cpu_reference(reference, torch.float32, False, data)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="static",
                              dtype=torch.float32, chunk_size=16384, offload_param_frac=0.5, offload_optim_frac=0.25)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01))
    assert train(model, optim, data) == cpu_losses
    n = len(model.chunks)
    on_device = [c.index for c in model.chunks if c.param.device_valid]
    assert on_device == list(range(n - round(0.5 * n)))
    trainable = [c.index for c in model.chunks if c.trainable]
    optim_device = [c.index for c in model.chunks if c.trainable and c.optim["exp_avg"].tier is cm.Tier.DEVICE]
    assert optim_device == trainable[:len(trainable) - round(0.25 * len(trainable))]


def test_dump_in_except_handler_and_viewer(tmp_path):
    import subprocess
    import sys

    torch.manual_seed(5)
    model, optim = build_sharded(TinyGPT(), "cpu", torch.float32)
    train(model, optim, batches(2))
    try:
        raise MemoryError("simulated out-of-memory in forward")
    except MemoryError:
        path = model.dump_memory_stats(str(tmp_path / "stats.json"))
    png, trace = tmp_path / "stats.png", tmp_path / "stats.trace.json"
    subprocess.run([sys.executable, "tools/memstats_view.py", path, "--png", str(png), "--trace", str(trace)],
                   check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    events = json.load(open(trace))["traceEvents"]
    doc = json.load(open(path))
    assert sum(1 for e in events if e.get("ph") == "X") == len(doc["periods"])
