"""Host Adam update of one chunk against the machine's memory-bandwidth bound (issue 5).

The update of a mixed-precision chunk reads the 16-bit gradient (2 bytes a parameter) and the fp32
master, exp_avg and exp_avg_sq (12), and writes those three (12) and the 16-bit parameter copy (2):
28 bytes a parameter at the least. The bound is those 28 bytes at the bandwidth of a "4 reads, 3
writes" in-place fp32 streaming kernel (``a, b, c = (a, b, c) * 0.5 + d``, also 28 bytes an element)
from the same C++ library, measured in the same run, with the same threads (``torch.get_num_threads()``).

Configurations, each over ``--params`` parameters (default 50M):

* ``bound``     the streaming kernel;
* ``(a) fp16``  chunkmem one pass: fp16 gradient in, AdamW with loss-scale removal (x 1/1024), fp16 copy out;
* ``(b) bf16``  the same with bf16;
* ``(c) torch`` ``torch._fused_adamw_`` on fp32 (the kernel of ``AdamW(fused=True)``, unscaling by its
  ``grad_scale`` as GradScaler does) plus separate conversions: fp16 gradient -> fp32 temporary before,
  fp32 master -> fp16 copy after;
* ``(-) ops``   chunkmem's torch-op formulation (``adam_update_torch_``, the path before the kernel and the
  fallback), fp16 in and out;
* ``(d) fp32``  fp32 only (fp32 gradient, no copy): chunkmem one pass (the variant fp32 training runs: the
  one that reproduces a torch AdamW bit for bit, see ``host_adam_ext.fp32_reference``) against
  ``torch.optim.AdamW(fused=True)`` on one flat tensor; also 28 bytes a parameter.
* ``(p) torch.compile``  peers: the same AdamW arithmetic written as tensor expressions and compiled by
  ``torch.compile`` (inductor) into one pass over the same arrays, for fp16, bf16 and fp32 gradients
  (``--no-compile`` leaves them out; compiling takes some 10-60 s).

* ``(8) 8-bit``  issue 40: chunkmem's one-pass update with blockwise 8-bit moments (bf16 gradient in, fp32
  master, codes and block scales, bf16 copy out: 16 bytes a parameter and 1/16 of scales), against torchao's
  ``AdamW8bit`` step on one flat fp32 parameter (its ``single_param_adam``, compiled as its optimizer compiles
  it; the same 16 bytes); target: 85% of the bound.

* ``(u) undo``  informational: ``step_in_backward``'s undo copy (the fp32 master and both moments, 12 bytes a
  parameter) with the bf16 update, as a pass of its own (torch's ``copy_``: 24 bytes more, the state read
  twice) and inside the update's pass (``undo=``: each block copied with streaming stores as the update
  reads it, 12 bytes more); "% of bound" counts each row's own bytes.

* ``threads``  informational, where the kernel runs on torch's OpenMP threads: the fp32 update right after
  a parallel torch operator (``torch.add`` over 4M elements) and right after a pause, on those threads
  against the same source built without OpenMP (threads started per update), each as a ratio to the
  ``torch.compile`` pass after the same predecessor (``--no-threads`` leaves it out; the first run builds
  the second library, some ten seconds).

* ``instruction sets``  informational, where the CPU has AVX-512: the update's compute speed on one thread
  over 1M elements in the cache, its AVX-512 body against its AVX2 one, per gradient dtype.

* ``(i) same traffic``  informational: the memory traffic of (a) exactly (fp16 stream in, three fp32
  streams in place, fp16 stream out with streaming stores) with trivial arithmetic, i.e. (a) with free
  arithmetic.

Note that the bound kernel reads 16 bytes and writes 12 per element, the mixed update reads 14 and
writes 14 (the 16-bit copy with streaming stores, which need no read for ownership): where reads are
the scarcer resource, as on the machine this was written on, the update can run faster than the
bound, and the "same traffic" row is the tighter reference.

Every round runs every configuration once, in an order shuffled from round to round (fixed seed), each
right after a run of the bound kernel, so that slow phases of a shared machine, and whatever one
configuration leaves behind for the next, fall on all of them alike.
Times are medians over rounds; "% of bound" is the median over all runs of (the bound's time just
before) / (the configuration's time). Exit status 1 if (a) or (d) is below 95% of the bound, (8) below 85%, or if a
chunkmem row is slower than the torch.compile row of its dtype (``--no-fail``: always 0).

Usage::

    python benchmarks/host_adam.py                  # 50M parameters, 11 rounds: well under 2 minutes
    python benchmarks/host_adam.py --params 10m --rounds 21
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

import _gpt
from chunkmem.core import native_build
from chunkmem.optim import host_adam_ext, low_bit_adam
from chunkmem.optim.adam_math import AdamHyper, adam_update_torch_

TARGET = 0.95
A16, B16, D32 = "(a) chunkmem one-pass fp16 -> fp16", "(b) chunkmem one-pass bf16 -> bf16", "(d) chunkmem one-pass fp32"
D32_PEER = "(p) torch.compile single pass fp32"
LOSS_SCALE = 1024.0
LOW_BIT = "(8) chunkmem 8-bit one-pass bf16 -> bf16"
LOW_BIT_BYTES = 16 + 1 / 16  # gradient 2, master 8, codes 4, copy 2; two scales of 4 bytes per 256 elements, read and written
LOW_BIT_TARGET = 0.85


def parse_count(text: str) -> int:
    text = text.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def _adamw_single_pass(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       out: torch.Tensor | None, *, mult: float, decay: float, w: float, beta2: float, omb2: float,
                       bc2s: float, eps: float, nss: float) -> None:
    """AdamW on flat buffers written as one expression per buffer, for torch.compile to fuse into a
    single pass (the peer rows): the same arithmetic as chunkmem's kernel."""
    g = grad.float() * mult
    p = master * decay
    m = exp_avg + w * (g - exp_avg)
    v = exp_avg_sq * beta2 + omb2 * g * g
    p = p + nss * m / (v.sqrt() / bc2s + eps)
    master.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(p)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def threads_comparison(kernel: host_adam_ext.HostAdamKernel, state: tuple, peer, rounds: int) -> None:
    """The fp32 update (``state``: master, gradient, exp_avg, exp_avg_sq, hyper) on torch's OpenMP threads
    against the same source built without OpenMP, right after a parallel torch operator and right after a
    pause, as ratios to the compiled pass (``peer``) run after the same."""
    master, grad, exp_avg, exp_avg_sq, hyper = state
    lib, path, _seconds = native_build.load_library(host_adam_ext.SOURCE, host_adam_ext.CXXFLAGS, "host_adam")
    own = host_adam_ext.HostAdamKernel(lib, path, None)
    assert not own.openmp

    def update(k):
        return lambda: k.update(master, grad, exp_avg, exp_avg_sq, 10, hyper, 1.0, None, fma=True, sqrt="ieee")

    contenders = {"on torch's OpenMP threads": update(kernel), "on threads started per update": update(own),
                  "peer": peer}
    other = torch.ones(1 << 22)
    predecessors = {"after a torch operator": lambda: other.add_(1.0), "after a 20 ms pause": lambda: time.sleep(0.02)}
    times = {(c, b): [] for c in contenders for b in predecessors}
    for _ in range(2 * rounds):
        for b, run_before in predecessors.items():
            for c, fn in contenders.items():
                time.sleep(0.02)
                run_before()
                times[c, b].append(timed(fn))
    print()
    print("threads: the fp32 update as a ratio to the torch.compile pass run after the same (> 1: faster), "
          f"median of {2 * rounds}:")
    for b in predecessors:
        cells = [f"{c} {statistics.median(p / t for p, t in zip(times['peer', b], times[c, b])):.3f}x"
                 for c in list(contenders)[:2]]
        print(f"  {b:<24} " + ", ".join(cells))


