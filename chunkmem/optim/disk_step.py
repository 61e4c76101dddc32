"""An optimizer step over optimizer state that rests on the disk tier: streamed, pipelined, all or nothing.

Adam is elementwise, so each chunk is updated in pieces of ``buffer_size`` bytes of fp32 state. For
every piece, in chunk order, the fp32 master (16-bit models), exp_avg and exp_avg_sq (another elementwise
optimizer's state families: :class:`ChunkUpdate`'s ``rule``) are read from the
chunk's current disk slot into a group of aligned I/O buffers, updated there (the 16-bit parameters
are written into host memory as the update's ``param_out``), and written back. ``buffer_count`` groups
circulate: while piece k is updated, pieces k+1... are being read and k−1... written (DeepSpeed's
``pipeline_read`` / ``pipeline_write``, always on). A rule whose state is laid out in blocks (the 8-bit Adams:
:attr:`ChunkUpdate.whole`) gets each chunk's shard as one piece, in buffers of at least one shard of the widest
family streamed (:func:`whole_piece_nbytes`); the families it keeps in memory (``Chunk.in_memory_families``) are
not streamed. What a rule must complete once every chunk was streamed, with collectives that every rank runs in
the same order (the 8-bit Adams' blocks cut by a shard boundary), is its ``settle`` (:data:`Settle`), run before
the commit on the caller's thread, also by a rank whose stream failed; the elements it returns are written again.

All or nothing (``atomic_step``, the default). New state goes to the chunk's *other* slot; the step
commits, switching every buffer's slot, only when every piece of every chunk was written and every
data-parallel rank agrees that it succeeded. If any read or write fails (a full disk, an I/O error, a
short read) the remaining I/O is drained, the current slots are untouched, the parameters already
overwritten are restored (16-bit: the rounding of the old master, read back from disk; fp32: their old
values, which were first written to a journal file), the chunks' step counts are restored, and
:class:`DiskStepError` is raised naming the file and the chunk. Gradients are kept for another
``step()``, except with ``reuse_fp16_shard``, where the update overwrote them in place: they are then
dropped, as by ``zero_grad()``. An exception other than an I/O error inside the stream (a crash) is re-raised
after the same: the I/O in flight drained, the other ranks told that this one failed (they raise
:class:`DiskStepError`), the parameters put back.

Without ``atomic_step`` the disk holds one slot (half the files), the state is written in place, and
a failed step leaves the chunks before the failure updated: the optimizer then refuses to step until a
checkpoint or state dict is loaded (the error says so).

In the backward (``ShardedOptimizerV2(..., step_in_backward=True)``) the same stream runs on a thread of
its own: :meth:`StreamedStep.start` starts it, :meth:`StreamedStep.add` hands it each chunk as soon as
the backward has finished the chunk's gradients, and :meth:`StreamedStep.finish` (in ``step()``) waits
for it and commits or undoes exactly as :meth:`StreamedStep.run` does.
"""
from __future__ import annotations

import atexit
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, NoReturn, Protocol

import torch

from .adam_kernels import adam_update_
from .adam_math import AdamHyper
from ..core.chunk import MASTER, Chunk, FlatBuffer, ParamSlot
from ..storage.disk_io import DiskIOError, IOHandle, aligned_nbytes
from ..core.disk_tier import JOURNAL, DiskTier, typed_view
from ..errors import DiskStepError


class PieceRule(Protocol):
    """Another optimizer's update of the elements ``[start, end)`` of one chunk's shard (see
    :class:`~chunkmem.optim.any_optimizer.PieceStep`): ``master`` and each ``state[family]`` are fp32 views of
    those elements, updated in place; ``grad`` is the rank's whole shard of gradients."""

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], start: int,
                 end: int) -> None: ...


