"""Limits that hold (issue 61 item 3): a connection takes one of an agent's slots only once its first
request authenticates; unauthenticated ones push each other out (the oldest of a peer first); every
message has a deadline for the whole of it, not for each recv; at the cap, a connection of an older
incarnation gives its slot up.

The acceptance (300 slow connections per agent: the stop-time drain and a restart's recovery still
succeed) is :func:`test_300_slow_connections_per_agent_leave_the_drain_and_a_recovery_working`."""

import socket
import time

import pytest

from ddlscale.ckpt.gemini import drain, kvstore
from ddlscale.ckpt.gemini.agent import server as agent_server
from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer
from ddlscale.ckpt.gemini.protocol import HELLO, MAGIC, AgentClient, ReplicaError, ReplicaRefused


def _raw(agent) -> socket.socket:
    """A stranger's connection: HELLO read, nothing sent."""
    host, port = agent.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    assert len(sock.recv(HELLO.size, socket.MSG_WAITALL)) == HELLO.size
    return sock


def _closed(sock: socket.socket, within_s: float = 2.0) -> bool:
    """Whether the agent closed ``sock`` (within ``within_s``)."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.multiprocess
def test_300_slow_connections_per_agent_leave_the_drain_and_a_recovery_working(job, tmp_path):
    """Acceptance: two agents holding a committed version of two ranks, each agent then sent 300
    connections that began a request (one byte of its header) and went quiet — as one byte every 8 s
    would, which held a slot for about 35 minutes before. While they are open, the drain writes the
    version and a restarted rank fetches its replica from its own agent, then from its peer's."""
    agents = [job.agent(m, 2) for m in range(2)]
    manifest, streams = job.put_version(5, [agents, agents])
    slow = []
    for agent in agents:
        for _ in range(300):
            sock = _raw(agent)
            sock.sendall(MAGIC[:1])
            slow.append(sock)
    try:
        drained = drain.drain_and_report(kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth),
                                         tmp_path / "checkpoints")
        assert drained.why == "" and drained.step == 5, drained.why
        # A restart: each rank from its own machine's agent, and rank 1 on a replacement machine (2, which
        # holds nothing) from a peer.
        for rank, machine, source in ((0, 0, "local"), (1, 1, "local"), (1, 2, "peer:0")):
            recovering = GeminiCheckpointer(replicas=2)
            recovering.store = kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)
            recovering.auth, recovering.machine, recovering.incarnation = job.auth, machine, job.incarnation
            assert recovering._fetch(5, rank) == (streams[rank], source)
        for agent in agents:  # the strangers were pushed out, each by a newer one, and counted
            assert agent.refusals["evicted"] >= 300 - agent_server.PENDING_PER_PEER
            assert agent.refusals.get("connections", 0) == 0
    finally:
        for sock in slow:
            sock.close()


@pytest.mark.multiprocess
def test_a_first_request_trickling_in_is_closed_at_its_deadline(job, monkeypatch):
    """One byte every 0.1 s: every recv is quick, the request never whole. The deadline is the
    connection's (its first request within FIRST_REQUEST_S of HELLO), not each recv's."""
    monkeypatch.setattr(agent_server, "FIRST_REQUEST_S", 0.5)
    agent = job.agent()
    sock = _raw(agent)
    start = time.monotonic()
    with pytest.raises(OSError):
        for byte in MAGIC + bytes(200):
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
    assert time.monotonic() - start < 3 and _closed(sock)
    deadline = time.monotonic() + 2
    while agent.refusals["slow"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.refusals["slow"] == 1
    sock.close()


@pytest.mark.multiprocess
def test_a_later_message_trickling_in_is_closed_at_its_deadline(job, monkeypatch):
    """An authenticated connection (the client JOINed) may idle between requests; a message it begins
    must be whole within MESSAGE_S."""
    monkeypatch.setattr(agent_server, "MESSAGE_S", 0.5)
    agent = job.agent()
    client = job.client(agent)
    start = time.monotonic()
    with pytest.raises(OSError):
        for byte in MAGIC + bytes(200):
            client.sock.sendall(bytes([byte]))
            time.sleep(0.1)
    assert time.monotonic() - start < 3
    assert agent.refusals["slow"] == 1
    client.close()
    with job.client(agent) as again:
        assert again.stat()["machine"] == 0


@pytest.mark.multiprocess
def test_a_peers_unauthenticated_connections_push_out_its_oldest(job):
    agent = job.agent()
    limit = agent_server.PENDING_PER_PEER
    strangers = [_raw(agent) for _ in range(limit + 3)]
    assert all(_closed(s, 0.5) for s in strangers[:3])
    assert not any(_closed(s, 0.01) for s in strangers[3:])
    assert agent.refusals["evicted"] == 3
    with job.client(agent) as client:  # the job's own: pushes out one more stranger, then holds a slot
        assert client.stat()["machine"] == 0
    assert _closed(strangers[3], 0.3)
    for sock in strangers:
        sock.close()


@pytest.mark.multiprocess
def test_at_the_cap_a_connection_of_an_older_incarnation_gives_its_slot_up(job):
    """Slots are for the job's current ranks: a trainer left from before a restart gives its slot to one
    of the new incarnation; two of the same incarnation do not push each other out. An incarnation
    claimed above the job's counts as the job's."""
    agent = job.agent(max_connections=2)
    job.store.set(job.keys.incarnation, 1)
    old = [job.client(agent, incarnation=1) for _ in range(2)]
    job.store.set(job.keys.incarnation, 2)
    job.store.get(job.keys.incarnation)
    new = job.client(agent, incarnation=2)
    assert sum(_closed(c.sock, 0.3) for c in old) == 1
    second = job.client(agent, incarnation=2)
    assert all(_closed(c.sock, 0.3) for c in old)
    with pytest.raises(ReplicaRefused, match="at its connection cap"):
        AgentClient(agent.address, job.auth, 99)  # claims more than the job's: it is the job's, no more
    assert agent.refusals["connections"] == 1
    assert new.stat()["machine"] == 0 and second.stat()["machine"] == 0
    for client in (*old, new, second):
        client.close()


@pytest.mark.multiprocess
def test_a_client_pushed_out_before_its_join_is_answered_tries_again(job, monkeypatch):
    """A flood of strangers may push the job's new connection out before its JOIN is read: the client
    connects again (CONNECT_ATTEMPTS), and says so when every try was pushed out."""
    from ddlscale.ckpt.gemini import protocol

    agent = job.agent()
    pushes = iter([True, True, False])
    original = agent.server.admission.authenticated

    def pushed_out_twice(sock, incarnation):
        if next(pushes):
            sock.shutdown(socket.SHUT_RDWR)
            return True
        return original(sock, incarnation)

    monkeypatch.setattr(agent.server.admission, "authenticated", pushed_out_twice)
    with job.client(agent) as client:
        assert client.stat()["machine"] == 0
    monkeypatch.setattr(protocol, "CONNECT_ATTEMPTS", 1)
    pushes = iter([True])
    with pytest.raises(ReplicaError, match="closed 1 connections before answering"):
        job.client(agent)
