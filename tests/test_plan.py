"""chunkmem.plan against real runs: the bytes per tier and family, and the bytes moved per step, must
equal what ShardedModelV2 / ShardedOptimizerV2 account in their ledger; 'fits' agrees with the real
capacity check."""
from __future__ import annotations

import sys
import os

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.plan import format_table, plan
from models import resting_tier_bytes

CHUNK = 64 * 256 * 4


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 8))


def real_run(policy: str, dtype: torch.dtype, batch: torch.Tensor, builder=build, chunk: int = CHUNK,
             loss_fn=None) -> tuple[dict, tuple[int, int], int]:
    m = cm.ShardedModelV2(builder(), cm.TensorShardStrategy(), tensor_placement_policy=policy, dtype=dtype,
                          chunk_size=chunk)
    o = cm.ShardedOptimizerV2(m, cm.HybridAdam(m.parameters(), lr=1e-3), initial_scale=2**8)
    ledger = m.runtime.ledger
    for _ in range(3):  # auto plans after its traced first step: compare the last
        before = ledger.moved_to_device, ledger.moved_to_host
        out = m(batch)
        loss = loss_fn(out, batch) if loss_fn else out.float().mean()
        o.backward(loss)
        o.step()
        o.zero_grad()
    traced_peak = max(p.non_model_peak for p in m.runtime.scheduler.periods)
    return resting_tier_bytes(m), (ledger.moved_to_device - before[0], ledger.moved_to_host - before[1]), traced_peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plan_bytes_equal_a_real_run(dtype):
    batch = torch.randn(4, 64)
    plans = plan(build, batch, 10 * 2**20, dtype=dtype, chunk_size=CHUNK)
    cm.set_device_memory_capacity(10 * 2**20)
    for policy in ("cuda", "cpu", "auto"):
        tiers, moved, _ = real_run(policy, dtype, batch)
        p = plans[policy]
        assert p.fits and p.chunk_bytes == CHUNK
        assert p.tier_bytes == tiers, policy
        assert (p.moved_to_device_per_step, p.moved_to_host_per_step) == moved, policy
    # hand-computed: fp32, chunks of 16384 elements: [w1], [b1], [w2], and the last [b2, w3, b3] trimmed to
    # its 584 elements rounded up to 640; fp16, chunks of 32768: [w1, b1] and [w2, b2, w3, b3] (16968 -> 17024)
    numel = 16384 * 3 + 640 if dtype == torch.float32 else 32768 + 17024
    param = numel * dtype.itemsize
    optim = {"exp_avg": numel * 4, "exp_avg_sq": numel * 4}  # Adam state is fp32
    if dtype == torch.float16:
        optim["master"] = numel * 4
    assert plans["cuda"].tier_bytes == {"device": {"param": param, **optim}, "host": {}}
    assert plans["cuda"].device_peak_bytes == param * 2 + sum(optim.values())  # parameters, gradients, Adam
    assert plans["cuda"].moved_to_device_per_step == 0


def test_plan_of_a_gpt_with_tied_and_functionally_used_weights_equals_a_real_run():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import TinyGPT, lm_loss

    def builder():
        torch.manual_seed(0)
        return TinyGPT(vocab=64, d=32, layers=2, seq=16)

    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plans = plan(builder, batch, 64 * 2**20, dtype=torch.float32, chunk_size=16384, loss_fn=lm_loss)
    cm.set_device_memory_capacity(64 * 2**20)
    for policy in ("cuda", "cpu", "auto"):
        tiers, moved, traced_peak = real_run(policy, torch.float32, batch, builder, 16384, lm_loss)
        p = plans[policy]
        assert p.num_chunks == 9 and p.tier_bytes == tiers, policy
        assert (p.moved_to_device_per_step, p.moved_to_host_per_step) == moved, policy
        # the meta run's tracer counts what the real one counts (both loops keep the output through backward)
        assert p.non_model_peak == traced_peak


