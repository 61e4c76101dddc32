"""torch's gradient idioms on chunkmem's model, against the same loop on the plain module:
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and ``clip_grad_value_`` (what every hand-written
loop, Hugging Face ``Trainer`` and Accelerate call), ``p.grad`` reads, ``None`` after ``zero_grad()`` and for a
parameter no backward reached; the model's forward signature and attributes. Before 2026-11-27 the first
raised ``ParameterAccessError`` ("clip them with optim.clip_grad_norm") and Trainer dropped every column."""
from __future__ import annotations

import copy
import math
import inspect

import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from tests.distributed import run_ranks
from tests.models import TinyGPT, batches, lm_loss

NO_CLIPPING = {"gradient_clipping": 0}  # a DeepSpeed config clips at 1.0 by default, as DeepSpeed does


def _config(placement: str, stage: int = 3, **extra) -> dict:
    offload = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}} if placement == "cpu" else {}
    if stage != 3:
        offload.pop("offload_param", None)
    return {"zero_optimization": {"stage": stage, **offload}, **NO_CLIPPING, **extra}


def _pair(make_optimizer, placement="cpu", extra_stage=3, **extra):
    torch.manual_seed(0)
    plain = TinyGPT()
    module = copy.deepcopy(plain)
    model, optim = cm.initialize(module, make_optimizer(module.parameters()), _config(placement, extra_stage, **extra))
    return plain, make_optimizer(plain.parameters()), model, optim


class _as_sharded_state:
    """A stage-1/2 model (the plain module) seen through state_dict() as the assertions read a wrapped one."""

    def __init__(self, module):
        self.module = module

    def state_dict(self):
        return {k: v.float() for k, v in self.module.state_dict().items()}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _assert_weights_equal(model, plain):
    ours = model.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(ours[key], value), key


def _assert_weights_close(model, plain, rtol=1e-5):
    ours = model.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=rtol, atol=rtol * value.abs().max().item())


def _clipped_loop(model, optim, plain, plain_optim, clip, steps=4, clip_fn=torch.nn.utils.clip_grad_norm_):
    norms = []
    for x in batches(steps):
        for net, opt in ((model, optim), (plain, plain_optim)):
            lm_loss(net(x), x).backward()
            norms.append(clip_fn(net.parameters(), clip))
            opt.step()
            opt.zero_grad()
    return norms


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
@pytest.mark.parametrize("make_optimizer", [_adamw, _sgd], ids=["adamw-kernel", "sgd-any-optimizer"])
def test_torch_clip_grad_norm_on_model_parameters_trains_like_plain_torch(placement, make_optimizer):
    plain, plain_optim, model, optim = _pair(make_optimizer, placement)
    norms = _clipped_loop(model, optim, plain, plain_optim, clip=0.05)
    ours, theirs = norms[0::2], norms[1::2]
    assert all(float(t) > 0.05 for t in theirs)  # the clipping triggers in every step
    for a, b in zip(ours, theirs):
        assert isinstance(a, torch.Tensor) and a.dim() == 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    _assert_weights_close(model, plain)


def test_clip_grad_value_trains_like_plain_torch():
    plain, plain_optim, model, optim = _pair(_adamw)
    _clipped_loop(model, optim, plain, plain_optim, clip=1e-3, clip_fn=torch.nn.utils.clip_grad_value_)
    _assert_weights_close(model, plain)


def test_fp16_clip_grad_norm_counts_the_loss_scale():
    """With fp16 the chunks hold gradients times the loss scale; the norm torch's idiom returns is the unscaled
    one, and the step clips as optim.clip_grad_norm would (the same coefficient, up to the summation order)."""
    results = []
    for idiom in (True, False):
        torch.manual_seed(0)
        module = TinyGPT()
        model, optim = cm.initialize(module, torch.optim.AdamW(module.parameters(), lr=1e-2),
                                     {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True,
                                                                                  "initial_scale_power": 10},
                                      **NO_CLIPPING})
        norms = []
        for x in batches(3):
            optim.backward(lm_loss(model(x), x))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)) if idiom
                         else optim.clip_grad_norm(0.05))
            optim.step()
            optim.zero_grad()
        results.append((norms, model.state_dict()))
    (idiom_norms, idiom_state), (own_norms, own_state) = results
    assert optim.loss_scale == 2.0 ** 10
    torch.testing.assert_close(torch.tensor(idiom_norms), torch.tensor(own_norms), rtol=1e-5, atol=0)
    for key, value in own_state.items():
        torch.testing.assert_close(idiom_state[key], value, rtol=1e-4, atol=1e-4)


def test_step_in_backward_redoes_the_updates_torch_clipping_changes():
    states = []
    for step_in_backward in (False, True):
        torch.manual_seed(0)
        module = TinyGPT()
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=16384)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2),
                                      step_in_backward=step_in_backward)
        for x in batches(3):
            optim.backward(lm_loss(model(x), x))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optim.step()
            optim.zero_grad()
        states.append(model.state_dict())
    for key, value in states[0].items():
        assert torch.equal(states[1][key], value), key


