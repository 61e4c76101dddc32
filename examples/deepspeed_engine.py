"""A DeepSpeed training script that runs on chunkmem: the only change is the import.

    python examples/deepspeed_engine.py                                  # ZeRO-3, optimizer state on disk
    python examples/deepspeed_engine.py --deepspeed_config my_config.json --steps 40
    torchrun --nproc_per_node 2 examples/deepspeed_engine.py             # every chunk sharded over 2 ranks

``examples/ds_config.json`` asks for ZeRO-3 with the parameters resting in host memory and the optimizer
state (fp32 masters, Adam moments) on the disk tier under ``/tmp/chunkmem_nvme``; gradient accumulation
over 2 micro batches, clipping at 1.0, AdamW with a warm-up then cosine schedule, a progress line every 5
steps. The script trains a small GPT on a learnable synthetic token stream, saves a checkpoint with a
client state halfway, and at the end resumes from it in a fresh engine and checks that the last steps come
out the same. With real DeepSpeed installed, ``import deepspeed`` instead runs the same script.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F

import chunkmem.deepspeed as deepspeed  # the one line that differs from a DeepSpeed script
from chunkmem.gpt import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def batches(steps: int, micro: int, seq: int, vocab: int):
    """A token stream where each token is usually followed by its fixed successor (learnable)."""
    g = torch.Generator().manual_seed(0)
    successor = torch.randperm(vocab, generator=g)
    for _ in range(steps):
        x = torch.empty(micro, seq, dtype=torch.long)
        x[:, 0] = torch.randint(vocab, (micro,), generator=g)
        for t in range(1, seq):
            noise = torch.randint(vocab, (micro,), generator=g)
            x[:, t] = torch.where(torch.rand(micro, generator=g) < 0.9, successor[x[:, t - 1]], noise)
        yield x


def build(args):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, d_model=128, layers=2, heads=4, seq=32))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    return engine


def train(engine, data, log: bool) -> list[float]:
    losses = []
    for x in data:
        logits = engine(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if log and engine.micro_steps % 10 == 0:
            print(f"micro step {engine.micro_steps:3d}  loss {loss.item():.4f}  lr {engine.get_lr()[0]:.2e}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default: a temporary dir)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    args.deepspeed_config = args.deepspeed_config or os.path.join(HERE, "ds_config.json")
    with open(args.deepspeed_config) as f:  # the disk tier's directory must exist
        offload = json.load(f).get("zero_optimization", {}).get("offload_optimizer", {})
    if offload.get("device") == "nvme":
        os.makedirs(offload["nvme_path"], exist_ok=True)
    deepspeed.init_distributed()
    rank0 = deepspeed.comm.get_rank() == 0
    checkpoints = args.checkpoint_dir or tempfile.mkdtemp(prefix="chunkmem-ds-")

    engine = build(args)
    micro_steps = args.steps * engine.gradient_accumulation_steps()
    data = list(batches(micro_steps, engine.train_micro_batch_size_per_gpu(), 33, 256))
    half = micro_steps // 2
    first = train(engine, data[:half], rank0)
    engine.save_checkpoint(checkpoints, client_state={"data_position": half})
    second = train(engine, data[half:], rank0)

    resumed = build(args)
    _, client = resumed.load_checkpoint(checkpoints)
    again = train(resumed, data[client["data_position"]:], False)
    if rank0:
        print(f"loss {sum(first[:8]) / 8:.3f} -> {sum(second[-8:]) / 8:.3f} over {engine.global_steps} steps; "
              f"resumed from {checkpoints}: last steps {'identical' if again == second else 'DIFFERENT'}")
        print(f"bytes per tier: {engine.sharded_model.tier_bytes()}")


if __name__ == "__main__":
    main()
