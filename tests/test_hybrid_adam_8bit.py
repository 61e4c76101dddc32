"""HybridAdam(state_dtype="8bit"): alone and in ShardedOptimizerV2 against torchao's AdamW8bit / Adam8bit run eagerly
(bit for bit; skipped without torchao), alone against wrapped (no torchao needed), the plain state dict both ways,
bf16_stochastic_round (bf16 parameters their own masters, torchao's draws), and what is refused with nothing
changed."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import chunkmem as cm
from chunkmem.optim.low_bit_param import CODES, PLAIN, SCALES
from models import TinyGPT, batches, lm_loss, train
from torchao_reference import eager_step


def _train_alone(reference, data, **options):
    module = copy.deepcopy(reference)
    optimizer = cm.HybridAdam(module.parameters(), state_dtype="8bit", **options)
    for x in data:
        lm_loss(module(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def _wrapped(reference, placement="cpu", model_options=None, step_in_backward=False, **options):
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement,
                              **{"dtype": torch.float32, "chunk_size": 1 << 17, **(model_options or {})})
    return model, cm.ShardedOptimizerV2(model, cm.HybridAdam(module.parameters(), state_dtype="8bit", **options),
                                        step_in_backward=step_in_backward)


def _same_params(state, module):
    for key, p in module.named_parameters():
        assert torch.equal(state[key], p.detach()), key


def _same_state(ours, theirs):
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        assert sorted(ours["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key].cpu(), value.cpu()), (index, key)
            assert ours["state"][index][key].dtype == value.dtype, (index, key)


# ---- against torchao ----------------------------------------------------------------------------------------


def _torchao_eager(reference, data, adamw, **options):
    """torchao's AdamW8bit / Adam8bit with its per-parameter update run eagerly (see test_low_bit_state.py)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    module = copy.deepcopy(reference)
    optimizer = (torchao_optim.AdamW8bit if adamw else torchao_optim.Adam8bit)(module.parameters(), **options)
    for x in data:
        lm_loss(module(x), x).backward()
        eager_step(optimizer)
        optimizer.zero_grad()
    return module, optimizer


def _same_as_torchaos(ours, theirs):
    """Our plain entries hold what torchao's OptimState8bit / fp32 tensors hold."""
    assert sorted(ours["state"]) == sorted(theirs["state"])
    quantized = 0
    for index, entry in theirs["state"].items():
        mine = ours["state"][index]
        assert torch.equal(mine["step"].cpu(), entry["step"])
        for key, codes, scales in zip(PLAIN, CODES, SCALES):
            value = entry[key]
            if hasattr(value, "codes"):
                quantized += 1
                assert torch.equal(mine[codes].cpu(), value.codes) and torch.equal(mine[scales].cpu(), value.scale)
            else:  # (fp32 in our plain form; torchao keeps a bf16 parameter's in bf16)
                assert mine[key].dtype == torch.float32 and torch.equal(mine[key].cpu(), value.float()), (index, key)
    assert quantized > 0


@pytest.mark.parametrize("rounding", [False, True])  # (bf16_stochastic_round on fp32 parameters: no effect, no draw)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_alone_equals_torchaos_eager_step_bit_for_bit(adamw_mode, rounding):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    data = batches(3, seed=21)
    options = dict(lr=1e-2, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-7, bf16_stochastic_round=rounding)
    theirs, their_optim = _torchao_eager(reference, data, adamw_mode, **options)
    generator = torch.get_rng_state()
    ours, optim = _train_alone(reference, data, adamw_mode=adamw_mode, **options)
    assert torch.equal(torch.get_rng_state(), generator)
    _same_params(dict(ours.named_parameters()), theirs)
    _same_as_torchaos(optim.state_dict(), their_optim.state_dict())


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_wrapped_equals_torchaos_eager_step_bit_for_bit(adamw_mode, placement):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    data = batches(3, seed=22)
    theirs, their_optim = _torchao_eager(reference, data, adamw_mode, lr=1e-2, weight_decay=0.05)
    model, optim = _wrapped(reference, placement, lr=1e-2, weight_decay=0.05, adamw_mode=adamw_mode)
    train(model, optim, data)
    _same_params(model.state_dict(), theirs)
    _same_as_torchaos(optim.state_dict(), their_optim.state_dict())


# ---- bf16_stochastic_round ------------------------------------------------------------------------------------

ROUNDED = dict(lr=1e-2, weight_decay=0.05, bf16_stochastic_round=True)


