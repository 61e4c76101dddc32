"""Building chunkmem's native libraries (``csrc/``) on first use and caching them.

A library is compiled from one source file (with the files beside it that it includes) by the C++ compiler
(``$CXX``, else ``g++``, ``c++`` or ``clang++``) into a cache folder (``$CHUNKMEM_CACHE_DIR``, else
``$XDG_CACHE_HOME/chunkmem``, else ``~/.cache/chunkmem``, else a folder in the temporary directory). The file
name carries a hash of the sources, the flags and the compiler's version, so a changed source, flag or
compiler builds a new file; later processes load the cached one. Each build goes through a temporary file and
an atomic rename, so processes building at the same time never load half a file. :class:`LoadedOnce` runs a
loader at most once per process and reports a failure once, with a warning; callers decide what a failure
means (they all fall back to torch).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

CACHE_ENV = "CHUNKMEM_CACHE_DIR"
CSRC = Path(__file__).parent.parent / "csrc"

T = TypeVar("T")


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to something other than empty, 0, false, no, off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


class LoadedOnce(Generic[T]):
    """What ``load`` returns, loaded on the first :meth:`get` of the process (thread-safe); when it
    raises, ``None`` from then on, with ``warning`` (``{error}`` stands for the reason) given once and
    the reason kept in :attr:`error`."""

    def __init__(self, load: Callable[[], T], warning: str) -> None:
        self._load = load
        self._warning = warning
        self._lock = threading.Lock()
        self.value: T | None = None
        self.error: str | None = None
        self.tried = False

    def get(self, stacklevel: int = 2) -> T | None:
        """The loaded value, or ``None`` if loading failed (``stacklevel``: for the warning, counted
        from this method)."""
        if self.tried:
            return self.value
        with self._lock:
            if not self.tried:
                try:
                    self.value = self._load()
                except Exception as exc:  # noqa: BLE001 - any failure means: fall back to torch
                    self.error = f"{type(exc).__name__}: {exc}"
                    warnings.warn(self._warning.format(error=self.error), RuntimeWarning, stacklevel=stacklevel)
                self.tried = True
        return self.value

    def fresh(self) -> "LoadedOnce[T]":
        """A new, untried loader of the same thing (tests)."""
        return LoadedOnce(self._load, self._warning)


def load_library(source: Path, flags: Sequence[str], stem: str) -> tuple[ctypes.CDLL, Path, float | None]:
    """The shared library built from ``source`` with ``flags``: ``(library, its path, seconds the
    build took or None when it came from the cache)``. Raises ``RuntimeError`` when no compiler is
    found or the build fails (with the compiler's last lines)."""
    cxx = _compiler()
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = [source.read_bytes(), *(header.read_bytes() for header in _included(source)), " ".join(cxx).encode(),
             version.encode(), " ".join(flags).encode(), platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = _cache_dir()
    path = folder / f"{stem}_{key}.so"
    if path.exists():
        try:
            return ctypes.CDLL(str(path)), path, None
        except OSError:  # a damaged cache entry: build it again
            path.unlink(missing_ok=True)
    seconds = _compile(cxx, source, flags, folder, path)
    return ctypes.CDLL(str(path)), path, seconds


def _included(source: Path) -> list[Path]:
    """The files beside ``source`` that it includes with ``#include "name"`` (one level: they are part of
    the library's source, so a change in them builds a new file)."""
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.MULTILINE)
    return [source.parent / name for name in dict.fromkeys(names)]


def _compiler() -> list[str]:
    requested = os.environ.get("CXX", "").strip()
    for cmd in [shlex.split(requested)] if requested else [["g++"], ["c++"], ["clang++"]]:
        path = shutil.which(cmd[0])
        if path:
            return [path, *cmd[1:]]
    raise RuntimeError(f"C++ compiler {requested!r} (CXX) not found" if requested
                       else "no C++ compiler found (install g++, or set CXX)")


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV)
    if base:
        candidates = [Path(base)]
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        candidates = [Path(xdg) / "chunkmem" if xdg else Path.home() / ".cache" / "chunkmem"]
    candidates.append(Path(tempfile.gettempdir()) / f"chunkmem-{os.getuid() if hasattr(os, 'getuid') else 0}")
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError(f"no writable cache folder among {candidates}")


def _compile(cxx: list[str], source: Path, flags: Sequence[str], folder: Path, path: Path) -> float:
    """Compile ``source`` into ``path`` through a temporary file and an atomic rename; returns the
    seconds it took. The flags follow the source, so libraries to link come after what needs them."""
    tmp = folder / f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    start = time.perf_counter()
    try:
        proc = subprocess.run([*cxx, str(source), *flags, "-o", str(tmp)], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise RuntimeError(f"compiling {source.name} with {' '.join(cxx)} failed (exit {proc.returncode}):\n"
                               + "\n".join(tail))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return time.perf_counter() - start
