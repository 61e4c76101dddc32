"""GatheredParameters, register_external_parameter, where hooks sit, post-forward hooks that run when
a forward raises, model.unwrap() and model.zero_grad()."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import chunkmem as cm
from chunkmem.core.param_guard import ChunkParameter
from distributed import run_ranks
from models import TinyGPT, batches, build_sharded, lm_loss, train, upcast_by_autograd

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DATA = batches(3)


def _changed_copy(model: cm.ShardedModelV2, name: str, dtype: torch.dtype) -> dict:
    """model.state_dict() with ``name`` halved the way the GatheredParameters blocks below halve it: in
    the parameter's dtype, then widened."""
    state = model.state_dict()
    state[name] = (state[name].to(dtype) * 0.5).float()
    return state


def _halve_gathered(model: cm.ShardedModelV2, name: str, modifier_rank: int = 0, rank: int = 0) -> None:
    param = dict(model.module.named_parameters())[name]
    with cm.GatheredParameters([param], modifier_rank=modifier_rank):
        with torch.no_grad():
            if rank == modifier_rank:
                param.mul_(0.5)
            else:
                param.zero_()  # not the modifier: overwritten by the broadcast on exit


@pytest.mark.parametrize("policy", ["cpu", "cuda", "auto", "static"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gathered_reads_state_dict_and_a_change_trains_on_like_a_loaded_twin(policy, dtype_name):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    reference = TinyGPT()
    extra = {"offload_param_frac": 0.5, "offload_optim_frac": 0.5} if policy == "static" else {}
    models = []
    for _ in range(2):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=policy,
                                  dtype=dtype, chunk_size=16384, **extra)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                      initial_scale=2**10)
        train(model, optim, DATA[:1])
        models.append((model, optim))
    (model, optim), (twin, twin_optim) = models
    name = "blocks.0.fc1.weight"
    params = dict(model.module.named_parameters())
    state = model.state_dict()
    with cm.GatheredParameters(list(model.parameters())):
        for key, param in params.items():
            assert torch.equal(param.detach().cpu(), state[key].to(dtype)), key
    expected = _changed_copy(model, name, dtype)
    _halve_gathered(model, name)
    twin.load_state_dict(expected)
    after = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(after[key], value), key  # only the changed parameter moved, its master exactly
    assert train(model, optim, DATA[1:]) == train(twin, twin_optim, DATA[1:])
    for (key, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), key


def test_gathered_change_trains_on_like_plain_pytorch_fp32():
    torch.manual_seed(0)
    reference = TinyGPT()
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    model, optim = build_sharded(reference, "cpu", torch.float32)
    for index, x in enumerate(DATA):
        if index == 1:
            _halve_gathered(model, "blocks.1.fc2.weight")
            with torch.no_grad():
                plain.blocks[1].fc2.weight.mul_(0.5)
        loss = lm_loss(plain(x), x)
        loss.backward()
        plain_optim.step()
        plain_optim.zero_grad()
        train(model, optim, [x])
    state = model.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6 * value.abs().max().item())


def _gathered_worker(rank: int, world: int) -> dict:
    results = {}
    for dtype in (torch.float32, torch.float16):
        runs = []
        for via_gather in (True, False):
            torch.manual_seed(0)
            model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                                      chunk_size=16384)
            optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10)
            data = [x[rank::world] for x in batches(3, batch=4)]
            train(model, optim, data[:1])
            name = "blocks.0.fc2.weight"
            state = model.state_dict()
            param = dict(model.module.named_parameters())[name]
            with cm.GatheredParameters([param]):
                read_ok = torch.equal(param.detach(), state[name].to(dtype))
            if via_gather:
                _halve_gathered(model, name, modifier_rank=1, rank=rank)
            else:
                model.load_state_dict(_changed_copy(model, name, dtype))
            train(model, optim, data[1:])
            runs.append((read_ok, model.state_dict()))
        results[str(dtype)] = runs
    return results


def test_gathered_parameters_on_two_ranks():
    ranks = run_ranks(_gathered_worker, 2)
    for dtype, runs in ranks[0].items():
        (read_a, gathered), (read_b, loaded) = runs
        assert read_a and read_b
        for key, value in gathered.items():
            assert torch.equal(value, loaded[key]), (dtype, key)
            assert torch.equal(value, ranks[1][dtype][0][1][key]), (dtype, key)


def test_gathered_parameters_refuses_and_validates():
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(), "cpu", torch.float16)
    param = model.module.blocks[0].fc1.weight
    with pytest.raises(cm.ParameterAccessError, match="read-only GatheredParameters"):
        with cm.GatheredParameters([param]):
            with torch.no_grad():
                param.zero_()
    with pytest.raises(cm.ParameterAccessError, match="fp32 master"):
        with torch.no_grad():
            param.zero_()  # outside: a 16-bit parameter with a master needs GatheredParameters
    with pytest.raises(cm.InvalidArgumentError, match="modifier_rank"):
        cm.GatheredParameters([param], modifier_rank=1)
    with pytest.raises(TypeError):
        cm.GatheredParameters(param, enabled="yes")
    with cm.GatheredParameters([param], modifier_rank=0, enabled=False):
        with pytest.raises(cm.ParameterAccessError):
            with torch.no_grad():
                param.zero_()
    assert all(c.users == 0 for c in model.chunks)  # nothing held (a released copy may stay cached)


