"""ZeRO-3 over two gloo processes: every chunk sharded over the ranks, gradients reduce-scattered.

References: the same model trained by one process on the batch of both ranks (chunkmem and plain
``torch.optim.AdamW``), exact byte counts, and fp64/fp32 formulas for the gradient reduction.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import chunkmem as cm
from chunkmem.distributed.agreement import LayoutMismatchError
from chunkmem.distributed.collectives import ShardGroup
from chunkmem.distributed.reduction import GradientReduction
from distributed import run_ranks
from models import TinyGPT, batches, lm_loss, resting_tier_bytes

POLICIES = ("cpu", "cuda", "auto")
# bytes, by world size: less than the fp32 TinyGPT's chunks need with the activations of batch 4 (one
# rank) or 2 (each of two ranks), so auto evicts
AUTO_CAPACITY = {1: 320 * 1024, 2: 224 * 1024}
DATA = batches(4, batch=4)


def run_training(policy: str, dtype: torch.dtype, data: list[torch.Tensor], *, reuse: bool = False,
                 clip: float | None = None, strategy: cm.BaseShardStrategy | None = None, margin: float = 0.0,
                 capacity: int | None = None, prefetch: bool = True, **model_kwargs) -> dict:
    """Train a TinyGPT (seed 0, built outside the context) with chunkmem; what the tests compare."""
    if policy == "auto":
        cm.set_device_memory_capacity(capacity or AUTO_CAPACITY[2 if torch.distributed.is_initialized() else 1])
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), strategy or cm.TensorShardStrategy(), tensor_placement_policy=policy,
                              reuse_fp16_shard=reuse, dtype=dtype, chunk_size=16384, **model_kwargs)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**10, gpu_margin_mem_ratio=margin)
    model.runtime.executor.prefetch = prefetch
    losses, norms, at_rest = [], [], None
    for x in data:
        loss = lm_loss(model(x), x)
        optim.backward(loss)
        if clip is not None:
            norms.append(optim.clip_grad_norm(clip))
        assert optim.step()
        at_rest = resting_tier_bytes(model)
        optim.zero_grad()
        losses.append(loss.item())
    cm.set_device_memory_capacity(None)
    return {"state": model.state_dict(), "losses": losses, "norms": norms, "bytes": at_rest,
            "optim_bytes": optim.get_memory_usage(), "chunk_numel": model.chunks[0].shard_numel,
            "collectives": model.runtime.reduction.collectives, "gathers": model.runtime.executor.gathers,
            "prefetched": model.runtime.executor.prefetched,
            "trainable_shard_numels": [c.shard_numel for c in model.chunks if c.trainable]}


def _half(data: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    rows = data[0].shape[0] // world
    return [x[rank * rows:(rank + 1) * rows] for x in data]


# placements whose sharded paths differ from the three above: shards resting on the device for some
# chunks only, and auto keeping gathered copies and optimizer state of the margin chunks on the device
OTHER_PLACEMENTS = {
    "static": (("static", torch.float32), dict(offload_param_frac=0.5, offload_optim_frac=0.5)),
    "auto_margin": (("auto", torch.float32), dict(margin=0.5, capacity=2**20)),
}


def _policies_worker(rank: int, world: int) -> dict:
    data = _half(DATA, rank, world)
    out = {policy: run_training(policy, torch.float32, data) for policy in POLICIES}
    out["clipped"] = run_training("cpu", torch.float32, data, clip=0.05)
    out["tiny_buckets"] = run_training("cpu", torch.float32, data, reduce_scatter_bucket_size_mb=0.004)
    out["predivided"] = run_training("cuda", torch.float32, data, gradient_predivide_factor=2.0)
    out["bucketed"] = run_training("cpu", torch.float32, data, strategy=cm.BucketTensorShardStrategy())
    out["no_prefetch"] = run_training("cuda", torch.float32, data, prefetch=False)
    for name, kwargs in OTHER_PLACEMENTS.items():
        out[name] = run_training(*kwargs[0], data, **kwargs[1])
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_policies_worker, 2)


def _total_bytes(tier_bytes: dict) -> int:
    return sum(n for families in tier_bytes.values() for n in families.values())


def _plain_adamw(data: list[torch.Tensor]) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for x in data:
        lm_loss(model(x), x).backward()
        optim.step()
        optim.zero_grad()
    return model


def _assert_states_close(state: dict, reference: dict, rtol: float) -> None:
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=rtol, atol=rtol * max(value.abs().max().item(), 1),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("policy", POLICIES)
def test_two_ranks_match_one_rank_with_the_double_batch(two_ranks, policy):
    one = run_training(policy, torch.float32, DATA)
    ranks = [r[policy] for r in two_ranks]
    assert ranks[0]["chunk_numel"] * 2 == one["chunk_numel"], "each rank keeps half of every chunk"
    # one process sums the 2b rows' gradients at once, the ranks b rows each and then the halves: the last fp32
    # bit differs, and Adam's division by sqrt(v) amplifies it where a gradient is near zero (1.5e-6 in one
    # element on an AVX2-only AMD EPYC; a wrong update is off by about lr = 1e-2)
    _assert_states_close(ranks[0]["state"], one["state"], rtol=1e-5)
    torch.testing.assert_close(ranks[0]["state"], ranks[1]["state"], rtol=0, atol=0)
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert mean_losses == pytest.approx(one["losses"], rel=1e-6)
    # Plain PyTorch averages the 2b rows in one sum, the ranks average b rows each and then the two means:
    # the gradients differ in the last fp32 bit, and Adam's division by sqrt(v) lets that reach 1e-5.
    _assert_states_close(ranks[0]["state"], _plain_adamw(DATA).state_dict(), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(OTHER_PLACEMENTS))
def test_other_placements_match_one_rank(two_ranks, name):
    (policy, dtype), kwargs = OTHER_PLACEMENTS[name]
    one = run_training(policy, dtype, DATA, **kwargs)
    _assert_states_close(two_ranks[0][name]["state"], one["state"], rtol=1e-5)  # (as the test above)
    torch.testing.assert_close(two_ranks[0][name]["state"], two_ranks[1][name]["state"], rtol=0, atol=0)
    device_bytes, _host_bytes = two_ranks[0][name]["optim_bytes"]
    assert device_bytes > 0, "some optimizer state is on the device"


@pytest.mark.parametrize("policy", ["cpu", "cuda"])
def test_each_rank_keeps_half_of_the_model_state(two_ranks, policy):
    one = run_training(policy, torch.float32, DATA)
    for rank in two_ranks:
        assert _total_bytes(rank[policy]["bytes"]) <= 0.52 * _total_bytes(one["bytes"])
        # the same layout, so exactly half of every family, and of the optimizer state on each tier
        for tier, families in one["bytes"].items():
            for family, nbytes in families.items():
                if family != "param" or policy == "cpu":  # under cuda the gathered copies come and go
                    assert rank[policy]["bytes"][tier].get(family, 0) * 2 == nbytes, (tier, family)
        assert tuple(2 * n for n in rank[policy]["optim_bytes"]) == one["optim_bytes"]


def test_clip_grad_norm_is_the_norm_over_every_rank(two_ranks):
    one = run_training("cpu", torch.float32, DATA, clip=0.05)
    for rank in two_ranks:
        assert rank["clipped"]["norms"] == pytest.approx(one["norms"], rel=1e-5)
    # the clip coefficients differ in the last bits (norms of differently ordered sums), which Adam passes
    # on to elements whose second moment is tiny: 1.008e-5 on one element of 4096 on an AMD EPYC (AVX2)
    # with torch 2.13, at every commit since the test was written, hence 2e-5
    _assert_states_close(two_ranks[0]["clipped"]["state"], one["state"], rtol=2e-5)


def test_bucket_size_splits_the_reduction_without_changing_results(two_ranks):
    default, tiny = two_ranks[0]["cpu"], two_ranks[0]["tiny_buckets"]
    # 0.004 MB = 4194 bytes of collective input: 524 fp32 elements of each of the 2 ranks, so each
    # 2048-element shard takes 4 collectives instead of 1 (the trimmed last chunk's shard fewer)
    shards = default["trainable_shard_numels"]
    assert shards[:-1] == [2048] * (len(shards) - 1) and shards[-1] < 2048
    per_reduction = sum(-(-s // 524) for s in shards)
    assert default["collectives"] % len(shards) == 0
    assert tiny["collectives"] == default["collectives"] // len(shards) * per_reduction
    torch.testing.assert_close(tiny["state"], default["state"], rtol=0, atol=0)


def test_bucket_strategy_gathers_a_module_in_one_collective(two_ranks):
    """TinyGPT's lm head uses its own chunk and that of the tied embedding: one gather instead of two."""
    tensor, bucketed = two_ranks[0]["cpu"], two_ranks[0]["bucketed"]
    assert 0 < bucketed["gathers"] < tensor["gathers"]
    torch.testing.assert_close(bucketed["state"], tensor["state"], rtol=0, atol=0)


