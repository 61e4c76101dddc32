"""Sharded checkpoints that load at another world size or chunk layout (``chunkmem.io.resharding``).

The reference for every loaded value is the checkpoint itself: ``consolidate_checkpoint`` assembles the full
state dicts from the rank files (what ``model.state_dict()`` and ``optimizer.state_dict()`` gave when it was
saved, checked against a full checkpoint in test_checkpoint.py); a load at any world size must give them bit
for bit (fp32 masters and both moments). Training then continues at the new world size, compared with the
continuation at the world size that saved (the same global batch, split over the ranks: losses equal up to the
order of the sums).
"""
from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

import chunkmem as cm
from distributed import run_ranks
from models import TinyGPT, batches, train
from test_checkpoint import assert_same_optimizer_state, assert_same_state

K = 2  # steps before the save and after the load
BATCH = 12  # divides among 1, 2, 3 and 4 ranks


def _reference(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT()


def _build(dtype: torch.dtype, disk: str | None, seed: int = 0, chunk_size: int = 16384):
    extra = {} if disk is None else dict(offload_optimizer="disk", nvme_path=disk, buffer_size=8192)
    model = cm.ShardedModelV2(copy.deepcopy(_reference(seed)), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=dtype, chunk_size=chunk_size, **extra)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**10)
    return model, optim


def _split(data: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    share = BATCH // world
    return [x[rank * share:(rank + 1) * share] for x in data]


def _disk_dir(disk: str | None, rank: int) -> str | None:
    if disk is None:
        return None
    os.makedirs(os.path.join(disk, f"rank{rank}"), exist_ok=True)
    return os.path.join(disk, f"rank{rank}")


def _save_at(rank: int, world: int, directory: str, dtype: torch.dtype, disk: str | None) -> None:
    model, optim = _build(dtype, _disk_dir(disk, rank))
    train(model, optim, _split(batches(K, batch=BATCH, seed=1), rank, world))
    cm.save_checkpoint(directory, model, optim, sharded=True)


def _load_at(rank: int, world: int, directory: str, dtype: torch.dtype, disk: str | None,
             elastic: bool = True) -> tuple:
    model, optim = _build(dtype, _disk_dir(disk, rank), seed=5)  # other values: the load sets them all
    cm.load_checkpoint(directory, model, optim, elastic=elastic)
    loaded = (model.state_dict(), optim.state_dict(), None)
    losses = train(model, optim, _split(batches(K, batch=BATCH, seed=2), rank, world))
    return (*loaded, losses)


def _at(world: int, fn, *args) -> list:
    """``fn`` on ``world`` gloo ranks, or in this process for one."""
    return [fn(0, 1, *args)] if world == 1 else run_ranks(fn, world, *args)


def _global_losses(results: list) -> torch.Tensor:
    """The loss of the global batch at each step: the mean of the ranks' equal shares."""
    return torch.tensor([r[3] for r in results], dtype=torch.float64).mean(0)


DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _save_each_dtype(rank: int, world: int, directory: str) -> None:
    """fp32's and fp16's checkpoints in one group of ranks (two directories): one spawn for both."""
    for name, dtype in DTYPES.items():
        _save_at(rank, world, os.path.join(directory, name), dtype, None)


def _load_each_dtype(rank: int, world: int, directory: str) -> dict:
    return {name: _load_at(rank, world, os.path.join(directory, name), dtype, None) for name, dtype in DTYPES.items()}


def test_saved_at_two_ranks_loads_at_one_three_and_four(tmp_path):
    """fp32 and fp16, each saved and loaded on its own: the two share each world size's spawn."""
    directory = str(tmp_path / "ckpt")
    _at(2, _save_each_dtype, directory)
    saved = {name: cm.consolidate_checkpoint(os.path.join(directory, name)) for name in DTYPES}
    at_saving_size = _at(2, _load_each_dtype, directory)
    for world in (1, 3, 4):
        results = _at(world, _load_each_dtype, directory)
        for name, dtype in DTYPES.items():
            for state, optim_state, shard_numels, _ in (r[name] for r in results):
                assert_same_state(state, saved[name]["model"])
                assert_same_optimizer_state(optim_state, saved[name]["optimizer"])
            tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-3)
            torch.testing.assert_close(_global_losses([r[name] for r in results]),
                                       _global_losses([r[name] for r in at_saving_size]), **tolerance)


