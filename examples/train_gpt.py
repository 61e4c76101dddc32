"""Train a small GPT with chunkmem.

This script shows the whole chunkmem flow on one page:

  1. build the model inside ``ZeroInitContext``, so its parameters go straight into chunks;
  2. wrap it in ``ShardedModelV2``, which places the chunks on the device or host tier;
  3. wrap a ``HybridAdam`` in ``ShardedOptimizerV2``, which keeps fp32 masters and Adam state per chunk;
  4. train with ``optim.backward(loss)``, ``optim.clip_grad_norm(...)``, ``optim.step()``,
     ``scheduler.step()``, ``optim.zero_grad()``, printing the loss, the speed and how many bytes each
     memory tier holds (the learning rate warms up linearly, then follows a cosine to 10%).

The data is a synthetic, learnable token stream (each token is usually followed by a fixed
"successor" token), so the loss falls visibly within a few dozen steps.

Run it with:

    python examples/train_gpt.py                      # defaults: under a minute on 2 CPU cores
    python examples/train_gpt.py --dtype bf16 --reuse-fp16-shard
    python examples/train_gpt.py --placement cuda --device-memory 1GiB
    python examples/train_gpt.py --optimizer adamw8bit    # torchao's 8-bit Adam moments in the chunks
    torchrun --nproc_per_node 2 examples/train_gpt.py  # ZeRO-3: every chunk sharded over 2 processes
    python examples/train_gpt.py --steps 30 --stop-after 10 --save ck.pt   # stop early ...
    python examples/train_gpt.py --steps 30 --resume ck.pt                 # ... and continue exactly

Without a GPU the "device" tier is the CPU under a capacity (``--device-memory``), so every
option runs on a laptop as well. Under ``torchrun`` each process joins the data-parallel group
(NCCL with GPUs, gloo without), keeps 1/N of every chunk and trains on its own batches; only rank 0
prints. Several nodes: the same command on each node with ``--nnodes``, ``--node_rank`` and
``--rdzv_endpoint`` (see the README).
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import chunkmem as cm

# ----------------------------------------------------------------------------------------------
# The model: a small GPT (token + position embedding, pre-LayerNorm blocks, tied lm head)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by the number of heads"
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)   # query, key and value in one matrix product
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, n_layers, d_model, n_heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)      # token embedding
        self.wpe = nn.Embedding(seq_len, d_model)    # position embedding
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight        # weight tying: the lm head reuses the embedding
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------------------------------
# Synthetic data: token t is followed by perm[t] most of the time, by a random token otherwise.

NOISE = 0.1   # share of random tokens


def make_batch(generator, perm, batch_size, seq_len, noise=NOISE):
    vocab = perm.numel()
    tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch_size,), generator=generator)
    for t in range(1, seq_len + 1):
        follow = perm[tokens[:, t - 1]]
        random = torch.randint(0, vocab, (batch_size,), generator=generator)
        is_noise = torch.rand(batch_size, generator=generator) < noise
        tokens[:, t] = torch.where(is_noise, random, follow)
    return tokens[:, :-1], tokens[:, 1:]   # inputs, and targets shifted by one


def ideal_loss(vocab, noise=NOISE):
    """Entropy of the next token: the best loss any model can reach on this data."""
    p_follow = 1 - noise + noise / vocab
    p_other = noise / vocab
    return -(p_follow * math.log(p_follow) + (vocab - 1) * p_other * math.log(p_other))


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args():
    has_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--placement", choices=["cpu", "cuda", "auto"], default="cuda" if has_cuda else "cpu",
                   help="'cuda': all chunks and Adam state on the device tier; 'cpu': they rest on the host; "
                        "'auto': traced first step, then chunks stay on the device until evicted (Belady)")
    p.add_argument("--gpu-margin-mem-ratio", type=float, default=0.0,
                   help="with 'auto': share of the device margin that holds optimizer state")
    p.add_argument("--memstats", default=None,
                   help="write the memory statistics (JSON) here at the end; draw with tools/memstats_view.py")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None,
                   help="compute/storage dtype (default: fp16 with CUDA, fp32 without)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["hybridadam", "adamw8bit"], default="hybridadam",
                   help="HybridAdam (fp32 moments) or torchao's AdamW8bit (8-bit moments; pip install torchao)")
    p.add_argument("--device-memory", default=None,
                   help="device tier capacity, e.g. '1GiB' (default: free GPU memory, or free host memory)")
    p.add_argument("--reuse-fp16-shard", action="store_true",
                   help="keep gradients in the 16-bit parameter memory (needs --dtype fp16 or bf16)")
    p.add_argument("--chunk-size", type=int, default=None, help="bytes per chunk (default: searched)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the gradients' total norm to this before each step (0: no clipping)")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine",
                   help="'cosine': linear warm-up, then cosine decay to 10%% of --lr at --steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="linear warm-up steps of the cosine schedule")
    p.add_argument("--save", default=None,
                   help="write a full checkpoint (model + optimizer) here at the end, and the loop's state "
                        "(step, LR schedule, data stream) beside it as SAVE.loop<rank>")
    p.add_argument("--resume", default=None,
                   help="continue from a checkpoint written by --save (same --steps and model options)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step (the schedule still spans --steps): save, and --resume later")
    args = p.parse_args()
    if args.grad_clip < 0 or args.warmup_steps < 0 or args.steps < 1:
        p.error("--grad-clip and --warmup-steps must be >= 0, --steps >= 1")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after must be between 1 and --steps ({args.steps})")
    if args.dtype is None:
        args.dtype = "fp16" if has_cuda else "fp32"
        if not has_cuda:
            print("no GPU: using fp32, the default on CPU, because 16-bit matmuls are 10-50x slower on this CPU")
    return args


def lr_factor(step, args):
    """Multiplier of --lr for optimizer step ``step`` (0-based): linear warm-up, then cosine to 0.1."""
    if args.lr_schedule == "constant":
        return 1.0
    if step < args.warmup_steps:
        return (step + 1) / (args.warmup_steps + 1)
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def loop_state_path(checkpoint, rank):
    return f"{checkpoint}.loop{rank}"


def join_process_group():
    """Under torchrun (WORLD_SIZE > 1): join the default group and return (rank, world), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))   # share the cores
    return dist.get_rank(), world


