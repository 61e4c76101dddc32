"""torch's optimizer semantics on chunkmem's step (HybridAdam: the in-memory kernel, the disk step, the step in
the backward, checkpoints, 2 ranks), against ``torch.optim.AdamW(fused=True)`` on the plain module, whose formula
chunkmem's fp32 kernel reproduces bit for bit:

* a parameter without a gradient in a step (a branch not taken, an expert not routed to, a parameter frozen for a
  while) is not updated and its state does not advance;
* Adam's step count, and so its bias correction, is per parameter.

Before 2026-11-27 such a parameter got a zero gradient, Adam's momentum moved it (1.2e-2 off AdamW after 3 steps at
lr 1e-2), and the step count was one per chunk (a parameter frozen for 2 of 4 steps ended 0.58 lr off).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import chunkmem as cm
from tests.distributed import run_ranks
from tests.models import TinyGPT, batches, lm_loss

LR, WD = 1e-2, 0.01
TAKEN = [True, False, True, False, False, True]  # whether the model's branch runs in each step


class Gate(nn.Linear):
    """A linear layer whose bias takes part in the gradient only while ``bias_learns`` (when not, the module
    still runs and its weight gets a gradient: under ZeRO-3 every rank must run the same modules)."""

    bias_learns = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.bias_learns else self.bias.detach())


class Branching(TinyGPT):
    """TinyGPT with a branch (a small MLP between the blocks and the head) that runs only when ``taken``."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Sequential(Gate(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.taken = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        if self.taken:
            x = x + self.branch(x)
        return self.lm_head(self.ln_f(x))


def _reference() -> Branching:
    torch.manual_seed(0)
    return Branching()


def _plain(reference, data, taken, frozen=()):
    model = copy.deepcopy(reference)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    _train_plain(model, optim, data, taken, frozen)
    return model, optim


def _chunked(reference, data, taken, frozen=(), placement="cpu", **optim_args):
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=placement,
                              dtype=torch.float32, chunk_size=16384, **optim_args.pop("model_args", {}))
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD), **optim_args)
    _train(model, optim, data, taken, frozen)
    return model, optim


def _train(model, optim, data, taken, frozen=(), first=0):
    for step, x in enumerate(data, start=first):
        model.module.taken = taken[step]
        for name, p in model.module.named_parameters():
            p.requires_grad_(not (name.startswith("blocks.1.") and step in frozen))
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()


def _assert_equal_to_plain(model, plain):
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name


def _assert_steps_like_torch(optim, plain_optim):
    ours = optim.state_dict()["state"]
    theirs = plain_optim.state_dict()["state"]
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        assert int(ours[index]["step"]) == int(entry["step"]), index
        assert torch.equal(ours[index]["exp_avg"], entry["exp_avg"]), index


@pytest.mark.parametrize("placement", ["cpu", "cuda", "auto"])
def test_a_branch_not_taken_is_not_stepped_as_in_torch(placement):
    reference = _reference()
    data = batches(len(TAKEN), seed=3)
    plain, plain_optim = _plain(reference, data, TAKEN)
    if placement == "auto":
        cm.set_device_memory_capacity(2**20)
    try:
        model, optim = _chunked(reference, data, TAKEN, placement=placement)
    finally:
        cm.set_device_memory_capacity(None)
    _assert_equal_to_plain(model, plain)
    _assert_steps_like_torch(optim, plain_optim)
    branch = [optim.state_dict()["state"][i]["step"] for i, (n, _) in enumerate(model.module.named_parameters())
              if n.startswith("branch.")]
    assert branch and all(int(s) == sum(TAKEN) for s in branch)


def test_a_parameter_frozen_for_a_while_keeps_its_own_step_count():
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    plain, plain_optim = _plain(reference, data, taken, frozen={1, 2})
    model, optim = _chunked(reference, data, taken, frozen={1, 2})
    _assert_equal_to_plain(model, plain)
    _assert_steps_like_torch(optim, plain_optim)


