"""Any torch optimizer in ShardedOptimizerV2 (chunkmem.optim.any_optimizer), against plain PyTorch:
SGD (momentum, Nesterov), RMSprop (centered, momentum), Adagrad, AdamW(amsgrad) and NAdam under the
placements, at 2 ranks against one process with the double batch, state dicts in torch's format both
ways, checkpoints, accessors, a 16-bit model against an fp32-master oracle, and what is refused."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from models import TinyGPT, batches, lm_loss

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1),
    "amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
}
FAMILIES = {"sgd": ["momentum_buffer"], "rmsprop": ["grad_avg", "momentum_buffer", "square_avg"],
            "adagrad": ["sum"], "amsgrad": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            "nadam": ["exp_avg", "exp_avg_sq"]}


def _wrap(reference, make, placement="cpu", dtype=torch.float32):
    """Built as chunkmem.initialize builds it: the optimizer over the plain module, then the wrapping
    (an optimizer that reads its parameters when built, as Adagrad does, cannot read sharded ones)."""
    module = copy.deepcopy(reference)
    optimizer = make(module.parameters())
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=placement, dtype=dtype,
                              chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, optimizer)
    assert not optimizer.state  # Adagrad's own sums are dropped: the chunks hold the state
    return model, optim


def _train(model, optim, data):
    for x in data:
        optim.backward(lm_loss(model(x), x))
        optim.step()


def _plain(reference, make, data):
    plain = copy.deepcopy(reference)
    optim = make(plain.parameters())
    for x in data:
        lm_loss(plain(x), x).backward()
        optim.step()
        optim.zero_grad()
    return plain, optim


def _assert_equal(model, plain):
    state = model.state_dict()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("placement", ["cpu", "cuda", "auto"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_plain_pytorch_and_keeps_its_state_in_chunk_families(name, placement):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=5)
    plain, _ = _plain(reference, OPTIMIZERS[name], data)
    model, optim = _wrap(reference, OPTIMIZERS[name], placement)
    _train(model, optim, data)
    _assert_equal(model, plain)
    if placement == "cpu":
        trainable = [c for c in model.chunks if c.trainable]
        host = model.tier_bytes()["host"]
        for family in FAMILIES[name]:  # counted exactly: one fp32 shard per trainable chunk
            assert host[family] == sum(4 * c.shard_numel for c in trainable), family
        assert sorted(set(host) - {"param"}) == FAMILIES[name]


@pytest.mark.parametrize("name", ["sgd", "adagrad", "amsgrad"])
def test_state_dict_is_torchs_both_ways_and_checkpoints_resume(tmp_path, name):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(4, seed=6)
    make = OPTIMIZERS[name]
    plain, plain_optim = _plain(reference, make, data[:2])
    model, optim = _wrap(reference, make)
    _train(model, optim, data[:2])
    ours, theirs = optim.state_dict(), plain_optim.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        assert set(ours["state"][index]) == set(entry)
        for key, value in entry.items():
            torch.testing.assert_close(torch.as_tensor(ours["state"][index][key]), torch.as_tensor(value), rtol=0, atol=0)
    cm.save_checkpoint(tmp_path / "ck.pt", model, optim)

    plain_from_ours = copy.deepcopy(reference)  # chunkmem's state dicts load into plain PyTorch
    plain_from_ours.load_state_dict(model.state_dict())
    loaded = make(plain_from_ours.parameters())
    loaded.load_state_dict(ours)
    resumed, resumed_optim = _wrap(reference, make)  # and the checkpoint into a fresh chunkmem
    cm.load_checkpoint(tmp_path / "ck.pt", resumed, resumed_optim)
    from_plain, from_plain_optim = _wrap(plain, make)  # and torch's state dict too
    from_plain_optim.load_state_dict(theirs)
    for x in data[2:]:
        lm_loss(plain(x), x).backward()
        plain_optim.step()
        plain_optim.zero_grad()
        lm_loss(plain_from_ours(x), x).backward()
        loaded.step()
        loaded.zero_grad()
    _train(model, optim, data[2:])
    _train(resumed, resumed_optim, data[2:])
    _train(from_plain, from_plain_optim, data[2:])
    for other in (model, resumed, from_plain):
        _assert_equal(other, plain)
    for p, q in zip(plain.parameters(), plain_from_ours.parameters()):
        assert torch.equal(p, q)


def test_accessors_read_and_write_the_optimizers_own_state():
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(2, seed=7)
    plain, plain_optim = _plain(reference, OPTIMIZERS["sgd"], data)
    model, optim = _wrap(reference, OPTIMIZERS["sgd"])
    _train(model, optim, data)
    for (name, p), want in zip(model.module.named_parameters(), plain.parameters()):
        got = cm.utils.safe_get_full_optimizer_state(p, "momentum_buffer")
        torch.testing.assert_close(got, plain_optim.state[want]["momentum_buffer"], rtol=1e-6, atol=1e-7, msg=name)
    p = next(model.module.parameters())
    cm.utils.safe_set_full_optimizer_state(p, torch.zeros_like(p, dtype=torch.float32), "momentum_buffer")
    assert cm.utils.safe_get_full_optimizer_state(p, "momentum_buffer").abs().sum() == 0
    with pytest.raises(cm.InvalidArgumentError) as caught:
        cm.utils.safe_get_full_optimizer_state(p, "exp_avg")
    assert caught.value.argument == "optim_state_key" and "momentum_buffer" in str(caught.value)


def test_a_16bit_model_steps_its_fp32_masters_with_the_optimizers_own_math():
    torch.manual_seed(0)
    data = batches(2, seed=8)
    model, optim = _wrap(TinyGPT(), OPTIMIZERS["rmsprop"], "cpu", torch.bfloat16)
    params = list(model.module.parameters())
    oracle = [cm.utils.safe_get_full_fp32_param(p).clone() for p in params]
    oracle_optim = OPTIMIZERS["rmsprop"](oracle)
    for x in data:
        optim.backward(lm_loss(model(x), x))
        for o, p in zip(oracle, params):
            o.grad = cm.utils.safe_get_full_grad(p)  # the bf16 gradient, widened
        optim.step()
        oracle_optim.step()
    for o, p in zip(oracle, params):
        master = cm.utils.safe_get_full_fp32_param(p)
        torch.testing.assert_close(master, o, rtol=1e-6, atol=1e-7)
        with cm.GatheredParameters([p]):
            assert torch.equal(p.detach(), master.to(torch.bfloat16))  # the 16-bit copy is the master's rounding


def _two_rank_worker(rank: int, world: int, name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, batch=4, seed=9)
    model, optim = _wrap(reference, OPTIMIZERS[name])
    for x in data:
        part = x[2 * rank:2 * rank + 2]
        optim.backward(lm_loss(model(part), part))
        optim.step()
    state = model.state_dict()
    return [state[n] for n, _ in reference.named_parameters()]


@pytest.mark.parametrize("name", ["sgd", "adagrad", "nadam"])
def test_two_ranks_equal_one_process_with_the_double_batch(name):
    from distributed import run_ranks
    ranks = run_ranks(_two_rank_worker, 2, name)
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, batch=4, seed=9)
    model, optim = _wrap(reference, OPTIMIZERS[name])
    _train(model, optim, data)
    state = model.state_dict()
    for result in ranks:
        for (n, _), got in zip(reference.named_parameters(), result):
            torch.testing.assert_close(got, state[n], rtol=1e-5, atol=1e-6, msg=n)


class ScaledSGD(torch.optim.SGD):
    """A subclass: its step might read a whole parameter, so it is not stepped on pieces."""


def _refused_when_sharded(rank: int, world: int) -> list[str]:
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    plain = TinyGPT()
    said = []
    for wrap in (lambda: cm.ShardedOptimizerV2(model, ScaledSGD(model.parameters(), lr=0.1)),
                 lambda: cm.LowLevelZeroOptimizer(ScaledSGD(plain.parameters(), lr=0.1)),
                 lambda: cm.ShardedOptimizerV2(model, torch.optim.Adafactor(model.parameters()))):
        try:
            wrap()
            said.append("accepted")
        except cm.InvalidArgumentError as e:
            said.append(f"{e.argument}: {e}")
    assert not any(hasattr(p, "_low_level_zero") for p in plain.parameters())  # nothing changed
    return said


def _refused_on_one_rank(rank: int, world: int) -> list[str]:
    """Rank 0 wraps an optimizer refused with several ranks, rank 1 an accepted one: rank 0 raises its
    refusal, rank 1 the ranks' disagreement naming it (neither waits for the other)."""
    said = []
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    plain = TinyGPT()
    make = ScaledSGD if rank == 0 else torch.optim.SGD
    for wrap in (lambda: cm.ShardedOptimizerV2(model, make(model.parameters(), lr=0.1)),
                 lambda: cm.LowLevelZeroOptimizer(make(plain.parameters(), lr=0.1))):
        try:
            wrap()
            said.append("accepted")
        except cm.ChunkmemError as e:
            said.append(f"{type(e).__name__}: {e}")
    return said


