"""Train a Hugging Face model with ``transformers.Trainer`` on chunkmem: a plain Trainer script, two lines changed.

The script is what a Trainer user already has: a model, ``torch.optim.AdamW``, a linear schedule with warm-up,
``TrainingArguments``, ``Trainer(...).train()``, ``save_model``. With chunkmem two lines differ (marked
``# chunkmem``): the model and the optimizer go through ``chunkmem.initialize`` (ZeRO-3 with parameters and
optimizer state offloaded to the host, a DeepSpeed-style config), and the Trainer class is
``chunkmem.integrations.transformers.ChunkmemTrainer``. ``--plain`` runs the same script without them, for
comparison: the logged losses agree to fp32 rounding.

The model is a small Llama built from a config (no download) and the data a learnable synthetic token stream
(each token is usually followed by a fixed successor), so the loss falls within a minute on a CPU.

    python examples/hf_trainer.py                                   # about a minute on 2 CPU cores
    python examples/hf_trainer.py --plain                           # the same run without chunkmem
    python examples/hf_trainer.py --steps 40 --save-steps 20 --output-dir run1
    python examples/hf_trainer.py --steps 60 --save-steps 20 --output-dir run1 --resume run1/checkpoint-40
    torchrun --nproc_per_node 2 examples/hf_trainer.py              # ZeRO-3 over 2 processes (gloo on CPUs)

``--output-dir`` ends with ``final/``, a ``save_pretrained`` directory that ``LlamaForCausalLM.from_pretrained``
loads. Under ``torchrun`` each rank holds half of every chunk and sees half of each batch
(``--batch-size`` is per process).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, get_linear_schedule_with_warmup

import chunkmem
from chunkmem.integrations.transformers import ChunkmemTrainer

CONFIG = {  # DeepSpeed's form; chunkmem.initialize reads it (see chunkmem/configs/deepspeed.py for every key)
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    "gradient_clipping": 0.0,  # Trainer clips (max_grad_norm); chunkmem's own clipping stays off
}


class SuccessorTokens(torch.utils.data.Dataset):
    """``size`` sequences in which token t is followed by ``perm[t]`` (the same for every ``seed``), or by a
    random token with probability ``noise``; the sequences are drawn from ``seed``."""

    def __init__(self, size, seq_len, vocab, seed=0, noise=0.1):
        perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
        g = torch.Generator().manual_seed(seed)
        ids = torch.empty(size, seq_len, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (size,), generator=g)
        for t in range(1, seq_len):
            random = torch.randint(0, vocab, (size,), generator=g)
            ids[:, t] = torch.where(torch.rand(size, generator=g) < noise, random, perm[ids[:, t - 1]])
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="Trainer's clipping (its default, 1.0)")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    p.add_argument("--output-dir", default=None,
                   help="checkpoints and final/ (default: chunkmem_hf_trainer in the temporary directory)")
    p.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--plain", action="store_true", help="without chunkmem (the same script, two lines undone)")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.quiet:
        transformers.logging.set_verbosity_error()
    # one path for every process (under torchrun each rank writes its part of a checkpoint there)
    output_dir = args.output_dir or os.path.join(tempfile.gettempdir(), "chunkmem_hf_trainer")
    torch.manual_seed(0)  # every process builds the same model
    model = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq_len))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if not args.plain:
        model, optim = chunkmem.initialize(model, optim, CONFIG)                              # chunkmem
    schedule = get_linear_schedule_with_warmup(optim, args.warmup, args.steps)
    training = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        logging_steps=args.log_every, max_grad_norm=args.max_grad_norm,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to="none", seed=0, disable_tqdm=True, log_level="error" if args.quiet else "passive",
        use_cpu=not torch.cuda.is_available(),  # on CPUs, torchrun's processes join over gloo only with this
        dataloader_pin_memory=torch.cuda.is_available())
    train = SuccessorTokens(4096, args.seq_len, args.vocab)
    evaluation = SuccessorTokens(64, args.seq_len, args.vocab, seed=1)
    trainer_class = Trainer if args.plain else ChunkmemTrainer                                # chunkmem
    trainer = trainer_class(model=model, args=training, train_dataset=train, eval_dataset=evaluation,
                            optimizers=(optim, schedule))
    if args.quiet:
        trainer.remove_callback(transformers.PrinterCallback)
    trainer.train(resume_from_checkpoint=args.resume)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(output_dir, "final"))  # every process calls it (chunkmem gathers the weights)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if trainer.is_world_process_zero() and not args.quiet:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, eval loss {eval_loss:.3f}; "
              f"from_pretrained loads {os.path.join(output_dir, 'final')}")
    return {"losses": losses, "eval_loss": eval_loss, "model": model, "output_dir": output_dir}


if __name__ == "__main__":
    main()
