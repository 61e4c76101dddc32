"""Gradient reduce-scatters left running while the backward goes on (``reductions_in_flight``, DeepSpeed's
``overlap_comm`` at stage 3): bitwise the in-line reduction's results, and really overlapped (the runtime's
event log shows backward periods between a reduction's start and its wait; no timing is asserted)."""
from __future__ import annotations

import pytest
import torch

import chunkmem as cm
from distributed import run_ranks
from models import TinyGPT, batches, train

CONFIGS = {  # name -> placement, dtype, extra ShardedModelV2 arguments
    "cpu-fp32": ("cpu", torch.float32, {}),
    "cpu-fp16-fp32-reduce": ("cpu", torch.float16, {"fp32_reduce_scatter": True, "reduce_scatter_bucket_size_mb": 0.01}),
    "cuda-fp32-persistent": ("cuda", torch.float32, {"persistence_threshold": 100}),
}
IN_FLIGHT = 2


def _train(rank: int, config: str, in_flight: int) -> dict:
    policy, dtype, extra = CONFIGS[config]
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy=policy, dtype=dtype,
                              chunk_size=4096 * dtype.itemsize, reductions_in_flight=in_flight, **extra)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01),
                                  initial_scale=2**10)
    model.runtime.executor.events = []
    losses = train(model, optim, [x[2 * rank:2 * rank + 2] for x in batches(3, batch=4, seed=1)])
    return {"losses": losses, "model": model.state_dict(), "optimizer": optim.state_dict(),
            "events": model.runtime.executor.events, "chunks": len(model.chunks)}


def _both_ways(rank: int, world: int) -> dict:
    return {(config, n): _train(rank, config, n) for config in CONFIGS for n in (0, IN_FLIGHT)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_both_ways, 2)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reductions_in_flight_are_bitwise_the_in_line_ones(two_ranks, config):
    for result in two_ranks:
        inline, overlapped = result[(config, 0)], result[(config, IN_FLIGHT)]
        assert overlapped["losses"] == inline["losses"]
        for key, value in inline["model"].items():
            assert torch.equal(overlapped["model"][key], value), key
        for index, entry in inline["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(overlapped["optimizer"]["state"][index][key], value), (index, key)
        assert not any(e[0] == "reduce" for e in inline["events"])  # in line: nothing left running


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reductions_overlap_the_backward_within_the_bound(two_ranks, config):
    events = two_ranks[0][(config, IN_FLIGHT)]["events"]
    started = [e for e in events if e[:1] == ("reduce",) and e[2] == "started"]
    assert started and len(started) == len([e for e in events if e[:1] == ("reduce",) and e[2] == "done"])
    running, overlapped, most = {}, 0, 0
    for position, event in enumerate(events):
        if event[0] == "reduce" and event[2] == "started":
            running[event[1]] = position
            most = max(most, len(running))
        elif event[0] == "reduce":
            began = running.pop(event[1])
            # a backward period of another module ran while this chunk's gradients were being reduced
            overlapped += any(e[0] == "period" and e[3] == "backward" for e in events[began:position])
    assert not running and overlapped > 0
    assert most <= IN_FLIGHT + 1  # the newest one starts before the oldest beyond the bound is waited for


def test_reductions_in_flight_arguments_are_checked():
    for value, error in ((-1, cm.InvalidArgumentError), (1.5, cm.InvalidArgumentError),
                         ("2", cm.ArgumentTypeError)):
        with pytest.raises(error, match="reductions_in_flight"):
            cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), reductions_in_flight=value)
    with pytest.raises(cm.InvalidArgumentError, match="reductions_in_flight=2.*reuse_fp16_shard=True"):
        cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), reductions_in_flight=2, reuse_fp16_shard=True)
    one = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), reductions_in_flight=2, dtype=torch.float32)
    assert one.reductions_in_flight == 2  # one process: nothing to reduce, accepted
