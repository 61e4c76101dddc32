"""HybridAdam and CPUAdam: Adam for ordinary parameters, and the hyper-parameters ShardedOptimizerV2
reads to update whole chunks."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.optim import Optimizer

from . import low_bit_param
from .adam_kernels import adam_update_
from .adam_math import UNSUPPORTED_OPTIONS, fused_device_adam_, hyper_of_group
from .low_bit_adam import LowBitHyper
from ..errors import ArgumentTypeError, InvalidArgumentError, check_choice, check_number, check_type
from ..state_dicts import first_few


class HybridAdam(Optimizer):
    """Adam / AdamW that updates each parameter where it lives.

    Host (CPU) tensors are updated by the host kernel, CUDA tensors by torch's fused device kernel.
    Used alone it behaves like ``torch.optim.AdamW`` (``adamw_mode=True``, decoupled weight decay) or
    ``torch.optim.Adam`` (``adamw_mode=False``, L2 added to the gradient). Given to
    :class:`~chunkmem.ShardedOptimizerV2` it supplies the hyper-parameters of each param group, and
    the update runs over whole chunks instead.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate, a finite number >= 0.
        bias_correction: divide the moments by ``1 - beta**step`` (a bool).
        betas: moment decay rates, two numbers, each in [0, 1).
        eps: added to the denominator, a finite number >= 0.
        weight_decay: a finite number >= 0.
        adamw_mode: decoupled (AdamW) instead of L2 weight decay (a bool).
        state_dtype: how the moments ``exp_avg`` and ``exp_avg_sq`` are kept: ``torch.float32`` (the default,
            4 bytes each per element) or ``"8bit"``: torchao's blockwise 8-bit format (a ``uint8`` code per
            element and an fp32 scale per block of 256 elements: about 1.02 bytes each per element; parameters
            under 4096 elements or not in whole blocks keep fp32 moments). With ``"8bit"`` the update is torchao's
            ``AdamW8bit`` (``adamw_mode=True``) or ``Adam8bit`` (``adamw_mode=False``), bit for bit as its step
            runs eagerly, without torchao installed; ``bias_correction`` must be ``True`` (torchao always corrects
            the bias). The state layout is :mod:`chunkmem.optim.low_bit_param`'s, in ``state`` and in
            ``state_dict()`` alike, whether used alone or in :class:`~chunkmem.ShardedOptimizerV2`.
        bf16_stochastic_round: torchao's option of the same name (a bool, default ``False``), allowed ``True`` only
            with ``state_dtype="8bit"``: each step's result for a bf16 parameter is rounded to bf16 stochastically
            (away from zero with the probability of the 16 bits cut off, as a fraction of 2**16), so that the bf16
            parameters are their own masters, with the random numbers torchao's ``AdamW8bit`` / ``Adam8bit`` draw: one
            ``torch.randint(0, 2**16)`` int32 per element of each parameter stepped, from the default generator of its
            device, in the order of the param groups and their parameters. The small parameters' moments are rounded
            to bf16 after each step, as torchao keeps them in the parameter's dtype (the state dict still holds them
            as fp32 tensors). Parameters of another dtype are rounded to nearest, as without it. Wrapped, a bf16
            model keeps no fp32 master (:mod:`chunkmem.optim.low_bit_rule`; refused over an fp16 model and with
            ``reuse_fp16_shard=True``). With fp32 state ``True`` is refused: the fp32 update is
            ``torch.optim.AdamW``'s arithmetic, not torchao's, so it could not be torchao's bit for bit.

    A value of the wrong type raises :class:`~chunkmem.ArgumentTypeError` (a ``TypeError``), a value
    out of range :class:`~chunkmem.InvalidArgumentError`.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, state_dtype: torch.dtype | str = torch.float32,
                 bf16_stochastic_round: bool = False) -> None:
        check_number("lr", lr, low=0.0, finite=True)
        check_number("eps", eps, low=0.0, finite=True)
        check_number("weight_decay", weight_decay, low=0.0, finite=True)
        check_betas(betas)
        check_type("bias_correction", bias_correction, bool, "True or False")
        check_type("adamw_mode", adamw_mode, bool, "True or False")
        check_choice("state_dtype", state_dtype, STATE_DTYPES)
        check_stochastic_round(bf16_stochastic_round, state_dtype)
        self.state_dtype = state_dtype
        self.bf16_stochastic_round = bf16_stochastic_round
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        """torch's optimizer state for pickling and ``copy.deepcopy``, with the settings kept outside the
        defaults (torch keeps only ``defaults``, ``state`` and ``param_groups``)."""
        return {**super().__getstate__(), "state_dtype": self.state_dtype,
                "bf16_stochastic_round": self.bf16_stochastic_round}

    @property
    def quantized_state(self) -> bool:
        """Whether the moments are kept in 8 bits (``state_dtype="8bit"``)."""
        return isinstance(self.state_dtype, str)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, refusing ``bias_correction=False`` with 8-bit state before adding."""
        if self.quantized_state:
            LowBitHyper.of_group({**self.defaults, **param_group}, decoupled=True)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``; with 8-bit state each entry is checked first (nothing changes if one is
        refused) and keeps its dtypes (torch would cast the codes and scales to the parameter's dtype)."""
        if not self.quantized_state:
            return super().load_state_dict(state_dict)
        check_type("state_dict", state_dict, Mapping, "an optimizer state dict with 'state' and 'param_groups'")
        params = [p for group in self.param_groups for p in group["params"]]
        saved = [i for group in state_dict.get("param_groups", ()) for i in group.get("params", ())]
        if len(saved) != len(params):
            raise InvalidArgumentError("state_dict['param_groups']", f"{len(saved)} parameters",
                                       f"{len(params)} parameters, as the optimizer has")
        param_of = dict(zip(saved, params))
        state = state_dict.get("state", {})
        for index, entry in state.items():
            if index not in param_of:
                raise InvalidArgumentError("state_dict['state']", f"a state for index {index!r}",
                                           f"indices of the param_groups' 'params' ({len(params)} parameters)")
            p = param_of[index]
            low_bit_param.check_entry(index, f"shape {tuple(p.shape)}", entry, p.numel(), tuple(p.shape))
        super().load_state_dict(state_dict)
        for index, entry in state.items():
            p = param_of[index]
            self.state[p] = {key: value.detach().to(p.device, copy=True) for key, value in entry.items()}
            self.state[p]["step"] = self.state[p]["step"].float()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if self.quantized_state:
                low_bit_hyper = LowBitHyper.of_group(group, group["adamw_mode"])
                for p in group["params"]:
                    if p.grad is not None:
                        low_bit_param.update_parameter_(p, p.grad, self.state[p] or self._new_state(p), low_bit_hyper,
                                                        self._rounds_stochastically(p))
                continue
            hyper = hyper_of_group(group)
            device_batch: tuple[list, list, list, list, list] = ([], [], [], [], [])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.preserve_format)
                if p.is_cuda and hyper.bias_correction and p.dtype == torch.float32:
                    for batch, tensor in zip(device_batch, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                                           state["step"])):
                        batch.append(tensor)
                    continue
                state["step"] += 1
                master = p if p.dtype == torch.float32 else p.float()
                adam_update_(master, p.grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()),
                             hyper, param_out=None if master is p else p)
            if device_batch[0]:
                fused_device_adam_(*device_batch, hyper=hyper)
        return loss

    def _rounds_stochastically(self, param: torch.Tensor) -> bool:
        return self.bf16_stochastic_round and param.dtype == torch.bfloat16

    def _new_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        self.state[param] = low_bit_param.new_state(param)
        return self.state[param]