def test_sharded_prefetch_gathers_ahead_and_changes_no_result(two_ranks):
    """Sharded, the next period's chunks are gathered ahead (an asynchronous all-gather both ranks start
    alike) on every placement that follows its schedule, bitwise as without prefetch."""
    for rank in two_ranks:
        assert rank["no_prefetch"]["prefetched"] == 0
        for placement in ("cuda", "cpu", "bucketed"):
            assert rank[placement]["prefetched"] > 0, placement
        on_demand = rank["cuda"]["gathers"] - rank["cuda"]["prefetched"]  # (gathers counts every all-gather)
        assert on_demand < rank["no_prefetch"]["gathers"]
        torch.testing.assert_close(rank["cuda"]["state"], rank["no_prefetch"]["state"], rtol=0, atol=0)


def test_predivide_factor_keeps_the_mean(two_ranks):
    _assert_states_close(two_ranks[0]["predivided"]["state"], two_ranks[0]["cuda"]["state"], rtol=1e-6)


# ---- the reduction itself, against formulas ----------------------------------------------------------


def _reduction_worker(rank: int, world: int) -> dict:
    shards = ShardGroup.of(None)
    generator = torch.Generator().manual_seed(rank)
    random = (torch.rand(4096, generator=generator) * 8 - 4).to(torch.float16)
    big = torch.full((4096,), 40000.0, dtype=torch.float16)
    out = {"random": random, "rank": rank}
    for fp32 in (False, True):
        for factor in (1.0, 2.0, 3.0):
            reduction = GradientReduction(shards, 2**20, fp32, factor)
            # (a result is valid until the next reduce: its buffer is reused)
            out[("random", fp32, factor)] = reduction.reduce(random.clone(), "random gradients").clone()
            out[("big", fp32, factor)] = reduction.reduce(big.clone(), "large gradients").clone()
    return out


