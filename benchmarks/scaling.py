"""How step time and auto placement's planning time grow with the model (issue 5): nothing faster than linear.

Three GPTs of one width and growing depth (default d_model 256, depths 4, 16, 64), fp32, placement
``auto``. For each:

1. a probe: the same GPT under placement ``cpu`` for one step, whose ``memory_stats()["periods"]``
   give every period's non-model peak and chunks; the device capacity is then set to the most any
   period needs (non-model peak + its chunks + two chunks of gradient staging headroom) plus half of
   the model's chunk bytes, so that the plan has to evict (Belady) and the device tier is a real
   constraint;
2. the measured run: placement ``auto`` under that capacity; the first step is traced and ends with
   the plan, whose creation (``scheduler.schedule_moves``, wrapped with a timer inside this script) is the
   planning time; then warm-up steps, then timed steps (step time = their median). The plan is also
   re-made ``--replans`` times after training; the least of those times (other jobs only add time)
   is used for the fit, their median is shown too (the single first call is a few milliseconds and
   noisy).

Printed: parameters, chunks, periods, capacity, bytes moved per step, step time and planning time,
then the least-squares slopes of log(step time) against log(parameters) and of log(planning time)
against log(periods). Target: both slopes <= 1.15 (neither grows faster than linearly).

Informational, not part of the verdict: the planner alone (``chunkmem.runtime.belady.belady_moves``) over
synthetic GPT-like schedules of up to ~100k periods, with slots growing with the model (half the
chunks) and with fixed slots, to see the planner's growth beyond the periods small models give.

dtype fp32: scaling does not depend on the dtype, and 16-bit matmuls are 10-50x slower than fp32 on
this CPU (16-bit backward far more), which would bury everything else.

Exit status 1 if a slope exceeds the target (``--no-fail``: always 0).

Usage::

    python benchmarks/scaling.py                          # about 40 s on 2 idle cores
    python benchmarks/scaling.py --d-model 384 --depths 2 8 32
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import chunkmem as cm

from _gpt import GPT, GPTConfig, count_params, loglog_slope, machine_header, mib

TARGET_SLOPE = 1.15
SYNTH_PERIODS_PER_CHUNK = 12
SYNTH_FIXED_SLOTS = 8


def synthetic_planning(sizes: list[int]) -> list[tuple[int, int, float, float]]:
    """(chunks, periods, seconds with slots = chunks // 2, seconds with fixed slots) of belady_moves."""
    from chunkmem.runtime.belady import belady_moves

    out = []
    for n in sizes:
        forward = [[c] for c in range(n) for _ in range(SYNTH_PERIODS_PER_CHUNK)]
        needed = forward + forward[::-1]
        forced = [[] for _ in needed]
        names = ["p"] * len(needed)
        best = []
        for slots in (max(n // 2, 1), SYNTH_FIXED_SLOTS):
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                belady_moves(needed, forced, [slots] * len(needed), names)
                runs.append(time.perf_counter() - t0)
            best.append(min(runs))
        out.append((n, len(needed), best[0], best[1]))
    return out


def build(cfg: GPTConfig, placement: str) -> tuple[cm.ShardedModelV2, cm.ShardedOptimizerV2]:
    torch.manual_seed(0)
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=True, dtype=torch.float32):
        net = GPT(cfg)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=placement)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-4))
    return model, optim


def train_step(model, optim, x, y, vocab: int) -> tuple[float, str]:
    """One step; returns the loss and the scheduler's mode during it (tracing, following, ...)."""
    logits = model(x)
    mode = model.runtime.scheduler.mode
    loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
    optim.backward(loss)
    optim.step()
    optim.zero_grad()
    return loss.item(), mode