def _vectors_first(module):
    """torchao's usual two param groups, the vectors (no weight decay) before the matrices: its draws follow the
    groups' order, not the model's."""
    params = list(module.parameters())
    return [{"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for p in params if p.dim() >= 2]}]


def _rounded_alone(reference, data, step, make):
    """``make``'s optimizer over a copy of the bf16 ``reference`` (grouped vectors first), trained on ``data`` with
    ``step`` from seed 1234; returns the module, the optimizer and the default generator's state after."""
    module = copy.deepcopy(reference)
    optimizer = make(_vectors_first(module))
    torch.manual_seed(1234)
    for x in data:
        lm_loss(module(x), x).backward()
        step(optimizer)
        optimizer.zero_grad()
    return module, optimizer, torch.get_rng_state()


def _plain_form(state_dict):
    """Each entry is HybridAdam's plain form (low_bit_param): codes and scales, or fp32 moments."""
    for index, entry in state_dict["state"].items():
        if CODES[0] in entry:
            assert set(entry) == {"step", *CODES, *SCALES}, index
            assert entry[CODES[0]].dtype == torch.uint8 and entry[SCALES[0]].dtype == torch.float32, index
        else:
            assert set(entry) == {"step", *PLAIN} and entry[PLAIN[0]].dtype == torch.float32, index
            assert isinstance(entry[PLAIN[0]], torch.Tensor) and type(entry[PLAIN[0]]) is torch.Tensor, index


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_bf16_stochastic_round_alone_equals_torchaos_bit_for_bit(adamw_mode):
    """bf16 parameters rounded stochastically with torchao's numbers (groups out of the model's order), the small
    parameters' moments rounded to bf16 as torchao keeps them, the generator left where torchao's step leaves it;
    the state dict in HybridAdam's plain form."""
    torchao_optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    reference = TinyGPT(d=64).bfloat16()
    data = batches(3, seed=31)
    cls = torchao_optim.AdamW8bit if adamw_mode else torchao_optim.Adam8bit
    theirs, their_optim, their_generator = _rounded_alone(reference, data, eager_step, lambda p: cls(p, **ROUNDED))
    ours, optim, generator = _rounded_alone(reference, data, lambda o: o.step(), lambda p: cm.HybridAdam(
        p, adamw_mode=adamw_mode, state_dtype="8bit", **ROUNDED))
    assert torch.equal(generator, their_generator)
    _same_params(dict(ours.named_parameters()), theirs)
    _same_as_torchaos(optim.state_dict(), their_optim.state_dict())
    _plain_form(optim.state_dict())


def test_bf16_stochastic_round_wrapped_equals_alone_and_keeps_the_plain_state_dict():
    """In ShardedOptimizerV2 over a bf16 model: no fp32 master, the same parameters, generator and plain state dict
    as alone (no torchao needed); that state dict loads alone and the two go on alike."""
    torch.manual_seed(0)
    reference = TinyGPT(d=64).bfloat16()
    first, then = batches(2, seed=32), batches(1, seed=33)
    make = lambda p: cm.HybridAdam(p, state_dtype="8bit", **ROUNDED)  # noqa: E731
    alone, alone_optim, alone_generator = _rounded_alone(reference, first + then, lambda o: o.step(), make)
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.bfloat16,
                              chunk_size=1 << 16)
    optim = cm.ShardedOptimizerV2(model, make(_vectors_first(module)))
    torch.manual_seed(1234)
    train(model, optim, first)
    assert optim.update_rule.stochastic_round and "master" not in model.tier_bytes()["host"]
    saved, saved_params, saved_generator = optim.state_dict(), model.state_dict(), torch.get_rng_state()
    _plain_form(saved)
    train(model, optim, then)
    _same_params(model.state_dict(), alone)
    assert torch.equal(torch.get_rng_state(), alone_generator)
    _same_state(optim.state_dict(), alone_optim.state_dict())
    moved = copy.deepcopy(reference)
    moved.load_state_dict(saved_params)  # (fp32 copies of bf16 values: exact)
    moved_optim = make(_vectors_first(moved))
    moved_optim.load_state_dict(saved)
    torch.set_rng_state(saved_generator)
    for x in then:
        lm_loss(moved(x), x).backward()
        moved_optim.step()
    _same_params(dict(moved.named_parameters()), alone)
    _same_state(moved_optim.state_dict(), alone_optim.state_dict())


@pytest.mark.parametrize("options,error,match", [
    (dict(bf16_stochastic_round=1, state_dtype="8bit"), cm.ArgumentTypeError,
     r"bf16_stochastic_round=1 .*True or False"),
    (dict(bf16_stochastic_round="yes"), cm.ArgumentTypeError, r"bf16_stochastic_round='yes' .*True or False"),
    (dict(bf16_stochastic_round=True), cm.InvalidArgumentError,
     r"bf16_stochastic_round=True .*False with state_dtype=torch.float32 \(True only with state_dtype='8bit'"),
])
def test_a_bad_bf16_stochastic_round_is_named(options, error, match):
    p = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    with pytest.raises(error, match=match):
        cm.HybridAdam([p], **options)
    assert torch.equal(p, torch.ones(64, 64, dtype=torch.bfloat16)) and p.grad is None


# ---- without torchao ----------------------------------------------------------------------------------------


def test_wrapped_equals_alone_and_keeps_the_same_state_dict():
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    data = batches(3, seed=23)
    alone, alone_optim = _train_alone(reference, data, lr=1e-2, weight_decay=0.01)
    model, optim = _wrapped(reference, lr=1e-2, weight_decay=0.01)
    train(model, optim, data)
    _same_params(model.state_dict(), alone)
    ours = optim.state_dict()
    _same_state(ours, alone_optim.state_dict())
    entry = next(e for e in ours["state"].values() if CODES[0] in e)
    assert entry[CODES[0]].dtype == torch.uint8 and entry[SCALES[0]].dtype == torch.float32
    assert entry[SCALES[0]].numel() * 256 == entry[CODES[0]].numel()


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_on_the_disk_tier_and_in_the_backward_it_equals_alone(tmp_path, step_in_backward):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    data = batches(3, seed=28)
    alone, alone_optim = _train_alone(reference, data, lr=1e-2, weight_decay=0.01)
    model, optim = _wrapped(reference, model_options=dict(offload_optimizer="disk", nvme_path=str(tmp_path)),
                            step_in_backward=step_in_backward, lr=1e-2, weight_decay=0.01)
    train(model, optim, data)
    assert "exp_avg_codes" in model.tier_bytes()["disk"]
    _same_params(model.state_dict(), alone)
    _same_state(optim.state_dict(), alone_optim.state_dict())


def test_the_state_dict_moves_both_ways_between_alone_and_wrapped():
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    first, then = batches(2, seed=24), batches(2, seed=25)
    whole, whole_optim = _train_alone(reference, first + then, lr=1e-2)
    # alone for two steps, then wrapped from its state dict
    start, start_optim = _train_alone(reference, first, lr=1e-2)
    model, optim = _wrapped(start, lr=1e-2)
    optim.load_state_dict(start_optim.state_dict())
    train(model, optim, then)
    _same_params(model.state_dict(), whole)
    _same_state(optim.state_dict(), whole_optim.state_dict())
    # wrapped for two steps, then alone from its state dict (a round trip through torch.save)
    model, optim = _wrapped(reference, lr=1e-2)
    train(model, optim, first)
    moved = copy.deepcopy(reference)
    moved.load_state_dict(model.state_dict())
    moved_optim = cm.HybridAdam(moved.parameters(), lr=1e-2, state_dtype="8bit")
    buffer = io.BytesIO()
    torch.save(optim.state_dict(), buffer)
    buffer.seek(0)
    moved_optim.load_state_dict(torch.load(buffer, weights_only=True))
    for x in then:
        lm_loss(moved(x), x).backward()
        moved_optim.step()
        moved_optim.zero_grad()
    _same_params(dict(moved.named_parameters()), whole)
    _same_state(moved_optim.state_dict(), whole_optim.state_dict())


def test_a_checkpoint_resumes_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    first, then = batches(2, seed=26), batches(2, seed=27)
    model, optim = _wrapped(reference, lr=1e-2, adamw_mode=False, weight_decay=0.01)
    train(model, optim, first)
    cm.save_checkpoint(tmp_path / "ckpt", model, optim)
    train(model, optim, then)
    resumed, resumed_optim = _wrapped(TinyGPT(d=64), lr=1e-2, adamw_mode=False, weight_decay=0.01)
    cm.load_checkpoint(tmp_path / "ckpt", resumed, resumed_optim)
    train(resumed, resumed_optim, then)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    _same_state(resumed_optim.state_dict(), optim.state_dict())


def test_the_state_is_8bit_and_counted_as_the_families():
    torch.manual_seed(0)
    module = TinyGPT(d=64)
    alone, optim = _train_alone(module, batches(1))
    for p in alone.parameters():
        state = optim.state[p]
        if p.numel() >= 4096 and p.numel() % 256 == 0:
            assert set(state) == {"step", *CODES, *SCALES} and state[CODES[0]].shape == p.shape
        else:
            assert set(state) == {"step", *PLAIN} and state[PLAIN[0]].dtype == torch.float32
    model, _ = _wrapped(module)
    host = model.tier_bytes()["host"]
    assert host["exp_avg_codes"] == sum(c.shard_numel for c in model.chunks if c.trainable)
    assert "exp_avg" not in host


def test_the_default_keeps_fp32_moments():
    p = torch.nn.Parameter(torch.randn(64, 64))
    for optimizer in (cm.HybridAdam([p]), cm.HybridAdam([p], state_dtype=torch.float32)):
        p.grad = torch.ones_like(p)
        optimizer.step()
        assert optimizer.state_dtype == torch.float32 and not optimizer.quantized_state
        assert set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32


# ---- refused -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,error", [(torch.float16, cm.InvalidArgumentError), ("int8", cm.InvalidArgumentError),
                                         (torch.uint8, cm.InvalidArgumentError), (8, cm.ArgumentTypeError)])
