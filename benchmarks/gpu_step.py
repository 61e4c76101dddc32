"""Step time, peak GPU memory and bytes moved per step of chunkmem, plain PyTorch and two offloading peers on a GPU.

First the parent measures the PCIe bandwidth (256 MiB buffers, median of 5 copies after 2 warm-ups, GB/s = 1e9
bytes/s): host->device and device->host from pinned and from pageable host memory, and both directions at once
(pinned, one copy each way on two streams, each direction timed on its own stream).

Then each row trains the same GPT (:mod:`chunkmem.gpt`) in a process of its own, inputs on the GPU,
``torch.cuda.synchronize()`` before every clock read. A row is ``<config> <dtype>[ sib]``; ``fp32`` trains in fp32,
``bf16`` in bfloat16 without a loss scale (``fp16``, outside the plans, starts its loss scale at 2**16 as
``GradScaler`` does and the table counts the timed steps each skipped on an overflow):

* ``plain``: the model on the GPU, ``torch.optim.AdamW(fused=True)``; ``bf16`` runs the same fp32 model and
  optimizer under ``torch.autocast("cuda", bfloat16)`` (fp32 master weights: what a mixed-precision user of plain
  PyTorch runs). The baseline of the rows of its dtype;
* ``cm-<placement>`` (``cuda``, ``cpu``, ``auto``): ``ShardedModelV2(tensor_placement_policy=<placement>,
  dtype=<dtype>)`` + ``ShardedOptimizerV2(HybridAdam)`` (fp32 masters in the optimizer); ``auto`` runs under a
  device-tier capacity of ``--auto-bytes-per-param`` bytes per parameter (default 8: half of fp32 parameter,
  gradient and the two Adam moments) so that chunks move, with ``gpu_margin_mem_ratio=--margin`` (default 0.0; recorded in the row); ``sib``: with
  ``step_in_backward=True``;
* ``cm-optim-offload``: ``tensor_placement_policy="static"`` with ``offload_optim_frac=1.0``: the parameters rest
  on the GPU, gradients and the Adam step on the host (the split torchao's ``CPUOffloadOptimizer`` makes);
* ``fsdp2-offload``: PyTorch FSDP2 on one rank (an NCCL group of one): ``fully_shard`` with ``CPUOffloadPolicy``
  on every transformer block, then on the root; the model is built on the CPU (the sharded parameters, gradients
  and the optimizer state stay in pinned host memory), ``torch.optim.AdamW(fused=True)`` on the CPU parameters
  (``foreach=True`` where fused is refused: the row's ``optimizer`` says which); ``bf16``:
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
* ``torchao-offload``: the model on the GPU, ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW,
  fused=True)`` (the optimizer state and step on the host, gradients kept on the GPU); ``bf16`` under autocast
  as ``plain``. Without torchao the row fails ("no torchao") and the run goes on.

Bytes moved are ``model.memory_stats()["totals"]`` of the last iteration (chunk copies between the GPU and the
host; none for the peers, whose copies are not counted); peak GPU memory is ``torch.cuda.max_memory_allocated()``
over the whole run (model, optimizer, activations); ``host waits/step`` and ``pinned bytes`` come from
``memory_stats()["copy_engine"]`` where chunkmem reports it. The bound of a row is the step it would take were
its copies fully overlapped with compute at the measured concurrent bandwidth:

    bound_ms = max(plain_ms of the same dtype, to_device_bytes / h2d_both_at_once, to_host_bytes / d2h_both_at_once)

and ``x bound`` is the row's step over it (none where the bytes are not known). Rows start only while the
elapsed time plus the longest row so far (40 s before any) fits ``--total-limit``; the rest are listed as skipped.
The results go to ``--json`` (default ``benchmarks/results/<gpu>-<date>.json``, and to ``$OUT/gpu_step.json``
where ``$OUT`` is a directory), written again after every row. Needs CUDA; prints tables and exits 0 (the
figures are for the README, no target is held).

    python benchmarks/gpu_step.py                 # 350M: the targets plan (target rows first); 50M: plain against cm-cuda (fp32)
    python benchmarks/gpu_step.py --sizes 350m --plan quick
    python benchmarks/gpu_step.py --sizes 350m --configs plain:bf16,cm-cpu:bf16:sib,fsdp2-offload:bf16
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

SCRIPT_START = time.perf_counter()  # before torch's import: --total-limit counts it

import _gpt  # noqa: E402
import _step_profile  # noqa: E402

RESULT_TAG = "GPU_STEP_RESULT "
SIZES = {
    # vocab, d_model, layers, heads, seq, batch
    "50m": dict(vocab=8192, d=768, layers=6, heads=12, seq=128, batch=2),
    "350m": dict(vocab=32768, d=1024, layers=24, heads=16, seq=512, batch=8),
}
CONFIGS = ("plain", "cm-cuda", "cm-cpu", "cm-auto", "cm-optim-offload", "fsdp2-offload", "torchao-offload")
DTYPES = ("fp32", "bf16", "fp16")
PER_DTYPE = ("cm-cuda", "cm-cpu", "cm-cpu:sib", "cm-auto", "cm-auto:sib", "cm-cuda:sib", "cm-optim-offload",
             "cm-optim-offload:sib", "fsdp2-offload", "torchao-offload")
PLANS = {
    "full": ["plain:fp32", "plain:bf16"] + [f"{c.split(':')[0]}:{d}" + (":sib" if c.endswith(":sib") else "")
                                           for d in ("fp32", "bf16") for c in PER_DTYPE],
    "quick": ["plain:fp32", "plain:bf16", "cm-cpu:fp32", "cm-cpu:bf16", "fsdp2-offload:fp32", "fsdp2-offload:bf16",
              "torchao-offload:fp32", "torchao-offload:bf16"],
    "small": ["plain:fp32", "cm-cuda:fp32"],
    # the rows the targets name first, then their peers, then the rest: what a call of limited time gets to
    "targets": ["plain:fp32", "cm-cpu:fp32", "cm-cpu:fp32:sib", "plain:bf16", "cm-cpu:bf16", "cm-auto:bf16",
                "torchao-offload:fp32", "cm-optim-offload:fp32", "cm-optim-offload:fp32:sib", "torchao-offload:bf16",
                "fsdp2-offload:fp32", "fsdp2-offload:bf16", "cm-cuda:fp32", "cm-cuda:bf16", "cm-cpu:bf16:sib",
                "cm-optim-offload:bf16", "cm-optim-offload:bf16:sib", "cm-auto:fp32", "cm-auto:fp32:sib",
                "cm-auto:bf16:sib", "cm-cuda:fp32:sib", "cm-cuda:bf16:sib"],
}
DEFAULT_PLAN = {"50m": "small", "350m": "targets"}
# rows profiled by default: the bf16 rows whose forward took longer in `cuda` placement (43.9 ms) than in `cpu`
# placement (29.9 ms) on the H200, their baseline, and the fp32 `cpu` row the first target names
PROFILED = ("plain:bf16", "cm-cuda:bf16", "cm-cpu:bf16", "cm-cpu:fp32")
AUTO_CAPACITY_BYTES_PER_PARAM = 8
INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler's
LR, WEIGHT_DECAY = 1e-3, 0.01
BW_BYTES, BW_WARMUP, BW_REPEATS = 256 * 2**20, 2, 5
FIRST_ROW_ESTIMATE_S = 40.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- rows ------------------------------------------------------------------------------------------------

def parse_row(text: str) -> tuple[str, str, bool]:
    """``config:dtype[:sib]`` -> ``(config, dtype, step_in_backward)``."""
    parts = text.strip().split(":")
    if not 2 <= len(parts) <= 3 or parts[0] not in CONFIGS or parts[1] not in DTYPES \
            or (len(parts) == 3 and parts[2] != "sib"):
        raise ValueError(f"row {text!r}: expected config:dtype[:sib], config one of {', '.join(CONFIGS)}, "
                         f"dtype one of {', '.join(DTYPES)}")
    sib = len(parts) == 3
    if sib and not parts[0].startswith("cm-"):
        raise ValueError(f"row {text!r}: sib (step_in_backward) is a chunkmem option")
    return parts[0], parts[1], sib


def row_name(config: str, dtype: str, sib: bool) -> str:
    return f"{config} {dtype}" + (" sib" if sib else "")


def device_slug(name: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", name.lower())).strip("-")


def bound_ms(plain_ms: float | None, to_device: int | None, to_host: int | None, bw: dict | None) -> float | None:
    """The step with every copy overlapped with compute at the measured concurrent bandwidth (GB/s)."""
    if plain_ms is None or to_device is None or to_host is None or not bw:
        return None
    return max(plain_ms, to_device / (bw["h2d_both"] * 1e9) * 1e3, to_host / (bw["d2h_both"] * 1e9) * 1e3)


def write_json(doc: dict, path: str) -> list[str]:
    """Write ``doc`` to ``path`` (atomically) and a copy to ``$OUT/gpu_step.json`` where ``$OUT`` is a folder."""
    paths = [path]
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        copy = os.path.join(out, "gpu_step.json")
        if os.path.abspath(copy) != os.path.abspath(path):
            paths.append(copy)
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        tmp = p + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, p)
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the child: one row ----------------------------------------------------------------------------------

def child(row: str, size: str, warmup: int, steps: int, limit: float, margin: float,
          auto_bytes_per_param: float = AUTO_CAPACITY_BYTES_PER_PARAM, profile: bool = False) -> dict:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(limit, exit=True)  # a configuration that hangs shows where
    import torch.nn.functional as F

    config, dtype_name, sib = parse_row(row)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    spec = SIZES[size]
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    net = _gpt.GPT(_gpt.GPTConfig(spec["vocab"], spec["d"], spec["layers"], spec["heads"], spec["seq"]))
    n_params = sum(p.numel() for p in net.parameters())
    out = dict(config=config, dtype=dtype_name, step_in_backward=sib, n_params=n_params)
    torch.cuda.reset_peak_memory_stats()
    model = None
    autocast = dtype != torch.float32

    def lossf(logits, y):
        return F.cross_entropy(logits.float().reshape(-1, spec["vocab"]), y.reshape(-1))

    if config in ("plain", "torchao-offload"):
        net = net.cuda()
        if config == "plain":
            optim = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
            out["optimizer"] = "AdamW(fused=True)"
        else:
            try:
                from torchao.optim import CPUOffloadOptimizer
            except ImportError:
                return dict(out, error="failed (no torchao)")
            import torchao
            optim = CPUOffloadOptimizer(net.parameters(), torch.optim.AdamW, fused=True, lr=LR,
                                        weight_decay=WEIGHT_DECAY)
            out["optimizer"] = f"torchao {torchao.__version__} CPUOffloadOptimizer(AdamW, fused=True)"
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

        def train_step(x, y):
            with torch.autocast("cuda", dtype=dtype, enabled=autocast):
                loss = lossf(net(x), y)
            stepped = True
            if scaler is not None:
                scale = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.step(optim)
                scaler.update()
                stepped = scaler.get_scale() >= scale  # a skipped step backs the scale off
            else:
                loss.backward()
                optim.step()
            optim.zero_grad()
            return loss, stepped
    elif config == "fsdp2-offload":
        import torch.distributed as dist
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
        mp = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if autocast
              else MixedPrecisionPolicy())
        for block in net.blocks:
            fully_shard(block, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        fully_shard(net, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
        opt_kind = {"name": "fused"}

        def make_optim(**kind):
            return torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kind)

        try:
            optim = make_optim(fused=True)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            optim, opt_kind["name"] = make_optim(foreach=True), f"foreach=True; fused refused: {str(e)[:120]}"

        def train_step(x, y):
            nonlocal optim
            loss = lossf(net(x), y)
            loss.backward()
            try:
                optim.step()
            except (RuntimeError, NotImplementedError) as e:  # fused refused on the first step: once, then foreach
                if opt_kind["name"] != "fused":
                    raise
                optim, opt_kind["name"] = make_optim(foreach=True), f"foreach=True; fused refused: {str(e)[:120]}"
                optim.step()
            optim.zero_grad(set_to_none=True)
            return loss, True
    else:
        import chunkmem as cm
        placement = config.split("-")[1]
        placed = {}
        if placement == "auto":
            cm.set_device_memory_capacity(int(auto_bytes_per_param * n_params))
            out.update(margin=margin, auto_bytes_per_param=auto_bytes_per_param)
        elif placement == "optim":  # torchao's split: parameters rest on the GPU, gradients and Adam on the host
            placement, placed = "static", dict(offload_param_frac=0.0, offload_optim_frac=1.0)
        model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=placement, dtype=dtype,
                                  **placed)
        kw = dict(step_in_backward=sib)
        if placement == "auto":
            kw["gpu_margin_mem_ratio"] = margin
        if dtype == torch.float16:
            # the loss scale GradScaler starts from: the reference's default, 2**32, overflows (and skips) for
            # the first thirty-odd steps, which would time skipped steps against plain's updates
            kw["initial_scale"] = INITIAL_SCALE
        optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY), **kw)
        out["optimizer"] = "ShardedOptimizerV2(HybridAdam)"

        update_chunk = optim.update_rule.update

        def timed_update(chunk, multiplier):  # the host timeline of a step (see host_timeline)
            began = time.perf_counter()
            update_chunk(chunk, multiplier)
            host_marks["updates"].append((chunk.name, began, time.perf_counter()))

        optim.update_rule.update = timed_update

        def train_step(x, y):
            host_marks.clear()
            host_marks["updates"] = []
            loss = lossf(model(x), y)
            host_marks["forward returned"] = time.perf_counter()
            optim.backward(loss)
            host_marks["backward returned"] = time.perf_counter()
            stepped = optim.step()
            host_marks["step returned"] = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            return loss, stepped

    host_marks: dict = {}  # what train_step records of a chunkmem step on the host (perf_counter seconds)
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
            if model is not None:
                out["host_timeline_ms"] = host_timeline(host_marks, optim, t0, t0 + times[-1])
        print(f"{row} step {i}: {time.perf_counter() - t0:.3f} s", file=sys.stderr, flush=True)
    if model is not None:  # one more step, synchronized between its phases: where a chunkmem step's time goes
        tokens = data[0]
        marks = [time.perf_counter()]
        for phase in ("forward", "backward", "step"):
            if phase == "forward":
                phase_loss = lossf(model(tokens[:, :-1]), tokens[:, 1:])
            elif phase == "backward":
                optim.backward(phase_loss)
            else:
                optim.step()
                optim.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
        out["phases_ms"] = {p: round((b - a) * 1e3, 1) for p, a, b in zip(("forward", "backward", "step"),
                                                                          marks, marks[1:])}
    if profile:  # one more step under torch's profiler (_step_profile)
        tokens, held = data[1], {}
        if model is not None:
            phases = [("forward", lambda: held.update(loss=lossf(model(tokens[:, :-1]), tokens[:, 1:]))),
                      ("backward", lambda: optim.backward(held["loss"])),
                      ("step", lambda: (optim.step(), optim.zero_grad(set_to_none=True)))]
        else:
            phases = [("step", lambda: train_step(tokens[:, :-1], tokens[:, 1:]))]
        out["profile"] = _step_profile.profile_step(phases, row)
    out.update(times=times, skipped=skipped, loss=float(loss.detach()),
               peak_gpu_bytes=torch.cuda.max_memory_allocated(), torch=torch.__version__,
               gpu=torch.cuda.get_device_name(), to_device=None, to_host=None, host_waits_per_step=None,
               pinned_bytes=None)
    if config == "fsdp2-offload":
        out["optimizer"] = "AdamW(fused=True)" if opt_kind["name"] == "fused" else f"AdamW({opt_kind['name']})"
        import torch.distributed as dist
        dist.destroy_process_group()
    if model is not None:
        stats = model.memory_stats()
        totals = stats["totals"]
        out.update(to_device=totals["moved_to_device_bytes"], to_host=totals["moved_to_host_bytes"],
                   chunks=len(model.chunks), chunk_bytes=model.layout.chunk_bytes,
                   traces=f"{stats['traces']} of {stats['iterations']} iterations traced")
        engine = stats.get("copy_engine")
        if engine is not None:
            out["host_waits_per_step"] = sum(engine.get("host_waits", {}).values()) / (warmup + steps)
            out["pinned_bytes"] = engine.get("pinned_bytes")
            out["copy_engine"] = engine
    if os.environ.get(HASH_ENV):  # the exactness check: every parameter's bytes
        import hashlib
        digest = hashlib.sha256()
        for name, value in sorted((model or net).state_dict().items()):
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out["params_sha256"] = digest.hexdigest()
    return out


HASH_ENV = "CHUNKMEM_BENCH_HASH"


def host_timeline(marks: dict, optim, t0: float, synchronized: float) -> dict:
    """Where the host was during one timed chunkmem step, in ms from its start: when the forward, backward
    and step calls returned, when the GPU was done (the synchronize after the step), each chunk update the step
    ran (``[name, start, end]``) and, with ``step_in_backward``, each update job of the backward's update thread
    (``[name, handed over, started, ended]``) and the backward's wait for them. A host that ran ahead of the GPU
    returns from the backward long before the synchronize; updates that start before the backward returned on
    the GPU overlapped it."""
    def ms(t):
        return None if t is None else round((t - t0) * 1e3, 1)

    timeline = {name: ms(marks[name]) for name in ("forward returned", "backward returned", "step returned")
                if name in marks}
    timeline["gpu done"] = ms(synchronized)
    timeline["updates"] = [[name, ms(a), ms(b)] for name, a, b in marks.get("updates", [])]
    jobs = optim._backward.host_updates  # (the update thread's record: chunkmem/optim/host_updates.py)
    if jobs.timeline and jobs.timeline[0].submitted >= t0:
        timeline["backward jobs"] = [[j.name, ms(j.submitted), ms(j.started), ms(j.finished)] for j in jobs.timeline]
        timeline["backward joined"] = [ms(t) for t in jobs.joined] if jobs.joined else None
    return timeline


def exactness_check(args: argparse.Namespace) -> list[dict]:
    """The asynchronous copy engine against the synchronous one (``CHUNKMEM_COPY_ENGINE=cuda-sync``): the 50M
    GPT under ``cpu`` placement, fp32 and bf16, with and without ``step_in_backward``, 3 steps each; the
    losses and every parameter's bytes must be equal."""
    results = []
    print("\nexactness: the asynchronous copy engine (cuda) against the synchronous one (cuda-sync), 50M GPT, "
          "cm-cpu, 3 steps", flush=True)
    for row in ("cm-cpu:fp32", "cm-cpu:bf16", "cm-cpu:fp32:sib"):
        got = {}
        for engine in ("cuda-sync", "cuda"):
            env = dict(os.environ, CHUNKMEM_COPY_ENGINE=engine, **{HASH_ENV: "1"})
            cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--size", "50m", "--warmup", "0",
                   "--steps", "3", "--limit", "60", "--margin", "0"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=90)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
            got[engine] = json.loads(line[len(RESULT_TAG):]) if line else {"error": proc.stderr[-500:]}
        a, b = got["cuda-sync"], got["cuda"]
        same = "error" not in a and "error" not in b and a["loss"] == b["loss"] and a["params_sha256"] == b["params_sha256"]
        results.append(dict(row=row, bitwise_equal=same, loss_sync=a.get("loss"), loss_async=b.get("loss"),
                            error=a.get("error") or b.get("error")))
        print(f"  {row:<18} bitwise equal: {'yes' if same else 'NO'}  (losses {a.get('loss')} / {b.get('loss')})"
              + (f" error: {results[-1]['error']}" if results[-1]["error"] else ""), flush=True)
    return results