def test_a_rank_that_refuses_its_optimizer_does_not_leave_the_others_waiting():
    from distributed import run_ranks
    rank0, rank1 = run_ranks(_refused_on_one_rank, 2)
    assert all(s.startswith("InvalidArgumentError: optimizer='ScaledSGD'") for s in rank0)
    for said in rank1:
        assert said.startswith("LayoutMismatchError") and "refused: InvalidArgumentError: optimizer='ScaledSGD'" in said


def test_what_cannot_be_stepped_is_refused_before_anything_changes(tmp_path):
    from distributed import run_ranks
    for sharded, zero12, adafactor in run_ranks(_refused_when_sharded, 2):
        assert sharded.startswith("optimizer:") and "sharded" in sharded
        assert adafactor.startswith("optimizer:") and "Adafactor may read a whole parameter" in adafactor
        assert zero12.startswith("optimizer:") and "several data-parallel ranks" in zero12
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32)
    before = model.tier_bytes()
    with pytest.raises(cm.InvalidArgumentError, match="closure") as caught:
        cm.ShardedOptimizerV2(model, torch.optim.LBFGS(model.parameters()))
    assert caught.value.argument == "optimizer" and model.tier_bytes() == before and not model.optimizer_attached
    optim = cm.ShardedOptimizerV2(model, ScaledSGD(model.parameters(), lr=0.1, momentum=0.9))  # one process: fine
    assert optim.state_layout.families == ("momentum_buffer",)
    disk = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                             offload_optimizer="disk", nvme_path=str(tmp_path))
    for refused in (ScaledSGD(disk.parameters(), lr=0.1), torch.optim.Adafactor(disk.parameters())):
        with pytest.raises(cm.InvalidArgumentError, match="disk tier") as caught:
            cm.ShardedOptimizerV2(disk, refused)
        assert caught.value.argument == "optimizer" and not disk.optimizer_attached


