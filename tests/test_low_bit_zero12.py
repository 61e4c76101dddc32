"""8-bit Adam state in LowLevelZeroOptimizer (ZeRO-1/2: chunkmem.optim.zero_low_bit) against torchao's step run eagerly
on the plain model with the ranks' mean gradient: on 1, 2 and 3 ranks, stages 1 and 2, torchao's AdamW8bit / Adam8bit
(fp32, bf16 with fp32 masters, bf16 rounded stochastically) and HybridAdam(state_dtype="8bit") (fp32, bf16 rounded
stochastically), the parameters, masters, codes and scales bit for bit after 3 steps, with shard boundaries that cut
blocks of quantized parameters (counted here, not by chunkmem); the state dict in torchao's format both ways, full
checkpoints, and what is refused with nothing changed."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import chunkmem as cm
from chunkmem.utils import safe_get_full_optimizer_state
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402
from torchao_reference import eager_step  # noqa: E402

LR, WD = 1e-2, 0.05
# name: (chunkmem's optimizer, torchao's reference, the model's dtype, fp32 masters of a 16-bit model)
CASES = {
    "adamw8bit": (lambda p: torchao_optim.AdamW8bit(p, lr=LR, weight_decay=WD),
                  lambda p: torchao_optim.AdamW8bit(p, lr=LR, weight_decay=WD), torch.float32, False),
    "adam8bit": (lambda p: torchao_optim.Adam8bit(p, lr=LR, weight_decay=WD),
                 lambda p: torchao_optim.Adam8bit(p, lr=LR, weight_decay=WD), torch.float32, False),
    "hybridadam-8bit": (lambda p: cm.HybridAdam(p, lr=LR, weight_decay=WD, state_dtype="8bit"),
                        lambda p: torchao_optim.AdamW8bit(p, lr=LR, weight_decay=WD), torch.float32, False),
    "adamw8bit-bf16-stochastic": (lambda p: torchao_optim.AdamW8bit(p, lr=LR, bf16_stochastic_round=True),
                                  lambda p: torchao_optim.AdamW8bit(p, lr=LR, bf16_stochastic_round=True),
                                  torch.bfloat16, False),
    "hybridadam-8bit-bf16-stochastic": (
        lambda p: cm.HybridAdam(p, lr=LR, weight_decay=WD, adamw_mode=False, state_dtype="8bit",
                                bf16_stochastic_round=True),
        lambda p: torchao_optim.Adam8bit(p, lr=LR, weight_decay=WD, bf16_stochastic_round=True), torch.bfloat16, False),
    "adamw8bit-bf16-masters": (lambda p: torchao_optim.AdamW8bit(p, lr=LR, weight_decay=WD),
                               lambda p: torchao_optim.AdamW8bit(p, lr=LR, weight_decay=WD), torch.bfloat16, True),
}


def _seeded(step, n):
    torch.manual_seed(100 + n)  # stochastic rounding's numbers: the same draws in torchao's step and in chunkmem's
    step()


def _data(rank, world, steps=3):
    """Each rank's batches: different on 2 ranks (their mean is exact in any order), the same on 3 (a sum of three
    values depends on the order gloo adds them in, which differs between a whole tensor and a bucket)."""
    return batches(steps, seed=5 + (rank if world == 2 else 0))


def _reference(reference, case, data, world):
    """torchao's eager step on the plain model; its gradient each rank's, all-reduced and divided by the world size
    in the model's dtype (as the buckets do); a 16-bit model with fp32 masters steps the masters with the gradient
    in fp32 and rounds them to nearest. Returns the working module, the masters and the optimizer."""
    _, make, dtype, masters = CASES[case]
    working = copy.deepcopy(reference)
    master = copy.deepcopy(reference).float() if masters else working
    optimizer = make(master.parameters())
    _reference_steps(working, master, optimizer, data, world)
    return working, master, optimizer


def _reference_steps(working, master, optimizer, data, world, first=0):
    for n, x in enumerate(data, first):
        lm_loss(working(x), x).backward()
        for w, m in zip(working.parameters(), master.parameters()):
            if world > 1:
                dist.all_reduce(w.grad)
                w.grad.div_(world)
            if m is not w:
                m.grad = w.grad.float()
        _seeded(lambda: eager_step(optimizer), n)
        with torch.no_grad():
            for w, m in zip(working.parameters(), master.parameters()):
                if m is not w:
                    w.copy_(m)
        working.zero_grad()
        master.zero_grad()


def _ours(reference, case, data, **options):
    module = copy.deepcopy(reference)
    reduce_scatter = options.pop("reduce_scatter", False)
    optim = cm.LowLevelZeroOptimizer(CASES[case][0](module.parameters()), reduce_bucket_size=5000, **options)
    optim.buckets.reduce_scatter = reduce_scatter  # gloo all-reduces at stage 2; True: NCCL's reduce-scatter
    _train(module, optim, data)
    return module, optim


def _train(module, optim, data, first=0):
    for n, x in enumerate(data, first):
        optim.backward(lm_loss(module(x), x))
        _seeded(optim.step, n)
        optim.zero_grad()


def _state_differences(ours, theirs, plain_form):
    """Where chunkmem's state dict differs from torchao's: ``plain_form``: ours holds HybridAdam's plain tensors."""
    found = [] if sorted(ours["state"]) == sorted(theirs["state"]) else ["indices"]
    for index, entry in theirs["state"].items():
        mine = ours["state"].get(index, {})
        if not torch.equal(mine.get("step", torch.tensor(-1.0)), entry["step"]):
            found.append((index, "step"))
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry[key]
            if isinstance(value, OptimState8bit):
                codes, scale = ((mine.get(f"{key}_codes"), mine.get(f"{key}_scales")) if plain_form else
                                (getattr(mine.get(key), "codes", None), getattr(mine.get(key), "scale", None)))
                same = codes is not None and torch.equal(codes, value.codes) and torch.equal(scale, value.scale)
            elif plain_form:  # fp32, where torchao keeps a bf16 parameter's in bf16
                same = key in mine and mine[key].dtype == torch.float32 and torch.equal(mine[key], value.float())
            else:
                same = key in mine and type(mine[key]) is torch.Tensor and torch.equal(mine[key], value)
            if not same:
                found.append((index, key))
    return found