def test_fp32_reduce_scatter_and_predivide_factor_against_formulas():
    ranks = run_ranks(_reduction_worker, 2)
    a, b = ranks[0]["random"], ranks[1]["random"]
    for rank in ranks:
        own = slice(rank["rank"] * 2048, (rank["rank"] + 1) * 2048)
        for factor in (1.0, 2.0, 3.0):
            in_fp16 = ((a / factor) + (b / factor)) / (2 / factor)  # each operation rounded to fp16
            in_fp32 = ((a.float() / factor + b.float() / factor) / (2 / factor)).half()
            assert torch.equal(rank[("random", False, factor)], in_fp16[own])
            assert torch.equal(rank[("random", True, factor)], in_fp32[own])
        # Over two ranks a sum of two fp16 values rounds once either way and halving is exact, so in range
        # the two reductions differ only when the predivision rounds (factor 3).
        assert not torch.equal(rank[("random", False, 3.0)], rank[("random", True, 3.0)])
        # 40000 + 40000 overflows fp16: only predividing or reducing in fp32 keeps the mean
        assert torch.isinf(rank[("big", False, 1.0)]).all()
        for key in (("big", False, 2.0), ("big", True, 1.0), ("big", True, 2.0)):
            assert torch.all(rank[key] == 40000), key


# ---- 16-bit training, the init context, overflow, and bad groups --------------------------------------


