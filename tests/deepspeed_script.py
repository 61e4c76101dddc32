"""A DeepSpeed training script, run unchanged under real DeepSpeed and under ``chunkmem.deepspeed``.

    python tests/deepspeed_script.py {deepspeed|chunkmem} STAGE OUT.json [WORKDIR [Adam|SGD]]

One process, fp32, the config's Adam (or torch's SGD with momentum, which DeepSpeed runs with ZeRO-Offload
once the config says ``zero_force_ds_cpu_optimizer: false``) with the optimizer state offloaded to the
CPU, gradient accumulation
over 2 micro batches, clipping at 0.05 (the gradients' norm is well above it), a WarmupLR schedule; 4
optimizer steps, a checkpoint with a client state after the second, then a fresh engine that loads it and
runs the last two steps again. Writes the learning rates, losses and final fp32 weights of both runs as
JSON. ``test_deepspeed_face.py`` compares the two backends (and keeps DeepSpeed's output in
``tests/data/deepspeed_reference.json``).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.nn as nn

if sys.argv[1] == "deepspeed":
    import deepspeed
else:
    import chunkmem.deepspeed as deepspeed

MICRO, ACCUMULATION, STEPS, SAVE_AFTER = 4, 2, 4, 2


OPTIMIZERS = {"Adam": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
              "SGD": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}}}


def config(stage: int, optimizer: str) -> dict:
    extra = {} if optimizer == "Adam" else {"zero_force_ds_cpu_optimizer": False,
                                            "zero_allow_untested_optimizer": True}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.05, "steps_per_print": 1000, **extra,
            "optimizer": OPTIMIZERS[optimizer],
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 3, "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}


def build(stage: int, optimizer: str) -> object:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(stage, optimizer))
    return engine


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(MICRO, 16, generator=g), 5 * torch.randn(MICRO, 8, generator=g))
            for _ in range(STEPS * ACCUMULATION)]


def train(engine: object, data: list, first_step: int) -> tuple[list[float], list[list[float]]]:
    losses, lrs = [], []
    for x, y in data[first_step * ACCUMULATION:]:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.micro_steps % ACCUMULATION == 0:  # this step() was a boundary
            lrs.append(engine.get_lr())
    return losses, lrs


def weights(engine: object) -> list[list[float]]:
    return [deepspeed.utils.safe_get_full_fp32_param(p).flatten().tolist() for p in engine.module.parameters()]


def main() -> None:
    stage, out = int(sys.argv[2]), sys.argv[3]
    workdir = sys.argv[4] if len(sys.argv) > 4 else tempfile.mkdtemp()
    optimizer = sys.argv[5] if len(sys.argv) > 5 else "Adam"
    deepspeed.init_distributed(dist_backend="gloo")
    data = batches()
    engine = build(stage, optimizer)
    first_losses, first_lrs = train(engine, data[:SAVE_AFTER * ACCUMULATION], 0)
    engine.save_checkpoint(os.path.join(workdir, "ckpt"), client_state={"epoch": 7, "note": "mine"})
    losses, lrs = train(engine, data, SAVE_AFTER)
    result = {"losses": first_losses + losses, "lrs": first_lrs + lrs, "weights": weights(engine),
              "global_steps": engine.global_steps}
    resumed = build(stage, optimizer)
    path, client = resumed.load_checkpoint(os.path.join(workdir, "ckpt"))
    resumed_losses, resumed_lrs = train(resumed, data, SAVE_AFTER)
    result.update(resumed_losses=resumed_losses, resumed_lrs=resumed_lrs, resumed_weights=weights(resumed),
                  resumed_global_steps=resumed.global_steps, loaded=path is not None,
                  client_state={k: client[k] for k in ("epoch", "note")})
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
