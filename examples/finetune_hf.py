"""Fine-tune a Hugging Face GPT-2 with chunkmem: the ZeRO tutorial's loop with chunkmem names.

The loop is the tutorial's (``GPTLMModel`` wrapping ``GPT2LMHeadModel`` with gradient checkpointing,
``GPTLMLoss``, ``ZeroInitContext(shard_param=True)``, ``ShardedModelV2(..., reuse_fp16_shard=...)``,
``HybridAdam`` in ``ShardedOptimizerV2``), plus what a real fine-tuning run needs:

* weights from a local ``save_pretrained`` directory (``--model DIR``): ``GPT2LMHeadModel.from_pretrained``
  inside ``ZeroInitContext`` reads them straight into the chunks (see ``chunkmem.io.pretrained``); without
  ``--model`` a tiny GPT-2 config is built on the fly;
* gradient clipping (``optim.clip_grad_norm``), a cosine learning-rate schedule with warm-up (a
  ``torch.optim.lr_scheduler.LambdaLR`` over the ShardedOptimizerV2), an eval loss on held-out batches;
* a progress line per ``--log-every`` steps: loss, learning rate, tokens/s and the bytes each tier holds;
* ``--save DIR``: a chunkmem checkpoint (model, optimizer, schedule, random state) to resume from, and a
  ``hf/`` export that plain ``transformers`` loads; ``--resume DIR`` continues such a run bit for bit.

The data is a learnable synthetic token stream (a token is usually followed by a fixed successor), the
batch of step ``s`` drawn from ``seed`` and ``s`` alone, so a resumed run sees the batches it would have seen.

    python examples/finetune_hf.py                                  # about a minute on 2 CPU cores
    python examples/finetune_hf.py --stop-at 60 --save run1
    python examples/finetune_hf.py --resume run1                    # continues from step 60 to 100
    python examples/finetune_hf.py --model run1/hf --steps 20       # fine-tune the exported weights
    torchrun --nproc_per_node 2 examples/finetune_hf.py             # ZeRO-3 over 2 processes
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import chunkmem as cm
from chunkmem.io import pretrained

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class GPTLMModel(nn.Module):
    """The tutorial's wrapper: a ``GPT2LMHeadModel`` that returns only the logits."""

    def __init__(self, model_dir=None, vocab=128, seq_len=32, layers=2, hidden=64, heads=2, checkpoint=True):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.checkpoint = checkpoint
        if model_dir is not None:   # inside ZeroInitContext: the weights go straight into the chunks
            self.model = GPT2LMHeadModel.from_pretrained(model_dir)
        else:
            self.model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq_len,
                                                    vocab_size=vocab, bos_token_id=0, eos_token_id=0))
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=not self.checkpoint)[0]