def _cut_blocks(optim, world):
    """The blocks of quantized parameters (at least 4096 elements, whole blocks of 256) that a shard boundary cuts,
    the boundaries at every multiple of the chunk's size over the world size."""
    cut = 0
    for chunk in optim.chunks:
        shard = chunk.numel // world
        for boundary in range(shard, chunk.numel, shard):
            cut += sum(1 for s in chunk.slots if s.numel >= 4096 and s.numel % 256 == 0
                       and s.offset < boundary < s.offset + s.numel and (boundary - s.offset) % 256)
    return cut


def _compare(reference, case, rank, world, **options):
    """chunkmem's run against the reference's: the names of what differs, and the cut blocks."""
    data = _data(rank, world)
    working, master, theirs = _reference(reference, case, data, world)
    their_generator = torch.default_generator.get_state()
    module, optim = _ours(reference, case, data, **options)
    differ = [name for (name, a), b in zip(working.named_parameters(), module.parameters()) if not torch.equal(a, b)]
    differ += [f"master {name}" for name, m in master.named_parameters()
               if not torch.equal(optim.master_of(dict(module.named_parameters())[name]), m.detach().float())]
    differ += _state_differences(optim.state_dict(), theirs.state_dict(), case.startswith("hybridadam"))
    if not torch.equal(torch.default_generator.get_state(), their_generator):
        differ.append("the default generator")
    return {"case": case, "options": options, "differ": differ, "cut": _cut_blocks(optim, world)}


def _model(case):
    torch.manual_seed(0)
    return TinyGPT(d=64).to(CASES[case][2])


def _ranks_worker(rank, world, runs):
    return [_compare(_model(case), case, rank, world, **options) for case, options in runs]


STAGES = [dict(partition_grad=False), dict(partition_grad=True), dict(partition_grad=True, reduce_scatter=True)]


