"""ShardedOptimizerV2 as a torch.optim.Optimizer (LR schedulers, hooks, repr, refusals), the fp16
loss.backward() misuse check, and bool-only flags (task H4)."""
import copy
import pickle

import pytest
import torch
from torch.optim import lr_scheduler

import chunkmem as cm
from chunkmem.core.chunk import EXP_AVG, EXP_AVG_SQ, MASTER
from models import TinyGPT, batches, build_sharded, lm_loss

LR, WD, STEPS = 1e-2, 0.01, 6


def two_groups(named_params):
    """Matrices with weight decay, vectors without: the same split for the plain and the chunked model."""
    named = list(named_params)
    return [{"params": [p for _, p in named if p.dim() >= 2]},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def make_scheduler(kind, optim):
    if kind == "lambda":  # one function per group
        return lr_scheduler.LambdaLR(optim, [lambda e: 0.7 ** e, lambda e: 1.0 / (1 + e)])
    if kind == "cosine":
        return lr_scheduler.CosineAnnealingLR(optim, T_max=STEPS, eta_min=1e-4)
    if kind == "onecycle":
        return lr_scheduler.OneCycleLR(optim, max_lr=[2e-2, 1e-2], total_steps=STEPS, cycle_momentum=True,
                                       base_momentum=0.8, max_momentum=0.95)
    if kind == "onecycle_fixed_betas":
        return lr_scheduler.OneCycleLR(optim, max_lr=[2e-2, 1e-2], total_steps=STEPS, cycle_momentum=False)
    if kind == "plateau":
        return lr_scheduler.ReduceLROnPlateau(optim, factor=0.5, patience=0, threshold=10.0)
    raise AssertionError(kind)


def run(model, optim, sched, data, *, chunked):
    """Train over ``data``; returns the (lr, beta1) of every group as each step used them."""
    used = []
    for x in data:
        used.append([(g["lr"], g["betas"][0]) for g in optim.param_groups])
        loss = lm_loss(model(x), x)
        if chunked:
            optim.backward(loss)
        else:
            loss.backward()
        optim.step()
        optim.zero_grad()
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(loss.item())
        else:
            sched.step()
    return used


def plain_run(reference, kind, data):
    plain = copy.deepcopy(reference)
    optim = torch.optim.AdamW(two_groups(plain.named_parameters()), lr=LR, weight_decay=WD)
    used = run(plain, optim, make_scheduler(kind, optim), data, chunked=False)
    return plain, used


def chunked_pair(reference, dtype=torch.float32):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=dtype, chunk_size=4096)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(two_groups(model.module.named_parameters()), lr=LR,
                                                       weight_decay=WD), initial_scale=2**10)
    return model, optim


def assert_params_close(model, plain, tol=1e-6):
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=tol, atol=tol, msg=name)


# ---- torch.optim.Optimizer ------------------------------------------------------------------------


def test_is_an_optimizer_over_the_wrapped_groups_without_a_second_state():
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    assert isinstance(optim, torch.optim.Optimizer)
    assert optim.param_groups is optim.optim.param_groups
    assert optim.defaults is optim.optim.defaults and optim.defaults["betas"] == (0.9, 0.999)
    assert optim.state is optim.optim.state and len(optim.state) == 0
    assert "param_groups" not in vars(optim) and "state" not in vars(optim) and "defaults" not in vars(optim)
    optim.param_groups[1]["lr"] = 0.5  # one list: a change through either object is seen by both
    assert optim.optim.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("kind", ["lambda", "cosine", "onecycle", "plateau"])
def test_scheduler_gives_the_same_lrs_and_weights_as_on_torch_adamw(kind):
    torch.manual_seed(0)
    reference = TinyGPT(d=16, layers=1, seq=8)
    data = batches(STEPS, seq=8)
    plain, plain_used = plain_run(reference, kind, data)
    model, optim = chunked_pair(reference)
    assert len([c for c in model.chunks if c.trainable]) >= 2
    sched = make_scheduler(kind, optim)
    used = run(model, optim, sched, data, chunked=True)
    assert used == plain_used  # exactly: the same scheduler arithmetic on the same values
    lrs = [u[0][0] for u in used]
    assert len(set(lrs)) > 2, lrs  # the schedule did change the lr
    if kind == "onecycle":
        beta1s = [u[0][1] for u in used]
        assert len(set(beta1s)) > 2 and min(beta1s) == pytest.approx(0.8, abs=0.02), beta1s
    assert_params_close(model, plain)


def test_onecycle_betas_reach_the_chunked_update():
    """Control: the weights differ from the run with fixed betas by far more than the tolerance above."""
    torch.manual_seed(0)
    reference = TinyGPT(d=16, layers=1, seq=8)
    data = batches(STEPS, seq=8)
    fixed, _ = plain_run(reference, "onecycle_fixed_betas", data)
    model, optim = chunked_pair(reference)
    run(model, optim, make_scheduler("onecycle", optim), data, chunked=True)
    state = model.state_dict()
    gap = max((state[k] - v).abs().max().item() for k, v in fixed.state_dict().items())
    assert gap > 1e-4


