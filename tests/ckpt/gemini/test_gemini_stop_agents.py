"""The agents' side of a stop that reaches every process of a job at once (issue 61 item 1): a stopping
agent takes no new version and keeps serving the ones it holds until the drain says it is over (or its
deadline passes), and agents a user started drain the committed version themselves, the root writing it."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ddlscale.ckpt.gemini import stopping
from ddlscale.ckpt.gemini.auth import SECRET_ENV
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaError
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.rng import capture_rng
from ddlscale.ckpt.state.shard import PAYLOAD_FORMAT, RANK_STATE_KEY
from ddlscale.ckpt.state.snapshot import to_bytes
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.io import load_version
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, list_manifests
from ddlscale.cluster.stop import descendants

pytestmark = pytest.mark.multiprocess


def _put(job, client, version, data, owner=0, chunk=1000):
    client.begin(version, owner, len(data))
    for offset in range(0, len(data), chunk):
        client.data(version, owner, offset, [memoryview(data)[offset:offset + chunk]])
    client.end(version, owner, checksum(data, "hmac-sha256", job.auth.replica))


def test_a_stopping_agent_takes_no_new_version_and_serves_the_one_it_holds(job, agent):
    data = bytes(range(256)) * 20
    with job.client(agent) as client:
        _put(job, client, 1, data)
        job.commit(1, len(data))
        agent.stopping.set()  # what its stop signal does first
        with pytest.raises(ReplicaError, match="stopping"):
            client.begin(2, 0, len(data))  # nothing may take the buffers the drain reads
        assert bytes(client.get(1, 0, max_bytes=len(data))) == data


def test_a_stopping_agent_serves_until_the_drain_of_its_incarnation_is_over(job, agent):
    data = bytes(range(256)) * 20
    job.store.set(job.keys.incarnation, 2)
    with job.client(agent) as client:
        _put(job, client, 1, data)
    job.commit(1, len(data))
    job.store.set(f"{job.keys.prefix}/drained", {"incarnation": 1})  # an earlier launch's drain: not this one's
    gone = threading.Event()
    threading.Thread(target=lambda: (agent.wind_down(), gone.set()), daemon=True).start()
    assert not gone.wait(1.0)  # nobody drained yet: it keeps serving
    with job.client(agent) as client:
        assert bytes(client.get(1, 0, max_bytes=len(data))) == data
    stopping.mark_drained(job.store)
    assert gone.wait(5.0)


def test_with_no_drain_a_stopping_agent_goes_at_its_deadline(job, monkeypatch):
    monkeypatch.setattr(stopping, "STOP_MARGIN_S", 0.0)
    agent = job.agent(drain_deadline_s=1.0)
    started = time.monotonic()
    agent.wind_down()
    assert 0.9 <= time.monotonic() - started < 5.0


def test_the_drains_deadline_follows_the_versions_size_and_the_rate():
    assert stopping.deadline_for(0) == stopping.FLOOR_S
    # The paper's regime: 1.2 TB through 20 Gbit/s of shared storage, twice the transfer time over the floor.
    assert stopping.deadline_for(1.2e12, 20e9) == pytest.approx(stopping.FLOOR_S + 2 * 480)
    assert stopping.deadline_for(10**9) == pytest.approx(stopping.FLOOR_S + 2 * 8e9 / stopping.DISK_RATE_BPS)
    assert stopping.series_rate(10e9, 10e9) == pytest.approx(5e9)  # fetched over a NIC, then written: in series
    assert stopping.series_rate(None, 2e9) == pytest.approx(2e9) and stopping.series_rate() is None


# -- agents a user started: the root drains ---------------------------------------------------------------
def _payload(rank, world, step, model, optimizer):
    """Rank ``rank``'s in-memory version as Gemini sends it (the rank-shared state on every rank)."""
    local = {"rank": rank, "world_size": world, "global_step": step, "rng": capture_rng(),
             "data": DataPosition(0, step, 10, step * 4 * world).to_dict(), "sync": {}}
    shared = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": step}
    return {"format": PAYLOAD_FORMAT, "local": local, "shared": shared}


