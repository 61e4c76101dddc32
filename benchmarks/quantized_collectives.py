"""Quantized collectives against exact ones: gradient reduction (``quantized_gradients``, ZeRO++'s qgZ) and
parameter gathers (``quantized_weights``, qwZ), 2 gloo ranks, the same seeds and batches, 200 steps of a small
GPT; prints the loss curves of the three runs, their largest distance from the exact one, and the bytes each
rank sends per step for gradients and parameters (counted by :mod:`chunkmem.distributed.traffic`, ring
figures).

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


MODES = ("exact", "qgZ", "qwZ")


def _run(rank: int, world: int, steps: int, mode: str, dtype_name: str) -> dict:
    import torch.nn.functional as F

    import chunkmem as cm
    from chunkmem.distributed.traffic import bytes_sent, reset_traffic, traffic
    from chunkmem.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    net = GPT(GPTConfig(512, 128, 4, 4, 64))
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              quantized_gradients=mode == "qgZ", quantized_weights=mode == "qwZ")
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01),
                                  initial_scale=2**12)
    g = torch.Generator().manual_seed(1)
    data = []  # 8 global batches, seen in turn: sequences t, 5t + 1, ... (mod 512) from random starts
    for _ in range(8):
        tokens = torch.randint(0, 512, (8, 1), generator=g)
        for _ in range(64):
            tokens = torch.cat([tokens, (5 * tokens[:, -1:] + 1) % 512], dim=1)
        data.append(tokens)
    losses, sent = [], {}
    for step in range(steps):
        tokens = data[step % len(data)][4 * rank:4 * rank + 4]
        reset_traffic()
        loss = F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
        optim.backward(loss)
        optim.step()
        optim.zero_grad()
        sent = {what: float(sum(bytes_sent(k[1], k[2], c.buffer_bytes) for k, c in traffic().items() if k[0] == what))
                for what in ("gradients", "parameters")}
        losses.append(loss.item())
    return {"losses": losses, "sent": sent, "params": sum(p.numel() for p in net.parameters())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from distributed import run_ranks  # the test suite's gloo launcher

    runs = {mode: run_ranks(_run, 2, args.steps, mode, args.dtype) for mode in MODES}
    curves = {mode: torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
              for mode, ranks in runs.items()}
    print(f"2 gloo ranks, GPT of {runs['exact'][0]['params']} parameters, {args.dtype}, {args.steps} steps, "
          f"the same seeds and batches")
    print(f"{'step':>5} " + " ".join(f"{m + ' loss':>11}" for m in MODES))
    for step in sorted({*range(0, args.steps, max(args.steps // 8, 1)), args.steps - 1}):
        print(f"{step:>5} " + " ".join(f"{curves[m][step].item():>11.4f}" for m in MODES))
    for mode in MODES[1:]:
        distance = (curves[mode] - curves["exact"]).abs()
        print(f"{mode}: largest |loss - exact loss| {distance.max().item():.4f} (step {int(distance.argmax())}), "
              f"{distance.max().item() / curves['exact'].max().item():.2%} of the largest loss")
    for what in ("gradients", "parameters"):
        exact = runs["exact"][0]["sent"][what]
        print(f"{what} bytes sent per rank per step (ring): " + ", ".join(
            f"{m} {runs[m][0]['sent'][what]:.0f} ({runs[m][0]['sent'][what] / exact:.3f}x)" for m in MODES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
