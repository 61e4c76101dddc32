"""``deepspeed.utils``: the safe accessors of full and local fp32 parameters, gradients and optimizer
states (:mod:`chunkmem.accessors`), under DeepSpeed's names."""
from ..accessors import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                     safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                     safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                     safe_set_local_optimizer_state)

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
           "safe_set_local_optimizer_state"]