PIECE = 8192  # bytes of the disk tier's I/O buffers: pieces cut parameters and chunks


def _wrap_on_disk(reference, make, path, dtype=torch.float32, step_in_backward=None, **extra):
    module = copy.deepcopy(reference)
    optimizer = make(module.parameters())
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy=extra.pop("policy", "cpu"),
                              dtype=dtype, chunk_size=16384, offload_optimizer="disk", nvme_path=str(path),
                              buffer_size=PIECE, **extra)
    if step_in_backward is None:  # NAdam: its updates overlap the backward
        step_in_backward = make is OPTIMIZERS["nadam"] and "offload_param" not in extra
    return model, cm.ShardedOptimizerV2(model, optimizer, step_in_backward=step_in_backward)


def _same(model, optim, other, other_optim):
    for key, value in model.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key
    mine, theirs = optim.state_dict()["state"], other_optim.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for index, entry in mine.items():
        assert entry.keys() == theirs[index].keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[index][key])), (index, key)


@pytest.mark.parametrize("name,dtype,extra", [
    ("sgd", torch.float32, {}), ("rmsprop", torch.float32, {}), ("adagrad", torch.bfloat16, {}),
    ("amsgrad", torch.float32, {"offload_param": "disk"}), ("nadam", torch.bfloat16, {}),
    ("rmsprop", torch.bfloat16, {"policy": "auto"})], ids=str)
