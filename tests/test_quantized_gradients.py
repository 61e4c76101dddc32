"""Quantized gradient reduction (``quantized_gradients``, ZeRO++'s qgZ): the int8 blocks and their error
bound, against the exact mean over 2 gloo ranks; an overflow still reaches the loss scaler; training stays
within the documented distance of the unquantized run."""
from __future__ import annotations

import pytest
import torch

import chunkmem as cm
from chunkmem.distributed import quantization as q
from chunkmem.distributed.collectives import ShardGroup
from chunkmem.distributed.reduction import GradientReduction
from distributed import run_ranks
from models import TinyGPT, batches, train


def _half_scales(rows: torch.Tensor) -> torch.Tensor:
    """Each element's bound: half of its block's scale (max |x| / 254)."""
    _, scales = q.quantize(rows)
    return (scales / 2).repeat_interleave(q.BLOCK, dim=1)[:, :rows.shape[1]]


def test_blocks_round_trip_within_half_a_scale():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 5000, generator=g) * torch.tensor([[1e-4], [1.0], [1e3]])
    rows[1, 2048:4096] = 0.0  # an all-zero block
    values, scales = q.quantize(rows)
    assert values.dtype == torch.int8 and scales.shape == (3, 3)
    back = q.dequantize(*q.unpack(q.pack(values, scales), 5000))
    assert q.pack(values, scales).shape == (3, q.packed_numel(5000)) == (3, 5000 + 12)
    assert torch.all((back - rows).abs() <= _half_scales(rows) * (1 + 1e-6))
    assert torch.equal(back[1, 2048:4096], torch.zeros(2048))


def test_a_block_with_inf_or_nan_comes_back_nan():
    rows = torch.ones(2, 4096)
    rows[0, 5] = float("inf")
    rows[1, 3000] = float("nan")
    back = q.dequantize(*q.quantize(rows))
    assert torch.isnan(back[0, :2048]).all() and torch.equal(back[0, 2048:], torch.ones(2048))
    assert torch.isnan(back[1, 2048:]).all() and torch.equal(back[1, :2048], torch.ones(2048))


def _reduce_both_ways(rank: int, world: int) -> dict:
    shards = ShardGroup.of(None)
    g = torch.Generator().manual_seed(rank)
    full = torch.randn(world * 6000, generator=g) * 10.0 ** (rank - 1)
    exact = GradientReduction(shards).reduce(full.clone(), "test gradients").clone()
    quantized = GradientReduction(shards, quantized=True, predivide_factor=2.0).reduce(full.clone(), "test")
    overlapped = GradientReduction(shards, quantized=True, predivide_factor=2.0).start(full.clone(), "test").wait()
    overflow = full.clone()
    if rank == 1:
        overflow[10] = float("inf")  # in rank 0's part: rank 0's shard turns NaN
    nan = GradientReduction(shards, quantized=True).reduce(overflow, "test")
    bound = _half_scales(full.view(world, 6000) / 2.0)  # each rank's blocks, predivided
    return {"exact": exact, "quantized": quantized.clone(), "overlapped": overlapped, "nan": nan.clone(),
            "bound": bound}


def test_two_ranks_reduce_within_the_bound_and_overflow_reaches_every_rank():
    ranks = run_ranks(_reduce_both_ways, 2)
    for rank, result in enumerate(ranks):
        # the sum of the predivided parts is off by at most the sum of their half scales; the post-division
        # is world / predivide = 1 here
        bound = sum(r["bound"][rank] for r in ranks)
        assert torch.all((result["quantized"] - result["exact"]).abs() <= bound * (1 + 1e-5) + 1e-7)
        assert not torch.equal(result["quantized"], result["exact"])  # it is quantized
        assert torch.equal(result["overlapped"], result["quantized"])  # started and waited: the same bits
    assert torch.isnan(ranks[0]["nan"][:2048]).all() and torch.isfinite(ranks[1]["nan"]).all()


STEPS = 30


def _train(rank: int, world: int) -> dict:
    runs = {}
    for quantized in (False, True):
        torch.manual_seed(0)
        model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, quantized_gradients=quantized)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2))
        runs[quantized] = train(model, optim, [x[2 * rank:2 * rank + 2] for x in batches(STEPS, batch=4, seed=2)])
    return runs


def test_quantized_training_stays_near_the_exact_run():
    ranks = run_ranks(_train, 2)
    exact = torch.tensor([r[False] for r in ranks]).mean(0)
    quantized = torch.tensor([r[True] for r in ranks]).mean(0)
    assert quantized[-1] < exact[0] - 0.5  # it learns
    assert (quantized - exact).abs().max() < 0.02 * exact.max()  # the documented distance (docs/guides/several-processes.md)
    assert not torch.equal(quantized, exact)


def test_quantized_gradients_argument_is_checked():
    with pytest.raises(cm.ArgumentTypeError, match="quantized_gradients"):
        cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), quantized_gradients="yes")
    assert cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), quantized_gradients=True).quantized_gradients
