"""Stopping a run on SIGINT, SIGTERM, SIGHUP or SIGUSR1: every process it started stops too, within seconds.

SIGUSR1 is SLURM's warning before a time limit or a preemption (``sbatch --signal=USR1@<seconds>``, sent
to every task; ``B:USR1`` to the batch shell alone, which must pass it on): handled as SIGTERM is, so the
run stops and persists what it has within the grace time that signal leaves, instead of being killed
at its end.

*Launcher side* (:func:`stop_on_signals`, around everything the launching process does): the first
such signal asks every process below the launcher to stop (SIGTERM) at once and raises
:class:`StopRequested` in the launcher, so its ``finally`` blocks run; on the way out
:func:`stop_processes` waits up to ``grace_s`` for them and kills what is left. Processes are
found through ``/proc`` (parent links), so this holds whatever started them: Lightning's spawn
launcher, torchrun agents and their workers, ``ip netns exec`` on emulated machines, checkpoint
agents. Without it, a SIGTERM (what ``timeout``, schedulers and ``kill`` send) kills the launcher
alone and its spawned workers train on, orphaned.

A service that must outlive the workers for a while (Gemini's replica agents hold the version the
launcher writes to disk on the way out) is :func:`spared` from that first fan-out: its owner stops it
in its own ``finally``, and whatever it leaves is stopped with the rest at the end.

*Worker side* (:func:`raise_on_signals`): a worker turns the same signals into StopRequested at
once, so the trainer's callbacks see an interrupted run and write what they have. It replaces
Lightning's SIGTERM handler for the training loop: that one broadcasts from inside the handler, a
collective the other ranks never issue, and the worker hangs until the collective timeout. Under
SLURM it also replaces Lightning's SIGUSR1 handler, which would save a pickled checkpoint and requeue.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
GRACE_S = 5.0  # what workers get to write their summary and leave before they are killed

_received: int | None = None  # the first stop signal this process got
_spared: dict[int, int] = {}  # pid -> start time: services their owner stops itself (see spared)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived. A KeyboardInterrupt, so code that handles Ctrl-C handles it alike
    (torch.multiprocessing's workers exit quietly, Lightning runs its interrupt path)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def received() -> str | None:
    """The name of the first stop signal this process received (``"SIGTERM"``), or None."""
    return None if _received is None else signal.Signals(_received).name


def _record(signum: int) -> bool:
    """Remember the first stop signal; False for any later one (already stopping)."""
    global _received
    if _received is not None:
        return False
    _received = signum
    return True


def _install(handler: Callable[[int, Any], None]) -> Callable[[], None]:
    """Install ``handler`` for the stop signals (forgetting any signal received before); return
    what puts the previous handlers back."""
    global _received
    if threading.current_thread() is not threading.main_thread():  # signal handlers live there only
        return lambda: None
    _received = None
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)

    def restore() -> None:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)

    return restore


def raise_on_signals() -> Callable[[], None]:
    """Worker: the first stop signal raises StopRequested in the main thread, later ones are ignored
    (the launcher kills a worker that does not finish in time). Returns the restoring function."""

    def on_signal(signum: int, frame: Any) -> None:
        if _record(signum):
            raise StopRequested(signum)

    return _install(on_signal)


@contextlib.contextmanager
def spared(pid: int) -> Iterator[None]:
    """Within the block, the first stop signal's fan-out leaves process ``pid`` and everything below
    it alone: its owner stops it when the block's ``finally`` runs."""
    started = start_time(pid)
    if started is not None:
        _spared[pid] = started
    try:
        yield
    finally:
        _spared.pop(pid, None)


def _spared_now() -> set[int]:
    """The spared processes still alive, and every process below them."""
    alive = [pid for pid, started in list(_spared.items()) if start_time(pid) == started]
    found = set(alive)
    for pid in alive:
        found.update(descendants(pid))
    return found


@contextlib.contextmanager
def stop_on_signals(grace_s: float = GRACE_S) -> Iterator[None]:
    """Launcher: see the module doc. Leaving with any exception also stops what is left of the
    processes started inside the block (never those that were there before it)."""
    before = descendants()

    def started_here() -> dict[int, int]:
        return {pid: t for pid, t in descendants().items() if before.get(pid) != t and not _ends_with_us(pid)}

    def on_signal(signum: int, frame: Any) -> None:
        if _record(signum):
            keep = _spared_now()
            for pid, started in started_here().items():  # they stop while this process unwinds
                if pid not in keep:
                    _send(pid, started, signal.SIGTERM)
            raise StopRequested(signum)

    restore = _install(on_signal)
    try:
        yield
    except BaseException:
        stop_processes(started_here, grace_s)
        raise
    finally:
        restore()


# -- processes below this one ---------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of a live process, None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    state, ppid, start = fields[0], int(fields[1]), int(fields[19])
    return None if state in ("Z", "X") else (ppid, state, start)


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, a process's identity."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def _ends_with_us(pid: int) -> bool:
    """multiprocessing's resource tracker: it ignores SIGTERM and exits when this process does, and
    killing it first makes this process's own clean-up at exit fail (it starts another one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def descendants(pid: int | None = None) -> dict[int, int]:
    """Every live process below ``pid`` (default: this one), as pid -> start time."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append((int(entry), stat[2]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child, started in children.get(todo.pop(), []):
            if child not in found:
                found[child] = started
                todo.append(child)
    return found


def _send(pid: int, started: int, signum: int) -> None:
    if start_time(pid) == started:  # not a recycled pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def stop_processes(find: Callable[[], dict[int, int]] = descendants, grace_s: float = GRACE_S,
                   poll_s: float = 0.1) -> list[int]:
    """Ask the processes ``find()`` returns (pid -> start time; default: every one below this) to stop
    (SIGTERM), wait up to ``grace_s`` seconds, kill the rest (SIGKILL). Returns the pids that had to
    be killed. Processes that lose their parent while stopping stay tracked: they were found first."""
    tracked = find()
    for pid, started in tracked.items():
        _send(pid, started, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        tracked.update(find())
        alive = {pid: started for pid, started in tracked.items() if start_time(pid) == started}
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    for pid, started in alive.items():
        _send(pid, started, signal.SIGKILL)
    return sorted(alive)
