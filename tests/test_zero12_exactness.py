"""LowLevelZeroOptimizer (ZeRO-1/2) and chunkmem.initialize: defects found by fault injection.

Each test is against an independent reference: the module's own values before the call (a refused
call changes nothing, bitwise), or ``torch.optim.AdamW`` run with the same freeze schedule.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.optim import builder as optimizer_builder
from chunkmem.optim.host_adam_ext import fp32_reference_options
from distributed import run_ranks

LR, WD = 1e-2, 0.01


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8))
    return model.half().float()  # values exact in every 16-bit dtype: a cast and back changes nothing


def data(steps: int, batch: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g).half().float(), torch.randn(batch, 8, generator=g))
            for _ in range(steps)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def train(model: nn.Module, optim, batches, dtype: torch.dtype = torch.float32) -> None:
    for x, y in batches:
        optim.backward(loss_fn(model(x.to(dtype)), y))
        optim.step()
        optim.zero_grad()


def same(a, b) -> bool:
    """Bitwise equality of nested dicts / lists of tensors and plain values (dtype included)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def snapshot(model: nn.Module, optim=None) -> dict:
    """Everything a call may change: the module's values, the optimizer's masters and state dict."""
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    if optim is not None:
        out["masters"] = [optim.master_of(p) for p in model.parameters() if id(p) in optim._slot_of]
        out["optim"] = optim.state_dict()
    return out


def trained(seed: int = 0, **kwargs):
    model = make_model(seed)
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), **kwargs)
    train(model, optim, data(2, seed=seed + 1))
    return model, optim


# ---- 2: the module given to model_state_dict / save_checkpoint / load_checkpoint ----------------------

def test_model_state_dict_refuses_a_module_the_optimizer_does_not_train():
    model, optim = trained()
    other = make_model(5)
    before = snapshot(other), snapshot(model, optim)
    with pytest.raises(cm.InvalidArgumentError) as info:
        optim.model_state_dict(other)
    assert info.value.argument == "module" and "parameters the optimizer holds" in info.value.allowed
    with pytest.raises(cm.InvalidArgumentError, match="module"):
        optim.model_state_dict(model[0])  # a part of the trained module: the optimizer holds more
    with pytest.raises(cm.InvalidArgumentError, match="module"):
        optim.load_model_state_dict(other, optim.model_state_dict(model))
    assert same(before, (snapshot(other), snapshot(model, optim)))


def test_save_and_load_checkpoint_refuse_a_module_the_optimizer_does_not_train(tmp_path):
    model, optim = trained()
    path = str(tmp_path / "ckpt.pt")
    other = make_model(5)
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.save_checkpoint(path, other, optim)
    assert info.value.argument == "model" and not os.path.exists(path)
    cm.save_checkpoint(path, model, optim)
    train(model, optim, data(1, seed=7))  # the trained module moves on from the checkpoint
    before = snapshot(other), snapshot(model, optim)
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.load_checkpoint(path, other, optim)
    assert info.value.argument == "model"
    assert same(before, (snapshot(other), snapshot(model, optim)))


def test_a_module_with_frozen_parameters_the_optimizer_does_not_hold_is_its_module(tmp_path):
    model = make_model()
    model[0].requires_grad_(False)
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR))
    train(model, optim, data(1))
    saved = optim.model_state_dict(model)
    assert set(saved) == set(model.state_dict())
    cm.save_checkpoint(str(tmp_path / "a.pt"), model, optim)
    cm.load_checkpoint(str(tmp_path / "a.pt"), model, optim)
    model[2].requires_grad_(False)  # frozen after construction: still held, still its module
    optim.model_state_dict(model)


# ---- 3: load_model_state_dict checks every value before it writes ------------------------------------

def _bad_values(shape: tuple[int, ...]) -> dict:
    value = torch.randn(shape)
    return {"complex": torch.complex(value, value), "int64": (value * 100).long(),
            "meta": torch.empty(shape, device="meta"), "sparse": value.to_sparse()}


@pytest.mark.parametrize("kind", ["complex", "int64", "meta", "sparse"])
def test_load_model_state_dict_refuses_a_bad_value_and_changes_nothing(kind):
    model, optim = trained()
    source, _ = trained(seed=3)  # other values everywhere: a partial load would show
    state = dict(source.state_dict())
    last = list(state)[-1]  # checked after every other key has been
    state[last] = _bad_values(tuple(state[last].shape))[kind]
    before = snapshot(model, optim)
    with pytest.raises(cm.InvalidArgumentError) as info:
        optim.load_model_state_dict(model, state)
    assert last in info.value.argument
    assert same(before, snapshot(model, optim))


# ---- 4: a parameter's requires_grad at the step decides whether it is updated ------------------------