def test_fp32_parameter_without_master_is_written_in_place_outside_forward():
    torch.manual_seed(0)
    reference = TinyGPT()
    model, optim = build_sharded(reference, "cpu", torch.float32)
    plain = copy.deepcopy(reference)
    with torch.no_grad():
        model.module.blocks[0].fc1.bias.fill_(0.25)
        nn.init.zeros_(model.module.blocks[1].fc1.weight)
        model.module.ln_f.weight.data.mul_(2.0)
        plain.blocks[0].fc1.bias.fill_(0.25)
        nn.init.zeros_(plain.blocks[1].fc1.weight)
        plain.ln_f.weight.data.mul_(2.0)
    state = model.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key], value), key


def test_register_external_parameter_before_and_after_wrapping():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x) + F.linear(x, self.b.weight)  # b's weight used outside b

    torch.manual_seed(0)
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            dtype=torch.float32, chunk_size=512):
        built = Shared()
    cm.register_external_parameter(built, built.b.weight)
    model = cm.ShardedModelV2(built, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    chunk_of_b = model.module.b.weight._chunkmem_slot.chunk
    assert chunk_of_b in model.runtime.module_chunks[model.module]  # known before any forward
    torch.manual_seed(1)
    other = cm.ShardedModelV2(Shared(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              chunk_size=512)
    cm.register_external_parameter(other.module, other.module.b.weight)
    assert other.module.b.weight._chunkmem_slot.chunk in other.runtime.module_chunks[other.module]
    with pytest.raises(cm.InvalidArgumentError, match="parameter"):
        cm.register_external_parameter(other.module, nn.Parameter(torch.zeros(2)))


def test_hooks_sit_only_on_modules_with_chunks_and_the_root():
    torch.manual_seed(0)
    model, _ = build_sharded(TinyGPT(), "cpu", torch.float32)
    hooked = {name for name, m in model.module.named_modules() if m._forward_pre_hooks}
    owners = {name for name, m in model.module.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert hooked == owners | {""}
    assert "blocks" not in hooked and "blocks.0" not in hooked


def test_a_forward_that_raises_releases_its_chunks():
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.fail = True

        def forward(self, x):
            y = self.lin(x)
            if self.fail:
                raise ValueError("boom")
            return y

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), Fails())
    model = cm.ShardedModelV2(copy.deepcopy(plain), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=128)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4))
    assert all(c.users == 0 and not c.held_for_backward for c in model.chunks)
    assert not model.runtime.in_forward
    model.module[1].fail = plain[1].fail = False
    x = torch.randn(2, 4)
    assert torch.equal(model(x), plain(x))


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_non_reentrant_checkpoint_early_stop_leaves_nothing_held(policy):
    torch.manual_seed(0)
    reference = TinyGPT(use_checkpoint=True)
    if policy == "auto":
        cm.set_device_memory_capacity(320 * 1024)
    model, optim = build_sharded(reference, policy, torch.float32)
    for x in batches(4):
        with torch.utils.checkpoint.set_checkpoint_early_stop(True):  # torch's default, made explicit
            optim.backward(lm_loss(model(x), x))
        assert all(c.users == 0 for c in model.chunks)
        if policy == "cpu":
            assert set(model.tier_bytes()["device"]) <= {"grad_staging"} or model.tier_bytes()["device"] == {}
        optim.step()
        optim.zero_grad()
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for x in batches(4):
        loss = lm_loss(plain(x), x)
        loss.backward()
        plain_optim.step()
        plain_optim.zero_grad()
    state = model.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())


@pytest.mark.parametrize("dtype_name", ["fp32", "fp16"])
def test_unwrap_gives_a_plain_module_with_the_current_values(dtype_name):
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(), "cpu", DTYPES[dtype_name])
    train(model, optim, DATA[:2])
    state = model.state_dict()
    params_before = {name: p for name, p in model.module.named_parameters()}
    plain = model.unwrap()
    assert all(type(p) is nn.Parameter for p in plain.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in plain.modules())
    for name, param in plain.named_parameters():
        assert param is params_before[name]
        assert torch.equal(param.detach(), state[name]), name
    x = DATA[2]
    loss = lm_loss(plain(x), x)
    loss.backward()
    assert plain.wte.weight.grad is not None
    assert model.runtime.ledger.tier_bytes(cm.Tier.HOST) == 0


