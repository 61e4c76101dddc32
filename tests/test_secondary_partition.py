"""hpZ (``secondary_partition_size``): 4 gloo ranks, secondary partitions of 2. The backward gathers inside the
secondary group from the parts kept after the forward; the training is bitwise that of flat ZeRO-3 at 4 ranks
(same reductions, exact gathers), with the secondary bytes on the ledger between forward and backward."""
from __future__ import annotations

import pytest
import torch

import chunkmem as cm
from chunkmem.core.chunk import ParamBuffer
from chunkmem.core.tiers import Tier
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss, train


def _build(secondary, **extra):
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=torch.float32,
                              chunk_size=16384, secondary_partition_size=secondary, **extra)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), max_norm=0.5)
    return model, optim


def _run(rank: int, world: int) -> dict:
    data = [x[rank:rank + 1] for x in batches(3, batch=4, seed=5)]
    out = {}
    for secondary in (None, 2):
        model, optim = _build(secondary)
        losses = train(model, optim, data)
        x = data[0]
        loss = lm_loss(model(x), x)  # between forward and backward: the secondary parts are held
        held = model.runtime.ledger.tier_bytes(Tier.DEVICE, (ParamBuffer.SECONDARY,))
        optim.backward(loss)
        after = model.runtime.ledger.tier_bytes(Tier.DEVICE, (ParamBuffer.SECONDARY,))
        optim.zero_grad()
        out[secondary] = {"losses": losses, "state": model.state_dict(), "held": held, "after": after,
                          "chunk_bytes": [c.param.nbytes for c in model.chunks], "group": model.secondary_partition_size}
    everything, everything_optim = _build(2, quantized_weights=True, quantized_gradients=True)
    out["zero++"] = train(everything, everything_optim, data)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_run, 4)


def test_hpz_trains_bitwise_as_flat_zero3(ranks):
    for r in ranks:
        assert r[2]["losses"] == r[None]["losses"] and r[2]["group"] == 2 and r[None]["group"] == 1
        for key, value in r[None]["state"].items():
            assert torch.equal(r[2]["state"][key], value), key


def test_secondary_parts_live_from_forward_to_backward(ranks):
    for r in ranks:
        # every chunk's half, except what the forward left gathered (its last chunk still in use)
        assert 0 < r[2]["held"] <= sum(r[2]["chunk_bytes"]) // 2 and r[2]["after"] == 0
        assert r[None]["held"] == 0


def test_all_of_zero_plus_plus_trains(ranks):
    exact = torch.tensor([r[None]["losses"] for r in ranks]).mean(0)
    everything = torch.tensor([r["zero++"] for r in ranks]).mean(0)
    assert (everything - exact).abs().max() < 0.02 * exact.max()


def test_secondary_partition_size_is_checked():
    with pytest.raises(cm.InvalidArgumentError, match="secondary_partition_size=2.*'auto'"):
        cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="auto",
                          secondary_partition_size=2)
    with pytest.raises(cm.InvalidArgumentError, match="secondary_partition_size=2.*below it"):
        cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), secondary_partition_size=2)  # one process
    assert cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), secondary_partition_size=1).secondary_partition_size == 1
