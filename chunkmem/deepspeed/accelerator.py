"""``deepspeed.accelerator``: :func:`get_accelerator` names the device chunkmem computes on (a CUDA GPU,
or the CPU on a machine without one) and its communication backend."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """The device of this process, as DeepSpeed's accelerator object describes it."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` / ``"cuda:i"``, or ``"cpu"``."""
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def communication_backend_name(self) -> str:
        """``"nccl"`` with CUDA, else ``"gloo"``."""
        return "nccl" if self._cuda else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes of tensors on the device (0 for the CPU, whose use chunkmem's ledger reports)."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of the device (the GPU's; for the CPU, chunkmem's device-tier capacity)."""
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        from ..core.tiers import device_memory_capacity
        return device_memory_capacity()


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's :class:`Accelerator` (one object, made at the first call)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
