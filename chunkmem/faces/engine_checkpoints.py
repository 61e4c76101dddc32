"""The training engine's checkpoint directories, as DeepSpeed lays them out: one directory per tag under
``save_dir`` and a ``latest`` file naming the last tag saved; inside a tag, the model's and optimizer's files
(:mod:`chunkmem.io.checkpoint` writes them; which ones is the engine's choice) and ``engine_state.pt`` (the
engine's counters, the schedule's state and the client state, with the SHA-256 of those bytes).

A tag is one atomic unit (:func:`write_tag`): every file is written into a directory beside the tag, which
replaces it by two renames once all are there, and ``latest`` is written last; a save that fails or is
killed leaves the tag as it was, and a tag a kill left aside between the renames is put back by the next
load of it (:func:`open_tag`). Every rank calls both; the outcome of each phase is agreed over the ranks.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..distributed.collectives import ShardGroup
from ..errors import ArgumentTypeError, CheckpointError, InvalidArgumentError
from ..storage.atomic_file import fsync_directory, write_atomically

ENGINE_STATE = "engine_state.pt"
"""The file of a checkpoint tag directory with the engine's counters, the schedule and the client state."""
ENGINE_FORMAT = "chunkmem.engine/1"
ENGINE_ENVELOPE = "chunkmem.engine-checksummed/1"
"""The file's envelope since 2026-11-27: the engine state's bytes and their SHA-256 (files of format
:data:`ENGINE_FORMAT` alone, written before, still load)."""
LATEST = "latest"
"""The file under ``save_dir`` naming the last tag saved (DeepSpeed's name)."""


def barrier() -> None:
    """Wait for every rank of the default group (nothing in one process)."""
    if ShardGroup.of(None).world > 1:
        dist.barrier()


def _agree_on(error: Exception | None, what: str) -> None:
    """Raise on every rank if ``error`` happened on any (one small all-reduce when distributed)."""
    group = ShardGroup.of(None)
    if group.world > 1:
        failed = torch.tensor([0 if error is None else group.rank + 1], dtype=torch.int64)
        group.all_reduce_(failed, dist.ReduceOp.MAX, what=f"the outcome of {what}")
        if error is None and int(failed.item()):
            raise CheckpointError(f"{what} failed on rank {int(failed.item()) - 1} (see its error); the checkpoint "
                                  f"was not changed")
    if error is not None:
        raise error


def _read_latest(path: str) -> str:
    """The tag a ``latest`` file names; :class:`CheckpointError` naming the file when it names none (a file
    that is not text, empty, or a name with path separators), where before a bare ``UnicodeDecodeError`` or an
    error about a ``tag`` argument the caller never passed came."""
    with open(path, "rb") as f:
        content = f.read(4097)
    try:
        tag = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag or len(content) > 4096 or tag in (".", "..") or os.sep in tag or (os.altsep and os.altsep in tag) \
            or any(not c.isprintable() for c in tag):
        raise CheckpointError(f"{path!r} does not name a checkpoint tag (it holds {content[:40]!r}): pass tag= to "
                              f"load one, or save again to rewrite it")
    return tag


def _serialized_engine_state(state: dict[str, Any]) -> bytes:
    """``state``'s bytes as ``torch.save`` writes them; a ``client_state`` that does not pickle is an
    :class:`InvalidArgumentError` naming it."""
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as e:  # noqa: BLE001 - the user's client_state is any object
        raise InvalidArgumentError("client_state", type(state["client_state"]).__name__,
                                   f"a dict torch.save can write ({type(e).__name__}: {e}); nothing was saved") from e
    return buffer.getvalue()


def _write_engine_state(path: str, payload: bytes) -> None:
    """Write the engine state's bytes with their SHA-256 (checked at load)."""
    envelope = {"format": ENGINE_ENVELOPE, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}
    write_atomically(path, lambda f: torch.save(envelope, f))


def _swap_in(pending: str, directory: str) -> None:
    """Make the complete directory ``pending`` the tag ``directory``: the old one (if any) is renamed aside,
    the new one into place, the old one removed. A kill between the two renames leaves no tag and the old one
    aside, which :func:`_recover_tag` puts back."""
    aside = None
    if os.path.lexists(directory):
        aside = f"{os.path.dirname(directory)}/.{os.path.basename(directory)}.replaced"
        _remove_tree(aside)
        os.rename(directory, aside)
    os.rename(pending, directory)
    fsync_directory(os.path.dirname(directory))
    if aside is not None:
        _remove_tree(aside)


def _recover_tag(directory: str) -> None:
    """A save killed between :func:`_swap_in`'s renames left the tag's previous contents aside: put them back."""
    aside = f"{os.path.dirname(directory)}/.{os.path.basename(directory)}.replaced"
    if not os.path.lexists(directory) and os.path.isdir(aside):
        os.rename(aside, directory)


