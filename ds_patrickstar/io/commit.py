"""The commit of a checkpoint save: completion markers, ``latest``, fsyncs, and the checks a load
makes before it reads anything.

[Note: crash-safe save]
DeepSpeed writes ``latest`` last but not atomically, and a killed save leaves a partial tag folder,
or, when it writes into an existing tag, a folder of old and new files. So a save is a commit:
before any rank writes a file of the tag, rank 0 removes the tag's completion marker and makes that
removal durable (the folder is fsynced), then a barrier; the first rank of each host removes the
tag's rank files (:data:`RANK_FILES`: model and optimizer states, spilled states) that an earlier
save left, a barrier (so a re-save at another world size leaves no rank file of the old one: see
[Note: checkpoint manifest]); DeepSpeed saves (with ``save_latest=False``); the first rank of each
host fsyncs the tag's files, a barrier; every rank reads back its share of the files (every
``world_size``-th of the sorted listing) for their sizes and CRC-32s, rank 0 gathers them and writes
``ds_patrickstar_complete.json`` (the manifest: every file of the tag, its size and digest, with the
world size and chunk layout of the save) and then ``latest``, each by write-to-temporary, fsync,
``os.replace`` and an fsync of the folder. A load (every rank checking its share, all ranks agreeing
before any reads a file) refuses a tag without a marker, or with a listed file missing, of another
size or of another digest, naming the tag, the file and the problem, and the complete tags to load
instead. So a save that dies part way, also into an existing tag, is never loaded half old and half
new, and a file changed after its save is never loaded; ``latest`` only ever names a tag whose
marker was written (re-saving the tag ``latest`` names makes it unloadable until that save
completes: a tag per step keeps the previous checkpoint loadable throughout). Markers that list
sizes only (no digests) load with their sizes checked.

[Note: checkpoint manifest]
The marker is the manifest of what the save wrote: the tag's rank files of an earlier save are gone
before this one writes (a re-save of tag ``last`` at 2 ranks over one at 4 left ranks 2 and 3's
optimizer files of the older step in the folder, the marker listed them, and a resume at 4 ranks
restored that step's masters and moments on those ranks, with no error), so every file it lists was
written by this save, and it records the save's ``world_size`` and chunk layout (``chunk_size``,
``chunks``). A load reads only the optimizer files it lists, and takes the saved world size from it:
the listed files must be those of ranks ``0 .. world_size - 1``. A marker written before the manifest
(no ``world_size``) may list an older save's files: its world size is read from DeepSpeed's model
file (``dp_world_size``), and a tag listing another number of optimizer files is refused, naming the
files to remove or a re-save.

The digest is ``zlib.crc32``, read in blocks: it guards against torn, truncated, zeroed or
bit-flipped files, not against a deliberate forgery, and it runs several times faster than the
standard library's cryptographic hashes, so reading a save back costs a fraction of writing it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import zlib
from collections.abc import Iterable
from typing import Any

MARKER = "ds_patrickstar_complete.json"
FORMAT = "ds_patrickstar/2"  # of the optimizer files and the marker (see [Note: checkpoint format])
DIGEST = "crc32"
_BLOCK = 4 << 20

FileRecords = dict[str, dict[str, int | str]]  # file name -> {"size": bytes, "crc32": 8 hex digits}
# what a save writes per rank (DeepSpeed's model and optimizer states, the disk tier's spilled states)
RANK_FILES = ("*model_states.pt", "*optim_states.pt", "ds_patrickstar_optim_rank*_chunk*.states")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


# ---- files ------------------------------------------------------------------------
def fsync_folder(path: str) -> None:
    """Make the folder's entries (a rename, a removal) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_folder(os.path.dirname(path) or ".")


def _tag_files(folder: str) -> list[str]:
    return [
        name
        for name in sorted(os.listdir(folder))
        if name != MARKER and os.path.isfile(os.path.join(folder, name)) and ".tmp" not in name
    ]


def file_record(path: str) -> dict[str, int | str]:
    """The file's size and CRC-32 (read in blocks into one buffer)."""
    crc, size = 0, 0
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"size": size, DIGEST: f"{crc:08x}"}


def _share(names: list[str], rank: int, world_size: int) -> list[str]:
    return names[rank::world_size]