# ---- the parent ------------------------------------------------------------------------------------------

def measure_bandwidth() -> dict:
    """PCIe copy bandwidth in GB/s (1e9 bytes/s): medians of BW_REPEATS timed copies after BW_WARMUP."""
    import torch

    n = BW_BYTES
    pinned = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    pageable = torch.ones(n, dtype=torch.uint8)  # touched: no first-touch page faults in the timing
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for t in pinned + dev:
        t.fill_(1)

    def timed(copy) -> float:
        rates = []
        for i in range(BW_WARMUP + BW_REPEATS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            if i >= BW_WARMUP:
                rates.append(n / (time.perf_counter() - t0) / 1e9)
        return statistics.median(rates)

    bw = dict(h2d_pinned=timed(lambda: dev[0].copy_(pinned[0], non_blocking=True)),
              d2h_pinned=timed(lambda: pinned[0].copy_(dev[0], non_blocking=True)),
              h2d_pageable=timed(lambda: dev[0].copy_(pageable)),
              d2h_pageable=timed(lambda: pageable.copy_(dev[0])))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    h2d, d2h, both = [], [], []
    for i in range(BW_WARMUP + BW_REPEATS):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            ev[0].record()
            dev[0].copy_(pinned[0], non_blocking=True)
            ev[1].record()
        with torch.cuda.stream(streams[1]):
            ev[2].record()
            pinned[1].copy_(dev[1], non_blocking=True)
            ev[3].record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if i >= BW_WARMUP:
            h2d.append(n / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e9)
            d2h.append(n / (ev[2].elapsed_time(ev[3]) / 1e3) / 1e9)
            both.append(2 * n / wall / 1e9)
    bw.update(h2d_both=statistics.median(h2d), d2h_both=statistics.median(d2h),
              sum_both=statistics.median(both))
    del pinned, pageable, dev
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {k: round(v, 3) for k, v in bw.items()}


def print_bandwidth(bw: dict) -> None:
    print(f"PCIe bandwidth, GB/s ({BW_BYTES // 2**20} MiB buffers, median of {BW_REPEATS} after {BW_WARMUP} "
          f"warm-ups):")
    print(f"  {'':<22} {'host->GPU':>10} {'GPU->host':>10}")
    print(f"  {'pinned':<22} {bw['h2d_pinned']:10.2f} {bw['d2h_pinned']:10.2f}")
    print(f"  {'pageable':<22} {bw['h2d_pageable']:10.2f} {bw['d2h_pageable']:10.2f}")
    print(f"  {'pinned, both at once':<22} {bw['h2d_both']:10.2f} {bw['d2h_both']:10.2f}   "
          f"(together {bw['sum_both']:.2f} over the wall clock)", flush=True)


def run_child(row: str, size: str, args: argparse.Namespace, time_left: float) -> dict:
    """Run one row in a process of its own; returns its result, or ``{"error": ...}``."""
    limit = max(1.0, min(args.limit, time_left - 2))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--size", size, "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--limit", str(limit), "--margin", str(args.margin),
           "--auto-bytes-per-param", str(args.auto_bytes_per_param)] + (["--profile-this"] if row in args.profile else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, time_left))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {time.perf_counter() - start:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    sys.stderr.write(f"--- {size} {row} failed (status {proc.returncode}) after "
                     f"{time.perf_counter() - start:.0f} s:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}\n")
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    # the exception's line, or faulthandler's timeout line where the child was stopped
    last = next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)
                 or ln.startswith("Timeout")), lines[-1] if lines else "")
    return {"error": f"failed ({proc.returncode}): {last[:200]}"}


