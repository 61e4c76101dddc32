"""``python -m chunkmem.plan``: the planner's command line (see :mod:`chunkmem.plan`)."""
from __future__ import annotations

import argparse
import importlib
import json
from typing import Sequence
import torch
import torch.nn as nn

from .machine_profile import MachineProfile
from ..gpt import GPT, GPTConfig
from .candidates import choose
from .meta_run import format_table, plan


PRESETS = {  # (vocab, d_model, layers, heads)
    "tiny": (512, 256, 4, 4), "gpt2-small": (50257, 768, 12, 12), "gpt2-medium": (50257, 1024, 24, 16),
    "gpt2-large": (50257, 1280, 36, 20), "gpt2-xl": (50257, 1600, 48, 25),
}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m chunkmem.plan", description="Will it fit? Plan one training "
                                "step per placement policy without allocating the model.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="a GPT of chunkmem.gpt (the benchmarks' model) in this shape")
    p.add_argument("--builder", default=None, help="MODULE:FUNCTION building the model instead of --preset "
                                                   "(called with no argument; the batch is token ids)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="token id range of the batch (default: the preset's)")
    p.add_argument("--device-memory", required=True, help="device tier capacity, e.g. 24GiB")
    p.add_argument("--host-memory", default=None, help="host tier capacity, e.g. 64GiB (default: unbounded)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--chunk-size", type=int, default=None, help="bytes per chunk (default: searched)")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1,
                   help="forward/backward passes per optimizer step (default 1): the peaks count the gradients "
                        "summed over them")
    p.add_argument("--grad-accum-dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="what 16-bit gradients of several backwards are summed in: fp32 (the default) or the "
                        "model's --dtype (kept in 16 bits, 2 bytes a parameter fewer while accumulating)")
    p.add_argument("--optimizer-states", default="fp32",
                   help="the optimizer state planned: fp32 (Adam's moments, the default), 8bit (8-bit moments: "
                        "HybridAdam(state_dtype='8bit'), torchao's AdamW8bit) or 8bit-bf16 (8-bit moments over bf16 "
                        "parameters that are their own masters: bf16_stochastic_round=True); with "
                        "--candidates, several comma-separated (e.g. fp32,8bit)")
    p.add_argument("--candidates", action="store_true",
                   help="plan every candidate (placements, static fractions, the disk tier, reuse_fp16_shard) with "
                        "a predicted time per step, and mark the fastest that fits")
    p.add_argument("--disk-memory", default=None, help="with --candidates: bytes the disk tier's files may use, "
                                                       "e.g. 200GiB (default: no disk candidates)")
    p.add_argument("--nvme-path", default=None, help="with --candidates: the disk tier's directory (its bandwidth "
                                                     "is measured there)")
    p.add_argument("--ranks", type=int, default=1, help="with --candidates: data-parallel processes (bytes per rank)")
    p.add_argument("--static-fractions", default="0.5:0.5",
                   help="with --candidates: offload_param_frac:offload_optim_frac pairs for 'static', comma-separated "
                        "('' for none)")
    p.add_argument("--profile", default=None, help="with --candidates: a MachineProfile JSON file to use instead "
                                                   "of measuring this machine")
    p.add_argument("--save-profile", default=None, help="with --candidates: write the profile used (with the "
                                                        "operators measured) to this JSON file")
    args = p.parse_args(argv)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    dtype = dtypes[args.dtype]
    accumulation = dict(gradient_accumulation_steps=args.gradient_accumulation_steps,
                        grad_accum_dtype=dtypes.get(args.grad_accum_dtype))
    if args.builder:
        module_name, _, function = args.builder.partition(":")
        builder = getattr(importlib.import_module(module_name), function)
        vocab = args.vocab or 2
    else:
        vocab_size, d_model, layers, heads = PRESETS[args.preset]
        def builder() -> nn.Module:
            return GPT(GPTConfig(vocab_size, d_model, layers, heads, args.seq_len))
        vocab = args.vocab or vocab_size
    batch = torch.randint(0, vocab, (args.batch_size, args.seq_len))
    states = tuple(args.optimizer_states.split(","))
    if not args.candidates:
        state = states[0] if len(states) == 1 else args.optimizer_states  # (several: refused by plan, named)
        print(format_table(plan(builder, batch, args.device_memory, args.host_memory, dtype=dtype,
                                chunk_size=args.chunk_size, optimizer_state=state, **accumulation)))
        return
    profile = None
    if args.profile:
        with open(args.profile) as f:
            profile = MachineProfile.from_dict(json.load(f))
    fractions = tuple(tuple(float(x) for x in pair.split(":")) for pair in args.static_fractions.split(",") if pair)
    choice = choose(builder, batch, args.device_memory, args.host_memory, args.disk_memory, ranks=args.ranks,
                    dtype=dtype, profile=profile, nvme_path=args.nvme_path, chunk_size=args.chunk_size,
                    static_fractions=fractions, optimizer_states=states, **accumulation)
    if args.save_profile:
        with open(args.save_profile, "w") as f:
            json.dump(choice.profile.to_dict(), f)
    print(choice.table())
    if choice.recommended is None:
        print("nothing fits these budgets")
