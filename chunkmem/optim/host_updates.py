"""The host updates ``step_in_backward`` starts, run off autograd's thread.

With ``step_in_backward`` a chunk whose optimizer state is in host memory is updated as soon as its gradients
are final (:mod:`chunkmem.optim.backward_step`). Run inside autograd's hook, that update first waits for the
gradient's copy to the host, then copies the undo state and runs the host Adam kernel: autograd's thread,
which launches the rest of the backward on the GPU, stands still meanwhile, and the GPU drains (on the H200,
the backward took 285 ms instead of 135 ms). :class:`HostUpdates` gives that work to one thread of its own:
the hook keeps the bookkeeping (which copy is written, the undo copy's memory, what the update assumes) and
hands over a job that waits for the gradient's copy, fills the undo copy and runs the update; autograd goes
on launching. The host Adam kernel is a C library called through ``ctypes``, which lets go of the
interpreter lock, so the update and the launching really overlap.

The jobs run in the order the chunks' gradients became final. :meth:`HostUpdates.join` waits for all of
them and runs each one's completion (the copy marked updated, the step counts advanced) on the caller's
thread; the runtime calls it when the backward ends, before it frees, plans or moves anything, so nothing
outside the backward ever sees a chunk whose update is running. A job that raised is re-raised by ``join``
(the first one), after every other job finished.

The update thread splits each update over one thread fewer than torch's count: autograd's thread goes on
launching the backward meanwhile, and an update whose threads take every core makes the launching wait for a
core (and the update for its slowest thread). The host Adam is bound by memory bandwidth, which one core less
barely changes (not measured on a GPU yet).

Only where a copy completes after it is issued (the ``cuda`` engine, and the ``deferred`` test engine that
checks every wait on the CPU) do the jobs go to the thread; with plain copies there is no copy to wait for
and the update runs in the hook as before.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .host_adam_ext import set_thread_default


@dataclass
class JobTimes:
    """When one update job was handed over, began and ended on the update thread (``time.perf_counter()``
    seconds; ``started`` and ``finished`` stay ``None`` until then). ``name``: what the job updates."""

    name: str
    submitted: float
    started: float | None = None
    finished: float | None = None


class HostUpdates:
    """One optimizer's updates running off autograd's thread (see the module docstring). ``timeline``: the
    :class:`JobTimes` of the jobs submitted since the last :meth:`join` began, or of those it joined;
    ``joined``: when the last join began and ended (``perf_counter`` seconds), for profiles of the overlap."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._running: list[tuple[Future, Callable[[], None]]] = []
        self.timeline: list[JobTimes] = []
        self.joined: tuple[float, float] | None = None

    @property
    def pending(self) -> int:
        """Jobs submitted and not joined yet."""
        return len(self._running)

    def submit(self, work: Callable[[], None], then: Callable[[], None], name: str = "") -> None:
        """Run ``work`` on the update thread; ``then`` runs on the joining thread once it has finished
        (``name``: what it updates, for :attr:`timeline`)."""
        if not self._running:  # the first job since the last join: a new timeline
            self.timeline = []
        times = JobTimes(name, time.perf_counter())
        self.timeline.append(times)

        def timed() -> None:
            times.started = time.perf_counter()
            try:
                work()
            finally:
                times.finished = time.perf_counter()

        if self._pool is None:
            threads = max(1, torch.get_num_threads() - 1)  # (module docstring) read on the submitting thread
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkmem-host-updates",
                                            initializer=set_thread_default, initargs=(threads,))
        self._running.append((self._pool.submit(timed), then))

    def join(self) -> None:
        """Wait for every job; run the completions of those that finished, in order; raise the first error."""
        running, self._running = self._running, []
        began = time.perf_counter()
        error: BaseException | None = None
        for future, then in running:
            failed = future.exception()
            if failed is not None:
                error = error or failed
                continue
            then()
        self.joined = (began, time.perf_counter())
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the jobs and stop the thread (the optimizer is going away)."""
        try:
            self.join()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