def _freeze_schedule(model: nn.Module, step: int) -> None:
    """The third Linear's weight is frozen from the second step on; its bias from the third."""
    model[4].weight.requires_grad_(step < 1)
    model[4].bias.requires_grad_(step < 2)


def test_parameter_frozen_after_construction_matches_torch_adamw():
    model, ref = make_model(), make_model()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    adamw = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, **fp32_reference_options())
    for n, (x, y) in enumerate(data(4)):
        _freeze_schedule(model, n)
        _freeze_schedule(ref, n)
        optim.backward(loss_fn(model(x), y))
        optim.step()
        optim.zero_grad()
        loss_fn(ref(x), y).backward()
        adamw.step()
        adamw.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, name
    assert torch.equal(model[4].weight, ref[4].weight)  # frozen: not decayed, not moved by momentum
    ours, theirs = optim.state_dict()["state"], adamw.state_dict()["state"]
    for index in theirs:
        for key in ("exp_avg", "exp_avg_sq"):
            assert (ours[index][key] - theirs[index][key]).abs().max().item() <= 1e-6, (index, key)


@pytest.mark.parametrize("dtype,cpu_offload", [(torch.float16, False), (torch.bfloat16, True),
                                               (torch.float32, True)])
def test_parameter_frozen_after_construction_does_not_move_in_16_bit_and_offload(dtype, cpu_offload):
    model = make_model().to(dtype)
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                                     cpu_offload=cpu_offload, initial_scale=2.0**8)
    train(model, optim, data(1), dtype)
    model[2].requires_grad_(False)
    frozen = model[2].weight
    value, master = frozen.detach().clone(), optim.master_of(frozen)
    moments = {k: v.clone() for k, v in optim.state_dict()["state"][2].items() if k != "step"}
    train(model, optim, data(3, seed=4), dtype)
    assert torch.equal(frozen, value) and torch.equal(optim.master_of(frozen), master)
    after = optim.state_dict()["state"][2]
    assert all(torch.equal(after[k], v) for k, v in moments.items())
    assert not torch.equal(model[0].weight.float(), make_model()[0].weight)  # the others did train


def test_parameter_frozen_at_construction_and_unfrozen_later_is_refused_at_the_step():
    model = make_model()
    model[2].requires_grad_(False)
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    train(model, optim, data(1))
    model[2].weight.requires_grad_(True)
    (x, y), = data(1, seed=4)
    optim.backward(loss_fn(model(x), y))
    before = snapshot(model, optim)
    with pytest.raises(cm.UnsupportedOperationError, match=r"index 2 .*shape \(8, 16\).*build the LowLevelZeroOptimizer with it"):
        optim.step()
    assert same(before, snapshot(model, optim))
    model[2].weight.requires_grad_(False)  # frozen again: the optimizer goes on
    assert optim.step()


# ---- 2 and 4 over two ranks (stage 2): the refusal is symmetric, the frozen shard stays ------------

def _two_ranks(rank: int, world: int) -> dict:
    model = make_model()
    optim = cm.LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                                     partition_grad=True)
    refused = False
    try:
        optim.model_state_dict(make_model(5))
    except cm.InvalidArgumentError:
        refused = True
    for n, (x, y) in enumerate(data(4, batch=4)):
        _freeze_schedule(model, n)
        optim.backward(loss_fn(model(x[rank * 2:rank * 2 + 2]), y[rank * 2:rank * 2 + 2]))
        optim.step()
        optim.zero_grad()
        if n == 0:
            after_first = model[4].weight.detach().clone()
    return dict(refused=refused, params=[p.detach().clone() for p in model.parameters()], after_first=after_first)


def test_two_ranks_freeze_like_torch_and_refuse_a_foreign_module():
    results = run_ranks(_two_ranks, 2)
    ref = make_model()
    adamw = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, **fp32_reference_options())
    for n, (x, y) in enumerate(data(4, batch=4)):
        _freeze_schedule(ref, n)
        loss_fn(ref(x), y).backward()
        adamw.step()
        adamw.zero_grad()
    for result in results:
        assert result["refused"]
        for p, q in zip(result["params"], ref.parameters()):
            assert (p - q).abs().max().item() <= 1e-6
        assert torch.equal(result["params"][4], result["after_first"])  # frozen from the second step on
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


# ---- 5 and 12: initialize checks the optimizer against the model before anything changes ------------

class WithBuffer(nn.Module):
    """A model with a buffer; ``exact=False``: fp32 values a 16-bit cast would round."""

    def __init__(self, exact: bool = True) -> None:
        super().__init__()
        self.body = make_model()
        if not exact:
            with torch.no_grad():
                for p in self.body.parameters():
                    p.add_(1e-4 / 3)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


FORMS = {
    "stage1": {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}},
    "stage2": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    "stage3": {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}},
    "colossal": {"zero": {"model_config": {"tensor_placement_policy": "cpu"}, "optimizer_config": {"initial_scale": 8}}},
}