@pytest.mark.parametrize("case", ["step_in_backward", "disk"])
def test_the_step_in_the_backward_and_the_disk_step_skip_it_too(case, tmp_path):
    reference = _reference()
    data = batches(len(TAKEN), seed=3)
    plain, plain_optim = _plain(reference, data, TAKEN)
    args = {"step_in_backward": True} if case == "step_in_backward" else \
        {"model_args": {"offload_optimizer": "disk", "nvme_path": str(tmp_path), "buffer_size": 8192}}
    model, optim = _chunked(reference, data, TAKEN, **args)
    _assert_equal_to_plain(model, plain)
    _assert_steps_like_torch(optim, plain_optim)


def test_per_parameter_steps_survive_a_checkpoint_and_a_state_dict(tmp_path):
    reference = _reference()
    data = batches(len(TAKEN), seed=3)
    plain, _ = _plain(reference, data, TAKEN)
    model, optim = _chunked(reference, data[:3], TAKEN)
    cm.save_checkpoint(str(tmp_path / "ckpt"), model, optim)
    saved_state = optim.state_dict()
    for load in ("checkpoint", "state_dict"):
        fresh = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=16384)
        fresh_optim = cm.ShardedOptimizerV2(fresh, cm.HybridAdam(fresh.parameters(), lr=LR, weight_decay=WD))
        if load == "checkpoint":
            cm.load_checkpoint(str(tmp_path / "ckpt"), fresh, fresh_optim)
        else:
            fresh.load_state_dict(model.state_dict())
            fresh_optim.load_state_dict(saved_state)
        _train(fresh, fresh_optim, data[3:], TAKEN, first=3)
        _assert_equal_to_plain(fresh, plain)


def _two_ranks(rank, world, local_branch):
    reference = _reference()
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    data = [x[rank::world] for x in batches(len(TAKEN), batch=4, seed=3)]
    model.module.branch[0].bias_learns = rank == 0 or not local_branch
    _train(model, optim, data, TAKEN)
    steps = {i: int(e["step"]) for i, e in optim.state_dict()["state"].items()}
    return {k: v.clone() for k, v in model.state_dict().items()}, steps


def test_two_ranks_step_a_parameter_when_any_rank_gave_it_a_gradient():
    """The branch taken on both ranks in the same steps: stepped sum(TAKEN) times, like one process with the
    double batch (within the reassociated gradient sum); a bias given a gradient on rank 0 only: still stepped
    on both ranks (DDP's rule: no gradient means no rank produced one), and the ranks stay bit for bit equal."""
    reference = _reference()
    both = run_ranks(_two_ranks, 2, False)
    plain, plain_optim = _plain(reference, batches(len(TAKEN), batch=4, seed=3), TAKEN)
    for params, steps in both:
        assert steps == {i: int(e["step"]) for i, e in plain_optim.state_dict()["state"].items()}
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5)
    one_sided = run_ranks(_two_ranks, 2, True)
    assert one_sided[0][1] == one_sided[1][1] == both[0][1]
    for name in one_sided[0][0]:
        assert torch.equal(one_sided[0][0][name], one_sided[1][0][name]), name


def test_low_level_zero_skips_it_too():
    reference = _reference()
    data = batches(len(TAKEN), seed=3)
    plain, plain_optim = _plain(reference, data, TAKEN)
    model = copy.deepcopy(reference)
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    for step, x in enumerate(data):
        model.taken = TAKEN[step]
        optim.backward(lm_loss(model(x), x))
        optim.step()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    _assert_steps_like_torch(optim, plain_optim)


MICRO_BATCHES = 8