def main():
    args = parse_args()
    rank, world = join_process_group()
    say = print if rank == 0 else (lambda *a, **k: None)   # one process prints
    torch.manual_seed(args.seed)   # the same seed on every rank: each builds the same model and keeps its shard
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.device_memory is not None:
        cm.set_device_memory_capacity(args.device_memory)

    # 1. Build the model inside ZeroInitContext: each module's parameters move into chunks as soon as
    #    that module is built. Chunks start on the GPU for placement 'cuda' (when there is one), else on the host.
    on_gpu = args.placement == "cuda" and torch.cuda.is_available()
    with cm.ZeroInitContext(target_device=torch.device("cuda" if on_gpu else "cpu"),
                            shard_strategy=cm.TensorShardStrategy(), shard_param=True, dtype=dtype):
        model = GPT(args.vocab, args.seq_len, args.layers, args.d_model, args.heads)
    n_params = sum(p.numel() for p in model.parameters())

    # 2. Wrap it: the placement policy decides which tier the chunks rest on.
    model = cm.ShardedModelV2(model, cm.TensorShardStrategy(), tensor_placement_policy=args.placement,
                              reuse_fp16_shard=args.reuse_fp16_shard, chunk_size=args.chunk_size)

    # 3. Wrap the optimizer: fp32 masters and Adam moments live in chunks too. Only fp16 uses the loss
    #    scale; bf16 and fp32 train unscaled.
    #    (--optimizer adamw8bit: torchao's AdamW8bit, its moments 8-bit codes and block scales in the chunks.)
    if args.optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit
        inner = AdamW8bit(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        inner = cm.HybridAdam(model.parameters(), lr=args.lr)
    optim = cm.ShardedOptimizerV2(model, inner, initial_scale=2**16, gpu_margin_mem_ratio=args.gpu_margin_mem_ratio)

    # The LR schedule: torch's schedulers take a ShardedOptimizerV2 (every step reads the groups' lr).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: lr_factor(step, args))

    say(f"GPT: {n_params / 1e6:.2f}M parameters in {len(model.chunks)} chunks of "
          f"{model.chunk_numel * torch.finfo(dtype).bits / 8 / 2**20:.2f} MiB, "
          f"dtype {args.dtype}, placement {args.placement!r}, device {model.compute_device}"
          + (f", {world} data-parallel ranks (each keeps 1/{world} of every chunk)" if world > 1 else ""))
    say(f"ideal loss on this data is about {ideal_loss(args.vocab):.2f} "
          f"(a random guess is {math.log(args.vocab):.2f})")

    # 4. Train. Every rank draws its own batches from the same token stream rule.
    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed))
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    losses = []
    first_step = 1
    if args.resume:
        # Model + optimizer (masters, moments, loss scale), then the loop: step, schedule, data stream.
        cm.load_checkpoint(args.resume, model, optim)
        loop = torch.load(loop_state_path(args.resume, rank), weights_only=True)
        scheduler.load_state_dict(loop["scheduler"])
        for group, lr in zip(optim.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        generator.set_state(loop["generator"])
        first_step = loop["step"] + 1
        say(f"resumed from {args.resume} after step {loop['step']}")
        if first_step > (args.stop_after or args.steps):
            raise SystemExit(f"nothing to train: the checkpoint is at step {loop['step']}, --steps is {args.steps}")
    last_step = args.stop_after or args.steps
    say("device/host MiB: chunk memory (parameters, gradients, optimizer state) on each tier after the step"
          + (" (rank 0)" if world > 1 else ""))
    say(f"{'step':>5} {'loss':>8} {'tokens/s':>10} {'device MiB':>11} {'host MiB':>9}")
    for step in range(first_step, last_step + 1):
        x, y = make_batch(generator, perm, args.batch_size, args.seq_len)
        start = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(logits.device).reshape(-1))
        optim.backward(loss)
        if args.grad_clip > 0:
            optim.clip_grad_norm(args.grad_clip)   # folded into the coming step's update
        updated = optim.step()   # False when fp16 gradients overflowed: the step is skipped, the scale lowered
        scheduler.step()
        optim.zero_grad()
        losses.append(loss.item())   # .item() waits for the GPU, so the timing below is honest
        elapsed = time.perf_counter() - start

        tiers = model.tier_bytes()
        device_bytes, host_bytes = sum(tiers["device"].values()), sum(tiers["host"].values())
        say(f"{step:5d} {losses[-1]:8.4f} {world * x.numel() / elapsed:10.0f} "
              f"{device_bytes / 2**20:11.2f} {host_bytes / 2**20:9.2f}"
              + ("" if updated else f"  skipped (overflow), loss scale now {optim.loss_scale:g}"))

    device_bytes, host_bytes = optim.get_memory_usage()
    say(f"optimizer state (masters + exp_avg + exp_avg_sq): device {device_bytes / 2**20:.2f} MiB, "
          f"host {host_bytes / 2**20:.2f} MiB")
    say(f"final loss {losses[-1]:.4f}")
    if args.memstats:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        model.dump_memory_stats(args.memstats)
    if args.save:
        cm.save_checkpoint(args.save, model, optim)   # every rank calls it; rank 0 writes the file
        torch.save({"step": last_step, "scheduler": scheduler.state_dict(), "generator": generator.get_state()},
                   loop_state_path(args.save, rank))
        say(f"checkpoint written to {args.save}")
    say(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
