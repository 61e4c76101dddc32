"""Optimizer step with the optimizer state on the disk tier, against the disk bound (issue 11, item 6).

A 16-bit model (bf16 by default) wrapped with ``tensor_placement_policy="cpu"`` and
``offload_optimizer="disk"``: the fp32 master, exp_avg and exp_avg_sq of every chunk rest in files under
``--nvme-path``; the 16-bit parameters and their gradients stay in host memory. A step streams each
chunk's three fp32 families in pieces of ``buffer_size`` bytes: it reads 12 bytes a parameter and writes
12 (``atomic_step`` writes them to the other slot; the same bytes). The disk bound of a step is

    bytes read / read bandwidth + bytes written / write bandwidth

with the bandwidths of ``chunkmem.storage.disk_io.measure_bandwidth`` on the same directory, measured in the same
run before the first configuration and after each one; each configuration's bound uses the mean of the
measurements just before and just after it (a shared disk's bandwidth drifts). The bound adds the read
and write times as if they ran one after the other; the step overlaps them (reads of the next pieces,
writes of the previous ones), so a disk that serves reads and writes at once can beat it (> 100%). The bytes are the
ledger's counters (``model.runtime.ledger.read_from_disk`` / ``written_to_disk``) over the timed
steps, cross-checked against the formula 12 B x the trainable chunks' elements, each way.

Only ``optim.step()`` is timed (after a backward), ``--steps`` steps after one warm-up step; the figure is
the median. Model: ``--layers`` square ``--width`` x ``--width`` weights whose forward adds their sum to the
input (forward and backward cost next to nothing); the default, 16 x 4096^2 = 268M parameters, has 3 GiB of fp32 state on disk, so
that the warm-up and the page cache do not dominate (with an ``O_DIRECT`` engine the page cache is
bypassed anyway).

The same model is built once for each ``--buffer-counts`` value (default 1, 2, 4, 8: the pipelining
claim, reads of the next pieces and writes of the previous ones overlapping the update of one); the
target row is the default ``buffer_count`` (4). Target: >= ``--target`` (80%) of the bound; exit status 1
on a miss or when the ledger's bytes differ from the formula (``--no-fail``: 0 on a miss, still 1 on a
byte mismatch). ``--tiny``: a ~0.3M-parameter model and a 16 MiB bandwidth file, to check the script in
a few seconds (no target, the byte check still applies).

Usage::

    python benchmarks/disk_adam.py --nvme-path /work/scratch     # ~2-4 minutes
    python benchmarks/disk_adam.py --tiny --nvme-path /tmp
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

import chunkmem as cm
from chunkmem.storage import disk_io

from _gpt import gib, machine_header, mib, peak_rss_bytes

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per element, read and written by a step


class Plane(nn.Module):
    """A ``width`` x ``width`` weight that adds its sum to the input: a forward and backward that cost
    next to nothing (the gradient of every element is the output gradient's sum), so that the script's
    time goes to the optimizer step it measures."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, width).normal_(std=width ** -0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight.sum(dtype=torch.float32)


class PlaneStack(nn.Module):
    """``layers`` :class:`Plane` modules in a row (each its own parameter, packed into chunks in order)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Plane(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ---- the disk bandwidth ----------------------------------------------------------------------------------

def measure_bandwidth(directory: str, nbytes: int, block: int) -> tuple[float, float, str]:
    """(read B/s, write B/s, what measured them): the disk tier's own engine on ``directory``."""
    read, write = disk_io.measure_bandwidth(directory, nbytes, block)
    return read, write, "chunkmem.storage.disk_io.measure_bandwidth"


# ---- one configuration -----------------------------------------------------------------------------------

def run_config(args, dtype: torch.dtype, buffer_count: int) -> dict:
    """Build, warm up and time ``args.steps`` optimizer steps with ``buffer_count``."""
    torch.manual_seed(0)
    net = PlaneStack(args.width, args.layers)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy="cpu", dtype=dtype,
                              offload_optimizer="disk", nvme_path=args.nvme_path, buffer_count=buffer_count,
                              buffer_size=args.buffer_size, atomic_step=args.atomic_step)
    del net
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-4), initial_scale=2**8)
    ledger = model.runtime.ledger
    elements = sum(c.shard_numel for c in model.chunks if c.trainable)
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(1))
    times, reads, writes, skipped = [], [], [], 0
    for i in range(args.steps + 1):
        optim.zero_grad()
        optim.backward(model(x).float().square().mean())
        r0, w0 = ledger.read_from_disk, ledger.written_to_disk
        t0 = time.perf_counter()
        updated = optim.step()
        elapsed = time.perf_counter() - t0
        skipped += not updated
        if i:  # the first step is the warm-up
            times.append(elapsed)
            reads.append(ledger.read_from_disk - r0)
            writes.append(ledger.written_to_disk - w0)
    result = dict(buffer_count=buffer_count, times=times, median=statistics.median(times), reads=reads,
                  writes=writes, elements=elements, params=sum(p.numel() for p in model.parameters()),
                  skipped=skipped, disk=model.tier_bytes()["disk"], files=model.disk_file_bytes(),
                  io_buffers=model.tier_bytes()["host"].get("disk_io", 0),
                  usage=optim.get_memory_usage(with_disk=True))
    del optim, model
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=None, help="directory of the disk tier's files (default: a new "
                                                          "temporary directory under /tmp, removed at the end)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--buffer-counts", default="1,2,4,8", help="comma-separated buffer_count values")
    parser.add_argument("--target-buffer-count", type=int, default=4, help="the configuration the target applies to")
    parser.add_argument("--buffer-size", type=int, default=16 * 2**20, help="bytes per I/O buffer (default 16 MiB)")
    parser.add_argument("--no-atomic-step", dest="atomic_step", action="store_false")
    parser.add_argument("--bandwidth-bytes", type=int, default=2**30, help="file size of the bandwidth measurement")
    parser.add_argument("--bandwidth-block", type=int, default=64 * 2**20)
    parser.add_argument("--target", type=float, default=0.8, help="fraction of the disk bound to reach")
    parser.add_argument("--tiny", action="store_true", help="a tiny model to check the script (no target)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 on a missed target")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.width, args.layers, args.steps = 256, 4, 2
        args.buffer_size = min(args.buffer_size, 64 * 1024)
        args.bandwidth_bytes, args.bandwidth_block = 16 * 2**20, 4 * 2**20
    counts = [int(c) for c in args.buffer_counts.split(",")]
    if args.target_buffer_count not in counts:
        counts.append(args.target_buffer_count)
    dtype = DTYPES[args.dtype]
    cleanup = None
    if args.nvme_path is None:
        cleanup = tempfile.TemporaryDirectory(prefix="disk-adam-")
        args.nvme_path = cleanup.name

    print(machine_header())
    print(f"CPU: {_cpu_flags_note()}")
    print(f"disk engine: chunkmem.storage.disk_io, O_DIRECT {'on' if _direct(args.nvme_path) else 'refused: buffered'}; "
          f"nvme_path {args.nvme_path}")
    print(f"model: {args.layers} x a {args.width} x {args.width} weight (forward: input + its sum), {args.dtype}, placement 'cpu', "
          f"offload_optimizer='disk', buffer_size {mib(args.buffer_size)}, atomic_step={args.atomic_step}; "
          f"{args.steps} timed optimizer steps per configuration after 1 warm-up", flush=True)

    bandwidths = [measure_bandwidth(args.nvme_path, args.bandwidth_bytes, args.bandwidth_block)]
    print(f"bandwidth ({bandwidths[0][2]}, {mib(args.bandwidth_bytes)} in {mib(args.bandwidth_block)} I/Os): "
          f"read {bandwidths[0][0] / 1e9:.3f} GB/s, write {bandwidths[0][1] / 1e9:.3f} GB/s", flush=True)
    results = []
    for count in counts:
        res = run_config(args, dtype, count)
        results.append(res)
        bandwidths.append(measure_bandwidth(args.nvme_path, args.bandwidth_bytes, args.bandwidth_block))
        res["read_bw"] = (bandwidths[-2][0] + bandwidths[-1][0]) / 2
        res["write_bw"] = (bandwidths[-2][1] + bandwidths[-1][1]) / 2
        print(f"  buffer_count {count}: steps " + ", ".join(f"{t:.2f}" for t in res["times"]) + " s; bandwidth after: "
              f"read {bandwidths[-1][0] / 1e9:.3f} GB/s, write {bandwidths[-1][1] / 1e9:.3f} GB/s", flush=True)
    if cleanup is not None:
        cleanup.cleanup()

    first = results[0]
    n, elements = first["params"], first["elements"]
    formula = STATE_BYTES * elements
    bytes_ok = all(r == formula and w == formula for res in results for r, w in zip(res["reads"], res["writes"]))
    print()
    print(f"parameters {n:,} ({n / 1e6:.1f}M) in trainable chunks of {elements:,} elements (with padding); "
          f"state on disk {gib(sum(first['disk'].values()))} ("
          + ", ".join(f"{k} {mib(v)}" for k, v in first["disk"].items())
          + f"), files {gib(first['files'])}; optimizer get_memory_usage(with_disk=True) = "
            f"{tuple(first['usage'])}")
    print(f"bytes per step (ledger): read {first['reads'][0]:,}, written {first['writes'][0]:,}; formula "
          f"12 B x {elements:,} = {formula:,} each way: {'MATCH' if bytes_ok else 'MISMATCH'}")
    print(f"disk bound of a step = {formula / 1e9:.3f} GB / read bandwidth + {formula / 1e9:.3f} GB / write bandwidth "
          f"(each row: the mean of the measurements just before and after it)")
    print()
    print(f"| buffer_count | I/O buffers (host) | read / write GB/s | bound (s) | step, median (s) | steps (s) | "
          f"params/s | bound params/s | % of bound |")
    print(f"|---|---|---|---|---|---|---|---|---|")
    target_row = None
    for res in results:
        bound_s = formula / res["read_bw"] + formula / res["write_bw"]
        frac = bound_s / res["median"]
        if res["buffer_count"] == args.target_buffer_count:
            target_row = (res, frac)
        print(f"| {res['buffer_count']} | {mib(res['io_buffers'])} | {res['read_bw'] / 1e9:.3f} / "
              f"{res['write_bw'] / 1e9:.3f} | {bound_s:.2f} | {res['median']:.2f} | "
              + ", ".join(f"{t:.2f}" for t in res["times"])
              + f" | {n / res['median'] / 1e6:.1f}M | {n / bound_s / 1e6:.1f}M | {100 * frac:.1f}% |")
    skipped = sum(r["skipped"] for r in results)
    if skipped:
        print(f"note: {skipped} step(s) skipped for overflow (fp16 loss scale): their time is not an update's")
    print(f"peak RSS {gib(peak_rss_bytes())}")
    res, frac = target_row
    if not bytes_ok:
        print("FAIL  the ledger's disk bytes differ from the formula")
        return 1
    if args.tiny:
        print("TINY run done (no target)")
        return 0
    ok = frac >= args.target
    print(f"{'PASS' if ok else 'MISS'}  buffer_count {res['buffer_count']}: {n / res['median'] / 1e6:.1f}M params/s "
          f"= {100 * frac:.1f}% of the disk bound (target >= {100 * args.target:.0f}%)")
    return 0 if ok or args.no_fail else 1


def _direct(directory: str) -> bool:
    """Whether the engine uses ``O_DIRECT`` in ``directory`` (a throwaway scratch space)."""
    with disk_io.ScratchSpace(directory) as space:
        space.file("probe", disk_io.ALIGNMENT)
        return space.direct


def _cpu_flags_note() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return "flags " + (", ".join(have) or "none of avx2/avx512") + " (the host Adam kernel is vectorised with these)"


if __name__ == "__main__":
    sys.exit(main())