def _bf16_grads_summed(reference, data, accumulate):
    """Each micro-batch's bf16 gradients of the plain bf16 module, summed in ``accumulate`` (a dtype)."""
    module = copy.deepcopy(reference).to(torch.bfloat16)
    sums = {name: torch.zeros_like(p, dtype=accumulate) for name, p in module.named_parameters()}
    for x in data:
        module.zero_grad()
        lm_loss(module(x), x).backward()
        for name, p in module.named_parameters():
            if p.grad is not None:  # (the model's side layer is never used)
                sums[name] += p.grad.to(accumulate) if accumulate == torch.float32 else p.grad
    return sums


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
def test_bf16_gradients_of_several_backwards_are_summed_in_fp32(placement):
    """Before 2026-11-27 the sum stayed in the chunk's bf16 buffer (32 micro-batches: 0.59% off an fp32 sum);
    DeepSpeed's bf16 ZeRO sums in fp32 too. ``grad_accum_dtype=torch.bfloat16`` keeps the 16-bit sum."""
    reference = _reference()
    data = batches(MICRO_BATCHES, seed=7)
    for accumulate in (torch.float32, torch.bfloat16):
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(),
                                  tensor_placement_policy=placement, dtype=torch.bfloat16, chunk_size=16384,
                                  grad_accum_dtype=None if accumulate == torch.float32 else torch.bfloat16)
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR))
        for x in data:
            lm_loss(model(x), x).backward()
        expected = _bf16_grads_summed(reference, data, accumulate)
        grad_bytes = sum(n for tier in ("device", "host") for f, n in model.tier_bytes()[tier].items() if f == "grad")
        numel = sum(c.shard_numel for c in model.chunks if c.trainable)
        assert grad_bytes == numel * accumulate.itemsize, (grad_bytes, numel)  # counted on the ledger
        for name, p in model.module.named_parameters():
            got = cm.utils.safe_get_full_grad(p)
            assert torch.equal(got, expected[name].float()), name
    far = _bf16_grads_summed(reference, data, torch.bfloat16)
    near = _bf16_grads_summed(reference, data, torch.float32)
    assert any(not torch.equal(far[k].float(), near[k]) for k in far)  # the two sums differ: the test can fail


@pytest.mark.parametrize("partition_grad", [False, True])
def test_low_level_zero_sums_bf16_gradients_of_several_backwards_in_fp32(partition_grad):
    reference = _reference()
    data = batches(MICRO_BATCHES, seed=7)
    for accumulate in (torch.float32, torch.bfloat16):
        module = copy.deepcopy(reference).to(torch.bfloat16)
        optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(module.parameters(), lr=LR), partition_grad=partition_grad,
                                         grad_accum_dtype=None if accumulate == torch.float32 else torch.bfloat16)
        for x in data:
            optim.backward(lm_loss(module(x), x))
        expected = _bf16_grads_summed(reference, data, accumulate)
        for name, p in module.named_parameters():
            assert torch.equal(cm.utils.safe_get_full_grad(p), expected[name].float()), name


# ---- any torch optimizer (chunkmem.optim.any_optimizer): the same semantics --------------------------------------
# Before 2026-11-27 its scalar state (step, NAdam's mu_product) was one per chunk and param group and a parameter's
# first step was its chunk's: a parameter frozen for its chunk's first steps got zeros for a state torch creates
# (SGD's dampened momentum buffer starts as the gradient, Adagrad's sum as initial_accumulator_value) and its
# neighbours' step count (NAdam 1.9e-3 off at lr 1e-2 after 4 steps, frozen for 2).

ANY = {
    "nadam": lambda p: torch.optim.NAdam(p, lr=LR, weight_decay=WD),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
}
FROZEN = {0, 2}  # blocks.1 frozen for its chunk's first step (its state is created later) and for one in between


def _plain_any(reference, make, data, taken, frozen=()):
    model = copy.deepcopy(reference)
    optim = make(model.parameters())
    _train_plain(model, optim, data, taken, frozen)
    return model, optim


def _train_plain(model, optim, data, taken, frozen=(), first=0):
    for step, x in enumerate(data, start=first):
        model.taken = taken[step]
        for name, p in model.named_parameters():
            p.requires_grad_(not (name.startswith("blocks.1.") and step in frozen))
        lm_loss(model(x), x).backward()
        optim.step()
        optim.zero_grad()


def _wrap_any(reference, make, placement="cpu", model_args=None, **optim_args):
    """As chunkmem.initialize wraps: the torch optimizer over the plain module, then the chunks (Adagrad reads
    its parameters when built)."""
    module = copy.deepcopy(reference)
    optimizer = make(module.parameters())
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement,
                              dtype=torch.float32, chunk_size=16384, **(model_args or {}))
    return model, cm.ShardedOptimizerV2(model, optimizer, **optim_args)


