"""``train.log``: what a run prints — its launcher's output and every worker's — kept in its directory.

The launching process's stdout and stderr (file descriptors 1 and 2, which the processes it starts
inherit) go through pipes; a thread per stream copies them to where they went before and to the
log. Progress bars redraw a line with carriage returns: the log keeps each line's last state.
Python-level redirection would miss the workers, and Hydra's own log file holds only ``logging``
records, which neither Lightning's messages nor the workers' output are.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

ENV = "DDLSCALE_RUN_LOG"  # set while a process's output is being kept: its children keep none of their own
CHUNK = 1 << 16
QUIET_S = 0.2  # at the end, what is left in the pipes is copied until they are this long quiet


def _last_state(line: bytes) -> bytes:
    """What a line redrawn with carriage returns finally shows."""
    return next((part for part in reversed(line.split(b"\r")) if part), b"")


def _copy(source: int, terminal: int, log: BinaryIO, lock: threading.Lock, closing: threading.Event) -> None:
    """Copy ``source`` to ``terminal`` and the log until it ends — or, once ``closing`` is set, until
    it has been quiet for ``QUIET_S``: a process that outlives the run (multiprocessing's resource
    tracker ends with this process) keeps the pipe open, and no end would come."""
    line = b""  # the line being written, for the log
    try:
        while True:
            # Never a blocking read: one that began just before ``closing`` was set would wait for
            # the straggler forever (and the launcher with it, joining this thread).
            if not select.select([source], [], [], QUIET_S)[0]:
                if closing.is_set():
                    break
                continue
            chunk = os.read(source, CHUNK)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:  # a pipe or terminal may take part of a write
                view = view[os.write(terminal, view):]
            *done, line = (line + chunk).split(b"\n")
            if done:
                with lock:
                    log.write(b"".join(_last_state(d) + b"\n" for d in done))
                    log.flush()
            line = _last_state(line) + (b"\r" if line.endswith(b"\r") else b"")  # bounded while a bar redraws
        with lock:
            log.write(_last_state(line))
    except (OSError, ValueError):  # the log or terminal closed under a straggler: nothing left to keep
        pass
    finally:
        os.close(source)


@contextlib.contextmanager
def run_log(path: str | Path) -> Iterator[None]:
    """Keep everything this process and the processes it starts print in ``path`` too (appended)."""
    if os.environ.get(ENV):  # a launcher above keeps this process's output already
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved_env = {key: os.environ.get(key) for key in (ENV, "PYTHONUNBUFFERED")}
    # Workers' prints arrive as they happen (a pipe would make their stdout block-buffered).
    os.environ.update({ENV: str(path), "PYTHONUNBUFFERED": "1"})
    lock, closing = threading.Lock(), threading.Event()
    copies: list[tuple[int, int, threading.Thread]] = []
    with open(path, "ab") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            read_end, write_end = os.pipe()
            terminal = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=_copy, args=(read_end, terminal, log, lock, closing), daemon=True,
                                      name=f"ddlscale-run-log-{fd}")
            thread.start()
            copies.append((fd, terminal, thread))
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, terminal, _ in copies:
                os.dup2(terminal, fd)  # drops this process's end of the pipe
            closing.set()
            for _, terminal, thread in copies:
                thread.join()
                os.close(terminal)
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
