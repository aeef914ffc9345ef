"""The launch context: what this process is in a launch, decided once, and what runs beside the workers.

The app builds one :class:`Launch` from the config and the environment (the only place that asks
whether this process is a launcher or one of the ranks) and hands it to every launch mode
(:mod:`ddlscale.cluster.launch`) and to the checkpointer's launch hooks
(:meth:`~ddlscale.ckpt.checkpointer.Checkpointer.validate_launch`, :meth:`~ddlscale.ckpt.checkpointer.Checkpointer.services`).
A tier's services answer with :class:`Services`: what the launcher passes on to the ranks.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOB_ENV = "DDLSCALE_JOB"

# How the ranks of a launch start (Launch.mode).
WORKER = "worker"  # this process is one of them: torchrun or SLURM started it (or a launcher below did)
IN_PROCESS = "in_process"  # Lightning's launcher starts them from this process (cluster=local, slurm, fallback)
ELASTIC = "elastic"  # torchrun's elastic agent on this machine starts them, and restarts them after a failure
EMULATED = "emulated"  # one torchrun agent per emulated machine


def job_name(run_dir: str | None) -> str:
    """A job id every rank derives alike: the launcher's ``$DDLSCALE_JOB``, else one from the run directory.

    torchrun's rendezvous id on the emulated cluster, and the name a checkpoint tier's keys and files
    carry."""
    if os.environ.get(JOB_ENV):
        return os.environ[JOB_ENV]
    where = str(Path(run_dir).resolve()) if run_dir else "default"
    return f"{Path(where).name}-{zlib.crc32(where.encode()):08x}"


@dataclass(frozen=True)
class Launch:
    """This process's part in a launch.

    Args:
        mode: how the ranks start: :data:`WORKER`, :data:`IN_PROCESS`, :data:`ELASTIC` or :data:`EMULATED`.
        kind: ``cluster.kind`` as configured (local, torchrun, slurm, emulated).
        machines: machines the ranks span (emulated machines, or nodes).
        devices: ranks per machine.
        run_dir: the run's directory (None: only checking a config).
        cluster: the :class:`~ddlscale.cluster.emulated.EmulatedCluster`, once it is up.
        rendezvous_store: on the emulated cluster, starts the launcher's TCPStore on machine 0 (on its
            first call) and returns its address; torchrun's rendezvous, and a tier's keys if it likes.
        storage: the emulated cluster has a storage machine (``cluster.storage.bandwidth`` set).
    """

    mode: str
    kind: str
    machines: int
    devices: int
    run_dir: Path | None = None
    cluster: Any = None
    rendezvous_store: Callable[[], str] | None = None
    storage: bool = False

    @property
    def is_worker(self) -> bool:
        return self.mode == WORKER

    @property
    def world_size(self) -> int:
        return self.devices * self.machines

    @property
    def job(self) -> str:
        return job_name(str(self.run_dir) if self.run_dir is not None else None)


@dataclass(frozen=True)
class Services:
    """What a checkpoint tier's services hand the launch they run beside.

    Args:
        env: extra environment of each machine's ranks, by machine (launches that start the ranks
            elsewhere than this process; the others inherit this process's environment).
        rendezvous: an :class:`~ddlscale.cluster.control_plane.EtcdAddress` torchrun's agents rendezvous
            through instead of the launcher's store (the tier started those members).
    """

    env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    rendezvous: Any = None


def no_services(launch: Launch) -> contextlib.AbstractContextManager[Services]:
    """The services of a launch without a checkpointer: nothing runs beside the workers."""
    return contextlib.nullcontext(Services())
