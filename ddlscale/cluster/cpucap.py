"""Each emulated machine's share of this host's CPU under time dilation: weights and a reserve, not quotas.

Time dilation (:mod:`ddlscale.clock`) slows every emulated machine's network and device by k; its
CPU must slow by k too, or CPU work would look k times faster than on the machine emulated. Each
machine therefore gets ``ranks / k`` cores of this host: in emulated time, one core per rank.

How the share is given decides what a message round costs. CFS bandwidth control (a quota per
period, the first mechanism here, still ``mode="quota"``) hands a machine its budget in lumps: one
that spent its budget waits for the next period, and the kernel's smallest quota is 1 ms, so a
throttled machine waits up to a millisecond of reported time at any k; measured, a recursive-doubling
swap cost about 2 ms at k = 4. A quota also never stops a burst shorter than the budget. So the
default (``mode="shares"``) uses the scheduler's proportional share instead:

* every machine's cgroup weighs ``ranks`` units (``cpu.shares`` 1024 per rank, or ``cpu.weight`` 100
  under cgroup v2), with no quota: nothing is ever throttled, and a machine that wakes for a message
  runs at once if a core is free;
* where k leaves the host more cores than the ranks' share needs (k > ranks x machines / cores), a
  **reserve** takes the rest: one spinning process pinned to each core, in a cgroup weighing
  ``cores x (k - ranks x machines / cores)`` units, so that when every rank computes each gets exactly
  1/k core (without it each would get cores / ranks, more than 1/k, and CPU work would look faster
  than on the machine emulated). The reserve asks for EEVDF's longest slice, so a rank that wakes
  (a message arrived) preempts it at once instead of waiting out the reserve's turn.

Shares guarantee a machine at least its part when it competes; they do not stop a lone busy machine
from taking more while the others wait (the reserve bounds that too, to about ``1 / (1 + k - share)``
cores). :mod:`ddlscale.cluster.cpuload` accounts what each machine received against its share, and
what the rest of the host took, for every run.

Every process started on a machine joins its cgroup before it enters the machine's namespace (inside
one, ``/sys`` shows the namespace's own view), and its children inherit it. The cgroups live under a
``ddlscale`` folder named after their cluster and go with it. Where cgroup v2 is mounted beside v1
(hybrid hierarchies), each machine also gets a v2 cgroup there, without controllers, only for its CPU
usage and pressure (:mod:`ddlscale.cluster.cpuload`).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PARENT = "ddlscale"
MODES = ("shares", "quota")
SHARES_PER_RANK = 1024  # cgroup v1 cpu.shares of one rank; v2 cpu.weight takes WEIGHT_PER_RANK
WEIGHT_PER_RANK = 100
MAX_SHARES, MAX_WEIGHT = 262_144, 10_000
# mode="quota": CFS refills a budget once per period; the kernel's smallest quota is 1 ms, hence
# longer periods at large k.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
RESERVE = "rsv"  # the reserve's cgroup: <cluster>-rsv
# Every emulated cluster's cgroups sit in one parent, which weighs this many ranks against each process
# (or session) outside it: a stray busy process on the host then takes about 1/17 of it from the
# machines, not half (the account of what each machine received still says when one was starved).
PARENT_RANKS = 16
RESERVE_SLICE_NS = 100_000_000  # EEVDF's longest request: the reserve yields to every waking rank


@dataclass(frozen=True)
class Controller:
    """Where the kernel's CPU controller is mounted, in which cgroup version, and (hybrid hierarchies)
    the cgroup v2 mount that accounts usage and pressure."""

    root: Path
    version: int
    accounting_root: Path | None = None

    def limit(self, group: Path, cores: float) -> None:
        """A CFS bandwidth quota of ``cores`` (mode="quota")."""
        period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / cores))
        quota = max(MIN_QUOTA_US, round(period * cores))
        if self.version == 2:
            (group / "cpu.max").write_text(f"{quota} {period}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{period}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def unlimit(self, group: Path) -> None:
        if self.version == 2:
            (group / "cpu.max").write_text("max\n")
        else:
            (group / "cpu.cfs_quota_us").write_text("-1\n")

    def weigh(self, group: Path, ranks: float) -> None:
        """A proportional share of ``ranks`` units (fractions allowed: the reserve's weight)."""
        if self.version == 2:
            (group / "cpu.weight").write_text(f"{min(MAX_WEIGHT, max(1, round(ranks * WEIGHT_PER_RANK)))}\n")
        else:
            (group / "cpu.shares").write_text(f"{min(MAX_SHARES, max(2, round(ranks * SHARES_PER_RANK)))}\n")

    def prepare_parent(self) -> Path:
        parent = self.root / PARENT
        parent.mkdir(exist_ok=True)
        if self.version == 2:  # v2 hands the cpu controller down one level at a time
            for level in (self.root, parent):
                control = level / "cgroup.subtree_control"
                if "cpu" not in control.read_text().split():
                    control.write_text("+cpu\n")
        self.weigh(parent, PARENT_RANKS)
        return parent

    def accounting_group(self, group: Path) -> Path | None:
        """The cgroup v2 group that reads ``group``'s usage and pressure: itself under v2, its twin in the
        hybrid v2 mount under v1, None where there is no v2 mount."""
        if self.version == 2:
            return group
        if self.accounting_root is None:
            return None
        return self.accounting_root / PARENT / group.name


def _mounts(mounts_file: Path) -> list[tuple[str, Path, list[str]]]:
    """(filesystem type, mount point, options) of every cgroup mount."""
    found = []
    for line in mounts_file.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            found.append((parts[2], Path(parts[1]), parts[3].split(",")))
    return found


def find_controller(mounts_file: Path = Path("/proc/mounts")) -> Controller | None:
    """The writable CPU controller of this host, or None (no cgroups, or not ours to write)."""
    try:
        mounts = _mounts(mounts_file)
    except OSError:
        return None
    unified = next((point for kind, point, _ in mounts if kind == "cgroup2"), None)
    for kind, point, options in mounts:
        if kind == "cgroup" and "cpu" in options:
            candidate = Controller(point, 1, _writable(unified))
        elif kind == "cgroup2" and "cpu" in _read(point / "cgroup.controllers").split():
            candidate = Controller(point, 2)
        else:
            continue
        try:
            candidate.prepare_parent()
        except OSError:
            continue
        return candidate
    return None


def _writable(root: Path | None) -> Path | None:
    if root is None:
        return None
    try:
        (root / PARENT).mkdir(exist_ok=True)
    except OSError:
        return None
    return root


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def own_group(controller: Controller) -> Path:
    """The cgroup this process is in, in ``controller``'s hierarchy."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if (controller.version == 2 and number == "0") or (controller.version == 1 and "cpu" in controllers.split(",")):
            return controller.root / path.lstrip("/")
    return controller.root


def reserve_units(k: float, ranks: int, cores: int) -> float:
    """The reserve's weight in rank units: what makes each busy rank get 1/k of a core of ``cores``.

    Spread over the cores, a core holds max(1, ranks / cores) ranks of one unit each (a rank is not
    split: with fewer ranks than cores each has a core) and the reserve's per-core part f: a rank gets
    1 / (max(1, ranks / cores) + f) of its core, which is 1/k when f = k - max(1, ranks / cores).
    """
    return cores * max(0.0, k - max(1.0, ranks / cores))


class CpuShares:
    """The CPU of the ``machines`` machines of cluster ``name`` at dilation ``k``, ``ranks_per_machine``
    ranks each: weighted cgroups and a reserve (``mode="shares"``), or quotas (``mode="quota"``)."""

    def __init__(self, controller: Controller, name: str, machines: int, ranks_per_machine: int, k: float,
                 mode: str = "shares", cores: int | None = None):
        if mode not in MODES:
            raise ValueError(f"cluster.cpu must be one of {', '.join(MODES)}, got {mode!r}")
        self.controller, self.name, self.mode = controller, name, mode
        self.ranks_per_machine, self.cores = ranks_per_machine, cores or os.cpu_count() or 1
        parent = controller.prepare_parent()
        self.groups = [parent / f"{name}-m{i}" for i in range(machines)]
        self.reserve_group = parent / f"{name}-{RESERVE}"
        for group in [*self.groups, self.reserve_group]:
            group.mkdir(exist_ok=True)
        self.accounting = [controller.accounting_group(g) for g in self.groups]
        self.reserve_accounting = controller.accounting_group(self.reserve_group)
        for group in [*self.accounting, self.reserve_accounting]:
            if group is not None:
                group.mkdir(exist_ok=True)
        self.reserve: list[subprocess.Popen] = []
        self.k = 0.0
        self.set_dilation(k)

    @property
    def ranks(self) -> int:
        return len(self.groups) * self.ranks_per_machine

    def set_dilation(self, k: float) -> None:
        """Give every machine its share at k (the dilation probe tries several k on one cluster)."""
        self.k = k
        for group in self.groups:
            if self.mode == "quota":
                self.controller.limit(group, self.ranks_per_machine / k)
            else:
                self.controller.unlimit(group)
                self.controller.weigh(group, self.ranks_per_machine)
        units = reserve_units(k, self.ranks, self.cores) if self.mode == "shares" else 0.0
        if units > 0:
            self.controller.weigh(self.reserve_group, units)
            if not self.reserve:
                self._start_reserve()
        else:
            self._stop_reserve()

    def _start_reserve(self) -> None:
        groups = [self.reserve_group, *([self.reserve_accounting] if self.reserve_accounting else [])]
        procs = ",".join(str(g / "cgroup.procs") for g in groups)
        # Run as a file, not a module of the package: importing ddlscale would load torch into each.
        self.reserve = [subprocess.Popen([sys.executable, __file__, procs, str(core)], stdin=subprocess.DEVNULL)
                        for core in range(self.cores)]

    def _stop_reserve(self) -> None:
        for process in self.reserve:
            process.kill()
        for process in self.reserve:
            process.wait()
        self.reserve = []

    def wrap(self, machine: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside machine ``machine``'s cgroups (the shell joins them, then becomes argv)."""
        return _joining([self.groups[machine], *([self.accounting[machine]] if self.accounting[machine] else [])],
                        argv)

    def wrap_service(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run in a cgroup of its own in the cluster's parent (``<cluster>-<name>``), weighing one
        rank: a part of the emulated cluster that is no machine (the storage machine's server), so that it
        competes as the cluster's, not as a stray process on the host."""
        group = self.controller.prepare_parent() / f"{self.name}-{name}"
        group.mkdir(exist_ok=True)
        self.controller.weigh(group, 1)
        return _joining([group], argv)

    def describe(self) -> str:
        if self.mode == "quota":
            return (f"{self.ranks_per_machine}/{self.k:g} core of this host per machine by CFS quota "
                    f"(cgroup v{self.controller.version})")
        units = reserve_units(self.k, self.ranks, self.cores)
        if self.ranks > self.cores * self.k:
            reserve = ", host oversubscribed: k is below the CPU share"
        else:
            reserve = f", a reserve of {units:g} rank shares on the host's {self.cores} cores" if units else ""
        return (f"{self.ranks_per_machine}/{self.k:g} core of this host per machine by weight "
                f"(cgroup v{self.controller.version} shares, no quota{reserve})")

    def remove(self, wait_s: float = 5.0) -> None:
        self._stop_reserve()
        remove_groups(self.controller, self.name, wait_s)


def _joining(groups: Sequence[Path], argv: Sequence[str]) -> list[str]:
    """``argv`` run by a shell that first joins ``groups`` (their cgroup.procs), then becomes argv."""
    joins = " && ".join(f'echo $$ > "${i}"' for i in range(len(groups)))
    return ["sh", "-c", f'{joins} && shift {len(groups) - 1} && exec "$@"', *(str(g / "cgroup.procs") for g in groups),
            *argv]


def remove_groups(controller: Controller | None, name: str, wait_s: float = 5.0) -> None:
    """Delete cluster ``name``'s cgroups once their processes are gone (a dying process leaves its
    cgroup a moment after it is killed; an empty cgroup is removed with rmdir). A reserve left behind
    by an owner that died (SIGKILL skips its teardown) is killed first: it belongs to this cluster."""
    if controller is None:
        return
    roots = [controller.root / PARENT]
    if controller.version == 1 and controller.accounting_root is not None:
        roots.append(controller.accounting_root / PARENT)
    for pid in _read(controller.root / PARENT / f"{name}-{RESERVE}" / "cgroup.procs").split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + wait_s  # the host's clock: this waits for the host's processes
    for parent in roots:
        for group in sorted(parent.glob(f"{name}-*")):
            while True:
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)


# -- the reserve's process ----------------------------------------------------------------------------
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


def request_slice(nanoseconds: int) -> bool:
    """Ask EEVDF for a slice of this length for the calling thread (Linux >= 6.12; False where refused)."""
    number = _SCHED_SETATTR.get(os.uname().machine)
    if number is None:
        return False
    # struct sched_attr, its first version: size, policy (SCHED_OTHER), flags, nice, priority, runtime...
    attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, 0, 0, nanoseconds, 0, 0))
    return ctypes.CDLL(None, use_errno=True).syscall(number, 0, attr, 0) == 0


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def reserve_main(procs: str, core: int) -> None:
    """One core of the reserve: join its cgroups (``procs``: their cgroup.procs files, comma-separated),
    stay on ``core``, ask for the longest slice, spin.

    It dies with the process that started it (the cluster's owner), so it never outlives the cluster.
    """
    _die_with_parent()
    for path in procs.split(","):
        Path(path).write_text(f"{os.getpid()}\n")
    os.sched_setaffinity(0, {core})
    request_slice(RESERVE_SLICE_NS)
    while True:
        pass


if __name__ == "__main__":
    reserve_main(sys.argv[1], int(sys.argv[2]))
