"""The bucketed mode of GradientReduction (ZeRO-1/2's buckets) on its own: where buckets close, what each rank is
handed of each gradient, the reduction's predivision and mean, the bound on collectives in flight and the traffic
counts. LowLevelZeroOptimizer's tests check it inside the optimizer."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from chunkmem.core.layout import part_in_shard
from chunkmem.distributed.bucketed_reduction import MAX_IN_FLIGHT, BucketedReduction
from chunkmem.distributed.collectives import SINGLE_PROCESS, ShardGroup
from chunkmem.distributed.reduction import GradientReduction
from chunkmem.distributed.traffic import reset_traffic, traffic
from distributed import run_ranks


@dataclass(eq=False)
class Owner:
    """A gradient of ``numel`` elements at ``offset`` of a chunk whose shards hold ``shard_numel`` elements."""

    offset: int
    numel: int
    shard_numel: int

    def part_of_rank(self, rank: int) -> tuple[int, int] | None:
        return part_in_shard(self.offset, self.numel, rank * self.shard_numel, self.shard_numel)


def _collecting(shards: ShardGroup, partitioned: bool, overlap: bool, bucket_numel: int,
                predivide_factor: float = 1.0) -> tuple[BucketedReduction, list]:
    delivered: list = []
    buckets = BucketedReduction(GradientReduction(shards, predivide_factor=predivide_factor), torch.float32,
                                bucket_numel, overlap, partitioned,
                                lambda owner, kept, mean: delivered.append((owner, kept, mean.clone())))
    return buckets, delivered


@pytest.mark.parametrize("overlap", [False, True])
def test_buckets_close_at_their_size_and_a_large_gradient_goes_alone(overlap):
    buckets, delivered = _collecting(SINGLE_PROCESS, False, overlap, bucket_numel=10)
    grads = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate((3, 4, 5, 20, 2))]
    owners = [Owner(0, g.numel(), g.numel()) for g in grads]
    counts = []
    for owner, grad in zip(owners, grads):
        buckets.add(owner, grad)
        counts.append(buckets.collectives)
        assert len(buckets.in_flight) <= MAX_IN_FLIGHT
    buckets.finish()
    # 3 + 4 + 5 >= 10 closes the first bucket; 20 >= 10 goes alone; 2 waits for finish()
    assert counts == [0, 0, 1, 2, 2] and buckets.collectives == 3 and buckets.idle
    assert [owner for owner, _, _ in delivered] == owners  # autograd's order
    for (_, kept, mean), grad in zip(delivered, grads):
        assert kept == (0, grad.numel()) and torch.equal(mean, grad)  # one rank: the mean is the gradient


def _two_ranks(rank: int, world: int) -> dict:
    shards = ShardGroup.of(None)
    owners = [Owner(0, 5, 8), Owner(5, 6, 8), Owner(11, 5, 8)]  # a chunk of 16: the middle one cut by the shards
    results = {}
    for partitioned, reduce_scatter, overlap in ((False, False, True), (True, False, False), (True, True, True)):
        reset_traffic()
        buckets, delivered = _collecting(shards, partitioned, overlap, bucket_numel=7, predivide_factor=2.0)
        buckets.reduce_scatter = reduce_scatter
        for owner in owners:
            buckets.add(owner, (rank + 1) * torch.arange(owner.numel, dtype=torch.float32) + owner.offset)
        buckets.finish()
        results[partitioned, reduce_scatter] = ([(owners.index(o), kept, mean) for o, kept, mean in delivered],
                                                buckets.collectives, traffic())
    return results


def test_two_ranks_keep_the_mean_of_their_parts():
    for rank, results in enumerate(run_ranks(_two_ranks, 2)):
        for (partitioned, reduce_scatter), (delivered, collectives, counts) in results.items():
            owners = [Owner(0, 5, 8), Owner(5, 6, 8), Owner(11, 5, 8)]
            assert collectives == 2  # 5 + 6 >= 7 closes the first bucket, finish() the second
            collective = "reduce_scatter" if reduce_scatter else "all_reduce"
            assert {key[1]: c.calls for key, c in counts.items()} == {collective: 2}
            assert [n for n, _, _ in delivered] == [0, 1, 2]
            for n, kept, mean in delivered:
                owner = owners[n]
                # the ranks' (r + 1) * arange + offset: the mean is 1.5 * arange + offset (exact in fp32)
                whole = 1.5 * torch.arange(owner.numel, dtype=torch.float32) + owner.offset
                expected = owner.part_of_rank(rank) if partitioned else (0, owner.numel)
                assert kept == expected
                if kept is None:
                    assert mean.numel() == 0
                else:
                    assert torch.equal(mean, whole[kept[0]:kept[1]])
