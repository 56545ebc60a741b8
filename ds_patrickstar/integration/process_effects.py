"""What a run changes outside its own objects, recorded in one place and undone at its end.

[Note: process-wide effects]
A "patrickstar" run changes some things that belong to the whole process. Each engine owns a
:class:`RunEffects`: everything of the run's own that outlives an object is recorded there as it is
made, with how to undo it, and undone in reverse order at ``engine.destroy()`` and when initialize rolls
back (see [Note: initialize as a transaction]), each undo even where one before it raised (logged):

* the disk tier's mmap threshold (see [Note: host heap]): the run's hold is released, and the threshold
  is what other holders want, else :data:`~ds_patrickstar.memory.host_heap.DYNAMIC_CEILING`;
* the marks that keep Hugging Face's ``generate`` ranks together (see [Note: generation in step]);
* side process groups a part of the run creates register their destruction here.

Some effects stay for the process's life, on purpose, each a no-op for every other ZeRO stage; they are
listed in :data:`KEPT` (and README's limits):

* the wrappers installed by ``import ds_patrickstar`` (see [Note: registration]): ``deepspeed.initialize``,
  DeepSpeed's ``clone_tensors_for_torch_save``, ``deepspeed.checkpointing.configure`` and Hugging Face's
  ``deepspeed_init``; and the autoload hook, which imports the package in processes that import DeepSpeed;
* the exit wait for gloo's worker threads (see [Note: gloo workers idle at exit]), registered once:
  the process groups it protects outlive the engine;
* accelerate's ``zero_stage`` of a "patrickstar" plugin, which reads as the same string (see
  [Note: accelerate's zero_stage]);
* the mmap threshold itself, once set: glibc cannot go back to its rising rule (see [Note: host heap]).

A lock on a swap folder is the disk tier's (released at destroy, see [Note: swap folder lock]); forked
children close their copy of its descriptor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

KEPT = (
    "deepspeed.initialize wrapped (import ds_patrickstar)",
    "deepspeed's clone_tensors_for_torch_save wrapped (import ds_patrickstar)",
    "deepspeed.checkpointing.configure wrapped (import ds_patrickstar)",
    "transformers' deepspeed_init wrapped (import ds_patrickstar)",
    "the autoload import hook (ds_patrickstar_autoload.pth; DS_PATRICKSTAR_AUTOLOAD=0 turns it off)",
    "an exit handler that waits for gloo's worker threads (first initialize)",
    "accelerate's DeepSpeedPlugin.zero_stage as StageName (first initialize)",
    "glibc's mmap threshold fixed (first initialize or Init block; glibc cannot restore its rising rule)",
)
"""What stays for the process's life; see [Note: process-wide effects]."""


class RunEffects:
    """One run's process-wide effects and how to undo each; see [Note: process-wide effects]."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def record(self, name: str, undo: Callable[[], None]) -> None:
        """``name`` is in effect until :meth:`undo_all` calls ``undo``."""
        self._undo.append((name, undo))

    def active(self) -> list[str]:
        """The names of the effects in effect now, oldest first."""
        return [name for name, _ in self._undo]

    def undo_all(self) -> None:
        """Undo every effect, newest first, each even where one before it raised (logged); again: nothing."""
        while self._undo:
            name, undo = self._undo.pop()
            try:
                undo()
            except Exception:
                logger.exception("ds_patrickstar: undoing %s failed", name)
