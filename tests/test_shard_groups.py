"""Shard groups (MiCS, ``shard_group_size``): 4 gloo ranks split into 2 groups of 2 ("nodes").

References: one process training on the 4x batch (fp32, the tolerance of the 2-rank tests), the exact bytes a
flat 2-rank ZeRO-3 rank holds (each rank holds half of every chunk), and the checkpoint's own consolidated
state (a load elsewhere is bit for bit)."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import chunkmem as cm
from chunkmem.core.chunk import EXP_AVG, EXP_AVG_SQ, PARAM
from distributed import run_ranks
from models import TinyGPT, batches, train

STEPS, BATCH = 3, 8  # global batch 8: 2 rows a rank


def _reference() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT()


def _build(group_size: int | None, **extra):
    model = cm.ShardedModelV2(copy.deepcopy(_reference()), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32, chunk_size=16384, shard_group_size=group_size, **extra)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  max_norm=0.5)  # clipping: the norm sums over one shard group only
    return model, optim


def _mics_rank(rank: int, world: int, directory: str, overlap: int) -> dict:
    model, optim = _build(2, reductions_in_flight=overlap)
    share = BATCH // world
    losses = train(model, optim, [x[rank * share:(rank + 1) * share] for x in batches(STEPS, batch=BATCH, seed=1)])
    ledger = model.runtime.ledger
    held = {family: ledger.tier_bytes(cm.Tier.HOST, (family,)) for family in (PARAM, EXP_AVG, EXP_AVG_SQ)}
    expected = sum(c.numel for c in model.chunks) // 2 * 4  # half of every chunk, fp32
    state, optim_state = model.state_dict(), optim.state_dict()
    cm.save_checkpoint(directory, model, optim, sharded=True)
    first = next(iter(model.module.parameters()))
    with cm.GatheredParameters([first], modifier_rank=0), torch.no_grad():
        if rank == 0:
            first.add_(1.0)  # the other shard group's copy changes too
    return {"losses": losses, "held": held, "expected": expected, "state": state, "optimizer": optim_state,
            "groups": (model.shard_group_size, model.replicas.world, model.shards.rank, model.replicas.rank),
            "after_write": model.state_dict()}


@pytest.mark.parametrize("overlap", [0, 2], ids=["in-line", "overlapped"])
def test_two_groups_of_two_train_like_one_process_with_the_4x_batch(tmp_path, overlap):
    directory = str(tmp_path / "ckpt")
    ranks = run_ranks(_mics_rank, 4, directory, overlap)
    assert [r["groups"] for r in ranks] == [(2, 2, 0, 0), (2, 2, 1, 0), (2, 2, 0, 1), (2, 2, 1, 1)]
    one, one_optim = _build(None)
    losses = train(one, one_optim, batches(STEPS, batch=BATCH, seed=1))
    assert one_optim.global_grad_norm > 0.5  # clipping acted (a norm summed over both groups would differ)
    global_losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(global_losses, torch.tensor(losses, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    want = one.state_dict()
    for r in ranks:
        assert r["held"] == {PARAM: r["expected"], EXP_AVG: r["expected"], EXP_AVG_SQ: r["expected"]}
        for key, value in want.items():
            # the 4-way gradient sum reassociated, which Adam's normalisation amplifies where a gradient is near
            # zero (up to 2.2e-6 on an AVX2-only AMD EPYC); a wrong update would be off by about lr = 1e-2
            torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-5)
            assert torch.equal(r["state"][key], ranks[0]["state"][key]), key  # the groups agree bit for bit
            assert torch.equal(r["after_write"][key], ranks[0]["after_write"][key]), key
    first = next(iter(want))
    assert torch.equal(ranks[3]["after_write"][first], ranks[0]["state"][first] + 1.0)
    # one copy of the shards was written (2 rank files) and loads into one process bit for bit
    assert sorted(n for n in os.listdir(directory) if n.endswith(".pt")) == sorted(
        n for n in os.listdir(directory) if n.endswith(".pt") and "-of-2" in n) and len(os.listdir(directory)) == 3
    loaded, loaded_optim = _build(None)
    cm.load_checkpoint(directory, loaded, loaded_optim)
    for key, value in ranks[0]["state"].items():
        assert torch.equal(loaded.state_dict()[key], value), key
    for index, entry in ranks[0]["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded_optim.state_dict()["state"][index][key], value), (index, key)


def _refusals(rank: int, world: int) -> list[str]:
    messages = []
    for size in (3, 1):
        with pytest.raises(cm.InvalidArgumentError, match=r"shard_group_size=\d.*divisor >= 2 of the 4") as info:
            _build(size)
        messages.append(str(info.value))
    with pytest.raises(cm.InvalidArgumentError, match="persistence_threshold=100.*shard groups"):
        _build(2, persistence_threshold=100)
    return messages


def test_shard_group_sizes_that_do_not_divide_are_refused():
    run_ranks(_refusals, 4)
    model, _ = _build(1)  # one process: its one group
    assert model.shard_group_size == 1 and model.replicas is None
    with pytest.raises(cm.InvalidArgumentError, match="shard_group_size=0"):
        _build(0)


def _hierarchical_rank(rank: int, world: int) -> dict:
    from chunkmem.distributed.traffic import reset_traffic, traffic

    share = BATCH // world
    data = [x[rank * share:(rank + 1) * share] for x in batches(STEPS, batch=BATCH, seed=1)]
    out = {}
    for node_size in (None, 2):
        model, optim = _build(None, gather_node_size=node_size)
        reset_traffic()
        out[node_size] = {"losses": train(model, optim, data), "state": model.state_dict(),
                          "gathers": {k[2]: c.calls for k, c in traffic().items() if k[0] == "parameters"}}
    return out


def test_hierarchical_gather_over_two_nodes_gives_the_same_bits():
    ranks = run_ranks(_hierarchical_rank, 4)
    for r in ranks:
        assert r[2]["losses"] == r[None]["losses"]
        for key, value in r[None]["state"].items():
            assert torch.equal(r[2]["state"][key], value), key
        # every gather in two stages of 2 ranks (across the "nodes", then inside one), none over all 4
        assert set(r[2]["gathers"]) == {2} and set(r[None]["gathers"]) == {4}
        assert r[2]["gathers"][2] == 2 * r[None]["gathers"][4]