@pytest.mark.parametrize("kind", ["cosine", "onecycle", "plateau"])
def test_scheduler_state_dict_round_trip_resumes_exactly(kind):
    torch.manual_seed(1)
    reference = TinyGPT(d=16, layers=1, seq=8)
    data = batches(STEPS, seq=8)
    model, optim = chunked_pair(reference)
    straight = run(model, optim, make_scheduler(kind, optim), data, chunked=True)

    first, first_optim = chunked_pair(reference)
    first_sched = make_scheduler(kind, first_optim)
    head = run(first, first_optim, first_sched, data[:3], chunked=True)
    saved = (first.state_dict(), first_optim.state_dict(), first_sched.state_dict())

    second, second_optim = chunked_pair(reference)
    second_sched = make_scheduler(kind, second_optim)  # before the optimizer's load, as torch asks
    second.load_state_dict(saved[0])
    second_optim.load_state_dict(saved[1])
    second_sched.load_state_dict(saved[2])
    assert second_sched.state_dict() == saved[2]
    tail = run(second, second_optim, second_sched, data[3:], chunked=True)
    assert head + tail == straight
    final = second.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(final[name], value), name


def test_step_hooks_run_around_the_chunked_step():
    torch.manual_seed(2)
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    x = batches(1, seq=8)[0]
    seen = []

    def pre(opt, args, kwargs):
        seen.append(("pre", opt is optim, args, kwargs, opt.model.state_dict()))

    def post(opt, args, kwargs):
        seen.append(("post", opt is optim, args, kwargs, opt.model.state_dict()))

    handles = [optim.register_step_pre_hook(pre), optim.register_step_post_hook(post)]
    before = model.state_dict()
    optim.backward(lm_loss(model(x), x))
    assert optim.step() is True
    after = model.state_dict()
    assert [s[:4] for s in seen] == [("pre", True, (optim,), {}), ("post", True, (optim,), {})]
    assert all(torch.equal(seen[0][4][k], v) for k, v in before.items())  # pre: not updated yet
    assert all(torch.equal(seen[1][4][k], v) for k, v in after.items())  # post: updated
    assert any(not torch.equal(before[k], v) for k, v in after.items())
    for handle in handles:
        handle.remove()
    optim.backward(lm_loss(model(x), x))
    optim.step()
    assert len(seen) == 2


def test_state_dict_hooks_run():
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    calls = []
    optim.register_state_dict_pre_hook(lambda opt: calls.append("save-pre"))
    optim.register_state_dict_post_hook(lambda opt, sd: {**sd, "note": "added"})
    optim.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(("load-pre", sd.get("note"))))
    optim.register_load_state_dict_post_hook(lambda opt: calls.append("load-post"))
    state = optim.state_dict()
    assert state["note"] == "added" and set(state) == {"state", "param_groups", "loss_scaler", "note"}
    optim.load_state_dict(state)
    assert calls == ["save-pre", ("load-pre", "added"), "load-post"]


def test_repr_shows_the_groups():
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    text = repr(optim)
    assert text.startswith("ShardedOptimizerV2 (HybridAdam, dtype=torch.float32, loss_scale=1.0\n")
    assert text.endswith("\n)")
    assert "Parameter Group 0" in text and "Parameter Group 1" in text
    assert f"lr: {LR}" in text and "weight_decay: 0.0\n" in text and "params" not in text


def test_add_param_group_is_refused_and_changes_nothing():
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    groups = [dict(g) for g in optim.param_groups]
    with pytest.raises(cm.UnsupportedOperationError, match="add_param_group.*every trainable parameter is in a param group"):
        optim.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert [dict(g) for g in optim.param_groups] == groups


def test_add_param_group_on_the_wrapped_torch_optimizer_is_refused_too():
    """Before 2026-11-27 the torch optimizer a script still holds accepted a new group, which then showed in
    param_groups and got gradients but was never stepped or zeroed."""
    import torch.nn as nn

    reference = TinyGPT(d=16, layers=1, seq=8)
    model, optim = chunked_pair(reference)
    inner = optim.optim
    groups = len(inner.param_groups)
    with pytest.raises(cm.UnsupportedOperationError, match="optimizer wrapped by ShardedOptimizerV2.*never be stepped"):
        inner.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    assert len(inner.param_groups) == groups
    plain = nn.Linear(4, 4)
    torch_optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    cm.LowLevelZeroOptimizer(torch_optim)
    with pytest.raises(cm.UnsupportedOperationError, match="optimizer wrapped by LowLevelZeroOptimizer"):
        torch_optim.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    pickle.loads(pickle.dumps(torch_optim.add_param_group))  # the stand-in pickles with the optimizer


