"""Frozen and unused parameters, activation checkpointing, gradient accumulation, eval and no_grad."""
import copy

import pytest
import torch

import chunkmem as cm
from chunkmem.core.chunk import EXP_AVG, MASTER
from models import TinyGPT, batches, build_sharded, lm_loss, train


def plain_run(reference, data, accumulate=1, lr=1e-2, weight_decay=0.01):
    model = copy.deepcopy(reference)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                              weight_decay=weight_decay, fused=True)
    for i, x in enumerate(data):
        lm_loss(model(x), x).backward()
        if (i + 1) % accumulate == 0:
            optim.step()
            optim.zero_grad()
    return model


def assert_same_params(sharded, plain, rtol=1e-6):
    state = sharded.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=rtol, atol=rtol * max(value.abs().max().item(), 1))


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
def test_frozen_and_unused_parameters(policy):
    torch.manual_seed(0)
    reference = TinyGPT(unused_param=True)
    reference.blocks[0].fc1.requires_grad_(False)
    data = batches(3)
    model, optim = build_sharded(reference, policy, torch.float32)
    train(model, optim, data)
    plain = plain_run(reference, data)
    assert_same_params(model, plain)
    frozen = [c for c in model.chunks if not c.trainable]
    assert frozen and all(not c.optim[EXP_AVG].allocated and not c.grad.allocated for c in frozen)
    names = {s.name for c in frozen for s in c.slots}
    assert names == {"blocks.0.fc1.weight", "blocks.0.fc1.bias"}
    # the unused parameter got no gradient: not stepped at all, as torch skips it (before 2026-11-27 it got zero
    # gradients and AdamW decayed it)
    assert torch.equal(model.state_dict()["unused.weight"], reference.unused.weight.detach())


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("policy,reuse,dtype", [("cpu", False, torch.float32), ("cpu", True, torch.bfloat16)])
def test_activation_checkpointing(policy, reuse, dtype, use_reentrant, monkeypatch):
    import models

    original = models.checkpoint
    monkeypatch.setattr(models, "checkpoint", lambda fn, x, use_reentrant: original(fn, x, use_reentrant=flag))
    flag = use_reentrant
    torch.manual_seed(1)
    reference = TinyGPT(d=16, layers=2)
    checkpointed = copy.deepcopy(reference)
    for block in checkpointed.blocks:
        block.use_checkpoint = True
    data = batches(3, seq=8)
    model_a, optim_a = build_sharded(reference, policy, dtype, reuse=reuse)
    model_b, optim_b = build_sharded(checkpointed, policy, dtype, reuse=reuse)
    assert train(model_a, optim_a, data) == train(model_b, optim_b, data)
    for name, value in model_a.state_dict().items():
        assert torch.equal(value, model_b.state_dict()[name]), name


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
def test_gradient_accumulation_without_reuse(policy):
    torch.manual_seed(2)
    reference = TinyGPT()
    data = batches(4)
    model, optim = build_sharded(reference, policy, torch.float32)
    for i, x in enumerate(data):
        optim.backward(lm_loss(model(x), x))
        if i % 2 == 1:
            optim.step()
            optim.zero_grad()
    assert_same_params(model, plain_run(reference, data, accumulate=2))


def test_gradient_accumulation_refused_with_reuse():
    torch.manual_seed(3)
    model, optim = build_sharded(TinyGPT(d=16, layers=1), "cpu", torch.bfloat16, reuse=True)
    x = batches(1, seq=8)[0]
    optim.backward(lm_loss(model(x), x))
    masters = {c.index: c.optim[MASTER].tensor.clone() for c in model.chunks if c.trainable}
    with pytest.raises(cm.GradientAccumulationError, match="reuse_fp16_shard"):
        model(x)
    with pytest.raises(cm.GradientAccumulationError, match="reuse_fp16_shard"):
        optim.backward(torch.zeros((), requires_grad=True))
    for chunk in model.chunks:
        if chunk.trainable:
            assert torch.equal(masters[chunk.index], chunk.optim[MASTER].tensor)
    assert optim.step() is True  # the refused calls changed nothing: the step still runs
    optim.zero_grad()
    model(x)


def test_eval_and_no_grad_forward_leave_nothing_on_device():
    torch.manual_seed(4)
    reference = TinyGPT()
    model, optim = build_sharded(reference, "cpu", torch.float32)
    x = batches(1)[0]
    model.eval()
    with torch.no_grad():
        out = model(x)
    reference.eval()
    with torch.no_grad():
        assert torch.equal(out, reference(x))
    assert model.tier_bytes()["device"] == {}
    model.train()
    train(model, optim, [x])
    assert model.tier_bytes()["device"] == {}


def test_buffers_follow_dtype_and_device():
    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("offset", torch.ones(4))
            self.register_buffer("count", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return self.lin(x) + self.offset

    model = cm.ShardedModelV2(WithBuffer(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.bfloat16)
    assert model.module.offset.dtype == torch.bfloat16 and model.module.count.dtype == torch.long
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32


def test_foreign_parameter_used_first_after_warm_up_works_at_once():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x, use_b_weight=False):
            y = self.a(x)
            if use_b_weight:
                y = y + torch.nn.functional.linear(x, self.b.weight)
            return y

    torch.manual_seed(0)
    plain = Branchy()
    model = cm.ShardedModelV2(copy.deepcopy(plain), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=128)
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)
        # the parameter guard fetches b's chunk for the running module at its first use
        assert torch.equal(model(x, use_b_weight=True), plain(x, use_b_weight=True))
        assert torch.equal(model(x, use_b_weight=True), plain(x, use_b_weight=True))
    assert model.tier_bytes()["device"] == {}
