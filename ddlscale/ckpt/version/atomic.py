"""Crash-safe file writes for checkpoints, optionally paced to a storage bandwidth.

A file appears under its final name only complete and on disk: it is written to a temporary name in
the same directory, flushed and fsynced, renamed over the final name (atomic on POSIX), and the
directory is fsynced so the rename itself survives a power loss. A crash leaves at most a stray
temporary file, which readers never look at (see :func:`is_temporary`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ddlscale import clock

_TMP_MARK = ".tmp-"
_CHUNK = 1 << 20


def is_temporary(path: Path) -> bool:
    return path.name.startswith(".") and _TMP_MARK in path.name


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, bandwidth_bps: float | None = None) -> None:
    """Write ``data`` to ``path`` all or nothing, readable by this user only (0600); at most
    ``bandwidth_bps`` bits/s when given.

    Pacing emulates remote storage on a local disk: each chunk waits until the bytes written so far
    would have crossed a link of that rate.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    start = clock.now()
    try:
        tmp.unlink(missing_ok=True)  # a stray one of an earlier crash of this pid; never followed if a link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as file:
            view = memoryview(data)
            chunk = _CHUNK if not bandwidth_bps else max(4096, min(_CHUNK, int(bandwidth_bps / 8 / 20)))
            for offset in range(0, len(view), chunk):
                file.write(view[offset : offset + chunk])
                if bandwidth_bps:
                    due = start + (offset + len(view[offset : offset + chunk])) * 8 / bandwidth_bps
                    delay = due - clock.now()
                    if delay > 0:
                        clock.sleep(delay)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def pace(nbytes: int, bandwidth_bps: float | None, since: float) -> None:
    """Sleep until ``nbytes`` moved since ``since`` would have crossed a ``bandwidth_bps`` link (reads
    from emulated remote storage)."""
    if bandwidth_bps:
        delay = since + nbytes * 8 / bandwidth_bps - clock.now()
        if delay > 0:
            clock.sleep(delay)
