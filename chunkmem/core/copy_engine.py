"""The copy engine: every hot move of chunk bytes between the device and the host goes through one.

An engine is chosen when a model's runtime is built (:func:`engine_for_new_model`) and lives on the model's
:class:`~chunkmem.core.memory.TierMemory`. It issues a copy and returns a
:class:`~chunkmem.core.transfer.Transfer`; the reader waits on the handle when it needs the bytes, never
earlier. Three engines:

* :class:`PlainCopies` (``"plain"``, a machine without CUDA): ``copy_`` at once; waiting is free.
* :class:`CudaCopies` (``"cuda"``, the default with CUDA): a host-to-device and a device-to-host stream per
  GPU (both copy engines of the card at once), events, and exact-size pinned host buffers
  (:mod:`chunkmem.core.pinned`) for the families that cross PCIe every step. A parameter copy makes the
  compute stream wait for its event (no host wait); a gradient copy starts when the compute stream's work
  that produced it is done (an event, not a host wait) and the host waits for it only when a reader needs
  the bytes. The source of a device-to-host copy is kept from reuse by the caching allocator until the copy
  is done (``record_stream``), so its owner may free it at once. ``"cuda-sync"`` is the same engine with
  every copy on the compute stream and waited for at once (the A/B reference).
* :class:`DeferredCopies` (``"deferred"``, for tests on a CPU machine): a copy is only *recorded* when
  issued. The destination is poisoned (NaN, or 0xFF bytes) at once and the bytes are copied when the
  handle is waited on, reading the source as it is then. A reader that forgets to wait reads NaN, and a
  source that is reused or changed before the copy is waited on gives wrong bytes: either makes an
  exactness test fail without a GPU.

``CHUNKMEM_COPY_ENGINE`` (``plain``, ``cuda``, ``cuda-sync``, ``deferred``; read when a model is wrapped)
or :func:`set_copy_engine` picks one; the default is ``cuda`` with CUDA, else ``plain``.

Every engine counts the host's waits for copies by site (:attr:`CopyEngine.host_waits`): a wait is counted
when the host had to block (on CUDA: an event that had not completed when the host asked). The model's
``memory_stats()["copy_engine"]`` reports them with the pinned bytes.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import torch

from ..errors import InvalidArgumentError
from .transfer import Transfer, staging_pool

ENGINE_ENV = "CHUNKMEM_COPY_ENGINE"
ENGINE_NAMES = ("plain", "cuda", "cuda-sync", "deferred")

_chosen: str | None = None


def set_copy_engine(name: str | None) -> None:
    """Choose the copy engine of models wrapped from now on: one of ``"plain"``, ``"cuda"``, ``"cuda-sync"``,
    ``"deferred"`` (see the module docstring), or ``None`` for the default (``CHUNKMEM_COPY_ENGINE`` if set,
    else ``"cuda"`` with CUDA, else ``"plain"``). A refused name changes nothing."""
    global _chosen
    if name is not None:
        _check_name(name, "name")
    _chosen = name


def copy_engine_name() -> str:
    """The engine a model wrapped now gets (see :func:`set_copy_engine`)."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENGINE_ENV, "").strip()
    if env:
        return _check_name(env, ENGINE_ENV)
    return "cuda" if torch.cuda.is_available() else "plain"


def _check_name(name: str, argument: str) -> str:
    if name not in ENGINE_NAMES:
        raise InvalidArgumentError(argument, name, "one of " + ", ".join(repr(n) for n in ENGINE_NAMES))
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgumentError(argument, name, "'plain' or 'deferred' (CUDA is not available on this machine)")
    return name


class CopyEngine:
    """Issues copies between the device and the host tier and counts the host's waits for them.

    ``name``: the engine's name. ``host_waits``: how many times the host blocked on a copy, by site (``site``
    is what the caller names: ``"grad read"``, ``"grad accumulate"``, ``"shard write"``, ...).
    ``pins_host``: whether host buffers that cross PCIe every step are pinned (CUDA only).
    ``asynchronous``: whether a copy may complete after it is issued (its source must then stay unchanged).
    """

    name = "plain"
    pins_host = False
    asynchronous = False

    def __init__(self) -> None:
        self.host_waits: Counter[str] = Counter()

    def count_wait(self, site: str) -> None:
        """Count one host wait at ``site``; one inside autograd's execution (a backward hook) is counted as
        ``"<site> in backward"``: the pipeline promises none there."""
        in_backward = torch._C._current_graph_task_id() != -1
        self.host_waits[f"{site} in backward" if in_backward else site] += 1

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, finish: Callable[[], None] = lambda: None) -> Transfer:
        """Issue ``dst.copy_(src)`` where ``dst`` is on the device tier and is then read by compute."""
        dst.copy_(src)
        return Transfer(finish)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, site: str) -> Transfer:
        """Issue ``dst.copy_(src)`` where ``dst`` is a host buffer the host reads later: the source may be
        freed by its owner right after this returns. The returned handle's ``wait`` makes the bytes readable."""
        dst.copy_(src)
        return Transfer()

    def before_host_write(self, tensor: torch.Tensor, site: str) -> None:
        """``tensor`` (a host buffer) is about to be written by the host: wait for copies still reading it."""
        self.host_write_wait(tensor, site)()

    def host_write_wait(self, tensor: torch.Tensor, site: str) -> Callable[[], None]:
        """:meth:`before_host_write` in two halves: the copies still reading ``tensor`` are taken now, the
        returned function waits for them (on any thread: an update running off autograd's thread waits there,
        and the engine's bookkeeping stays on the thread that issues copies)."""
        return nothing_to_wait_for

    def stats(self) -> dict[str, object]:
        """``{"engine", "host_waits" (site -> count), "staging_waits"}`` (cumulative over the process)."""
        return {"engine": self.name, "host_waits": dict(self.host_waits), "staging_waits": 0}