def test_on_the_disk_tier_equals_host_state_bitwise(tmp_path, name, dtype, extra):
    """The streamed disk step (pieces smaller than a parameter; NAdam with step_in_backward) gives the
    same bits as the same optimizer with its state on the host, which equals plain PyTorch (above)."""
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(3, seed=5)
    host, host_optim = _wrap(reference, OPTIMIZERS[name], "cpu", dtype)
    disk, disk_optim = _wrap_on_disk(reference, OPTIMIZERS[name], tmp_path, dtype, **extra)
    _train(host, host_optim, data)
    _train(disk, disk_optim, data)
    _same(host, host_optim, disk, disk_optim)
    trainable = [c for c in disk.chunks if c.trainable]
    on_disk = disk.tier_bytes()["disk"]
    for family in FAMILIES[name]:  # counted exactly: one fp32 shard per chunk whose state rests on disk
        resting = [c for c in trainable if disk.runtime.optim_tier(c) is cm.Tier.DISK]
        assert resting and on_disk[family] == sum(4 * c.shard_numel for c in resting), family
    assert disk_optim.get_memory_usage(with_disk=True)[2] >= len(FAMILIES[name]) * 4 * trainable[0].shard_numel
    if name == "sgd":
        plain, _ = _plain(reference, OPTIMIZERS[name], data)
        _assert_equal(disk, plain)


def test_a_failed_disk_step_is_undone_scalar_state_included(tmp_path):
    import errno
    from chunkmem.storage.disk_io import inject_faults
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(3, seed=5)
    host, host_optim = _wrap(reference, OPTIMIZERS["nadam"])
    disk, disk_optim = _wrap_on_disk(reference, OPTIMIZERS["nadam"], tmp_path, step_in_backward=False)
    _train(host, host_optim, data[:2])
    _train(disk, disk_optim, data[:2])
    before = copy.deepcopy(disk_optim.state_dict())
    with inject_faults(write_errno=errno.ENOSPC, what="chunk2."):
        disk_optim.backward(lm_loss(disk(data[2]), data[2]))
        with pytest.raises(cm.DiskStepError, match="undone"):
            disk_optim.step()
    after = disk_optim.state_dict()
    for index, entry in before["state"].items():  # NAdam's step and mu_product too
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][index][key])), (index, key)
    assert disk_optim.step()  # the kept gradients
    _train(host, host_optim, data[2:])
    _same(host, host_optim, disk, disk_optim)


def _disk_two_rank_worker(rank: int, world: int, path: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    reference = TinyGPT()
    model, optim = _wrap_on_disk(reference, OPTIMIZERS["adagrad"], path)
    for x in batches(3, batch=4, seed=9):
        part = x[2 * rank:2 * rank + 2]
        optim.backward(lm_loss(model(part), part))
        optim.step()
    state = model.state_dict()
    return [state[n] for n, _ in reference.named_parameters()]


def test_two_ranks_on_the_disk_tier_equal_one_process_with_the_double_batch(tmp_path):
    from distributed import run_ranks
    ranks = run_ranks(_disk_two_rank_worker, 2, str(tmp_path))
    torch.manual_seed(0)
    reference = TinyGPT()
    plain, _ = _plain(reference, OPTIMIZERS["adagrad"], batches(3, batch=4, seed=9))
    for result in ranks:
        for (n, p), got in zip(plain.named_parameters(), result):
            torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-6, msg=n)


# ---- LowLevelZeroOptimizer (ZeRO-1/2) -----------------------------------------------------------------

def _zero12(reference, make, **kwargs):
    module = copy.deepcopy(reference)
    return module, cm.LowLevelZeroOptimizer(make(module.parameters()), **kwargs)