def test_grad_reads_like_plain_torch_and_is_none_where_torch_has_none():
    plain, plain_optim, model, optim = _pair(_adamw)
    x = batches(1)[0]
    assert all(p.grad is None for p in model.parameters())
    lm_loss(model(x), x).backward()
    lm_loss(plain(x), x).backward()
    for (name, ours), theirs in zip(model.module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad.clone(), theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert ours.grad.shape == theirs.grad.shape and ours.grad.dtype == theirs.grad.dtype
    optim.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_a_parameter_no_backward_reached_has_no_grad():
    torch.manual_seed(0)
    module = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = module

        def forward(self, x):
            return self.layers["used"](x).sum()

    net = Net()
    model, optim = cm.initialize(net, torch.optim.AdamW(net.parameters()), _config("cpu"))
    model(torch.randn(2, 4)).backward()
    assert model.module.layers["used"].weight.grad is not None
    assert model.module.layers["unused"].weight.grad is None  # torch's .grad stays None: clip_grad_norm_ skips it
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()


def test_clipping_some_parameters_only_is_refused_at_the_step_with_nothing_changed():
    plain, plain_optim, model, optim = _pair(_adamw)
    x = batches(1)[0]
    lm_loss(model(x), x).backward()
    before = model.state_dict()
    torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1e-3)
    with pytest.raises(cm.UnsupportedOperationError, match="scaled by different factors"):
        optim.step()
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    optim.zero_grad()
    lm_loss(model(x), x).backward()
    assert optim.step()  # zero_grad dropped the factors with the gradients


def _a_backward_after_clipping():
    """A chunkmem model and optimizer after a backward, torch's clip_grad_norm_, and a second backward; and the batch."""
    _, _, model, optim = _pair(_adamw)
    x = batches(1)[0]
    lm_loss(model(x), x).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    lm_loss(model(x), x).backward()
    return model, optim, x


def test_a_backward_after_clipping_is_refused_at_the_step():
    model, optim, _ = _a_backward_after_clipping()
    with pytest.raises(cm.UnsupportedOperationError, match="added gradients to gradients already scaled"):
        optim.step()


def test_other_in_place_changes_of_grad_are_refused():
    plain, plain_optim, model, optim = _pair(_adamw)
    x = batches(1)[0]
    lm_loss(model(x), x).backward()
    grad = next(model.parameters()).grad
    with pytest.raises(cm.ParameterAccessError, match="clip_grad_norm_"):
        grad.add_(1.0)
    with pytest.raises(cm.ParameterAccessError, match="several elements"):
        grad.mul_(torch.ones(grad.shape))
    with pytest.raises(cm.ParameterAccessError, match="clip_grad_norm_"):
        torch._foreach_add_([grad], 1.0)


def _two_ranks(rank, world):
    torch.manual_seed(0)
    module = TinyGPT()
    model, optim = cm.initialize(module, torch.optim.AdamW(module.parameters(), lr=1e-2), _config("cpu"))
    norms = []
    for i, x in enumerate(batches(6)):
        if i % world != rank:
            continue
        lm_loss(model(x), x).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        optim.step()
        optim.zero_grad()
    sharded_read = None
    x = batches(1)[0]
    lm_loss(model(x), x).backward()
    try:
        next(model.parameters()).grad.sum()
    except cm.ParameterAccessError as refused:
        sharded_read = str(refused)
    return norms, model.state_dict(), sharded_read


def test_two_ranks_clip_the_global_norm_like_one_process_with_the_whole_batch():
    ranks = run_ranks(_two_ranks, 2)
    torch.manual_seed(0)
    plain = TinyGPT()
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    data = batches(6)
    norms = []
    for i in range(0, 6, 2):
        for x in data[i:i + 2]:
            (lm_loss(plain(x), x) / 2).backward()  # the mean over the ranks, as the reduction takes it
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)))
        plain_optim.step()
        plain_optim.zero_grad()
    for ours, state, sharded_read in ranks:
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(norms), rtol=1e-5, atol=0)
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())
        assert "safe_get_full_grad" in sharded_read


