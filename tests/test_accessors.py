"""chunkmem.utils accessors (DeepSpeed's safe_get_* / safe_set_*) against plain PyTorch, model.state_dict()
and optim.state_dict(), every placement, fp32/fp16/bf16, one and two ranks."""
from __future__ import annotations

import copy
import tempfile

import pytest
import torch

import chunkmem as cm
from chunkmem import utils
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss

POLICY_KWARGS = {"cuda": {}, "cpu": {}, "auto": {}, "static": {"offload_param_frac": 0.5, "offload_optim_frac": 0.5},
                 # cpu placement with the disk tier: optimizer state and parameters in files
                 "disk": {"offload_optimizer": "disk", "offload_param": "disk", "nvme_path": tempfile.gettempdir()}}


def _build(reference, policy, dtype, reuse=False, lr=1e-2, process_group=None):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(),
                              tensor_placement_policy="cpu" if policy == "disk" else policy,
                              reuse_fp16_shard=reuse, dtype=dtype, chunk_size=16384, process_group=process_group,
                              **POLICY_KWARGS[policy])
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=lr, weight_decay=0.01),
                                  initial_scale=2**10)
    return model, optim


def _named(model):
    return list(model.module.named_parameters())


def _close(actual, expected, tol=1e-6):
    assert actual is not None
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(expected.abs().max().item(), 1e-12))


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto", "static", "disk"])
def test_fp32_getters_and_setters_match_torch_adamw(policy):
    torch.manual_seed(0)
    reference = TinyGPT()
    model, optim = _build(reference, policy, torch.float32)
    twin = copy.deepcopy(reference)
    twin_optim = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01)
    twin_params = dict(twin.named_parameters())
    named = _named(model)
    # before any backward / step: values yes, gradients and optimizer state no (torch: p.grad None, no state)
    for name, p in named:
        assert torch.equal(utils.safe_get_full_fp32_param(p), twin_params[name].detach())
        assert utils.safe_get_full_grad(p) is None and utils.safe_get_local_grad(p) is None
        assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None
        with pytest.raises(cm.UnsupportedOperationError, match="first"):
            utils.safe_set_full_optimizer_state(p, torch.zeros(p.shape), "exp_avg")
    for step, x in enumerate(batches(3)):
        optim.backward(lm_loss(model(x), x))
        lm_loss(twin(x), x).backward()
        for name, p in named:
            _close(utils.safe_get_full_grad(p), twin_params[name].grad)
            assert torch.equal(utils.safe_get_local_grad(p), utils.safe_get_full_grad(p).reshape(-1))
        optim.step()
        twin_optim.step()
        state = model.state_dict()
        saved = optim.state_dict()["state"]
        for index, (name, p) in enumerate(named):
            full = utils.safe_get_full_fp32_param(p)
            assert torch.equal(full, state[name])
            _close(full, twin_params[name].detach())
            assert torch.equal(utils.safe_get_local_fp32_param(p), full.reshape(-1))
            for key in ("exp_avg", "exp_avg_sq"):
                value = utils.safe_get_full_optimizer_state(p, key)
                assert torch.equal(value, saved[index][key])
                _close(value, twin_optim.state[twin_params[name]][key])
                assert torch.equal(utils.safe_get_local_optimizer_state(p, key), value.reshape(-1))
        if step == 0:  # set values, on both, then keep training: the next steps must agree again
            for i, (name, p) in enumerate(named):
                g = torch.Generator().manual_seed(i)
                new = torch.randn(p.shape, generator=g) * 0.02
                avg = torch.randn(p.shape, generator=g) * 1e-3
                utils.safe_set_full_fp32_param(p, new)
                utils.safe_set_local_optimizer_state(p, avg.reshape(-1), "exp_avg")
                utils.safe_set_full_optimizer_state(p, avg.square(), "exp_avg_sq")
                with torch.no_grad():
                    twin_params[name].copy_(new)
                twin_optim.state[twin_params[name]]["exp_avg"].copy_(avg)
                twin_optim.state[twin_params[name]]["exp_avg_sq"].copy_(avg.square())
                assert torch.equal(utils.safe_get_full_fp32_param(p), new)
        optim.zero_grad()
        twin_optim.zero_grad()
        for _, p in named:
            assert utils.safe_get_full_grad(p) is None
    # the parameter copy the forward uses holds the set values too
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        _close(model(x), twin(x), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy,reuse", [("cpu", False), ("cuda", True), ("auto", False), ("static", True),
                                          ("disk", False)])