def _train_zero12(module, optim, data, rank=0, world=1):
    for x in data:
        part = x[rank * len(x) // world:(rank + 1) * len(x) // world]
        optim.backward(lm_loss(module(part), part))
        optim.step()


@pytest.mark.parametrize("name,kwargs", [
    ("sgd", {}), ("rmsprop", {"partition_grad": True}), ("adagrad", {"cpu_offload": True}),
    ("amsgrad", {"partition_grad": True, "cpu_offload": True}), ("nadam", {})], ids=str)
def test_zero12_equals_plain_pytorch(name, kwargs):
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(4, seed=5)
    plain, plain_optim = _plain(reference, OPTIMIZERS[name], data)
    module, optim = _zero12(reference, OPTIMIZERS[name], **kwargs)
    assert optim.state_layout.families == tuple(FAMILIES[name]) or sorted(optim.state_layout.families) == FAMILIES[name]
    _train_zero12(module, optim, data)
    for (n, p), q in zip(plain.named_parameters(), module.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7, msg=n)
    bytes_ = optim.model_state_bytes()
    assert all(bytes_[f] == sum(4 * c.shard_numel for c in optim.chunks) for f in FAMILIES[name])
    mine, theirs = optim.state_dict(), plain_optim.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert mine["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(torch.as_tensor(mine["state"][index][key]), torch.as_tensor(value),
                                       rtol=1e-6, atol=1e-7, msg=f"{index} {key}")


def test_zero12_state_dicts_load_both_ways_and_checkpoints_resume(tmp_path):
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(4, seed=6)
    make = OPTIMIZERS["rmsprop"]
    full, full_optim = _zero12(reference, make, partition_grad=True)
    _train_zero12(full, full_optim, data)
    half, half_optim = _zero12(reference, make, partition_grad=True)
    _train_zero12(half, half_optim, data[:2])
    cm.save_checkpoint(tmp_path / "ck.pt", half, half_optim)
    resumed, resumed_optim = _zero12(TinyGPT(), make, partition_grad=True)
    cm.load_checkpoint(tmp_path / "ck.pt", resumed, resumed_optim)
    _train_zero12(resumed, resumed_optim, data[2:])
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    # into a plain RMSprop and back: the same next step
    plain = copy.deepcopy(half)
    plain_optim = make(plain.parameters())
    plain_optim.load_state_dict(half_optim.state_dict())
    for x in data[2:]:
        lm_loss(plain(x), x).backward()
        plain_optim.step()
        plain_optim.zero_grad()
    back, back_optim = _zero12(half, make)
    back_optim.load_state_dict(plain_optim.state_dict())
    assert cm.utils.safe_get_full_optimizer_state(next(back.parameters()), "square_avg") is not None
    _train_zero12(half, half_optim, data[2:])
    for p, q in zip(plain.parameters(), half.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(cm.InvalidArgumentError, match="momentum_buffer"):
        bad = plain_optim.state_dict()
        del bad["state"][0]["momentum_buffer"]
        back_optim.load_state_dict(bad)


def _zero12_two_rank_worker(rank: int, world: int, name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    reference = TinyGPT()
    module, optim = _zero12(reference, OPTIMIZERS[name], partition_grad=name == "adagrad")
    _train_zero12(module, optim, batches(3, batch=4, seed=9), rank, world)
    state = optim.state_dict()
    return [p.detach().clone() for p in module.parameters()] + [state["state"][0][FAMILIES[name][0]]]


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_zero12_two_ranks_equal_one_process_with_the_double_batch(name):
    from distributed import run_ranks
    ranks = run_ranks(_zero12_two_rank_worker, 2, name)
    torch.manual_seed(0)
    reference = TinyGPT()
    plain, plain_optim = _plain(reference, OPTIMIZERS[name], batches(3, batch=4, seed=9))
    expected = [p.detach() for p in plain.parameters()] + [plain_optim.state_dict()["state"][0][FAMILIES[name][0]]]
    for result in ranks:
        for want, got in zip(expected, result):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- whole-parameter state: Adafactor in one process ---------------------------------------------------

def _adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.01)


@pytest.mark.parametrize("placement", ["cpu", "cuda", "auto"])
def test_adafactor_equals_plain_pytorch_in_one_process(tmp_path, placement):
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(4, seed=5)
    plain, plain_optim = _plain(reference, _adafactor, data)
    model, optim = _wrap(reference, _adafactor, placement)
    assert optim.state_layout.whole and optim.state_layout.families == ()
    _train(model, optim, data)
    _assert_equal(model, plain)
    mine, theirs = optim.state_dict()["state"], plain_optim.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for index, entry in theirs.items():  # row_var / col_var of matrices, variance of vectors, step
        assert mine[index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(mine[index][key], value, rtol=1e-6, atol=1e-7, msg=f"{index} {key}")
    if placement != "cpu":
        return
    # a checkpoint resumes it, and torch's state dict loads into it
    half, half_optim = _wrap(reference, _adafactor)
    _train(half, half_optim, data[:2])
    cm.save_checkpoint(tmp_path / "ck.pt", half, half_optim)
    resumed, resumed_optim = _wrap(TinyGPT(), _adafactor)
    cm.load_checkpoint(tmp_path / "ck.pt", resumed, resumed_optim)
    _train(resumed, resumed_optim, data[2:])
    _assert_equal(resumed, plain)
    loaded, loaded_optim = _wrap(reference, _adafactor)
    torch_half, torch_half_optim = _plain(reference, _adafactor, data[:2])
    loaded.load_state_dict(torch_half.state_dict())
    loaded_optim.load_state_dict(torch_half_optim.state_dict())
    _train(loaded, loaded_optim, data[2:])
    _assert_equal(loaded, plain)


def test_adafactor_in_zero12_one_process_equals_plain_pytorch():
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(3, seed=5)
    plain, plain_optim = _plain(reference, _adafactor, data)
    module, optim = _zero12(reference, _adafactor, cpu_offload=True)
    _train_zero12(module, optim, data)
    for (n, p), q in zip(plain.named_parameters(), module.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7, msg=n)
    back = _zero12(reference, _adafactor)[1]
    back.load_state_dict(plain_optim.state_dict())
    for index, entry in plain_optim.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(back.state_dict()["state"][index][key], value)


@pytest.mark.parametrize("name", ["rmsprop", "nadam", "adafactor"])
def test_sharded_checkpoints_resume_bitwise_and_consolidate_to_torchs_state_dict(tmp_path, name):
    make = _adafactor if name == "adafactor" else OPTIMIZERS[name]
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(4, seed=7)
    full, full_optim = _wrap(reference, make)
    _train(full, full_optim, data)
    half, half_optim = _wrap(reference, make)
    _train(half, half_optim, data[:2])
    cm.save_checkpoint(tmp_path / "ck", half, half_optim, sharded=True)
    consolidated = cm.consolidate_checkpoint(tmp_path / "ck")["optimizer"]
    expected = half_optim.state_dict()
    assert consolidated["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert consolidated["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(consolidated["state"][index][key]), torch.as_tensor(value)), (index, key)
    resumed, resumed_optim = _wrap(TinyGPT(), make)
    cm.load_checkpoint(tmp_path / "ck", resumed, resumed_optim)
    _train(resumed, resumed_optim, data[2:])
    _same(full, full_optim, resumed, resumed_optim)
    other, other_optim = _wrap(reference, OPTIMIZERS["sgd"])  # another optimizer's families: refused, unchanged
    with pytest.raises(cm.InvalidArgumentError, match="one optimizer class"):
        cm.load_checkpoint(tmp_path / "ck", other, other_optim)
    adam, adam_optim = _wrap(reference, lambda p: torch.optim.AdamW(p, lr=1e-3))
    with pytest.raises(cm.InvalidArgumentError, match="one optimizer class|betas"):
        cm.load_checkpoint(tmp_path / "ck", adam, adam_optim)


def _sharded_checkpoint_worker(rank: int, world: int, path: str) -> bool:
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(4, batch=4, seed=9)

    def train(model, optim, steps):
        for x in steps:
            part = x[2 * rank:2 * rank + 2]
            optim.backward(lm_loss(model(part), part))
            optim.step()
    full, full_optim = _wrap_on_disk(reference, OPTIMIZERS["adagrad"], path)
    train(full, full_optim, data)
    half, half_optim = _wrap_on_disk(reference, OPTIMIZERS["adagrad"], path)
    train(half, half_optim, data[:2])
    cm.save_checkpoint(f"{path}/ck", half, half_optim, sharded=True)
    resumed, resumed_optim = _wrap(TinyGPT(), OPTIMIZERS["adagrad"])
    cm.load_checkpoint(f"{path}/ck", resumed, resumed_optim)
    train(resumed, resumed_optim, data[2:])
    _same(full, full_optim, resumed, resumed_optim)
    return True


def test_two_rank_sharded_checkpoint_from_the_disk_tier_resumes_on_the_host_bitwise(tmp_path):
    from distributed import run_ranks
    assert run_ranks(_sharded_checkpoint_worker, 2, str(tmp_path)) == [True, True]


@pytest.mark.parametrize("field,edit,error", [
    ("state", lambda e: e.pop("state"), cm.InvalidArgumentError),  # then it reads as Adam's: refused
    ("scalars", lambda e: e.update(slot_scalars=[1]), cm.CheckpointError),
    ("scalars", lambda e: e["slot_scalars"].update({0: 5}), cm.CheckpointError),
    ("scalars", lambda e: e["slot_scalars"][0].update(step=torch.empty(1, device="meta")), cm.InvalidArgumentError),
])
def test_a_damaged_sharded_rank_file_of_another_optimizer_is_refused_before_anything_changes(tmp_path, field, edit,
                                                                                              error):
    from test_checkpoint_integrity import edit_rank_file
    torch.manual_seed(0)
    reference, data = TinyGPT(), batches(2, seed=7)
    model, optim = _wrap(reference, OPTIMIZERS["nadam"])
    _train(model, optim, data)
    cm.save_checkpoint(tmp_path / "ck", model, optim, sharded=True)
    edit_rank_file(str(tmp_path / "ck"), lambda payload: edit(payload["model"]["chunks"][0]))
    fresh, fresh_optim = _wrap(reference, OPTIMIZERS["nadam"])
    before = copy.deepcopy(fresh_optim.state_dict()), copy.deepcopy(fresh.state_dict())
    with pytest.raises(error, match=field):
        cm.load_checkpoint(tmp_path / "ck", fresh, fresh_optim)
    assert fresh_optim.state_dict()["state"] == before[0]["state"] == {}
    assert all(torch.equal(v, before[1][k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("wrapper", ["ShardedOptimizerV2", "LowLevelZeroOptimizer"])
def test_momentum_switched_on_after_wrapping_is_refused_not_shared(wrapper):
    """SGD built with momentum 0 keeps no per-element state; a schedule that switches momentum on (OneCycleLR's
    cycle_momentum) makes it keep a buffer per parameter. Before 2026-11-27 that buffer was kept as one value per
    param group (8% off torch, or a shape error); now the step refuses, with nothing changed."""
    torch.manual_seed(0)
    reference = TinyGPT()
    x = batches(2)[0]
    if wrapper == "ShardedOptimizerV2":
        model = cm.ShardedModelV2(copy.deepcopy(reference), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=16384)
        optim = cm.ShardedOptimizerV2(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0))
    else:
        model = copy.deepcopy(reference)
        optim = cm.LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0))
    optim.backward(lm_loss(model(x), x))
    optim.step()
    optim.zero_grad()
    optim.param_groups[0]["lr"] = 0.05  # another value of a setting that keeps the same state: fine
    optim.backward(lm_loss(model(x), x))
    optim.step()
    optim.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim.param_groups[0]["momentum"] = 0.9
    optim.backward(lm_loss(model(x), x))
    with pytest.raises(cm.UnsupportedOperationError, match="momentum_buffer.*build .* with the setting"):
        optim.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
