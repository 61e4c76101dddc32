"""torchao's 8-bit Adams (and HybridAdam(state_dtype="8bit"), bf16_stochastic_round=True or not) in
ShardedOptimizerV2 on several ranks (chunkmem.optim.low_bit_layout, low_bit_rule,
low_bit_streamed): chunks whose shard boundaries cut quantized parameters in the middle of a block train bit for bit
as torchao's step run eagerly on the unsharded model, with the state in memory or on the disk tier, updated in
step() or in the backward (step_in_backward); the state dict gathered is torchao's, a sharded checkpoint resumes
bit for bit, a disk step that fails on one rank is undone on both, and a NaN in a cut block stays a NaN. Sharded
checkpoints loaded into another layout and consolidated: test_low_bit_resharding.py; ZeRO-1/2
(LowLevelZeroOptimizer): test_low_bit_zero12.py."""
from __future__ import annotations

import contextlib
import copy
import errno
import os

import pytest
import torch
import torch.distributed as dist

import chunkmem as cm
from chunkmem.optim.blockwise import BLOCK_SIZE, quantizes
from chunkmem.optim.low_bit_streamed import StreamedLowBitUpdate
from chunkmem.storage.disk_io import inject_faults
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
    "hybridadam-8bit": (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.05, state_dtype="8bit"), torch.float32),
    "hybridadam-8bit-bf16-stochastic": (lambda p: cm.HybridAdam(p, lr=1e-2, weight_decay=0.01, state_dtype="8bit",
                                                                bf16_stochastic_round=True), torch.bfloat16),
}
# the torchao optimizer that steps as a HybridAdam case does (torchao's cases: their own)
TORCHAO = {"hybridadam-8bit": lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, weight_decay=0.05),
           "hybridadam-8bit-bf16-stochastic": lambda p: torchao_optim.AdamW8bit(p, lr=1e-2, bf16_stochastic_round=True)}


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


DISK_CASES = {  # (the optimizer and dtype of CASES, the disk tier's settings)
    "fp32 atomic": ("adamw8bit", dict(atomic_step=True)),
    "fp32 in place": ("adam8bit", dict(atomic_step=False)),
    "bf16 rounded, parameters on disk": ("adamw8bit-bf16-stochastic", dict(offload_param="disk")),
    "bf16 rounded, parameters in memory": ("adamw8bit-bf16-stochastic", dict(atomic_step=True)),
    "HybridAdam fp32 atomic": ("hybridadam-8bit", dict(atomic_step=True)),
    "HybridAdam bf16 rounded, parameters on disk": ("hybridadam-8bit-bf16-stochastic", dict(offload_param="disk")),
}


def _on_disk(reference, make, dtype, world, directory, step_in_backward=False, **disk):
    """The 8-bit Adam over the reference's copy with its state on the disk tier, in I/O buffers smaller than a
    shard (the 8-bit update still gets each shard whole), one directory per rank."""
    module = copy.deepcopy(reference)
    path = os.path.join(directory, f"rank{dist.get_rank()}")
    os.makedirs(path, exist_ok=True)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              chunk_size=CHUNK_ELEMENTS[world] * dtype.itemsize, offload_optimizer="disk",
                              nvme_path=path, buffer_size=8192, **disk)
    return model, cm.ShardedOptimizerV2(model, make(module.parameters()), step_in_backward=step_in_backward)


def _train_seeded_before_backward(model, optim, data, first=0):
    """As _train, the generator seeded before the backward, which step_in_backward's updates draw from (torchao's
    step draws the same numbers: the backward draws none)."""
    for n, x in enumerate(data, first):
        torch.manual_seed(100 + n)
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()


def _differences(model, optim, plain, plain_optim, plain_rng, plain_form=False):
    """The parameters differing from torchao's (state: asserted equal, in HybridAdam's form if ``plain_form``),
    and whether the generator is where torchao's step left it."""
    state = model.state_dict()
    _same_state(optim.state_dict(), plain_optim.state_dict(), plain_form=plain_form)
    return {"differ": [key for key, p in plain.named_parameters() if not torch.equal(state[key], p.detach().float())],
            "generator": torch.equal(torch.get_rng_state(), plain_rng)}


