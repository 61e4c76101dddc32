"""torchao's 8-bit Adams (and HybridAdam(state_dtype="8bit", bf16_stochastic_round=True)) in ShardedOptimizerV2 on
several ranks (chunkmem.optim.low_bit_layout, low_bit_rule): chunks whose shard boundaries cut quantized parameters
in the middle of a block train bit for bit as torchao's step run eagerly on the unsharded model, the state dict
gathered is torchao's, a sharded checkpoint resumes bit for bit, and what is not supported (the disk tier or
step_in_backward on several ranks) is refused. Sharded checkpoints loaded into another layout and consolidated:
test_low_bit_resharding.py; ZeRO-1/2 (LowLevelZeroOptimizer): test_low_bit_zero12.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import chunkmem as cm
from chunkmem.optim.blockwise import BLOCK_SIZE, quantizes
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss

torchao_optim = pytest.importorskip("torchao.optim")
from test_low_bit_state import _same_state  # noqa: E402
from torchao_reference import eager_step as _eager_step  # noqa: E402

# elements per chunk by world size: every shard boundary of the first chunk falls in the middle of a block of
# blocks.0.fc1.weight (asserted by _cut_blocks), and the rank's part of it is not in whole blocks
CHUNK_ELEMENTS = {2: 1 << 15, 3: 3 * 10240}

CASES = {
    "adamw8bit": (lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, weight_decay=0.05), torch.float32),
    "adam8bit": (lambda p: torchao_optim.Adam8bit(p, lr=1e-2, weight_decay=0.05), torch.float32),
    "adamw8bit-bf16-stochastic": (lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, bf16_stochastic_round=True),
                                  torch.bfloat16),
    "hybridadam-8bit-bf16-stochastic": (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.01, state_dtype="8bit",
                                                                bf16_stochastic_round=True), torch.bfloat16),
}
# the torchao optimizer that steps as HybridAdam's case does (torchao's cases: their own)
TORCHAO = {"hybridadam-8bit-bf16-stochastic": lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, bf16_stochastic_round=True)}


def _wrapped(reference, make, dtype, world):
    module = copy.deepcopy(reference)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              chunk_size=CHUNK_ELEMENTS[world] * dtype.itemsize)
    return model, cm.ShardedOptimizerV2(model, make(module.parameters()))


def _cut_blocks(model) -> int:
    """The quantized blocks the shard boundaries cut (shard boundaries computed here, not by chunkmem)."""
    cut = 0
    for chunk in model.chunks:
        for boundary in range(chunk.shard_numel, chunk.numel, chunk.shard_numel):
            cut += sum(1 for s in chunk.slots if quantizes(s.numel) and s.offset < boundary < s.offset + s.numel
                       and (boundary - s.offset) % BLOCK_SIZE)
    return cut


def _seeded_step(step, n):
    torch.manual_seed(100 + n)  # the stochastic rounding's numbers: the same draws on every rank and in torchao
    step()


def _train(model, optim, data, first=0):
    for n, x in enumerate(data, first):
        optim.backward(lm_loss(model(x), x))
        _seeded_step(optim.step, n)
        optim.zero_grad()


def _plain_on_ranks(reference, make, data, world):
    """torchao's eager step on the unsharded model, each gradient the ranks' mean as torch.distributed gives it
    (every rank has the same data: exact at 2 ranks, one rounding of a sum of 3 equal values at 3)."""
    plain = copy.deepcopy(reference)
    optimizer = make(plain.parameters())
    for n, x in enumerate(data):
        lm_loss(plain(x), x).backward()
        for p in plain.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        _seeded_step(lambda: _eager_step(optimizer), n)
        optimizer.zero_grad()
    return plain, optimizer


def _training_worker(rank, world, case):
    make, dtype = CASES[case]
    torch.manual_seed(0)
    reference = TinyGPT(d=64).to(dtype)
    data = batches(3, seed=5)
    plain, plain_optim = _plain_on_ranks(reference, TORCHAO.get(case, make), data, world)
    their_generator = torch.get_rng_state()
    model, optim = _wrapped(reference, make, dtype, world)
    _train(model, optim, data)
    state = model.state_dict()
    differ = [key for key, p in plain.named_parameters() if not torch.equal(state[key], p.detach().float())]
    if not torch.equal(torch.get_rng_state(), their_generator):
        differ.append("the default generator")
    _same_state(optim.state_dict(), plain_optim.state_dict(), plain_form=case in TORCHAO)
    return {"cut": _cut_blocks(model), "differ": differ}


@pytest.mark.parametrize("world,case", [(2, "adamw8bit"), (2, "adam8bit"), (2, "adamw8bit-bf16-stochastic"),
                                        (2, "hybridadam-8bit-bf16-stochastic"), (3, "adamw8bit")])
def test_training_on_several_ranks_equals_torchaos_step_on_the_whole_model(world, case):
    for rank in run_ranks(_training_worker, world, case):
        assert rank["cut"] >= world - 1  # the test is not vacuous: boundaries cut blocks of quantized parameters
        assert rank["differ"] == []


FIRST, THEN = batches(2, seed=10), batches(2, seed=11)


def _checkpoint_worker(rank, world, directory):
    make, dtype = CASES["adam8bit"]
    torch.manual_seed(0)
    reference = TinyGPT(d=64)
    model, optim = _wrapped(reference, make, dtype, world)
    _train(model, optim, FIRST)
    cm.save_checkpoint(directory, model, optim, sharded=True)
    cm.save_checkpoint(directory + ".pt", model, optim)
    _train(model, optim, THEN)
    resumed, resumed_optim = _wrapped(TinyGPT(d=64), make, dtype, world)
    cm.load_checkpoint(directory, resumed, resumed_optim)
    _train(resumed, resumed_optim, THEN)
    differ = [key for (key, a), b in zip(model.state_dict().items(), resumed.state_dict().values())
              if not torch.equal(a, b)]
    _same_state(resumed_optim.state_dict(), optim.state_dict())
    return {"cut": _cut_blocks(model), "differ": differ, "model": model.state_dict()}


def test_checkpoints_saved_on_two_ranks_resume_bit_for_bit(tmp_path):
    """Sharded: on the 2 ranks that saved it. Full (torchao's state dict): also in one process, where the same
    data trains as on 2 ranks (their mean gradient is each rank's)."""
    ranks = run_ranks(_checkpoint_worker, 2, str(tmp_path / "ckpt"))
    for rank in ranks:
        assert rank["cut"] >= 1 and rank["differ"] == []
    make, dtype = CASES["adam8bit"]
    model, optim = _wrapped(TinyGPT(d=64), make, dtype, 2)
    cm.load_checkpoint(tmp_path / "ckpt.pt", model, optim)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute (the matmuls' roundings depend on the threads)
    try:
        _train(model, optim, THEN)
    finally:
        torch.set_num_threads(threads)
    for key, value in model.state_dict().items():
        assert torch.equal(value, ranks[0]["model"][key]), key


def _disk_or_backward_worker(rank, world, directory):
    messages = []
    for model_kwargs, optim_kwargs in ((dict(offload_optimizer="disk", nvme_path=directory), {}),
                                       ({}, dict(step_in_backward=True))):
        model = cm.ShardedModelV2(TinyGPT(d=64), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, **model_kwargs)
        optimizer = torchao_optim.AdamW8bit(model.parameters())
        try:
            cm.ShardedOptimizerV2(model, optimizer, **optim_kwargs)
            messages.append("accepted")
        except cm.UnsupportedOperationError as refused:
            assert not model.optimizer_attached and not optimizer.state
            messages.append(str(refused))
    return messages


def test_several_ranks_with_the_disk_tier_or_step_in_backward_are_refused_on_every_rank(tmp_path):
    for disk, backward in run_ranks(_disk_or_backward_worker, 2, str(tmp_path)):
        assert "on several ranks with the disk tier" in disk and "not supported yet" in disk
        assert "on several ranks with step_in_backward=True" in backward