def _assert_state_like_torch(optim, plain_optim, atol=0.0):
    """Each parameter's state as torch keeps it: the same parameters have state, each its own step count and
    scalars, and the per-element state. (Adagrad's constructor gives every parameter a state of step 0, which
    torch keeps for one never stepped, Branching's unused ``side``; chunkmem keeps none: not compared here.)"""
    ours, theirs = optim.state_dict()["state"], plain_optim.state_dict()["state"]
    theirs = {i: e for i, e in theirs.items() if "step" not in e or float(e["step"]) > 0}
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        assert set(ours[index]) == set(entry), index
        for key, value in entry.items():
            torch.testing.assert_close(torch.as_tensor(ours[index][key]), torch.as_tensor(value), rtol=0, atol=atol,
                                       msg=f"{index} {key}")


def _assert_close_to_plain(model, plain, atol=0.0):
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=atol, msg=name)


def _frozen_shares_a_chunk_with_others(model):
    """The test can fail: blocks.1's parameters share a chunk with parameters stepped while they are frozen."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    return any(len({names[id(s.param)].startswith("blocks.1.") for s in c.slots}) == 2 for c in model.chunks)


@pytest.mark.parametrize("case", ["cpu", "cuda", "disk", "step_in_backward", "disk_step_in_backward"])
@pytest.mark.parametrize("name", list(ANY))
def test_any_optimizer_keeps_a_frozen_parameters_own_state_as_torch(name, case, tmp_path):
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    plain, plain_optim = _plain_any(reference, ANY[name], data, taken, FROZEN)
    model_args = {"offload_optimizer": "disk", "nvme_path": str(tmp_path), "buffer_size": 8192} \
        if case.startswith("disk") else None  # pieces of 2048 elements: they cut parameters
    model, optim = _wrap_any(reference, ANY[name], "cuda" if case == "cuda" else "cpu", model_args,
                             step_in_backward=case.endswith("step_in_backward"))
    assert _frozen_shares_a_chunk_with_others(model)
    _train(model, optim, data, taken, FROZEN)
    atol = 1e-6 if case == "cuda" and torch.cuda.is_available() else 0.0  # a GPU's forward is not the CPU's
    _assert_close_to_plain(model, plain, atol)
    _assert_state_like_torch(optim, plain_optim, atol)
    counts = {int(e["step"]) for i, e in optim.state_dict()["state"].items() if "step" in e}
    assert counts == ({2, 4} if name != "sgd" else set())  # (SGD counts no steps)


@pytest.mark.parametrize("load", ["state_dict", "checkpoint", "sharded", "sharded_other_layout"])
@pytest.mark.parametrize("name", list(ANY))
def test_any_optimizer_per_parameter_state_survives_a_state_dict_and_checkpoints(name, load, tmp_path):
    """Saved after 2 steps (blocks.1 stepped once, its neighbours twice), loaded into a fresh wrap (a sharded
    checkpoint also into another chunk size, the resharded load), resumed: exactly plain torch's 4 steps."""
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    plain, plain_optim = _plain_any(reference, ANY[name], data, taken, FROZEN)
    model, optim = _wrap_any(reference, ANY[name])
    _train(model, optim, data[:2], taken, FROZEN)
    fresh_args = {"chunk_size": 32768} if load == "sharded_other_layout" else {}
    module = copy.deepcopy(reference)
    optimizer = ANY[name](module.parameters())
    fresh = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              **{"chunk_size": 16384, **fresh_args})
    fresh_optim = cm.ShardedOptimizerV2(fresh, optimizer)
    if load == "state_dict":
        fresh.load_state_dict(model.state_dict())
        fresh_optim.load_state_dict(optim.state_dict())
    else:
        cm.save_checkpoint(str(tmp_path / "ckpt"), model, optim, sharded=load != "checkpoint")
        _assert_same_state(cm.consolidate_checkpoint(str(tmp_path / "ckpt"))["optimizer"]["state"],
                           optim.state_dict()["state"])
        cm.load_checkpoint(str(tmp_path / "ckpt"), fresh, fresh_optim, **({"elastic": True} if fresh_args else {}))
    _train(fresh, fresh_optim, data[2:], taken, FROZEN, first=2)
    _assert_close_to_plain(fresh, plain)
    _assert_state_like_torch(fresh_optim, plain_optim)


def _assert_same_state(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for index, entry in theirs.items():
        assert set(ours[index]) == set(entry), index
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(ours[index][key]), torch.as_tensor(value)), (index, key)


