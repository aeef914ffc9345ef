"""c10d's stores listen on the one address they are for (issue 61 item 4): the process group's store that
rank 0 hosts, on ``MASTER_ADDR`` alone — loopback for a run on one machine, the machine's own address on
the emulated cluster (torchrun's ``--local-addr``) — where torch's own TCPStore listens on every interface.
Each test checks what the kernel says is listening (``/proc/net/tcp``), in this process, one rank."""

import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import LightningEnvironment

from ddlscale.cluster import pgstore
from ddlscale.cluster.emulated import EmulatedCluster
from ddlscale.cluster.launch import run_with_restarts
from ddlscale.cluster.local import free_port
from ddlscale.strategy import DDLStrategy

EVERY_INTERFACE = {"0.0.0.0", "::"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def master(monkeypatch):
    def at(host: str) -> int:
        port = free_port()
        monkeypatch.setenv("MASTER_ADDR", host)
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.delenv(pgstore.USE_AGENT_STORE, raising=False)
        return port

    yield at
    if dist.is_initialized():
        dist.destroy_process_group()


def test_torchs_own_store_listens_on_every_interface():
    """What this replaces, and that the check can tell: the address torch binds is the wildcard."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    assert set(pgstore.listening_addresses(store.port)) & EVERY_INTERFACE


def test_the_strategys_process_group_store_listens_on_loopback_alone(master):
    """DDLStrategy's set-up, as Lightning's spawn launcher runs it on one machine (MASTER_ADDR 127.0.0.1)."""
    port = master("127.0.0.1")
    strategy = DDLStrategy(parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment())
    strategy.setup_distributed()
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert pgstore.listening_addresses(port) == ["127.0.0.1"]


def test_the_store_listens_on_the_machines_own_address_as_torchrun_names_it(master):
    """On the emulated cluster torchrun's --local-addr (the machine's address) becomes MASTER_ADDR: the store
    listens there and nowhere else. 127.0.0.2 stands for such an address: one this host has, not the
    wildcard, and not the loopback address a client would otherwise reach it by."""
    port = master("127.0.0.2")
    pgstore.init_process_group("gloo", 0, 1, datetime.timedelta(seconds=30))
    assert pgstore.listening_addresses(port) == ["127.0.0.2"]
    dist.barrier()  # the group works over it


def test_a_host_name_is_left_to_torch(master):
    """SLURM's or torchrun's default MASTER_ADDR, a host name, is resolved by each machine for itself (one
    that maps its own name to 127.0.1.1 would listen where no other connects): torch's own store then."""
    port = master("localhost")
    pgstore.init_process_group("gloo", 0, 1, datetime.timedelta(seconds=30))
    assert set(pgstore.listening_addresses(port)) & EVERY_INTERFACE


def test_local_restarts_run_torchrun_with_stores_on_loopback(tmp_path, monkeypatch):
    """cluster=local with restarts: torchrun's rendezvous store is the launcher's, on loopback, and each
    round's process-group store listens on --local-addr=127.0.0.1 (no --standalone, whose stores listen
    everywhere; no store shared across rounds, which torchrun's agent would host everywhere)."""
    seen = {}

    def run(argv, env=None):
        endpoint = next(a for a in argv if a.startswith("--rdzv-endpoint=")).split("=", 1)[1]
        seen.update(argv=argv, env=env, listening=pgstore.listening_addresses(int(endpoint.rsplit(":", 1)[1])))
        (tmp_path / "summary.json").write_text("{}")
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr("ddlscale.cluster.launch.subprocess.run", run)
    launch = type("Launch", (), {"devices": 2, "job": "j", "run_dir": tmp_path})()
    monkeypatch.setattr("ddlscale.cluster.launch.replace", lambda launch, **kw: launch)
    run_with_restarts(launch, 1, [])
    argv = seen["argv"]
    assert "--standalone" not in argv and "--local-addr=127.0.0.1" in argv and "--rdzv-conf=is_host=false" in argv
    assert seen["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert seen["listening"] == ["127.0.0.1"]
    assert os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") is None  # the launcher's own env is untouched


class _OnThisHost(EmulatedCluster):
    """An emulated cluster never brought up whose machine 0 is this host at 127.0.0.2: what it is asked to
    run, runs here."""

    def address(self, machine):
        return "127.0.0.2"

    def popen(self, machine, argv, env=None, **kwargs):
        return subprocess.Popen(argv, env={**os.environ, **(env or {})}, cwd=ROOT, **kwargs)


@pytest.mark.multiprocess
def test_the_emulated_rendezvous_store_listens_on_machine_0s_address_and_outlives_a_stop_signal():
    """torchrun's rendezvous store on the emulated cluster, which Gemini's keys live in too: on machine 0's
    own address alone, and still there after every stop signal a scheduler sends the whole job (the drain
    that follows reads it; the cluster's teardown kills it)."""
    port = free_port()
    store = _OnThisHost(2).start_rendezvous_store(port)
    try:
        assert pgstore.listening_addresses(port) == ["127.0.0.2"]
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            store.send_signal(signum)
        time.sleep(0.5)
        assert store.poll() is None
        client = dist.TCPStore("127.0.0.2", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        store.kill()
        store.wait()
        store.stdout.close()
