"""Issue 44's hostile-neighbour scenarios against a live agent: a planted symlink or file in shared memory,
a stale incarnation's DATA and END after a restart, a flood of connections, a silent connection; and
what a trainer's mapping can reach after its version is written."""

import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from ddlscale.ckpt.gemini.agent import server as agent_server
from ddlscale.ckpt.gemini.agent import slots
from ddlscale.ckpt.gemini.protocol import (
    HELLO,
    AgentClient,
    LocalAgentClient,
    ReplicaError,
    ReplicaRefused,
    ReplicaStoreBehind,
)
from ddlscale.ckpt.version.checksum import checksum

NBYTES = 4096


def _put(job, client, version, owner=0, fill=1):
    data = bytes([fill]) * NBYTES
    path = client.begin(version, owner, NBYTES)
    client.data(version, owner, 0, [memoryview(data)])
    client.end(version, owner, checksum(data, "hmac-sha256", job.auth.replica))
    return path


def test_replica_files_are_private_and_unpredictable(job, agent):
    with job.client(agent) as client:
        assert _put(job, client, 1) == ""  # a buffer's own file is named to no writer
        first = agent.replicas.complete(0, 1).path
        job.decide(1)
        _put(job, client, 2)
        second = agent.replicas.complete(0, 2).path
    modes = [os.stat(path).st_mode for path in (first, second)]
    job.decide(2)
    with job.client(agent, cls=LocalAgentClient) as local:  # and the file the machine's own trainer writes
        modes.append(os.stat(local.begin(3, 0, NBYTES)).st_mode)
    assert all(stat.S_IMODE(mode) == 0o600 and stat.S_ISREG(mode) for mode in modes)
    # 64 random bits in each name: the next one cannot be guessed from these.
    assert first != second and len(os.path.basename(first).rsplit("-", 1)[1]) == 16