def make_row(config: str, dtype: str, sib: bool, size: str, r: dict, plain: dict | None, bw: dict | None,
             wall_s: float | None) -> dict:
    """The JSON row: the child's result with the derived figures (``None`` where unknown)."""
    row = dict(config=config, dtype=dtype, step_in_backward=sib, name=row_name(config, dtype, sib), size=size,
               step_ms=None, ratio=None, bound_ms=None, x_bound=None, to_device_mib=None, to_host_mib=None,
               host_waits_per_step=None, pinned_bytes=None, loss=None, peak_gpu_gib=None, skipped=None,
               wall_s=None if wall_s is None else round(wall_s, 1))
    extra = {k: v for k, v in r.items() if k not in ("config", "dtype", "step_in_backward")}
    if r.get("error") or "times" not in r:
        row.update(extra)
        row.setdefault("error", "no result")
        return row
    step = statistics.median(r["times"]) * 1e3
    plain_ms = plain["step_ms"] if plain and plain.get("step_ms") is not None else None
    to_device, to_host = r.get("to_device"), r.get("to_host")
    if config == "plain":  # its own baseline; copies nothing
        plain_ms, to_device, to_host = round(step, 2), 0, 0
    bound = bound_ms(plain_ms, to_device, to_host, bw)
    row.update(extra)
    row.update(step_ms=round(step, 2), ratio=None if plain_ms is None else round(step / plain_ms, 4),
               bound_ms=None if bound is None else round(bound, 2),
               x_bound=None if bound is None else round(step / bound, 4),
               to_device_mib=None if r.get("to_device") is None else round(r["to_device"] / 2**20, 1),
               to_host_mib=None if r.get("to_host") is None else round(r["to_host"] / 2**20, 1),
               loss=round(r["loss"], 5), peak_gpu_gib=round(r["peak_gpu_bytes"] / 2**30, 3),
               times_ms=[round(t * 1e3, 2) for t in r["times"]])
    del row["times"]
    return row