def _user_agent(job, machine, persist_dir):
    """``python -m ddlscale.ckpt.gemini.agent`` as the real-cluster recipe runs it, with --persist-dir."""
    argv = [sys.executable, "-m", "ddlscale.ckpt.gemini.agent", "--machine", str(machine), "--machines", "2",
            "--bind", "127.0.0.1:0", "--store", job.address, "--job", job.name, "--persist-dir", str(persist_dir)]
    return subprocess.Popen(argv, env={**os.environ, SECRET_ENV: str(job.secret)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_user_started_agents_write_the_committed_version_on_a_stop_of_the_whole_job(job, tmp_path):
    persist = tmp_path / "checkpoints"
    agents = [_user_agent(job, m, persist) for m in range(2)]
    try:
        addresses = [a.stdout.readline().split()[1] for a in agents]
        deadline = time.monotonic() + 30
        while job.store.get(job.keys.root) is None:  # a root elected: it is the one that drains
            assert time.monotonic() < deadline, "no root agent"
            time.sleep(0.1)
        # Step 7 of two ranks, each rank's replica on both machines (m = 2), committed.
        model = nn.Linear(4, 3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        payloads = [_payload(r, 2, 7, model, optimizer) for r in range(2)]
        data = [to_bytes(p) for p in payloads]
        for address in addresses:
            with AgentClient(address, job.auth, 0) as client:
                for rank in range(2):
                    _put(job, client, 7, data[rank], owner=rank)
        shards = tuple(ShardRecord(r, f"memory:rank{r}", len(d), checksum(d, "hmac-sha256", job.auth.replica))
                       for r, d in enumerate(data))
        job.store.publish(Manifest(step=7, world_size=2, shards=shards, batch=7, tier="memory",
                                   placement={"incarnation": 0, "machines": 2, "holders": {"0": [0, 1], "1": [1, 0]}}))
        job.decide(7, "committed", incarnation=0)

        for agent in agents:  # the job's stop reaches every process at once
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            assert agent.wait(timeout=120) == 0, agent.stderr.read()[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    written = list_manifests(persist)
    assert len(written) == 1 and written[0].name == "step_000000007.manifest.json", [a.stderr.read() for a in agents]
    for rank in range(2):
        loaded = load_version(written[0], rank=rank)
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in model.state_dict().items())
        assert loaded[RANK_STATE_KEY]["data"] == payloads[rank]["local"]["data"]


def test_a_launch_derives_the_drains_rate_and_tells_the_agents_and_the_drain(tmp_path):
    """The rate a drain's bytes move at: the storage machine's link after machine 0's NIC (fetched, then
    written), ckpt.persist_bandwidth, or a plain disk's; the agents and machine 0's drain are told it."""
    from types import SimpleNamespace

    from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer
    from ddlscale.ckpt.gemini.services import Drain, drain_rate_bps

    run = str(tmp_path / "run")
    emulated = SimpleNamespace(cluster=SimpleNamespace(bandwidth_bps=10e9, storage=SimpleNamespace(bandwidth_bps=2e9)),
                               storage=True)
    on_storage = drain_rate_bps(GeminiCheckpointer(run_dir=run), emulated)
    assert on_storage == pytest.approx(1 / (1 / 10e9 + 1 / 2e9))
    local = SimpleNamespace(cluster=None, storage=False)
    assert drain_rate_bps(GeminiCheckpointer(run_dir=run), local) == stopping.DISK_RATE_BPS
    assert drain_rate_bps(GeminiCheckpointer(run_dir=run, persist_bandwidth="200mbit"), local) == pytest.approx(200e6)
    assert Drain(None, 2e9).agent_args() == ["--drain-rate", "2e+09"]
    assert Drain(45.0, 2e9).drain_args() == ["--deadline", "45", "--rate", "2e+09"]
    assert GeminiCheckpointer(run_dir=run).persistent.interval == 100  # the default cadence


def test_a_launchs_agents_signalled_with_the_whole_job_keep_the_version_for_its_drain(tmp_path, monkeypatch):
    """cluster=local's launch (local_gemini): a stop signal reaches its agents too, before the launcher's
    drain runs. They keep their replicas; the drain on the way out writes the committed version; then
    they go at once (the drain's mark), not at their deadline."""
    from ddlscale.ckpt.gemini import services
    from ddlscale.ckpt.gemini.auth import JobKeys, read_secret
    from ddlscale.ckpt.gemini.kvstore import JobStore, connect
    from ddlscale.ckpt.gemini.services import Drain, local_gemini

    # Whether they went on the drain's mark, not how fast (a busy host is slow at both): the agents wait
    # for the drain up to 320 s here (its 300 s deadline and the stop margin), and the launch's stop is
    # given 120 s before it kills them. An agent that exited by itself (0) within that saw the mark;
    # one still waiting for its deadline is killed (-SIGKILL).
    exits, stop_agents = [], services.stop_agents

    def stop_and_record(agents, grace_s=2.0):
        stop_agents(agents, grace_s=120.0)
        exits.extend(agent.returncode for agent in agents)

    monkeypatch.setattr(services, "stop_agents", stop_and_record)

    persist = tmp_path / "checkpoints"
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    payloads = [_payload(r, 2, 5, model, optimizer) for r in range(2)]
    data = [to_bytes(p) for p in payloads]
    with local_gemini(2, f"t{tmp_path.name}", persist_dir=persist, drain=Drain(deadline_s=300.0)) as env:
        auth = JobKeys(read_secret(env[SECRET_ENV]), f"t{tmp_path.name}")
        store = JobStore(connect(env["DDLSCALE_STORE"]), f"t{tmp_path.name}", auth)
        job = type("Job", (), {"auth": auth})
        for machine in range(2):
            with AgentClient(store.get(store.keys.agent(machine)), auth, 0) as client:
                for rank in range(2):
                    _put(job, client, 5, data[rank], owner=rank)
        shards = tuple(ShardRecord(r, f"memory:rank{r}", len(d), checksum(d, "hmac-sha256", auth.replica))
                       for r, d in enumerate(data))
        store.publish(Manifest(step=5, world_size=2, shards=shards, batch=5, tier="memory",
                               placement={"incarnation": 0, "machines": 2, "holders": {"0": [0, 1], "1": [1, 0]}}))
        agents = [pid for pid in descendants() if b"ddlscale.ckpt.gemini.agent" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(agents) == 2
        for pid in agents:  # the job's stop reaches them first
            os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)
    assert exits == [0, 0]  # gone on the drain's mark, not killed waiting for their deadline
    written = list_manifests(persist)
    assert [m.name for m in written] == ["step_000000005.manifest.json"]
    loaded = load_version(written[0], rank=1)
    assert loaded[RANK_STATE_KEY]["data"] == payloads[1]["local"]["data"]