def test_a_planted_symlink_is_never_written_through(job, agent, tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(slots.secrets, "token_hex", lambda n: "0" * 2 * n)  # the name an attacker would need
    planted = slots.shm_dir() / f"{agent.replicas.prefix}-o0-s0-{'0' * 16}"
    planted.symlink_to(victim)
    try:
        with job.client(agent) as client, pytest.raises(ReplicaError, match="exists already"):
            client.begin(1, 0, NBYTES)
        assert victim.read_bytes() == b"precious" and planted.is_symlink()
        assert agent.refusals["planted"] == 1
    finally:
        planted.unlink()


def test_a_planted_world_writable_file_receives_nothing(job, agent, monkeypatch):
    monkeypatch.setattr(slots.secrets, "token_hex", lambda n: "1" * 2 * n)
    planted = slots.shm_dir() / f"{agent.replicas.prefix}-o0-s0-{'1' * 16}"
    planted.write_bytes(b"")
    os.chmod(planted, 0o666)
    try:
        with job.client(agent) as client, pytest.raises(ReplicaError, match="exists already"):
            client.begin(1, 0, NBYTES)
        assert planted.read_bytes() == b""
    finally:
        planted.unlink()


def test_a_stale_incarnations_data_and_end_are_refused_as_soon_as_the_job_restarts(job, agent):
    job.store.set(job.keys.incarnation, 1)
    stale = job.client(agent, incarnation=1)
    stale.begin(1, 0, NBYTES)
    job.store.set(job.keys.incarnation, 2)  # a restart: rank 0 of incarnation 2 raised it
    time.sleep(2 * agent_server.DATA_FENCE_S)
    stale.data(1, 0, 0, [memoryview(bytes(NBYTES))])
    with pytest.raises((ReplicaRefused, ReplicaError, OSError)):
        stale.end(1, 0, checksum(bytes(NBYTES), "hmac-sha256", job.auth.replica))
    assert agent.refusals["stale"] == 1  # the DATA, at once; the connection is then closed
    stale.close()
    # END alone, on a connection of its own, is refused too, with no wait at all.
    late = job.client(agent, incarnation=2)
    late.begin(1, 0, NBYTES)
    late.data(1, 0, 0, [memoryview(bytes(NBYTES))])
    job.store.set(job.keys.incarnation, 3)
    with pytest.raises(ReplicaRefused, match="not the job's current one"):
        late.end(1, 0, checksum(bytes(NBYTES), "hmac-sha256", job.auth.replica))
    assert agent.refusals["stale"] == 2 and agent.replicas.complete(0, 1) is None
    late.close()


def test_a_trainers_mapping_never_reaches_a_written_version(job, agent):
    """The machine's own trainer writes through shared memory: its mapping is dropped at END, and each
    version is a new file, so whatever it kept from an earlier version cannot change a later one."""
    with job.client(agent, cls=LocalAgentClient) as client:
        path = _put(job, client, 1)
        assert client._map is None
        job.decide(1)
        second = _put(job, client, 2, fill=2)
    assert path != second  # a new file: the first one's mapping (had it been kept) is not this one
    held = agent.replicas.complete(0, 2)
    assert bytes(held.view()) == bytes([2]) * NBYTES


# A trainer that keeps its mapping of the file BEGIN named past END (left over from before a restart, or
# buggy): it maps the file, waits for the version to complete, then writes over it.
KEEPER = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
kept = mmap.mmap(fd, int(sys.argv[2]))
os.close(fd)
print("mapped", flush=True)
sys.stdin.readline()
kept[:] = b"\xff" * len(kept)
kept.flush()
print("written", flush=True)
"""


@pytest.mark.multiprocess
def test_a_mapping_kept_past_end_cannot_change_the_complete_version(job, agent):
    """Item 5: a committed buffer is never mapped writable by a trainer. The file a trainer writes is not
    the buffer that becomes complete: END copies it into the agent's own buffer (checking the MAC on the
    copy) and truncates it, so a write through a mapping kept past END faults (SIGBUS) and what the agent
    serves, to a reader or the drain, stays bit-identical to what was sent."""
    data = bytes(range(256)) * (NBYTES // 256)
    mac = checksum(data, "hmac-sha256", job.auth.replica)
    with job.client(agent, cls=LocalAgentClient) as local:
        path = local.begin(1, 0, NBYTES)
        keeper = subprocess.Popen([sys.executable, "-c", KEEPER, path, str(NBYTES)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert keeper.stdout.readline() == "mapped\n"
            local.data(1, 0, 0, [memoryview(data)])
            local.end(1, 0, mac)
            keeper.stdin.write("go\n")
            keeper.stdin.flush()
            assert keeper.wait(timeout=60) == -signal.SIGBUS  # the stray write faulted
            assert keeper.stdout.read() == ""  # and never went through
        finally:
            keeper.kill()
            keeper.wait()
        assert bytes(local.get(1, 0, NBYTES)) == data
        local.verify(1, 0, mac)
    assert not os.path.exists(path)  # unlinked: nothing can map it again by name
    held = agent.replicas.describe()["0"]
    assert [h["version"] for h in held if h["complete"]] == [1] and path not in [h["path"] for h in held]


def test_the_file_of_a_version_abandoned_before_end_goes_at_the_next_begin(job, agent):
    """A trainer writes one version at a time: its next BEGIN revokes the file of one it left unfinished
    (its pages go, a kept mapping faults), and at most one such file per rank is ever held."""
    with job.client(agent, cls=LocalAgentClient) as local:
        first = local.begin(1, 0, NBYTES)
        local.data(1, 0, 0, [memoryview(bytes([7]) * NBYTES)])
        job.decide(1)  # given up (a peer failed, say)
        second = _put(job, local, 2, fill=2)
    assert first != second and not os.path.exists(first) and not os.path.exists(second)
    assert bytes(agent.replicas.complete(0, 2).view()) == bytes([2]) * NBYTES


def test_the_agent_caps_its_authenticated_connections_and_says_so(job):
    """Only an authenticated connection takes a slot (every client JOINs as it connects); one more is told
    so, counted and closed; a closed one gives its slot back."""
    agent = job.agent(max_connections=3)
    held = [job.client(agent) for _ in range(3)]
    with pytest.raises(ReplicaRefused, match="at its connection cap \\(3 authenticated connections"):
        job.client(agent)
    assert agent.refusals["connections"] == 1
    held.pop().close()
    deadline = time.monotonic() + 30  # until the agent's handler thread has seen the close (a busy host: seconds)
    while len(agent.server.admission.held) >= 3:
        assert time.monotonic() < deadline, "the closed connection kept its slot"
        time.sleep(0.02)
    with job.client(agent) as client:  # room again
        assert client.stat()["machine"] == 0
    for client in held:
        client.close()


def test_a_connection_that_sends_nothing_is_closed(job, monkeypatch):
    monkeypatch.setattr(agent_server, "FIRST_REQUEST_S", 0.3)
    agent = job.agent()
    host, port = agent.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as silent:
        assert len(silent.recv(HELLO.size)) == HELLO.size
        start = time.monotonic()
        assert silent.recv(1) == b""  # closed by the agent
        assert time.monotonic() - start < 3
    with job.client(agent) as client:  # and the agent serves on
        assert isinstance(client, AgentClient) and client.stat()["machine"] == 0


def test_a_replayed_commit_record_stops_begin_and_the_committed_buffer_is_kept(job, agent):
    """An older signed manifest written back (its signature still holds) must not move the agent back: a
    BEGIN would then reuse the committed version's buffer. The agent refuses BEGIN instead, and counts it."""
    with job.client(agent) as client:
        _put(job, client, 1)
        job.commit(1, NBYTES)
        old_record = job.store.raw.get(job.keys.manifest)
        _put(job, client, 2, fill=2)
        job.commit(2, NBYTES)
        assert agent.view.committed(0) == 2  # the agent has seen step 2 committed
        job.store.raw.set(job.keys.manifest, old_record)  # the replay
        job.store.raw.get(job.keys.manifest)  # (a TCPStore SET is not acknowledged: applied once this answers)
        with pytest.raises(ReplicaStoreBehind, match="went back to commit record"):
            client.begin(3, 0, NBYTES)
        assert agent.refusals["store_behind"] == 1
    assert bytes(agent.replicas.complete(0, 2).view()) == bytes([2]) * NBYTES


