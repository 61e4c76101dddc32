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

The disk tier (issue 11): ``--nvme-path DIR`` rests the optimizer state (fp32 master, exp_avg,
exp_avg_sq: 12 B a parameter) in files under DIR (``offload_optimizer="disk"``); with ``--offload-param``
the 16-bit parameters too (``offload_param="disk"``, which needs ``reuse_fp16_shard=False``: the
gradients then have their own host buffers). ``--atomic-step/--no-atomic-step`` (default on): an atomic
step writes the new state to a second slot, so the files are twice the state; a 4B model's fp32 state is
48 GB, twice that does not fit this machine's disk, so the 4B runs use ``--no-atomic-step``.
``--host-memory SIZE`` sets the host tier's capacity (``chunkmem.set_host_memory_capacity``): under
``--placement auto`` the optimizer state that fits it stays in host memory, the rest rests on disk.
The estimate then counts host bytes (16-bit parameters, host-resident state, the I/O buffers) and disk
bytes (the files, checked against the free space of DIR); it prints the bytes per tier after each step,
each step's CPU seconds and page faults, the bytes read from and written to disk by the step (the ledger's
counters) and, at the end, a SHA-256 of every parameter's 16-bit values (chunk by chunk under ``chunkmem.GatheredParameters``) and the
losses in hex. ``--results FILE`` writes them as JSON; ``--compare-to FILE`` compares them with another
run's (exit status 1 when they differ): the all-on-disk run against the ``auto`` run must be bitwise
equal.

