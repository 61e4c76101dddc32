"""What the ranks' agreement at each point of training costs: one all-reduce of two values (a digest).

Two gloo processes on this machine time ``agree_on_point`` (the record chunkmem all-reduces at every
sharded forward, clip_grad_norm, step and ZeRO-1/2 backward) against a bare ``dist.all_reduce`` of one
float, the smallest collective there is, and against one ZeRO-3 training step of a small GPT (batch 2 x 16)
so the cost reads as a share of a step. Prints a table; medians of ``--calls`` calls.

    python benchmarks/agreement_cost.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402


def _median_seconds(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        dist.barrier()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _rank(rank: int, port: int, calls: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import chunkmem as cm
    from chunkmem.distributed.agreement import agree_on_point
    from chunkmem.distributed.collectives import ShardGroup
    from models import TinyGPT, batches, lm_loss

    shards = ShardGroup.of(None)
    one = torch.zeros(1)
    fields = [("forward_count", 1.0), ("step_count", 1.0)]
    bare = _median_seconds(lambda: dist.all_reduce(one), calls)
    agreed = _median_seconds(lambda: agree_on_point(shards, "forward", "the benchmark", fields), calls)
    torch.manual_seed(0)
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=torch.float32)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
    x = batches(1, seed=rank)[0]

    def step() -> None:
        optim.backward(lm_loss(model(x), x))
        optim.step()
        optim.zero_grad()

    step()
    stepped = _median_seconds(step, max(5, calls // 50))
    if rank == 0:
        results.update(bare=bare, agreed=agreed, step=stepped)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="timed calls of each collective")
    args = parser.parse_args()
    results = _gpt.run_two_gloo_ranks(_rank, args.calls)
    print(f"{'what':<44} {'median':>10}")
    print(f"{'bare all_reduce of one float':<44} {results['bare'] * 1e6:>8.1f} us")
    print(f"{'agree_on_point (2 float64 values)':<44} {results['agreed'] * 1e6:>8.1f} us")
    print(f"{'ZeRO-3 step, TinyGPT, cpu placement':<44} {results['step'] * 1e3:>8.2f} ms")
    print(f"agreement at a step's two points (forward, step): "
          f"{2 * results['agreed'] / results['step'] * 100:.2f}% of that step")


if __name__ == "__main__":
    main()