def test_a_bad_state_dtype_is_named(value, error):
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(error, match=r"state_dtype=.*torch.float32, '8bit'"):
        cm.HybridAdam([p], state_dtype=value)


def test_bias_correction_false_with_8bit_is_refused_with_nothing_changed():
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(cm.InvalidArgumentError, match="bias_correction=False.*state_dtype='8bit'"):
        cm.HybridAdam([p], bias_correction=False, state_dtype="8bit")
    optimizer = cm.HybridAdam([p], state_dtype="8bit")
    with pytest.raises(cm.InvalidArgumentError, match="bias_correction"):
        optimizer.add_param_group({"params": [q], "bias_correction": False})
    assert len(optimizer.param_groups) == 1


def test_a_bad_state_dict_is_refused_with_nothing_changed():
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    alone, optim = _train_alone(reference, batches(1))
    saved = copy.deepcopy(optim.state_dict())
    index = next(i for i, e in saved["state"].items() if CODES[0] in e)
    before = copy.deepcopy(optim.state_dict())
    bad = copy.deepcopy(saved)
    bad["state"][index][CODES[0]] = bad["state"][index][CODES[0]].float()  # fp32 moments where codes belong
    with pytest.raises(cm.InvalidArgumentError, match="exp_avg_codes.*uint8"):
        optim.load_state_dict(bad)
    bad = copy.deepcopy(saved)
    del bad["state"][index][SCALES[1]]
    model, wrapped = _wrapped(reference)
    with pytest.raises(cm.InvalidArgumentError, match="exp_avg_sq_scales"):
        wrapped.load_state_dict(bad)
    assert not any(c.stepped for c in model.chunks)
    _same_state(optim.state_dict(), before)
    torch_saved = copy.deepcopy(saved)  # an fp32 Adam's state (moments where codes belong) is refused too
    torch_saved["state"][index] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(alone.wte.weight.shape),
                                   "exp_avg_sq": torch.zeros(alone.wte.weight.shape)}
    with pytest.raises(cm.InvalidArgumentError, match="exp_avg_codes"):
        optim.load_state_dict(torch_saved)