@dataclass
class ChunkUpdate:
    """What one chunk's streamed update needs: its host gradient (this rank's ``shard_numel``
    elements), where its parameters are (``param``: a host tensor, or ``None`` when the parameter shard
    rests on disk too and is streamed like the state), the slots it steps (their step counts advance once it
    is written), the ranges updated with their hyper-parameters and the step number after the update
    (``(start, end, hyper, step)``, elements of this rank's shard, one per run of one param group's stepped
    parameters with one step count) and the gradient multiplier. ``rule``: the update of
    an optimizer other than Adam (its state families are the chunk's ``state_families``); ``None`` runs
    the Adam kernel over ``ranges``."""

    chunk: Chunk
    grad: torch.Tensor
    param: torch.Tensor | None
    stepped: list[ParamSlot]
    ranges: list[tuple[int, int, AdamHyper, int]]
    spans: list[tuple[int, int]]  # the parameters' element spans in this rank's shard (see param_spans)
    multiplier: float
    rule: PieceRule | None = None
    whole: bool = False  # one piece: the whole shard (``rule`` must not see a piece boundary; see whole_piece_nbytes)
    # parameters resting on disk that are their own masters: their values already in host memory (taken from the
    # copy the backward computed with), streamed from here instead of read from disk again
    resting_values: torch.Tensor | None = None
    updated_to: int = 0  # elements [0, updated_to) were updated, or after a crash written to (pieces run in order)

    @property
    def computed(self) -> bool:
        """Whether every piece was updated (written or not): the gradient is read no more."""
        return self.updated_to >= self.chunk.shard_numel

    @property
    def reads(self) -> list[FlatBuffer]:
        """The disk buffers read for the update: the master (a separate fp32 one, or the parameters resting on
        disk that are their own masters) and the chunk's optimizer state families that rest on disk (Adam:
        exp_avg, exp_avg_sq; not those the chunk keeps in memory: ``Chunk.in_memory_families``)."""
        chunk = self.chunk
        if chunk.has_master:
            master = [chunk.optim[MASTER]]
        else:
            master = [chunk.param.shard] if self.param is None else []
        return master + [chunk.optim[family] for family in streamed_state(chunk)]

    @property
    def writes(self) -> list[FlatBuffer]:
        """The disk buffers written: those read, and 16-bit parameters resting on disk."""
        extra = [self.chunk.param.shard] if self.param is None and self.chunk.has_master else []
        return self.reads + extra


