"""Writing a file all or nothing: checkpoints, their manifest and memory-statistics dumps.

The content goes into a temporary file beside the target (``.{name}.{random hex}.tmp``), is flushed
and fsynced, and the temporary file is renamed over the target; the directory entry is fsynced too
where the system allows. A write that fails or is killed leaves the previous file in place (and at
most a temporary file, which readers ignore).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from typing import Any, BinaryIO, Callable


def write_atomically(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` with what ``write(file)`` writes into a binary file, all or nothing."""
    directory, name = os.path.split(os.path.abspath(path))
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise
    _fsync_directory(directory)


def write_json_atomically(doc: Any, path: str) -> None:
    """Replace ``path`` with ``doc`` as indented JSON, all or nothing."""
    write_atomically(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
