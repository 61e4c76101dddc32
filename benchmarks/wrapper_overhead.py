"""Overhead of the chunkmem wrapper against plain PyTorch on the same GPT: step time and peak RSS.

Three configurations, each in its own subprocess so that peak RSS (``ru_maxrss``) is measured alone:

1. ``plain``: the GPT below with ``torch.optim.AdamW(fused=True)``, fp32;
2. ``cm-cuda``: ``ShardedModelV2(..., tensor_placement_policy="cuda")`` + ``ShardedOptimizerV2(HybridAdam)``, fp32;
3. ``cm-cpu``: the same with ``tensor_placement_policy="cpu"``, fp32;
4. ``cm-auto``: the same with ``tensor_placement_policy="auto"`` and a device-tier capacity of half the
   model's state (8 bytes a parameter: half of the fp32 parameters, gradients, exp_avg and exp_avg_sq),
   ``gpu_margin_mem_ratio=0``: reported, no target.

On a machine without a GPU the "device tier" is the CPU: placement "cuda" keeps every chunk there, and
placement "cpu" rests every chunk on the host tier and copies each module's parameter chunks to the
device tier for its compute (real copies), so the CPU figure measures the wrapper's own overhead.

The configurations run in rounds, the order rotating from round to round, so that slow phases of a
shared machine fall on all of them; each child runs warm-up steps, then timed steps. The table gives
the median step time of each configuration's least disturbed round (other jobs only ever add time; every
round's median and the pooled median are shown too), its ratio to plain, and peak RSS (median over
rounds) with its ratio to plain, then PASS/MISS against the targets of the issue:

* cm-cuda step time <= 1.05x plain
* cm-cpu step time <= 1.25x plain
* cm-cpu peak RSS <= 1.15x plain

Exit status 1 if a target is missed (``--no-fail``: always 0).

Usage::

    python benchmarks/wrapper_overhead.py                 # ~23M-parameter GPT, about 2-3 minutes on 2 cores
    python benchmarks/wrapper_overhead.py --size 50m      # ~49M parameters: the issue's figure, about 5 minutes
    python benchmarks/wrapper_overhead.py --interleaved   # hand-written attention, functional tied head: 1 minute
    python benchmarks/wrapper_overhead.py --host-bound    # the wrapper's host time per module, tiny widths: 10 seconds

The interleaved mode (``--interleaved``) measures another way, on the kind of model users bring: a GPT with
attention written by hand and its lm head used through ``F.linear(x, wte.weight)``, plain and chunkmem
(``cuda`` placement) in one process, their steps alternating one by one; target: the median of the pairs'
step-time ratios <= 1.05.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _gpt

CONFIGS = ("plain", "cm-cuda", "cm-cpu", "cm-auto")
AUTO_CAPACITY_BYTES_PER_PARAM = 8  # half of fp32 parameter + gradient + exp_avg + exp_avg_sq
SIZES = {
    # vocab, d_model, layers, heads, seq, batch
    "small": dict(vocab=8192, d=512, layers=6, heads=8, seq=128, batch=2),
    "50m": dict(vocab=8192, d=768, layers=6, heads=12, seq=128, batch=2),
}
# (config, what, limit) -- what is "time" or "rss"; the ratio to plain must be <= limit.
TARGETS = (("cm-cuda", "time", 1.05), ("cm-cpu", "time", 1.25), ("cm-cpu", "rss", 1.15))
RESULT_TAG = "WRAPPER_OVERHEAD_RESULT "
LR, WEIGHT_DECAY = 1e-3, 0.01


# ---- the model and memory readings: benchmarks/_gpt.py -----------------------------------------------

def rss_mb() -> float:
    return _gpt.rss_bytes() / 2**20


def peak_rss_mb() -> float:
    return _gpt.peak_rss_bytes() / 2**20


def child(config: str, size: str, warmup: int, steps: int, threads: int | None) -> dict:
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    spec = SIZES[size]
    baseline_rss = rss_mb()  # after importing torch, before any model memory
    torch.manual_seed(0)
    net = _gpt.GPT(_gpt.GPTConfig(spec["vocab"], spec["d"], spec["layers"], spec["heads"], spec["seq"]))
    n_params = sum(p.numel() for p in net.parameters())

    if config == "plain":
        model = net
        optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        backward, step = (lambda loss: loss.backward()), optim.step
        zero_grad = lambda: optim.zero_grad(set_to_none=True)  # noqa: E731
    else:
        import chunkmem as cm
        placement = {"cm-cuda": "cuda", "cm-cpu": "cpu", "cm-auto": "auto"}[config]
        if placement == "auto":
            cm.set_device_memory_capacity(AUTO_CAPACITY_BYTES_PER_PARAM * n_params)
        model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=placement,
                                  dtype=torch.float32)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
        backward, step = optim.backward, optim.step
        zero_grad = lambda: optim.zero_grad(set_to_none=True)  # noqa: E731

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g) for _ in range(4)]
    vocab = spec["vocab"]
    times, cpu_times, phases = [], [], []
    after_backward = None
    for i in range(warmup + steps):
        tokens = data[i % len(data)]
        x, y = tokens[:, :-1], tokens[:, 1:]
        c0, t0 = time.process_time(), time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        if config != "plain" and i == warmup + steps - 1:
            after_backward = model.tier_bytes()  # a dict walk: microseconds, inside the step phase
        step()
        zero_grad()
        t3, c3 = time.perf_counter(), time.process_time()
        if i >= warmup:
            times.append(t3 - t0)
            cpu_times.append(c3 - c0)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
    out = dict(config=config, n_params=n_params, times=times, cpu_times=cpu_times, phases=phases, loss=loss.item(),
               peak_rss_mb=peak_rss_mb(), baseline_rss_mb=baseline_rss, threads=torch.get_num_threads(),
               torch=torch.__version__)
    if config != "plain":
        out["n_chunks"] = len(model.chunks)
        out["chunk_bytes"] = model.layout.chunk_bytes
        out["tier_bytes"] = model.tier_bytes()
        out["tier_bytes_after_backward"] = after_backward
        out["ledger_peak_device_bytes"] = model.runtime.ledger.peak_device_bytes
        out["capacity_bytes"] = model.runtime.ledger.capacity
    return out


# ---- the interleaved mode: the kind of model users bring, both steps in one process ---------------------

INTERLEAVED_TARGET = 1.05


def functional_gpt(vocab: int = 8192, d: int = 512, layers: int = 6, heads: int = 8):
    """A GPT written as users often write one: attention by hand (q k^T, masked_fill, softmax) and an lm
    head that uses the token embedding through ``F.linear(x, wte.weight)`` (no module of its own)."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(), nn.LayerNorm(d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    class FunctionalGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(1024, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return F.linear(self.ln_f(x), self.wte.weight)

    return FunctionalGPT()