def test_16bit_accessors_match_state_dicts(dtype, policy, reuse):
    if reuse and dtype == torch.bfloat16:
        pytest.skip("one reuse case per dtype is enough")
    torch.manual_seed(1)
    reference = TinyGPT()
    model, optim = _build(reference, policy, dtype, reuse=reuse)
    named = _named(model)
    for x in batches(2, seed=2):
        optim.backward(lm_loss(model(x), x))
        twin = copy.deepcopy(reference)
        twin.load_state_dict(model.state_dict())
        lm_loss(twin.to(dtype)(x), x).backward()
        twin_grads = dict(twin.named_parameters())
        for name, p in named:
            grad = utils.safe_get_full_grad(p)
            # the gradient is unscaled (loss scale 2**10 for fp16) and 16-bit: near the 16-bit twin's
            _close(grad, twin_grads[name].grad.float(), 0.1)
            assert torch.equal(utils.safe_get_local_grad(p), grad.reshape(-1))
        if reuse:
            with pytest.raises(cm.UnsupportedOperationError, match="gradients"):
                utils.safe_set_full_fp32_param(named[0][1], torch.zeros(named[0][1].shape))
        optim.step()
        if reuse:  # the step overwrote the gradients' memory with the new parameters
            assert all(utils.safe_get_full_grad(p) is None for _, p in named)
        state = model.state_dict()
        saved = optim.state_dict()["state"]
        for index, (name, p) in enumerate(named):
            assert torch.equal(utils.safe_get_full_fp32_param(p), state[name])
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(utils.safe_get_full_optimizer_state(p, key), saved[index][key])
        optim.zero_grad()
    # a set fp32 value is kept exactly in the master; the 16-bit copy is its rounding
    name, p = named[1]
    value = torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.1
    utils.safe_set_full_fp32_param(p, value)
    assert torch.equal(utils.safe_get_full_fp32_param(p), value.float())
    assert torch.equal(model.state_dict()[name], value.float())
    with cm.GatheredParameters([p]):
        assert torch.equal(p.detach().clone(), value.float().to(dtype))


def test_16bit_without_optimizer_has_no_fp32_master_and_set_keeps_the_rounding():
    torch.manual_seed(2)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float16, chunk_size=16384)
    name, p = _named(model)[0]
    assert utils.safe_get_full_fp32_param(p) is None and utils.safe_get_local_fp32_param(p) is None
    value = torch.full(p.shape, 0.1)
    utils.safe_set_full_fp32_param(p, value)
    assert torch.equal(model.state_dict()[name], value.half().float())


