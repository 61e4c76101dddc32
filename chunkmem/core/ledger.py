"""Exact byte accounting per tier and per state family, with the device tier's capacity enforced."""
from __future__ import annotations

from collections import defaultdict

from ..errors import DeviceCapacityError, HostCapacityError, LedgerError
from .tiers import Tier


class TierLedger:
    """Counts the bytes of every chunk buffer allocated on each tier, per state family.

    ``capacity`` (bytes) bounds what chunk buffers may occupy on the device tier; an allocation past it
    raises :class:`DeviceCapacityError` before anything is allocated. ``host_capacity`` (bytes, or
    ``None`` for no bound) does the same for the host tier with :class:`HostCapacityError`. Bytes on the
    disk tier are the chunk buffers' own sizes (the files' sizes, with alignment and the spare copies of
    an atomic step, are :attr:`~chunkmem.core.disk_tier.DiskTier.file_bytes`). It only counts: the
    memory itself comes from :class:`~chunkmem.core.memory.TierMemory`.
    """

    def __init__(self, capacity: int, host_capacity: int | None = None) -> None:
        self.capacity = capacity
        self.host_capacity = host_capacity
        self._bytes: dict[tuple[Tier, str], int] = defaultdict(int)
        self._totals: dict[Tier, int] = defaultdict(int)  # per tier, kept with _bytes (read every period)
        self.peak_device_bytes = 0
        self.peak_host_bytes = 0  # the most bytes on the host tier at once (what a host capacity must allow)
        self.moved_to_device = 0
        self.moved_to_host = 0
        self.read_from_disk = 0
        self.written_to_disk = 0
        self.context = ""

    def reserve(self, tier: Tier, family: str, nbytes: int, what: str) -> None:
        """Account ``nbytes`` more on ``tier`` for ``family``; refuse past the device or host capacity."""
        if tier is Tier.DEVICE:
            self._check_room(tier, self.capacity, nbytes, what, DeviceCapacityError, "set_device_memory_capacity",
                             "CHUNKMEM_DEVICE_MEMORY", "on the host")
            self.peak_device_bytes = max(self.peak_device_bytes, self.tier_bytes(Tier.DEVICE) + nbytes)
        elif tier is Tier.HOST and self.host_capacity is not None:
            self._check_room(tier, self.host_capacity, nbytes, what, HostCapacityError, "set_host_memory_capacity",
                             "CHUNKMEM_HOST_MEMORY", "on the disk tier")
        self._bytes[(tier, family)] += nbytes
        self._totals[tier] += nbytes
        if tier is Tier.HOST:
            self.peak_host_bytes = max(self.peak_host_bytes, self._totals[tier])

    def _check_room(self, tier: Tier, capacity: int, nbytes: int, what: str, error: type[Exception], setter: str,
                    variable: str, elsewhere: str) -> None:
        used = self.tier_bytes(tier)
        if used + nbytes > capacity:
            where = f" during {self.context}" if self.context else ""
            raise error(f"{tier.value} tier full{where}: {what} needs {nbytes} bytes, {used} of the capacity of "
                        f"{capacity} bytes are in use (set chunkmem.{setter} or {variable} higher, or rest more "
                        f"state {elsewhere})")

    def count_move(self, destination: Tier, nbytes: int) -> None:
        """Count ``nbytes`` copied between the device and the host, towards ``destination``."""
        if destination is Tier.DEVICE:
            self.moved_to_device += nbytes
        else:
            self.moved_to_host += nbytes

    def count_disk(self, read: int = 0, written: int = 0) -> None:
        """Count bytes read from and written to the disk tier's files."""
        self.read_from_disk += read
        self.written_to_disk += written

    def release(self, tier: Tier, family: str, nbytes: int) -> None:
        """Account ``nbytes`` fewer on ``tier`` for ``family``."""
        if self._bytes[(tier, family)] < nbytes:
            raise LedgerError(f"internal error: releasing {nbytes} bytes of {family} on the {tier.value} tier, "
                              f"which holds only {self._bytes[(tier, family)]} ({self.context or 'no period'})")
        self._bytes[(tier, family)] -= nbytes
        self._totals[tier] -= nbytes

    def tier_bytes(self, tier: Tier, families: tuple[str, ...] | None = None) -> int:
        """Bytes on ``tier``, over all families or only those named."""
        if families is None:
            return self._totals[tier]
        return sum(n for (t, f), n in self._bytes.items() if t is tier and f in families)

    def breakdown(self, with_disk: bool = False) -> dict[str, dict[str, int]]:
        """``{tier: {family: bytes}}`` for every family with bytes on a tier (the ``"disk"`` tier is listed
        when ``with_disk``: the model has one)."""
        tiers = [t for t in Tier if t is not Tier.DISK or with_disk]
        out: dict[str, dict[str, int]] = {t.value: {} for t in tiers}
        for (tier, family), n in sorted(self._bytes.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
            if n:
                out[tier.value][family] = n
        return out
