"""Planning chunk moves for a recorded schedule: Belady's rule (evict the chunk used furthest ahead).

Pure functions over chunk indices and byte counts. With equal-size chunks the rule is optimal in the
number of fetches, so the bytes it moves are the lower bound the runtime is measured against.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

from .errors import DeviceCapacityError


@dataclass
class PeriodPlan:
    """What to do before one period: chunks to evict from the device, then chunks to fetch."""

    evict: list[int] = field(default_factory=list)
    fetch: list[int] = field(default_factory=list)
    slots: int = 0


@dataclass
class MovePlan:
    """The plan of one iteration; ``fetched_chunks`` is the number of chunk fetches it makes."""

    periods: list[PeriodPlan]
    fetched_chunks: int


def plan_moves(needed: Sequence[Sequence[int]], forced_out: Sequence[Sequence[int]], slots: Sequence[int],
               names: Sequence[str]) -> MovePlan:
    """Belady's plan for a sequence of periods.

    ``needed[i]``: chunks that must be on the device during period ``i``. ``forced_out[i]``: chunks
    that leave the device at the end of period ``i`` whatever the plan says. ``slots[i]``: how many
    chunks the device can hold during period ``i``. The device starts empty. Costs O(A log A) for A
    chunk accesses in all (each period costs its accesses and evictions, each a heap operation). Raises :class:`DeviceCapacityError` if a period needs more chunks than it
    has slots.
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
    plans: list[PeriodPlan] = []
    fetched = 0
    for i, chunks in enumerate(needed):
        need = set(chunks)
        if len(need) > slots[i]:
            raise DeviceCapacityError(
                f"period {i} ({names[i]}) needs {len(need)} chunks on the device at once but only {slots[i]} "
                f"fit there with its non-model memory; raise the device capacity or use smaller chunks")
        plan = PeriodPlan(slots=slots[i])
        missing = need - resident
        occupied = len(resident) + len(missing)
        while occupied > slots[i]:
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
        plans.append(plan)
    return MovePlan(plans, fetched)
