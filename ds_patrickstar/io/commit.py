"""The commit of a checkpoint save: completion markers, ``latest``, fsyncs, and the checks a load
makes before it reads anything.

[Note: crash-safe save]
DeepSpeed writes ``latest`` last but not atomically, and a killed save leaves a partial tag
folder, or, when it writes into an existing tag, a folder of old and new files. So a save is a
commit: before any rank writes a file of the tag, rank 0 removes the tag's completion marker and
makes that removal durable (the folder is fsynced), then a barrier; DeepSpeed saves (with
``save_latest=False``); the first rank of each host fsyncs the tag's files, a barrier, and rank 0 writes
``ds_patrickstar_complete.json`` (every file of the tag and its size) and then ``latest``, each by
write-to-temporary, fsync, ``os.replace`` and an fsync of the folder. A tag without a valid marker
is refused on load with a message naming what is missing, so a save that dies part way, also
into an existing tag, is never loaded half old and half new; ``latest`` only ever names a tag
whose marker was written (re-saving the tag ``latest`` names makes it unloadable until that save
completes: a tag per step keeps the previous checkpoint loadable throughout).
"""

from __future__ import annotations

import json
import os

MARKER = "ds_patrickstar_complete.json"
FORMAT = "ds_patrickstar/2"  # of the optimizer files and the marker (see [Note: checkpoint format])


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


def begin_save(save_dir: str, tag: str) -> None:
    """Rank 0, before any file of the tag is written: its marker goes, durably, so that a save that
    dies part way leaves a tag that is refused on load; see [Note: crash-safe save]."""
    folder = os.path.join(save_dir, tag)
    marker = os.path.join(folder, MARKER)
    if os.path.exists(marker):
        os.remove(marker)
        fsync_folder(folder)


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


def write_marker(save_dir: str, tag: str) -> None:
    folder = os.path.join(save_dir, tag)
    files = {name: os.path.getsize(os.path.join(folder, name)) for name in _tag_files(folder)}
    atomic_write_text(os.path.join(folder, MARKER), json.dumps({"format": FORMAT, "tag": tag, "files": files}))


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


def verify_complete(load_dir: str, tag: str) -> None:
    """Raise :class:`CheckpointError` unless the tag's marker lists files that are all there, whole."""
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint tag {tag!r} does not exist in {load_dir!r}")
    marker = os.path.join(folder, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"checkpoint {folder!r} is incomplete or not a ds_patrickstar checkpoint: it has no "
            f"{MARKER} (a save was interrupted, or it was written by another backend). "
            f"Load an earlier tag."
        )
    with open(marker) as f:
        files = json.load(f)["files"]
    for name, size in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {folder!r} is missing {name}")
        if os.path.getsize(path) != size:
            raise CheckpointError(
                f"checkpoint file {path!r} has {os.path.getsize(path)} bytes, {size} were "
                f"written: it is truncated or was modified"
            )
