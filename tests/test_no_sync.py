"""ShardedModelV2.no_sync(): k micro-batches accumulated without collectives equal one batch k times
larger (plain PyTorch AdamW on one process is the reference); refused with reuse_fp16_shard."""
import pytest
import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.optim.host_adam_ext import fp32_reference_options
from distributed import run_ranks

LR, WD, K = 1e-2, 0.01, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8))


def data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(steps)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _ranks(rank: int, world: int) -> dict:
    model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), dtype=torch.float32, chunk_size=1024)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WD))
    reduction = model.runtime.reduction
    quiet = True
    for x, y in data(2, 2 * world * K):
        mine = slice(rank * 2 * K, (rank + 1) * 2 * K)
        micro = [(x[mine][2 * i:2 * i + 2], y[mine][2 * i:2 * i + 2]) for i in range(K)]
        before = reduction.collectives
        with model.no_sync():
            for xi, yi in micro[:-1]:
                optim.backward(loss_fn(model(xi), yi) / K)
        quiet = quiet and reduction.collectives == before
        optim.backward(loss_fn(model(micro[-1][0]), micro[-1][1]) / K)
        assert reduction.collectives > before
        optim.step()
        optim.zero_grad()
    # zero_grad drops what no_sync accumulated: a no_sync backward, zero_grad, then an ordinary step
    with model.no_sync():
        optim.backward(loss_fn(model(x[:2] * 100), y[:2]))
    optim.zero_grad()
    x, y = data(3, 2 * world)[2]
    optim.backward(loss_fn(model(x[rank * 2:rank * 2 + 2]), y[rank * 2:rank * 2 + 2]))
    optim.step()
    return dict(quiet=quiet, state=model.state_dict())


def test_no_sync_over_k_micro_batches_equals_one_batch_k_times_larger():
    per_rank = run_ranks(_ranks, 2)
    reference = make_model()
    optim = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD, **fp32_reference_options())
    batches = data(2, 2 * 2 * K) + [data(3, 4)[2]]
    for x, y in batches:
        loss_fn(reference(x), y).backward()
        optim.step()
        optim.zero_grad()
    for result in per_rank:
        assert result["quiet"]  # no reduce-scatter inside no_sync
        for name, p in reference.named_parameters():
            got, want = result["state"][name].double(), p.detach().double()
            assert ((got - want).norm() / want.norm()).item() <= 1e-6, name


def test_no_sync_is_refused_with_reuse_fp16_shard():
    model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), dtype=torch.float16, reuse_fp16_shard=True)
    with pytest.raises(cm.GradientAccumulationError, match="reuse_fp16_shard"):
        with model.no_sync():
            pass
    assert not model.runtime.no_sync


def test_no_sync_cannot_nest_and_one_rank_trains_as_without_it():
    model = cm.ShardedModelV2(make_model(), cm.TensorShardStrategy(), dtype=torch.float32)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR))
    with model.no_sync():
        with pytest.raises(cm.InvalidArgumentError, match="no_sync"):
            with model.no_sync():
                pass
        x, y = data(1, 4)[0]
        optim.backward(loss_fn(model(x), y))
    assert not model.runtime.no_sync
    reference = make_model()
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0, **fp32_reference_options())
    loss_fn(reference(x), y).backward()
    ref_optim.step()
    optim.step()
    state = model.state_dict()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7)
