"""The runtime memory tracer: what one training iteration needs, period by period.

A *period* runs from one module boundary that touches chunks (a module's pre-forward or pre-backward)
to the next. While an iteration is traced, the tracer records for each period the chunks that had to
be on the device, the chunks whose gradient buffers were started or finished, and the peak of
*non-model* memory on the device tier: everything that is not chunk memory (activations, temporaries,
autograd's gradients before they reach a chunk, or until a chunk adopts them: :meth:`IterationTrace.adopt`).

On the CPU the non-model bytes are counted exactly by :class:`StorageCounter`, a dispatch mode that
sees every operator and adds the size of each storage an operator creates until the storage is freed.
On CUDA the caching allocator's peak statistics give the same figure less the chunk bytes.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode
from torch.utils._pytree import tree_leaves


@dataclass
class Period:
    """One period of a traced iteration. Byte counts are bytes; chunk ids are chunk indices."""

    name: str
    phase: str
    needed: list[int] = field(default_factory=list)
    grads_started: list[int] = field(default_factory=list)
    grads_finished: list[int] = field(default_factory=list)
    non_model_peak: int = 0
    needed_set: set[int] = field(default_factory=set, repr=False)

    def key(self) -> tuple[str, str]:
        return self.name, self.phase


class StorageCounter(TorchDispatchMode):
    """Counts the bytes of live storages created by operators on ``device`` (exact, deterministic).

    A storage is counted when an operator returns a tensor whose storage is none of its inputs'
    storages, and uncounted once the storage is freed. ``paused()`` stops counting, for chunk memory
    the manager allocates itself.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self._paused = 0
        self.stopped = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.stopped:
            return func(*args, **kwargs)
        self.collect_freed()
        out = func(*args, **kwargs)
        if self._paused:
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _strided(t)}
        for tensor in tree_leaves(out):
            if not _strided(tensor) or tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.live:
                continue
            self.live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out

    def collect_freed(self) -> None:
        freed = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in freed:
            self.current -= self.live.pop(key)[1]

    def start_period(self) -> int:
        """Begin a new period; returns the peak of the one that ends."""
        self.collect_freed()
        peak, self.peak = self.peak, self.current
        return peak

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def adopt(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage became chunk memory (counted on the ledger): stop counting it."""
        counted = self.live.pop(tensor.untyped_storage()._cdata, None)
        if counted is not None:
            self.current -= counted[1]


def _strided(value: Any) -> bool:
    """Whether ``value`` is a tensor with one storage to count (sparse, nested and other layouts have none
    a counter may touch: a counting mode that outlived its iteration must not break them)."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested


class CudaPeakCounter:
    """Non-model peak per period from the CUDA caching allocator: peak allocated less chunk bytes."""

    def __init__(self, device: torch.device, model_bytes: Any) -> None:
        self.device = device
        self.model_bytes = model_bytes
        torch.cuda.reset_peak_memory_stats(device)

    def start_period(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device) - self.model_bytes()
        torch.cuda.reset_peak_memory_stats(self.device)
        return max(peak, 0)

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def adopt(self, tensor: torch.Tensor) -> None:
        """Nothing to do: :meth:`start_period` subtracts every chunk byte on the ledger."""


def _stop(counter: StorageCounter) -> None:
    counter.stopped = True


def _pop_stopped_counters() -> None:
    """Remove stopped counters from the top of the dispatch-mode stack (call outside backward)."""
    stack = _get_current_dispatch_mode_stack()
    while stack and isinstance(stack[-1], StorageCounter) and stack[-1].stopped:
        _pop_mode()
        stack = _get_current_dispatch_mode_stack()


class IterationTrace:
    """Records the periods of one iteration (see the module docstring)."""

    def __init__(self, device: torch.device, model_device_bytes: Any) -> None:
        self.periods: list[Period] = []
        if device.type == "cuda":
            self.counter: StorageCounter | CudaPeakCounter = CudaPeakCounter(device, model_device_bytes)
            self._mode_active = False
        else:
            _pop_stopped_counters()
            self.counter = StorageCounter(device)
            self.counter.__enter__()
            self._mode_active = True
            # A trace dropped before its backward (a forward with autograd whose model is then discarded)
            # leaves its mode on torch's global stack: make it inert, and the next trace removes it.
            weakref.finalize(self, _stop, self.counter)

    @property
    def current(self) -> Period | None:
        return self.periods[-1] if self.periods else None

    def begin_period(self, name: str, phase: str, resident_required: list[int]) -> None:
        peak = self.counter.start_period()
        if self.current is not None:
            self.current.non_model_peak = max(self.current.non_model_peak, peak)
        self.periods.append(Period(name, phase, sorted(set(resident_required))))

    def need(self, chunk_index: int) -> None:
        if self.current is not None and chunk_index not in self.current.needed:
            self.current.needed.append(chunk_index)

    def grads_started(self, chunk_index: int) -> None:
        if self.current is not None:
            self.current.grads_started.append(chunk_index)

    def grads_finished(self, chunk_index: int) -> None:
        if self.current is not None:
            self.current.grads_finished.append(chunk_index)

    def paused(self):
        return self.counter.paused()

    def adopt(self, tensor: torch.Tensor) -> None:
        """``tensor`` (made by the model's backward) is chunk memory from now on, not non-model memory."""
        self.counter.adopt(tensor)

    def finish(self) -> list[Period]:
        """Close the last period; returns the periods. Call :meth:`close` afterwards, outside autograd's
        backward: the engine restores the caller's dispatch modes when backward returns, so leaving the
        counting mode from inside backward would not last."""
        peak = self.counter.start_period()
        if self.current is not None:
            self.current.non_model_peak = max(self.current.non_model_peak, peak)
        if isinstance(self.counter, StorageCounter):
            self.counter.stopped = True
        for period in self.periods:
            period.needed.sort()
        return self.periods

    def close(self) -> None:
        """Leave the counting mode (outside autograd's backward)."""
        if self._mode_active:
            self.counter.__exit__(None, None, None)
            self._mode_active = False