def test_a_stale_incarnation_cannot_publish_over_its_successor(job):
    from ddlscale.ckpt.gemini.kvstore import StaleRecord

    job.store.set(job.keys.incarnation, 1)
    job.commit(4)
    job.store.set(job.keys.incarnation, 2)  # a restart
    with pytest.raises(StaleRecord, match="incarnation 1"):
        job.store.publish(_manifest(5, incarnation=1))
    job.store.publish(_manifest(3, incarnation=2))  # the new incarnation may go back to any step
    assert job.store.manifest().step == 3


def _manifest(step, incarnation):
    from ddlscale.ckpt.version.manifest import Manifest, ShardRecord

    return Manifest(step=step, world_size=1, shards=(ShardRecord(0, "memory:rank0", 1, "hmac-sha256:0"),),
                    tier="memory", placement={"incarnation": incarnation, "machines": 1, "holders": {}})


def test_the_jobs_store_listens_on_loopback_only(job):
    import subprocess

    port = job.address.rsplit(":", 1)[1]
    listening = [line.split()[3] for line in subprocess.run(["ss", "-ltnH"], capture_output=True,
                                                            text=True).stdout.splitlines()]
    assert f"127.0.0.1:{port}" in listening
    assert not any(address.endswith(f":{port}") and not address.startswith("127.0.0.1") for address in listening)