def _disk_case(case, world):
    """A disk case's optimizer maker, dtype and disk arguments, the reference model, the data, and torchao's eager
    training on it over ``world`` ranks (plain model, its optimizer, the generator's state after)."""
    optimizer, disk = DISK_CASES[case]
    make, dtype = CASES[optimizer]
    torch.manual_seed(0)
    reference = TinyGPT(d=64).to(dtype)
    data = batches(3, seed=5)
    plain, plain_optim = _plain_on_ranks(reference, TORCHAO.get(optimizer, make), data, world)
    return make, dtype, disk, reference, data, (plain, plain_optim, torch.get_rng_state())


def _hybrid(case):
    """Whether a disk case's optimizer is HybridAdam (its state dict in HybridAdam's form, torchao's in TORCHAO)."""
    return DISK_CASES[case][0] in TORCHAO


def _disk_worker(rank, world, directory, case):
    make, dtype, disk, reference, data, (plain, plain_optim, plain_rng) = _disk_case(case, world)
    found = {}
    for step_in_backward in (False, True):
        model, optim = _on_disk(reference, make, dtype, world, os.path.join(directory, str(step_in_backward)),
                                step_in_backward, **disk)
        _train_seeded_before_backward(model, optim, data)
        tiers = model.tier_bytes()
        found[step_in_backward] = {**_differences(model, optim, plain, plain_optim, plain_rng, _hybrid(case)),
                                   "cut": _cut_blocks(model), "kept": optim.kept_backward_updates,
                                   "codes on disk": tiers["disk"]["exp_avg_codes"] == sum(
                                       c.shard_numel for c in model.chunks if c.trainable)}
    return found


@pytest.mark.parametrize("case", list(DISK_CASES))
def test_the_disk_tier_on_two_ranks_equals_torchaos_step_in_step_and_in_the_backward(tmp_path, case):
    """The blocks a shard boundary cuts are quantized once every chunk was streamed, with the scales the ranks
    agree on (chunkmem.optim.low_bit_streamed)."""
    for rank in run_ranks(_disk_worker, 2, str(tmp_path), case):
        for step_in_backward, found in rank.items():
            assert found["cut"] >= 1 and found["codes on disk"], (step_in_backward, found)
            assert found["differ"] == [] and found["generator"], (step_in_backward, found)
        assert rank[True]["kept"] > 0  # the backward's updates stood


def _in_memory_backward_worker(rank, world):
    make, dtype = CASES["adamw8bit-bf16-stochastic"]
    torch.manual_seed(0)
    reference = TinyGPT(d=64).to(dtype)
    data = batches(3, seed=5)
    plain, plain_optim = _plain_on_ranks(reference, make, data, world)
    plain_rng = torch.get_rng_state()
    model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=dtype, chunk_size=CHUNK_ELEMENTS[world] * dtype.itemsize)
    optim = cm.ShardedOptimizerV2(model, make(model.module.parameters()), step_in_backward=True)
    _train_seeded_before_backward(model, optim, data)
    cut = sum(1 for c in model.chunks if c.trainable and optim.update_rule._layouts[c.index].cut_blocks)
    return {**_differences(model, optim, plain, plain_optim, plain_rng), "cut chunks": cut,
            "kept": optim.kept_backward_updates, "trainable": sum(c.trainable for c in model.chunks)}


def test_step_in_backward_with_the_state_in_memory_on_two_ranks_equals_torchaos_step():
    """The chunks whose shard boundaries cut blocks are left to step(), which agrees on their scales in chunk
    order; the others are updated in the backward."""
    for rank in run_ranks(_in_memory_backward_worker, 2):
        assert rank["differ"] == [] and rank["generator"], rank
        assert 0 < rank["cut chunks"] < rank["trainable"]
        assert rank["kept"] == rank["trainable"] - rank["cut chunks"], rank  # (the last step)


