"""``chunkmem.utils``: the per-parameter accessors of :mod:`chunkmem.accessors` under the module name DeepSpeed
users call them from (``deepspeed.utils``): the same functions, not copies."""
from .accessors import (OPTIMIZER_STATE_KEYS, safe_get_full_fp32_param, safe_get_full_grad,
                        safe_get_full_optimizer_state, safe_get_local_fp32_param, safe_get_local_grad,
                        safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state,
                        safe_set_local_fp32_param, safe_set_local_optimizer_state)

__all__ = [
    "OPTIMIZER_STATE_KEYS", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
]