@pytest.mark.parametrize("case", list(CASES))
def test_in_one_process_it_equals_torchaos_eager_step(case):
    for options in STAGES[:2]:
        result = _compare(_model(case), case, 0, 1, **options)
        assert result["differ"] == [], result


@pytest.mark.parametrize("world", [2, 3])
def test_on_several_ranks_stages_1_and_2_equal_torchaos_eager_step_on_the_whole_model(world):
    if world == 2:
        runs = [(case, options) for case in CASES for options in STAGES[:2]]
        runs.append(("adamw8bit-bf16-stochastic", STAGES[2]))
    else:
        runs = [("adamw8bit", STAGES[1]), ("adamw8bit-bf16-stochastic", STAGES[0]), ("hybridadam-8bit", STAGES[2])]
    for results in run_ranks(_ranks_worker, world, runs):
        assert len(results) == len(runs)
        for result in results:
            assert result["cut"] >= world - 1, result  # not vacuous: the boundaries cut blocks of quantized parameters
            assert result["differ"] == [], result


# ---- the state dict and checkpoints -----------------------------------------------------------------------------


def _resume_worker(rank, world, path, case):
    """Resumed from a full checkpoint saved on ``world`` ranks, and from torchao's own state dict of the plain model:
    each run's next step equals the run that never stopped (and torchao's)."""
    reference = _model(case)
    data = _data(rank, world, steps=3)
    module, optim = _ours(reference, case, data[:2], partition_grad=True)
    cm.save_checkpoint(path, module, optim)
    _train(module, optim, data[2:], first=2)
    differ = []
    resumed = _model(case)
    resumed_optim = cm.LowLevelZeroOptimizer(CASES[case][0](resumed.parameters()))
    cm.load_checkpoint(path, resumed, resumed_optim)
    _train(resumed, resumed_optim, data[2:], first=2)
    differ += [n for (n, a), b in zip(module.named_parameters(), resumed.parameters()) if not torch.equal(a, b)]
    differ += ["checkpoint: " + str(d) for d in _state_differences(resumed_optim.state_dict(), optim.state_dict(),
                                                                   False)]
    # torchao's state dict of the plain model after two steps, loaded; then one more step on both
    working, master, theirs = _reference(reference, case, data[:2], world)
    loaded = _model(case)
    loaded_optim = cm.LowLevelZeroOptimizer(CASES[case][0](loaded.parameters()), partition_grad=False)
    loaded_optim.load_model_state_dict(loaded, master.state_dict())
    loaded_optim.load_state_dict(theirs.state_dict())
    _train(loaded, loaded_optim, data[2:], first=2)
    _reference_steps(working, master, theirs, data[2:], world, first=2)
    differ += [n for (n, a), b in zip(working.named_parameters(), loaded.parameters()) if not torch.equal(a, b)]
    differ += ["torchao's: " + str(d) for d in _state_differences(loaded_optim.state_dict(), theirs.state_dict(),
                                                                  False)]
    return {"differ": differ, "cut": _cut_blocks(optim, world)}


@pytest.mark.parametrize("case", ["adam8bit", "adamw8bit-bf16-stochastic"])
def test_checkpoints_and_torchaos_state_dict_resume_bit_for_bit_on_two_ranks(tmp_path, case):
    for rank in run_ranks(_resume_worker, 2, str(tmp_path / "ckpt.pt"), case):
        assert rank["cut"] >= 1 and rank["differ"] == [], rank