# on rank 1: a write of the stream (every write of chunk 1's codes), or the second write of chunk 0's codes of
# exp_avg: the page around its cut block, written again once the ranks agreed on its scale; or the update of the
# second chunk streamed raises once it has written the new values (a crash, not an I/O error)
FAULTS = {"stream": dict(what="chunk1.", write_errno=errno.EIO),
          "cut block's page": dict(what="chunk0.exp_avg_codes", after=1, write_errno=errno.EIO),
          "crash": None}


@contextlib.contextmanager
def _faults_on(rank, fault):
    """Rank 1's fault (FAULTS), yielding how many were made; the other rank's none."""
    if rank != 1 or FAULTS[fault] is not None:
        with inject_faults(**(FAULTS[fault] if rank == 1 else dict(what="nothing"))) as faults:
            yield lambda: faults.failed
        return
    calls, update = [], StreamedLowBitUpdate.__call__

    def crashing(self, *args):
        calls.append(1)
        update(self, *args)
        if len(calls) == 2:
            raise RuntimeError("a crash inside the disk step's update")
    StreamedLowBitUpdate.__call__ = crashing
    try:
        yield lambda: int(len(calls) >= 2)
    finally:
        StreamedLowBitUpdate.__call__ = update


def _failing_worker(rank, world, directory, case, fault, step_in_backward):
    make, dtype, disk, reference, data, (plain, plain_optim, plain_rng) = _disk_case(case, world)
    model, optim = _on_disk(reference, make, dtype, world, directory, step_in_backward, **disk)
    _train_seeded_before_backward(model, optim, data[:1])
    before, before_state = copy.deepcopy(model.state_dict()), optim.state_dict()
    found = {"failed": None}
    torch.manual_seed(101)
    with _faults_on(rank, fault) as failed:
        try:
            optim.backward(lm_loss(model(data[1]), data[1]))
            optim.step()
        except cm.DiskStepError as exc:
            found["failed"] = (exc.undone, exc.cause is not None)
        except RuntimeError as exc:
            found["failed"] = str(exc)
    found["injected"] = failed()
    after = model.state_dict()
    found["unchanged"] = [key for key, value in before.items() if not torch.equal(value, after[key])]
    _same_state(optim.state_dict(), before_state)
    torch.manual_seed(101)
    optim.step()  # the gradients were kept: the step again
    optim.zero_grad()
    _train_seeded_before_backward(model, optim, data[2:], first=2)
    return {**found, **_differences(model, optim, plain, plain_optim, plain_rng, _hybrid(case))}


@pytest.mark.parametrize("case,fault,step_in_backward", [
    ("fp32 atomic", "stream", False), ("fp32 atomic", "cut block's page", False), ("fp32 atomic", "crash", False),
    ("bf16 rounded, parameters on disk", "stream", True),
    ("bf16 rounded, parameters on disk", "cut block's page", True),
    ("bf16 rounded, parameters in memory", "crash", True)])
def test_a_disk_step_failing_on_one_rank_is_undone_on_both_and_the_next_one_equals_torchaos(tmp_path, case, fault,
                                                                                           step_in_backward):
    """Rank 1's write fails (in the stream, or when the page of a cut block is written again) or its update raises:
    it still meets rank 0's collectives, both raise (DiskStepError, or rank 1 its crash) with everything as before
    the step, and stepping again trains as torchao."""
    ranks = run_ranks(_failing_worker, 2, str(tmp_path), case, fault, step_in_backward)
    assert ranks[1]["injected"] >= 1 and ranks[0]["injected"] == 0
    assert ranks[0]["failed"] == (True, False), ranks
    assert ranks[1]["failed"] == ("a crash inside the disk step's update" if fault == "crash" else (True, True)), ranks
    for rank in ranks:
        assert rank["unchanged"] == [] and rank["differ"] == [] and rank["generator"], rank