def fmt(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{spec}}"


def print_header() -> None:
    print(f"{'row':<22} {'step ms':>9} {'x base':>7} {'bound ms':>9} {'x bound':>8} {'peak GPU GiB':>13} "
          f"{'to GPU MiB':>11} {'to host MiB':>12} {'waits/step':>10} {'loss':>8} {'skipped':>8}", flush=True)


def print_row(row: dict) -> None:
    if row.get("step_ms") is None:
        print(f"{row['name']:<22} {row.get('error', 'failed')}", flush=True)
        return
    print(f"{row['name']:<22} {row['step_ms']:9.1f} {fmt(row['ratio'], '.3f', 7)} {fmt(row['bound_ms'], '.1f', 9)} "
          f"{fmt(row['x_bound'], '.3f', 8)} {row['peak_gpu_gib']:13.2f} {fmt(row['to_device_mib'], '.1f', 11)} "
          f"{fmt(row['to_host_mib'], '.1f', 12)} {fmt(row['host_waits_per_step'], '.1f', 10)} {row['loss']:8.4f} "
          f"{row['skipped']:>8}" + (" " + str(row["phases_ms"]) if row.get("phases_ms") else ""), flush=True)
    if row.get("profile"):
        print(f"{'':<22} " + _step_profile.format_summary(row["profile"]), flush=True)
    timeline = row.get("host_timeline_ms")
    if timeline:
        spans = [(u[1], u[2]) for u in timeline["updates"]] + [(j[2], j[3]) for j in timeline.get("backward jobs", [])]
        spans = [(a, b) for a, b in spans if a is not None and b is not None]
        print(f"{'':<22} host ms: forward returned {timeline.get('forward returned')}, backward returned "
              f"{timeline.get('backward returned')}, step returned {timeline.get('step returned')}, GPU done "
              f"{timeline['gpu done']}" + (f"; updates {min(a for a, _ in spans)}..{max(b for _, b in spans)} "
                                           f"({len(spans)})" if spans else ""), flush=True)