def test_fp16_with_loss_scaling_equals_torchaos_step_on_fp32_masters():
    """fp16 parameters, the loss scaled: the masters are stepped by torchao with the unscaled gradient, the fp16
    parameters are the masters rounded to nearest."""
    torch.manual_seed(0)
    reference = TinyGPT(d=64).half()
    scale = 2.0 ** 8
    data = batches(3, seed=7)
    working, master = copy.deepcopy(reference), copy.deepcopy(reference).float()
    theirs = torchao_optim.AdamW8bit(master.parameters(), lr=LR, weight_decay=WD)
    for x in data:
        (lm_loss(working(x), x) * scale).backward()
        for w, m in zip(working.parameters(), master.parameters()):
            m.grad = w.grad.float() * (1 / scale)
        eager_step(theirs)
        with torch.no_grad():
            for w, m in zip(working.parameters(), master.parameters()):
                w.copy_(m)
                w.grad = None
    module = copy.deepcopy(reference)
    optim = cm.LowLevelZeroOptimizer(torchao_optim.AdamW8bit(module.parameters(), lr=LR, weight_decay=WD),
                                     initial_scale=scale, partition_grad=True)
    for x in data:
        optim.backward(lm_loss(module(x), x))
        assert optim.step()
        optim.zero_grad()
    assert optim.loss_scale == scale
    for (name, w), p, m in zip(working.named_parameters(), module.parameters(), master.parameters()):
        assert torch.equal(w, p) and torch.equal(optim.master_of(p), m.detach()), name
    assert _state_differences(optim.state_dict(), theirs.state_dict(), False) == []


def test_the_state_is_8bit_and_counted():
    torch.manual_seed(0)
    module = TinyGPT(d=64).bfloat16()
    optim = cm.LowLevelZeroOptimizer(torchao_optim.AdamW8bit(module.parameters(), bf16_stochastic_round=True))
    counted = optim.model_state_bytes()
    elements = sum(c.numel for c in optim.chunks)
    assert counted["master"] == 0 and "exp_avg" not in counted  # the bf16 parameters are their own masters
    assert counted["exp_avg_codes"] == counted["exp_avg_sq_codes"] == elements
    quantized = sum(p.numel() for p in module.parameters() if p.numel() >= 4096 and p.numel() % 256 == 0)
    small = sum(p.numel() for p in module.parameters()) - quantized
    assert counted["exp_avg_scales"] == 4 * quantized // 256 and counted["exp_avg_fp32"] == 2 * small  # bf16


# ---- refused, with nothing changed --------------------------------------------------------------------------------


def _untouched(module):
    return [p.detach().clone() for p in module.parameters()]


def _same_values(before, module):
    return all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.parametrize("dtype,options,error,match", [
    (torch.float32, dict(block_size=128), cm.InvalidArgumentError, r"block_size"),
    (torch.float16, dict(bf16_stochastic_round=True), cm.UnsupportedOperationError, r"over an fp16 model"),
    (torch.float32, dict(amsgrad=True), cm.InvalidArgumentError, r"param_groups\[0\]\['amsgrad'\]"),
])
def test_what_the_8bit_update_does_not_run_is_refused_when_built(dtype, options, error, match):
    module = TinyGPT(d=64).to(dtype)
    optimizer = torchao_optim.AdamW8bit(module.parameters(), **options)
    before = _untouched(module)
    with pytest.raises(error, match=match):
        cm.LowLevelZeroOptimizer(optimizer)
    assert _same_values(before, module) and not optimizer.state
    assert not any(hasattr(p, "_low_level_zero") for p in module.parameters())
    cm.LowLevelZeroOptimizer(torch.optim.AdamW(module.parameters()))  # not wrapped: another optimizer may take them


def test_amsgrad_switched_on_later_is_refused_at_the_step_and_in_a_state_dict():
    torch.manual_seed(0)
    module = TinyGPT(d=64)
    optim = cm.LowLevelZeroOptimizer(torchao_optim.AdamW8bit(module.parameters(), lr=LR))
    _train(module, optim, batches(1))
    saved, before = optim.state_dict(), _untouched(module)
    optim.backward(lm_loss(module(batches(1)[0]), batches(1)[0]))
    optim.param_groups[0]["amsgrad"] = True
    with pytest.raises(cm.InvalidArgumentError, match=r"optimizer.param_groups\[0\]\['amsgrad'\]"):
        optim.step()
    assert _same_values(before, module) and _state_differences(optim.state_dict(), saved, False) == []
    optim.param_groups[0]["amsgrad"] = False
    bad = dict(saved, param_groups=[dict(group, amsgrad=True) for group in saved["param_groups"]])
    with pytest.raises(cm.InvalidArgumentError, match=r"state_dict\['param_groups'\]\[0\]\['amsgrad'\]"):
        optim.load_state_dict(bad)
    assert optim.param_groups[0]["amsgrad"] is False
    assert optim.step() and not _same_values(before, module)


