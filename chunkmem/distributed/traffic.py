"""What the training collectives move: every parameter gather and gradient reduction of a ZeRO-3 model, and
the gradient buckets of ZeRO-1/2 (:mod:`chunkmem.distributed.bucketed_reduction`), counted as it is issued.

Each count is keyed by ``(what, collective, group size)`` (``what``: ``"parameters"`` or ``"gradients"``;
``collective``: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``) and holds the calls and the
collective's buffer bytes (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor, summed
over the calls). :func:`bytes_sent` turns a buffer into what each rank sends over the network in a
bandwidth-optimal (ring) implementation: ``(p - 1) / p`` of it for an all-gather, a reduce-scatter or an
all-to-all (its input: every row but its own leaves the rank), twice that for an all-reduce. Over gloo chunkmem runs a reduce-scatter as an all-reduce and an all-gather
as broadcasts (faster there; see :mod:`chunkmem.distributed.collectives`), so gloo itself sends more; the
counts describe the collectives chunkmem asks for, which is what a model of the traffic at scale needs
(``benchmarks/comm_model.py`` predicts them and checks its figures against these counts).

Single-process groups are not counted (nothing moves). Read with :func:`traffic`, start afresh with
:func:`reset_traffic`.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

__all__ = ["TrafficCount", "bytes_sent", "count_collective", "reset_traffic", "traffic"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass
class TrafficCount:
    """Calls and buffer bytes of one kind of collective (see the module docstring)."""

    calls: int = 0
    buffer_bytes: int = 0


_counts: dict[tuple[str, str, int], TrafficCount] = {}


def count_collective(what: str, collective: str, world: int, buffer_bytes: int) -> None:
    """Count one collective over ``world`` ranks with a buffer of ``buffer_bytes`` bytes."""
    if world <= 1:
        return
    entry = _counts.setdefault((what, collective, world), TrafficCount())
    entry.calls += 1
    entry.buffer_bytes += buffer_bytes


def traffic() -> dict[tuple[str, str, int], TrafficCount]:
    """A copy of the counts since the last :func:`reset_traffic` (this process's)."""
    return {key: TrafficCount(c.calls, c.buffer_bytes) for key, c in sorted(_counts.items())}


def reset_traffic() -> None:
    """Forget every count."""
    _counts.clear()


def bytes_sent(collective: str, world: int, buffer_bytes: int | Fraction) -> Fraction:
    """Bytes each of ``world`` ranks sends for a ``collective`` over a buffer of ``buffer_bytes`` in a
    ring implementation (exact, as a fraction)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r}: expected one of {COLLECTIVES}")
    share = Fraction(buffer_bytes) * (world - 1) / world
    return 2 * share if collective == "all_reduce" else share
