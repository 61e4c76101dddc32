"""Train a LightningModule with chunkmem: the one-line change is the Trainer's ``strategy``.

The LightningModule below is ordinary Lightning: a small GPT (``chunkmem.gpt.GPT``, any ``nn.Module`` does),
``training_step`` / ``validation_step``, and ``configure_optimizers`` returning ``torch.optim.AdamW`` with
a warm-up + cosine learning-rate schedule stepped every step. What changes is one line::

    trainer = L.Trainer(..., strategy="auto")                    # plain Lightning
    trainer = L.Trainer(..., strategy=ChunkmemStrategy(config))  # chunkmem

``config`` is what ``chunkmem.initialize`` takes (here the DeepSpeed form: ZeRO stage 3 with the
parameters and the optimizer state resting on the host, so the device holds only what computes). The
Trainer's ``gradient_clip_val``, ``accumulate_grad_batches``, ``trainer.save_checkpoint`` and
``trainer.fit(ckpt_path=...)`` work as usual.

The data is a synthetic, learnable token stream (each token is usually followed by a fixed "successor"),
so the loss falls within a few dozen steps; an epoch is ``--epoch-steps`` optimizer steps and the model is
validated at the end of each. A run stopped after a number of epochs resumes bit for bit (Lightning resumes
in the middle of an epoch exactly only with a stateful dataloader). Run it with:

    python examples/lightning_module.py                    # about a minute on 2 CPU cores
    python examples/lightning_module.py --plain            # the same with Lightning's default strategy
    python examples/lightning_module.py --devices 2        # two processes (gloo on CPUs, NCCL on GPUs)
    python examples/lightning_module.py --dtype bf16       # 16-bit compute, fp32 masters
    python examples/lightning_module.py --stop-after 1 --save run.ckpt   # stop after the first epoch ...
    python examples/lightning_module.py --resume run.ckpt                 # ... and continue exactly

Without a GPU the "device" tier is the CPU, so every option runs on a laptop.
"""
from __future__ import annotations

import argparse
import math
import warnings

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from chunkmem.gpt import GPT, GPTConfig
from chunkmem.integrations.lightning import ChunkmemStrategy

NOISE = 0.1  # how often a token is random instead of its successor


def ideal_loss(vocab: int) -> float:
    """The entropy of the next token: the lowest loss a model can reach on this data."""
    hit, miss = 1 - NOISE + NOISE / vocab, NOISE / vocab
    return -(hit * math.log(hit) + (vocab - 1) * miss * math.log(miss))


class SuccessorTokens(Dataset):
    """``length`` sequences of ``seq`` tokens in which each token is usually followed by ``perm[token]``;
    item ``i`` is always the same sequence (drawn from a generator seeded with ``seed + i``)."""

    def __init__(self, vocab: int, seq: int, length: int, seed: int) -> None:
        self.perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
        self.vocab, self.seq, self.length, self.seed = vocab, seq, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + i)
        tokens = torch.empty(self.seq + 1, dtype=torch.long)
        tokens[0] = torch.randint(0, self.vocab, (), generator=g)
        for t in range(1, self.seq + 1):
            noisy = torch.rand((), generator=g) < NOISE
            tokens[t] = torch.randint(0, self.vocab, (), generator=g) if noisy else self.perm[tokens[t - 1]]
        return tokens


class LitGPT(L.LightningModule):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int, lr: float, warmup: int,
                 steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab=vocab, d_model=d_model, layers=layers, heads=heads, seq=seq))
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(tokens)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, tokens: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(tokens), sync_dist=True)

    def configure_optimizers(self):  # noqa: ANN201
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1)

        def schedule(step: int) -> float:  # linear warm-up, then a cosine down to 10%
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            progress = min(1.0, (step - hp.warmup) / max(1, hp.steps - hp.warmup))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PrintLoss(L.Callback):
    """Print the loss every ``every`` steps (rank 0)."""

    def __init__(self, every: int, quiet: bool) -> None:
        self.every, self.quiet = every, quiet

    def on_train_batch_end(self, trainer: L.Trainer, module: LitGPT, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        step = trainer.global_step
        if not self.quiet and trainer.is_global_zero and step % self.every == 0:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            print(f"step {step:4d}  loss {module.losses[-1]:.4f}  lr {lr:.2e}", flush=True)


def chunkmem_config(dtype: str, offload: bool) -> dict:
    """What chunkmem.initialize takes (the DeepSpeed form; the ColossalAI form works too)."""
    device = "cpu" if offload else "none"
    return {"zero_optimization": {"stage": 3, "offload_param": {"device": device},
                                  "offload_optimizer": {"device": device}},
            "bf16": {"enabled": dtype == "bf16"},
            "fp16": {"enabled": dtype == "fp16"}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plain", action="store_true", help="Lightning's default strategy instead of chunkmem's")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--no-offload", action="store_true", help="keep parameters and optimizer state on the device")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many epochs (then --save)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="Trainer(gradient_clip_val=...)")
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--epoch-steps", type=int, default=40, help="optimizer steps an epoch (validation after each)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save", default=None, help="trainer.save_checkpoint(path) at the end")
    p.add_argument("--resume", default=None, help="trainer.fit(..., ckpt_path=path)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    warnings.filterwarnings("ignore", module="lightning")  # tips about workers and loggers
    torch.manual_seed(0)
    steps = args.epochs * args.epoch_steps
    module = LitGPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len, args.lr, args.warmup, steps)
    strategy = "auto" if args.plain else ChunkmemStrategy(chunkmem_config(args.dtype, not args.no_offload))
    # an epoch of epoch_steps optimizer steps whatever the number of processes (Lightning splits the data)
    samples = args.epoch_steps * args.batch_size * args.accumulate * args.devices
    train = DataLoader(SuccessorTokens(args.vocab, args.seq_len, samples, seed=0), batch_size=args.batch_size)
    val = DataLoader(SuccessorTokens(args.vocab, args.seq_len, 4 * args.batch_size, seed=10**6),
                     batch_size=args.batch_size)
    trainer = L.Trainer(
        strategy=strategy,  # the one line: strategy=ChunkmemStrategy(config)
        accelerator="auto", devices=args.devices, max_epochs=args.stop_after or args.epochs,
        gradient_clip_val=args.clip, accumulate_grad_batches=args.accumulate,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=not args.quiet, callbacks=[PrintLoss(args.log_every, args.quiet)])
    trainer.fit(module, train, val, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    val_loss = trainer.callback_metrics.get("val_loss")
    if not args.quiet and trainer.is_global_zero and val_loss is not None:
        print(f"validation loss {float(val_loss):.4f} (the noise alone costs {ideal_loss(args.vocab):.4f})")
    return {"losses": module.losses, "val_loss": None if val_loss is None else float(val_loss),
            "trainer": trainer, "module": module}


if __name__ == "__main__":
    main()
