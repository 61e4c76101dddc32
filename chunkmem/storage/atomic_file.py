"""Writing a file all or nothing: checkpoints, their manifest and memory-statistics dumps.

The content goes into a temporary file beside the target (``.{name}.{random hex}.tmp``), is flushed
and fsynced, and the temporary file is renamed over the target; the directory entry is fsynced too
where the system allows. A write that fails or is killed leaves the previous file in place (and at
most a temporary file, which readers ignore and :func:`remove_stale_temporaries` removes).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import warnings
from typing import Any, BinaryIO, Callable

_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.[0-9a-f]+\.tmp$")


def write_atomically(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` with what ``write(file)`` writes into a binary file, all or nothing."""
    directory, name = os.path.split(os.path.abspath(path))
    temp = os.path.join(directory, _temporary_name(name, secrets.token_hex(6)))
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
    fsync_directory(directory)


def write_json_atomically(doc: Any, path: str) -> None:
    """Replace ``path`` with ``doc`` as indented JSON, all or nothing."""
    write_atomically(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def temporary_target(name: str) -> str | None:
    """The name of the file whose temporary :func:`write_atomically` names ``name`` (a bare file name,
    ``.{target}.{hex}.tmp``), or ``None`` when ``name`` is not such a temporary file."""
    match = _TEMPORARY.match(name)
    return match.group("target") if match else None


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporary files that interrupted writes of ``path`` left beside it (only names of
    this module's pattern for that target; nothing else). Never raises: what cannot be removed is
    warned about and left. The names removed."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        names = os.listdir(directory)
    except OSError as exc:
        warnings.warn(f"could not list {directory!r} to remove stale temporary files: {exc}", stacklevel=2)
        return []
    removed = []
    for other in names:
        if temporary_target(other) == name:
            try:
                os.remove(os.path.join(directory, other))
                removed.append(other)
            except OSError as exc:
                warnings.warn(f"could not remove the stale temporary file {other!r} in {directory!r}: {exc}",
                              stacklevel=2)
    return removed


def _temporary_name(name: str, tag: str) -> str:
    return f".{name}.{tag}.tmp"


def fsync_directory(directory: str) -> None:
    """Make a rename or a new file inside ``directory`` durable (where the file system allows)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
