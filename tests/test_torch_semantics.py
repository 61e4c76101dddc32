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
    for step, x in enumerate(data):
        model.taken = taken[step]
        for name, p in model.named_parameters():
            p.requires_grad_(not (name.startswith("blocks.1.") and step in frozen))
        lm_loss(model(x), x).backward()
        optim.step()
        optim.zero_grad()
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
