"""The reference systems' step semantics, against plain PyTorch.

* The step releases the gradients it consumed (reference document 003's loop never calls
  ``zero_grad()``): a loop without it equals plain AdamW with it, for ShardedOptimizerV2 under every
  placement and for LowLevelZeroOptimizer.
* A configured clipping (DeepSpeed's ``gradient_clipping``, ``ShardedOptimizerV2(max_norm=)``) is applied
  inside the step: equal to plain AdamW after ``torch.nn.utils.clip_grad_norm_``.
"""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from models import TinyGPT, batches, lm_loss

LR, WD = 1e-2, 0.01


def _plain_run(reference: torch.nn.Module, data, clip: float = 0.0) -> list[torch.Tensor]:
    """Plain PyTorch: AdamW, zero_grad every step, optional clip_grad_norm_."""
    model = copy.deepcopy(reference)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x in data:
        lm_loss(model(x), x).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _loop_without_zero_grad(model, optim, data) -> None:
    """Reference document 003's loop: backward and step, never zero_grad."""
    for x in data:
        optim.backward(lm_loss(model(x), x))
        optim.step()


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_step_releases_gradients_like_the_reference_loop(policy):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=3)
    expected = _plain_run(reference, data)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    _loop_without_zero_grad(model, optim, data)
    state = model.state_dict()
    for (name, _), want in zip(reference.named_parameters(), expected):
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_an_overflow_skipped_step_releases_the_gradients_too():
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float16, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR), initial_scale=2**32)
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))  # the scale overflows fp16 gradients
    assert optim.step() is False
    assert all(p.grad is None for p in model.module.parameters())
    assert optim.step() is False  # nothing left to step on


def test_several_backwards_then_one_step_still_accumulate():
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=5)
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    for pair in (data[:2], data[2:]):
        for x in pair:
            lm_loss(plain(x), x).backward()
            optim.backward(lm_loss(model(x), x))
        plain_optim.step()
        plain_optim.zero_grad()
        optim.step()
    state = model.state_dict()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_low_level_zero_step_releases_gradients(stage):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=7)
    expected = _plain_run(reference, data)
    model = copy.deepcopy(reference)
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD),
                                     partition_grad=stage == 2)
    _loop_without_zero_grad(model, optim, data)
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("placement", ["none", "cpu"])
def test_deepspeed_stage3_gradient_clipping_is_applied_in_the_step(placement):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=9)
    clip = 0.05  # small enough to clip every step of this model
    expected = _plain_run(reference, data, clip=clip)
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": placement},
                                    "offload_param": {"device": placement}},
              "gradient_clipping": clip}
    module = copy.deepcopy(reference)
    model, optim = cm.initialize(module, torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD), config)
    assert optim.max_norm == clip
    _loop_without_zero_grad(model, optim, data)
    state = model.state_dict()
    for (name, _), want in zip(reference.named_parameters(), expected):
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_max_norm_clips_like_clip_grad_norm_and_an_explicit_call_wins():
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, seed=11)
    expected = _plain_run(reference, data, clip=0.05)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD), max_norm=10.0)
    for x in data:
        optim.backward(lm_loss(model(x), x))
        optim.clip_grad_norm(0.05)  # the explicit call decides this step's clipping
        optim.step()
    state = model.state_dict()
    for (name, _), want in zip(reference.named_parameters(), expected):
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_bad_max_norm_is_refused_before_anything_changes(bad):
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=16384)
    with pytest.raises(cm.InvalidArgumentError, match="max_norm"):
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), max_norm=bad)
    cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()))  # the model is still free to take one


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_a_parameter_frozen_at_wrapping_and_unfrozen_later_is_refused_not_ignored(policy):
    """torch keeps a frozen parameter in the optimizer's groups and trains it once unfrozen; its chunk here has
    no gradient or optimizer state. Before 2026-11-27 it silently never trained; now the forward (and a step)
    that would train it raises, naming it, and nothing changes; freezing it again trains on."""
    torch.manual_seed(0)
    module = TinyGPT()
    module.blocks[1].fc1.weight.requires_grad_(False)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR))
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    optim.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module.blocks[1].fc1.weight.requires_grad_(True)
    with pytest.raises(cm.UnsupportedOperationError, match="blocks.1.fc1.weight.*frozen.*when the model was wrapped"):
        model(x)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        model(x)  # evaluation is not training: allowed
    module.blocks[1].fc1.weight.requires_grad_(False)
    optim.backward(lm_loss(model(x), x))
    module.blocks[1].fc1.weight.requires_grad_(True)  # unfrozen between the backward and the step
    with pytest.raises(cm.UnsupportedOperationError, match="ShardedOptimizerV2.step"):
        optim.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("policy", ["cpu", "auto", "cuda"])
def test_a_second_backward_through_a_retained_graph_adds_the_gradients_as_torch(policy):
    """Before 2026-11-27 the second ``loss.backward()`` read a chunk already sent back to its tier ("setStorage
    ... out of bounds for storage of size 0") under cpu and auto: each backward pass now fetches the chunks."""
    torch.manual_seed(0)
    reference = TinyGPT()
    x = batches(1)[0]
    cm.set_device_memory_capacity(2**20 if policy == "auto" else None)
    try:
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                                  dtype=torch.float32, chunk_size=16384)
    finally:
        cm.set_device_memory_capacity(None)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR))
    loss = lm_loss(model(x), x)
    loss.backward(retain_graph=True)
    loss.backward()
    plain = copy.deepcopy(reference)
    plain_loss = lm_loss(plain(x), x)
    plain_loss.backward(retain_graph=True)
    plain_loss.backward()
    for p, q in zip(model.module.parameters(), plain.parameters()):
        if q.grad is not None:
            assert torch.equal(cm.utils.safe_get_full_grad(p), q.grad)
    assert optim.step()
