"""What each emulated machine received of this host's CPU during a run, and what the rest of the host took.

Dilation promises each machine ``ranks / k`` cores (:mod:`ddlscale.cluster.cpucap`). Weights give it
at least that whenever it competes, but only if nothing outside the cluster competes too: a loaded
host (another job, a test suite) silently slows every figure (measured: one uncapped zen step 93 ms on
a loaded host, 24.5 ms quiet). So every emulated run records, from the kernel's own counters:

* per machine, the CPU time it used (``cpu.stat`` usage) and the time its processes waited for a core
  while runnable (``cpu.pressure``, "some": at least one of them waiting). While it wanted CPU it
  received ``used / (used + waited)`` of a core per runnable thread; against its share that is
  ``received = used / (used + waited) x k / ranks``: 1 when it got exactly its share, below 1 when it
  was starved, above 1 when the host had cores to spare.
* for the host, the CPU that processes outside this cluster used (``/proc/stat``'s busy time less the
  cluster's own cgroups and its launcher), in cores on average.

A machine that waited for more than :data:`MIN_WAIT` of the run and received less than
:data:`STARVED_BELOW` of its share makes the run **starved**: summary.json says so, and the experiments
keep its row but do not count it (:mod:`experiments.claims`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARVED_BELOW = 0.9
MIN_WAIT = 0.01  # waits shorter than this share of the run are scheduling noise, not starvation
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _field(path: Path | None, key: str, line_prefix: str | None = None) -> float:
    """A ``key value`` (or ``key=value``) counter of a cgroup or /proc file; 0 where it cannot be read."""
    if path is None:
        return 0.0
    try:
        text = path.read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line_prefix is not None and not line.startswith(line_prefix):
            continue
        for word in line.split():
            name, _, value = word.partition("=")
            if name == key and value:
                return float(value)
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return float(parts[1])
    return 0.0


def group_usage_s(group: Path | None) -> float:
    return _field(group / "cpu.stat" if group else None, "usage_usec") / 1e6


def group_wait_s(group: Path | None) -> float:
    return _field(group / "cpu.pressure" if group else None, "total", "some") / 1e6


def host_busy_s(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds the host's cores spent on anything but idling (all cores, since boot)."""
    first = stat.read_text().splitlines()[0].split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` itself used (not its children: those on a machine are in its cgroup)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass
class _Snapshot:
    wall: float
    used: list[float]
    waited: list[float]
    own: float
    host: float


class CpuLedger:
    """Counts from :meth:`start` to :meth:`finish`: ``machines`` are each machine's accounting cgroup
    (None where the host has none), ``own`` further cgroups of the cluster (its reserve) whose CPU is
    not foreign, ``ranks_per_machine`` and ``k`` the share each machine was promised."""

    def __init__(self, machines: Sequence[Path | None], own: Sequence[Path | None], ranks_per_machine: int,
                 k: float, launcher_pid: int | None = None):
        self.machines, self.own = list(machines), [g for g in own if g is not None]
        self.ranks_per_machine, self.k = ranks_per_machine, k
        self.launcher_pid = os.getpid() if launcher_pid is None else launcher_pid
        self.started: _Snapshot | None = None

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            wall=time.monotonic(),  # the host's clock: these are the host's seconds
            used=[group_usage_s(g) for g in self.machines],
            waited=[group_wait_s(g) for g in self.machines],
            own=sum(group_usage_s(g) for g in self.own) + process_cpu_s(self.launcher_pid),
            host=host_busy_s(),
        )

    def start(self) -> None:
        self.started = self._snapshot()

    def finish(self) -> dict[str, Any]:
        """The run's ``cpu_load`` (host seconds, not dilated: these are the host's) and whether it starved."""
        if self.started is None:
            raise RuntimeError("CpuLedger.finish() before start()")
        now, then = self._snapshot(), self.started
        wall = max(now.wall - then.wall, 1e-9)
        share = self.ranks_per_machine / self.k
        machines = []
        for used1, used0, waited1, waited0 in zip(now.used, then.used, now.waited, then.waited, strict=True):
            used, waited = used1 - used0, waited1 - waited0
            wanted = used + waited
            received = used / wanted / share if wanted > 0 else None
            machines.append({"cpu_s": round(used, 3), "wait_s": round(waited, 3),
                             "received": None if received is None else round(received, 3)})
        ours = sum(m["cpu_s"] for m in machines) + (now.own - then.own)
        foreign = max(0.0, (now.host - then.host) - ours)
        accounted = all(g is not None for g in self.machines)
        starved = [i for i, m in enumerate(machines)
                   if m["received"] is not None and m["received"] < STARVED_BELOW and m["wait_s"] > MIN_WAIT * wall]
        return {
            "accounted": accounted,
            "wall_s": round(wall, 3),
            "share_cores": share,
            "machines": machines,
            "received_min": min((m["received"] for m in machines if m["received"] is not None), default=None),
            "host_foreign_cores": round(foreign / wall, 3),
            "starved_machines": starved,
            "starved": bool(starved),
        }


def describe(load: dict[str, Any]) -> str:
    """One line for the run's printout."""
    if not load.get("accounted"):
        return "CPU received: not accounted (no cgroup v2 counters on this host)"
    low = load["received_min"]
    verdict = (f"STARVED: machines {', '.join(map(str, load['starved_machines']))} got under "
               f"{STARVED_BELOW:.0%} of their share: this run's figures are the host's, not the cluster's"
               if load["starved"] else "every machine got its share")
    lowest = f"lowest {low:.2f}x its share" if low is not None else "no machine waited"
    return f"CPU received: {lowest}; other processes used {load['host_foreign_cores']:.2f} cores; {verdict}"
