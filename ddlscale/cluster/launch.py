"""Launch modes that start the ranks through torchrun: on this machine with restarts, or on an emulated cluster.

The app picks the mode (:class:`~ddlscale.cluster.context.Launch`); a run that Lightning launches
itself (``cluster=local`` without restarts, SLURM) or that torchrun already started needs none of
this. Each mode re-runs the app (``python -m ddlscale``) with the command line's overrides in every
rank and reads back the summary rank 0 wrote; ``services`` (the checkpointer's, see
:meth:`~ddlscale.ckpt.checkpointer.Checkpointer.services`) runs beside the ranks for the whole launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ddlscale.cluster import cpuload, dilation, pgstore, stop, storage
from ddlscale.cluster.context import Launch, Services, no_services
from ddlscale.cluster.emulated import (
    TRAIN_MODULE,
    EmulatedCluster,
    netem_available,
    resolve_latency,
    train_env,
)
from ddlscale.cluster.local import free_port
from ddlscale.comm.network import PROJECTION_WORKERS, NetworkModel
from ddlscale.units import parse_bandwidth

LOOPBACK = "127.0.0.1"
ServicesOf = Callable[[Launch], AbstractContextManager[Services]]


def run_with_restarts(launch: Launch, max_restarts: int, overrides: list[str],
                      services: ServicesOf = no_services) -> dict[str, Any]:
    """``cluster=local`` with ``cluster.max_restarts`` > 0: torchrun's elastic agent (torch's restart
    engine) runs the app's workers on this machine and restarts them all when one dies, up to that
    many times; each restart resumes from the checkpointer. The services belong to this process, so
    they outlive the workers (Gemini's restarted workers recover from its agents' memory)."""
    devices = launch.devices
    # torchrun's --standalone would host its rendezvous store, and each round's rank 0 its process-group
    # store, on every interface: the rendezvous store is this process's, on loopback, and each round's
    # store listens on --local-addr (the workers' MASTER_ADDR; ddlscale/cluster/pgstore.py).
    port = free_port()
    rendezvous = pgstore.listening_store(LOOPBACK, port, timedelta(hours=24))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={devices}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{port}", "--rdzv-conf=is_host=false",
            f"--rdzv-id={launch.job}", f"--local-addr={LOOPBACK}", f"--max-restarts={max_restarts}",
            "--module", TRAIN_MODULE, *overrides, f"hydra.run.dir={launch.run_dir}"]
    # Each round a store of its own (as on the emulated cluster): torchrun's shared one would be hosted
    # by its agent on every interface, and outlives rounds.
    with services(replace(launch, machines=1)):  # one machine, `devices` ranks; may export the workers' env
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **train_env()}
        code = subprocess.run(argv, env=env).returncode
    del rendezvous  # the store stops with its last reference
    if code:
        raise RuntimeError(f"torchrun exited with code {code} after at most {max_restarts} restarts; "
                           "see the output above")
    return json.loads((launch.run_dir / "summary.json").read_text())


class _RendezvousStore:
    """The launcher's TCPStore on machine 0, started on first use: torchrun's rendezvous, unless the
    services brought their own; a tier may keep its keys there too."""

    def __init__(self, cluster: EmulatedCluster, port: int) -> None:
        self.cluster, self.port, self.started = cluster, port, False

    def __call__(self) -> str:
        if not self.started:
            self.cluster.start_rendezvous_store(self.port)
            self.started = True
        return f"{self.cluster.address(0)}:{self.port}"


def run_on_emulated_cluster(launch: Launch, cluster_cfg: Any, overrides: list[str],
                            services: ServicesOf = no_services) -> dict[str, Any]:
    """Bring up the emulated machines, run the app under one torchrun agent per machine, tear down.

    ``cluster_cfg``: the ``cluster`` group (bandwidth, latency, dilation, port, max_restarts, storage).
    Every agent gets the same overrides, plus the machine count and this run's directory, so all ranks
    write one run's outputs; the summary gains the cost model's view of the network. With a storage
    machine (``cluster.storage.bandwidth``), it serves before any agent starts and every agent gets its
    endpoint and credentials in its environment (never in the summary or the logs).
    """
    nodes, devices, output_dir = launch.machines, launch.devices, launch.run_dir
    worker_args = [*overrides, f"trainer.num_nodes={nodes}", f"hydra.run.dir={output_dir}"]
    latency_s = resolve_latency(cluster_cfg.get("latency", "0ms"))
    choice = dilation.choose(dilation.parse(cluster_cfg.get("dilation", 1)), nodes, devices,
                             parse_bandwidth(cluster_cfg.bandwidth), latency_s)
    storage_bandwidth, storage_root = storage.check_config(_plain(cluster_cfg.get("storage")))
    with EmulatedCluster(nodes, str(cluster_cfg.bandwidth), f"{latency_s}s", dilation=choice.k,
                         ranks_per_machine=devices, cpu=str(cluster_cfg.get("cpu", "shares")),
                         storage_bandwidth=storage_bandwidth,
                         storage_root=storage_root or output_dir / "storage") as cluster:
        cpu_cap = cluster.cpu_cap()
        print(f"emulated cluster {cluster.name}: {nodes} machines x {devices} workers, "
              f"{cluster_cfg.bandwidth} NICs, {describe_latency(latency_s)}, {choice.describe()}; CPU: {cpu_cap}; "
              f"every time reported is wall time / {choice.k:g}", flush=True)
        if cluster.storage is not None:
            print(f"storage machine: {storage_bandwidth} shared by all machines, WebDAV (nginx) serving "
                  f"{cluster.storage.root}; the persistent tier's storage://", flush=True)
        storage_env = cluster.storage_env()
        ledger = cluster.cpu_ledger()
        ledger.start()
        # All emulated machines share this host's cores: split them, or OpenMP pools oversubscribe.
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (nodes * devices)))}
        port = int(cluster_cfg.port)
        on_cluster = replace(launch, cluster=cluster, rendezvous_store=_RendezvousStore(cluster, port))
        try:
            with services(on_cluster) as provided:
                if provided.rendezvous is None:
                    on_cluster.rendezvous_store()
                agents = [cluster.torchrun(i, worker_args, nproc_per_node=devices, port=port,
                                           env={**threads, **storage_env, **provided.env.get(i, {})},
                                           max_restarts=int(cluster_cfg.get("max_restarts", 0)),
                                           etcd=provided.rendezvous, run_id=launch.job)
                          for i in range(nodes)]
                try:
                    codes = _wait_all_or_first_failure(agents)
                    cpu_load = ledger.finish()  # before teardown: the machines' cgroups go with the cluster
                except BaseException:
                    # The workers first (SIGTERM: they write what they have); the services' own processes
                    # (Gemini's agents hold what goes to disk on the way out) stop as the services end.
                    stop.stop_processes(lambda: _process_trees(agents), grace_s=stop.GRACE_S)
                    raise
        finally:
            cluster.down()
    if any(codes):
        raise RuntimeError(f"emulated-cluster agents exited with codes {codes}; see the output above")
    summary_path = output_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    network = cluster.network_model(gpus_per_machine=devices)
    summary["cluster_nodes"] = nodes
    summary["cluster_bandwidth_bps"] = cluster.bandwidth_bps
    summary.update(choice.summary())
    summary["cpu_cap"] = cpu_cap
    summary["cluster_latency_s"] = latency_s
    summary["cpu_load"] = cpu_load
    summary["starved"] = cpu_load["starved"]
    print(cpuload.describe(cpu_load), flush=True)
    if storage_bandwidth is not None:
        summary["storage_bandwidth_bps"] = parse_bandwidth(storage_bandwidth)
        summary["storage_root"] = str(cluster.storage.root)
    world = summary["world_size"]
    if summary.get("bytes_sent_per_step") and world > 1:
        # A ring laid out machine by machine crosses each NIC once: one rank's volume per NIC.
        summary["wire_time_per_step_s"] = summary["bytes_sent_per_step"] * 8 / network.bandwidth_bps
        summary["projected_step_time_s"] = project_step_time(summary, network)
        print("projected step time (cost model, dense ring allreduce not overlapped): " + ", ".join(
            f"{n} workers {t * 1e3:.0f} ms" for n, t in summary["projected_step_time_s"].items()), flush=True)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def describe_latency(latency_s: float) -> str:
    if latency_s > 0:
        return f"{latency_s * 1e6:g} us one-way delay"
    why = "" if netem_available() else " (this kernel has no netem: the links' own, measured per run)"
    return f"no added delay{why}"


def _plain(node: Any) -> Any:
    """A config node as plain values (what the checks take)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def project_step_time(summary: dict[str, Any], network: NetworkModel) -> dict[str, float]:
    """Step time at 16-1024 workers: this run's non-sync time plus the model's allreduce of its gradients.

    The gradient bytes are recovered from the measured ring volume, 2 (n-1)/n of them per rank.
    """
    world = summary["world_size"]
    grad_bytes = summary["bytes_sent_per_step"] * world / (2 * (world - 1))
    local = max(summary["step_time_s"] - summary["sync_time_s"], 0.0)
    return {str(n): local + network.allreduce(grad_bytes, n) for n in PROJECTION_WORKERS}


def _process_trees(processes: list[Any]) -> dict[int, int]:
    """Each process and everything below it, as pid -> start time (see :func:`stop.stop_processes`)."""
    found: dict[int, int] = {}
    for process in processes:
        started = stop.start_time(process.pid)
        if started is not None:
            found[process.pid] = started
            found.update(stop.descendants(process.pid))
    return found


def _wait_all_or_first_failure(agents: list[Any], poll_s: float = 0.5) -> list[int | None]:
    """Exit codes of all agents, or as soon as one fails (its peers could wait on it forever; the
    cluster's teardown then kills them)."""
    while True:
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes) or any(code for code in codes):
            return codes
        time.sleep(poll_s)

