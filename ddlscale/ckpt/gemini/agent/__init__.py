"""The replica agent: one process per machine that keeps checkpoint replicas in CPU memory.

It outlives the training processes of its machine (a trainer crash loses nothing) and dies with the
machine. Bytes arrive straight into a replica buffer; ``END`` checks them against the version's MAC
before the replica counts; a version of an older incarnation than the job's current one is refused as
stale. Its parts:

* :mod:`~ddlscale.ckpt.gemini.agent.slots` — two buffers per owner rank in shared memory, and the
  fencing rule for which one a new version may overwrite (decided from the job's signed records only);
* :mod:`~ddlscale.ckpt.gemini.agent.server` — the authenticated replica server, one handler per op code,
  every length bounded before anything is allocated, connections admitted only once they authenticate,
  every message under a deadline; refusals counted by reason (``STAT``) and logged;
* :mod:`~ddlscale.ckpt.gemini.agent.membership` — heartbeats, failure detection and root election.

Run one per machine (``$DDLSCALE_SECRET_FILE`` names the job's secret)::

    python -m ddlscale.ckpt.gemini.agent --machine 0 --machines 4 --bind 10.213.0.1:29500 \\
        --store 10.213.0.1:29400 --job myrun --persist-dir /shared/myrun/checkpoints

**A stop** (SIGTERM, SIGINT, SIGHUP, or SLURM's SIGUSR1) does not take the replicas away: a scheduler
stopping the job signals every process at once, the agents with the launcher, and the newest committed
version must still reach the persistent tier. The agent takes no new version from then on (BEGIN is
refused, so nothing can overwrite what the drain reads), keeps serving the ones it holds, and goes once
the drain says it is over (:func:`~ddlscale.ckpt.gemini.stopping.mark_drained`) or the drain's deadline
has passed (:data:`~ddlscale.ckpt.gemini.stopping.STOP_MARGIN_S` plus the version's
:func:`~ddlscale.ckpt.gemini.stopping.deadline_for` at ``--drain-rate``, or ``--drain-deadline``); later
signals change nothing (SLURM's SIGTERM after its SIGUSR1). The launcher drains for the agents it started;
agents a user started drain themselves: the root agent, given ``--persist-dir``, writes the version there.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any

from ddlscale import clock
from ddlscale.ckpt.gemini import stopping
from ddlscale.ckpt.gemini.agent.membership import Membership
from ddlscale.ckpt.gemini.agent.server import MAX_CONNECTIONS, ReplicaServer
from ddlscale.ckpt.gemini.agent.slots import JobView, ReplicaStore, file_prefix
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, SecretError
from ddlscale.ckpt.gemini.kvstore import JobStore, connect
from ddlscale.ckpt.gemini.protocol import mib, parse_address, shm_dir, shm_usage
from ddlscale.ckpt.version.manifest import Manifest
from ddlscale.cluster.stop import STOP_SIGNALS


class Agent:
    """A machine's agent: the replica server, heartbeats and the root role, on the job's store."""

    def __init__(self, machine: int, machines: int, bind: str, store: str, job: str, auth: JobKeys,
                 heartbeat_s: float = 0.5, failure_timeout_s: float = 3.0, max_version_bytes: int | None = None,
                 max_connections: int = MAX_CONNECTIONS, persist_dir: str | None = None,
                 drain_deadline_s: float | None = None, drain_rate_bps: float | None = None) -> None:
        self.machine, self.machines = machine, machines
        # On a stop (see the module doc): where the root writes the committed version, and how long it may take.
        self.persist_dir, self.drain_deadline_s, self.drain_rate_bps = persist_dir, drain_deadline_s, drain_rate_bps
        self.stopping = threading.Event()  # set by a stop signal: no new versions from then on
        self.store_address, self.job, self.auth = store, job, auth
        self.view = JobView(self._job_store())
        host, port = parse_address(bind)
        self.replicas = ReplicaStore(file_prefix(job, machine) + (f"-p{os.getpid()}" if port == 0 else ""))
        # Beyond this limit (if any) a version is refused outright; below it, BEGIN checks the shared
        # memory's free space before reserving, and refuses naming it.
        self.max_version_bytes = max_version_bytes
        self.server = ReplicaServer((host, port), self, max_connections)
        self.address = f"{host}:{self.server.server_address[1]}"
        self.stopped = threading.Event()
        self.membership = Membership(machine, machines, heartbeat_s, failure_timeout_s, self.stopped,
                                     on_store_lost=self._store_lost, on_beat=self.view.observe)
        self.refusals: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    @property
    def is_root(self) -> bool:
        return self.membership.is_root

    def _job_store(self) -> JobStore:
        return JobStore(connect(self.store_address), self.job, self.auth)

    def count(self, reason: str, message: str) -> None:
        with self._count_lock:
            self.refusals[reason] += 1
            n = self.refusals[reason]
        if n <= 10 or n % 100 == 0:
            print(f"gemini agent {self.machine}: refused ({reason}, #{n}) {message}", file=sys.stderr, flush=True)

    def stat(self) -> dict[str, Any]:
        usage = shm_usage()
        with self._count_lock:
            refused = dict(self.refusals)
        # host and device: which agents share one shared memory (all of them, on cluster=local)
        return {"machine": self.machine, "holds": self.replicas.describe(), "refused": refused,
                "seen": self.view.seen(),  # what a restart and the drain trust over the store's commit record
                "shm": {"dir": str(shm_dir()), "free": usage.free, "total": usage.total,
                        "host": socket.gethostname(), "device": os.stat(shm_dir()).st_dev}}

    def start(self) -> Agent:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                         name="replica-server").start()
        store = self._job_store()
        store.set(store.keys.agent(self.machine), self.address)
        threading.Thread(target=self.membership.run, args=(store,), daemon=True, name="heartbeat").start()
        return self

    def wind_down(self) -> None:
        """After a stop signal: serve the replicas held until the drain is over or its deadline passed (the
        module doc says why); the root drains itself when given a persistent directory. The store may be
        gone for a while (the signal stops it too, and a launcher brings it back): asked again each poll."""
        self.stopping.set()
        started = time.monotonic()
        deadline = started + stopping.STOP_MARGIN_S + clock.wall(self.drain_deadline_s or stopping.FLOOR_S)
        store, incarnation, drainer, said = None, 0, None, False
        while not self.stopped.is_set() and time.monotonic() < deadline:
            if not said and time.monotonic() - started > 2 * stopping.POLL_S:  # waiting: not a normal end's stop
                print(f"gemini agent {self.machine}: stopping: no new versions; the ones held are served until the "
                      "drain has read them", file=sys.stderr, flush=True)
                said = True
            try:
                if store is None:
                    store = self._job_store()
                    incarnation = int(store.get(store.keys.incarnation, 0))
                    manifest = store.manifest()
                    if isinstance(manifest, Manifest) and self.drain_deadline_s is None:  # its size sets the time
                        drain_s = stopping.deadline_for(sum(s.bytes for s in manifest.shards), self.drain_rate_bps)
                        deadline = started + stopping.STOP_MARGIN_S + clock.wall(drain_s)
                if drainer is None and self.persist_dir is not None and self.is_root:  # asked each time: roots change
                    drainer = threading.Thread(target=self._drain, daemon=True, name="drain")
                    drainer.start()
                if stopping.was_drained(store, incarnation) or (drainer is not None and not drainer.is_alive()):
                    return
            except (RuntimeError, OSError):
                store = None  # unreachable, or its connection broke: connect again next time
            self.stopped.wait(stopping.POLL_S)

    def _drain(self) -> None:
        """The root's drain of the committed version to ``persist_dir``, then the mark that ends every
        agent's wait."""
        from ddlscale.ckpt.gemini.drain import drain_and_report  # the persistent tier's writer: only here

        try:
            store = self._job_store()  # a connection of this thread's own
            drain_and_report(store, self.persist_dir, self.drain_deadline_s, self.drain_rate_bps)
            stopping.mark_drained(store)
        except (RuntimeError, OSError) as exc:
            print(f"gemini agent {self.machine}: the drain could not finish: {exc}", file=sys.stderr, flush=True)

    def _store_lost(self) -> None:
        """The store has been unreachable for long: the job (and its store) is over. Not while stopping: a
        stop of the whole job stops the store too, the launcher brings it back for the drain, and the
        wind-down's own deadline ends the wait."""
        if not self.stopping.is_set():
            self.stop()

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
        self.replicas.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.ckpt.gemini.agent",
                                     description="ddlscale Gemini replica agent (one per machine)")
    parser.add_argument("--machine", type=int, required=True)
    parser.add_argument("--machines", type=int, required=True)
    parser.add_argument("--bind", required=True, help="HOST:PORT to serve replicas on (port 0: any)")
    parser.add_argument("--store", required=True, help="HOST:PORT of the job's TCPStore")
    parser.add_argument("--job", default="default")
    parser.add_argument("--secret-file", default=os.environ.get(SECRET_ENV),
                        help=f"the job's secret (default: ${SECRET_ENV})")
    parser.add_argument("--failure-timeout", type=float, default=3.0)
    parser.add_argument("--max-version-bytes", type=int, default=None,
                        help="largest version accepted (default: what the shared memory's free space allows)")
    parser.add_argument("--persist-dir", default=None,
                        help="on a stop signal the root agent writes the committed version here (a path, or "
                             "storage://<path> with the storage endpoint in the environment); default: none")
    parser.add_argument("--drain-deadline", type=float, default=None,
                        help="seconds the drain on a stop may take (default: from the version's size at --drain-rate)")
    parser.add_argument("--drain-rate", type=float, default=None,
                        help="bits/s a drain moves the replicas at to the persistent tier (default: a plain disk's)")
    args = parser.parse_args(argv)
    if not 0 <= args.machine < args.machines:
        parser.error(f"--machine must be in 0..{args.machines - 1}")
    try:
        if not args.secret_file:
            raise SecretError(f"no job secret: pass --secret-file or set ${SECRET_ENV}")
        os.environ[SECRET_ENV] = args.secret_file
        auth = JobKeys.from_env(args.job)
    except SecretError as exc:
        parser.error(str(exc))
    agent = Agent(args.machine, args.machines, args.bind, args.store, args.job, auth,
                  failure_timeout_s=args.failure_timeout, max_version_bytes=args.max_version_bytes,
                  persist_dir=args.persist_dir, drain_deadline_s=args.drain_deadline,
                  drain_rate_bps=args.drain_rate).start()
    for signum in STOP_SIGNALS:  # the first starts the wind-down; later ones change nothing (module doc)
        signal.signal(signum, lambda *_: agent.stopping.set())
    usage = shm_usage()
    print(f"ready {agent.address}", flush=True)
    print(f"gemini agent {args.machine}: replicas in {shm_dir()} ({mib(usage.free)} free of {mib(usage.total)})",
          file=sys.stderr, flush=True)
    while not agent.stopped.wait(0.1) and not agent.stopping.is_set():
        pass
    if agent.stopping.is_set() and not agent.stopped.is_set():
        agent.wind_down()
    if agent.refusals:
        print(f"gemini agent {args.machine}: refused {dict(agent.refusals)}", file=sys.stderr, flush=True)
    agent.stop()  # the replicas' shared memory goes with the agent
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left to finalize: skip the interpreter's teardown of torch, seconds on a busy machine,
    # which a launcher stopping on a signal would wait for.
    os._exit(0)

