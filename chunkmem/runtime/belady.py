"""Planning chunk moves for a recorded schedule: Belady's rule (evict the chunk used furthest ahead).

Pure functions over chunk indices and byte counts. With equal-size chunks the rule is optimal in the
number of fetches, so the bytes it moves are the lower bound the runtime is measured against.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence



@dataclass
class PeriodMoves:
    """What to do before one period: chunks to evict from the device, then chunks to fetch.
    ``fallback``: the period needs more chunks than its slots, so it runs as under ``cpu`` placement:
    every chunk it does not need is evicted first, and its own are evicted after it."""

    evict: list[int] = field(default_factory=list)
    fetch: list[int] = field(default_factory=list)
    slots: int = 0
    fallback: bool = False


@dataclass
class MoveSchedule:
    """The plan of one iteration; ``fetched_chunks`` is the number of chunk fetches it makes."""

    periods: list[PeriodMoves]
    fetched_chunks: int


def belady_moves(needed: Sequence[Sequence[int]], forced_out: Sequence[Sequence[int]], slots: Sequence[int],
               names: Sequence[str]) -> MoveSchedule:
    """Belady's plan for a sequence of periods.

    ``needed[i]``: chunks that must be on the device during period ``i``. ``forced_out[i]``: chunks
    that leave the device at the end of period ``i`` whatever the plan says. ``slots[i]``: how many
    chunks the device can hold during period ``i``. The device starts empty. Costs O(A log A) for A
    chunk accesses in all (each period costs its accesses and evictions, each a heap operation).

    A period that needs more chunks than it has slots (its non-model memory leaves too little room for
    the plan) is planned as ``cpu`` placement runs it: every resident chunk it does not need is evicted
    before it, its chunks are fetched, and they leave the device after it (``fallback``). Whether the
    chunks alone fit the device is the ledger's to check when they are fetched, as under ``cpu``.
    """
    uses: dict[int, list[int]] = {}
    for i, chunks in enumerate(needed):
        for c in chunks:
            uses.setdefault(c, []).append(i)
    never = len(needed)

    def next_use(c: int, i: int) -> int:
        positions = uses[c]
        k = bisect_right(positions, i)
        return positions[k] if k < len(positions) else never

    resident: set[int] = set()
    heap: list[tuple[int, int]] = []  # (-next use, chunk), stale entries skipped lazily
    stamp: dict[int, int] = {}
    plans: list[PeriodMoves] = []
    fetched = 0
    carry_out: set[int] = set()
    for i, chunks in enumerate(needed):
        need = set(chunks)
        plan = PeriodMoves(slots=slots[i], fallback=len(need) > slots[i])
        if carry_out:  # the chunks of a fallback period leave unless this one needs them
            plan.evict = sorted(carry_out - need)
            resident -= carry_out - need
            carry_out = set()
        missing = need - resident
        if plan.fallback:
            plan.evict += sorted(resident - need)
            resident &= need
        occupied = len(resident) + len(missing)
        while occupied > slots[i] and not plan.fallback:
            while True:
                neg_next, c = heapq.heappop(heap)
                if c in resident and stamp[c] == -neg_next and c not in need:
                    break
            resident.discard(c)
            plan.evict.append(c)
            occupied -= 1
        for c in sorted(missing):
            plan.fetch.append(c)
            fetched += 1
        for c in need:
            resident.add(c)
            stamp[c] = next_use(c, i)
            heapq.heappush(heap, (-stamp[c], c))
        for c in forced_out[i]:
            resident.discard(c)
        if plan.fallback:
            carry_out = set(resident)
        plans.append(plan)
    return MoveSchedule(plans, fetched)