def _as_saved_with_scalars_per_group(payload):
    """A rank file as chunkmem wrote it before 2026-11-27: another optimizer's scalar state one per chunk and
    param group (here one group), not one per parameter."""
    for entry in payload["model"]["chunks"]:
        if "slot_scalars" in entry:
            per_slot = entry.pop("slot_scalars")
            entry["scalars"] = {0: per_slot[min(per_slot)]} if per_slot else {}


@pytest.mark.parametrize("layout", ["same", "other"])
def test_any_optimizer_loads_a_sharded_checkpoint_with_scalars_per_param_group(layout, tmp_path):
    """Such a checkpoint still loads (with its layout, and resharded into another chunk size) and consolidates:
    each parameter that had stepped takes its group's scalar state, one never stepped (Branching's unused
    ``side``) none."""
    from tests.test_checkpoint_integrity import edit_rank_file
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    plain, plain_optim = _plain_any(reference, ANY["nadam"], data, taken)
    model, optim = _wrap_any(reference, ANY["nadam"])
    _train(model, optim, data[:2], taken)
    path = str(tmp_path / "ckpt")
    cm.save_checkpoint(path, model, optim, sharded=True)
    edit_rank_file(path, _as_saved_with_scalars_per_group)
    _assert_same_state(cm.consolidate_checkpoint(path)["optimizer"]["state"], optim.state_dict()["state"])
    module = copy.deepcopy(reference)
    optimizer = ANY["nadam"](module.parameters())
    fresh = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              chunk_size=16384 if layout == "same" else 32768)
    fresh_optim = cm.ShardedOptimizerV2(fresh, optimizer)
    cm.load_checkpoint(path, fresh, fresh_optim, elastic=layout == "other")
    _assert_same_state(fresh_optim.state_dict()["state"], optim.state_dict()["state"])
    _train(fresh, fresh_optim, data[2:], taken, first=2)
    _assert_close_to_plain(fresh, plain)
    _assert_state_like_torch(fresh_optim, plain_optim)


def _two_ranks_any(rank, world, local_branch):
    reference = _reference()
    model, optim = _wrap_any(reference, ANY["nadam"])
    data = [x[rank::world] for x in batches(len(TAKEN), batch=4, seed=3)]
    model.module.branch[0].bias_learns = rank == 0 or not local_branch
    _train(model, optim, data, TAKEN)
    held_elsewhere = sum(c.own_range(s) is None for c in model.chunks if c.trainable for s in c.slots)
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
             for i, e in optim.state_dict()["state"].items()}
    return {k: v.clone() for k, v in model.state_dict().items()}, state, held_elsewhere


def test_any_optimizer_on_two_ranks_steps_each_parameter_as_torch():
    """test_two_ranks_step_a_parameter_when_any_rank_gave_it_a_gradient with NAdam: each parameter's step count
    and mu_product are torch's on both ranks, also those of parameters none of whose elements a rank holds (it
    advances their scalar state on a one-element stand-in), and the ranks stay bit for bit equal."""
    reference = _reference()
    both = run_ranks(_two_ranks_any, 2, False)
    plain, plain_optim = _plain_any(reference, ANY["nadam"], batches(len(TAKEN), batch=4, seed=3), TAKEN)
    assert all(held_elsewhere > 0 for _, _, held_elsewhere in both)  # the stand-ins are exercised
    theirs = plain_optim.state_dict()["state"]
    for params, state, _ in both:
        assert sorted(state) == sorted(theirs)
        assert {int(e["step"]) for e in state.values()} == {sum(TAKEN), len(TAKEN)}
        for index, entry in theirs.items():
            for key in ("step", "mu_product"):
                assert torch.equal(torch.as_tensor(state[index][key]), torch.as_tensor(entry[key])), (index, key)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5)
    one_sided = run_ranks(_two_ranks_any, 2, True)
    for index, entry in one_sided[0][1].items():
        for key in ("step", "mu_product"):
            assert torch.equal(entry[key], one_sided[1][1][index][key]), (index, key)
            assert torch.equal(entry[key], both[0][1][index][key]), (index, key)
    for name in one_sided[0][0]:
        assert torch.equal(one_sided[0][0][name], one_sided[1][0][name]), name


