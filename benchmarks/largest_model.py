"""Train a GPT of at least 1.5 billion parameters on this machine with a 1 GiB device tier (issue 5).

Plain PyTorch (fp32 + ``AdamW(fused=True)``, 16 bytes a parameter) trains at most 1.444B parameters
here (28 layers at d_model 2048, vocab 16384); 30 layers (1.544B) are killed for memory. chunkmem
with fp16 storage and ``reuse_fp16_shard=True`` needs 14 bytes a parameter at rest (fp16 parameter,
whose memory also holds the gradient, + fp32 master, exp_avg, exp_avg_sq), all on the host under
placement ``cpu``; the device tier (the CPU under a 1 GiB capacity here) only holds the chunks the
running module needs.

The script:

1. picks the layers (``--layers``, default: the fewest giving >= 1.5B parameters at the chosen
   d_model and vocab), computes the chunk layout from element counts (nothing allocated), and prints
   the estimate of the process's peak memory: the exact chunk bytes (14 B x chunk elements) + the RSS
   of the process now + the larger of the backward's transient memory (device-tier chunk copies,
   activations, gradients on their way to a chunk) and the step's (an fp32 copy of one chunk for the
   gradient norm) + 128 MiB of allocator slack; it refuses to start if psutil's available memory is
   below the estimate (``--force`` starts anyway);
2. builds the GPT inside ``ZeroInitContext`` (fp16, parameters go into chunks module by module), wraps
   it (``ShardedModelV2``, placement ``cpu`` or ``--placement auto``, ``reuse_fp16_shard=True``) with
   ``ShardedOptimizerV2(HybridAdam)``, device capacity ``--device-memory`` (1 GiB);
3. trains ``--steps`` steps of batch 1 x 64 tokens, printing per step the loss, the time (forward,
   backward, optimizer step), the peak and current RSS and the bytes moved between the tiers
   (``memory_stats()["totals"]``); block forward and backward times are taken with hooks, for the
   extrapolation;
4. prints the host bound (psutil's available memory at the start / 14 bytes: the most parameters 14
   bytes a parameter could hold) and how close the model comes to it, the exact host bytes per
   parameter, and the estimate against the measured peak RSS.

``--dry-run-small``: the same script on a ~134M GPT (d_model 2048, 2 layers, same vocab) to check it in
a few minutes; it also extrapolates the time and memory of the full configuration from the measured
per-block times.

Compute dtype: fp16 by default, because the target is about 16-bit storage (fp16 is what the issue
names). On this CPU fp16 matmuls are slow, and the fp16 backward matmuls (grad_output @ weight) are
about 100x slower than bf16 ones, so a 1.5B step takes many minutes; ``--dtype bf16`` stores exactly the
same 14 bytes a parameter and computes far faster.

Exit status: 0 when the model has >= 1.5B parameters and every step ran (dry run: when it ran),
1 when the model is smaller (``--no-fail``: 0), 2 when it refuses to start for lack of memory.

Usage::

    python benchmarks/largest_model.py --dry-run-small                    # ~134M, a few minutes
    python benchmarks/largest_model.py                                    # 30 layers: 1.544B (~23 GB)
    python benchmarks/largest_model.py --placement auto --layers 28
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import psutil
import torch
import torch.nn.functional as F

import chunkmem as cm
from chunkmem import host_adam_ext

from _gpt import (GPT, GPTConfig, chunk_layout, count_params, gib, machine_header, mib,
                  peak_rss_bytes, rss_bytes)

MIN_PARAMS = 1_500_000_000
STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per chunk element
SLACK_BYTES = 128 * 2**20
DRY_RUN_LAYERS = 2
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def layers_for(min_params: int, d_model: int, vocab: int, seq: int, heads: int) -> int:
    layers = 1
    while count_params(GPTConfig(vocab, d_model, layers, heads, seq)) < min_params:
        layers += 1
    return layers


def estimate(cfg: GPTConfig, batch: int, placement: str, capacity: int, element_size: int,
             baseline_rss: int) -> dict:
    """Peak host memory of the run, in bytes, by parts (see the module docstring)."""
    chunk_numel, n_chunks, padding = chunk_layout(cfg, element_size)
    chunk_param_bytes = chunk_numel * element_size
    chunks = n_chunks * chunk_numel * (element_size + STATE_BYTES)
    b, s, d, v, a = batch, cfg.seq, cfg.d_model, cfg.vocab, cfg.heads
    if placement == "cpu":
        # the chunk holding the embedding is held for the whole backward (the tied lm head's backward
        # comes first, the embedding's last), plus the chunks around the running module
        device = min(capacity, min(4, n_chunks) * chunk_param_bytes)
    else:
        device = capacity  # auto keeps chunks on the device up to the capacity; their host copies stay
    activations = cfg.layers * (34 * b * s * d + 5 * a * s * s * b) * element_size // 2  # saved for backward
    logits = b * s * v * (element_size + 4 + 4)  # 16-bit logits, their fp32 copy and its gradient
    grads = 2 * v * d * element_size + 4 * d * d * element_size  # the tied weight's two grads, the largest other
    backward = device + activations + logits + grads
    step = chunk_numel * 4  # an fp32 copy of one chunk's gradient for its norm
    total = baseline_rss + chunks + max(backward, step) + SLACK_BYTES
    return dict(total=total, chunks=chunks, chunk_numel=chunk_numel, n_chunks=n_chunks, padding=padding,
                device=device, activations=activations + logits, grads=grads, step=step, backward=backward,
                baseline=baseline_rss, slack=SLACK_BYTES)


def print_estimate(est: dict, cfg: GPTConfig, n_params: int, available: int, label: str) -> None:
    print(f"estimate ({label}): {gib(est['total'])} = {gib(est['chunks'])} chunk memory "
          f"({est['n_chunks']} chunks x {est['chunk_numel']} elements x 14 B; {est['padding']} padding elements, "
          f"{100 * est['padding'] / (est['n_chunks'] * est['chunk_numel']):.2f}%; "
          f"{est['chunks'] / n_params:.3f} B/param)"
          f" + {mib(est['baseline'])} process RSS now + {mib(max(est['backward'], est['step']))} transient "
          f"(backward: device-tier copies {mib(est['device'])}, activations and logits {mib(est['activations'])}, "
          f"gradients in flight {mib(est['grads'])}; step: {mib(est['step'])}) + {mib(est['slack'])} slack; "
          f"psutil available: {gib(available)}")


class BlockTimer:
    """Forward and backward wall time of each transformer block, from hooks (the last step's)."""

    def __init__(self, blocks) -> None:
        self.fwd: dict[int, float] = {}
        self.bwd_out: dict[int, float] = {}
        self.bwd_in: dict[int, float] = {}
        self._start: dict[int, float] = {}
        for k, block in enumerate(blocks):
            block.register_forward_pre_hook(self._pre(k))
            block.register_forward_hook(self._post(k))

    def reset(self) -> None:
        self.fwd.clear(), self.bwd_out.clear(), self.bwd_in.clear()

    def _pre(self, k: int):
        def hook(module, args):
            self._start[k] = time.perf_counter()
            x = args[0]
            if torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda g: self.bwd_in.__setitem__(k, time.perf_counter()))
        return hook

    def _post(self, k: int):
        def hook(module, args, out):
            self.fwd[k] = time.perf_counter() - self._start[k]
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(lambda g: self.bwd_out.__setitem__(k, time.perf_counter()))
        return hook

    def per_block(self) -> tuple[float, float]:
        """Median forward and backward seconds of one block."""
        bwd = [self.bwd_in[k] - self.bwd_out[k] for k in self.bwd_out if k in self.bwd_in]
        return statistics.median(self.fwd.values()), statistics.median(bwd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default: the fewest giving >= 1.5B parameters)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--placement", choices=("cpu", "auto"), default="cpu")
    parser.add_argument("--device-memory", default="1GiB", help="device tier capacity (default 1GiB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16",
                        help="16-bit storage and compute dtype (default fp16; bf16 stores the same bytes and "
                             "computes far faster on this CPU)")
    parser.add_argument("--dry-run-small", action="store_true",
                        help=f"a ~134M variant ({DRY_RUN_LAYERS} layers) to check the script, with an extrapolation "
                             f"to the full configuration")
    parser.add_argument("--force", action="store_true",
                        help="start even if the memory estimate exceeds the available memory (the kernel may kill it)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even if the model is under 1.5B parameters")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    available_at_start = psutil.virtual_memory().available
    dtype = DTYPES[args.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    capacity = cm.parse_size(args.device_memory, "--device-memory")

    full_layers = args.layers or layers_for(MIN_PARAMS, args.d_model, args.vocab, args.seq, args.heads)
    full_cfg = GPTConfig(args.vocab, args.d_model, full_layers, args.heads, args.seq)
    cfg = GPTConfig(args.vocab, args.d_model, DRY_RUN_LAYERS, args.heads, args.seq) if args.dry_run_small else full_cfg
    n_params = count_params(cfg)
    full_params = count_params(full_cfg)

    print(machine_header())
    print(f"model: {cfg.describe()}: {n_params / 1e9:.4f}B parameters (tied lm head counted once)"
          + (f" -- DRY RUN of the full {full_cfg.describe()}: {full_params / 1e9:.4f}B" if args.dry_run_small else ""))
    if args.layers is None:
        print(f"layers: {full_layers} is the fewest giving >= {MIN_PARAMS / 1e9:.1f}B parameters at d_model "
              f"{args.d_model}, vocab {args.vocab} ({full_layers - 1} layers: "
              f"{count_params(GPTConfig(args.vocab, args.d_model, full_layers - 1, args.heads, args.seq)) / 1e9:.4f}B)")
    print(f"training: batch {args.batch} x {args.seq} tokens, {args.steps} step(s), placement '{args.placement}', "
          f"device tier capacity {gib(capacity)}, reuse_fp16_shard=True, HybridAdam (lr 1e-4)")
    why = ("the target is about 16-bit storage; on this CPU fp16 matmuls are slow and the fp16 backward matmuls "
           "about 100x slower than bf16 ones, so steps take minutes (--dtype bf16 stores the same 14 B/param and "
           "computes far faster)" if args.dtype == "fp16" else
           "16-bit storage as the target asks (the same 14 B/param as fp16); bf16 matmuls are fast on this CPU, "
           "fp16 backward matmuls are about 100x slower")
    print(f"dtype: {args.dtype} storage and compute: {why}")
    print(f"host bound: psutil available memory at the start {gib(available_at_start)} / 14 B = "
          f"{available_at_start / 14 / 1e9:.3f}B parameters")

    # the host Adam kernel (a small ctypes library, built once into a cache) before the RSS baseline
    kernel = host_adam_ext.kernel()
    if kernel is None:
        print(f"host Adam kernel unavailable ({host_adam_ext.load_error()}): the torch-op path runs the update")
    baseline = rss_bytes()
    est = estimate(cfg, args.batch, args.placement, capacity, element_size, baseline)
    available = psutil.virtual_memory().available
    print_estimate(est, cfg, n_params, available, "this run")
    if args.dry_run_small:
        full_est = estimate(full_cfg, args.batch, args.placement, capacity, element_size, baseline)
        print_estimate(full_est, full_cfg, full_params, available, "the full configuration")
    sys.stdout.flush()
    if est["total"] > available:
        print(f"REFUSED: the run needs about {gib(est['total'])} but only {gib(available)} are available; free "
              f"memory, use fewer layers (--layers), or --force to start anyway (the kernel may kill the process).")
        if not args.force:
            return 2
        print("--force: starting anyway")
    print()

    cm.set_device_memory_capacity(capacity)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=True, dtype=dtype):
        net = GPT(cfg)
    t_init = time.perf_counter() - t0
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=args.placement,
                              reuse_fp16_shard=True)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-4), initial_scale=2**16)
    gc.collect()  # the ZeroInitContext chunks the wrap did not free (see bytes_per_param.py)
    build_s = time.perf_counter() - t0
    assert sum(p.numel() for p in model.parameters()) == n_params, "parameter count formula is off"
    print(f"built in {build_s:.1f} s (ZeroInitContext {t_init:.1f} s, wrap + optimizer {build_s - t_init:.1f} s): "
          f"{len(model.chunks)} chunks of {mib(model.chunks[0].param.nbytes)}; RSS {gib(rss_bytes())}, "
          f"peak {gib(peak_rss_bytes())}", flush=True)

    timer = BlockTimer(model.module.blocks)
    gen = torch.Generator().manual_seed(1)
    steps = []
    device_peak = 0
    for i in range(args.steps):
        tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=gen)
        timer.reset()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        optim.backward(loss)
        t2 = time.perf_counter()
        updated = optim.step()
        optim.zero_grad()
        t3 = time.perf_counter()
        del logits
        totals = model.memory_stats()["totals"]
        device_peak = max(device_peak, totals["peak_device_bytes"])
        blk_fwd, blk_bwd = timer.per_block()
        steps.append(dict(loss=loss.item(), total=t3 - t0, fwd=t1 - t0, bwd=t2 - t1, opt=t3 - t2, updated=updated,
                          blk_fwd=blk_fwd, blk_bwd=blk_bwd))
        print(f"step {i + 1}: loss {loss.item():.4f}, {t3 - t0:.1f} s (forward {t1 - t0:.1f}, backward {t2 - t1:.1f}, "
              f"optimizer {t3 - t2:.1f}; one block: forward {blk_fwd:.2f}, backward {blk_bwd:.2f}), "
              f"{'updated' if updated else 'SKIPPED (overflow)'}, loss scale {optim.loss_scale:g}; peak RSS "
              f"{gib(peak_rss_bytes())}, RSS {gib(rss_bytes())}; moved to device {mib(totals['moved_to_device_bytes'])}, "
              f"to host {mib(totals['moved_to_host_bytes'])}, device-tier peak {mib(totals['peak_device_bytes'])}",
              flush=True)

    tiers = model.tier_bytes()
    host_total = sum(tiers["host"].values())
    device_total = sum(tiers["device"].values())
    optim_device, optim_host = optim.get_memory_usage()
    peak = peak_rss_bytes()
    print()
    print(f"at rest (after the last step + zero_grad): host {gib(host_total)} = {host_total / n_params:.3f} B/param "
          f"(model.tier_bytes(): " + ", ".join(f"{k} {mib(v)}" for k, v in tiers["host"].items())
          + f"), device {mib(device_total)}; optimizer state: host {gib(optim_host)}, device {mib(optim_device)}")
    print(f"peak RSS {gib(peak)} = {peak / n_params:.3f} B/param (estimate was {gib(est['total'])}: "
          f"measured / estimate = {peak / est['total']:.3f}); device-tier peak of chunk memory {mib(device_peak)} "
          f"({device_peak / model.chunks[0].param.nbytes:.1f} chunks; estimated {mib(est['device'])})")
    bound = available_at_start / 14
    print(f"host bound: {available_at_start / 2**30:.2f} GiB available at the start / 14 B = {bound / 1e9:.3f}B "
          f"parameters; this model: {n_params / 1e9:.4f}B = {100 * n_params / bound:.1f}% of the bound "
          f"(plain PyTorch fp32 + fused AdamW at 16 B/param: at most {available_at_start / 16 / 1e9:.3f}B)")

    if args.dry_run_small:
        first, last = steps[0], steps[-1]
        extra_layers = full_cfg.layers - cfg.layers
        extra_params = full_params - n_params
        per_block = last["blk_fwd"] + last["blk_bwd"]
        opt_per_param = last["opt"] / n_params
        full_step = last["total"] + extra_layers * per_block + extra_params * opt_per_param
        full_first = first["total"] + extra_layers * (first["blk_fwd"] + first["blk_bwd"]) + extra_params * \
            first["opt"] / n_params
        full_build = build_s * full_params / n_params
        full_wall = full_build + full_first + (args.steps - 1) * full_step
        print()
        print(f"extrapolation to the full {full_cfg.describe()} ({full_params / 1e9:.4f}B), from this run's "
              f"per-block times ({per_block:.2f} s a block in the last step: forward {last['blk_fwd']:.2f}, backward "
              f"{last['blk_bwd']:.2f}), its optimizer time per parameter ({opt_per_param * 1e9:.2f} s per billion) and "
              f"its build time per parameter: build {full_build / 60:.1f} min, first step {full_first / 60:.1f} min, "
              f"later steps {full_step / 60:.1f} min each; {args.steps} steps: about {full_wall / 60:.0f} min in all")
        print(f"memory of the full run: estimate {gib(full_est['total'])} (this run's peak RSS was "
              f"{peak / est['total']:.3f} x its estimate); psutil available at this run's start "
              f"{gib(available_at_start)}: the full run {'fits' if full_est['total'] <= available_at_start else 'does NOT fit'} "
              f"with {gib(abs(available_at_start - full_est['total']))} {'to spare' if full_est['total'] <= available_at_start else 'missing'}")
        print(f"full run: {sys.executable} benchmarks/largest_model.py"
              + (f" --layers {args.layers}" if args.layers else "")
              + (f" --placement {args.placement}" if args.placement != "cpu" else "")
              + (f" --dtype {args.dtype}" if args.dtype != "fp16" else "")
              + (f" --vocab {args.vocab}" if args.vocab != 16384 else "")
              + (f" --d-model {args.d_model}" if args.d_model != 2048 else ""))
        print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
        print("DRY RUN done (no target)")
        return 0

    ok = n_params >= MIN_PARAMS and len(steps) == args.steps and all(s["loss"] == s["loss"] for s in steps)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    print(f"{'PASS' if ok else 'MISS'}  trained a {n_params / 1e9:.4f}B-parameter GPT for {len(steps)} step(s) "
          f"({sum(s['updated'] for s in steps)} updated) with a {gib(capacity)} device tier "
          f"(target >= {MIN_PARAMS / 1e9:.1f}B)")
    return 0 if ok or args.no_fail else 1


if __name__ == "__main__":
    sys.exit(main())