def gaps(ranges: list[tuple[int, int, AdamHyper, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The element ranges within ``[start, end)`` that none of ``ranges`` (sorted, disjoint) covers."""
    out, position = [], start
    for a, b, *_ in ranges:
        if a > position:
            out.append((position, min(a, end)))
        position = max(position, b)
        if position >= end:
            break
    if position < end:
        out.append((position, end))
    return [(a, b) for a, b in out if a < b]


def streamed_state(chunk: Chunk) -> tuple[str, ...]:
    """The state families of ``chunk`` that the streamed step reads from disk (every one but those kept in
    memory)."""
    return tuple(family for family in chunk.state_families if family not in chunk.in_memory_families)


def streamed_families(chunk: Chunk, params_on_disk: bool, atomic_step: bool) -> int:
    """I/O buffers one piece of ``chunk``'s streamed update holds: one per family read or written (see
    :attr:`ChunkUpdate.writes`), plus the journal of fp32 parameters overwritten in host memory by an
    atomic step."""
    return streamed_count(len(streamed_state(chunk)), chunk.has_master, params_on_disk, atomic_step)


def whole_piece_nbytes(chunk: Chunk, params_on_disk: bool, atomic_step: bool) -> int:
    """Bytes of an I/O buffer that holds the widest of the families ``chunk``'s streamed update reads or writes
    (see :attr:`ChunkUpdate.writes`; an atomic step's journal of parameters in host memory is fp32) for its whole
    shard: an update streamed as one piece (:attr:`ChunkUpdate.whole`)."""
    widths = [chunk.optim[family].dtype.itemsize for family in streamed_state(chunk)]
    if chunk.has_master:
        widths.append(4)
    if params_on_disk:
        widths.append(chunk.dtype.itemsize)
    elif atomic_step and not chunk.has_master:
        widths.append(4)
    return aligned_nbytes(max(widths) * chunk.shard_numel)


def stream_shape(chunks: list[Chunk], whole: bool, disk: DiskTier) -> tuple[int, int]:
    """``(families, nbytes)`` of the I/O buffers a streamed step over ``chunks`` needs: the most buffers one
    piece holds (:func:`streamed_families`), and each buffer's bytes (the disk tier's ``buffer_size``, or with
    ``whole`` pieces at least one whole shard: :func:`whole_piece_nbytes`)."""
    families = max((streamed_families(c, c.param.shard.on_disk, disk.atomic_step) for c in chunks), default=0)
    nbytes = max([disk.buffer_size] + [whole_piece_nbytes(c, c.param.shard.on_disk, disk.atomic_step)
                                       for c in chunks if whole])
    return families, nbytes


def streamed_count(state_families: int, has_master: bool, params_on_disk: bool, atomic_step: bool) -> int:
    """:func:`streamed_families` of a trainable chunk with ``state_families`` per-element state families,
    a separate master or not (16-bit or fp32 parameters), before any chunk exists."""
    if has_master:
        return state_families + (2 if params_on_disk else 1)
    if params_on_disk:
        return state_families + 1
    return state_families + (1 if atomic_step else 0)


@dataclass
class _Piece:
    update: ChunkUpdate
    start: int
    end: int
    buffers: list[torch.Tensor]
    reads: list[IOHandle]
    journal: torch.Tensor | None = None

    @property
    def held(self) -> list[torch.Tensor]:
        """Every I/O buffer the piece holds (given back once its writes are done)."""
        return self.buffers + ([self.journal] if self.journal is not None else [])


LateWrite = tuple[ChunkUpdate, str, int, torch.Tensor]
"""``(update, family, start, values)``: elements of a state family that rests on disk, written again once every
chunk was streamed (:class:`StreamedStep`'s ``settle``): ``values`` from element ``start`` (a multiple of the I/O
alignment) to a multiple of it or to the end of the shard."""

Settle = Callable[[list[ChunkUpdate], bool], list[LateWrite]]
"""``settle(updates, failed)``: what completes the streamed ``updates`` once all of them were computed, on every
data-parallel rank in the same order (it may run collectives), whether this rank's stream ``failed`` or not; it
returns the elements to write again (nothing where ``failed``)."""


class StreamedStep:
    """Runs one step over chunks whose optimizer state rests on ``disk``; see the module docstring.
    ``agree(failed)`` returns whether any data-parallel rank failed (a collective); ``shape``: the most
    I/O buffers one piece holds and their bytes (:func:`stream_shape` of the chunks to come); ``settle``: what
    completes the updates before the commit (:data:`Settle`: the 8-bit Adams' blocks cut by a shard boundary),
    on the caller's thread, also on a rank whose stream failed, so that every rank meets the same collectives;
    ``release_values`` is called, on the caller's thread once the stream has ended, with each update's
    ``resting_values`` still held."""

    def __init__(self, disk: DiskTier, agree: Callable[[bool], bool], shape: tuple[int, int],
                 settle: Settle | None = None,
                 release_values: Callable[[torch.Tensor], None] = lambda values: None) -> None:
        self.disk = disk
        self.agree = agree
        self.settle = settle
        self.release_values = release_values
        self.updates: list[ChunkUpdate] = []  # every update handed over so far, in order
        self._families, self._buffer_nbytes = shape
        self._incoming: queue.SimpleQueue[ChunkUpdate | None] = queue.SimpleQueue()
        self._closed = False  # no more updates will come (the queue ends with None)
        self._drained = False  # the stream has taken the closing None
        self._current: Iterator[tuple[ChunkUpdate, int, int]] = iter(())
        self._thread: threading.Thread | None = None
        self._crash: BaseException | None = None  # an exception other than an I/O error, on the thread
        self._error: DiskIOError | None = None
        self._progress = threading.Condition()  # notified when a chunk's update is computed or the thread ends
        self._stopped = False  # the thread ended (every update done, an I/O error or a crash)

    @classmethod
    def over(cls, disk: DiskTier, updates: list[ChunkUpdate], agree: Callable[[bool], bool],
             settle: Settle | None = None) -> "StreamedStep":
        """A step over ``updates``, all known now."""
        step = cls(disk, agree, stream_shape([u.chunk for u in updates], any(u.whole for u in updates), disk),
                   settle)
        for update in updates:
            step.add(update)
        return step

    def add(self, update: ChunkUpdate) -> None:
        """Hand over one more chunk's update (its gradient final)."""
        if self._closed:
            raise RuntimeError("StreamedStep.add after finish(): the step is closed")
        self.updates.append(update)
        self._incoming.put(update)

    def run(self) -> None:
        """Update every chunk handed over on this thread and commit, or undo and raise
        :class:`DiskStepError`."""
        self._close()
        try:
            if self.updates:
                self._stream()
        except BaseException as crash:
            self._after_crash(crash)
            raise
        self._commit()

    def start(self) -> None:
        """Start streaming on a thread of its own, chunk by chunk as :meth:`add` hands them over."""
        self.disk.buffers(self._families, self._buffer_nbytes)  # here: the host ledger is not changed from two threads
        self._thread = threading.Thread(target=self._stream_on_thread, name="chunkmem-disk-step", daemon=True)
        self._thread.start()
        # A process that ends before step() (a script that stops after a backward, an uncaught error) must not
        # finalize the interpreter while the thread is inside torch's or the kernel's native code: a daemon
        # thread that wants the interpreter back then is ended by unwinding native frames, which aborts the
        # process ("terminate called without an active exception"). So the stream is closed and joined at exit,
        # before the disk tier's files are removed (whose exit handlers were registered earlier: run later).
        atexit.register(self._close_and_join)

    def finish(self) -> None:
        """No more chunks: wait for the thread to update every chunk handed over, then commit, or undo
        and raise :class:`DiskStepError`."""
        self._close_and_join()
        if self._crash is not None:
            self._after_crash(self._crash)
            raise self._crash
        self._commit()

    def abandon(self) -> None:
        """No more chunks, and no commit (``atomic_step`` only): wait for the thread, put back the
        parameters it overwrote; every slot stays as it was (the state before the step)."""
        assert self.disk.atomic_step, "only an atomic step can be abandoned"
        self._close_and_join()
        for update in self.updates:
            if update.updated_to and update.param is not None:
                self._restore_params(update)
        if self._crash is not None:
            raise self._crash

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._incoming.put(None)

    def _close_and_join(self) -> None:
        """No more chunks; wait for the thread (if one was started) to stream those handed over."""
        self._close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            atexit.unregister(self._close_and_join)
        for update in self.updates:
            if update.resting_values is not None:
                self.release_values(update.resting_values)
                update.resting_values = None

    def _stream_on_thread(self) -> None:
        try:
            self._stream()
        except BaseException as exc:  # re-raised by finish() on the caller's thread
            self._crash = exc
        finally:
            with self._progress:
                self._stopped = True
                self._progress.notify_all()

    def wait_until_computed(self, pending: int) -> list[ChunkUpdate]:
        """On a stream started with :meth:`start`: wait until at most ``pending`` of the updates handed over
        are not computed yet (some piece not updated: they still read their gradient), or the thread
        ended; return the updates that are computed (their gradients are read no more)."""
        with self._progress:
            while not self._stopped and sum(not u.computed for u in self.updates) > pending:
                self._progress.wait()
        return [u for u in self.updates if u.computed]

    def _commit(self) -> None:
        failed = self._error is not None
        if self.settle is not None:  # (every rank settles, also one whose stream failed: it may run collectives)
            late = self.settle(self.updates, failed)
            if not failed:
                self._write_late(late)
        if self.agree(self._error is not None):  # (every rank agrees, also one without chunks on disk)
            self._fail()
        if self.disk.atomic_step:
            for update in self.updates:
                for buf in update.writes:
                    buf.switch_disk_slot()

    def _after_crash(self, crash: BaseException) -> None:
        """The stream raised ``crash``, something other than an I/O error (re-raised by the caller): take part in
        the collectives the other ranks' commits run, as a rank that failed, so that none of them waits forever
        (where that fails too, the crash says so in a note); an atomic step puts back the parameters it overwrote
        (no slot was switched: the state is as before the step)."""
        try:
            if self.settle is not None:
                self.settle(self.updates, True)
            self.agree(True)
        except Exception as exc:
            crash.add_note(f"chunkmem: telling the other data-parallel ranks that this rank's disk step failed "
                           f"failed too: {exc!r}")
        if self.disk.atomic_step:
            for update in self.updates:
                if update.updated_to and update.param is not None:
                    self._restore_params(update)

    def _write_late(self, late: list[LateWrite]) -> None:
        """Write ``late``'s elements (:data:`LateWrite`) where the stream wrote the pieces they lie in (the other
        slot of an atomic step, else in place); a failure is remembered in ``_error``, as the stream's."""
        if not late:
            return
        pool = self.disk.buffers(self._families, self._buffer_nbytes)
        staging = pool.take()
        try:
            for update, family, start, values in late:
                buf = update.chunk.optim[family]
                slot = (1 - buf.disk_slot) if self.disk.atomic_step else buf.disk_slot
                end = start + values.numel()
                typed_view(staging, buf.dtype, end - start).copy_(values)
                if not self._wait([self.disk.write_piece(buf.region, slot, start, end, staging)]):
                    return
        finally:
            pool.give_back(staging)

    def _next_piece(self, block: bool) -> tuple[ChunkUpdate, int, int] | None:
        """The next piece to read: of the current chunk, else of the next one handed over (waiting for it
        when ``block``); ``None`` when there is none yet or no more."""
        while True:
            piece = next(self._current, None)
            if piece is not None:
                return piece
            if self._drained:
                return None
            try:
                update = self._incoming.get(block=block)
            except queue.Empty:
                return None
            if update is None:
                self._drained = True
                return None
            numel = update.chunk.shard_numel
            pieces = [(0, numel)] if update.whole else self.disk.pieces(numel, 4)
            self._current = ((update, a, b) for a, b in pieces)

    def _stream(self) -> None:
        """Read, update and write every piece; stop issuing at the first failed I/O, drain what is in
        flight, and leave the error in ``_error``."""
        pool = self.disk.buffers(self._families, self._buffer_nbytes)
        write_slot: dict[int, list[int]] = {}
        reading: deque[_Piece] = deque()
        writing: deque[tuple[list[torch.Tensor], list[IOHandle]]] = deque()
        # pieces read (or being read) but not yet updated: every group but one, kept for the writes
        most_reading = max(self.disk.buffer_count - 1, 1)

        def reclaim(block: bool) -> None:
            while writing and (block or all(h.done() for h in writing[0][1])):
                buffers, handles = writing.popleft()
                self._wait(handles)
                for buf in buffers:
                    pool.give_back(buf)
                block = False

        def issue(update: ChunkUpdate, start: int, end: int) -> None:
            while pool.free < self._families:
                reclaim(block=True)
            if id(update) not in write_slot:
                write_slot[id(update)] = [(1 - b.disk_slot) if self.disk.atomic_step else b.disk_slot
                                          for b in update.writes]
            buffers = [pool.take() for _ in update.writes]
            reads = [self._read(update, buf, start, end, raw) for buf, raw in zip(update.reads, buffers)]
            reads = [handle for handle in reads if handle is not None]
            piece = _Piece(update, start, end, buffers, reads)
            if self._journals(update):
                piece.journal = pool.take()
                typed_view(piece.journal, torch.float32, end - start).copy_(update.param[start:end])
                piece.reads.append(self.disk.file(JOURNAL).write_from(
                    piece.journal[:_aligned(end - start)], self._journal_offset(update, start),
                    f"{update.chunk.name}.{JOURNAL}"))
            reading.append(piece)

        updating: list[_Piece] = []  # the piece being updated: its buffers are in neither queue
        try:
            while self._error is None:
                while len(reading) < most_reading and self._error is None:
                    upcoming = self._next_piece(block=not reading)  # wait for a chunk only with nothing to do
                    if upcoming is None:
                        break
                    issue(*upcoming)
                if self._error is not None or not reading:
                    break
                piece = reading.popleft()
                if not self._wait(piece.reads):
                    writing.append((piece.held, []))
                    break
                updating.append(piece)
                self._update(piece)
                if piece.update.computed:
                    with self._progress:
                        self._progress.notify_all()
                handles = [self.disk.write_piece(buf.region, slot, piece.start, piece.end, raw) for buf, raw, slot
                           in zip(piece.update.writes, piece.buffers, write_slot[id(piece.update)])]
                writing.append((updating.pop().held, handles))
                reclaim(block=False)
        finally:  # drained after a failure, or an exception (a crash): every buffer is given back
            for piece in updating:  # it may have written part of the parameters: put back as if updated
                piece.update.updated_to = piece.end
                writing.append((piece.held, []))
            for piece in reading:
                self._wait(piece.reads)
                writing.append((piece.held, []))
            while writing:
                reclaim(block=True)

    def _read(self, update: ChunkUpdate, buf: FlatBuffer, start: int, end: int, raw: torch.Tensor) -> IOHandle | None:
        """Start reading elements ``[start, end)`` of ``buf`` into the I/O buffer ``raw``; the parameters whose
        values the update holds already are copied there instead (``None``: nothing to wait for)."""
        if update.resting_values is not None and buf is update.chunk.param.shard:
            typed_view(raw, buf.dtype, end - start).copy_(update.resting_values[start:end])
            return None
        return self.disk.read_piece(buf.region, buf.disk_slot, start, end, raw)

    def _wait(self, handles: list[IOHandle]) -> bool:
        """Wait for every handle; remember the first error. Returns whether all succeeded."""
        ok = True
        for handle in handles:
            try:
                handle.wait()
            except DiskIOError as exc:
                ok = False
                if self._error is None:
                    self._error = exc
        return ok

    def _journals(self, update: ChunkUpdate) -> bool:
        """Whether the update overwrites fp32 parameters in host memory (their old values are journaled)."""
        return self.disk.atomic_step and not update.chunk.has_master and update.param is not None

    def _update(self, piece: _Piece) -> None:
        update, a, b = piece.update, piece.start, piece.end
        views = [typed_view(raw, buf.dtype, b - a) for buf, raw in zip(update.reads, piece.buffers)]
        param_out = None
        if update.chunk.has_master:
            master, state = views[0], views[1:]
            if update.param is None:
                param_out = typed_view(piece.buffers[-1], update.chunk.dtype, b - a)
            else:
                param_out = update.param[a:b]
        elif update.param is None:
            master, state = views[0], views[1:]
        else:
            master, state = update.param[a:b], views
        if update.rule is not None:
            update.rule(master, update.grad, dict(zip(streamed_state(update.chunk), state)), a, b)
            if param_out is not None:
                param_out.copy_(master)
            update.updated_to = b
            return
        exp_avg, exp_avg_sq = state
        for start, end, hyper, step in update.ranges:
            lo, hi = max(start, a), min(end, b)
            if lo >= hi:
                continue
            piece = slice(lo - a, hi - a)
            adam_update_(master[piece], update.grad[lo:hi], exp_avg[piece], exp_avg_sq[piece], step, hyper,
                         grad_multiplier=update.multiplier,
                         param_out=None if param_out is None else param_out[piece],
                         param_spans=[(s - lo, e - lo) for s, e in update.spans])
        if param_out is not None:  # what no range wrote (frozen parameters, padding): the master's rounding
            for lo, hi in gaps(update.ranges, a, b):
                param_out[lo - a:hi - a].copy_(master[lo - a:hi - a])
        update.updated_to = b

    def _journal_offset(self, update: ChunkUpdate, start: int) -> int:
        return self.disk.offset(JOURNAL, update.chunk.index, 0) + start * 4

    def _fail(self) -> NoReturn:
        """Undo what can be undone and raise :class:`DiskStepError`."""
        error = self._error
        where = (f"{error.operation} of {error.what} in {error.path} failed" if error is not None
                 else "another data-parallel rank's disk I/O failed")
        if not self.disk.atomic_step:
            raise DiskStepError(
                f"optimizer step failed: {where}. The state was being written in place (atomic_step=False), so "
                f"the chunks before the failure are updated and the others are not: load a checkpoint "
                f"(chunkmem.load_checkpoint) or a state dict before stepping again", undone=False, cause=error)
        for update in self.updates:
            if update.updated_to and update.param is not None:
                self._restore_params(update)
        raise DiskStepError(f"optimizer step undone: {where}. Masters and optimizer state are as they were "
                            f"before the step; free the cause (e.g. disk space) and step again, or load a "
                            f"checkpoint", undone=True, cause=error)

    def _restore_params(self, update: ChunkUpdate) -> None:
        """Put back the parameter values the failed step overwrote."""
        chunk = update.chunk
        if chunk.has_master:
            update.param.copy_(chunk.optim[MASTER].read())
            return
        pool = self.disk.buffers(1)
        staging = pool.take()
        try:
            for a, b in self.disk.pieces(update.updated_to, 4):
                self.disk.file(JOURNAL).read_into(staging[:_aligned(b - a)], self._journal_offset(update, a),
                                                  f"{chunk.name}.{JOURNAL}").wait()
                update.param[a:b].copy_(typed_view(staging, torch.float32, b - a))
        finally:
            pool.give_back(staging)


def _aligned(numel: int) -> int:
    """Bytes of ``numel`` fp32 elements rounded up to the I/O alignment."""
    return aligned_nbytes(numel * 4)
