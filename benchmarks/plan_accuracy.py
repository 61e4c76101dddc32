"""The planner's predicted seconds per step against measured ones (issue #23, item 1).

For each configuration (a GPT of :mod:`chunkmem.gpt`, a dtype, a placement with or without the disk
tier), ``chunkmem.choose`` plans it with a :class:`~chunkmem.MachineProfile` measured at the start of the
run (matrix products, the host Adam kernel, copies, the disk on ``--nvme-path``) plus the traced
iteration's operators timed on this machine; then the candidate is built for real with the settings it
stands for (``candidate.model_config``), under the same device / host capacities, and trained: the fastest
of the timed steps (after the warm-up steps: ``auto`` traces its first iteration and plans from it) is the
measured figure, the median is printed beside it. Both sides take the fastest of their runs: the
operators of the profile are timed that way too, so that another job on a shared machine slows neither.
Prints predicted, measured and their ratio; exits 1 if any ratio is outside ``1 +- --tolerance`` (0.30).

Usage::

    python benchmarks/plan_accuracy.py --nvme-path DIR              # the six default configurations
    python benchmarks/plan_accuracy.py --nvme-path DIR --large 1.5b   # and a bf16 GPT with the optimizer on disk
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import _gpt
import chunkmem as cm
from chunkmem.plan.cost_model import trace_compute
from chunkmem.gpt import GPT, GPTConfig, count_params


def _meta_gpt(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


@dataclass
class Config:
    name: str
    gpt: GPTConfig
    batch: int
    dtype: torch.dtype
    candidate: str          # the candidate's name in chunkmem.choose's table
    device_bytes_per_param: float | None = None  # device capacity (None: 64 GiB)
    warmup: int = 2
    steps: int = 5


CONFIGS = [
    Config("23M fp32 cuda", GPTConfig(8192, 512, 6, 8, 128), 2, torch.float32, "cuda"),
    Config("23M fp32 cpu", GPTConfig(8192, 512, 6, 8, 128), 2, torch.float32, "cpu"),
    Config("23M fp32 auto", GPTConfig(8192, 512, 6, 8, 128), 2, torch.float32, "auto", device_bytes_per_param=12),
    Config("23M bf16 cpu", GPTConfig(8192, 512, 6, 8, 128), 2, torch.bfloat16, "cpu"),
    Config("49M fp32 cpu, parameters on disk", GPTConfig(8192, 768, 6, 12, 128), 2, torch.float32, "cpu+param@disk"),
    Config("98M bf16 cpu, optimizer on disk", GPTConfig(16384, 768, 12, 12, 128), 2, torch.bfloat16,
           "cpu+optim@disk"),
]
LARGE = {  # --large: a bf16 GPT with its optimizer state on disk
    "350m": Config("355M bf16 cpu, optimizer on disk", GPTConfig(16384, 1024, 24, 16, 64), 1, torch.bfloat16,
                   "cpu+optim@disk", warmup=1, steps=2),
    "760m": Config("760M bf16 cpu, optimizer on disk", GPTConfig(16384, 1536, 24, 16, 64), 1, torch.bfloat16,
                   "cpu+optim@disk", warmup=1, steps=2),
    "1.5b": Config("1.5B bf16 cpu, optimizer on disk", GPTConfig(16384, 2048, 29, 16, 64), 1, torch.bfloat16,
                   "cpu+optim@disk", warmup=1, steps=2),
}


def lm_loss(vocab: int):
    def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab).float(), tokens.reshape(-1))
    return loss


def run(config: Config, profile: cm.MachineProfile, nvme_path: str) -> dict:
    cfg = config.gpt
    n_params = count_params(cfg)
    device = 64 * 2**30 if config.device_bytes_per_param is None else int(config.device_bytes_per_param * n_params)
    tokens = torch.randint(0, cfg.vocab, (config.batch, cfg.seq), generator=torch.Generator().manual_seed(0))
    loss_fn = lm_loss(cfg.vocab)
    policy = config.candidate.split("+")[0]
    begin = time.perf_counter()
    choice = cm.choose(lambda: GPT(cfg), tokens, device, disk_memory=2**40, dtype=config.dtype, loss_fn=loss_fn,
                       profile=profile, measure_operators=True, policies=(policy,), static_fractions=(),
                       reuse_fp16_shard=False)
    planning_s = time.perf_counter() - begin
    candidate = {c.name: c for c in choice.candidates}[config.candidate]
    assert candidate.fits, candidate.reason

    cm.set_device_memory_capacity(device)
    torch.manual_seed(0)
    with cm.ZeroInitContext(torch.device("cpu"), cm.TensorShardStrategy(), dtype=config.dtype):
        module = GPT(cfg)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), **candidate.model_config(nvme_path))
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-4), initial_scale=2**8)
    compute = trace_compute(_meta_gpt(cfg), (tokens.to("meta"),), loss_fn, config.dtype)
    times = []
    for i in range(config.warmup + config.steps):
        if i == config.warmup:  # a second look at the operators, between the warm-up and the timed steps
            profile.measure_operators(compute.replays(), again=True)
        t0 = time.perf_counter()
        optim.backward(loss_fn(model(tokens), tokens))
        optim.step()
        optim.zero_grad()
        if i >= config.warmup:
            times.append(time.perf_counter() - t0)
    real_bytes = model.tier_bytes()
    del model, optim, module
    gc.collect()
    cm.set_device_memory_capacity(None)
    measured = min(times)  # the step least slowed down by the other jobs of a shared machine
    # a third look at the operators, after the run (the fastest figure of the three is kept), and the
    # candidate's time with it: the same cost model, from the refreshed figures
    profile.measure_operators(compute.replays(), again=True)
    parts = candidate.predict(profile, compute.seconds(profile))
    predicted = parts.total
    return dict(name=config.name, params=n_params, candidate=candidate.name, predicted=predicted, measured=measured,
                median=statistics.median(times), first_prediction=candidate.seconds_per_step,
                ratio=predicted / measured, times=times, planning_s=planning_s,
                bytes_equal=real_bytes == candidate.tier_bytes,
                parts=dict(compute=parts.compute, copies=parts.copies, adam=parts.adam, disk=parts.disk))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", default=None, help="directory of the disk tier (default: a temporary one under /tmp)")
    p.add_argument("--tolerance", type=float, default=0.30)
    p.add_argument("--only", default=None, help="run the configurations whose name contains this")
    p.add_argument("--large", choices=sorted(LARGE), action="append", default=[], help="add a large configuration")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 on a machine shared with other jobs: one thread of a "
                        "parallel region descheduled stalls the others at its barrier, which turns another job's "
                        "load into 10x slower steps at 2 threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(_gpt.machine_header(), flush=True)
    directory = args.nvme_path or tempfile.mkdtemp(prefix="plan-accuracy-", dir="/var/tmp")
    begin = time.perf_counter()
    profile = cm.MachineProfile.measure(dtypes=(torch.float32, torch.bfloat16), nvme_path=directory)
    print(f"profile measured in {time.perf_counter() - begin:.1f} s: matmul GFLOP/s "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in profile.matmul_flops.items())
          + f"; Adam Mparams/s " + ", ".join(f"{k} {v / 1e6:.0f}" for k, v in profile.adam_elements_per_s.items())
          + "; 8-bit Adam Mparams/s " + ", ".join(f"{k} {v / 1e6:.0f}"
                                                  for k, v in profile.low_bit_adam_elements_per_s.items())
          + f", bf16 rounded {profile.rounded_adam_elements_per_s / 1e6:.0f}"
          + f"; copy {profile.copy_bytes_per_s / 1e9:.1f} GB/s; disk read {profile.disk_read_bytes_per_s / 1e9:.2f}"
          f" GB/s, write {profile.disk_write_bytes_per_s / 1e9:.2f} GB/s, streamed step "
          f"{profile.disk_step_bytes_per_s / 1e9:.2f} GB/s", flush=True)
    configs = [c for c in CONFIGS if args.only is None or args.only in c.name] + [LARGE[k] for k in args.large]
    results = []
    print(f"{'configuration':<36} {'params':>7} {'predicted s':>11} {'measured s':>10} {'ratio':>6} {'median s':>8}  "
          f"parts (compute, copies, adam, disk s)", flush=True)
    for config in configs:
        r = run(config, profile, directory)
        results.append(r)
        parts = ", ".join(f"{v:.3f}" for v in r["parts"].values())
        print(f"{r['name']:<36} {r['params'] / 1e6:6.0f}M {r['predicted']:11.3f} {r['measured']:10.3f} "
              f"{r['ratio']:6.2f} {r['median']:8.3f}  {parts}; steps {', '.join(f'{t:.3f}' for t in r['times'])}; "
              f"planned in {r['planning_s']:.1f} s; bytes equal: {r['bytes_equal']}", flush=True)
    if not args.nvme_path:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [r for r in results if abs(r["ratio"] - 1) > args.tolerance or not r["bytes_equal"]]
    print(f"total {time.perf_counter() - begin:.0f} s; {len(bad)} of {len(results)} outside +-{args.tolerance:.0%}"
          + (": " + ", ".join(r["name"] for r in bad) if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