def interleaved(args: argparse.Namespace) -> int:
    """Plain and chunkmem (``cuda`` placement) steps of :func:`functional_gpt` (vocab 8192, d 512, 6 layers,
    seq 128, batch 2, fp32) alternate one by one in this process; the ratio of each pair's step times,
    median over ``--steps`` pairs, is held against the target."""
    import copy

    import torch
    import torch.nn.functional as F

    import chunkmem as cm

    if args.threads:
        torch.set_num_threads(args.threads)
    vocab, seq, batch = 8192, 128, 2
    torch.manual_seed(0)
    plain = functional_gpt(vocab)
    wrapped = copy.deepcopy(plain)
    plain_optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model = cm.ShardedModelV2(wrapped, cm.TensorShardStrategy(), tensor_placement_policy="cuda",
                              dtype=torch.float32)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    steps = {
        "plain": (plain, lambda loss: loss.backward(), plain_optim.step,
                  lambda: plain_optim.zero_grad(set_to_none=True)),
        "chunkmem": (model, optim.backward, optim.step, lambda: optim.zero_grad(set_to_none=True)),
    }
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(4)]

    def run(name: str, tokens) -> tuple[float, float, float]:
        net, backward, step, zero_grad = steps[name]
        t0 = time.perf_counter()
        loss = F.cross_entropy(net(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    phases: dict[str, list[tuple[float, float, float]]] = {"plain": [], "chunkmem": []}
    ratios = []
    for i in range(args.warmup + args.steps):
        tokens = data[i % len(data)]
        order = ("plain", "chunkmem") if i % 2 == 0 else ("chunkmem", "plain")
        times = {name: run(name, tokens) for name in order}
        if i >= args.warmup:
            for name in phases:
                phases[name].append(times[name])
            ratios.append(sum(times["chunkmem"]) / sum(times["plain"]))
    n_params = sum(p.numel() for p in plain.parameters())
    print(f"{_gpt.machine_header()}")
    print(f"interleaved: GPT with hand-written attention and F.linear(x, wte.weight) as its head, vocab {vocab}, "
          f"d 512, 6 layers, seq {seq}, batch {batch}, fp32, {n_params / 1e6:.2f}M parameters; plain + "
          f"AdamW(fused=True) and chunkmem (cuda placement) steps alternating, {args.warmup} warm-up + "
          f"{args.steps} timed pairs")
    print()
    print(f"{'':<9} {'step ms':>8} {'fwd ms':>8} {'bwd ms':>8} {'step+zg':>8}   (medians)")
    for name, rows in phases.items():
        cols = [statistics.median(sum(r) for r in rows)] + [statistics.median(r[j] for r in rows) for j in range(3)]
        print(f"{name:<9} " + " ".join(f"{c * 1e3:8.1f}" for c in cols))
    ratio = statistics.median(ratios)
    print()
    print(f"pair ratios: median {ratio:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
    ok = ratio <= INTERLEAVED_TARGET
    print(f"{'PASS' if ok else 'MISS'}  chunkmem step time {ratio:.3f}x plain, median of {len(ratios)} "
          f"interleaved pairs (target <= {INTERLEAVED_TARGET:.2f}x)")
    return 0 if ok or args.no_fail else 1


# ---- the host-bound mode: the wrapper's own host time, where compute is negligible ----------------------

HOST_BOUND_SHAPE = dict(vocab=512, d=64, layers=24, heads=4, seq=16, batch=1)  # the 336M GPT's modules, tiny widths


def host_bound(args: argparse.Namespace) -> int:
    """The GPU check's 336M GPT has 24 layers and 149 modules with parameters; with bf16 on a GPU its kernels are
    short enough that the host's launching can bound the step. Here the same modules at width 64 (seq 16, batch
    1, fp32, one torch thread: the compute is a few microseconds an operator) run plain (``AdamW(foreach=True)``),
    under chunkmem ``cuda`` placement and under ``cpu`` placement, their steps alternating in this process. Times
    are the thread's CPU time (``time.thread_time``: a process descheduled by a shared machine does not count),
    medians over ``--steps`` rounds after ``--warmup``. The table gives each phase and what chunkmem's forward and
    backward add to plain's, in all and per module with parameters (each has one period in the forward and one in
    the backward). A report, no target."""
    import torch
    import torch.nn.functional as F

    import chunkmem as cm

    torch.set_num_threads(1)
    shape = HOST_BOUND_SHAPE
    vocab = shape["vocab"]

    def build(config: str):
        torch.manual_seed(0)
        net = _gpt.GPT(_gpt.GPTConfig(vocab, shape["d"], shape["layers"], shape["heads"], shape["seq"]))
        if config == "plain":
            optim = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
            return net, lambda loss: loss.backward(), optim
        model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=config.split("-")[1],
                                  dtype=torch.float32)
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
        return model, optim.backward, optim

    configs = {name: build(name) for name in ("plain", "cm-cuda", "cm-cpu")}
    modules = sum(1 for m in configs["plain"][0].modules() if any(True for _ in m.parameters(recurse=False)))
    tokens = torch.randint(0, vocab, (shape["batch"], shape["seq"] + 1), generator=torch.Generator().manual_seed(1))
    phases: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
    for i in range(args.warmup + args.steps):
        for name in (list(configs) if i % 2 == 0 else list(reversed(configs))):
            net, backward, optim = configs[name]
            t0 = time.thread_time()
            loss = F.cross_entropy(net(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            t1 = time.thread_time()
            backward(loss)
            t2 = time.thread_time()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if i >= args.warmup:
                phases[name].append((t1 - t0, t2 - t1, time.thread_time() - t2))
    print(_gpt.machine_header())
    print(f"host-bound: the reference GPT at vocab {vocab}, d {shape['d']}, {shape['layers']} layers, seq "
          f"{shape['seq']}, batch {shape['batch']}, fp32, one torch thread, {modules} modules with parameters; "
          f"thread CPU time, medians of {args.steps} rounds after {args.warmup}")
    print()
    print(f"{'':<8} {'fwd ms':>7} {'bwd ms':>7} {'step ms':>8} {'fwd+bwd added ms':>17} {'added us/module':>16}")
    medians = {name: [statistics.median(r[j] for r in rows) for j in range(3)] for name, rows in phases.items()}
    base = medians["plain"][0] + medians["plain"][1]
    for name, (fwd, bwd, step) in medians.items():
        added = fwd + bwd - base
        extra = "" if name == "plain" else f" {added * 1e3:17.2f} {added / modules * 1e6:16.1f}"
        print(f"{name:<8} {fwd * 1e3:7.2f} {bwd * 1e3:7.2f} {step * 1e3:8.2f}{extra}")
    return 0


# ---- the driver (parent side) -----------------------------------------------------------------------

def run_child(config: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--size", args.size,
           "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"child {config} failed with status {proc.returncode}")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise SystemExit(f"child {config} printed no result:\n{proc.stdout}{proc.stderr}")


def fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="small: ~23M parameters (default); 50m: ~49M parameters (the issue's figure)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs every configuration once")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per child")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per child (default 10), or timed pairs with --interleaved (default 20)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; start no further round that would end past it (default: 170 for small, "
                             "600 for 50m, so that a quiet machine runs every round)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even if a target is missed")
    parser.add_argument("--interleaved", action="store_true",
                        help="the interleaved mode: a GPT with hand-written attention and a functional tied "
                             "head, plain and chunkmem steps alternating in one process (--steps pairs)")
    parser.add_argument("--host-bound", action="store_true",
                        help="the host-bound mode: the wrapper's own host time per module, on the GPU check's "
                             "GPT at width 64 (--steps rounds, default 40); a report, no target")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 40 if args.host_bound else 20 if args.interleaved else 10
    if args.host_bound:
        return host_bound(args)
    if args.interleaved:
        return interleaved(args)
    if args.time_budget is None:
        args.time_budget = 170.0 if args.size == "small" else 600.0

    if args.child:
        result = child(args.child, args.size, args.warmup, args.steps, args.threads)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    start = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    rounds_done = 0
    for r in range(args.rounds):
        round_start = time.perf_counter()
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        for config in order:
            runs[config].append(run_child(config, args))
        rounds_done += 1
        now = time.perf_counter()
        print(f"round {r + 1}/{args.rounds} done ({now - start:.0f} s)", file=sys.stderr, flush=True)
        if r + 1 < args.rounds and now - start + (now - round_start) > args.time_budget:
            print(f"stopping after {rounds_done} rounds: another would pass --time-budget {args.time_budget:.0f} s "
                  f"(a busy machine?)", file=sys.stderr, flush=True)
            break
    load_after = os.getloadavg()

    first = runs["plain"][0]
    spec = SIZES[args.size]
    stats = {}
    for config, results in runs.items():
        times = [t for res in results for t in res["times"]]
        best = min(results, key=lambda res: statistics.median(res["times"]))  # the least disturbed round
        stats[config] = dict(
            step_ms=statistics.median(best["times"]) * 1e3,
            pooled_ms=statistics.median(times) * 1e3,
            round_ms=[statistics.median(res["times"]) * 1e3 for res in results],
            cpu_ms=min(statistics.median(res["cpu_times"]) for res in results) * 1e3,
            phase_ms=[statistics.median(p[i] for p in best["phases"]) * 1e3 for i in range(3)],
            rss=statistics.median(res["peak_rss_mb"] for res in results),
            base=statistics.median(res["baseline_rss_mb"] for res in results),
        )
    plain = stats["plain"]

    print(f"machine: {_gpt.cpu_kind()}, {os.cpu_count()} CPUs, torch {first['torch']}, {first['threads']} torch threads, "
          f"CUDA {'available' if _cuda_available() else 'not available (device tier = CPU)'}")
    print(f"model: GPT vocab {spec['vocab']}, d {spec['d']}, {spec['layers']} layers, {spec['heads']} heads, "
          f"seq {spec['seq']}, batch {spec['batch']}: {first['n_params'] / 1e6:.2f}M parameters (tied lm head)")
    print("dtype: fp32 (the wrapper's overhead does not depend on the dtype, and 16-bit matmul is 10-50x "
          "slower than fp32 on this CPU, which would hide it)")
    print(f"timing: {rounds_done} round(s) x ({args.warmup} warm-up + {args.steps} timed steps) per configuration, "
          f"order rotating per round; step ms = median of the timed steps of the least disturbed round (other "
          f"jobs only add time); 1-min load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (other jobs on the machine inflate and blur "
          f"the times)")
    print()
    header = (f"{'config':<9} {'step ms':>9} {'x plain':>8} {'CPU ms':>8} {'x plain':>8} {'fwd ms':>8} {'bwd ms':>8} {'step+zg':>8} "
              f"{'peak RSS MB':>12} {'x plain':>8} {'RSS-base MB':>12}  per-round step ms")
    print(header)
    print("-" * len(header))
    for config in CONFIGS:
        s = stats[config]
        print(f"{config:<9} {s['step_ms']:9.1f} {s['step_ms'] / plain['step_ms']:8.3f} "
              f"{s['cpu_ms']:8.1f} {s['cpu_ms'] / plain['cpu_ms']:8.3f} "
              f"{s['phase_ms'][0]:8.1f} {s['phase_ms'][1]:8.1f} {s['phase_ms'][2]:8.1f} "
              f"{s['rss']:12.1f} {s['rss'] / plain['rss']:8.3f} {s['rss'] - s['base']:12.1f}  "
              + " ".join(f"{m:.1f}" for m in s["round_ms"]) + f" (pooled median {s['pooled_ms']:.1f})")
    print("(step ms: wall time, the figure the targets use; CPU ms: process CPU time of all threads per step "
          "(least of the rounds' medians), a cross-check on a busy machine; fwd = forward + loss, bwd = backward, step+zg = optimizer step + "
          "zero_grad, wall-time medians of each phase; RSS-base = peak RSS minus RSS after importing torch)")
    print()
    for config in CONFIGS[1:]:
        last = runs[config][-1]
        capacity = f" (capacity {fmt_bytes(last['capacity_bytes'])})" if config == "cm-auto" else ""
        print(f"{config}: {last['n_chunks']} chunks of {fmt_bytes(last['chunk_bytes'])}, device-tier ledger peak "
              f"{fmt_bytes(last['ledger_peak_device_bytes'])}{capacity}; model.tier_bytes()")
        for when, key in (("after the last backward", "tier_bytes_after_backward"),
                          ("after the last step+zero_grad", "tier_bytes")):
            tiers = "; ".join(f"{tier}: " + (", ".join(f"{fam} {fmt_bytes(n)}" for fam, n in fams.items()) or "-")
                              + f" (total {fmt_bytes(sum(fams.values()))})"
                              for tier, fams in last[key].items())
            print(f"    {when + ':':<31} {tiers}")
    print()
    missed = False
    for config, what, limit in TARGETS:
        key = "step_ms" if what == "time" else "rss"
        ratio = stats[config][key] / plain[key]
        ok = ratio <= limit
        missed |= not ok
        label = "step time" if what == "time" else "peak RSS"
        print(f"{'PASS' if ok else 'MISS'}  {config} {label} {ratio:.3f}x plain (target <= {limit:.2f}x)")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    return 1 if missed and not args.no_fail else 0


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