def test_attention_is_counted_as_the_fused_kernel_of_a_real_run(monkeypatch):
    """The meta run counts scaled_dot_product_attention as the CPU's fused kernel does (no sequence x
    sequence matrices): its traced peak equals the real run's."""
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from chunkmem.gpt import GPT, GPTConfig

    def builder():
        torch.manual_seed(0)
        return GPT(GPTConfig(128, 64, 2, 2, 128))

    batch = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    p = plan(builder, batch, 64 * 2**20, dtype=torch.float32, chunk_size=65536, policies=("cpu",))["cpu"]
    cm.set_device_memory_capacity(64 * 2**20)
    tiers, moved, traced_peak = real_run("cpu", torch.float32, batch, builder, 65536)
    assert (p.tier_bytes, (p.moved_to_device_per_step, p.moved_to_host_per_step)) == (tiers, moved)
    assert p.non_model_peak == traced_peak


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
    capacity = 3 * CHUNK * 4  # the 'cuda' state (0.76 MiB with the gradients) does not fit; 'cpu' visits two chunks at a time
    plans = plan(build, batch, capacity, dtype=torch.float32, chunk_size=CHUNK)
    assert not plans["cuda"].fits and "device" in plans["cuda"].reason
    assert plans["cpu"].fits
    cm.set_device_memory_capacity(capacity - plans["cpu"].non_model_peak)  # what the chunks may use
    with pytest.raises(cm.DeviceCapacityError):
        real_run("cuda", torch.float32, batch)
    real_run("cpu", torch.float32, batch)
    host = plan(build, batch, capacity, host_memory=2**10, dtype=torch.float32, chunk_size=CHUNK)["cpu"]
    assert not host.fits and host.reason.startswith("host")
    assert cm.device_memory_capacity() == capacity - plans["cpu"].non_model_peak  # plan restored the setting


def test_bad_arguments_are_named():
    with pytest.raises(cm.InvalidArgumentError, match="policies"):
        plan(build, torch.randn(1, 64), 2**20, policies=("gpu",))
    with pytest.raises(cm.ArgumentTypeError, match="model_or_builder"):
        plan(3, torch.randn(1, 64), 2**20)
    with pytest.raises(cm.InvalidArgumentError, match="device_memory"):
        plan(build, torch.randn(1, 64), "lots")
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), dtype=torch.float32):
        in_chunks = build()
    with pytest.raises(cm.InvalidArgumentError, match="model_or_builder"):
        plan(in_chunks, torch.randn(1, 64), 2**20)
    module = build()
    assert plan(module, torch.randn(1, 64), 2**30, dtype=torch.float32)["cpu"].num_chunks >= 1  # a plain module
    assert not any(p.is_meta for p in module.parameters())  # was copied, not moved
    with pytest.raises(cm.InvalidArgumentError, match="chunk_size"):
        plan(build, torch.randn(1, 64), 2**20, dtype=torch.float32, chunk_size=64)


