"""torchao's 8-bit Adam step with its per-parameter update run eagerly: the reference chunkmem's 8-bit update
reproduces bit for bit (tests/test_low_bit_state.py, test_low_bit_disk.py, test_hybrid_adam_8bit.py). Needs torchao."""
from __future__ import annotations

import torch


def eager_step(optimizer) -> None:
    """One step of torchao's ``AdamW8bit`` / ``Adam8bit`` ``optimizer``, its own ``single_param_adam`` run eagerly
    (not compiled), random draws included (bf16 parameters rounded stochastically as its
    ``bf16_stochastic_round`` says)."""
    from torchao.optim.adam import single_param_adam

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=optimizer._new_buffer(p, True),
                             exp_avg_sq=optimizer._new_buffer(p, False))
            state["step"] += 1
            with torch.no_grad():
                single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"], None,
                                  group["lr"], *group["betas"], group["weight_decay"], group["eps"],
                                  optimizer.is_adamw, optimizer.bf16_stochastic_round and p.dtype == torch.bfloat16)