def _nan_worker(rank, world, directory):
    """One step with a NaN in a cut block (rank 1's gradient: test_low_bit_zero12's), the state on disk, in step()
    and in the backward; torchao's step on the whole model with the ranks' mean gradient as the reference."""
    from test_low_bit_zero12 import _model, _poisoned, _poisoned_block_is_cut, _reference_steps
    make, _ = CASES["adamw8bit"]
    reference, data = _model("adamw8bit"), batches(1, seed=5 + rank)
    working = _poisoned(copy.deepcopy(reference), rank)
    theirs = make(working.parameters())
    _reference_steps(working, working, theirs, data, world)
    found = {"nan": int(working.blocks[0].fc2.weight.isnan().sum())}
    for step_in_backward in (False, True):
        module = _poisoned(copy.deepcopy(reference), rank)
        path = os.path.join(directory, f"{step_in_backward}-rank{rank}")
        os.makedirs(path)
        model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                                  chunk_size=75776 * 4, offload_optimizer="disk", nvme_path=path, buffer_size=8192)
        optim = cm.ShardedOptimizerV2(model, make(module.parameters()), step_in_backward=step_in_backward)
        _train(model, optim, data)
        state = model.state_dict()
        found[step_in_backward] = {
            "cut": _poisoned_block_is_cut(model.chunks, module.blocks[0].fc2.weight, world),
            "differ": [n for n, p in working.named_parameters()
                       if not torch.equal(p.detach().nan_to_num(7.0), state[n].nan_to_num(7.0))]}
        ours, mine = optim.state_dict()["state"], theirs.state_dict()["state"]
        for index, entry in mine.items():
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = ours[index][key], entry[key]
                same = (torch.equal(a.codes, b.codes) and torch.equal(a.scale.nan_to_num(7.0), b.scale.nan_to_num(7.0))
                        if hasattr(b, "codes") else torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
                if not same:
                    found[step_in_backward]["differ"].append((index, key))
    return found


def test_a_nan_in_a_cut_block_on_disk_is_torchaos(tmp_path):
    """torchao's scale of a block holding a NaN is NaN: the agreement made once every chunk was streamed keeps it
    (gloo's MAX would drop it)."""
    for rank in run_ranks(_nan_worker, 2, str(tmp_path)):
        assert rank["nan"] == 1, rank
        for step_in_backward in (False, True):
            assert rank[step_in_backward]["cut"] and rank[step_in_backward]["differ"] == [], rank


def _drawing_on_one_rank_worker(rank, world, directory):
    """Rank 1 draws a random number between a backward (whose disk updates, written in place, drew the stochastic
    rounding's numbers) and the step."""
    make, dtype = CASES["adamw8bit-bf16-stochastic"]
    torch.manual_seed(0)
    reference = TinyGPT(d=64).to(dtype)
    data = batches(2, seed=5)
    model, optim = _on_disk(reference, make, dtype, world, directory, True, atomic_step=False)
    _train_seeded_before_backward(model, optim, data[:1])
    optim.backward(lm_loss(model(data[1]), data[1]))
    if rank == 1:
        torch.rand(3)
    found = {}
    for attempt in ("the step", "another step"):
        try:
            optim.step()
            found[attempt] = "stepped"
        except cm.UnsupportedOperationError as exc:
            found[attempt] = "on one rank at least" in str(exc) and "random generator" in str(exc)
    return found


def test_numbers_drawn_on_one_rank_after_a_backward_written_in_place_are_refused_on_every_rank(tmp_path):
    """The backward's updates (atomic_step=False) cannot be redone and one rank's generator moved before step():
    the ranks agree, so both raise and both refuse to step again (not one rank going on while the other is
    broken)."""
    for found in run_ranks(_drawing_on_one_rank_worker, 2, str(tmp_path)):
        assert found == {"the step": True, "another step": True}, found  # refused, and broken until a load