class GPTLMLoss(nn.Module):
    """Next-token cross entropy, as in the tutorial."""

    def __init__(self):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def get_batch(seed, step, rank, batch_size, seq_len, vocab, noise=0.1):
    """Batch ``step`` of this rank: token t is followed by ``perm[t]``, or by a random token with
    probability ``noise``. Depends only on its arguments (a resumed run draws the same batches); the
    eval batches are steps -1, -2, ... (never trained on)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed((seed * 1_000_003 + step * 101 + rank) % 2**62)
    tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
    for t in range(1, seq_len):
        noisy = torch.rand(batch_size, generator=g) < noise
        tokens[:, t] = torch.where(noisy, torch.randint(0, vocab, (batch_size,), generator=g), perm[tokens[:, t - 1]])
    return tokens, torch.ones_like(tokens)


def cosine_with_warmup(warmup, total, floor=0.1):
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a local save_pretrained directory of a GPT-2 (default: tiny config)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (the schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (then --save, --resume later)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm (0: off)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--placement", choices=["cpu", "cuda", "auto", "static"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: fp16 with a GPU (as the tutorial), fp32 on the CPU (16-bit matmuls are slow there)")
    p.add_argument("--no-checkpointing", action="store_true", help="turn off gradient checkpointing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="write a resumable checkpoint and an hf/ export here at the end")
    p.add_argument("--resume", default=None, help="continue a run saved with --save")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.dtype is None:
        args.dtype = "fp16" if torch.cuda.is_available() else "fp32"
    return args


def join_process_group():
    """Under torchrun (WORLD_SIZE > 1) join the default group; returns (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def tier_mib(model):
    tiers = model.tier_bytes()
    return sum(tiers["device"].values()) / 2**20, sum(tiers["host"].values()) / 2**20


def evaluate(model, criterion, args, rank):
    model.eval()
    with torch.no_grad():
        losses = [criterion(model(*batch), batch[0]).item()
                  for batch in (get_batch(args.seed, -1 - i, rank, args.batch_size, args.seq_len, args.vocab)
                                for i in range(args.eval_batches))]
    model.train()
    return sum(losses) / len(losses)


def main(argv=None):
    """Run the fine-tuning; returns ``{"losses": [...], "eval_losses": [(step, loss), ...], "model": ...}``."""
    args = parse_args(argv)
    rank, world = join_process_group()
    say = (lambda *a: None) if args.quiet or rank else print
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    on_gpu = args.placement == "cuda" and torch.cuda.is_available()
    shard_strategy = cm.TensorShardStrategy()

    # 1. Build (or load) the model inside ZeroInitContext: parameters go straight into chunks.
    with cm.ZeroInitContext(target_device=torch.device("cuda" if on_gpu else "cpu"), shard_strategy=shard_strategy,
                            shard_param=True, dtype=dtype):
        model = GPTLMModel(args.model, args.vocab, args.seq_len, args.layers, args.hidden, args.heads,
                           checkpoint=not args.no_checkpointing)
    config = model.model.config
    args.vocab, args.seq_len = config.vocab_size, min(args.seq_len, config.n_positions)
    n_params = sum(p.numel() for p in model.parameters())

    # 2. Wrap model and optimizer (16-bit: gradients reuse the parameter memory, as in the tutorial).
    model = cm.ShardedModelV2(model, shard_strategy, tensor_placement_policy=args.placement,
                              reuse_fp16_shard=dtype != torch.float32,
                              **({"offload_param_frac": 0.5, "offload_optim_frac": 0.5}
                                 if args.placement == "static" else {}))
    criterion = GPTLMLoss()
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=args.lr, weight_decay=0.01),
                                  initial_scale=2**5)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, cosine_with_warmup(args.warmup, args.steps))
    start = 0
    if args.resume:
        cm.load_checkpoint(os.path.join(args.resume, "chunkmem.pt"), model, optim)
        trainer = torch.load(os.path.join(args.resume, f"trainer{rank}.pt"), weights_only=False)
        schedule.load_state_dict(trainer["schedule"])
        torch.set_rng_state(trainer["rng"])
        start = trainer["step"]
        say(f"resumed from {args.resume} at step {start}")
    say(f"GPT-2: {n_params / 1e6:.2f}M parameters in {len(model.chunks)} chunks, dtype {args.dtype}, "
        f"placement {args.placement!r}" + (f", {world} ranks" if world > 1 else "")
        + (f", weights from {args.model}" if args.model else ", tiny config"))

    # 3. Train: the tutorial's loop, with clipping, the schedule and an eval loss.
    losses, eval_losses = [], []
    tokens, clock = 0, time.perf_counter()
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    for step in range(start, stop):
        input_ids, attention_mask = get_batch(args.seed, step, rank, args.batch_size, args.seq_len, args.vocab)
        outputs = model(input_ids, attention_mask)
        loss = criterion(outputs, input_ids)
        optim.backward(loss)
        if args.clip > 0:
            optim.clip_grad_norm(args.clip)
        optim.step()
        optim.zero_grad()
        schedule.step()
        losses.append(loss.item())
        tokens += input_ids.numel() * world
        done = step + 1
        if done % args.log_every == 0 or done == stop:
            elapsed = time.perf_counter() - clock
            device_mib, host_mib = tier_mib(model)
            bar = "#" * (20 * done // args.steps)
            say(f"[{bar:<20}] {done:5d}/{args.steps} loss {losses[-1]:.4f} lr {schedule.get_last_lr()[0]:.2e} "
                f"{tokens / elapsed:8.0f} tokens/s  device {device_mib:.2f} MiB host {host_mib:.2f} MiB")
            tokens, clock = 0, time.perf_counter()
        if done % args.eval_every == 0 or done == stop:
            eval_losses.append((done, evaluate(model, criterion, args, rank)))
            say(f"{'':22} eval loss {eval_losses[-1][1]:.4f} at step {done}")

    # 4. Save: a resumable chunkmem checkpoint and a Hugging Face export.
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        cm.save_checkpoint(os.path.join(args.save, "chunkmem.pt"), model, optim)
        torch.save({"step": max(start, stop), "schedule": schedule.state_dict(), "rng": torch.get_rng_state()},
                   os.path.join(args.save, f"trainer{rank}.pt"))
        pretrained.save_pretrained(model, os.path.join(args.save, "hf"), module=model.module.model)
        say(f"saved to {args.save} (resume with --resume {args.save}; {args.save}/hf loads with from_pretrained)")
    if losses:
        say(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")
    return {"losses": losses, "eval_losses": eval_losses, "model": model}


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
