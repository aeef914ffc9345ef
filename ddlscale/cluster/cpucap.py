"""A CPU budget per emulated machine: a cgroup capping its processes at a fraction of a core.

Time dilation (:mod:`ddlscale.clock`) slows every emulated machine's network and device by k; its
CPU must slow by k too, or CPU work would look k times faster than on the machine emulated (and an
idle machine's share would go to a busy one). A cgroup's CPU bandwidth limit gives each machine
exactly ``cores / k`` cores of this host, whatever the other machines do: in emulated time, ``cores``
cores. This is DieCast's CPU scaling, done with the kernel's CFS bandwidth control instead of a VMM
scheduler. ``cgroup v1``'s ``cpu`` controller and ``cgroup v2``'s ``cpu.max`` both work.

Every process started on a machine joins its cgroup before it enters the machine's namespace (inside
one, ``/sys`` shows the namespace's own view), and its children inherit it. The cgroups live under a
``ddlscale`` folder named after their cluster and go with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PARENT = "ddlscale"
# CFS refills a budget once per period: a machine that spent its budget waits for the next refill, so
# a short period keeps that wait (a message's extra latency) short. The kernel's smallest quota is
# 1 ms, hence longer periods at large k.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000


@dataclass(frozen=True)
class Controller:
    """Where the kernel's CPU bandwidth control is mounted, and in which cgroup version."""

    root: Path
    version: int

    def limit(self, group: Path, cores: float) -> None:
        period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / cores))
        quota = max(MIN_QUOTA_US, round(period * cores))
        if self.version == 2:
            (group / "cpu.max").write_text(f"{quota} {period}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{period}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def prepare_parent(self) -> Path:
        parent = self.root / PARENT
        parent.mkdir(exist_ok=True)
        if self.version == 2:  # v2 hands the cpu controller down one level at a time
            for level in (self.root, parent):
                control = level / "cgroup.subtree_control"
                if "cpu" not in control.read_text().split():
                    control.write_text("+cpu\n")
        return parent


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
    for kind, point, options in mounts:
        if kind == "cgroup" and "cpu" in options:
            candidate = Controller(point, 1)
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


class CpuCaps:
    """One capped cgroup per machine of cluster ``name``: ``cores`` cores each (a fraction of one here)."""

    def __init__(self, controller: Controller, name: str, machines: int, cores: float):
        if not cores > 0:
            raise ValueError(f"a CPU cap needs cores > 0, got {cores!r}")
        self.controller, self.name, self.cores = controller, name, cores
        parent = controller.prepare_parent()
        self.groups = [parent / f"{name}-m{i}" for i in range(machines)]
        for group in self.groups:
            group.mkdir(exist_ok=True)
            controller.limit(group, cores)

    def set_cores(self, cores: float) -> None:
        """Change every machine's cap (the dilation probe tries several k on one cluster)."""
        self.cores = cores
        for group in self.groups:
            self.controller.limit(group, cores)

    def wrap(self, machine: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside machine ``machine``'s cgroup (the shell joins it, then becomes argv)."""
        procs = self.groups[machine] / "cgroup.procs"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *argv]

    def remove(self, wait_s: float = 5.0) -> None:
        remove_groups(self.controller, self.name, wait_s)


def remove_groups(controller: Controller | None, name: str, wait_s: float = 5.0) -> None:
    """Delete cluster ``name``'s cgroups once their processes are gone (a dying process leaves its
    cgroup a moment after it is killed; an empty cgroup is removed with rmdir)."""
    if controller is None:
        return
    parent = controller.root / PARENT
    deadline = time.monotonic() + wait_s  # the host's clock: this waits for the host's processes
    for group in sorted(parent.glob(f"{name}-m*")):
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