def test_a_state_dict_of_another_form_is_refused_and_the_state_is_not_read_element_by_element():
    torch.manual_seed(0)
    module = TinyGPT(d=64)
    optim = cm.LowLevelZeroOptimizer(torchao_optim.AdamW8bit(module.parameters(), lr=LR))
    _train(module, optim, batches(1))
    other = copy.deepcopy(module)
    plain_form = cm.LowLevelZeroOptimizer(cm.HybridAdam(other.parameters(), lr=LR, state_dtype="8bit"))
    _train(other, plain_form, batches(1))
    saved = optim.state_dict()
    with pytest.raises(cm.InvalidArgumentError, match=r"state_dict\['state'\]\[0\]"):
        optim.load_state_dict(plain_form.state_dict())
    assert _state_differences(optim.state_dict(), saved, False) == []
    with pytest.raises(cm.UnsupportedOperationError, match="8-bit optimizer state 'exp_avg_codes'.*state_dict"):
        safe_get_full_optimizer_state(module.wte.weight, "exp_avg_codes")
    with pytest.raises(cm.InvalidArgumentError, match="optim_state_key"):
        safe_get_full_optimizer_state(module.wte.weight, "exp_avg")


def test_the_state_dict_moves_both_ways_between_zero_1_2_and_zero_3():
    """The same state dict format as ShardedOptimizerV2's: each loads the other's and they go on alike."""
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    first, then = batches(2, seed=8), batches(1, seed=9)
    module, optim = _ours(reference, "adam8bit", first)
    sharded = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                dtype=torch.float32, chunk_size=1 << 17)
    sharded_optim = cm.ShardedOptimizerV2(sharded, CASES["adam8bit"][0](sharded.module.parameters()))
    sharded.load_state_dict(optim.model_state_dict(module))
    sharded_optim.load_state_dict(optim.state_dict())
    back = _model("adam8bit")
    back_optim = cm.LowLevelZeroOptimizer(CASES["adam8bit"][0](back.parameters()), partition_grad=True)
    back_optim.load_model_state_dict(back, sharded.state_dict())
    back_optim.load_state_dict(sharded_optim.state_dict())
    for model, optimizer in ((module, optim), (sharded, sharded_optim), (back, back_optim)):
        _train(model, optimizer, then)
    state = sharded.state_dict()
    for name, p in module.named_parameters():
        assert torch.equal(state[name], p.detach()) and torch.equal(dict(back.named_parameters())[name], p), name
    assert _state_differences(sharded_optim.state_dict(), optim.state_dict(), False) == []
    assert _state_differences(back_optim.state_dict(), optim.state_dict(), False) == []