def test_bad_input_is_refused_and_changes_nothing():
    torch.manual_seed(3)
    model, optim = _build(TinyGPT(), "cpu", torch.float32)
    x = batches(1)[0]
    optim.backward(lm_loss(model(x), x))
    optim.step()
    p = _named(model)[0][1]
    before = utils.safe_get_full_fp32_param(p)
    with pytest.raises(cm.ArgumentTypeError, match="param"):
        utils.safe_get_full_fp32_param(torch.zeros(3))
    with pytest.raises(cm.InvalidArgumentError, match="param"):
        utils.safe_get_full_grad(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(cm.InvalidArgumentError, match="optim_state_key.*'exp_avg'"):
        utils.safe_get_full_optimizer_state(p, "momentum")
    with pytest.raises(cm.ArgumentTypeError, match="optim_state_key"):
        utils.safe_get_local_optimizer_state(p, 1)
    with pytest.raises(cm.InvalidArgumentError, match="shape"):
        utils.safe_set_full_fp32_param(p, torch.zeros(p.numel() + 1))
    with pytest.raises(cm.InvalidArgumentError, match="elements"):
        utils.safe_set_local_fp32_param(p, torch.zeros(p.numel() - 1))
    with pytest.raises(cm.InvalidArgumentError, match="floating"):
        utils.safe_set_full_fp32_param(p, torch.zeros(p.shape, dtype=torch.long))
    with pytest.raises(cm.ArgumentTypeError, match="value"):
        utils.safe_set_full_optimizer_state(p, [0.0], "exp_avg")
    assert torch.equal(utils.safe_get_full_fp32_param(p), before)
    # inside the forward: refused
    seen = []

    def hook(module, args):
        with pytest.raises(cm.ParameterAccessError, match="forward"):
            utils.safe_get_full_fp32_param(p)
        seen.append(True)

    handle = model.module.ln_f.register_forward_pre_hook(hook)
    model(x)
    handle.remove()
    assert seen


def _two_ranks(rank, world, dtype):
    import torch.distributed as dist

    torch.manual_seed(4)
    reference = TinyGPT()
    model, optim = _build(reference, "cpu", dtype)
    twin = copy.deepcopy(reference)
    twin_optim = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01)
    twin_params = dict(twin.named_parameters())
    named = _named(model)
    x = batches(1)[0]  # the same batch on both ranks: the mean gradient is the twin's
    optim.backward(lm_loss(model(x), x))
    lm_loss(twin(x), x).backward()
    checks = 0
    for name, p in named:
        grad = utils.safe_get_full_grad(p)
        if dtype == torch.float32:
            _close(grad, twin_params[name].grad)
        pieces = [None] * world
        dist.all_gather_object(pieces, utils.safe_get_local_grad(p))
        assert torch.equal(torch.cat(pieces), grad.reshape(-1))
        checks += 1
    optim.step()
    twin_optim.step()
    state = model.state_dict()
    saved = optim.state_dict()["state"]
    for index, (name, p) in enumerate(named):
        full = utils.safe_get_full_fp32_param(p)
        assert torch.equal(full, state[name])
        if dtype == torch.float32:
            _close(full, twin_params[name].detach())
        for key in ("exp_avg", "exp_avg_sq"):
            value = utils.safe_get_full_optimizer_state(p, key)
            assert torch.equal(value, saved[index][key])
            if dtype == torch.float32:
                _close(value, twin_optim.state[twin_params[name]][key])
            pieces = [None] * world
            dist.all_gather_object(pieces, utils.safe_get_local_optimizer_state(p, key))
            assert torch.equal(torch.cat(pieces), value.reshape(-1))
        # local setters: each rank writes its part; the full value is the two parts joined
        local = utils.safe_get_local_fp32_param(p)
        utils.safe_set_local_fp32_param(p, torch.full_like(local, float(rank + 1)))
        utils.safe_set_local_optimizer_state(p, torch.full_like(local, float(rank + 3)), "exp_avg")
        pieces = [None] * world
        dist.all_gather_object(pieces, (torch.full_like(local, float(rank + 1)), torch.full_like(local, rank + 3.0)))
        assert torch.equal(utils.safe_get_full_fp32_param(p).reshape(-1), torch.cat([a for a, _ in pieces]))
        assert torch.equal(utils.safe_get_full_optimizer_state(p, "exp_avg").reshape(-1),
                           torch.cat([b for _, b in pieces]))
    split = sum(1 for _, p in named if 0 < utils.safe_get_local_fp32_param(p).numel() < p.numel())
    return checks, split, model.state_dict()[named[0][0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_ranks_full_forms_gather_and_local_forms_are_the_shards(dtype):
    results = run_ranks(_two_ranks, 2, dtype)
    assert results[0][0] == results[1][0] > 0
    assert torch.equal(results[0][2], results[1][2])
    assert results[0][1] + results[1][1] > 0, "no parameter straddles the two shards: the test would miss the split"
