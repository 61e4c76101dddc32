"""The CUDA path of issue #10 (skipped without CUDA; on a GPU machine: ``pytest -m cuda tests/test_cuda.py``):
host-to-device transfers on a side stream with an event, the bounded pool of pinned staging buffers,
parameter shards and gradients pinned at their exact sizes (the rest pageable), gradients copied to the host
on the device-to-host stream bitwise as synchronous copies, and prefetch bitwise equal to no prefetch."""
import copy

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.core.copy_engine import start_copy
from chunkmem.core.transfer import PinnedStagingPool

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_host_to_device_copy_runs_on_a_side_stream_and_is_waited_on():
    src = torch.arange(1 << 20, dtype=torch.float32)  # pageable host memory
    dst = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    done = []
    handle = start_copy(dst, src, lambda: done.append(True))
    assert handle.on_side_stream and not handle.waited and done == []
    assert handle.device == dst.device
    src.zero_()  # the copy was staged through a pinned buffer: the source may change at once
    handle.wait()
    handle.wait()
    assert done == [True]
    assert torch.equal(dst.cpu(), torch.arange(1 << 20, dtype=torch.float32))


def test_device_to_host_copy_is_complete_when_issued():
    src = torch.arange(1000, dtype=torch.float32, device="cuda")
    dst = torch.empty(1000, dtype=torch.float32)
    handle = start_copy(dst, src, lambda: None)
    assert not handle.on_side_stream
    assert torch.equal(dst, torch.arange(1000, dtype=torch.float32))


def test_pinned_staging_pool_is_bounded():
    pool = PinnedStagingPool(max_buffers=2)
    stream = torch.cuda.Stream()
    for size in (4096, 4096, 8192, 4096, 8192, 8192):
        buf = pool.take(size)
        assert buf.is_pinned() and buf.numel() == size
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000)  # keep the "copy" reading the buffer busy for a while
            event = torch.cuda.Event()
            event.record(stream)
        pool.give_back(buf, event)
        assert pool.buffers <= 2
        assert pool.pinned_bytes <= 2 * 8192
    assert pool.peak_pinned_bytes <= 2 * 8192
    torch.cuda.synchronize()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64),
                         nn.GELU(), nn.Linear(64, 8))


def train_mlp(reference: nn.Module, policy: str, prefetch: bool, steps: int = 4):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              dtype=torch.float32, chunk_size=256 * 256 * 4)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
    model.runtime.executor.prefetch = prefetch
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g).cuda()
        loss = model(x).float().pow(2).mean()
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_shards_and_gradients_are_pinned_exactly_the_rest_pageable():
    model, _ = train_mlp(mlp(), "cpu", prefetch=True, steps=2)
    pinned = model.runtime.memory.pinned
    shards = [c.param.shard.tensor for c in model.chunks if c.param.shard.allocated]
    state = [c.optim["exp_avg"].tensor for c in model.chunks if c.optim["exp_avg"].allocated]
    assert shards and all(t.is_pinned() for t in shards)
    assert state and not any(t.is_pinned() for t in state)
    stats = model.memory_stats()["copy_engine"]
    assert stats["engine"] == "cuda" and stats["pinned_fallback_bytes"] == 0
    # every pinned block is one shard or one step's gradient, at its exact size: no power-of-two rounding
    shard_bytes = sum(t.numel() * t.element_size() for t in shards)
    grad_bytes = sum(c.grad.nbytes for c in model.chunks if c.trainable)
    assert stats["pinned_bytes"] == pinned.pinned_bytes == shard_bytes + grad_bytes
    assert stats["pinned_in_use_bytes"] == shard_bytes  # the step released the gradients: kept for the next


def test_gradient_copy_to_the_host_outlives_its_freed_source():
    from chunkmem.core.copy_engine import engine_named
    from chunkmem.core.pinned import PinnedHostMemory

    engine = engine_named("cuda")
    memory = PinnedHostMemory()
    dst = memory.empty(1 << 22, torch.float32)
    src = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
    torch.cuda._sleep(2_000_000)  # the compute stream is busy: the copy starts after it
    handle = engine.to_host(dst, src, "test")
    del src  # freed at once: record_stream keeps the memory until the copy read it
    scratch = torch.full((1 << 22,), -1.0, device="cuda")  # would reuse the block if it were free
    handle.wait()
    assert torch.equal(dst, torch.arange(1 << 22, dtype=torch.float32))
    del scratch
    memory.give_back(dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_asynchronous_copies_train_bitwise_as_synchronous_ones(policy, dtype):
    """The cuda engine (gradients leave on the device-to-host stream into pinned buffers, parameters come
    from pinned shards) against cuda-sync (every copy on the compute stream, waited for at once): with
    clipping that triggers, an fp16 overflow and the step in the backward; no host wait inside the backward
    when the step follows it; the norm's sums of squares taken as the gradients landed (chunkmem/optim/squares_ahead.py)
    under the cuda engine only."""
    from chunkmem.core import copy_engine

    reference = mlp()

    def run(engine, in_backward):
        copy_engine.set_copy_engine(engine)
        if policy == "auto":
            cm.set_device_memory_capacity(3 * 256 * 256 * 4 * 4)
        try:
            model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(),
                                      tensor_placement_policy=policy, dtype=dtype, chunk_size=256 * 256 * 4)
        finally:
            copy_engine.set_copy_engine(None)
            cm.set_device_memory_capacity(None)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10,
                                      max_norm=0.05, step_in_backward=in_backward)
        engine_waits = model.runtime.memory.copies.host_waits
        before = sum(v for k, v in engine_waits.items() if k.endswith("in backward"))
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            x = torch.randn(32, 64, generator=g).cuda()
            loss = model(x).float().pow(2).mean()
            optim.backward(loss * (float("inf") if step == 2 and dtype == torch.float16 else 1.0))
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        in_hooks = sum(v for k, v in engine_waits.items() if k.endswith("in backward")) - before
        return losses, {k: v.clone() for k, v in model.state_dict().items()}, in_hooks, optim._squares.used

    for in_backward in (False, True):
        sync_losses, sync_state, _, sync_ahead = run("cuda-sync", in_backward)
        async_losses, async_state, in_hooks, ahead = run("cuda", in_backward)
        assert sync_ahead == 0 and ahead > 0  # (no margin under auto here: every gradient lands on the host)
        assert async_losses == sync_losses
        for name, value in sync_state.items():
            assert torch.equal(value, async_state[name]), name
        if policy == "cpu":  # with the step in the backward too: its host updates run off autograd's thread
            assert in_hooks == 0


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_prefetch_on_cuda_matches_no_prefetch_bitwise(policy):
    reference = mlp()
    off_model, off_losses = train_mlp(reference, policy, prefetch=False)
    on_model, on_losses = train_mlp(reference, policy, prefetch=True)
    assert off_model.runtime.executor.prefetched == 0
    assert on_model.runtime.executor.prefetched > 0
    assert on_losses == off_losses
    for name, value in off_model.state_dict().items():
        assert torch.equal(value, on_model.state_dict()[name]), name
    assert on_model.memory_stats()["totals"]["moved_to_device_bytes"] == \
        off_model.memory_stats()["totals"]["moved_to_device_bytes"]