@pytest.mark.parametrize("name", list(ANY))
def test_any_optimizer_undoes_and_redoes_the_backwards_update_of_a_frozen_parameters_own_state(name):
    """step_in_backward: a clipping decided after the backward undoes its updates (per-element state, step
    counts and each parameter's scalar state put back) and redoes them: bit for bit the wrap without
    step_in_backward, and torch with clip_grad_norm_ (within the norm's summation order)."""
    reference = _reference()
    data = batches(4, seed=5)
    clip = {1: 1e-2, 3: 1e-2}  # steps 1 and 3 (blocks.1 stepped, not stepped) clipped hard
    plain = copy.deepcopy(reference)
    plain_optim = ANY[name](plain.parameters())
    for step, x in enumerate(data):
        for param_name, p in plain.named_parameters():
            p.requires_grad_(not (param_name.startswith("blocks.1.") and step in FROZEN))
        lm_loss(plain(x), x).backward()
        if step in clip:
            torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.grad is not None], clip[step])
        plain_optim.step()
        plain_optim.zero_grad()
    wraps = [_wrap_any(reference, ANY[name], step_in_backward=speculating) for speculating in (True, False)]
    for step, x in enumerate(data):
        for model, optim in wraps:
            for param_name, p in model.module.named_parameters():
                p.requires_grad_(not (param_name.startswith("blocks.1.") and step in FROZEN))
            optim.backward(lm_loss(model(x), x))
            if step in clip:
                optim.clip_grad_norm(clip[step])
            optim.step()
            optim.zero_grad()
            if model is wraps[0][0]:  # the clipped steps redid every update the backward made, the others kept them
                assert optim.kept_backward_updates == (0 if step in clip else len(optim.runtime.trainable_chunks()))
    (model, optim), (other, other_optim) = wraps
    _assert_close_to_plain(model, other)
    _assert_same_state(optim.state_dict()["state"], other_optim.state_dict()["state"])
    _assert_close_to_plain(model, plain, atol=1e-6)
    _assert_state_like_torch(optim, plain_optim, atol=1e-6)


# ---- the same under LowLevelZeroOptimizer (ZeRO-1/2) ---------------------------------------------------------------
# Before 2026-11-27 (after ShardedOptimizerV2 was fixed) LowLevelZeroOptimizer still kept another optimizer's scalar
# state one per chunk and param group and took a parameter's first step with its chunk's: the same differences.

def _zero12_any(reference, make, **kwargs):
    module = copy.deepcopy(reference)
    return module, cm.LowLevelZeroOptimizer(make(module.parameters()), **kwargs)


def _train_zero12(module, optim, data, taken, frozen=(), first=0):
    for step, x in enumerate(data, start=first):
        module.taken = taken[step]
        for name, p in module.named_parameters():
            p.requires_grad_(not (name.startswith("blocks.1.") and step in frozen))
        optim.backward(lm_loss(module(x), x))
        optim.step()
        optim.zero_grad()


def _frozen_shares_a_flat_chunk_with_others(module, optim):
    names = {id(p): n for n, p in module.named_parameters()}
    return any(len({names[id(s.param)].startswith("blocks.1.") for s in c.slots}) == 2 for c in optim.chunks)


def _assert_module_equal(module, plain):
    state = module.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("partition_grad", [False, True], ids=["stage1", "stage2"])
@pytest.mark.parametrize("name", list(ANY))
def test_low_level_zero_keeps_a_frozen_parameters_own_state_as_torch(name, partition_grad):
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    plain, plain_optim = _plain_any(reference, ANY[name], data, taken, FROZEN)
    module, optim = _zero12_any(reference, ANY[name], partition_grad=partition_grad)
    assert _frozen_shares_a_flat_chunk_with_others(module, optim)
    _train_zero12(module, optim, data, taken, FROZEN)
    _assert_module_equal(module, plain)
    _assert_state_like_torch(optim, plain_optim)
    counts = {int(e["step"]) for e in optim.state_dict()["state"].values() if "step" in e}
    assert counts == ({2, 4} if name != "sgd" else set())  # (SGD counts no steps)