class PlainCopies(CopyEngine):
    """Both tiers in CPU memory: a copy is done when it is issued."""


class DeferredCopies(CopyEngine):
    """A test engine: copies complete when their handle is waited on (module docstring)."""

    name = "deferred"
    asynchronous = True

    def _defer(self, dst: torch.Tensor, src: torch.Tensor, site: str | None, finish: Callable[[], None]) -> Transfer:
        _poison(dst)
        # A view of its own keeps the source's memory from reuse until the copy ran (the block pool does not
        # take back a block something else views), as record_stream does for the CUDA engine's sources.
        src = src.view(src.shape)

        def complete() -> None:
            if site is not None:
                self.count_wait(site)
            dst.copy_(src)
        return Transfer(finish, complete=complete)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, finish: Callable[[], None] = lambda: None) -> Transfer:
        return self._defer(dst, src, None, finish)  # (on a GPU the compute stream waits: no host wait)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, site: str) -> Transfer:
        return self._defer(dst, src, site, lambda: None)


def nothing_to_wait_for() -> None:
    """The wait of :meth:`CopyEngine.host_write_wait` where no copy reads the buffer (nor of any other host write
    that needs none)."""


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0xFF)


class CudaCopies(CopyEngine):
    """Copies on two side streams per GPU (host-to-device, device-to-host), ordered by events; ``synchronous``:
    on the compute stream and waited for at once (module docstring)."""

    pins_host = True

    def __init__(self, synchronous: bool = False) -> None:
        super().__init__()
        self.synchronous = synchronous
        self.asynchronous = not synchronous
        self.name = "cuda-sync" if synchronous else "cuda"
        self._up: dict[int, torch.cuda.Stream] = {}
        self._down: dict[int, torch.cuda.Stream] = {}
        self._reading: dict[int, torch.cuda.Event] = {}  # host data_ptr -> event after the last copy reading it

    @staticmethod
    def _stream(streams: dict[int, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in streams:
            streams[index] = torch.cuda.Stream(device=index)
        return streams[index]

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, finish: Callable[[], None] = lambda: None) -> Transfer:
        if self.synchronous or dst.device.type != "cuda" or src.device.type != "cpu":
            dst.copy_(src)
            return Transfer(finish)
        compute = torch.cuda.current_stream(dst.device)
        stream = self._stream(self._up, dst.device)
        stream.wait_stream(compute)  # dst's memory was given on the compute stream
        staging = None
        source = src
        if not src.is_pinned():
            staging = staging_pool().take(src.numel() * src.element_size()).view(src.dtype)
            staging.copy_(src)
            source = staging
        with torch.cuda.stream(stream):
            dst.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if staging is not None:
            staging_pool().give_back(staging.view(torch.uint8), event)
        else:
            self._reading[src.data_ptr()] = event
        return Transfer(finish, event, dst.device, complete=lambda: compute.wait_event(event))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, site: str) -> Transfer:
        if src.device.type != "cuda" or self.synchronous or not dst.is_pinned():
            dst.copy_(src)  # from a pageable destination a CUDA copy is synchronous anyway
            return Transfer()
        compute = torch.cuda.current_stream(src.device)
        stream = self._stream(self._down, src.device)
        stream.wait_stream(compute)  # the kernels that produced src
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        src.record_stream(stream)  # its memory is not reused before the copy read it

        def complete() -> None:
            if not event.query():
                self.count_wait(site)
                event.synchronize()
        return Transfer(event=event, device=src.device, complete=complete)

    def host_write_wait(self, tensor: torch.Tensor, site: str) -> Callable[[], None]:
        event = self._reading.pop(tensor.data_ptr(), None)
        if event is None:
            return nothing_to_wait_for

        def wait() -> None:
            if not event.query():
                self.count_wait(site)
                event.synchronize()
        return wait

    def stats(self) -> dict[str, object]:
        return {"engine": self.name, "host_waits": dict(self.host_waits), "staging_waits": staging_pool().host_waits}


_engines: dict[str, CopyEngine] = {}


def engine_named(name: str) -> CopyEngine:
    """The process's engine of that name (one each: streams and counters are shared by the models using it)."""
    if name not in _engines:
        _check_name(name, "name")
        if name == "plain":
            _engines[name] = PlainCopies()
        elif name == "deferred":
            _engines[name] = DeferredCopies()
        else:
            _engines[name] = CudaCopies(synchronous=name == "cuda-sync")
    return _engines[name]


def engine_for_new_model() -> CopyEngine:
    """The engine a model wrapped now uses (see :func:`set_copy_engine`)."""
    return engine_named(copy_engine_name())


def default_engine() -> CopyEngine:
    """The machine's default engine (``cuda`` with CUDA, else ``plain``), for copies outside any model."""
    return engine_named("cuda" if torch.cuda.is_available() else "plain")


def start_copy(dst: torch.Tensor, src: torch.Tensor, finish: Callable[[], None]) -> Transfer:
    """Issue ``dst.copy_(src)`` (same dtype and element count) through the machine's default engine and return
    its handle; ``finish`` runs at the handle's first :meth:`~chunkmem.core.transfer.Transfer.wait`."""
    return default_engine().to_device(dst, src, finish)