def instruction_sets_comparison(kernel: host_adam_ext.HostAdamKernel, hyper: AdamHyper) -> None:
    """The update's compute speed on one thread over 1M elements held in the cache (4-16 MB: L2/L3), its
    AVX-512 body against its AVX2 one (the same bits), for each gradient dtype."""
    n, calls = 1 << 20, 20
    gen = torch.Generator().manual_seed(1)
    master, exp_avg = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-6
    print()
    print(f"instruction sets: one thread, {n / 2**20:.0f}M elements in the cache, G elements/s:")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        grad = (torch.randn(n, generator=gen) * 64).to(dtype)
        out = None if dtype == torch.float32 else torch.empty(n, dtype=dtype)
        speeds = {}
        for avx512 in (False, True):
            def run():
                for _ in range(calls):
                    kernel.update(master, grad, exp_avg, exp_avg_sq, 10, hyper, 1 / LOSS_SCALE, out, nthreads=1,
                                  sqrt="ieee", nt_min=1 << 62, avx512=avx512)
            run()
            speeds[avx512] = n * calls / min(timed(run) for _ in range(5)) / 1e9
        label = {torch.float32: "fp32", torch.float16: "fp16 -> fp16", torch.bfloat16: "bf16 -> bf16"}[dtype]
        print(f"  {label:<13} AVX2 {speeds[False]:.2f}, AVX-512 {speeds[True]:.2f} ({speeds[True] / speeds[False]:.2f}x)")


