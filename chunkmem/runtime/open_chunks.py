"""The chunks ``GatheredParameters`` blocks hold open, for reading or for writing: counted per chunk, since
blocks nest and several may open the same chunk (the parameter guard asks whether one is open).
"""
from __future__ import annotations

from collections import Counter

from ..core.chunk import Chunk


class OpenChunks:
    """How many blocks hold each chunk open (see the module docstring)."""

    def __init__(self) -> None:
        self._for_reading: Counter[Chunk] = Counter()
        self._for_writing: Counter[Chunk] = Counter()

    def is_open(self, chunk: Chunk, for_writing: bool) -> bool:
        return chunk in (self._for_writing if for_writing else self._for_reading)

    def open(self, chunks: list[Chunk], for_writing: bool) -> None:
        for chunk in chunks:
            self._for_reading[chunk] += 1
            if for_writing:
                self._for_writing[chunk] += 1

    def close(self, chunks: list[Chunk], for_writing: bool) -> None:
        for chunk in chunks:
            self._for_reading[chunk] -= 1
            if for_writing:
                self._for_writing[chunk] -= 1
        self._for_reading = +self._for_reading  # (drops the chunks no block holds open)
        self._for_writing = +self._for_writing
