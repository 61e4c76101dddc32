"""Adam's arithmetic over flat buffers, written with torch operators: the reference formulation.

``adam_update_torch_`` does the same arithmetic, in the same order, as ``torch.optim.Adam``/``AdamW``
with ``foreach=False``, on any device: it reads a 16-bit or fp32 gradient, updates the fp32 master and
both moments in place, and writes the 16-bit parameter copy when one is given. The one-pass host kernel
(:mod:`chunkmem.optim.host_adam_ext`) is checked against it; :mod:`chunkmem.optim.adam_kernels` picks
between them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one Adam update (``lr`` etc. as in ``torch.optim.AdamW``)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool

    def bias_corrections(self, step: int) -> tuple[float, float]:
        """``(1 - beta1**step, 1 - beta2**step)``, or ``(1, 1)`` without bias correction."""
        if not self.bias_correction:
            return 1.0, 1.0
        return 1 - self.beta1 ** step, 1 - self.beta2 ** step


def hyper_of_group(group: dict[str, Any]) -> AdamHyper:
    """The Adam hyper-parameters of one param group of a HybridAdam, torch Adam or torch AdamW."""
    beta1, beta2 = group["betas"]
    adamw_mode = group.get("adamw_mode", group.get("decoupled_weight_decay", False))
    return AdamHyper(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                     weight_decay=float(group["weight_decay"]), adamw_mode=bool(adamw_mode),
                     bias_correction=bool(group.get("bias_correction", True)))


UNSUPPORTED_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable")
"""torch Adam options chunkmem's Adam kernel does not run (ShardedOptimizerV2 runs such an Adam by its own
step; LowLevelZeroOptimizer and a state dict loaded into a kernel-run Adam refuse them)."""


def adam_update_torch_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, step: int, hyper: AdamHyper, grad_multiplier: float = 1.0,
                       param_out: torch.Tensor | None = None) -> None:
    """One Adam step on flat buffers, in place, with torch operators (any device).

    ``master``, ``exp_avg``, ``exp_avg_sq``: fp32, same length. ``grad``: fp32, fp16 or bf16, not
    modified. ``step``: the step number after this update (1 for the first). ``grad_multiplier``
    multiplies the gradient first (loss-scale removal and clipping). ``param_out``: if given, receives
    the updated master cast to its dtype.
    """
    g = grad if grad.dtype == torch.float32 else grad.float()
    if grad_multiplier != 1.0:
        g = g.mul(grad_multiplier) if g is grad else g.mul_(grad_multiplier)
    if hyper.weight_decay != 0:
        if hyper.adamw_mode:
            master.mul_(1 - hyper.lr * hyper.weight_decay)
        else:
            g = g.add(master, alpha=hyper.weight_decay)
    exp_avg.lerp_(g, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
    bias_correction1, bias_correction2 = hyper.bias_corrections(step)
    step_size = hyper.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if param_out is not None:
        param_out.copy_(master)


def fused_device_adam_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], hyper: AdamHyper) -> None:
    """Adam over CUDA tensors with torch's fused multi-tensor kernel (``steps`` are float tensors,
    incremented here). Bias correction off is not supported by that kernel; callers fall back to
    :func:`adam_update_` then."""
    for step in steps:
        step.add_(1)
    kernel = torch._fused_adamw_ if hyper.adamw_mode else torch._fused_adam_
    kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=hyper.lr, beta1=hyper.beta1,
           beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False,
           grad_scale=None, found_inf=None)
