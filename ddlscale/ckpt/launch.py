"""Starting Gemini's infrastructure: the job's secret, its store and one replica agent per machine.

* :func:`job_secret` draws the job's secret into a private temporary directory for the launch (the
  trainers and agents read it through ``$DDLSCALE_SECRET_FILE``) and removes it when the launch ends.
* ``cluster=local``: :func:`local_gemini` hosts a TCPStore in the launching process and starts one
  agent per rank on loopback (each rank is its own "machine"); the workers inherit the environment that
  points at them. When the launch ends the committed version is written to the persistent directory
  (:mod:`ddlscale.ckpt.drain`), then the agents stop.
* ``cluster=emulated``: the rendezvous store on machine 0 serves Gemini's keys too, and
  :func:`start_emulated_agent` starts machine i's agent inside its namespace — also what a test or
  experiment calls to bring up a replacement machine after killing one.
* elsewhere (torchrun or SLURM on a real cluster): run ``python -m ddlscale.ckpt.agent`` on every
  machine and export ``DDLSCALE_STORE``, ``DDLSCALE_MACHINE``, ``DDLSCALE_MACHINES``, ``DDLSCALE_JOB``
  and ``DDLSCALE_SECRET_FILE``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddlscale.ckpt import kvstore
from ddlscale.ckpt.agent import remove_replicas
from ddlscale.ckpt.auth import SECRET_ENV, JobKeys, create_secret_file, read_secret
from ddlscale.ckpt.drain import announce, persist_committed
from ddlscale.ckpt.gemini import JOB_ENV, MACHINE_ENV, MACHINES_ENV, STORE_ENV

AGENT_PORT = 29500  # replica agents' port on emulated machines


@contextlib.contextmanager
def job_secret() -> Iterator[Path]:
    """A new job secret in a private directory, removed when the block ends."""
    directory = tempfile.mkdtemp(prefix="ddlscale-job-")  # mode 0700
    try:
        yield create_secret_file(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def agent_argv(machine: int, machines: int, bind: str, store: str, job: str) -> list[str]:
    return [sys.executable, "-m", "ddlscale.ckpt.agent", "--machine", str(machine), "--machines", str(machines),
            "--bind", bind, "--store", store, "--job", job]


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
def local_gemini(machines: int, job: str, persist_dir: Path | None = None) -> Iterator[dict[str, str]]:
    """Secret, store and ``machines`` agents on loopback for one launch; yields (and exports) their
    environment. On the way out the committed version goes to ``persist_dir`` when given."""
    address = f"127.0.0.1:{_free_port()}"
    store = kvstore.serve(address)
    agents: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in (STORE_ENV, MACHINES_ENV, JOB_ENV, SECRET_ENV)}
    with job_secret() as secret:
        env = {STORE_ENV: address, MACHINES_ENV: str(machines), JOB_ENV: job, SECRET_ENV: str(secret)}
        try:
            for m in range(machines):
                agents.append(subprocess.Popen(agent_argv(m, machines, "127.0.0.1:0", address, job),
                                               stdout=subprocess.PIPE, text=True, env={**os.environ, **env}))
            for m, agent in enumerate(agents):
                _await_ready(agent, f"replica agent {m}")
            os.environ.update(env)
            yield env
        finally:
            if persist_dir is not None and agents:
                _persist(address, job, JobKeys(read_secret(secret), job), persist_dir)
            for agent in agents:
                agent.terminate()
            for agent in agents:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=10)
            remove_replicas(job)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            del store


def _persist(address: str, job: str, auth: JobKeys, directory: Path) -> None:
    try:
        written = persist_committed(kvstore.JobStore(kvstore.connect(address), job, auth), Path(directory))
    except Exception as exc:  # the launch is ending anyway: say why the version stayed in memory
        warnings.warn(f"gemini: could not write the committed version to {directory}: {exc}", stacklevel=2)
        return
    announce(written)


def emulated_env(cluster: Any, machine: int, store_port: int, job: str, secret: Path) -> dict[str, str]:
    """What machine ``machine``'s trainers need to find the store and their agent."""
    return {STORE_ENV: f"{cluster.address(0)}:{store_port}", MACHINE_ENV: str(machine),
            MACHINES_ENV: str(cluster.nodes), JOB_ENV: job, SECRET_ENV: str(secret)}


def start_emulated_agent(cluster: Any, machine: int, store_port: int, job: str, secret: Path,
                         **popen_kwargs: Any) -> subprocess.Popen:
    """Machine ``machine``'s replica agent, inside its namespace; returns once it serves."""
    argv = agent_argv(machine, cluster.nodes, f"{cluster.address(machine)}:{AGENT_PORT}",
                      f"{cluster.address(0)}:{store_port}", job)
    env = {SECRET_ENV: str(secret), **popen_kwargs.pop("env", {})}
    process = cluster.popen(machine, argv, stdout=subprocess.PIPE, text=True, env=env, **popen_kwargs)
    _await_ready(process, f"replica agent on emulated machine {machine}")
    return process


def persist_emulated(cluster: Any, store_port: int, job: str, secret: Path, directory: Path) -> None:
    """Write the committed version to ``directory`` from inside machine 0 (the store is reachable only
    there); a failure is reported, not raised: the launch is ending anyway."""
    argv = [sys.executable, "-m", "ddlscale.ckpt.drain", "--store", f"{cluster.address(0)}:{store_port}",
            "--job", job, "--dir", str(directory)]
    done = cluster.popen(0, argv, env={SECRET_ENV: str(secret)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        output, _ = done.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        done.kill()
        output = f"gemini: writing the committed version to {directory} took over 300 s: given up"
    if output.strip():
        print(output.strip(), flush=True)