def _mixed_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    data = _half(DATA, rank, world)
    out = {"fp16_reuse": run_training("cpu", torch.float16, data, reuse=True),
           "bf16_cuda": run_training("cuda", torch.bfloat16, data)}

    torch.manual_seed(0)
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), shard_param=True,
                            dtype=torch.float32, chunk_size=16384) as ctx:
        model = InitializedAfterwards()
    out["context_local_bytes"] = sum(c.param.shard.nbytes for c in ctx.chunks)
    out["context_full_bytes"] = sum(c.param.nbytes for c in ctx.chunks)
    wrapped = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    out["context_state"] = wrapped.state_dict()
    out["rank0_only"] = wrapped.state_dict(rank0_only=True)
    out["repacked"] = train_repacked(data)

    # an inf gradient element in rank 1's shard only: rank 0's shard is finite, yet it skips the step too
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float16, chunk_size=16384)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10,
                                  hysteresis=1)
    chunk = model.chunks[0]
    slot = next(s for s in chunk.slots if s.offset + s.numel > chunk.shard_numel and s.param.requires_grad)
    element = max(chunk.shard_numel - slot.offset, 0)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[element] = float("inf")
        return grad

    slot.param.register_hook(poison)
    x = data[0]
    optim.backward(lm_loss(model(x), x))
    out["finite_here"] = bool(torch.isfinite(model.runtime.grad_of(chunk)).all())
    out["overflow_step"] = optim.step()
    out["overflow_scale"] = optim.loss_scale

    errors = {}
    single = dist.new_group([0])
    # rank 0 only: wrapping is a collective when sharded (the ranks agree on the layout), so rank 1 must
    # not wrap a model that rank 0 refuses
    for kwargs in (({"reduce_scatter_process_group": single},) if rank == 0 else ()):
        try:
            cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), dtype=torch.float32, **kwargs)
        except cm.InvalidArgumentError as exc:
            errors["reduce_scatter_process_group"] = str(exc)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), dtype=torch.float32)
    # building the optimizer is a collective when sharded (the ranks agree on its settings): rank 0's
    # refusal meets rank 1's agreement, so rank 1 learns of it instead of waiting
    try:
        cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters()), **({"dp_process_group": single} if rank == 0
                                                                           else {}))
    except cm.InvalidArgumentError as exc:
        errors["dp_process_group"] = str(exc)
    except LayoutMismatchError as exc:
        errors["another rank refused"] = str(exc)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def mixed_ranks() -> list[dict]:
    return run_ranks(_mixed_worker, 2)


@pytest.mark.parametrize("case, dtype, rtol", [("fp16_reuse", torch.float16, 2e-2), ("bf16_cuda", torch.bfloat16, 5e-2)])
def test_16bit_training_matches_one_rank(mixed_ranks, case, dtype, rtol):
    """The two runs differ by the rounding of the 16-bit gradient mean (one rank averages 2b rows in
    the backward, two ranks average b rows each and then each other's means, rounded to 16 bits once
    more); four Adam steps of lr 1e-2 keep the parameters within a few 16-bit ulps of each other."""
    policy = "cpu" if case == "fp16_reuse" else "cuda"
    one = run_training(policy, dtype, DATA, reuse=case == "fp16_reuse")
    _assert_states_close(mixed_ranks[0][case]["state"], one["state"], rtol=rtol)
    torch.testing.assert_close(mixed_ranks[0][case]["state"], mixed_ranks[1][case]["state"], rtol=0, atol=0)


class InitializedAfterwards(TinyGPT):
    """Initialises its children's parameters in its own ``__init__``, after they went into chunks."""

    def __init__(self) -> None:
        super().__init__()
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        self.side.weight.data.uniform_(-0.1, 0.1)  # the Hugging Face way
        with torch.no_grad():
            self.blocks[0].fc1.weight.mul_(3.0)  # reads the current values, then writes


def train_repacked(data: list[torch.Tensor]) -> dict:
    """A model built in a sharded ZeroInitContext at the default chunk size, re-packed twice while
    sharded: by ShardedModelV2 (the searched size) and by the optimizer (two param groups)."""
    torch.manual_seed(0)
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), shard_param=True, dtype=torch.float32):
        module = InitializedAfterwards()
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu")
    matrices = [p for p in model.module.parameters() if p.dim() > 1]
    vectors = [p for p in model.module.parameters() if p.dim() <= 1]
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam([{"params": matrices, "weight_decay": 0.1},
                                                        {"params": vectors, "weight_decay": 0.0}], lr=1e-2))
    for x in data:
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()
    return model.state_dict()


