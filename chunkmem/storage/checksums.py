"""SHA-256 checksums of checkpoint files: of the exact bytes of a file, and of the content of a
state dict (for a file whose checksum must travel inside it).

A checksum is written ``"sha256:<64 hex digits>"``, so that another algorithm can be added later.

* :class:`HashingWriter` and :func:`file_checksum` hash the bytes written to and read from a file.
* :func:`content_checksum` hashes what ``torch.load`` returns rather than the file's bytes: every
  mapping key and list item in order, every string and number with its type, and every tensor's
  dtype, shape and element bytes (row-major). Two objects have the same content checksum when they
  load as equal state dicts; one changed byte of a tensor, key, dtype or shape changes it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch

ALGORITHM = "sha256"
"""The checksum algorithm (``hashlib`` name) and the prefix of every checksum string."""
_READ_BYTES = 1 << 22


def _format(digest: Any) -> str:
    return f"{ALGORITHM}:{digest.hexdigest()}"


class HashingWriter:
    """A binary file-like object that writes to ``file`` and hashes every byte written; ``checksum()``
    is the checksum of all of them."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        """Write ``data`` (bytes-like) and add it to the checksum; the number of bytes written."""
        self._digest.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def checksum(self) -> str:
        """The checksum of the bytes written so far."""
        return _format(self._digest)


def file_checksum(path: str) -> str:
    """The checksum of the bytes of the file at ``path`` (read in blocks of 4 MiB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BYTES):
            digest.update(block)
    return _format(digest)


def content_checksum(obj: Any) -> str:
    """The checksum of ``obj``'s content: nested mappings, lists, tuples, strings, numbers, ``None``,
    tensors (a wrapper tensor subclass by its inner tensors and attributes), and other values by their type and
    ``repr`` (``torch.dtype``, ``torch.Size``...)."""
    digest = hashlib.sha256()
    _hash(obj, digest)
    return _format(digest)


def _hash(obj: Any, digest: Any) -> None:
    def tag(kind: str, text: str = "") -> None:
        data = text.encode()
        digest.update(f"{kind}{len(data)}:".encode())
        digest.update(data)

    if isinstance(obj, torch.Tensor) and hasattr(type(obj), "__tensor_flatten__"):
        # a wrapper subclass (torchao's OptimState8bit: codes, scales and map): its inner tensors and attributes
        names, attributes = obj.__tensor_flatten__()
        tag("S", f"{type(obj).__qualname__}{attributes!r}{tuple(obj.shape)}")
        for name in names:
            _hash(name, digest)
            _hash(getattr(obj, name), digest)
    elif isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
        tag("T", f"{tensor.dtype}{tuple(obj.shape)}")
        digest.update(tensor.view(torch.uint8).numpy().data if tensor.numel() else b"")
    elif isinstance(obj, Mapping):
        tag("M", str(len(obj)))
        for key, value in obj.items():
            _hash(key, digest)
            _hash(value, digest)
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        tag("L" if isinstance(obj, list) else "U", str(len(obj)))
        for item in obj:
            _hash(item, digest)
    elif isinstance(obj, str):
        tag("S", obj)
    else:  # None, bool, int, float and the small torch types torch.load(weights_only=True) gives
        tag("V", f"{type(obj).__qualname__}={obj!r}")