STATE_DTYPES = (torch.float32, "8bit")
"""The values :class:`HybridAdam`'s ``state_dtype`` takes."""


class CPUAdam(HybridAdam):
    """The same optimizer as :class:`HybridAdam`, under the name users of host-offloaded training know.

    Host tensors use the host kernel; CUDA tensors still work (device kernel).
    """


def check_stochastic_round(bf16_stochastic_round: Any, state_dtype: torch.dtype | str) -> None:
    """Raise unless ``bf16_stochastic_round`` is a bool, ``True`` only with ``state_dtype="8bit"``."""
    check_type("bf16_stochastic_round", bf16_stochastic_round, bool, "True or False")
    if bf16_stochastic_round and state_dtype != "8bit":
        raise InvalidArgumentError("bf16_stochastic_round", bf16_stochastic_round,
                                   f"False with state_dtype={state_dtype!r} (True only with state_dtype='8bit': the "
                                   "fp32-state update is torch's AdamW arithmetic, not torchao's)")


def check_betas(betas: Any) -> None:
    """Raise unless ``betas`` is a pair of numbers, each in [0, 1)."""
    allowed = "two numbers, each in [0, 1)"
    if not isinstance(betas, (tuple, list)):
        raise ArgumentTypeError("betas", betas, allowed)
    if len(betas) != 2:
        raise InvalidArgumentError("betas", betas, allowed)
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
        raise ArgumentTypeError("betas", betas, allowed)
    if not all(0.0 <= b < 1.0 for b in betas):
        raise InvalidArgumentError("betas", betas, allowed)


def runs_adam_kernel(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update is chunkmem's Adam kernel: a :class:`HybridAdam` / ``CPUAdam`` with fp32
    state, or ``torch.optim.Adam`` / ``AdamW`` with plain options (no ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable``, a float ``lr``)."""
    if isinstance(optimizer, HybridAdam):
        return not optimizer.quantized_state
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return all(not group.get(option) for group in optimizer.param_groups for option in UNSUPPORTED_OPTIONS) and \
            all(not isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups)
    return False


def check_supported_optimizer(optimizer: Any) -> None:
    """Raise :class:`~chunkmem.ArgumentTypeError` unless ``optimizer`` is one whose update chunkmem can run
    per chunk: one that :func:`runs_adam_kernel`, or any other ``torch.optim.Optimizer`` (what it keeps
    is checked when it is wrapped: :mod:`chunkmem.optim.any_optimizer`)."""
    if runs_adam_kernel(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        return
    raise ArgumentTypeError("optimizer", type(optimizer).__name__,
                            "a chunkmem.HybridAdam, chunkmem.CPUAdam or another torch.optim.Optimizer")


def params_mismatch(module: nn.Module, params: Sequence[torch.Tensor]) -> str | None:
    """Why ``params`` (an optimizer's, over its param groups) are not the parameters of ``module`` it
    trains, or ``None`` when they are: each must be a parameter of ``module`` (compared by identity) and
    every parameter of ``module`` that requires grad must be one of them (frozen parameters may be left
    out)."""
    own = {id(p) for p in module.parameters()}
    foreign = [(i, tuple(p.shape)) for i, p in enumerate(params) if id(p) not in own]
    if foreign:
        return (f"{len(foreign)} of the optimizer's {len(params)} parameters are not parameters of the "
                f"{type(module).__name__}: (index, shape) {first_few(foreign)}")
    held = {id(p) for p in params}
    missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        return (f"the {type(module).__name__}'s trainable parameters {first_few(missing)} are not in the "
                f"optimizer's param_groups")
    return None
