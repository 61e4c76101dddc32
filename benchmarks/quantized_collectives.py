"""Quantized gradient reduction (``quantized_gradients``, ZeRO++'s qgZ) against the exact one: 2 gloo ranks,
the same seeds and batches, 200 steps of a small GPT; prints the loss curve of both runs, their largest
distance, and the gradient bytes each rank sends per step (counted by :mod:`chunkmem.distributed.traffic`,
ring figures).

Usage::

    python benchmarks/quantized_collectives.py             # 200 steps, about a minute on 2 cores
    python benchmarks/quantized_collectives.py --steps 50
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(rank: int, world: int, steps: int, quantized: bool, dtype_name: str) -> dict:
    import torch.nn.functional as F

    import chunkmem as cm
    from chunkmem.distributed.traffic import bytes_sent, reset_traffic, traffic
    from chunkmem.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    net = GPT(GPTConfig(512, 128, 4, 4, 64))
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              quantized_gradients=quantized)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01),
                                  initial_scale=2**12)
    g = torch.Generator().manual_seed(1)
    data = []  # 8 global batches, seen in turn: sequences t, 5t + 1, ... (mod 512) from random starts
    for _ in range(8):
        tokens = torch.randint(0, 512, (8, 1), generator=g)
        for _ in range(64):
            tokens = torch.cat([tokens, (5 * tokens[:, -1:] + 1) % 512], dim=1)
        data.append(tokens)
    losses, sent = [], 0.0
    for step in range(steps):
        tokens = data[step % len(data)][4 * rank:4 * rank + 4]
        reset_traffic()
        loss = F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        sent = float(sum(bytes_sent(k[1], k[2], c.buffer_bytes) for k, c in traffic().items() if k[0] == "gradients"))
        losses.append(loss.item())
    return {"losses": losses, "sent": sent, "params": sum(p.numel() for p in net.parameters())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from distributed import run_ranks  # the test suite's gloo launcher

    runs = {q: run_ranks(_run, 2, args.steps, q, args.dtype) for q in (False, True)}
    curves = {q: torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0) for q, ranks in runs.items()}
    print(f"2 gloo ranks, GPT of {runs[False][0]['params']} parameters, {args.dtype}, {args.steps} steps, "
          f"the same seeds and batches")
    print(f"{'step':>5} {'exact loss':>11} {'qgZ loss':>11} {'difference':>11}")
    for step in sorted({*range(0, args.steps, max(args.steps // 8, 1)), args.steps - 1}):
        exact, quantized = curves[False][step].item(), curves[True][step].item()
        print(f"{step:>5} {exact:>11.4f} {quantized:>11.4f} {quantized - exact:>+11.4f}")
    distance = (curves[True] - curves[False]).abs()
    print(f"largest |difference|: {distance.max().item():.4f} (step {int(distance.argmax())}), "
          f"{distance.max().item() / curves[False].max().item():.2%} of the largest loss")
    exact_bytes, quantized_bytes = runs[False][0]["sent"], runs[True][0]["sent"]
    print(f"gradient bytes sent per rank per step (ring): exact {exact_bytes:.0f}, qgZ {quantized_bytes:.0f} "
          f"({quantized_bytes / exact_bytes:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