def test_pickle_and_copy_are_refused():
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    for attempt in (lambda: pickle.dumps(optim), lambda: copy.deepcopy(optim), lambda: copy.copy(optim)):
        with pytest.raises(cm.UnsupportedOperationError, match="cannot be pickled or copied.*state_dict"):
            attempt()


# ---- fp16: loss.backward() instead of optim.backward(loss) ---------------------------------------


def snapshot(model, optim):
    chunks = [c for c in model.chunks if c.trainable]
    return ({(c.index, f): c.optim[f].tensor.clone() for c in chunks for f in (MASTER, EXP_AVG, EXP_AVG_SQ)},
            {c.index: c.param.current().clone() for c in chunks}, [dict(c.steps) for c in chunks],
            optim.grad_scaler.state_dict())


def assert_same(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert a[2] == b[2] and a[3] == b[3]


@pytest.mark.parametrize("reuse", [False, True])
def test_fp16_plain_backward_is_refused_at_step_without_change(reuse):
    torch.manual_seed(3)
    model, optim = build_sharded(TinyGPT(d=16, layers=1, seq=8), "cpu", torch.float16, reuse=reuse,
                                 chunk_size=4096, growth_interval=1)
    data = batches(3, seq=8)
    optim.backward(lm_loss(model(data[0]), data[0]))
    assert optim.step() is True
    optim.zero_grad()
    before = snapshot(model, optim)

    lm_loss(model(data[1]), data[1]).backward()
    with pytest.raises(cm.UnscaledBackwardError, match=r"optim\.backward\(loss\) instead of loss\.backward\(\)"):
        optim.step()
    with pytest.raises(cm.UnscaledBackwardError, match=r"optim\.backward\(loss\)"):
        optim.clip_grad_norm(1.0)
    after = snapshot(model, optim)
    assert all(torch.equal(after[0][k], v) for k, v in before[0].items())  # masters and moments
    assert after[2:] == before[2:]  # step counts and loss scaler
    if not reuse:  # (with reuse_fp16_shard the 16-bit parameter memory holds the gradients until zero_grad)
        assert_same(after, before)

    optim.zero_grad()  # drops the unscaled gradients; training goes on normally
    assert_same(snapshot(model, optim), before)
    optim.backward(lm_loss(model(data[1]), data[1]))
    assert optim.step() is True
    assert optim.loss_scale == 2 * before[3]["scale"]  # growth_interval=1: one more clean step


def test_fp16_scaled_and_unscaled_backward_accumulated_is_refused():
    torch.manual_seed(3)
    model, optim = build_sharded(TinyGPT(d=16, layers=1, seq=8), "cpu", torch.float16, chunk_size=4096)
    x = batches(1, seq=8)[0]
    optim.backward(lm_loss(model(x), x))
    lm_loss(model(x), x).backward()
    optim.backward(lm_loss(model(x), x))
    steps = [dict(c.steps) for c in model.chunks]
    with pytest.raises(cm.UnscaledBackwardError, match=r"^1 backward pass\(es\)"):
        optim.step()
    assert [dict(c.steps) for c in model.chunks] == steps


def test_fp16_backward_by_grad_counts_as_scaled():
    torch.manual_seed(4)
    model, optim = build_sharded(TinyGPT(d=16, layers=1, seq=8), "cpu", torch.float16, chunk_size=4096)
    x = batches(1, seq=8)[0]
    loss = lm_loss(model(x), x)
    optim.backward_by_grad(loss, torch.tensor(optim.loss_scale))
    assert optim.step() is True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unscaled_dtypes_train_the_same_with_plain_backward(dtype):
    torch.manual_seed(5)
    reference = TinyGPT(d=16, layers=1, seq=8)
    data = batches(4, seq=8)
    results = []
    for plain_backward in (False, True):
        model, optim = build_sharded(reference, "cpu", dtype, chunk_size=4096)
        for x in data:
            loss = lm_loss(model(x), x)
            loss.backward() if plain_backward else optim.backward(loss)
            norm = optim.clip_grad_norm(1.0)
            assert optim.step() is True
            optim.zero_grad()
        results.append((norm, model.state_dict()))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


# ---- bool-only flags -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_non_bool_flags_are_refused(bad):
    torch.manual_seed(6)
    model, optim = chunked_pair(TinyGPT(d=16, layers=1, seq=8))
    x = batches(1, seq=8)[0]
    optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.ChunkmemError, match=f"set_to_none={bad!r}.*True or False"):
        optim.zero_grad(set_to_none=bad)
    assert optim.runtime.grads_pending  # the gradients are still there
    assert optim.step() is True
    with pytest.raises(cm.ChunkmemError, match=f"rank0_only={bad!r}.*True or False"):
        optim.state_dict(rank0_only=bad)
    with pytest.raises(cm.ChunkmemError, match=f"rank0_only={bad!r}.*True or False"):
        model.state_dict(rank0_only=bad)