def test_model_zero_grad_and_param_grad_stand_in():
    torch.manual_seed(0)
    model, optim = build_sharded(TinyGPT(), "cpu", torch.float32)
    x = DATA[0]
    param = model.module.blocks[0].fc1.weight
    assert param.grad is None
    optim.backward(lm_loss(model(x), x))
    assert isinstance(param.grad, cm.ChunkGradient) and param.grad.shape == param.shape
    assert "ChunkGradient" in repr(param.grad)
    param.grad = None  # zeroes this parameter's part of the chunk gradient
    slot = param._chunkmem_slot
    assert torch.count_nonzero(slot.view(model.runtime.grad_of(slot.chunk))) == 0
    model.zero_grad()
    assert param.grad is None and not optim.step()
    assert isinstance(param, ChunkParameter) and isinstance(param, nn.Parameter)


def test_gathering_one_chunk_after_another_outside_an_iteration_frees_each_device_copy():
    # reported by the disk-tier benchmark: released device copies stayed (stale) until the device tier was
    # full, as no period boundary came to free them
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    cm.set_device_memory_capacity(3 * 8192)
    try:
        model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", chunk_size=8192,
                                  dtype=torch.bfloat16, reuse_fp16_shard=True)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
        optim.backward(model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum())
        optim.step()
        optim.zero_grad()
        for layer in net:
            with cm.GatheredParameters([layer.weight]):
                pass
            assert model.tier_bytes()["device"].get("param", 0) == 0
    finally:
        cm.set_device_memory_capacity(None)


_KEPT_VIEWS_CHILD = """
import torch, chunkmem as cm
from models import TinyGPT, batches, lm_loss
for modifier_rank in (None, 0):
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
    with cm.GatheredParameters(list(model.module.parameters()), modifier_rank=modifier_rank):
        kept = model.module.state_dict()
        data = model.module.wte.weight.data
        if modifier_rank is not None:
            with torch.no_grad():
                model.module.ln_f.weight.mul_(0.5)  # a change: written back into the chunk on exit
    expected = model.state_dict()
    for x in batches(2):  # the chunks' memory is freed, reused and refilled
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()
    for key, value in kept.items():
        assert torch.equal(value, expected[key]), key
    assert torch.equal(data, expected["wte.weight"])
print("ok")
"""


def test_views_kept_from_a_gathered_block_stay_valid_after_it():
    """A state_dict() (or p.data) taken inside GatheredParameters views the gathered memory; read after the block
    (whose chunks are freed and refilled by training) it keeps the values it had. Before 2026-11-27 reading it
    crashed the process (a segmentation fault): a child process runs it."""
    import os
    import subprocess
    import sys
    tests = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-c", _KEPT_VIEWS_CHILD], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_guard_finds_the_parameters_torch_s_argument_tree_holds():
    """The guard looks for chunk-managed parameters in a call's arguments with a scan of tuples, lists and dicts
    of its own (torch's pytree was a third of its time on every call): it finds what ``tree_leaves`` finds."""
    from collections import namedtuple

    from torch.utils._pytree import tree_leaves

    from chunkmem.core.param_guard import _guarded_in

    model = cm.ShardedModelV2(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), cm.TensorShardStrategy())
    w0, b0, w1, b1 = model.module.parameters()
    pair = namedtuple("pair", "a b")
    args = (torch.ones(2), [w0, (b0, 3.0)], pair(w1, None), {"k": [b1]}, "text")
    kwargs = {"out": None, "weights": (w1, {"x": w0})}
    expected = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, ChunkParameter)]
    found = _guarded_in(args, [])
    _guarded_in(kwargs.values(), found)
    assert [id(p) for p in found] == [id(p) for p in expected] and len(found) == 6



@pytest.mark.parametrize("policy,reuse", [("cpu", False), ("cpu", True), ("cuda", False), ("auto", True)])
def test_a_custom_functions_backward_reads_the_held_parameter_itself(policy, reuse, monkeypatch):
    """The reference GPT's ``UpcastLinear`` (a custom autograd Function whose backward reads its saved weight)
    trains bitwise like the same model upcasting through autograd's nodes, and its backward's reads make no
    copy of the chunk's values: the backward holds the chunk on the device."""
    import chunkmem.core.param_guard as param_guard
    from chunkmem.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab=64, d_model=32, layers=2, heads=4, seq=16)
    torch.manual_seed(0)
    reference = GPT(cfg, upcast=True)
    copies, current_values = [], param_guard._current_values
    monkeypatch.setattr(param_guard, "_current_values", lambda slot: copies.append(slot.name) or current_values(slot))
    states = []
    for module in (copy.deepcopy(reference), upcast_by_autograd(copy.deepcopy(reference))):
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=policy,
                                  dtype=torch.bfloat16, reuse_fp16_shard=reuse, chunk_size=8192)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=1)
        for tokens in batches(3, vocab=64, seq=17):
            optim.backward(F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 64), tokens[:, 1:].reshape(-1)))
            optim.step()
            optim.zero_grad()
        states.append(model.state_dict())
    assert copies == []
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key
