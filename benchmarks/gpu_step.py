"""Step time, peak GPU memory and bytes moved per step of chunkmem against plain PyTorch on a real GPU.

Each configuration trains the same GPT (:mod:`chunkmem.gpt`) in a process of its own, inputs on the GPU,
``torch.cuda.synchronize()`` before every clock read; fp16 runs start their loss scale at 2**16 (``GradScaler``'s)
and the table counts the timed steps each skipped (an overflow), whose time has no update in it:

* ``plain``: the model on the GPU, ``torch.optim.AdamW(fused=True)``, fp32;
* ``plain-amp``: the same under ``torch.autocast(float16)`` with ``torch.amp.GradScaler`` (fp32 master weights:
  what a mixed-precision user of plain PyTorch runs);
* ``cm-<placement>``: ``ShardedModelV2(tensor_placement_policy=<placement>)`` + ``ShardedOptimizerV2(HybridAdam)``,
  fp32; ``cm-<placement>-fp16``: the same with ``dtype=torch.float16`` (fp32 masters in the optimizer);
  ``auto`` runs under a device-tier capacity of 8 bytes per parameter (half of fp32 parameter, gradient and the
  two Adam moments), so that chunks move.

Bytes moved are ``model.memory_stats()["totals"]`` of the last iteration (chunk copies between the GPU and the
host); peak GPU memory is ``torch.cuda.max_memory_allocated()`` over the whole run (model, optimizer,
activations). Needs CUDA; prints a table and exits 0 (the figures are for the README, no target is held).

    python benchmarks/gpu_step.py                 # 350M: every configuration; 50M: plain against cm-cuda
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

RESULT_TAG = "GPU_STEP_RESULT "
SIZES = {
    # vocab, d_model, layers, heads, seq, batch
    "50m": dict(vocab=8192, d=768, layers=6, heads=12, seq=128, batch=2),
    "350m": dict(vocab=32768, d=1024, layers=24, heads=16, seq=512, batch=8),
}
PLAN = {
    "50m": ("plain", "cm-cuda"),
    "350m": ("plain", "cm-cuda", "cm-cpu", "cm-auto", "plain-amp", "cm-cuda-fp16", "cm-cpu-fp16", "cm-auto-fp16"),
}
AUTO_CAPACITY_BYTES_PER_PARAM = 8
INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler's
LR, WEIGHT_DECAY = 1e-3, 0.01


def child(config: str, size: str, warmup: int, steps: int, limit: float) -> dict:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(limit, exit=True)  # a configuration that hangs shows where
    import torch.nn.functional as F

    spec = SIZES[size]
    torch.manual_seed(0)
    net = _gpt.GPT(_gpt.GPTConfig(spec["vocab"], spec["d"], spec["layers"], spec["heads"], spec["seq"]))
    n_params = sum(p.numel() for p in net.parameters())
    torch.cuda.reset_peak_memory_stats()
    model = None
    if config.startswith("plain"):
        net = net.cuda()
        optim = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        amp = config == "plain-amp"
        scaler = torch.amp.GradScaler("cuda") if amp else None

        def train_step(x, y):
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = F.cross_entropy(net(x).float().reshape(-1, spec["vocab"]), y.reshape(-1))
            stepped = True
            if amp:
                scale = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.step(optim)
                scaler.update()
                stepped = scaler.get_scale() >= scale  # a skipped step backs the scale off
            else:
                loss.backward()
                optim.step()
            optim.zero_grad(set_to_none=True)
            return loss, stepped
    else:
        import chunkmem as cm
        placement = config.split("-")[1]
        dtype = torch.float16 if config.endswith("fp16") else torch.float32
        if placement == "auto":
            cm.set_device_memory_capacity(AUTO_CAPACITY_BYTES_PER_PARAM * n_params)
        model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=placement, dtype=dtype)
        # the loss scale GradScaler starts from: the reference's default, 2**32, overflows (and skips) for the
        # first thirty-odd steps, which would time skipped steps against plain-amp's updates
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                                      initial_scale=INITIAL_SCALE)

        def train_step(x, y):
            loss = F.cross_entropy(model(x).reshape(-1, spec["vocab"]), y.reshape(-1))
            optim.backward(loss)
            stepped = optim.step()
            optim.zero_grad(set_to_none=True)
            return loss, stepped

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g).cuda() for _ in range(4)]
    times, skipped = [], 0
    for i in range(warmup + steps):
        tokens = data[i % len(data)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, stepped = train_step(tokens[:, :-1], tokens[:, 1:])
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            skipped += not stepped
        print(f"{config} step {i}: {time.perf_counter() - t0:.3f} s", file=sys.stderr, flush=True)
    out = dict(config=config, n_params=n_params, times=times, skipped=skipped, loss=float(loss),
               peak_gpu_bytes=torch.cuda.max_memory_allocated(), torch=torch.__version__,
               gpu=torch.cuda.get_device_name())
    if model is not None:
        totals = model.memory_stats()["totals"]
        out.update(to_device=totals["moved_to_device_bytes"], to_host=totals["moved_to_host_bytes"],
                   chunks=len(model.chunks), chunk_bytes=model.layout.chunk_bytes)
    return out


def run_child(config: str, size: str, args: argparse.Namespace) -> dict | str:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--size", size,
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--limit", str(args.limit)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    sys.stderr.write(f"--- {size} {config} failed (status {proc.returncode}) after "
                     f"{time.perf_counter() - start:.0f} s:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}\n")
    return f"failed ({proc.returncode})"


def print_row(config: str, r: dict | str, results: dict) -> None:
    if not isinstance(r, dict):
        print(f"{config:<13} {r}", flush=True)
        return
    base = results.get("plain-amp" if config.endswith("fp16") or config == "plain-amp" else "plain")
    step = statistics.median(r["times"]) * 1e3
    ratio = step / (statistics.median(base["times"]) * 1e3) if isinstance(base, dict) else float("nan")
    moved = (f"{r['to_device'] / 2**20:11.1f} {r['to_host'] / 2**20:12.1f}" if "to_device" in r
             else f"{'-':>11} {'-':>12}")
    print(f"{config:<13} {step:9.1f} {ratio:7.3f} {r['peak_gpu_bytes'] / 2**30:13.2f} {moved} {r['loss']:8.4f} "
          f"{r['skipped']:>8}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50m,350m", help="comma-separated, of " + ", ".join(SIZES))
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--configs", default=None, help="comma-separated configurations (default: each size's plan)")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="seconds a configuration may run before it is stopped with a traceback (default 60)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT_TAG + json.dumps(child(args.child, args.size, args.warmup, args.steps, args.limit)), flush=True)
        return 0
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs CUDA (the CPU figures come from wrapper_overhead.py)")
    print(f"{_gpt.machine_header()}; GPU {torch.cuda.get_device_name()}")
    print(f"timing: {args.warmup} warm-up + {args.steps} timed steps per configuration, one process each; "
          f"step ms = median; moved = chunk bytes copied host->GPU / GPU->host in the last iteration")
    for size in args.sizes.split(","):
        spec = SIZES[size]
        n_params = _gpt.count_params(_gpt.GPTConfig(spec["vocab"], spec["d"], spec["layers"], spec["heads"], spec["seq"]))
        print(f"\n{size}: GPT vocab {spec['vocab']}, d {spec['d']}, {spec['layers']} layers, seq {spec['seq']}, "
              f"batch {spec['batch']}: {n_params / 1e6:.1f}M parameters")
        print(f"{'config':<13} {'step ms':>9} {'x base':>7} {'peak GPU GiB':>13} {'to GPU MiB':>11} "
              f"{'to host MiB':>12} {'loss':>8} {'skipped':>8}", flush=True)
        results: dict[str, dict | str] = {}
        for config in (args.configs.split(",") if args.configs else PLAN[size]):
            results[config] = run_child(config, size, args)
            print_row(config, results[config], results)
    print("(x base: against plain for fp32 rows, against plain-amp for the fp16 rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
