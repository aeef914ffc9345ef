"""Launching a Gemini job: checks before the workers start, and the secret, store and agents around them.

:func:`check_launch` and :func:`launch_services` are ``GeminiCheckpointer``'s launch hooks
(:class:`~ddlscale.ckpt.checkpointer.Checkpointer`): the app and the launch modes of
:mod:`ddlscale.cluster.launch` call them without knowing the tier.

The store is a TCPStore by default, or with ``ckpt.store=etcd`` an etcd cluster
(:mod:`ddlscale.cluster.control_plane`): one member on loopback for ``cluster=local``, one on each of
the first three machines of an emulated cluster, data under ``<run dir>/etcd``.

* :func:`job_secret` draws the job's secret into a private temporary directory for the launch (the
  trainers and agents read it through ``$DDLSCALE_SECRET_FILE``) and removes it when the launch ends.
* ``cluster=local``: :func:`local_gemini` hosts a TCPStore in the launching process and starts one
  agent per rank on loopback (each rank is its own "machine"), or starts one etcd member instead of
  the TCPStore (``etcd_dir``); the workers inherit the environment that
  points at them. When the launch ends (a stop included, even one that signalled every process of the
  job: the agents then keep their replicas for the drain, and an etcd member is started again) the
  committed version is written to the persistent directory (:mod:`ddlscale.ckpt.gemini.drain`), then the
  agents stop.
* ``cluster=emulated``: the rendezvous store on machine 0 serves Gemini's keys too (or, with etcd,
  :func:`start_emulated_etcd`'s members serve both), and :func:`start_emulated_agent` starts machine
  i's agent inside its namespace — also what a test or experiment calls to bring up a replacement
  machine after killing one.
* elsewhere (torchrun or SLURM on a real cluster): run ``python -m ddlscale.ckpt.gemini.agent`` on every
  machine (with ``--persist-dir``: on a stop the root agent drains) and export ``DDLSCALE_STORE``,
  ``DDLSCALE_MACHINE``, ``DDLSCALE_MACHINES``, ``DDLSCALE_JOB`` and ``DDLSCALE_SECRET_FILE``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddlscale.ckpt.disk.disk_checkpointer import check_storage
from ddlscale.ckpt.gemini.agent.slots import remove_replicas
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, create_secret_file, read_secret
from ddlscale.ckpt.gemini.drain import drain_and_report
from ddlscale.ckpt.gemini.env import MACHINE_ENV, MACHINES_ENV, STORE_ENV, machine_count
from ddlscale.ckpt.gemini.kvstore import ETCD, JobStore, connect, serve
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.stopping import DISK_RATE_BPS, mark_drained, series_rate
from ddlscale.cluster import stop
from ddlscale.cluster.context import ELASTIC, EMULATED, JOB_ENV, Launch, Services
from ddlscale.cluster.control_plane import EtcdMembers, Member, missing

if TYPE_CHECKING:
    from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer

AGENT_PORT = 29500  # replica agents' port on emulated machines
ETCD_MEMBERS = 3  # members on the first machines: any one can fail and a quorum of two remains


def check_launch(gemini: GeminiCheckpointer, launch: Launch) -> None:
    """Refuse, naming the key, what cannot work in this launch: m replicas need m machines — emulated
    machines, nodes, or (one machine) one per worker, as the workers count them
    (:func:`~ddlscale.ckpt.gemini.env.machine_layout`); a ``storage://`` persistent directory needs the
    storage machine and no ``ckpt.persist_bandwidth`` (the disk tier's check, under Gemini's keys); and
    ``ckpt.store=etcd`` needs etcd where the launcher starts the members (cluster=local, emulated),
    elsewhere their address."""
    machines = machine_count(launch.world_size if launch.kind == "local" else launch.machines)
    try:
        PlacementPlan(int(machines), gemini.replicas, gemini.placement)
    except ValueError as exc:
        raise ValueError(f"ckpt.replicas / ckpt.placement: {exc}") from None
    check_storage(gemini.persist_given, gemini.persist_bps, launch, "ckpt.persist_dir", "ckpt.persist_bandwidth")
    if gemini.store_address != ETCD:
        return
    if launch.is_worker or launch.kind not in ("local", "emulated"):
        if not os.environ.get(STORE_ENV, "").startswith("etcd"):
            raise ValueError(f"ckpt.store=etcd with cluster={launch.kind}: nothing starts etcd members here; give "
                             "their address as ckpt.store=etcd://HOST:PORT,... (or $DDLSCALE_STORE)")
        return
    reason = missing(server=True)
    if reason:
        raise ValueError(f"ckpt.store=etcd cannot run here: {reason}")


def launch_services(gemini: GeminiCheckpointer, launch: Launch) -> contextlib.AbstractContextManager[Services]:
    """The secret, store and agents a launch needs, unless someone else provides them: the workers
    (the launcher above them does), and a launch in this process given a store (``ckpt.store=HOST:PORT``
    or ``$DDLSCALE_STORE``: its agents are the user's). An elastic launch starts its own whatever the
    store: its agents must outlive the restarted workers."""
    if launch.is_worker:
        return contextlib.nullcontext(Services())
    if launch.mode == EMULATED:
        return _on_emulated_cluster(gemini, launch)
    if launch.mode != ELASTIC and (gemini.store_address not in (None, ETCD) or os.environ.get(STORE_ENV)):
        return contextlib.nullcontext(Services())
    return _on_this_machine(gemini, launch)


@contextlib.contextmanager
def _on_this_machine(gemini: GeminiCheckpointer, launch: Launch) -> Iterator[Services]:
    """One agent per rank on loopback; the workers inherit the environment that finds them."""
    etcd_dir = launch.run_dir / "etcd" if gemini.store_address == ETCD else None
    with local_gemini(launch.world_size, launch.job, gemini.persist_dir, etcd_dir=etcd_dir,
                      drain=Drain(gemini.drain_deadline_s, drain_rate_bps(gemini, launch))):
        yield Services()


@contextlib.contextmanager
def _on_emulated_cluster(gemini: GeminiCheckpointer, launch: Launch) -> Iterator[Services]:
    """Store (the launcher's rendezvous store on machine 0, or etcd members on the first three machines,
    which then hold torchrun's rendezvous too) and one agent per machine. When the launch ends the
    committed version is written to ``persist_dir`` from inside machine 0 (``storage://gemini`` by default
    where a storage machine serves the run: over its link), then the machines go down and with them the
    agents, whose shared memory is removed last."""
    cluster, job = launch.cluster, launch.job
    drain = Drain(gemini.drain_deadline_s, drain_rate_bps(gemini, launch))
    with job_secret() as secret, contextlib.ExitStack() as spared:
        rendezvous = etcd = None
        if gemini.store_address == ETCD:  # members on the first three machines: rendezvous and keys
            etcd = start_emulated_etcd(cluster, launch.run_dir / "etcd", job)
            store, rendezvous = str(etcd.address), etcd.address
            print(f"control plane: etcd members at {etcd.address.rendezvous_endpoint}", flush=True)
        else:
            store = launch.rendezvous_store()  # it ignores stop signals: the drain reads it (emulated.py)
        env = {}
        for machine in range(cluster.nodes):
            agent = start_emulated_agent(cluster, machine, store, job, secret, drain_args=drain.agent_args())
            spared.enter_context(stop.spared(agent.pid))  # stopped with its machine, after the drain
            env[machine] = emulated_env(cluster, machine, store, job, secret)
        try:
            yield Services(env=env, rendezvous=rendezvous)
        finally:  # the same command into this run directory (hydra.run.dir=) then continues from it
            # A stop of the whole job (every process signalled at once) stopped the etcd members and the
            # storage machine's server too; their data is on disk: back for the drain.
            if etcd is not None:
                _bring_back("the etcd members", etcd.revive)
            if cluster.storage is not None:
                _bring_back("the storage machine's server", cluster.storage.revive)
            persist_emulated(cluster, store, job, secret, gemini.persist_target(launch.storage), drain)
            cluster.down()
            remove_replicas(job)  # the agents died with the cluster; their shared memory goes too


@dataclass(frozen=True)
class Drain:
    """How long the drain of a launch's last committed version may take: ``deadline_s`` seconds, or
    (None) :func:`~ddlscale.ckpt.gemini.stopping.deadline_for` the version's size at ``rate_bps``. The agents
    are told too: on a stop they keep their replicas that long for the drain."""

    deadline_s: float | None = None
    rate_bps: float | None = None

    def agent_args(self) -> list[str]:
        return ((["--drain-deadline", f"{self.deadline_s:g}"] if self.deadline_s is not None else [])
                + (["--drain-rate", f"{self.rate_bps:g}"] if self.rate_bps is not None else []))

    def drain_args(self) -> list[str]:
        return ((["--deadline", f"{self.deadline_s:g}"] if self.deadline_s is not None else [])
                + (["--rate", f"{self.rate_bps:g}"] if self.rate_bps is not None else []))


def drain_rate_bps(gemini: GeminiCheckpointer, launch: Launch) -> float:
    """What a drain's bytes move at: the persistent tier's rate (the storage machine's link for
    ``storage://``, else ``ckpt.persist_bandwidth``, else a plain disk's), after machine 0's NIC on the
    emulated cluster, which every replica crosses first (fetched there, then written)."""
    cluster = launch.cluster
    on_storage = str(gemini.persist_target(launch.storage)).startswith("storage://")
    if on_storage and cluster is not None and cluster.storage is not None:
        tier = cluster.storage.bandwidth_bps
    else:
        tier = gemini.persist_bps or DISK_RATE_BPS
    return series_rate(cluster.bandwidth_bps if cluster is not None else None, tier)


def _bring_back(what: str, revive: Any) -> None:
    try:
        revive()
    except (RuntimeError, OSError) as exc:  # the drain then says what it could not reach
        print(f"gemini: {what} could not be started again for the drain: {exc}", flush=True)


@contextlib.contextmanager
def job_secret() -> Iterator[Path]:
    """A new job secret in a private directory, removed when the block ends."""
    directory = tempfile.mkdtemp(prefix="ddlscale-job-")  # mode 0700
    try:
        yield create_secret_file(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def agent_argv(machine: int, machines: int, bind: str, store: str, job: str, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "ddlscale.ckpt.gemini.agent", "--machine", str(machine), "--machines", str(machines),
            "--bind", bind, "--store", store, "--job", job, *extra]


def _await_ready(process: subprocess.Popen, what: str) -> str:
    line = process.stdout.readline().strip()
    if not line.startswith("ready "):
        process.kill()
        raise RuntimeError(f"{what} did not start (said {line!r})")
    return line.split()[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def local_gemini(machines: int, job: str, persist_dir: Path | str | None = None,
                 etcd_dir: Path | None = None, drain: Drain = Drain()) -> Iterator[dict[str, str]]:
    """Secret, store and ``machines`` agents on loopback for one launch; yields (and exports) their
    environment. On the way out the committed version goes to ``persist_dir`` when given, within
    ``drain``'s deadline. With ``etcd_dir`` the store is one etcd member with its data there (no
    replication on one machine).

    The agents hold the version that goes to disk on the way out, so a stop signal must not take it
    away first: each runs in a session of its own (a terminal's Ctrl-C goes to the launcher's process
    group only) and is spared from the launcher's first fan-out of SIGTERM (:func:`ddlscale.cluster.stop.spared`);
    a stop of the whole job, which signals them too, makes them keep their replicas until the drain is
    over (:meth:`~ddlscale.ckpt.gemini.agent.Agent.wind_down`). They are stopped here, after the drain."""
    if etcd_dir is not None:
        member = Member("m0", "127.0.0.1", _free_port(), _free_port())
        store = EtcdMembers([member], etcd_dir, lambda _, argv, **kw: subprocess.Popen(argv, **kw), job).start()
        address = str(store.address)
    else:
        address = f"127.0.0.1:{_free_port()}"
        store = serve(address)
    agents: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in (STORE_ENV, MACHINES_ENV, JOB_ENV, SECRET_ENV)}
    with job_secret() as secret, contextlib.ExitStack() as spared:
        env = {STORE_ENV: address, MACHINES_ENV: str(machines), JOB_ENV: job, SECRET_ENV: str(secret)}
        try:
            for m in range(machines):
                agents.append(subprocess.Popen(agent_argv(m, machines, "127.0.0.1:0", address, job, drain.agent_args()),
                                               stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
                                               start_new_session=True))
                spared.enter_context(stop.spared(agents[-1].pid))
            for m, agent in enumerate(agents):
                _await_ready(agent, f"replica agent {m}")
            os.environ.update(env)
            yield env
        finally:
            if isinstance(store, EtcdMembers):  # a stop of the whole job stopped the member too: back for the drain
                _bring_back("the etcd member", store.revive)
            if agents:
                _drain_locally(address, job, secret, persist_dir, drain)
            stop_agents(agents)
            remove_replicas(job)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if isinstance(store, EtcdMembers):
                store.stop()
            del store


def _drain_locally(address: str, job: str, secret: Path, persist_dir: Path | str | None, drain: Drain) -> None:
    """The committed version to ``persist_dir`` (when given), then the mark that lets the agents go."""
    try:
        store = JobStore(connect(address), job, JobKeys(read_secret(secret), job))
        if persist_dir is not None:
            drain_and_report(store, persist_dir, drain.deadline_s, drain.rate_bps)
        mark_drained(store)
    except (RuntimeError, OSError) as exc:  # the store is gone: nothing can be read or marked
        print(f"ckpt=gemini: no version written to {persist_dir} on the way out: the job's store is "
              f"unreachable ({exc})", flush=True)


def stop_agents(agents: list[subprocess.Popen], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace_s``. An agent that finds the drain over stops at
    once; one that does not (the store gone) would keep its replicas for the drain's deadline."""
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            agent.terminate()
    deadline = time.monotonic() + grace_s
    for agent in agents:
        try:
            agent.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()


def start_emulated_etcd(cluster: Any, directory: Path, job: str) -> EtcdMembers:
    """An etcd member on each of the first (up to) three emulated machines, data under ``directory``;
    returns once a quorum is healthy. Its ``address`` is the job's store and rendezvous."""
    members = [Member(f"m{i}", cluster.address(i)) for i in range(min(ETCD_MEMBERS, cluster.nodes))]
    return EtcdMembers(members, directory, cluster.popen, job).start()


def emulated_env(cluster: Any, machine: int, store: str, job: str, secret: Path) -> dict[str, str]:
    """What machine ``machine``'s trainers need to find the store (its address) and their agent."""
    return {STORE_ENV: store, MACHINE_ENV: str(machine),
            MACHINES_ENV: str(cluster.nodes), JOB_ENV: job, SECRET_ENV: str(secret)}


def start_emulated_agent(cluster: Any, machine: int, store: str, job: str, secret: Path,
                         drain_args: list[str] = (), **popen_kwargs: Any) -> subprocess.Popen:
    """Machine ``machine``'s replica agent, inside its namespace; returns once it serves. ``drain_args``:
    how long it keeps its replicas for the drain on a stop (:meth:`Drain.agent_args`)."""
    argv = agent_argv(machine, cluster.nodes, f"{cluster.address(machine)}:{AGENT_PORT}", store, job, drain_args)
    env = {SECRET_ENV: str(secret), **popen_kwargs.pop("env", {})}
    process = cluster.popen(machine, argv, stdout=subprocess.PIPE, text=True, env=env, **popen_kwargs)
    _await_ready(process, f"replica agent on emulated machine {machine}")
    return process


def persist_emulated(cluster: Any, store: str, job: str, secret: Path, directory: Path | str,
                     drain: Drain = Drain()) -> None:
    """Write the committed version to ``directory`` from inside machine 0 (the store is reachable only
    from the emulated machines) within ``drain``'s deadline; a failure is reported, not raised: the launch
    is ending anyway. A ``storage://`` directory is written over machine 0's link to the storage machine,
    with the endpoint and credentials the workers get (in the environment: never on a command line,
    which others can read). The drain marks its end in the store, so the agents may go."""
    argv = [sys.executable, "-m", "ddlscale.ckpt.gemini.drain", "--store", store, "--job", job, "--dir", str(directory),
            *drain.drain_args()]
    done = cluster.popen(0, argv, env={SECRET_ENV: str(secret), **cluster.storage_env()}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    # The drain keeps its own deadline (from the version's size, which only it reads), checked before each
    # rank's replica: waited for without a limit of ours, which could only be a guess.
    output, _ = done.communicate(timeout=None)
    if output.strip():
        print(output.strip(), flush=True)
