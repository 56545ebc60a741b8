"""The device ledger: running totals of the bytes the backend holds on the accelerator, under a budget."""

from __future__ import annotations


class DeviceBudgetExceeded(RuntimeError):
    """Model data plus non-model memory would not fit the accelerator budget."""


class DeviceLedger:
    """Running totals of the bytes the backend holds on the accelerator, by kind, under a budget.
    A charge fails when it would not fit beside ``non_model`` (the activation tide, kept current
    by the placement runtime)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.by_kind: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self._interval_peak = 0  # highest total since the last interval_peak() call
        self.non_model = 0  # non-model bytes now, kept current by the placement runtime

    def charge(self, nbytes: int, kind: str, what: str) -> None:
        if self.total + nbytes + self.non_model > self.budget:
            raise DeviceBudgetExceeded(
                f"allocating {what} ({nbytes:,} B, {kind}) on the accelerator would exceed its budget of "
                f"{self.budget:,} B: the backend holds {self.total:,} B ({self._kinds()}) next to "
                f"{self.non_model:,} B of non-model memory. Raise zero_optimization.device_budget or lower "
                f"chunk_size."
            )
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
        self.total += nbytes
        self.peak = max(self.peak, self.total)
        self._interval_peak = max(self._interval_peak, self.total)

    def release(self, nbytes: int, kind: str) -> None:
        held = self.by_kind.get(kind, 0)
        if nbytes > held:
            raise RuntimeError(f"device ledger: releasing {nbytes} B of {kind} but only {held} B are held")
        self.by_kind[kind] = held - nbytes
        self.total -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.total

    def interval_peak(self) -> int:
        """The highest total since the previous call (paired with the allocator's peak, see placement/tracer.py)."""
        peak, self._interval_peak = self._interval_peak, self.total
        return peak

    def _kinds(self) -> str:
        return ", ".join(f"{k} {v:,} B" for k, v in sorted(self.by_kind.items()) if v) or "nothing"