def low_bit_state(n: int) -> tuple[low_bit_adam.Moments, low_bit_adam.LowBitHyper]:
    """Zero 8-bit moments of ``n`` parameters, all quantized, and the hyper-parameters the 8-bit rows step with."""
    moments = low_bit_adam.Moments(torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                                   torch.zeros(n // 256), torch.zeros(n // 256), torch.zeros(1), torch.zeros(1))
    return moments, low_bit_adam.LowBitHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True)


def low_bit_rows(n: int, grad: torch.Tensor, out: torch.Tensor, with_torchao: bool) -> dict[str, tuple]:
    """The 8-bit rows (issue 40): chunkmem's one-pass kernel (bf16 gradient in, fp32 master, 8-bit moments with
    their block scales, bf16 copy out) and torchao's ``AdamW8bit`` step (``single_param_adam`` compiled as its
    optimizer compiles it) over one flat fp32 parameter with fp32 gradient: 16 bytes a parameter each, and 1/16
    of a byte of scales."""
    kernel = low_bit_adam.kernel()
    if kernel is None:
        print(f"8-bit kernel unavailable: {low_bit_adam._KERNEL.error}")
        return {}
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(n, generator=gen)
    moments, hyper = low_bit_state(n)
    step = [0]

    def ours():
        step[0] += 1
        kernel.update(master, grad, moments, [low_bit_adam.Segment(0, n - n % 256, True, 0, hyper, step[0])], 1.0, out)

    rows = {LOW_BIT: (ours, LOW_BIT_BYTES)}
    if with_torchao:
        try:
            from torchao.optim.adam import single_param_adam
            from torchao.optim.subclass_8bit import OptimState8bit
        except ImportError as e:
            print(f"torchao row left out: {e}")
            return rows
        param = torch.randn(n - n % 256, generator=gen)
        grad32 = grad[:param.numel()].float()
        m, v = (OptimState8bit.zeros((param.numel(),), signed) for signed in (True, False))
        count, lr = torch.tensor(0.0), torch.tensor(1e-3)
        compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=False)

        def theirs():
            count.add_(1)
            compiled(param, grad32, count, m, v, None, lr, 0.9, 0.999, 0.01, 1e-8, True, False)

        t0 = time.perf_counter()
        theirs()
        print(f"torchao's AdamW8bit step compiled in {time.perf_counter() - t0:.0f} s")
        rows["(8) torchao AdamW8bit (compiled) fp32"] = (theirs, LOW_BIT_BYTES)
    return rows


