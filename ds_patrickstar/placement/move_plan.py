"""The bytes one iteration moves, moment by moment, as the move model predicts them (see [Note: predicted moves] in
move_model.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MovePlan:
    """Bytes to the accelerator and back at each moment of one iteration: chunk payloads (``to_device``,
    ``to_host``) and, with gradient accumulation, the fp32 accumulators that move with them (``acc_to_device``,
    ``acc_to_host``; None: none); ``demand``: of both, the bytes brought for the moment's own use (not ahead of
    it); ``ahead``: the rest, per moment as ``(target moment, bytes)`` in the order they were brought (None: all
    of it for the next moment)."""

    to_device: list[int]
    to_host: list[int]
    demand: list[int]
    ahead: list[list[tuple[int, int]]] | None = None
    acc_to_device: list[int] | None = None
    acc_to_host: list[int] | None = None
    over_budget: bool = False  # some moment's chunks did not fit beside the tide: the driver would refuse or give way

    def evicted(self, moment: int) -> int:
        """Bytes sent to the host at ``moment``, accumulators included."""
        return self.to_host[moment] + (self.acc_to_host[moment] if self.acc_to_host is not None else 0)

    @property
    def accumulator_bytes_to_device(self) -> int:
        return sum(self.acc_to_device) if self.acc_to_device is not None else 0

    @property
    def accumulator_bytes_to_host(self) -> int:
        return sum(self.acc_to_host) if self.acc_to_host is not None else 0

    @property
    def moved(self) -> int:
        """Every byte copied each way, accumulators included."""
        return (
            self.bytes_to_device
            + self.bytes_to_host
            + self.accumulator_bytes_to_device
            + self.accumulator_bytes_to_host
        )

    def brought_ahead(self, moment: int) -> list[tuple[int, int]]:
        """``(target moment, bytes)`` brought ahead at ``moment``."""
        if self.ahead is not None:
            return self.ahead[moment]
        early = self.to_device[moment] - self.demand[moment]
        return [(moment + 1, early)] if early else []

    @property
    def bytes_to_device(self) -> int:
        return sum(self.to_device)

    @property
    def bytes_to_host(self) -> int:
        return sum(self.to_host)