@pytest.mark.parametrize("load", ["state_dict", "checkpoint"])
@pytest.mark.parametrize("partition_grad", [False, True], ids=["stage1", "stage2"])
@pytest.mark.parametrize("name", list(ANY))
def test_low_level_zero_per_parameter_state_survives_a_state_dict_and_a_checkpoint(name, partition_grad, load,
                                                                                   tmp_path):
    """Saved after 2 steps (blocks.1 stepped once, its neighbours twice), loaded into a fresh optimizer, resumed:
    exactly plain torch's 4 steps."""
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    plain, plain_optim = _plain_any(reference, ANY[name], data, taken, FROZEN)
    module, optim = _zero12_any(reference, ANY[name], partition_grad=partition_grad)
    _train_zero12(module, optim, data[:2], taken, FROZEN)
    fresh, fresh_optim = _zero12_any(reference, ANY[name], partition_grad=partition_grad)
    if load == "state_dict":
        fresh_optim.load_model_state_dict(fresh, optim.model_state_dict(module))
        fresh_optim.load_state_dict(optim.state_dict())
    else:
        cm.save_checkpoint(str(tmp_path / "ckpt.pt"), module, optim)
        cm.load_checkpoint(str(tmp_path / "ckpt.pt"), fresh, fresh_optim)
    _assert_same_state(fresh_optim.state_dict()["state"], optim.state_dict()["state"])
    _train_zero12(fresh, fresh_optim, data[2:], taken, FROZEN, first=2)
    _assert_module_equal(fresh, plain)
    _assert_state_like_torch(fresh_optim, plain_optim)


def test_low_level_zero_loads_a_state_dict_with_the_group_scalars_in_each_entry():
    """A state dict LowLevelZeroOptimizer wrote before 2026-11-27 (each entry its chunk and group's scalar state)
    loads: each parameter takes its entry's, exports it again and counts on from it by its own steps (blocks.1,
    frozen again, one step fewer)."""
    reference = _reference()
    data = batches(4, seed=5)
    taken = [True] * 4
    module, optim = _zero12_any(reference, ANY["nadam"])
    _train_zero12(module, optim, data[:2], taken, FROZEN)
    saved = optim.state_dict()
    group = max(saved["state"].values(), key=lambda e: int(e["step"]))
    for entry in saved["state"].values():
        entry.update(step=group["step"].clone(), mu_product=group["mu_product"].clone())
    fresh, fresh_optim = _zero12_any(reference, ANY["nadam"])
    fresh_optim.load_state_dict(saved)
    _assert_same_state(fresh_optim.state_dict()["state"], saved["state"])
    _train_zero12(fresh, fresh_optim, data[2:], taken, FROZEN, first=2)
    names = [n for n, _ in fresh.named_parameters()]
    steps = {names[i]: int(e["step"]) for i, e in fresh_optim.state_dict()["state"].items()}
    assert steps == {n: 3 if n.startswith("blocks.1.") else 4 for n in names if n != "side.weight"}


def _two_ranks_zero12_any(rank, world):
    reference = _reference()
    module, optim = _zero12_any(reference, ANY["nadam"], partition_grad=True)
    data = [x[rank::world] for x in batches(len(TAKEN), batch=4, seed=3)]
    _train_zero12(module, optim, data, TAKEN, FROZEN)
    names = {id(p): n for n, p in module.named_parameters()}
    held_elsewhere = sorted(names[id(s.param)] for c in optim.chunks for s in c.slots if s.owned() is None)
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
             for i, e in optim.state_dict()["state"].items()}
    return {k: v.clone() for k, v in module.state_dict().items()}, state, held_elsewhere


def test_low_level_zero_on_two_ranks_steps_each_parameter_as_torch():
    """Stage 2 with NAdam on 2 ranks, the branch not taken in some steps and blocks.1 frozen in some: each
    parameter's step count and mu_product are torch's on both ranks, also those of parameters none of whose
    elements a rank holds (it advances their scalar state on a one-element stand-in)."""
    reference = _reference()
    ranks = run_ranks(_two_ranks_zero12_any, 2)
    plain, plain_optim = _plain_any(reference, ANY["nadam"], batches(len(TAKEN), batch=4, seed=3), TAKEN, FROZEN)
    for _, _, held_elsewhere in ranks:  # the stand-ins are exercised, also for a parameter frozen for a while
        assert any(n.startswith("blocks.1.") for n in held_elsewhere), held_elsewhere
    theirs = plain_optim.state_dict()["state"]
    for params, state, _ in ranks:
        assert sorted(state) == sorted(theirs)
        assert {int(e["step"]) for e in state.values()} == {sum(TAKEN), len(TAKEN) - len(FROZEN), len(TAKEN)}
        for index, entry in theirs.items():
            for key in ("step", "mu_product"):
                assert torch.equal(torch.as_tensor(state[index][key]), torch.as_tensor(entry[key])), (index, key)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5)
    for name in ranks[0][0]:
        assert torch.equal(ranks[0][0][name], ranks[1][0][name]), name