def low_bit_from_cache(bound_gbs: float) -> str | None:
    """The 8-bit kernel's time a parameter with its arrays in the cache (128K parameters, 2.4 MiB, stepped over and
    over on one thread, divided by the threads the 8-bit row uses), against the bound's time for its 16.06 bytes:
    where the kernel is compute-bound, no memory system brings it nearer the bound than this."""
    kernel = low_bit_adam.kernel()
    if kernel is None:
        return None
    n, threads = 1 << 17, torch.get_num_threads()
    gen = torch.Generator().manual_seed(2)
    master, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    moments, hyper = low_bit_state(n)
    best = float("inf")
    for step in range(1, 501):
        segments = [low_bit_adam.Segment(0, n, True, 0, hyper, 1 + step % 4)]  # the step scalars cached
        start = time.perf_counter()
        kernel.update(master, grad, moments, segments, 1.0, out, nthreads=1)
        best = min(best, time.perf_counter() - start)
    ns = best / n * 1e9 / threads
    bound_ns = LOW_BIT_BYTES / bound_gbs
    return (f"(8) from the cache ({n} parameters stepped 500 times on one thread, best, / {threads} threads): "
            f"{ns:.2f} ns a parameter, {100 * bound_ns / ns:.1f}% of the bound ({bound_ns:.2f} ns for "
            f"{LOW_BIT_BYTES:.2f} B): the ceiling of the 8-bit row, whatever the memory")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="50m", help="parameters per chunk (default 50m)")
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds (default 11)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even if a target is missed")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer rows")
    parser.add_argument("--no-threads", action="store_true", help="leave out the OpenMP threads comparison")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = parse_count(args.params)

    start = time.perf_counter()
    kernel = host_adam_ext.kernel()
    load_s = time.perf_counter() - start
    if kernel is None:
        print(f"host Adam kernel unavailable: {host_adam_ext.load_error()}", file=sys.stderr)
        return 2
    how = f"compiled in {kernel.build_seconds:.1f} s" if kernel.build_seconds is not None else "from the cache"
    threads = "torch's OpenMP runtime" if kernel.openmp else "threads started per update"
    print(f"kernel: {kernel.path.name} ({how}; load + self-check {load_s:.2f} s), "
          f"{'AVX-512' if kernel.avx512 else 'AVX2'} body on {threads}, fma={kernel.fma}, "
          f"bitwise equal to the torch-op path: {kernel.exact}; fp32 gradients reproduce torch's "
          f"{host_adam_ext.fp32_reference()} AdamW")
    print(f"CPU: {_gpt.cpu_kind()}")
    print(f"{n / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, {args.rounds} rounds")

    gen = torch.Generator().manual_seed(0)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True,
                      bias_correction=True)
    # every buffer is written once here, so that no timed call pays first-touch page faults
    sa, sb, sc, sd = (torch.rand(n, generator=gen) for _ in range(4))
    master = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen).mul_(1e-3)
    exp_avg_sq = torch.rand(n, generator=gen).mul_(1e-6)
    grad32 = torch.randn(n, generator=gen).mul_(1e-2)
    grad16 = {dt: (grad32 * LOSS_SCALE).to(dt) for dt in (torch.float16, torch.bfloat16)}
    out16 = {dt: master.to(dt) for dt in (torch.float16, torch.bfloat16)}
    temp32 = torch.zeros(n)
    # (c) and (d-torch) on their own fp32 state, so that each configuration updates a live state
    t_master, t_avg, t_avg_sq = master.clone(), exp_avg.clone(), exp_avg_sq.clone()
    t_step = torch.zeros(())
    grad_scale, found_inf = torch.tensor(LOSS_SCALE), torch.zeros(())
    flat = torch.nn.Parameter(master.clone())
    flat.grad = grad32
    fused = torch.optim.AdamW([flat], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                              weight_decay=hyper.weight_decay, fused=True)
    step = [0]

    def ours(dt):
        def run():
            step[0] += 1
            kernel.update(master, grad16[dt], exp_avg, exp_avg_sq, step[0] % 1000 + 1, hyper, 1 / LOSS_SCALE,
                          out16[dt])
        return run

    def ours32():  # what fp32 training runs: the variant that reproduces a torch AdamW bit for bit
        step[0] += 1
        assert host_adam_ext.try_update(master, grad32, exp_avg, exp_avg_sq, step[0] % 1000 + 1, hyper, 1.0, None)

    undo = tuple(torch.zeros(n) for _ in range(3))  # step_in_backward's undo copy of master and moments

    def undo_then_update():  # the copy as a pass of its own (torch's copy_), then the update
        for saved, state in zip(undo, (master, exp_avg, exp_avg_sq)):
            saved.copy_(state)
        ours(torch.bfloat16)()

    def undo_in_update():
        step[0] += 1
        kernel.update(master, grad16[torch.bfloat16], exp_avg, exp_avg_sq, step[0] % 1000 + 1, hyper,
                      1 / LOSS_SCALE, out16[torch.bfloat16], undo=undo)

    compiled = {}
    if not args.no_compile:
        # over chunkmem's own arrays: copies would sit on other pages, whose placement in the memory
        # system moves a memory-bound pass by a percent or two either way
        single_pass = torch.compile(_adamw_single_pass, dynamic=False)
        bc1, bc2 = hyper.bias_corrections(10)
        scalars = dict(decay=1 - hyper.lr * hyper.weight_decay, w=1 - hyper.beta1, beta2=hyper.beta2,
                       omb2=1 - hyper.beta2, bc2s=bc2 ** 0.5, eps=hyper.eps, nss=-hyper.lr / bc1)
        for label, dt in (("fp16 -> fp16", torch.float16), ("bf16 -> bf16", torch.bfloat16), ("fp32", None)):
            grad = grad32 if dt is None else grad16[dt]
            out = None if dt is None else out16[dt]
            mult = 1.0 if dt is None else 1 / LOSS_SCALE
            compiled[f"(p) torch.compile single pass {label}"] = (
                lambda grad=grad, out=out, mult=mult: single_pass(master, grad, exp_avg, exp_avg_sq, out, mult=mult,
                                                                  **scalars), 28)
        t0 = time.perf_counter()
        for fn, _ in compiled.values():
            fn()
        print(f"torch.compile (inductor) single passes compiled in {time.perf_counter() - t0:.0f} s")

    def torch_fused_mixed():
        temp32.copy_(grad16[torch.float16])
        t_step.add_(1)
        torch._fused_adamw_([t_master], [temp32], [t_avg], [t_avg_sq], [], [t_step], amsgrad=False, lr=hyper.lr,
                            beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
                            maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        out16[torch.float16].copy_(t_master)

    def torch_ops():
        step[0] += 1
        adam_update_torch_(master, grad16[torch.float16], exp_avg, exp_avg_sq, step[0] % 1000 + 1, hyper,
                           1 / LOSS_SCALE, out16[torch.float16])

    low_bit = low_bit_rows(n, grad16[torch.bfloat16], out16[torch.bfloat16], not args.no_compile)

    configs = {  # name: (function, bytes per parameter)
        "bound": (lambda: kernel.stream_4r3w(sa, sb, sc, sd), 28),
        "(a) chunkmem one-pass fp16 -> fp16": (ours(torch.float16), 28),
        "(b) chunkmem one-pass bf16 -> bf16": (ours(torch.bfloat16), 28),
        "(c) torch fused AdamW + conversions": (torch_fused_mixed, 28),
        "(-) chunkmem torch-op path fp16": (torch_ops, 28),
        "(d) chunkmem one-pass fp32": (ours32, 28),
        "(d) torch AdamW(fused=True) fp32": (fused.step, 28),
        "(i) same traffic, trivial arithmetic": (lambda: kernel.stream_mixed(sa, sb, sc, grad16[torch.float16],
                                                                            out16[torch.float16]), 28),
        "(u) bf16 + undo copy, then the update": (undo_then_update, 52),
        "(u) bf16 + undo copy in the update pass": (undo_in_update, 40),
        **compiled,
        **low_bit,
    }
    names = list(configs)
    for name in names:  # warm-up
        configs[name][0]()

    times: dict[str, list[float]] = {name: [] for name in names}
    before: dict[str, list[float]] = {name: [] for name in names}  # the bound's time just before each run
    others = names[1:]
    rng = random.Random(5)
    for _ in range(args.rounds):
        for name in rng.sample(others, len(others)):
            before[name].append(timed(configs["bound"][0]))
            times["bound"].append(before[name][-1])
            times[name].append(timed(configs[name][0]))
    before["bound"] = times["bound"]
    for t in (master, exp_avg, exp_avg_sq, t_master, flat):
        assert torch.isfinite(t).all(), "the update diverged"

    bound_gbs = 28 * n / statistics.median(times["bound"]) / 1e9
    print()
    print(f"bandwidth (4 reads, 3 writes fp32 in place): {bound_gbs:.1f} GB/s -> bound "
          f"{bound_gbs / 28:.3f} Gparams/s at 28 B/param")
    print()
    header = f"{'configuration':<40} {'B/param':>7} {'median ms':>10} {'Gparams/s':>10} {'% of bound':>11}"
    print(header)
    print("-" * len(header))
    fraction = {}
    for name in names:
        per_byte = configs[name][1]
        med = statistics.median(times[name])
        fraction[name] = statistics.median(tb * per_byte / 28 / t for tb, t in zip(before[name], times[name]))
        print(f"{name:<40} {per_byte:>7} {med * 1e3:>10.1f} {n / med / 1e9:>10.3f} {100 * fraction[name]:>10.1f}%")
    checks = [(f"(a) fp16 at {100 * fraction[A16]:.1f}% of the bandwidth bound (target {100 * TARGET:.0f}%)",
               fraction[A16] >= TARGET),
              (f"(d) fp32 at {100 * fraction[D32]:.1f}% of the bandwidth bound (target {100 * TARGET:.0f}%)",
               fraction[D32] >= TARGET)]
    if LOW_BIT in fraction:
        print(low_bit_from_cache(bound_gbs))
        checks.append((f"(8) 8-bit at {100 * fraction[LOW_BIT]:.1f}% of the bandwidth bound (target "
                       f"{100 * LOW_BIT_TARGET:.0f}%)", fraction[LOW_BIT] >= LOW_BIT_TARGET))
    # against the compiled peers: the two run back to back (what a slow phase of the machine does to one
    # run of a pair, it does to the other), in both orders: the second of a pair runs faster here (the
    # memory system is warm), which makes the ratios of one order differ from the other's by more than the
    # kernels do. So each pair of one order is joined with the next of the other order (geometric mean of
    # the two ratios) and the median is taken over those order-balanced ratios.
    for ours_name, label in ((A16, "fp16 -> fp16"), (B16, "bf16 -> bf16"), (D32, "fp32")):
        peer = f"(p) torch.compile single pass {label}"
        if peer in configs:
            ratios = []
            for i in range(2 * args.rounds + 2):
                first, second = (ours_name, peer) if i % 2 else (peer, ours_name)
                t_first, t_second = timed(configs[first][0]), timed(configs[second][0])
                t_ours, t_peer = (t_first, t_second) if first == ours_name else (t_second, t_first)
                ratios.append(t_peer / t_ours)
            balanced = [(a * b) ** 0.5 for a, b in zip(ratios[0::2], ratios[1::2])]
            ratio = statistics.median(balanced)
            order = statistics.median(ratios[1::2]) / statistics.median(ratios[0::2])
            checks.append((f"chunkmem {label} {ratio:.3f}x the speed of the torch.compile single pass, median of "
                           f"{len(balanced)} order-balanced pairs of pairs (target >= 1; the order alone moves a "
                           f"pair's ratio by {order:.3f}x)", ratio >= 1.0))
    if kernel.openmp and not args.no_threads and D32_PEER in configs:
        threads_comparison(kernel, (master, grad32, exp_avg, exp_avg_sq, hyper), configs[D32_PEER][0], args.rounds)
    if kernel.avx512_available:
        instruction_sets_comparison(kernel, hyper)
    print()
    print("the gradient norm's sum of squares over the same gradient (fp16 and bf16 are what a 16-bit step's overflow "
          "check and clipping read):")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        g = flat.to(dtype)
        torch_s = statistics.median(timed(lambda: torch.linalg.vector_norm(g, 2, dtype=torch.float32).item())
                                    for _ in range(args.rounds))
        ours_s = statistics.median(timed(lambda: kernel.sum_squares(g)) for _ in range(args.rounds))
        gbs = g.numel() * g.element_size() / ours_s / 1e9
        print(f"  {str(dtype)[6:]:<9} torch vector_norm(dtype=float32) {torch_s * 1e3:7.1f} ms, chunkmem "
              f"sum_squares {ours_s * 1e3:6.1f} ms ({gbs:.1f} GB/s): {torch_s / ours_s:.1f}x")
    print()
    for text, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}: {text}")
    return 0 if all(ok for _, ok in checks) or args.no_fail else 1


if __name__ == "__main__":
    sys.exit(main())