``--target-4b``: the >= 4B-parameter target (issue 11): d_model 4096, 32 heads, bf16 (unless given),
``--matmul fp32`` (unless given), the fewest layers giving >= 4B parameters, ``--nvme-path`` required,
and a step (forward + backward + optimizer) of at most ``--max-step-seconds`` (180) in every step.
``--matmul fp32`` builds the GPT with ``_gpt.UpcastLinear``: parameters, activations and gradients stay
16-bit, the matmuls run in fp32 on fp32 copies in reused buffers (this AVX2 CPU has no native bf16/fp16 matmul:
torch's bf16 backward matmuls run at a few GFLOP/s, 50-100x slower than fp32 ones). On disk runs the
searched chunk size is given to ``ZeroInitContext`` too, so that the wrap keeps the context's chunks.
``--tiny``: a ~0.13M-parameter GPT in 128 KiB chunks with 64 KiB I/O buffers, to check the script and
the comparison in seconds (``tests/test_disk_benchmarks.py``).

Exit status: 0 when the model has >= the minimum parameters (1.5B; 4B with ``--target-4b``), every
step ran (and, where a step time limit applies, in time; dry run: when it ran) and a comparison matched,
1 when the model is smaller, a step too slow or a comparison differed (``--no-fail``: 0 for the first
two), 2 when it refuses to start for lack of memory or disk space.

Usage::

    python benchmarks/largest_model.py --dry-run-small                    # ~134M, a few minutes
    python benchmarks/largest_model.py                                    # 30 layers: 1.544B (~23 GB)
    python benchmarks/largest_model.py --placement auto --layers 28
    python benchmarks/largest_model.py --target-4b --nvme-path /scratch --no-atomic-step --dry-run-small
    python benchmarks/largest_model.py --target-4b --nvme-path /scratch --no-atomic-step --results disk.json
    python benchmarks/largest_model.py --target-4b --nvme-path /scratch --no-atomic-step --placement auto \
        --host-memory 11.75GiB --compare-to disk.json
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import resource
import shutil
import statistics
import sys
import time

import psutil
import torch
import torch.nn.functional as F

import chunkmem as cm
from chunkmem.optim import host_adam_ext
from chunkmem.optim.backward_step import GRADIENTS_AHEAD_OF_THE_DISK_STEP
from chunkmem.storage.disk_io import aligned_nbytes

from _gpt import (GPT, GPTConfig, chunk_layout, count_params, gib, machine_header, mib,
                  peak_rss_bytes, rss_bytes)

MIN_PARAMS = 1_500_000_000
MIN_PARAMS_4B = 4_000_000_000
MIN_PARAMS_10B = 10_000_000_000
MAX_STEP_SECONDS_4B = 180.0
MAX_PEAK_BYTES_PER_PARAM_10B = 1.0
SLACK_BYTES = 128 * 2**20
DRY_RUN_LAYERS = 2
DISK_BUFFER_SIZE = 16 * 2**20  # bytes per disk I/O buffer (the default)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def layers_for(min_params: int, d_model: int, vocab: int, seq: int, heads: int) -> int:
    layers = 1
    while count_params(GPTConfig(vocab, d_model, layers, heads, seq)) < min_params:
        layers += 1
    return layers


def state_families(optimizer: str, rounding: bool) -> tuple[list[int], float]:
    """The optimizer state of one chunk element: the bytes of each family the disk tier streams (the fp32 master
    first, where there is one), and the bytes that stay in host memory beside the disk (the 8-bit Adam's block
    scales: 8 bytes per 256 elements)."""
    if optimizer == "hybridadam":
        return [4, 4, 4], 0.0  # fp32 master, exp_avg, exp_avg_sq
    return ([] if rounding else [4]) + [1, 1], 8 / 256  # (master,) exp_avg_codes, exp_avg_sq_codes; scales


def estimate(cfg: GPTConfig, batch: int, placement: str, capacity: int, element_size: int,
             baseline_rss: int, disk: dict | None = None, host_capacity: int | None = None,
             chunk_size: int | None = None, step_in_backward: bool = False, optimizer: str = "hybridadam",
             rounding: bool = False) -> dict:
    """Peak host memory of the run, in bytes, by parts (see the module docstring), and the bytes of the
    disk tier's files (``disk``: ``offload_param``, ``atomic_step``, ``buffer_count``, ``buffer_size``).
    With the parameters on disk the 16-bit bytes on the host are their gradients: all of them after the
    backward, or a few chunks' with ``step_in_backward`` in place (each freed once its update is computed, as
    are the values of parameters that are their own masters, kept from the backward for the update).
    ``optimizer`` and ``rounding``: the state's families (:func:`state_families`); the 8-bit Adam's streamed
    update takes each chunk whole, so its I/O buffers hold a chunk of the widest family streamed."""
    chunk_numel, n_chunks, padding = chunk_layout(cfg, element_size, chunk_size)
    chunk_param_bytes = chunk_numel * element_size
    elements = n_chunks * chunk_numel
    streamed, beside = state_families(optimizer, rounding)
    state_per_element = sum(streamed) + beside
    params, state, io, disk_bytes = elements * element_size, int(elements * state_per_element), 0, 0
    if disk is not None:
        slots = 2 if disk["atomic_step"] else 1
        families = len(streamed) + disk["offload_param"]
        buffer_size = disk["buffer_size"]
        if optimizer != "hybridadam":  # whole chunks
            widest = max(streamed + [element_size if disk["offload_param"] else 0])
            buffer_size = max(buffer_size, aligned_nbytes(widest * chunk_numel))
        io = disk["buffer_count"] * families * buffer_size + 2 * disk["buffer_size"]  # + the in-line and fetch buffers
        if disk["offload_param"] and step_in_backward and not disk["atomic_step"]:
            in_flight = min(n_chunks, GRADIENTS_AHEAD_OF_THE_DISK_STEP + 2) * chunk_param_bytes
            # their gradients and, parameters that are their own masters, their values kept for the disk step
            params = in_flight * (2 if element_size == 4 or rounding else 1)
        host_state = 0
        if placement == "auto" and host_capacity is not None:  # what fits the host capacity stays there
            host_state = max(0, min(state, host_capacity - params - io))
        on_disk = n_chunks - int(host_state // (chunk_numel * state_per_element))  # files: only their regions
        state = host_state + int(on_disk * chunk_numel * beside)
        disk_bytes = on_disk * slots * sum(aligned_nbytes(chunk_numel * width) for width in streamed)
        if disk["offload_param"]:  # 16-bit parameters in files; gradients in their own host buffers
            disk_bytes += n_chunks * slots * aligned_nbytes(chunk_param_bytes)
    chunks = params + state + io
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
    return dict(total=total, chunks=chunks, params=params, state=state, io=io, disk=disk_bytes,
                chunk_numel=chunk_numel, n_chunks=n_chunks, padding=padding, device=device,
                activations=activations + logits, grads=grads, step=step, backward=backward,
                baseline=baseline_rss, slack=SLACK_BYTES)


def print_estimate(est: dict, cfg: GPTConfig, n_params: int, available: int, label: str,
                   disk_free: int | None = None) -> None:
    print(f"estimate ({label}): {gib(est['total'])} = {gib(est['chunks'])} chunk memory "
          f"({est['n_chunks']} chunks x {est['chunk_numel']} elements; 16-bit parameters {gib(est['params'])}, "
          f"host-resident optimizer state {gib(est['state'])}, disk I/O buffers {mib(est['io'])}; "
          f"{est['padding']} padding elements, "
          f"{100 * est['padding'] / (est['n_chunks'] * est['chunk_numel']):.2f}%; "
          f"{est['chunks'] / n_params:.3f} B/param)"
          f" + {mib(est['baseline'])} process RSS now + {mib(max(est['backward'], est['step']))} transient "
          f"(backward: device-tier copies {mib(est['device'])}, activations and logits {mib(est['activations'])}, "
          f"gradients in flight {mib(est['grads'])}; step: {mib(est['step'])}) + {mib(est['slack'])} slack; "
          f"psutil available: {gib(available)}")
    if disk_free is not None:
        print(f"estimate ({label}), disk tier files: {gib(est['disk'])} ({est['disk'] / n_params:.2f} B/param); "
              f"free in --nvme-path: {gib(disk_free)}")


def tier_summary(tiers: dict[str, dict[str, int]]) -> str:
    """``model.tier_bytes()`` as text: each tier's total and its families."""
    return "; ".join(f"{tier} {gib(sum(fam.values()))} (" + ", ".join(f"{k} {mib(v)}" for k, v in fam.items()) + ")"
                     for tier, fam in tiers.items())


def parameter_checksum(model: cm.ShardedModelV2) -> str:
    """SHA-256 of every parameter's current 16-bit values, in packing order, read chunk by chunk under
    ``GatheredParameters`` (wherever the chunks rest)."""
    digest = hashlib.sha256()
    for chunk in model.chunks:
        params = [slot.param for slot in chunk.slots]
        with cm.GatheredParameters(params):
            for p in params:
                raw = p.detach().contiguous().view(-1).view(torch.uint8)
                for start in range(0, raw.numel(), 2**26):  # in pieces of 64 MiB
                    digest.update(memoryview(raw[start:start + 2**26].numpy()))
    return digest.hexdigest()


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
                        help="transformer blocks (default: the fewest giving >= 1.5B parameters, 4B with --target-4b)")
    parser.add_argument("--d-model", type=int, default=None, help="default 2048 (4096 with --target-4b)")
    parser.add_argument("--heads", type=int, default=None, help="default 16 (32 with --target-4b)")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--placement", choices=("cpu", "auto"), default="cpu")
    parser.add_argument("--device-memory", default="1GiB", help="device tier capacity (default 1GiB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="16-bit storage and compute dtype (default fp16; bf16 stores the same bytes and "
                             "computes far faster on this CPU)")
    parser.add_argument("--dry-run-small", action="store_true",
                        help=f"a ~134M variant ({DRY_RUN_LAYERS} layers) to check the script, with an extrapolation "
                             f"to the full configuration")
    parser.add_argument("--tiny", action="store_true",
                        help="a ~0.13M-parameter GPT in 128 KiB chunks (64 KiB disk I/O buffers) to check the script "
                             "in seconds (no target; --compare-to still applies)")
    parser.add_argument("--matmul", choices=("native", "fp32"), default=None,
                        help="'native': matmuls in the 16-bit dtype (default; --target-4b: fp32); 'fp32': the linear "
                             "layers upcast to fp32 for the matmul (bf16/fp16 backward matmuls are 50-100x slower "
                             "than fp32 ones on this AVX2 CPU); the stored parameters stay 16-bit")
    parser.add_argument("--force", action="store_true",
                        help="start even if the memory estimate exceeds the available memory (the kernel may kill it)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--no-fail", action="store_true",
                        help="exit 0 even if the model is under the minimum or a step over the time limit")
    parser.add_argument("--target-4b", action="store_true",
                        help="the issue-11 target: >= 4B parameters (d_model 4096, 32 heads, bf16 unless given), "
                             "optimizer state on disk (--nvme-path), every step <= --max-step-seconds")
    parser.add_argument("--target-10b", action="store_true",
                        help="issue 40's target: >= 10B parameters as --target-4b, with torchao's AdamW8bit and bf16 "
                             "masters rounded stochastically (--optimizer adamw8bit --stochastic-round), parameters "
                             f"and state on disk, every step <= {MAX_STEP_SECONDS_4B:g} s and a peak RSS <= "
                             f"{MAX_PEAK_BYTES_PER_PARAM_10B} B/param")
    parser.add_argument("--optimizer", choices=("hybridadam", "adamw8bit"), default="hybridadam",
                        help="HybridAdam (fp32 moments; default) or torchao's AdamW8bit (8-bit moments in the chunks)")
    parser.add_argument("--stochastic-round", action="store_true",
                        help="with --optimizer adamw8bit and bf16: bf16_stochastic_round=True (the parameters are "
                             "their own masters: no fp32 master)")
    parser.add_argument("--max-step-seconds", type=float, default=None,
                        help=f"a step's time limit (default: none; {MAX_STEP_SECONDS_4B:g} with --target-4b)")
    parser.add_argument("--nvme-path", default=None,
                        help="rest the optimizer state in files under this directory (offload_optimizer='disk')")
    parser.add_argument("--offload-param", action="store_true",
                        help="with --nvme-path: the 16-bit parameters too (offload_param='disk', reuse_fp16_shard off)")
    parser.add_argument("--atomic-step", action=argparse.BooleanOptionalAction, default=True,
                        help="atomic optimizer steps on disk (two slots: files twice the state; default on)")
    parser.add_argument("--step-in-backward", action="store_true",
                        help="with --nvme-path: update each chunk whose optimizer state is on disk as soon as the "
                             "backward finishes its gradients (ShardedOptimizerV2(step_in_backward=True)): its disk "
                             "I/O overlaps the rest of the backward")
    parser.add_argument("--max-norm", type=float, default=0.0,
                        help="clip the gradients to this total norm in every step (ShardedOptimizerV2(max_norm=); "
                             "default 0: no clipping); with --step-in-backward it needs --atomic-step")
    parser.add_argument("--buffer-count", type=int, default=4, help="disk I/O buffers per family (default 4)")
    parser.add_argument("--buffer-size", type=int, default=DISK_BUFFER_SIZE,
                        help="bytes per disk I/O buffer (default 16 MiB)")
    parser.add_argument("--host-memory", default=None,
                        help="host tier capacity (chunkmem.set_host_memory_capacity), e.g. 11.75GiB")
    parser.add_argument("--results", default=None, help="write the losses and the parameter checksum to this JSON file")
    parser.add_argument("--compare-to", default=None,
                        help="a --results file of another run: exit 1 unless the losses and checksum are bitwise equal")
    args = parser.parse_args()
    if args.target_10b:
        args.target_4b, args.optimizer, args.stochastic_round = True, "adamw8bit", True
    if args.stochastic_round and args.optimizer != "adamw8bit":
        parser.error("--stochastic-round needs --optimizer adamw8bit")
    if args.target_4b and args.nvme_path is None:
        parser.error("--target-4b needs --nvme-path (the optimizer state of >= 4B parameters does not fit in memory)")
    if args.offload_param and args.nvme_path is None:
        parser.error("--offload-param needs --nvme-path")
    if args.step_in_backward and args.nvme_path is None:
        parser.error("--step-in-backward needs --nvme-path")
    d_default, heads_default, dtype_default = (4096, 32, "bf16") if args.target_4b else (2048, 16, "fp16")
    args.d_model = args.d_model or d_default
    args.heads = args.heads or heads_default
    args.dtype = args.dtype or dtype_default
    args.matmul = args.matmul or ("fp32" if args.target_4b else "native")
    chunk_size = None
    if args.tiny:
        args.vocab, args.d_model, args.heads, args.seq, args.layers = 512, 64, 4, 16, 2
        args.dry_run_small, chunk_size, args.buffer_size = False, 131072, 65536
    min_params = MIN_PARAMS_10B if args.target_10b else MIN_PARAMS_4B if args.target_4b else MIN_PARAMS
    max_step = args.max_step_seconds if args.max_step_seconds is not None else (
        MAX_STEP_SECONDS_4B if args.target_4b else None)
    disk = None if args.nvme_path is None else dict(
        offload_param=args.offload_param, atomic_step=args.atomic_step, buffer_count=args.buffer_count,
        buffer_size=args.buffer_size)
    host_capacity = None if args.host_memory is None else cm.parse_size(args.host_memory, "--host-memory")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    available_at_start = psutil.virtual_memory().available
    dtype = DTYPES[args.dtype]
    element_size = dtype.itemsize
    if args.stochastic_round and dtype != torch.bfloat16:
        parser.error("--stochastic-round needs --dtype bf16")
    state = dict(optimizer=args.optimizer, rounding=args.stochastic_round)
    optimizer_name = ("torchao AdamW8bit" + (" (bf16_stochastic_round)" if args.stochastic_round else "")
                      if args.optimizer == "adamw8bit" else "HybridAdam")
    capacity = cm.parse_size(args.device_memory, "--device-memory")

    full_layers = args.layers or layers_for(min_params, args.d_model, args.vocab, args.seq, args.heads)
    full_cfg = GPTConfig(args.vocab, args.d_model, full_layers, args.heads, args.seq)
    cfg = GPTConfig(args.vocab, args.d_model, DRY_RUN_LAYERS, args.heads, args.seq) if args.dry_run_small else full_cfg
    n_params = count_params(cfg)
    full_params = count_params(full_cfg)

    print(machine_header())
    print(f"model: {cfg.describe()}: {n_params / 1e9:.4f}B parameters (tied lm head counted once)"
          + (f" -- DRY RUN of the full {full_cfg.describe()}: {full_params / 1e9:.4f}B" if args.dry_run_small else ""))
    if args.layers is None:
        print(f"layers: {full_layers} is the fewest giving >= {min_params / 1e9:.1f}B parameters at d_model "
              f"{args.d_model}, vocab {args.vocab} ({full_layers - 1} layers: "
              f"{count_params(GPTConfig(args.vocab, args.d_model, full_layers - 1, args.heads, args.seq)) / 1e9:.4f}B)")
    print(f"training: batch {args.batch} x {args.seq} tokens, {args.steps} step(s), placement '{args.placement}', "
          f"device tier capacity {gib(capacity)}, reuse_fp16_shard={not args.offload_param}, {optimizer_name} (lr 1e-4)")
    if disk is not None:
        print(f"disk tier: nvme_path {args.nvme_path}, offload_optimizer='disk'"
              + (", offload_param='disk'" if args.offload_param else "")
              + f", atomic_step={args.atomic_step}, step_in_backward={args.step_in_backward}"
              + f", max_norm={args.max_norm:g}"
              + ("" if args.atomic_step else " (one slot: the files hold the state once; an atomic step's two "
                 "slots of a 4B model's 48 GB fp32 state would not fit this disk)")
              + f", buffer_count {args.buffer_count} x {mib(args.buffer_size)}; host capacity "
              + (gib(host_capacity) if host_capacity is not None else "unlimited"))
    elif host_capacity is not None:
        print(f"host capacity {gib(host_capacity)}")
    why = ("the target is about 16-bit storage; on this CPU fp16 matmuls are slow and the fp16 backward matmuls "
           "about 100x slower than bf16 ones, so steps take minutes (--dtype bf16 stores the same 14 B/param and "
           "computes far faster)" if args.dtype == "fp16" else
           "16-bit storage as the target asks (the same 14 B/param as fp16); bf16 matmuls are fast on this CPU, "
           "fp16 backward matmuls are about 100x slower")
    if args.matmul == "fp32":
        why = ("16-bit storage; the linear layers' matmuls run in fp32 on an fp32 copy of the weight (--matmul "
               "fp32): on this AVX2 CPU bf16/fp16 backward matmuls are 50-100x slower than fp32 ones")
    print(f"dtype: {args.dtype} storage and compute{' (matmuls in fp32)' if args.matmul == 'fp32' else ''}: {why}")
    print(f"host bound: psutil available memory at the start {gib(available_at_start)} / 14 B = "
          f"{available_at_start / 14 / 1e9:.3f}B parameters")

    # the host Adam kernel (a small ctypes library, built once into a cache) before the RSS baseline
    kernel = host_adam_ext.kernel()
    if kernel is None:
        print(f"host Adam kernel unavailable ({host_adam_ext.load_error()}): the torch-op path runs the update")
    baseline = rss_bytes()
    est = estimate(cfg, args.batch, args.placement, capacity, element_size, baseline, disk, host_capacity,
                   chunk_size, args.step_in_backward, **state)
    available = psutil.virtual_memory().available
    disk_free = None if disk is None else shutil.disk_usage(args.nvme_path).free
    print_estimate(est, cfg, n_params, available, "this run", disk_free)
    if args.dry_run_small:
        full_est = estimate(full_cfg, args.batch, args.placement, capacity, element_size, baseline, disk,
                            host_capacity, step_in_backward=args.step_in_backward, **state)
        print_estimate(full_est, full_cfg, full_params, available, "the full configuration", disk_free)
    sys.stdout.flush()
    if disk is not None and est["disk"] > disk_free:
        print(f"REFUSED: the disk tier's files need about {gib(est['disk'])} but {args.nvme_path} has "
              f"{gib(disk_free)} free" + (" (--no-atomic-step halves them)" if args.atomic_step else ""))
        return 2
    if est["total"] > available:
        print(f"REFUSED: the run needs about {gib(est['total'])} but only {gib(available)} are available; free "
              f"memory, use fewer layers (--layers), or --force to start anyway (the kernel may kill the process).")
        if not args.force:
            return 2
        print("--force: starting anyway")
    print()

    if chunk_size is None and disk is not None:
        # the searched chunk size given to ZeroInitContext too: the wrap then keeps the context's chunks
        # (without it, the context's own chunks and the wrap's copies were both alive: ~2.5x the 16-bit
        # parameters at the peak of the build)
        chunk_size = est["chunk_numel"] * element_size
    cm.set_device_memory_capacity(capacity)
    if host_capacity is not None:
        cm.set_host_memory_capacity(host_capacity)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # with the parameters on disk they are built there too (ZeroInitContext(nvme_path=)): host memory then holds
    # only the chunk being filled, never the whole model's 16-bit parameters
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=True, dtype=dtype, chunk_size=chunk_size,
                            nvme_path=args.nvme_path if args.offload_param else None):
        net = GPT(cfg, upcast=args.matmul == "fp32")
    t_init = time.perf_counter() - t0
    disk_kwargs = {} if disk is None else dict(
        offload_optimizer="disk", offload_param="disk" if args.offload_param else None, nvme_path=args.nvme_path,
        buffer_count=args.buffer_count, buffer_size=args.buffer_size, atomic_step=args.atomic_step)
    model = cm.ShardedModelV2(net, cm.TensorShardStrategy(), tensor_placement_policy=args.placement,
                              reuse_fp16_shard=not args.offload_param, chunk_size=chunk_size, **disk_kwargs)
    ledger = model.runtime.ledger
    if args.optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit
        inner = AdamW8bit(model.parameters(), lr=1e-4, bf16_stochastic_round=args.stochastic_round)
    else:
        inner = cm.HybridAdam(model.parameters(), lr=1e-4)
    optim = cm.ShardedOptimizerV2(model, inner, initial_scale=2**16, step_in_backward=args.step_in_backward,
                                  max_norm=args.max_norm)
    gc.collect()  # the ZeroInitContext chunks the wrap did not free (see bytes_per_param.py)
    build_s = time.perf_counter() - t0
    assert sum(p.numel() for p in model.parameters()) == n_params, "parameter count formula is off"
    print(f"built in {build_s:.1f} s (ZeroInitContext {t_init:.1f} s, wrap + optimizer {build_s - t_init:.1f} s): "
          f"{len(model.chunks)} chunks of {mib(model.chunks[0].param.nbytes)}; RSS {gib(rss_bytes())}, "
          f"peak {gib(peak_rss_bytes())}" + ("" if disk is None else
                                             f"; disk files {gib(model.disk_file_bytes())} (estimated {gib(est['disk'])}), "
                                             f"written at build {gib(ledger.written_to_disk)}"), flush=True)

    timer = BlockTimer(model.module.blocks)
    gen = torch.Generator().manual_seed(1)
    steps = []
    device_peak = 0
    for i in range(args.steps):
        tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=gen)
        timer.reset()
        read0, written0 = ledger.read_from_disk, ledger.written_to_disk
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        optim.backward(loss)
        t2 = time.perf_counter()
        updated = optim.step()
        optim.zero_grad()
        t3 = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        del logits
        totals = model.memory_stats()["totals"]
        device_peak = max(device_peak, totals["peak_device_bytes"])
        blk_fwd, blk_bwd = timer.per_block()
        steps.append(dict(loss=loss.item(), total=t3 - t0, fwd=t1 - t0, bwd=t2 - t1, opt=t3 - t2, updated=updated,
                          blk_fwd=blk_fwd, blk_bwd=blk_bwd, read=ledger.read_from_disk - read0,
                          written=ledger.written_to_disk - written0))
        print(f"step {i + 1}: loss {loss.item():.4f}, {t3 - t0:.1f} s (forward {t1 - t0:.1f}, backward {t2 - t1:.1f}, "
              f"optimizer {t3 - t2:.1f}; one block: forward {blk_fwd:.2f}, backward {blk_bwd:.2f}), "
              f"{'updated' if updated else 'SKIPPED (overflow)'}, loss scale {optim.loss_scale:g}; peak RSS "
              f"{gib(peak_rss_bytes())}, RSS {gib(rss_bytes())}; moved to device {mib(totals['moved_to_device_bytes'])}, "
              f"to host {mib(totals['moved_to_host_bytes'])}, device-tier peak {mib(totals['peak_device_bytes'])}"
              + ("" if disk is None else f"; disk read {gib(steps[-1]['read'])}, written {gib(steps[-1]['written'])}")
              + f"; CPU {usage.ru_utime - usage0.ru_utime:.1f} s user, {usage.ru_stime - usage0.ru_stime:.1f} s "
              f"system, {usage.ru_minflt - usage0.ru_minflt:,} page faults",
              flush=True)

    tiers = model.tier_bytes()
    host_total = sum(tiers["host"].values())
    device_total = sum(tiers["device"].values())
    optim_device, optim_host, optim_disk = optim.get_memory_usage(with_disk=True)
    peak = peak_rss_bytes()
    print()
    print(f"at rest (after the last step + zero_grad): host {gib(host_total)} = {host_total / n_params:.3f} B/param "
          f"(model.tier_bytes(): " + ", ".join(f"{k} {mib(v)}" for k, v in tiers["host"].items())
          + f"), device {mib(device_total)}; optimizer state: host {gib(optim_host)}, device {mib(optim_device)}"
          + ("" if disk is None else f", disk {gib(optim_disk)}"))
    if disk is not None:
        disk_total = sum(tiers["disk"].values())
        print(f"disk tier: {gib(disk_total)} = {disk_total / n_params:.3f} B/param (model.tier_bytes(): "
              + ", ".join(f"{k} {mib(v)}" for k, v in tiers["disk"].items())
              + f"); files {model.disk_file_bytes():,} bytes (estimated {est['disk']:,}) in {model.disk_path}; "
              f"per step read {gib(steps[-1]['read'])}, written {gib(steps[-1]['written'])} "
              f"(ledger counters; {steps[-1]['read'] / n_params:.2f} and {steps[-1]['written'] / n_params:.2f} B/param)")
    print(f"peak RSS {gib(peak)} = {peak / n_params:.3f} B/param (estimate was {gib(est['total'])}: "
          f"measured / estimate = {peak / est['total']:.3f}); device-tier peak of chunk memory {mib(device_peak)} "
          f"({device_peak / model.chunks[0].param.nbytes:.1f} chunks; estimated {mib(est['device'])})")
    checksum = parameter_checksum(model)
    losses = [st["loss"].hex() for st in steps]
    print(f"parameter checksum (SHA-256 of every parameter's {args.dtype} values after the last step): {checksum}")
    print(f"losses (hex): {' '.join(losses)}")
    results = dict(losses=losses, checksum=checksum, params=n_params, dtype=args.dtype, config=cfg.describe(),
                   placement=args.placement, nvme_path=args.nvme_path, host_memory=args.host_memory)
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
        print(f"results written to {args.results}")
    same = True
    if args.compare_to:
        with open(args.compare_to) as f:
            other = json.load(f)
        same = other["losses"] == losses and other["checksum"] == checksum
        print(f"{'BITWISE EQUAL' if same else 'DIFFERENT'}: this run ({args.placement}"
              + (f", host capacity {args.host_memory}" if args.host_memory else "")
              + f") against {args.compare_to} ({other['placement']}"
              + (f", host capacity {other['host_memory']}" if other.get("host_memory") else "")
              + f"): losses {other['losses']} vs {losses}, checksum {other['checksum'][:16]}... vs {checksum[:16]}...")
    bound = available_at_start / 14
    print(f"host bound: {available_at_start / 2**30:.2f} GiB available at the start / 14 B = {bound / 1e9:.3f}B "
          f"parameters; this model: {n_params / 1e9:.4f}B = {100 * n_params / bound:.1f}% of the bound "
          f"(plain PyTorch fp32 + fused AdamW at 16 B/param: at most {available_at_start / 16 / 1e9:.3f}B)"
          + ("" if disk is None else f"; with the disk tier the host holds {host_total / n_params:.3f} B/param at "
                                      f"rest, peak RSS {peak / n_params:.3f} B/param"))

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
              + (f" --d-model {args.d_model}" if args.d_model != d_default else "")
              + (" --target-10b" if args.target_10b else " --target-4b" if args.target_4b else "")
              + (f" --optimizer {args.optimizer}" if args.optimizer != "hybridadam" and not args.target_10b else "")
              + (" --stochastic-round" if args.stochastic_round and not args.target_10b else "")
              + (f" --seq {args.seq}" if args.seq != 64 else "")
              + (f" --matmul {args.matmul}" if args.matmul != ("fp32" if args.target_4b else "native") else "")
              + (f" --nvme-path {args.nvme_path}" if args.nvme_path else "")
              + (" --offload-param" if args.offload_param else "")
              + ("" if args.atomic_step or disk is None else " --no-atomic-step")
              + (" --step-in-backward" if args.step_in_backward else "")
              + (f" --max-norm {args.max_norm:g}" if args.max_norm else "")
              + (f" --host-memory {args.host_memory}" if args.host_memory else ""))
        print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
        print("DRY RUN done (no target)")
        return 0 if same else 1
    if args.tiny:
        print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
        print("TINY run done (no target)")
        return 0 if same else 1

    slowest = max(st["total"] for st in steps)
    fast = max_step is None or slowest <= max_step
    small = not args.target_10b or peak / n_params <= MAX_PEAK_BYTES_PER_PARAM_10B
    ok = (n_params >= min_params and len(steps) == args.steps and all(st["loss"] == st["loss"] for st in steps)
          and fast and small)
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")
    print(f"{'PASS' if ok else 'MISS'}  trained a {n_params / 1e9:.4f}B-parameter GPT for {len(steps)} step(s) "
          f"({sum(st['updated'] for st in steps)} updated) with a {gib(capacity)} device tier"
          + ("" if disk is None else f" and the optimizer state{' and parameters' if args.offload_param else ''} on disk")
          + f", slowest step {slowest:.1f} s (target >= {min_params / 1e9:.1f}B"
          + ("" if max_step is None else f", a step <= {max_step:g} s")
          + (f"; peak RSS {peak / n_params:.3f} B/param, target <= {MAX_PEAK_BYTES_PER_PARAM_10B}"
             if args.target_10b else "") + ")")
    if not same:
        return 1
    return 0 if ok or args.no_fail else 1


if __name__ == "__main__":
    sys.exit(main())