def test_command_line_prints_the_table(capsys, monkeypatch):
    from chunkmem.plan.cli import main as _main

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
    _main(["--preset", "tiny", "--seq-len", "8", "--batch-size", "1", "--device-memory", "64MiB", "--dtype", "fp32"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["policy", "fits"]
    assert [line.split()[:2] for line in lines[1:4]] == [["cuda", "yes"], ["cpu", "yes"], ["auto", "yes"]]
    # tiny preset: vocab 512, d_model 256, 4 layers, 8 positions (examples/train_gpt.py's GPT at --seq-len 8)
    n_params = 512 * 256 + 8 * 256 + 4 * (12 * 256 * 256 + 13 * 256) + 2 * 256
    assert float(lines[1].split()[2]) == pytest.approx(3 * 4 * n_params / 2**20, rel=0.05)  # param + 2 moments
    assert format_table(plan(build, torch.randn(1, 64), 2**30)).count("\n") == 6


def test_activations_that_do_not_fit_beside_the_chunks_make_a_plan_not_fit():
    """'cuda' at a capacity that holds its chunks at their peak (parameters, gradients, Adam moments:
    4 families of 3 full chunks and the trimmed last one) but not the activations of a large batch beside
    them."""
    batch = torch.randn(4096, 64)  # the first Linear's output alone is 4 MiB
    p = plan(build, batch, 18 * CHUNK, dtype=torch.float32, chunk_size=CHUNK, policies=("cuda",))["cuda"]
    chunks = 3 * CHUNK + 640 * 4
    assert p.device_peak_bytes == 4 * chunks and p.non_model_peak >= 4096 * 256 * 4
    assert not p.fits and "non-model peak" in p.reason
    assert p.tier_bytes["device"] == {"param": chunks, "exp_avg": chunks, "exp_avg_sq": chunks}
    assert plan(build, torch.randn(4, 64), 18 * CHUNK, dtype=torch.float32, chunk_size=CHUNK,
                policies=("cuda",))["cuda"].fits


def accumulating_run(policy: str, dtype: torch.dtype, batch: torch.Tensor, backwards: int,
                     grad_accum_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """A real run with ``backwards`` backwards before each of 3 steps: its ledger's device peak read before
    the last step (the ledger's device peak restarts at each period, as the meta run's does) and its host
    peak. The optimizer state is on the ledger here; the plan adds it to its peaks."""
    m = cm.ShardedModelV2(build(), cm.TensorShardStrategy(), tensor_placement_policy=policy, dtype=dtype,
                          chunk_size=CHUNK, grad_accum_dtype=grad_accum_dtype)
    o = cm.ShardedOptimizerV2(m, cm.HybridAdam(m.parameters(), lr=1e-3), initial_scale=2**8)
    ledger = m.runtime.ledger
    for _ in range(3):
        for _ in range(backwards):
            o.backward(m(batch).float().mean())
        device_peak = ledger.peak_device_bytes
        o.step()
        o.zero_grad()
    return device_peak, ledger.peak_host_bytes


def test_gradient_accumulation_counts_the_sums_widened_to_fp32_at_the_peak():
    """bf16 with two backwards before a step: the second backward widens each chunk's 16-bit sum to fp32 where
    it rests (the device under 'cuda', the host under 'cpu'); the plan's peak there grows by exactly those
    bytes, as a real run's ledger counts them. Summed in bf16 (grad_accum_dtype), or an fp32 model: no change."""
    batch = torch.randn(4, 64)
    bf16 = torch.bfloat16
    one = plan(build, batch, 10 * 2**20, dtype=bf16, chunk_size=CHUNK, policies=("cuda", "cpu"))
    two = plan(build, batch, 10 * 2**20, dtype=bf16, chunk_size=CHUNK, policies=("cuda", "cpu"),
               gradient_accumulation_steps=2)
    kept = plan(build, batch, 10 * 2**20, dtype=bf16, chunk_size=CHUNK, policies=("cuda", "cpu"),
                gradient_accumulation_steps=2, grad_accum_dtype=bf16)
    # the layout (chunks of 32768 elements): [w1, b1] and [w2, b2, w3, b3] trimmed to 17024 (see above)
    numels = one["cuda"].extra["trainable_shard_numels"]
    assert numels == [32768, 17024] and two["cpu"].extra["trainable_shard_numels"] == numels
    # the backward reaches the chunks last to first, and the first gradient of each widens the chunk's sum of
    # the first backward: 2 bytes more per element of every chunk widened so far, and while the 16-bit sum
    # is copied into its fp32 buffer both are held (4 bytes more per element of that chunk); the peak is at
    # the first chunk, the last one widened
    widened = max(2 * sum(numels[k + 1:]) + 4 * numels[k] for k in range(len(numels)))
    assert widened == 2 * (32768 + 17024) + 2 * 32768 == 165120
    # where the sums rest: 'cuda' on the device, 'cpu' on the host (the device holds this backward's 16-bit
    # staging buffer, freed when the chunk's gradients are added to the host's sum)
    assert two["cuda"].device_peak_bytes - one["cuda"].device_peak_bytes == widened
    assert two["cuda"].host_peak_bytes == one["cuda"].host_peak_bytes
    assert two["cpu"].host_peak_bytes - one["cpu"].host_peak_bytes == widened
    assert two["cpu"].device_peak_bytes == one["cpu"].device_peak_bytes
    for policy in ("cuda", "cpu"):
        assert (kept[policy].device_peak_bytes, kept[policy].host_peak_bytes) == \
            (one[policy].device_peak_bytes, one[policy].host_peak_bytes), policy
        assert two[policy].fits and two[policy].gradient_accumulation_steps == 2
        assert two[policy].tier_bytes == one[policy].tier_bytes  # between steps: nothing more rests
    # the reference: real runs' ledgers, with one and two backwards before each step
    cm.set_device_memory_capacity(10 * 2**20)
    for policy in ("cuda", "cpu"):
        for plans, backwards, summed_in in ((one, 1, None), (two, 2, None), (kept, 2, bf16)):
            real = accumulating_run(policy, bf16, batch, backwards, summed_in)
            assert (plans[policy].device_peak_bytes, plans[policy].host_peak_bytes) == real, (policy, backwards)
    # fp32: the sums are fp32 already
    one32 = plan(build, batch, 10 * 2**20, dtype=torch.float32, chunk_size=CHUNK, policies=("cuda", "cpu"))
    two32 = plan(build, batch, 10 * 2**20, dtype=torch.float32, chunk_size=CHUNK, policies=("cuda", "cpu"),
                 gradient_accumulation_steps=2)
    for policy in ("cuda", "cpu"):
        assert (two32[policy].device_peak_bytes, two32[policy].host_peak_bytes) == \
            (one32[policy].device_peak_bytes, one32[policy].host_peak_bytes), policy
        assert (two32[policy].device_peak_bytes, two32[policy].host_peak_bytes) == \
            accumulating_run(policy, torch.float32, batch, 2), policy
    # a third backward adds in fp32: the peak of the second one's widening stays the step's peak
    three = plan(build, batch, 10 * 2**20, dtype=bf16, chunk_size=CHUNK, policies=("cuda",),
                 gradient_accumulation_steps=3)["cuda"]
    assert three.device_peak_bytes == two["cuda"].device_peak_bytes
    # the bytes moved per step are those of its passes: twice one pass's under 'cpu' (fetches and gradients)
    assert two["cpu"].moved_to_device_per_step == 2 * one["cpu"].moved_to_device_per_step


def test_fits_turns_false_when_the_widened_sums_exceed_a_capacity():
    """A device capacity (under 'cuda') and a host capacity (under 'cpu') between the peaks of one and two
    backwards per step: the plan fits with one and not with two, as a real run under that capacity trains
    with one backward per step and runs out with two."""
    batch = torch.randn(4, 64)
    bf16 = torch.bfloat16
    one = plan(build, batch, 10 * 2**20, dtype=bf16, chunk_size=CHUNK, policies=("cuda", "cpu"))
    two = plan(build, batch, 10 * 2**20, dtype=bf16, chunk_size=CHUNK, policies=("cuda", "cpu"),
               gradient_accumulation_steps=2)
    cuda_chunks = (one["cuda"].device_peak_bytes + two["cuda"].device_peak_bytes) // 2
    device = cuda_chunks + one["cuda"].non_model_peak
    assert plan(build, batch, device, dtype=bf16, chunk_size=CHUNK, policies=("cuda",))["cuda"].fits
    refused = plan(build, batch, device, dtype=bf16, chunk_size=CHUNK, policies=("cuda",),
                   gradient_accumulation_steps=2)["cuda"]
    assert not refused.fits and refused.reason.startswith("device")
    assert plan(build, batch, device, dtype=bf16, chunk_size=CHUNK, policies=("cuda",), gradient_accumulation_steps=2,
                grad_accum_dtype=bf16)["cuda"].fits  # summed in bf16: nothing widened
    host = (one["cpu"].host_peak_bytes + two["cpu"].host_peak_bytes) // 2
    assert plan(build, batch, 10 * 2**20, host, dtype=bf16, chunk_size=CHUNK, policies=("cpu",))["cpu"].fits
    refused = plan(build, batch, 10 * 2**20, host, dtype=bf16, chunk_size=CHUNK, policies=("cpu",),
                   gradient_accumulation_steps=2)["cpu"]
    assert not refused.fits and refused.reason.startswith("host")
    # the real runtime agrees (its device capacity bounds the chunks alone)
    cm.set_device_memory_capacity(cuda_chunks)
    accumulating_run("cuda", bf16, batch, 1)
    with pytest.raises(cm.DeviceCapacityError):
        accumulating_run("cuda", bf16, batch, 2)
    cm.set_device_memory_capacity(10 * 2**20)
    cm.set_host_memory_capacity(host)
    try:
        accumulating_run("cpu", bf16, batch, 1)
        with pytest.raises(cm.HostCapacityError):
            accumulating_run("cpu", bf16, batch, 2)
    finally:
        cm.set_host_memory_capacity(None)


def test_bad_accumulation_arguments_are_named():
    batch = torch.randn(1, 64)
    for value in (0, -1):
        with pytest.raises(cm.InvalidArgumentError, match="gradient_accumulation_steps"):
            plan(build, batch, 2**20, gradient_accumulation_steps=value)
    for value in (2.0, True, "2", None):
        with pytest.raises(cm.ArgumentTypeError, match="gradient_accumulation_steps"):
            plan(build, batch, 2**20, gradient_accumulation_steps=value)
    with pytest.raises(cm.InvalidArgumentError, match="gradient_accumulation_steps"):  # cannot accumulate
        plan(build, batch, 2**20, reuse_fp16_shard=True, gradient_accumulation_steps=2)
    for dtype, value in ((torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, "fp32"),
                         (torch.float16, torch.int8)):
        with pytest.raises(cm.InvalidArgumentError, match="grad_accum_dtype"):
            plan(build, batch, 2**20, dtype=dtype, grad_accum_dtype=value)
        with pytest.raises(cm.InvalidArgumentError, match="grad_accum_dtype"):  # ShardedModelV2's own check
            cm.ShardedModelV2(build(), cm.TensorShardStrategy(), dtype=dtype, grad_accum_dtype=value)