# ---- save ---------------------------------------------------------------------------
def begin_save(save_dir: str, tag: str) -> None:
    """Rank 0, before any file of the tag is written: its marker goes, durably, so that a save that
    dies part way leaves a tag that is refused on load; see [Note: crash-safe save]."""
    folder = os.path.join(save_dir, tag)
    marker = os.path.join(folder, MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        fsync_folder(folder)


def clear_rank_files(save_dir: str, tag: str) -> list[str]:
    """The first rank of each host, after :func:`begin_save` and before any file of the save is written: the
    tag's rank files an earlier save left go, durably; see [Note: checkpoint manifest]. Their names."""
    folder = os.path.join(save_dir, tag)
    if not os.path.isdir(folder):
        return []
    names = [name for name in _tag_files(folder) if any(fnmatch.fnmatch(name, p) for p in RANK_FILES)]
    for name in names:
        with contextlib.suppress(FileNotFoundError):  # another host's first rank, on shared storage
            os.remove(os.path.join(folder, name))
    if names:
        fsync_folder(folder)
    return names


def sync_saved_files(save_dir: str, tag: str) -> None:
    """The first rank of each host, after the host's part of the save: the tag's files it can see reach
    the disk (an fsync flushes what this host wrote, whichever of its processes wrote it; on storage
    shared by hosts each host flushes its own writes)."""
    folder = os.path.join(save_dir, tag)
    for name in _tag_files(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def record_files(save_dir: str, tag: str, rank: int = 0, world_size: int = 1) -> FileRecords:
    """Every rank, after every file of the tag is written: the records of this rank's share of them."""
    folder = os.path.join(save_dir, tag)
    return {name: file_record(os.path.join(folder, name)) for name in _share(_tag_files(folder), rank, world_size)}


def write_marker(
    save_dir: str, tag: str, shares: Iterable[FileRecords] | None = None, layout: dict[str, int] | None = None
) -> None:
    """Rank 0: the marker listing every file of the tag with its record, from the ranks' ``shares``
    (:func:`record_files` on every rank) or, without them, read here, and the save's ``layout``
    (``world_size``, ``chunk_size``, ``chunks``; see [Note: checkpoint manifest])."""
    folder = os.path.join(save_dir, tag)
    files: FileRecords = {}
    for share in shares if shares is not None else [record_files(save_dir, tag)]:
        files.update(share)
    unrecorded = sorted(set(_tag_files(folder)) - files.keys())
    if unrecorded:
        raise CheckpointError(
            f"checkpoint {folder!r}: no rank read back {unrecorded[:5]}; the ranks see different files in the "
            f"tag folder (save_dir must be one folder that every rank sees, or on every host the same)"
        )
    marker = {"format": FORMAT, "tag": tag, "digest": DIGEST, **(layout or {}), "files": dict(sorted(files.items()))}
    atomic_write_text(os.path.join(folder, MARKER), json.dumps(marker))


# ---- load ---------------------------------------------------------------------------
def read_marker(load_dir: str, tag: str) -> dict[str, Any]:
    """The tag's marker (checked by :func:`verify_complete` first)."""
    with open(os.path.join(load_dir, tag, MARKER)) as f:
        marker: dict[str, Any] = json.load(f)
    return marker


def listed(marker: dict[str, Any], pattern: str) -> list[str]:
    """The names of the files the marker lists that match ``pattern``, sorted."""
    return sorted(name for name in marker["files"] if fnmatch.fnmatch(name, pattern))


def resolve_tag(load_dir: str, tag: str | None) -> str:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        raise CheckpointError(
            f"no checkpoint tag given and no 'latest' file in {load_dir!r}; pass tag= "
            f"or point load_dir at a folder written by engine.save_checkpoint"
        )
    with open(latest) as f:
        return f.read().strip()


def complete_tags(load_dir: str) -> list[str]:
    """The tags in ``load_dir`` with a completion marker, the newest save first."""
    markers = {}
    for name in os.listdir(load_dir):
        marker = os.path.join(load_dir, name, MARKER)
        if os.path.isfile(marker):
            markers[name] = os.path.getmtime(marker)
    return sorted(markers, key=lambda name: -markers[name])


def _recovery(load_dir: str, tag: str) -> str:
    others = [name for name in complete_tags(load_dir) if name != tag]
    if not others:
        return "No other tag in this folder has a completion marker: resume from an earlier save elsewhere, if any."
    shown = ", ".join(repr(name) for name in others[:5])
    return (
        f"Load the previous complete tag instead: engine.load_checkpoint({load_dir!r}, tag={others[0]!r}) "
        f"(tags with a completion marker here, newest first: {shown})."
    )


def _file_problem(folder: str, name: str, saved: int | dict, read_digest: bool) -> str | None:
    path = os.path.join(folder, name)
    size = saved if isinstance(saved, int) else int(saved["size"])
    if not os.path.isfile(path):
        return f"is missing {name}"
    if os.path.getsize(path) != size:
        return (
            f"has {name} of {os.path.getsize(path)} bytes where {size} were written: it is truncated "
            f"or was modified after the save"
        )
    if read_digest and isinstance(saved, dict) and DIGEST in saved:
        found = file_record(path)[DIGEST]
        if found != saved[DIGEST]:
            return (
                f"has {name} whose {DIGEST} is {found} where {saved[DIGEST]} was written: its contents are "
                f"corrupted or were modified after the save"
            )
    return None


def verify_complete(load_dir: str, tag: str, rank: int = 0, world_size: int = 1) -> None:
    """Raise :class:`CheckpointError` unless the tag's marker lists files that are all there, of
    their sizes, and (this rank's share of them) of their digests; see [Note: crash-safe save]."""
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint tag {tag!r} does not exist in {load_dir!r}. {_recovery(load_dir, tag)}")
    marker = os.path.join(folder, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"checkpoint tag {tag!r} ({folder!r}) is incomplete or not a ds_patrickstar checkpoint: it has no "
            f"{MARKER} (a save was interrupted, or it was written by another backend). {_recovery(load_dir, tag)}"
        )
    with open(marker) as f:
        files = json.load(f)["files"]
    mine = set(_share(sorted(files), rank, world_size))
    for name, saved in files.items():
        problem = _file_problem(folder, name, saved, name in mine)
        if problem:
            raise CheckpointError(f"checkpoint tag {tag!r} ({folder!r}) {problem}. {_recovery(load_dir, tag)}")


def check_same_update(saved: str, ours: str) -> None:
    """Refuse moments saved by SGD for Adam, or Adam's for SGD (Adam and AdamW keep the same ones)."""
    if (saved == "SGD") != (ours == "SGD"):
        raise CheckpointError(
            f"the checkpoint's optimizer states were saved by {saved} and this run's optimizer is {ours}: their "
            f"states differ (see [Note: SGD on chunks]); load it with load_optimizer_states=False to take the "
            f"weights only, or use the optimizer it was saved with"
        )