def test_prefetched_chunk_is_in_flight_until_its_period_waits():
    reference = mlp()
    model, _ = train_mlp(reference, "cpu", prefetch=True, steps=2)
    manager = model.runtime
    states = []

    def look(module, args):
        states.append([c.param.device_state.name for c in model.chunks])

    for layer in model.module:
        layer.register_forward_pre_hook(look)
    with torch.enable_grad():
        x = torch.randn(32, 64).cuda()
        loss = model(x).float().pow(2).mean()
    # while the first Linear computes, the next one's chunk was issued (FETCHING or already CURRENT)
    assert any(s[1] in ("FETCHING", "CURRENT") for s in states[:1])
    loss.backward()
    manager.scheduler.close_finished_traces()
    assert not any(c.param.fetching for c in model.chunks)


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_step_in_backward_with_state_in_memory_on_cuda_is_bitwise_the_plain_step(policy):
    """The backward's in-place updates (device-tier state under ``cuda``, host under ``cpu``) with an fp16
    overflow and clipping that triggers every other step: bitwise the step after the backward."""
    reference = mlp()

    def run(in_backward):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                                  dtype=torch.float16)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10,
                                      step_in_backward=in_backward, gpu_margin_mem_ratio=0.5 if policy == "auto" else 0)
        torch.manual_seed(1)
        steps = []
        for n in range(4):
            x = torch.randn(32, 64).cuda()
            optim.backward(model(x).float().pow(2).mean() * (float("inf") if n == 1 else 1.0))
            optim.clip_grad_norm(1e-3 if n % 2 else 1e6)
            steps.append(optim.step())
            optim.zero_grad()
        return model, steps

    (plain, plain_steps), (ahead, ahead_steps) = run(False), run(True)
    assert plain_steps == ahead_steps == [True, False, True, True]
    for name, value in plain.state_dict().items():
        assert torch.equal(value, ahead.state_dict()[name]), name


@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("dtype,rounding", [(torch.float32, False), (torch.bfloat16, True)])
def test_8bit_state_on_the_gpu_is_bitwise_torchaos_eager_step(dtype, rounding, step_in_backward):
    """torchao's ``AdamW8bit`` under ``cuda`` placement: codes, scales and parameters on the GPU, updated by the
    torch-op formulation (the C++ kernel is the host's); with ``bf16_stochastic_round`` the numbers come from the
    GPU's generator where torchao's step draws them. Bitwise torchao's eager step on the plain model on the GPU,
    the generator left where it leaves it."""
    torchao_optim = pytest.importorskip("torchao.optim")
    from models import TinyGPT, batches, lm_loss
    from torchao_reference import eager_step

    torch.manual_seed(0)
    reference = TinyGPT(d=64).to("cuda", dtype)
    data = [x.cuda() for x in batches(3, seed=31)]

    def make(params):
        return torchao_optim.AdamW8bit(params, lr=1e-2, weight_decay=0.05, bf16_stochastic_round=rounding)

    plain = copy.deepcopy(reference)
    plain_optim = make(plain.parameters())
    torch.manual_seed(1234)
    for x in data:
        lm_loss(plain(x), x).backward()
        eager_step(plain_optim)
        plain_optim.zero_grad()
    plain_rng = torch.cuda.get_rng_state()
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cuda", dtype=dtype,
                              chunk_size=(1 << 15) * dtype.itemsize)
    optim = cm.ShardedOptimizerV2(model, make(module.parameters()), step_in_backward=step_in_backward)
    torch.manual_seed(1234)
    for x in data:
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()
    state = model.state_dict()
    for key, p in plain.named_parameters():
        assert torch.equal(state[key].to(p.device, p.dtype), p.detach()), key
    ours, theirs = optim.state_dict()["state"], plain_optim.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = ours[index][key], entry[key]
            if hasattr(b, "codes"):
                assert torch.equal(a.codes.cpu(), b.codes.cpu()) and torch.equal(a.scale.cpu(), b.scale.cpu()), (index, key)
            else:
                assert torch.equal(a.cpu(), b.cpu()), (index, key)
    assert torch.equal(torch.cuda.get_rng_state(), plain_rng), "the GPU's generator is not where torchao leaves it"
