"""What every asynchronous operation hands back: :class:`Pending` (a copy, a collective, a disk
request), and :class:`CopyHazard`, the error of using a buffer before its operation was waited on.
A module of its own so that the accelerators, the host pool, the collectives and the disk tier's
I/O share them without importing each other."""

from __future__ import annotations


class CopyHazard(RuntimeError):
    """A buffer was freed or overwritten while an asynchronous copy still read it."""


class Pending:
    """An enqueued copy (or a collective, see groups/comm.py; a disk request, disk/io.py). :meth:`wait`
    makes its destination safe to use for the caller; :meth:`wait_host` blocks the host until the copy
    has run."""

    collective = False  # a collective in flight: its chunks must not move before it is waited on
    host_work = False  # a host job (memory/host_work.py): its chunk's values must not be copied before it ran

    def wait(self) -> None:
        raise NotImplementedError

    def wait_host(self) -> None:
        self.wait()

    def done(self) -> bool:
        raise NotImplementedError

    def cancel(self) -> bool:
        """Whether the operation will not run (only a host job not started can be cancelled)."""
        return False

    def finished(self) -> bool:
        """Whether :meth:`wait` would return at once (the operation has run; it may not be waited on yet)."""
        return self.done()