def test_in_low_level_zero_it_equals_alone_and_keeps_the_same_state_dict():
    """ZeRO-1/2 in one process (no torchao needed; against torchao on several ranks: test_low_bit_zero12.py); its
    state dict loads into the optimizer alone, and the two go on alike."""
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    first, then = batches(2, seed=29), batches(1, seed=30)
    alone, alone_optim = _train_alone(reference, first + then, lr=1e-2, weight_decay=0.01)
    module = copy.deepcopy(reference)
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01,
                                                   state_dtype="8bit"), partition_grad=True)
    train(module, optim, first)
    moved = copy.deepcopy(module)
    moved_optim = cm.HybridAdam(moved.parameters(), lr=1e-2, weight_decay=0.01, state_dtype="8bit")
    moved_optim.load_state_dict(optim.state_dict())
    train(module, optim, then)
    _same_params(dict(module.named_parameters()), alone)
    _same_state(optim.state_dict(), alone_optim.state_dict())
    for x in then:
        lm_loss(moved(x), x).backward()
        moved_optim.step()
    _same_params(dict(moved.named_parameters()), alone)



def test_a_deep_copy_keeps_the_state_dtype_and_the_rounding():
    """``copy.deepcopy`` (and pickling) keep ``state_dtype`` and ``bf16_stochastic_round`` (torch's optimizer keeps
    only its defaults, state and groups): a copy of the module and optimizer after a step goes on as they do."""
    torch.manual_seed(0)
    first, second = batches(2, seed=32)
    module = TinyGPT(d=64).bfloat16()
    optim = cm.HybridAdam(_vectors_first(module), state_dtype="8bit", **ROUNDED)
    lm_loss(module(first), first).backward()
    optim.step()
    optim.zero_grad()
    twin_module, twin_optim = copy.deepcopy((module, optim))
    assert (twin_optim.state_dtype, twin_optim.bf16_stochastic_round) == ("8bit", True)
    generators = []
    for m, o in ((module, optim), (twin_module, twin_optim)):
        torch.manual_seed(99)
        lm_loss(m(second), second).backward()
        o.step()
        generators.append(torch.get_rng_state())
    assert torch.equal(*generators)
    _same_params(dict(twin_module.named_parameters()), module)
    _plain_form(twin_optim.state_dict())