def module_record(module: nn.Module) -> dict:
    """The module as a plain module: values, dtypes, devices, classes, hooks, attributes."""
    return {
        "params": [(type(p), p.dtype, p.device, p.requires_grad, p.detach().clone()) for p in module.parameters()],
        "ids": [id(p) for p in module.parameters()],
        "buffers": [(name, b.dtype, b.device, b.clone()) for name, b in module.named_buffers()],
        "classes": [type(m) for m in module.modules()],
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for m in module.modules()]
        + [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in module.parameters()],
        "attributes": sorted(k for m in module.modules() for k in vars(m) if "chunkmem" in k or "zero" in k)
        + sorted(k for p in module.parameters() for k in vars(p)),
    }


def assert_unchanged(before: dict, module: nn.Module) -> None:
    after = module_record(module)
    for key in ("ids", "classes", "hooks", "attributes"):
        assert after[key] == before[key], key
    for (t0, d0, dev0, r0, v0), (t1, d1, dev1, r1, v1) in zip(before["params"], after["params"]):
        assert (t1, d1, dev1, r1) == (t0, d0, dev0, r0) and torch.equal(v0, v1)
    for (n0, d0, dev0, v0), (n1, d1, dev1, v1) in zip(before["buffers"], after["buffers"]):
        assert (n1, d1, dev1) == (n0, d0, dev0) and torch.equal(v0, v1)


@pytest.mark.parametrize("form", list(FORMS))
def test_initialize_refuses_an_optimizer_over_another_module_and_changes_nothing(form):
    model = WithBuffer()
    before = module_record(model)
    foreign = cm.HybridAdam(WithBuffer().parameters(), lr=LR)
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, foreign, FORMS[form])
    assert info.value.argument == "optimizer"
    assert_unchanged(before, model)
    partial = cm.HybridAdam(model.body[0].parameters(), lr=LR)  # the model's, but not all its trainable ones
    with pytest.raises(cm.InvalidArgumentError) as info:
        cm.initialize(model, partial, FORMS[form])
    assert info.value.argument == "optimizer"
    assert_unchanged(before, model)
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=LR), FORMS[form])  # still free to wrap
    assert o is not None
    x, y = data(1)[0]
    o.backward(loss_fn(m(x.to(next(m.parameters()).dtype) if form in ("stage1", "stage2") else x), y))
    assert o.step() is not False


@pytest.mark.parametrize("form", list(FORMS))
def test_initialize_refuses_an_unsupported_optimizer_and_changes_nothing(form):
    model = WithBuffer()
    before = module_record(model)
    with pytest.raises(cm.InvalidArgumentError, match="closure"):  # LBFGS's step cannot run on stand-ins
        cm.initialize(model, torch.optim.LBFGS(model.parameters()), FORMS[form])
    assert_unchanged(before, model)
    with pytest.raises(cm.ArgumentTypeError):
        cm.initialize(model, object(), FORMS[form])
    assert_unchanged(before, model)
    cm.initialize(model, cm.HybridAdam(model.parameters(), lr=LR), FORMS[form])


def test_initialize_checks_the_optimizer_settings_against_the_model_before_wrapping():
    model = WithBuffer()
    before = module_record(model)
    config = {"zero": {"model_config": {"tensor_placement_policy": "cpu", "reuse_fp16_shard": True},
                       "optimizer_config": {"step_in_backward": True}}}  # in memory: not with reuse_fp16_shard
    with pytest.raises(cm.InvalidArgumentError, match=r"zero\.optimizer_config\.step_in_backward"):
        cm.initialize(model, cm.HybridAdam(model.parameters(), lr=LR), config)
    assert_unchanged(before, model)


@pytest.mark.parametrize("form", ["stage3", "colossal"])
def test_initialize_undoes_the_wrapping_when_the_optimizer_state_cannot_be_placed(form, monkeypatch):
    """A failure that only the wrapped model can detect (the optimizer state's capacity) leaves the
    module as it was: the wrapping is undone, its 16-bit cast included."""
    def no_room(model, layout=None) -> None:
        raise cm.DeviceCapacityError("no room for the optimizer state (injected)")

    model = WithBuffer(exact=False)
    assert not torch.equal(model.body[0].weight.half().float(), model.body[0].weight)
    before = module_record(model)
    monkeypatch.setattr(optimizer_builder, "check_capacity", no_room)
    with pytest.raises(cm.DeviceCapacityError):
        cm.initialize(model, cm.HybridAdam(model.parameters(), lr=LR), FORMS[form])
    assert_unchanged(before, model)
    monkeypatch.undo()
    m, o = cm.initialize(model, cm.HybridAdam(model.parameters(), lr=LR), FORMS[form])
    x, y = data(1)[0]
    o.backward(loss_fn(m(x), y))
    o.step()