def _remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def check_dir(path: Any, name: str) -> str:
    """``path`` (the argument ``name``) as a directory path string."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(name, path, "a directory path")
    return os.fspath(path)


def check_tag(tag: Any) -> str:
    """``tag`` as the name of a tag directory."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise ArgumentTypeError("tag", tag, "a string or an integer naming the checkpoint")
    tag = str(tag)
    if not tag or tag in (".", "..") or os.sep in tag or (os.altsep and os.altsep in tag):
        raise InvalidArgumentError("tag", tag, "a non-empty name without path separators")
    return tag


def write_tag(save_dir: str, tag: str, pending_name: str, engine_state: dict[str, Any] | None,
              write_model: Callable[[str], None], save_latest: bool) -> None:
    """Write the tag ``tag`` under ``save_dir`` as one unit: ``write_model(directory)`` writes the model's and
    optimizer's files (every rank) and rank 0 writes ``engine_state`` (``None`` on the other ranks) into the
    directory ``pending_name`` beside the tag, which is then swapped in; with ``save_latest`` rank 0 then
    writes ``latest``. A ``client_state`` that does not pickle raises before any file is written."""
    directory = os.path.join(save_dir, tag)
    rank0 = ShardGroup.of(None).rank == 0
    # The whole tag is written into a directory beside it and swapped in by two renames once every file is
    # there (model, optimizer, engine state), and ``latest`` after: a save that fails or is killed leaves the
    # tag as it was. Before 2026-11-27 the files were replaced one by one, and a failure between them left the
    # new weights with the old counters, schedule and client state.
    pending = os.path.join(save_dir, pending_name)
    error = None
    try:
        if rank0:
            payload = _serialized_engine_state(engine_state)  # before any file: an unpicklable client_state raises
            _remove_tree(pending)  # left by a process killed at this same save
            os.makedirs(pending)
    except OSError as exc:  # a file where the directory goes, a read-only or full file system
        error = CheckpointError(f"save_checkpoint: cannot write the checkpoint directory {directory!r} "
                                f"({type(exc).__name__}: {exc}); nothing was saved")
        error.__cause__ = exc
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    _agree_on(error, f"preparing the checkpoint {directory!r}")
    error = None
    try:
        write_model(pending)
        if rank0:
            _write_engine_state(os.path.join(pending, ENGINE_STATE), payload)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    barrier()
    if error is None and rank0:
        try:
            _swap_in(pending, directory)
            if save_latest:
                write_atomically(os.path.join(save_dir, LATEST), lambda f: f.write(tag.encode()))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    if error is not None and rank0:
        _remove_tree(pending)
    _agree_on(error, f"saving the checkpoint {directory!r}")
    barrier()


def open_tag(load_dir: str, tag: Any) -> tuple[str, dict[str, Any]] | None:
    """The tag directory ``tag`` names under ``load_dir`` (``None``: the one ``latest`` names; without that
    file a warning and ``None``) and its engine state, checked. A tag a killed save left aside is put back
    first (rank 0; every rank waits for it)."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            warnings.warn(f"load_checkpoint: no {latest!r}: nothing loaded (pass tag= to name a checkpoint)",
                          stacklevel=3)
            return None
        tag = _read_latest(latest)
    directory = os.path.join(load_dir, check_tag(tag))
    if ShardGroup.of(None).rank == 0:
        _recover_tag(directory)
    barrier()
    return directory, read_engine_state(directory)


def read_engine_state(directory: str) -> dict[str, Any]:
    """The engine state of the tag ``directory``, its checksum and fields checked."""
    path = os.path.join(directory, ENGINE_STATE)
    try:
        # the engine's own file, which holds the user's client_state (any picklable object)
        state = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(state, dict) and state.get("format") == ENGINE_ENVELOPE:
            if hashlib.sha256(state["payload"]).hexdigest() != state["sha256"]:
                raise CheckpointError(f"{path!r} is corrupt: its SHA-256 does not match the one saved with it")
            state = torch.load(io.BytesIO(state["payload"]), map_location="cpu", weights_only=False)
    except FileNotFoundError as e:
        raise CheckpointError(f"{directory!r} is not a checkpoint of this engine: {ENGINE_STATE} is missing") from e
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error for the user
        raise CheckpointError(f"{path!r} could not be read ({type(e).__name__}: {e})") from e
    fields = {"global_steps": int, "global_samples": int, "skipped_steps": int, "micro_steps": int,
              "client_state": dict}
    if not isinstance(state, dict) or state.get("format") != ENGINE_FORMAT or any(
            not isinstance(state.get(k), t) for k, t in fields.items()):
        raise CheckpointError(f"{path!r} is not an engine state of format {ENGINE_FORMAT!r}")
    return state
