"""ColossalAI's Engine loop shape (reference document 003: ``engine.zero_grad(); out = engine(x);
loss = engine.criterion(out, y); engine.backward(loss); engine.step()``) from the ``zero=dict(...)`` config,
against plain AdamW."""
from __future__ import annotations

import copy

import pytest
import torch

import chunkmem as cm
from models import TinyGPT, batches, lm_loss

LR, WD = 1e-2, 0.01


@pytest.mark.parametrize("placement", ["cuda", "cpu", "auto"])
def test_the_engine_loop_equals_plain_adamw(placement):
    torch.manual_seed(0)
    reference = TinyGPT()
    data = batches(3, seed=6)
    module = copy.deepcopy(reference)
    config = {"zero": {"model_config": {"tensor_placement_policy": placement, "dtype": "fp32",
                                        "shard_strategy": "TensorShardStrategy"},
                       "optimizer_config": {}}}
    schedule = torch.optim.lr_scheduler.LambdaLR
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    engine, loader, _, scheduler = cm.initialize_engine(
        module, optimizer, criterion=lm_loss, config=config, train_dataloader=data,
        lr_scheduler=lambda wrapped: schedule(wrapped, lambda step: 0.5 ** step))
    engine.train()
    for x in loader:
        engine.zero_grad()
        out = engine(x)
        engine.backward(engine.criterion(out, x))
        engine.step()
        assert scheduler.last_epoch == engine.global_steps - 1  # ColossalAI's engine.step() leaves the schedule
        scheduler.step()  # ... to the loop
    assert engine.global_steps == 3 and scheduler.last_epoch == 3

    plain = copy.deepcopy(reference)
    optim = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WD)
    plain_schedule = schedule(optim, lambda step: 0.5 ** step)
    for x in data:
        optim.zero_grad()
        lm_loss(plain(x), x).backward()
        optim.step()
        plain_schedule.step()
    state = engine.module.state_dict()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_deepspeed_config_is_sent_to_the_deepspeed_face():
    with pytest.raises(cm.InvalidArgumentError, match="chunkmem.deepspeed.initialize") as caught:
        cm.initialize_engine(TinyGPT(), config={"zero_optimization": {"stage": 3}})
    assert caught.value.argument == "config"
    with pytest.raises(cm.ArgumentTypeError) as caught:
        cm.initialize_engine(TinyGPT(), criterion=3, config={"zero": {}})
    assert caught.value.argument == "criterion"
