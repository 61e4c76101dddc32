"""Fine-tune LoRA adapters on a frozen base that does not fit in the device tier, with chunkmem and PEFT.

The base (a Llama-style model built from a config) is built in ``ZeroInitContext``: its 16-bit parameters go
straight into chunks on the host, or onto the disk tier with ``--base-on disk`` (then host memory never holds
the whole base). PEFT adds LoRA adapters to the attention's projections afterwards, and ``ShardedModelV2``
packs the frozen base and the trainable adapters into separate chunks: the base's rest on the host (or the
disk) at 2 bytes a parameter with no gradient, no fp32 master and no optimizer state; the adapters get fp32
masters and Adam moments. Each step copies the base's chunks through the device tier one by one, so the device
tier (``--device-memory``, default a third of the base) only needs room for the chunks in use.

At the end ``--save DIR`` writes the adapter alone (``model.state_dict(trainable_only=True)`` gathers only the
adapters' chunks, ``PeftModel.save_pretrained`` writes ``adapter_model.safetensors``), which plain PEFT loads
onto the base with ``PeftModel.from_pretrained``.

    python examples/finetune_lora.py                          # bf16 base on the host, about a minute on 2 cores
    python examples/finetune_lora.py --base-on disk           # the base rests on the disk tier
    python examples/finetune_lora.py --save adapter           # then: PeftModel.from_pretrained(base, "adapter")
    torchrun --nproc_per_node 2 examples/finetune_lora.py     # every chunk sharded over 2 processes

The data is a learnable synthetic token stream (a token is usually followed by a fixed successor). On a CPU
without AVX512-BF16 16-bit matrix products are slow: ``--dtype fp32`` there.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

import chunkmem as cm

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--data-vocab", type=int, default=64, help="the tokens the data uses (the first ones of the vocabulary)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm (0: off)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the base's dtype and the compute dtype")
    p.add_argument("--base-on", choices=["host", "disk"], default="host", help="where the base's chunks rest")
    p.add_argument("--nvme-path", default=None, help="directory for the disk tier (default: a temporary one)")
    p.add_argument("--device-memory", default=None,
                   help="device tier capacity, e.g. '8MiB' (default: a third of the base's bytes)")
    p.add_argument("--chunk-size", type=int, default=2**20, help="bytes per chunk")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save", default=None, help="write the adapter alone here (PeftModel.save_pretrained)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def get_batch(seed, step, rank, batch_size, seq_len, vocab, noise=0.1):
    """Batch ``step`` of this rank: token t is followed by ``perm[t]``, or by a random token with
    probability ``noise``; depends only on its arguments."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed((seed * 1_000_003 + step * 101 + rank) % 2**62)
    tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
    for t in range(1, seq_len):
        noisy = torch.rand(batch_size, generator=g) < noise
        tokens[:, t] = torch.where(noisy, torch.randint(0, vocab, (batch_size,), generator=g), perm[tokens[:, t - 1]])
    return tokens


def build_lora_model(args, nvme_path):
    """The base in ``ZeroInitContext`` (onto the disk with ``nvme_path``), then PEFT's LoRA on q, k, v, o."""
    import peft
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_attention_heads=args.heads,
                                      num_key_value_heads=args.heads, vocab_size=args.vocab,
                                      max_position_embeddings=args.seq_len)
    torch.manual_seed(args.seed)
    with cm.ZeroInitContext(target_device=torch.device("cpu"), shard_strategy=cm.TensorShardStrategy(),
                            shard_param=True, dtype=DTYPES[args.dtype], nvme_path=nvme_path):
        base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(base, lora)


def join_process_group():
    """Under torchrun (WORLD_SIZE > 1) join the default group; returns (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def main(argv=None):
    """Train and return what a test checks: the losses, the model, the base's and the device tier's bytes."""
    args = parse_args(argv)
    rank, world = join_process_group()
    say = (lambda *a: None) if args.quiet or rank else print
    scratch = None
    nvme_path = None
    if args.base_on == "disk":
        if args.nvme_path is None:
            scratch = tempfile.TemporaryDirectory(prefix="chunkmem-lora-")
        nvme_path = os.path.join(args.nvme_path or scratch.name, f"rank{rank}")
        os.makedirs(os.path.join(nvme_path, "init"), exist_ok=True)
    module = build_lora_model(args, os.path.join(nvme_path, "init") if nvme_path else None)
    element_size = DTYPES[args.dtype].itemsize
    base_bytes = sum(p.numel() for p in module.parameters() if not p.requires_grad) * element_size
    device_capacity = cm.parse_size(args.device_memory, "--device-memory") if args.device_memory else base_bytes // 3
    cm.set_device_memory_capacity(device_capacity)
    model = cm.ShardedModelV2(module, cm.TensorShardStrategy(), tensor_placement_policy="cpu",
                              dtype=DTYPES[args.dtype], chunk_size=args.chunk_size,
                              offload_param="disk" if nvme_path else None, nvme_path=nvme_path)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=args.lr, weight_decay=0.0))
    adapter = sum(p.numel() for p in module.parameters() if p.requires_grad)
    say(f"base: {base_bytes // element_size:,} frozen parameters, {base_bytes / 2**20:.1f} MiB of {args.dtype} on the "
        f"{args.base_on}; device tier {device_capacity / 2**20:.1f} MiB ({base_bytes / device_capacity:.1f}x smaller "
        f"than the base); adapters: {adapter:,} parameters with fp32 masters; {world} rank(s)")
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = get_batch(args.seed, step, rank, args.batch_size, args.seq_len, min(args.data_vocab, args.vocab))
        loss = model(input_ids=tokens, labels=tokens)["loss"]
        optim.backward(loss)
        if args.clip:
            optim.clip_grad_norm(args.clip)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            tokens_per_s = (step + 1) * args.batch_size * args.seq_len * world / (time.perf_counter() - start)
            tiers = {tier: f"{sum(f.values()) / 2**20:.1f}" for tier, f in model.tier_bytes().items() if f}
            say(f"step {step + 1:4d}  loss {loss.item():.4f}  {tokens_per_s:,.0f} tokens/s  MiB per tier {tiers}")
    if args.save:
        state = model.state_dict(rank0_only=True, trainable_only=True)  # the adapters' chunks only
        if rank == 0:
            model.module.save_pretrained(args.save, state_dict=state)
            say(f"adapter saved to {args.save}")
    result = {"losses": losses, "model": model, "base_bytes": base_bytes, "device_capacity": device_capacity,
              "tier_bytes": model.tier_bytes()}
    if scratch is not None:
        result["scratch"] = scratch  # removed when the caller drops the result (after the model)
    return result


if __name__ == "__main__":
    main()
