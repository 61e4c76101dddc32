"""Collectives per ZeRO-3 step at 2 ranks, with and without persistent parameters (``persistence_threshold``,
DeepSpeed's ``stage3_param_persistence_threshold``): the small parameters (biases, LayerNorms) then sit in
chunks whole on every rank that are never gathered and whose gradients are all-reduced.

Two gloo processes train the reference GPT (``chunkmem.gpt``) under ``cpu`` placement and count, for one
step after a warm-up step, the all-gathers the chunks' fetches start and the gradient collectives
(reduce-scatters, all-reduces); the per-rank parameter bytes and the median step time over ``--steps``
steps are printed beside them.

    python benchmarks/persistence_collectives.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpt  # noqa: E402

THRESHOLDS = (0, 1000, 100_000)  # elements; 100_000 is DeepSpeed's default


def _rank(rank: int, port: int, steps: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    import chunkmem as cm
    from chunkmem.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=1024, d_model=256, layers=4, heads=4, seq=64)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, cfg.vocab, (2, 33), generator=g) for _ in range(steps + 1)]
    for threshold in THRESHOLDS:
        torch.manual_seed(0)
        model = cm.ShardedModelV2(GPT(cfg), cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                                  dtype=torch.float32, chunk_size=2**20, persistence_threshold=threshold)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3))
        executor, reduction = model.runtime.executor, model.runtime.reduction
        times, counted = [], None
        for i, tokens in enumerate(data):
            gathers, reduced = executor.gathers, reduction.collectives
            dist.barrier()
            began = time.perf_counter()
            loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
            optim.backward(loss)
            optim.step()
            optim.zero_grad()
            times.append(time.perf_counter() - began)
            if i == 1:
                counted = (executor.gathers - gathers, reduction.collectives - reduced)
        replicated = [c for c in model.chunks if c.replicas is not None]
        if rank == 0:
            results[threshold] = dict(
                gathers=counted[0], reductions=counted[1], chunks=len(model.chunks), replicated=len(replicated),
                persistent=sum(s.numel for c in replicated for s in c.slots),
                param_bytes=sum(c.param.shard.nbytes for c in model.chunks),
                step=statistics.median(times[1:]))
        del model, optim
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per threshold")
    args = parser.parse_args()
    results = _gpt.run_two_gloo_ranks(_rank, args.steps)
    print(f"machine: {_gpt.cpu_kind()}; 2 gloo ranks, GPT vocab 1024, d 256, 4 layers (3.4M parameters), "
          f"cpu placement, 1 MiB chunks")
    print(f"{'threshold':>10} {'chunks':>7} {'replicated':>10} {'persistent':>10} {'all-gathers':>11} "
          f"{'grad colls':>10} {'per step':>8} {'param bytes/rank':>16} {'step ms':>8}")
    for threshold in THRESHOLDS:
        r = results[threshold]
        print(f"{threshold:>10} {r['chunks']:>7} {r['replicated']:>10} {r['persistent']:>10} {r['gathers']:>11} "
              f"{r['reductions']:>10} {r['gathers'] + r['reductions']:>8} {r['param_bytes']:>16} "
              f"{r['step'] * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
