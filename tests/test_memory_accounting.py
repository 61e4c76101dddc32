"""Per-tier byte counts and get_memory_usage() against bytes computed by hand."""
import pytest
import torch
import torch.nn as nn

import chunkmem as cm


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


# Linear(8, 8) = 64 + 8 elements; chunks of 128 elements: [w0, b0] (72) then [w1, b1] (72): 2 chunks.
CHUNKS, NUMEL = 2, 128


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype,reuse", [(torch.float16, True), (torch.float16, False), (torch.float32, False)])
def test_bytes_by_hand(policy, dtype, reuse):
    size = 2 if dtype == torch.float16 else 4
    model = cm.ShardedModelV2(two_linears(), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              reuse_fp16_shard=reuse, dtype=dtype, chunk_size=NUMEL * size)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), initial_scale=1.0)
    assert len(model.chunks) == CHUNKS and all(c.numel == NUMEL for c in model.chunks)
    rest, other = ("device", "host") if policy == "cuda" else ("host", "device")
    fp32_families = {"exp_avg": CHUNKS * NUMEL * 4, "exp_avg_sq": CHUNKS * NUMEL * 4}
    if dtype == torch.float16:
        fp32_families["master"] = CHUNKS * NUMEL * 4
    expected = {"param": CHUNKS * NUMEL * size, **fp32_families}
    assert model.tier_bytes() == {rest: expected, other: {}}
    optimizer_bytes = CHUNKS * NUMEL * 4 * 3
    assert optim.get_memory_usage() == ((optimizer_bytes, 0) if policy == "cuda" else (0, optimizer_bytes))
    if dtype == torch.float16 and reuse and policy == "cpu":
        total = sum(model.tier_bytes()["host"].values())
        assert total == 14 * CHUNKS * NUMEL  # 2 (16-bit param, also the grad) + 3 x 4 (fp32)

    x = torch.randn(4, 8)
    optim.backward(model(x).float().pow(2).sum())
    grads = {} if reuse else {"grad": CHUNKS * NUMEL * size}
    assert model.tier_bytes() == {rest: {**expected, **grads}, other: {}}
    optim.step()  # releases the gradients it consumed (the reference's step semantics)
    # under cpu the next forward's first chunk is on its way to the device (fetched after the step)
    ahead = {"device": {"param": NUMEL * size}} if policy == "cpu" else {}
    assert model.tier_bytes() == {rest: expected, other: {}, **ahead}
    optim.backward(model(x).float().pow(2).sum())
    optim.zero_grad(set_to_none=False)
    assert model.tier_bytes() == {rest: {**expected, **grads}, other: {}}
    optim.zero_grad(set_to_none=True)
    assert model.tier_bytes() == {rest: expected, other: {}}


def test_cpu_placement_device_peak_is_one_module_at_a_time():
    model = cm.ShardedModelV2(two_linears(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              reuse_fp16_shard=True, dtype=torch.float16, chunk_size=NUMEL * 2)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), initial_scale=1.0)
    ledger = model.runtime.ledger
    ledger.peak_device_bytes = 0
    optim.backward(model(torch.randn(4, 8)).float().sum())
    optim.step()
    # each Linear lives in its own chunk; forward holds one at a time, backward holds a chunk until
    # its gradients are done, so at most both 16-bit chunks are on the device at once
    assert 0 < ledger.peak_device_bytes <= CHUNKS * NUMEL * 2
    assert model.tier_bytes()["device"] == {"param": NUMEL * 2}  # the next forward's first chunk, fetched ahead


def test_after_the_step_only_the_first_period_is_fetched_ahead_and_prefetch_numel_0_fetches_nothing():
    """Under ``cpu`` the step ends by fetching the chunks the next forward's first period needs (here the
    first Linear's), so that their copies run while the caller prepares the next batch; the forward then
    fetches none of them on demand. ``prefetch_numel=0`` (no prefetch) leaves the device empty after the
    step, and both train alike, bit for bit."""
    results = []
    for prefetch_numel in (None, 0):
        model = cm.ShardedModelV2(two_linears(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=NUMEL * 4, prefetch_numel=prefetch_numel)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        device_after_step = []
        for _ in range(3):
            model.runtime.executor.events = []
            optim.backward(model(x).pow(2).sum())
            optim.step()
            device_after_step.append(model.tier_bytes()["device"])
        events = model.runtime.executor.events
        after_step = [e[1] for e in events if e[0] == "fetch" and e[2] == "after step"]
        if prefetch_numel is None:
            assert device_after_step == [{"param": NUMEL * 4}] * 3  # (the traced backward left a schedule)
            assert after_step == [0]
            first_period = events.index(next(e for e in events if e[0] == "period"))
            assert not [e for e in events[first_period:] if e[0] == "fetch" and e[1] == 0 and e[2] == "demand"]
        else:
            assert device_after_step == [{}, {}, {}] and after_step == []
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_capacity_below_one_module_raises_and_changes_nothing():
    module = two_linears()
    before = [p.detach().clone() for p in module.parameters()]
    cm.set_device_memory_capacity(NUMEL * 2 * 2 - 1)  # one fp16 chunk + its grad staging, minus a byte
    with pytest.raises(cm.DeviceCapacityError, match="capacity of 511 bytes.*512 bytes of the chunks of module .0."):
        cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float16,
                          chunk_size=NUMEL * 2)
    assert all(not hasattr(p, "_chunkmem_slot") for p in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    cm.set_device_memory_capacity(NUMEL * 2 * 2)
    cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float16,
                      chunk_size=NUMEL * 2)


def test_cuda_placement_capacity_for_optimizer_state():
    cm.set_device_memory_capacity(CHUNKS * NUMEL * 2 * 2)  # params + grads fit, fp32 state does not
    model = cm.ShardedModelV2(two_linears(), cm.TensorShardStrategy(), tensor_placement_policy="cuda",
                              dtype=torch.float16, chunk_size=NUMEL * 2)
    with pytest.raises(cm.DeviceCapacityError, match="optimizer state"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))
    assert model.tier_bytes()["device"] == {"param": CHUNKS * NUMEL * 2}