# ---- a gradient set is a gradient stepped: zeroed ones, and those of a parameter frozen since ---------------------
# torch's optimizers step every parameter whose .grad is not None, whatever its requires_grad. Before 2026-11-28 a
# step after zero_grad(set_to_none=False) with no backward since updated nothing (and .grad read None where torch
# reads zeros; weight decay and momentum move such a parameter in torch), and a parameter frozen between its backward
# and the step was left alone.

def _pair_of_sides(placement):
    reference = _reference()
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD, fused=True)
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy=placement,
                              dtype=torch.float32, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    return model, optim, plain, plain_optim


def _step_both(model, optim, plain, plain_optim):
    optim.step()
    plain_optim.step()
    plain_optim.zero_grad()  # (chunkmem's step releases the gradients it used, as the reference's does)
    _assert_equal_to_plain(model, plain)
    _assert_steps_like_torch(optim, plain_optim)


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
def test_gradients_zeroed_without_a_backward_since_are_stepped_as_in_torch(placement):
    model, optim, plain, plain_optim = _pair_of_sides(placement)
    x, y = batches(2, seed=3)
    for net in (model, plain):
        lm_loss(net(x), x).backward()
    _step_both(model, optim, plain, plain_optim)
    for net in (model, plain):
        lm_loss(net(y), y).backward()
    optim.zero_grad(set_to_none=False)
    plain_optim.zero_grad(set_to_none=False)
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        assert (ours.grad is None) == (theirs.grad is None)
        assert theirs.grad is None or torch.equal(ours.grad.clone(), theirs.grad)
    _step_both(model, optim, plain, plain_optim)  # weight decay and Adam's moments move them


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
def test_a_parameter_frozen_after_its_backward_is_stepped_as_in_torch(placement):
    model, optim, plain, plain_optim = _pair_of_sides(placement)
    data = batches(3, seed=3)
    for step, x in enumerate(data):
        for net in (model, plain):
            lm_loss(net(x), x).backward()
        frozen = f"blocks.{step % 2}."
        for net in (model.module, plain):
            for name, p in net.named_parameters():
                p.requires_grad_(not name.startswith(frozen))
        if step == 2:  # a zeroed gradient of a frozen parameter is stepped too
            optim.zero_grad(set_to_none=False)
            plain_optim.zero_grad(set_to_none=False)
        assert next(p for n, p in model.module.named_parameters() if n.startswith(frozen)).grad is not None
        _step_both(model, optim, plain, plain_optim)
        for net in (model.module, plain):
            net.requires_grad_(True)


@pytest.mark.parametrize("partition_grad", [False, True], ids=["stage1", "stage2"])
def test_low_level_zero_steps_zeroed_gradients_and_those_of_a_parameter_frozen_since(partition_grad):
    """The same under LowLevelZeroOptimizer: before 2026-11-28 its step after zero_grad(set_to_none=False) updated
    nothing, and it left a parameter frozen after its backward alone."""
    reference = _reference()
    plain = copy.deepcopy(reference)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD, fused=True)
    module = copy.deepcopy(reference)
    optim = cm.LowLevelZeroOptimizer(cm.HybridAdam(module.parameters(), lr=LR, weight_decay=WD),
                                     partition_grad=partition_grad)
    for step, x in enumerate(batches(3, seed=3)):
        optim.backward(lm_loss(module(x), x))
        lm_loss(plain(x), x).backward()
        if step == 1:
            optim.zero_grad(set_to_none=False)
            plain_optim.zero_grad(set_to_none=False)
        if step == 2:
            module.blocks[0].requires_grad_(False)
            plain.blocks[0].requires_grad_(False)
        assert optim.step()
        plain_optim.step()
        plain_optim.zero_grad()
        _assert_module_equal(module, plain)
        _assert_steps_like_torch(optim, plain_optim)
