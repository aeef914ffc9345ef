"""The run's clock: every span ddlscale measures, waits for or reports, in emulated seconds.

On a time-dilated emulated cluster (``cluster.dilation`` = k, :mod:`ddlscale.cluster.dilation`)
every NIC runs at 1/k of its bandwidth with k times its delay, every machine's CPU is capped at 1/k
of a core per rank, and device time idles k times longer: the emulation runs k times slower than the
cluster it stands for, in every respect. Dividing each measured span by k gives the time that cluster
would see; multiplying each wait by k keeps a wait in step with the work it waits for. Outside such an
emulation k is 1 and :func:`now` is ``time.perf_counter``.

The launcher of an emulated cluster hands k to every process it starts through ``$DDLSCALE_DILATION``;
each process reads it once. Code that manages processes (teardown grace periods, process start times)
keeps the host's own clock: those spans belong to the host, not to the emulated cluster.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

ENV = "DDLSCALE_DILATION"

_factor: float | None = None


def parse_factor(value: object, key: str = ENV) -> float:
    """A dilation factor: a finite number >= 1."""
    try:
        factor = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        factor = math.nan
    if isinstance(value, bool) or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"{key} must be a number >= 1, got {value!r}")
    return factor


def dilation() -> float:
    """This process's k (1 unless an emulated cluster's launcher set ``$DDLSCALE_DILATION``).

    Read once; on the first read a dilated process also stretches the interpreter's own timer
    (:func:`dilate_interpreter`)."""
    global _factor
    if _factor is None:
        raw = os.environ.get(ENV)
        _factor = 1.0 if raw in (None, "") else parse_factor(raw)
        if _factor > 1:
            dilate_interpreter(_factor)
    return _factor


SWITCH_INTERVAL_S = 0.005  # CPython's default: a thread waiting for the GIL asks for it after this long


def dilate_interpreter(k: float) -> None:
    """CPython hands the GIL to a waiting thread only after the switch interval, a span of wall time. A
    sparse sync's lane thread waits so for the training thread (measured: Zen's sync on 2 machines took
    about the same wall time at k = 2, 4 and 8, so its reported time fell by k). On the emulated machine
    that interval is CPython's default in emulated time: k times longer here."""
    sys.setswitchinterval(SWITCH_INTERVAL_S * k)


def now() -> float:
    """Seconds of emulated time on a monotonic clock shared by every process on this host."""
    return time.perf_counter() / dilation()


def timestamp() -> float:
    """Unix time / k: for spans between processes (a restart's gap); only differences mean anything."""
    return time.time() / dilation()


def sleep(seconds: float) -> None:
    """Idle for ``seconds`` of emulated time."""
    if seconds > 0:
        time.sleep(seconds * dilation())


def wall(seconds: float) -> float:
    """A span of emulated time as host seconds: for timeouts handed to sockets, stores and torch."""
    return seconds * dilation()


def wall_timeout(seconds: float) -> timedelta:
    """:func:`wall` as the ``timedelta`` torch's process groups and stores take."""
    return timedelta(seconds=wall(seconds))


@contextlib.contextmanager
def dilated(factor: float) -> Iterator[None]:
    """Run a block as if this process had been started with ``$DDLSCALE_DILATION=factor`` (tests)."""
    global _factor
    saved, _factor = _factor, parse_factor(factor)
    try:
        yield
    finally:
        _factor = saved