def test_saved_at_one_rank_loads_at_two_with_optimizer_state_on_disk(tmp_path):
    directory = str(tmp_path / "ckpt")
    _at(1, _save_at, directory, torch.float32, str(tmp_path / "disk-save"))
    saved = cm.consolidate_checkpoint(directory)
    at_saving_size = _at(1, _load_at, directory, torch.float32, str(tmp_path / "disk-1"))
    results = _at(2, _load_at, directory, torch.float32, str(tmp_path / "disk-2"))
    for state, optim_state, _, _ in results + at_saving_size:
        assert_same_state(state, saved["model"])
        assert_same_optimizer_state(optim_state, saved["optimizer"])
    torch.testing.assert_close(_global_losses(results), _global_losses(at_saving_size), rtol=1e-5, atol=1e-6)


def test_another_chunk_size_at_one_rank_loads_bitwise_and_trains_identically(tmp_path):
    data = batches(2 * K, batch=4, seed=3)
    model, optim = _build(torch.float16, None)
    train(model, optim, data[:K])
    cm.save_checkpoint(tmp_path / "ckpt", model, optim, sharded=True)
    other, other_optim = _build(torch.float16, None, seed=5, chunk_size=8192)
    assert len(other.chunks) != len(model.chunks)
    cm.load_checkpoint(tmp_path / "ckpt", other, other_optim)
    assert_same_state(other.state_dict(), model.state_dict())
    assert_same_optimizer_state(other_optim.state_dict(), optim.state_dict())
    # the same per-element arithmetic in other chunks: bitwise the same run
    assert train(other, other_optim, data[K:]) == train(model, optim, data[K:])
    assert_same_state(other.state_dict(), model.state_dict())


def _refusals(rank: int, world: int, directory: str) -> list[str]:
    messages = []
    model, optim = _build(torch.float32, None, seed=5)
    before = model.state_dict()
    with pytest.raises(cm.InvalidArgumentError, match=r"saved by 2 ranks.*saved by 1; elastic=False") as info:
        cm.load_checkpoint(directory, model, optim, elastic=False)
    messages.append(str(info.value))
    with pytest.raises(cm.ChunkmemError) as info:  # rank 0 verifies the damaged file; both refuse
        cm.load_checkpoint(directory + "-damaged", model, optim)
    messages.append(str(info.value))
    assert_same_state(model.state_dict(), before)
    return messages


def test_refusals_change_nothing(tmp_path):
    directory = str(tmp_path / "ckpt")
    _at(1, _save_at, directory, torch.float32, None)
    damaged = directory + "-damaged"
    shutil.copytree(directory, damaged)
    rank_file = next(os.path.join(damaged, n) for n in os.listdir(damaged) if n.endswith(".pt"))
    payload = torch.load(rank_file, weights_only=True)
    payload["model"]["chunks"][0]["param"][3] += 1  # a changed value in a well-formed file: only the checksum tells
    torch.save(payload, rank_file)
    messages = run_ranks(_refusals, 2, directory)
    assert "damaged" in messages[0][1] or "checksum" in messages[0][1], messages[0][1]
    assert "failed on rank 0" in messages[1][1], messages[1][1]  # rank 0 (of 2) verifies file 0

    model, optim = _build(torch.float32, None, seed=5)
    with pytest.raises(cm.ArgumentTypeError, match="elastic"):
        cm.load_checkpoint(directory, model, optim, elastic="yes")
    wider = cm.ShardedModelV2(TinyGPT(d=48), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32)
    with pytest.raises(cm.InvalidArgumentError, match=r"'wte.weight'.*shape \[64, 32\].*shape \[64, 48\]"):
        cm.load_checkpoint(directory, wider)
    half = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float16)
    with pytest.raises(cm.InvalidArgumentError, match="dtype float16.*dtype float32, the sharded checkpoint's"):
        cm.load_checkpoint(directory, half)