def test_param_groups_out_of_model_order_and_parameters_without_a_step_draw_as_torchao():
    """Two param groups (the second block first, other hyper-parameters), a parameter no backward reaches and one
    frozen after building: torchao's step skips both (no state, no draw) and draws in the groups' order."""
    torch.manual_seed(0)
    reference = TinyGPT(d=64, unused_param=True).bfloat16()
    data = batches(3, seed=12)

    def groups(module):
        late = list(module.blocks[1].parameters())
        return [{"params": late, "lr": 3e-3, "weight_decay": 0.1},
                {"params": [p for p in module.parameters() if all(p is not q for q in late)]}]
    working = copy.deepcopy(reference)
    theirs = torchao_optim.AdamW8bit(groups(working), lr=LR, bf16_stochastic_round=True)
    module = copy.deepcopy(reference)
    optim = cm.LowLevelZeroOptimizer(torchao_optim.AdamW8bit(groups(module), lr=LR, bf16_stochastic_round=True))
    for model in (working, module):
        model.side.requires_grad_(False)
    _reference_steps(working, working, theirs, data, 1)
    their_generator = torch.default_generator.get_state()
    _train(module, optim, data)
    for (name, a), b in zip(working.named_parameters(), module.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(torch.default_generator.get_state(), their_generator)
    assert _state_differences(optim.state_dict(), theirs.state_dict(), False) == []
    assert len(theirs.state_dict()["state"]) == len(list(module.parameters())) - 3  # unused (2), frozen: no state


POISONED = 16050  # an element of blocks.0.fc2.weight on rank 1's side of a block the shard boundary cuts


def _poisoned(module, rank):
    """Rank 1's gradient of blocks.0.fc2.weight gets a NaN at POISONED (the ranks' mean is NaN there)."""
    def hook(grad):
        if rank != 1:
            return grad
        grad = grad.clone()
        grad.view(-1)[POISONED] = float("nan")
        return grad
    module.blocks[0].fc2.weight.register_hook(hook)
    return module


def _poisoned_block_is_cut(chunks, param, world):
    """Whether POISONED lies on rank 1's side of a block of ``param`` that the boundary of ``chunks`` cuts."""
    for chunk in chunks:
        for slot in chunk.slots:
            if slot.param is param:
                inside = chunk.numel // world - slot.offset
                return inside % 256 != 0 and inside <= POISONED < (inside // 256 + 1) * 256
    return False


def _nan_worker(rank, world):
    """One step with a NaN in a cut block, in ZeRO-1/2 and in ZeRO-3 (one chunk: the same boundary)."""
    reference = _model("adamw8bit")
    data = _data(rank, world, steps=1)
    working = _poisoned(copy.deepcopy(reference), rank)
    theirs = CASES["adamw8bit"][1](working.parameters())
    _reference_steps(working, working, theirs, data, world)
    low_level = _poisoned(copy.deepcopy(reference), rank)
    optim = cm.LowLevelZeroOptimizer(CASES["adamw8bit"][0](low_level.parameters()))
    _train(low_level, optim, data)
    module = _poisoned(copy.deepcopy(reference), rank)
    sharded = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                                chunk_size=75776 * 4)
    sharded_optim = cm.ShardedOptimizerV2(sharded, CASES["adamw8bit"][0](module.parameters()))
    _train(sharded, sharded_optim, data)
    found = {"cut": [_poisoned_block_is_cut(optim.chunks, low_level.blocks[0].fc2.weight, world),
                     _poisoned_block_is_cut(sharded.chunks, module.blocks[0].fc2.weight, world)],
             "nan": int(working.blocks[0].fc2.weight.isnan().sum())}
    their_state = {i: {k: (v.codes, v.scale.nan_to_num(7.0)) if isinstance(v, OptimState8bit) else v.nan_to_num(7.0)
                       for k, v in entry.items()} for i, entry in theirs.state_dict()["state"].items()}
    for name, params, state in (("zero-1/2", low_level.parameters(), optim.state_dict()),
                                ("zero-3", sharded.state_dict().values(), sharded_optim.state_dict())):
        found[name] = [n for (n, a), b in zip(working.named_parameters(), params)
                       if not torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))]
        for index, entry in state["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                value, theirs_value = entry[key], their_state[index][key]
                same = (torch.equal(value.codes, theirs_value[0]) and torch.equal(value.scale.nan_to_num(7.0),
                                                                                  theirs_value[1])
                        if isinstance(value, OptimState8bit) else torch.equal(value.nan_to_num(7.0), theirs_value))
                if not same:
                    found[name].append((index, key))
    return found


def test_a_nan_in_a_cut_block_is_torchaos_in_zero_1_2_and_zero_3():
    """torchao's block scale of a block holding a NaN is NaN; gloo's MAX drops a NaN that another rank meets with a
    number, so the agreement on a cut block's scale (and the state dict's gathering of the scales) carries it."""
    for rank in run_ranks(_nan_worker, 2):
        assert rank["cut"] == [True, True] and rank["nan"] == 1, rank
        assert rank["zero-1/2"] == [] and rank["zero-3"] == [], rank