def git_commit() -> str:
    """``CHUNKMEM_COMMIT`` where the caller set it (the device tool's copy of a checkout carries a stale
    ``.git``: name the commit in the command), else HEAD, with ``-dirty`` where the tree differs from it."""
    if os.environ.get("CHUNKMEM_COMMIT"):
        return os.environ["CHUNKMEM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, timeout=30).returncode != 0
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50m,350m", help="comma-separated, of " + ", ".join(SIZES))
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row")
    parser.add_argument("--plan", choices=sorted(PLANS), default=None,
                        help="rows to run (default: targets for 350m (the rows the targets name first, then peers, then the rest), small (plain fp32, cm-cuda fp32) for 50m)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated rows config:dtype[:sib] (e.g. plain:fp32,cm-cpu:bf16:sib); "
                             "overrides --plan; configs: " + ", ".join(CONFIGS))
    parser.add_argument("--margin", type=float, default=0.0, help="gpu_margin_mem_ratio of the cm-auto rows")
    parser.add_argument("--auto-bytes-per-param", type=float, default=AUTO_CAPACITY_BYTES_PER_PARAM,
                        help="the device-tier capacity of the cm-auto rows, in bytes per parameter (default "
                             f"{AUTO_CAPACITY_BYTES_PER_PARAM})")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="seconds a row may run before it is stopped with a traceback (default 60)")
    parser.add_argument("--total-limit", type=float, default=420.0,
                        help="seconds the whole run may take; rows that would not fit are skipped (default 420)")
    parser.add_argument("--json", default=None,
                        help="results file (default benchmarks/results/<gpu>-<date>.json; "
                             "a copy goes to $OUT/gpu_step.json where $OUT is a directory)")
    parser.add_argument("--exactness", action="store_true",
                        help="first check the asynchronous copy engine bitwise against the synchronous one")
    parser.add_argument("--profile", default=",".join(PROFILED), type=lambda text: [r for r in text.split(",") if r],
                        help="comma-separated rows (as --configs) that run one more step under torch's profiler "
                             "(benchmarks/_step_profile.py; the summary in the row's JSON, the trace under $OUT); "
                             f"default {','.join(PROFILED)}; '' for none")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--profile-this", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(RESULT_TAG + json.dumps(child(args.child, args.size, args.warmup, args.steps, args.limit,
                                            args.margin, args.auto_bytes_per_param, args.profile_this)), flush=True)
        return 0
    sizes = args.sizes.split(",")
    for size in sizes:
        if size not in SIZES:
            parser.error(f"--sizes: {size!r} is none of {', '.join(SIZES)}")
    try:
        explicit = [parse_row(r) for r in args.configs.split(",")] if args.configs else None
    except ValueError as e:
        parser.error(f"--configs: {e}")
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs CUDA (the CPU figures come from wrapper_overhead.py)")
    gpu = torch.cuda.get_device_name()
    today = datetime.date.today().isoformat()
    json_path = args.json or os.path.join(REPO, "benchmarks", "results", f"{device_slug(gpu)}-{today}.json")
    print(f"{_gpt.machine_header()}; GPU {gpu}")
    bw = measure_bandwidth()
    print_bandwidth(bw)
    models = []
    for size in sizes:
        spec = SIZES[size]
        n = _gpt.count_params(_gpt.GPTConfig(spec["vocab"], spec["d"], spec["layers"], spec["heads"], spec["seq"]))
        models.append(dict(size=size, **spec, n_params=n))
    doc = dict(device=gpu, date=today, commit=git_commit(), host_cpu=_gpt.cpu_kind(), torch=torch.__version__,
               bandwidth_gbps=bw, model=models[0], models=models, warmup=args.warmup, steps=args.steps,
               margin=args.margin, auto_bytes_per_param=args.auto_bytes_per_param, total_limit_s=args.total_limit, rows=[])
    if args.exactness:
        doc["exactness"] = exactness_check(args)
    written = write_json(doc, json_path)
    print(f"timing: {args.warmup} warm-up + {args.steps} timed steps per row, one process each; step ms = median; "
          f"moved = chunk bytes copied host->GPU / GPU->host in the last iteration; bound = max(plain of the dtype, "
          f"moved / concurrent bandwidth); results: {', '.join(written)}")
    longest = None
    for size, model in zip(sizes, models):
        print(f"\n{size}: GPT vocab {model['vocab']}, d {model['d']}, {model['layers']} layers, seq {model['seq']}, "
              f"batch {model['batch']}: {model['n_params'] / 1e6:.1f}M parameters")
        print_header()
        rows = explicit or [parse_row(r) for r in PLANS[args.plan or DEFAULT_PLAN.get(size, "small")]]
        plains: dict[str, dict] = {}
        skipped_rows = []
        for config, dtype, sib in rows:
            elapsed = time.perf_counter() - SCRIPT_START
            estimate = longest if longest is not None else FIRST_ROW_ESTIMATE_S
            if skipped_rows or elapsed + estimate > args.total_limit:
                skipped_rows.append(row_name(config, dtype, sib))
                row = make_row(config, dtype, sib, size, {"error": "skipped: time"}, None, bw, None)
            else:
                t0 = time.perf_counter()
                r = run_child(f"{config}:{dtype}" + (":sib" if sib else ""), size, args,
                              args.total_limit - elapsed)
                wall = time.perf_counter() - t0
                longest = max(longest or 0.0, wall)
                row = make_row(config, dtype, sib, size, r, plains.get(dtype), bw, wall)
                if config == "plain" and row["step_ms"] is not None:
                    plains[dtype] = row
                print_row(row)
            doc["rows"].append(row)
            write_json(doc, json_path)
        if skipped_rows:
            print(f"skipped (--total-limit {args.total_limit:.0f} s): {', '.join(skipped_rows)}", flush=True)
    print("(x base: against plain of the same dtype; x bound: against bound ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