def measure(cfg: GPTConfig, batch: int, warmup: int, steps: int, replans: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen) for _ in range(4)]

    # 1. probe under "cpu": what each period needs on the device
    cm.set_device_memory_capacity("64GiB")
    model, optim = build(cfg, "cpu")
    tokens = data[0]
    train_step(model, optim, tokens[:, :-1], tokens[:, 1:], cfg.vocab)
    stats = model.memory_stats()
    chunk_bytes = stats["chunks"]["param_bytes"]
    n_chunks = stats["chunks"]["count"]
    need = max(p["non_model_peak_bytes"] + len(p["chunks"]) * chunk_bytes for p in stats["periods"])
    capacity = need + 2 * chunk_bytes + (n_chunks * chunk_bytes) // 2
    del model, optim, stats
    gc.collect()

    # 2. the measured run under "auto"
    cm.set_device_memory_capacity(capacity)
    model, optim = build(cfg, "auto")
    scheduler = model.runtime.scheduler
    schedule_moves = scheduler.schedule_moves
    plan_times: list[float] = []
    last_inputs: list = []

    def timed_make_plan(inputs):
        last_inputs[:] = [inputs]
        t0 = time.perf_counter()
        margin = schedule_moves(inputs)
        plan_times.append(time.perf_counter() - t0)
        return margin

    scheduler.schedule_moves = timed_make_plan  # the instance attribute shadows the method the runtime calls
    times, moved, modes = [], [], []
    for i in range(1 + warmup + steps):
        tokens = data[i % len(data)]
        t0 = time.perf_counter()
        loss, mode = train_step(model, optim, tokens[:, :-1], tokens[:, 1:], cfg.vocab)
        dt = time.perf_counter() - t0
        modes.append(mode)
        if i >= 1 + warmup:
            times.append(dt)
            totals = model.memory_stats()["totals"]
            moved.append(totals["moved_to_device_bytes"] + totals["moved_to_host_bytes"])
    doc = model.memory_stats()
    first_plan = plan_times[0] if plan_times else float("nan")
    replan_times = []
    for _ in range(replans):
        t0 = time.perf_counter()
        schedule_moves(last_inputs[0])
        replan_times.append(time.perf_counter() - t0)
    plan = model.runtime.state.moves
    out = dict(
        params=sum(p.numel() for p in model.parameters()), chunks=len(model.chunks), chunk_bytes=chunk_bytes,
        periods=len(scheduler.periods), traces=scheduler.traces, modes=modes,
        capacity=capacity, need=need, step_s=statistics.median(times), step_min_s=min(times),
        plan_first_s=first_plan, plan_calls=len(plan_times), plan_s=statistics.median(replan_times),
        plan_min_s=min(replan_times),
        moved=statistics.median(moved), fetched=plan.fetched_chunks if plan else None,
        accesses=sum(len(p.needed) for p in scheduler.periods), loss=loss,
        peak_device=doc["totals"]["peak_device_with_non_model_bytes"])
    del model, optim, doc
    gc.collect()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the traced one (default 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--replans", type=int, default=21, help="plan re-creations timed after training (default 21)")
    parser.add_argument("--synthetic-chunks", type=int, nargs="+", default=[64, 256, 1024, 4096],
                        help="chunk counts of the synthetic planner schedules (default 64 256 1024 4096)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even if a target is missed")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if len(args.depths) < 2:
        parser.error("--depths needs at least two sizes for a slope")
    start = time.perf_counter()

    print(machine_header())
    print(f"models: GPT d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, depths "
          f"{', '.join(map(str, args.depths))}; batch {args.batch} x {args.seq} tokens")
    print("dtype: fp32 (scaling does not depend on the dtype; 16-bit matmuls are 10-50x slower than fp32 on this "
          "CPU, which would bury the rest); placement 'auto', HybridAdam, gpu_margin_mem_ratio 0 (Adam on the host)")
    print(f"capacity per model: the most one period needs (from a one-step probe under 'cpu': non-model peak + its "
          f"chunks) + 2 chunks of staging headroom + half the model's chunk bytes; timing: 1 traced step, "
          f"{args.warmup} warm-up, median of {args.steps} timed steps")
    print()

    results = []
    for depth in args.depths:
        cfg = GPTConfig(args.vocab, args.d_model, depth, args.heads, args.seq)
        print(f"depth {depth}: {count_params(cfg) / 1e6:.1f}M parameters ...", file=sys.stderr, flush=True)
        results.append(measure(cfg, args.batch, args.warmup, args.steps, args.replans))

    header = (f"{'depth':>5} {'params':>8} {'chunks':>6} {'chunk':>9} {'periods':>7} {'accesses':>8} "
              f"{'capacity':>10} {'model':>10} {'moved/step':>11} {'step ms':>9} {'min ms':>8} {'plan ms':>8} "
              f"{'min ms':>7} {'1st plan':>9}  modes of the steps")
    print(header)
    print("-" * len(header))
    for depth, r in zip(args.depths, results):
        print(f"{depth:>5} {r['params'] / 1e6:>7.1f}M {r['chunks']:>6} {mib(r['chunk_bytes']):>9} {r['periods']:>7} "
              f"{r['accesses']:>8} {mib(r['capacity']):>10} {mib(r['chunks'] * r['chunk_bytes']):>10} "
              f"{mib(r['moved']):>11} {r['step_s'] * 1e3:>9.1f} {r['step_min_s'] * 1e3:>8.1f} "
              f"{r['plan_s'] * 1e3:>8.2f} {r['plan_min_s'] * 1e3:>7.2f} {r['plan_first_s'] * 1e3:>9.2f}  "
              + " ".join(m[:5] for m in r["modes"]))
    print("(model: chunk bytes of the parameters; moved/step: chunk bytes copied between the tiers in the last timed "
          "step; step ms: median of the timed steps, min ms: their least (other jobs only add time); plan ms: median "
          "of the re-made plans, min ms: their least, 1st plan: the call at the end of the traced step; accesses: "
          "chunk uses over all periods, the A of Belady's O(A log A); modes: the scheduler's mode in each step)")
    for depth, r in zip(args.depths, results):
        if r["traces"] != 1 or r["plan_calls"] != 1 or r["modes"][0] != "tracing" \
                or any(m != "following" for m in r["modes"][1:]):
            print(f"WARNING depth {depth}: {r['traces']} traces, {r['plan_calls']} plans, modes {r['modes']} "
                  f"(expected 1 trace, 1 plan, then 'following')")

    step_slope = loglog_slope([r["params"] for r in results], [r["step_s"] for r in results])
    plan_slope = loglog_slope([r["periods"] for r in results], [r["plan_min_s"] for r in results])
    plan_slope_median = loglog_slope([r["periods"] for r in results], [r["plan_s"] for r in results])

    # Belady's planner alone, over synthetic schedules far longer than the models above give
    print()
    print(f"planner alone (chunkmem.runtime.belady.belady_moves) on synthetic GPT-like schedules: each chunk used by "
          f"{SYNTH_PERIODS_PER_CHUNK} consecutive forward periods, then the backward in reverse; slots = half the "
          f"chunks (a capacity that grows with the model) or a fixed {SYNTH_FIXED_SLOTS}; least of 3 runs")
    synth = synthetic_planning(args.synthetic_chunks)
    print(f"{'chunks':>7} {'periods':>8} {'half: ms':>9} {'us/period':>10} {'fixed: ms':>10} {'us/period':>10}")
    for n, periods, half, fixed in synth:
        print(f"{n:>7} {periods:>8} {half * 1e3:>9.2f} {half * 1e6 / periods:>10.2f} {fixed * 1e3:>10.2f} "
              f"{fixed * 1e6 / periods:>10.2f}")
    synth_half = loglog_slope([r[1] for r in synth], [r[2] for r in synth])
    synth_fixed = loglog_slope([r[1] for r in synth], [r[3] for r in synth])
    print(f"log-log slope of planning time vs periods: {synth_half:.3f} with slots = half the chunks, "
          f"{synth_fixed:.3f} with fixed slots (informational, not part of the verdict)")

    print()
    missed = False
    for what, slope in (("step time vs parameters", step_slope), ("planning time vs periods", plan_slope)):
        ok = slope <= TARGET_SLOPE
        missed |= not ok
        print(f"{'PASS' if ok else 'MISS'}  log-log slope of {what}: {slope:.3f} (target <= {TARGET_SLOPE})")
    print(f"      (planning: fitted on the least of the {args.replans} re-made plans of each model, as other jobs only "
          f"add time; on their medians the slope is {plan_slope_median:.3f})")
    if synth_half > TARGET_SLOPE:
        print(f"NOTE  the planner alone grows faster than linearly on the synthetic schedules with slots proportional "
              f"to the model (slope {synth_half:.3f}); belady_moves pushes every access on one heap and pops each entry "
              f"at most once (O(A log A)), so the excess over the log factor is not in its operation count: look at "
              f"the longest schedule's time (cache misses on a heap of A entries, the machine's load)")
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    return 1 if missed and not args.no_fail else 0


if __name__ == "__main__":
    sys.exit(main())