def test_sharded_chunks_repack_like_one_process(mixed_ranks):
    one = train_repacked(DATA)
    _assert_states_close(mixed_ranks[0]["repacked"], one, rtol=1e-6)
    torch.testing.assert_close(mixed_ranks[0]["repacked"], mixed_ranks[1]["repacked"], rtol=0, atol=0)


def test_zero_init_context_shards_at_creation_like_one_process(mixed_ranks):
    torch.manual_seed(0)
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), shard_param=True,
                            dtype=torch.float32, chunk_size=16384):
        model = InitializedAfterwards()
    assert model.blocks[0].fc1.weight.std().item() == pytest.approx(0.06, rel=0.1)
    assert model.side.weight.abs().max().item() <= 0.1
    one = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy="cpu").state_dict()
    for rank in mixed_ranks:
        assert rank["context_local_bytes"] * 2 == rank["context_full_bytes"]
        torch.testing.assert_close(rank["context_state"], one, rtol=0, atol=0)
    torch.testing.assert_close(mixed_ranks[0]["rank0_only"], one, rtol=0, atol=0)
    assert mixed_ranks[1]["rank0_only"] == {}


def test_an_overflow_on_one_rank_skips_the_step_everywhere(mixed_ranks):
    assert mixed_ranks[0]["finite_here"] and not mixed_ranks[1]["finite_here"]
    for rank in mixed_ranks:
        assert rank["overflow_step"] is False
        assert rank["overflow_scale"] == 2**9


def test_groups_of_other_ranks_are_refused(mixed_ranks):
    errors = mixed_ranks[0]["errors"]
    assert "reduce_scatter_process_group" in errors and "same ranks as process_group" in errors[
        "reduce_scatter_process_group"]
    assert "dp_process_group" in errors and "data-parallel ranks" in errors["dp_process_group"]
    other = mixed_ranks[1]["errors"]
    assert list(other) == ["another rank refused"]
    assert "arguments: refused: InvalidArgumentError: dp_process_group=" in other["another rank refused"]


# ---- a model-parallel group ----------------------------------------------------------------------------


def _model_parallel_worker(rank: int, world: int, directory: str) -> dict:
    """Each rank is its own data-parallel group of one and holds its own model (standing for a different
    part of one model); both ranks form the model-parallel group."""
    import torch.distributed as dist

    own_groups = [dist.new_group([r]) for r in range(world)]
    both = dist.group.WORLD
    data = _half(DATA, rank, world)
    out = {}
    for mp_group in (None, both):
        torch.manual_seed(rank)
        model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), process_group=own_groups[rank],
                                  tensor_placement_policy="cpu", dtype=torch.float16, chunk_size=16384)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**10,
                                      hysteresis=1, dp_process_group=own_groups[rank], mp_process_group=mp_group)
        x = data[0]
        optim.backward(lm_loss(model(x), x))
        out[("norm", mp_group is not None)] = optim.clip_grad_norm(1.0)
        optim.zero_grad()
        optim.backward(lm_loss(model(x), x) * (float("inf") if rank == 1 else 1.0))
        out[("overflow_step", mp_group is not None)] = optim.step()
    out["dump"] = os.path.basename(model.dump_memory_stats(os.path.join(directory, "memstats.json")))
    return out


def test_mp_process_group_reduces_the_norm_and_the_overflow_flag(tmp_path):
    ranks = run_ranks(_model_parallel_worker, 2, str(tmp_path))
    local = [r[("norm", False)] for r in ranks]
    for r in ranks:
        assert r[("norm", True)] == pytest.approx(math.sqrt(local[0] ** 2 + local[1] ** 2), rel=1e-6)
    assert ranks[0][("overflow_step", False)] is True and ranks[1][("overflow_step", False)] is False
    assert ranks[0][("overflow_step", True)] is False and ranks[1][("overflow_step", True)] is False
    assert [r["dump"] for r in ranks] == ["memstats.rank0.json", "memstats.rank1.json"]
    assert (tmp_path / "memstats.rank0.json").exists() and (tmp_path / "memstats.rank1.json").exists()
