"""Starting Gemini's infrastructure: the job's store and one replica agent per machine.

* ``cluster=local``: :func:`local_gemini` hosts a TCPStore in the launching process and starts one
  agent per rank on loopback (each rank is its own "machine"); the spawned workers inherit the
  environment that points at them. They end with the run.
* ``cluster=emulated``: the rendezvous store on machine 0 serves Gemini's keys too, and
  :func:`start_emulated_agent` starts machine i's agent inside its namespace — also what a test or
  experiment calls to bring up a replacement machine after killing one.
* elsewhere (torchrun or SLURM on a real cluster): run ``python -m ddlscale.ckpt.agent`` on every
  machine and export ``DDLSCALE_STORE``, ``DDLSCALE_MACHINE``, ``DDLSCALE_MACHINES``, ``DDLSCALE_JOB``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from ddlscale.ckpt import kvstore
from ddlscale.ckpt.agent import remove_replicas
from ddlscale.ckpt.gemini import JOB_ENV, MACHINE_ENV, MACHINES_ENV, STORE_ENV

AGENT_PORT = 29500  # replica agents' port on emulated machines


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
def local_gemini(machines: int, job: str) -> Iterator[dict[str, str]]:
    """Store and ``machines`` agents on loopback for one run; yields (and exports) their environment."""
    address = f"127.0.0.1:{_free_port()}"
    store = kvstore.serve(address)
    agents: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in (STORE_ENV, MACHINES_ENV, JOB_ENV)}
    try:
        for m in range(machines):
            agents.append(subprocess.Popen(agent_argv(m, machines, "127.0.0.1:0", address, job),
                                           stdout=subprocess.PIPE, text=True))
        for m, agent in enumerate(agents):
            _await_ready(agent, f"replica agent {m}")
        env = {STORE_ENV: address, MACHINES_ENV: str(machines), JOB_ENV: job}
        os.environ.update(env)
        yield env
    finally:
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


def emulated_env(cluster: Any, machine: int, store_port: int, job: str) -> dict[str, str]:
    """What machine ``machine``'s trainers need to find the store and their agent."""
    return {STORE_ENV: f"{cluster.address(0)}:{store_port}", MACHINE_ENV: str(machine),
            MACHINES_ENV: str(cluster.nodes), JOB_ENV: job}


def start_emulated_agent(cluster: Any, machine: int, store_port: int, job: str, **popen_kwargs: Any) -> subprocess.Popen:
    """Machine ``machine``'s replica agent, inside its namespace; returns once it serves."""
    argv = agent_argv(machine, cluster.nodes, f"{cluster.address(machine)}:{AGENT_PORT}",
                      f"{cluster.address(0)}:{store_port}", job)
    process = cluster.popen(machine, argv, stdout=subprocess.PIPE, text=True, **popen_kwargs)
    _await_ready(process, f"replica agent on emulated machine {machine}")
    return process
