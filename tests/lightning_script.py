"""A Lightning training script and the LightningModule that ``test_lightning.py`` trains.

    python tests/lightning_script.py OUT.json WORKDIR [DEVICES]

runs ``L.Trainer(strategy=ChunkmemStrategy(STAGE3), devices=DEVICES)`` on the CPU (default 2 devices:
Lightning starts the second process by running this script again, and creates the gloo group): a full run
of ``EPOCHS`` epochs, a run of the first epoch that saves a checkpoint, and a fresh Trainer and module that
resume from it. Rank 0 writes every rank's per-step losses and the full fp32 weights of both runs as JSON.
Imported, it gives the test the same module, data and settings for the plain Lightning references.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.nn as nn
import lightning.pytorch as L
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from models import TinyGPT, lm_loss  # noqa: E402

SAMPLES, SEQ, VOCAB = 32, 16, 64
EPOCHS = 2
LR, WEIGHT_DECAY = 1e-2, 0.01
CLIP = 0.3  # below the gradients' norm at every step (the test checks it on the plain run)
STAGE3 = {"zero_optimization": {"stage": 3}}


class LitGPT(L.LightningModule):
    """A tiny GPT (tied embedding and head, a parameter used functionally by another module) and a
    parameter of the LightningModule itself used in ``training_step``, outside ``forward``; AdamW and a
    step-wise learning-rate schedule."""

    def __init__(self, schedule: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = TinyGPT(vocab=VOCAB, seq=SEQ)
        self.logit_scale = nn.Parameter(torch.ones(()))
        self.schedule = schedule
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        loss = lm_loss(self(idx) * self.logit_scale, idx)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (idx,) = batch
        self.log("val_loss", lm_loss(self(idx) * self.logit_scale, idx))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.5 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))


def trainer(strategy, epochs: int = EPOCHS, devices: int = 1, **kwargs) -> L.Trainer:  # noqa: ANN001
    kwargs.setdefault("gradient_clip_val", CLIP)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def main(out: str, workdir: str, devices: int) -> None:
    import torch.distributed as dist

    from chunkmem.integrations.lightning import ChunkmemStrategy

    warnings.filterwarnings("ignore")
    batch = SAMPLES // (4 * devices)  # 4 steps an epoch; Lightning's DistributedSampler splits the data
    results = {}
    for name, epochs, resume in (("full", EPOCHS, None), ("first", 1, None),
                                 ("resumed", EPOCHS, os.path.join(workdir, "first.ckpt"))):
        model = LitGPT()
        run = trainer(ChunkmemStrategy(STAGE3), epochs, devices)
        run.fit(model, DataLoader(dataset(), batch_size=batch), ckpt_path=resume)
        if name == "first":
            run.save_checkpoint(os.path.join(workdir, "first.ckpt"))
        weights = run.strategy.lightning_module_state_dict()  # every rank gathers; rank 0 keeps them
        results[name] = {"losses": model.losses, "weights": {k: v.tolist() for k, v in weights.items()}}
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [results]
    if dist.is_initialized():
        dist.all_gather_object(gathered, results)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        with open(out + ".tmp", "w") as f:
            json.dump({"ranks": [{k: r[k]["losses"] for k in r} for r in gathered],
                       "weights": {k: results[k]["weights"] for k in results}}, f)
        os.replace(out + ".tmp", out)
    if dist.is_initialized():
        dist.barrier()
    # every rank is done: leave without the interpreter's teardown, where gloo's threads occasionally abort
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2)