def test_the_model_shows_its_module_signature_and_attributes():
    class Net(nn.Module):
        main_input_name = "input_ids"

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.config = {"hidden": 4}

        def forward(self, input_ids, labels=None):
            return self.linear(input_ids)

        def describe(self):
            return "net"

    model = cm.ShardedModelV2(Net(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "labels"]
    assert list(inspect.signature(type(model).forward).parameters) == ["self", "input_ids", "labels"]  # Trainer's labels
    assert isinstance(model, cm.ShardedModelV2) and type(model).__name__ == "ShardedModelV2"
    assert model.config == {"hidden": 4} and model.main_input_name == "input_ids" and model.describe() == "net"
    out = model(input_ids=torch.ones(2, 4))
    assert out.shape == (2, 4)
    with pytest.raises(AttributeError, match="ShardedModelV2"):
        model.no_such_attribute


@pytest.mark.parametrize("stage", [3, 2])
def test_step_takes_torch_closure_and_a_schedule_sees_the_step(stage, recwarn):
    """torch's optimizer.step(closure) (Accelerate passes one): the closure runs once with autograd on, before the
    update, and step returns its loss; a schedule built on the wrapped torch optimizer (Lightning, stages 1 and 2)
    gives no 'lr_scheduler.step() before optimizer.step()' warning."""
    plain, plain_optim, model, optim = _pair(_adamw, extra_stage=stage)
    inner = optim.optim
    schedule = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5)
    x = batches(1)[0]
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        loss = lm_loss(model(x), x)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optim.step(closure)
    schedule.step()
    lm_loss(plain(x), x).backward()
    plain_optim.step()
    assert calls == [True] and isinstance(loss, torch.Tensor)
    _assert_weights_close(model if stage == 3 else _as_sharded_state(model), plain)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    with pytest.raises(cm.ArgumentTypeError, match="closure"):
        optim.step(closure=1.0)


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_the_norm_of_gradients_that_overflowed_is_torch_s(stage, norm_type):
    """inf stays inf and NaN stays NaN through the per-parameter norms and their reduction (an infinity made
    finite would clip by a tiny factor instead of reporting the overflow)."""
    plain, plain_optim, model, optim = _pair(_adamw, extra_stage=stage)
    x = batches(1)[0]
    for net in (model, plain):
        (lm_loss(net(x), x) * (1e38 if norm_type == 2.0 else math.inf)).backward()  # some gradients overflow
    ours = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=norm_type))
    theirs = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, norm_type=norm_type))
    assert not math.isfinite(theirs)
    assert (math.isnan(ours), math.isinf(ours)) == (math.isnan(theirs), math.isinf(theirs))


def test_per_parameter_gradient_norms_are_torch_s_bit_for_bit():
    """clip_grad_norm_ takes torch.linalg.vector_norm of each .grad and the norm of those: in one process
    without a loss scale each stand-in gives torch's fp32 norm of the same gradient, so the total norm, the
    clipping coefficient and the step are plain torch's bit for bit. Before 2026-11-28 they came from a float64
    sum of squares, rounded: the last bit differed for some parameters, so the total norm and the weights could."""
    plain, plain_optim, model, optim = _pair(_adamw)
    for x in batches(3, seed=4):
        for net in (model, plain):
            lm_loss(net(x), x).backward()
        for (name, ours), theirs in zip(model.module.named_parameters(), plain.parameters()):
            assert torch.equal(torch.linalg.vector_norm(ours.grad), torch.linalg.vector_norm(theirs.grad)), name
        norms = [torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05) for net in (model, plain)]
        assert torch.equal(*norms)
        optim.step()
        plain_optim.step()
        optim.zero_grad()
        plain_optim.zero_grad()
    _assert_weights_equal(model, plain)


def test_a_norm_or_read_after_a_backward_that_added_to_clipped_gradients_is_refused():
    """torch's second clip_grad_norm_ sees c * g1 + g2; the chunks hold g1 + g2 and one factor c. Before
    2026-11-28 the norm returned was (|g1 + g2|) * c, silently, and only the step refused."""
    model, optim, x = _a_backward_after_clipping()
    with pytest.raises(cm.UnsupportedOperationError, match="added gradients to gradients already scaled"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(cm.UnsupportedOperationError, match="added gradients to gradients already scaled"):
        next(model.parameters()).grad.clone()
    optim.zero_grad()
    lm_loss(model(x), x).backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) > 0
    assert optim.step()


def test_setting_grad_to_none_drops_the_gradient_as_in_torch():
    """torch's step skips a parameter whose .grad is None. Before 2026-11-28 ``p.grad = None`` zeroed the gradient
    in its chunk and the step still updated the parameter (weight decay, Adam's moments: state torch has none of)."""
    plain, plain_optim, model, optim = _pair(_adamw)
    x = batches(1)[0]
    for net in (model, plain):
        lm_loss(net(x), x).backward()
        net.blocks[0].fc1.weight.grad = None
    assert model.module.blocks[0].fc1.weight.grad is None
    optim.step()
    plain_optim.step()
    _assert_weights_equal(model, plain)
    assert sorted(optim.state_dict()["state"]) == sorted(plain_optim.state_dict()["state"])


def test_clipping_twice_trains_like_plain_torch_bit_for_bit():
    """torch rounds each in-place scaling of .grad: the second clip_grad_norm_ takes the norm of the rounded scaled
    gradients and scales those again. Before 2026-11-28 chunkmem multiplied the two factors and the norms (the
    last bit off torch's); a second scaling now folds the first into the gradients, as torch's does."""
    plain, plain_optim, model, optim = _pair(_adamw)
    for x in batches(3, seed=5):
        for net in (model, plain):
            lm_loss(net(x), x).backward()
        for clip in (0.5, 0.05, 0.01):
            norms = [torch.nn.utils.clip_grad_norm_(net.parameters(), clip) for net in (model, plain)]
            assert torch.equal(*norms), clip
        optim.step()
        plain_optim.step()
        optim.zero_grad()
        plain_optim.zero_grad()
        _assert_weights_equal(model, plain)
