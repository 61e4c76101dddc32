"""chunkmem.plan against real runs: the bytes per tier and family, and the bytes moved per step, must
equal what ShardedModelV2 / ShardedOptimizerV2 account in their ledger; 'fits' agrees with the real
capacity check."""
from __future__ import annotations

import subprocess
import sys
import os

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.plan import format_table, plan

CHUNK = 64 * 256 * 4


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 8))


def real_run(policy: str, dtype: torch.dtype, batch: torch.Tensor) -> tuple[dict, tuple[int, int]]:
    m = cm.ShardedModelV2(build(), cm.TensorShardStrategy(), tensor_placement_policy=policy, dtype=dtype,
                          chunk_size=CHUNK)
    o = cm.ShardedOptimizerV2(m, cm.HybridAdam(m.parameters(), lr=1e-3), initial_scale=2**8)
    ledger = m.chunk_manager.ledger
    for _ in range(3):  # auto plans after its traced first step: compare the last
        before = ledger.moved_to_device, ledger.moved_to_host
        loss = m(batch).float().mean()
        o.backward(loss)
        o.step()
        o.zero_grad()
    return m.tier_bytes(), (ledger.moved_to_device - before[0], ledger.moved_to_host - before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plan_bytes_equal_a_real_run(dtype):
    batch = torch.randn(4, 64)
    plans = plan(build, batch, 10 * 2**20, dtype=dtype, chunk_size=CHUNK)
    cm.set_device_memory_capacity(10 * 2**20)
    for policy in ("cuda", "cpu", "auto"):
        tiers, moved = real_run(policy, dtype, batch)
        p = plans[policy]
        assert p.fits and p.chunk_bytes == CHUNK
        assert p.tier_bytes == tiers, policy
        assert (p.moved_to_device_per_step, p.moved_to_host_per_step) == moved, policy
    # hand-computed: 4 fp32 chunks (2 fp16) of 16384 (32768) elements; Adam state is fp32
    n = 4 if dtype == torch.float32 else 2
    fp32_chunk = CHUNK if dtype == torch.float32 else 2 * CHUNK
    optim = {"exp_avg": n * fp32_chunk, "exp_avg_sq": n * fp32_chunk}
    if dtype == torch.float16:
        optim["master"] = n * fp32_chunk
    assert plans["cuda"].tier_bytes == {"device": {"param": n * CHUNK, **optim}, "host": {}}
    assert plans["cuda"].extra["device_step_chunk_bytes"] == n * CHUNK * 2 + sum(optim.values())
    assert plans["cuda"].moved_to_device_per_step == 0


def test_plan_allocates_nothing_and_reports_the_non_model_peak():
    built = []

    def builder():
        model = build()
        built.append(model)
        return model

    batch = torch.randn(16, 64)
    p = plan(builder, batch, 10 * 2**20, dtype=torch.float32, chunk_size=CHUNK)["cpu"]
    assert all(t.is_meta for t in built[0].parameters())
    # forward: the activations 16x256 (Linear, GELU), 16x64, 16x8 and the loss; backward adds the
    # parameter gradients (they are non-model memory until they reach a chunk) - at least the largest
    assert p.non_model_peak >= (16 * 256 * 2 + 16 * 64 + 16 * 8) * 4
    assert p.non_model_peak < 4 * sum(q.numel() for q in built[0].parameters()) * 4


def test_fits_agrees_with_the_real_capacity_check():
    batch = torch.randn(4, 64)
    capacity = 2**20  # the 'cuda' state (0.75 MiB + gradients) does not fit; 'cpu' visits two chunks at a time
    plans = plan(build, batch, capacity, dtype=torch.float32, chunk_size=CHUNK)
    assert not plans["cuda"].fits and "device" in plans["cuda"].reason
    assert plans["cpu"].fits
    cm.set_device_memory_capacity(capacity - plans["cpu"].non_model_peak)  # what the chunks may use
    with pytest.raises(cm.DeviceCapacityError):
        real_run("cuda", torch.float32, batch)
    real_run("cpu", torch.float32, batch)
    host = plan(build, batch, capacity, host_memory=2**10, dtype=torch.float32, chunk_size=CHUNK)["cpu"]
    assert not host.fits and host.reason.startswith("host")


def test_bad_arguments_are_named():
    with pytest.raises(cm.InvalidArgumentError, match="policies"):
        plan(build, torch.randn(1, 64), 2**20, policies=("gpu",))
    with pytest.raises(cm.ArgumentTypeError, match="model_or_builder"):
        plan(3, torch.randn(1, 64), 2**20)
    with pytest.raises(cm.InvalidArgumentError, match="device_memory"):
        plan(build, torch.randn(1, 64), "lots")
    with pytest.raises(cm.InvalidArgumentError, match="chunk_size"):
        plan(build, torch.randn(1, 64), 2**20, dtype=torch.float32, chunk_size=64)


def test_command_line_prints_the_table():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "chunkmem.plan", "--preset", "tiny", "--seq-len", "32",
                          "--batch-size", "2", "--device-memory", "64MiB", "--dtype", "fp32"], cwd=root,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["policy", "fits"]
    assert [line.split()[0] for line in lines[1:4]] == ["cuda", "cpu", "auto"]
    assert format_table(plan(build, torch.randn(1, 64), 2**30)).count("\n") == 6
