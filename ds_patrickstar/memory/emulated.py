"""The accelerator's strict CPU twin.

[Note: strict emulated accelerator]
``emulate_accelerator: true`` runs placement on a CPU-only machine against
:class:`EmulatedAccelerator`, built to fail where a GPU would misbehave:

* **Copies are asynchronous.** :meth:`Accelerator.copy` only *enqueues* a copy on the
  emulated copy stream and fills the destination with poison (NaN) at once. The values
  arrive when the copy's :class:`Pending` is waited on (which also completes every copy
  enqueued before it, as a stream would). A consumer that reads, writes, reduces, norms,
  updates or all-gathers a buffer without waiting on its pending copy sees NaN, and the
  numbers change. A source freed (storage released) or overwritten before its copy
  completes raises :class:`CopyHazard`.
* **Every accelerator byte is counted.** Each allocation the backend makes on the
  accelerator (chunk payloads, gathered copies, gradient accumulators, optimizer states,
  temporaries of ``state_dict`` and checkpoints) is charged to the :class:`DeviceLedger`
  with a name; one past the budget raises
  :class:`~ds_patrickstar.memory.ledger.DeviceBudgetExceeded` naming it.

The CUDA counterpart is :mod:`~ds_patrickstar.memory.cuda`.
"""

from __future__ import annotations

from collections import deque

import torch

from .accelerator import Accelerator, Pending


class CopyHazard(RuntimeError):
    """A buffer was freed or overwritten while an asynchronous copy still read it."""


class _EmulatedCopy(Pending):
    def __init__(self, stream: EmulatedAccelerator, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream = stream
        self.dst, self.src = dst, src
        self.src_version = src._version
        self.src_bytes = src.untyped_storage().nbytes()
        self.src_ptr = src.untyped_storage().data_ptr()
        self.completed = False

    def wait(self) -> None:
        self.stream.complete_through(self)

    def done(self) -> bool:
        return self.completed

    def run(self) -> None:
        storage = self.src.untyped_storage()
        if storage.nbytes() != self.src_bytes or storage.data_ptr() != self.src_ptr:
            raise CopyHazard(
                f"emulated accelerator: the source of a pending copy ({self.src.numel()} elements, "
                f"{self.src.dtype}) was freed before the copy completed; free it with "
                f"Accelerator.free(..., after=pending)"
            )
        if self.src._version != self.src_version:
            raise CopyHazard(
                f"emulated accelerator: the source of a pending copy ({self.src.numel()} elements, "
                f"{self.src.dtype}) was overwritten before the copy completed; wait on the copy first"
            )
        self.dst.copy_(self.src)
        self.completed = True


class EmulatedAccelerator(Accelerator):
    """The accelerator's CPU twin; see [Note: strict emulated accelerator]."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.device = torch.device("cpu")
        self._queue: deque[_EmulatedCopy] = deque()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Pending:
        pending = _EmulatedCopy(self, dst, src)
        with torch.no_grad():
            if dst.is_floating_point():
                dst.fill_(float("nan"))  # poison until the copy completes
            else:
                dst.fill_(-1)
        self._queue.append(pending)
        return pending

    def complete_through(self, pending: _EmulatedCopy) -> None:
        """Complete every queued copy up to and including ``pending`` (stream order)."""
        while not pending.completed:
            head = self._queue.popleft()
            head.run()
            # a later copy that reads what this one wrote sees the written values as its source
            written = head.dst.untyped_storage().data_ptr()
            for later in self._queue:
                if later.src.untyped_storage().data_ptr() == written:
                    later.src_version = later.src._version
