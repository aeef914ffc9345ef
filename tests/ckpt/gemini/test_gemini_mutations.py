"""Tests that fail when one of these mutations of Gemini's code is applied (issue 61 found the suite passing
with each of them):

1. **stale DATA accepted**: the agent skips the incarnation check for DATA chunks (``fence`` returns early
   for ``op == DATA``, or reads the incarnation with ``max_age_s=math.inf``) —
   :func:`test_a_stale_trainers_data_chunk_is_refused_at_once_and_lands_nowhere` fails: no refusal comes,
   the read of it times out (``TimeoutError``);
2. **publishing with a plain set instead of compare-and-set**: ``JobStore._advance`` writes its record with
   ``raw.set`` and takes it as written —
   :func:`test_a_publish_racing_a_newer_incarnation_never_overwrites_it` fails: ``DID NOT RAISE
   StaleRecord`` (incarnation 1's record went over incarnation 2's);
3. **the drain skipping the MAC**: ``drain._replica`` returns a replica of the right length without
   ``matches`` (a corrupt replica written to disk under a fresh sha256) —
   :func:`test_the_drain_never_writes_a_replica_that_fails_its_mac` fails: the drain wrote the version;
4. **END hashing the inbox instead of the copy**: ``Slot.copy_in`` passes ``source[start:end]`` to the
   digest, or END hashes the inbox whole and then copies it —
   :func:`test_end_checks_the_bytes_it_copied_not_the_inbox_a_trainer_can_still_write` fails: END is
   refused, "MAC mismatch", though the buffer holds the version as sent.

Each was checked by applying the mutation to the committed tree, running its test, and reverting.
"""

import mmap
import os
import time

import pytest

from ddlscale.ckpt.gemini import drain, kvstore
from ddlscale.ckpt.gemini.agent import server as agent_server
from ddlscale.ckpt.gemini.agent.slots import COPY_CHUNK
from ddlscale.ckpt.gemini.control import corrupt_replica
from ddlscale.ckpt.gemini.protocol import DATA, LocalAgentClient, ReplicaRefused
from ddlscale.ckpt.version.checksum import Checksum, checksum
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, manifest_names

NBYTES = 4096


# -- 1. stale DATA ------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_a_stale_trainers_data_chunk_is_refused_at_once_and_lands_nowhere(job, agent):
    """A trainer of incarnation 1 began a version; the job restarted (incarnation 2). Its next DATA request
    is refused on its header alone — a reply comes (an accepted DATA has none) and the connection
    closes — before any payload is read into the buffer. END refusing the version later is not enough:
    the chunk must not land. (Under the mutation the agent waits for the payload: no reply, and the read
    below times out.)"""
    job.store.set(job.keys.incarnation, 1)
    stale = job.client(agent, incarnation=1)
    stale.begin(1, 0, NBYTES)
    slot = agent.replicas.writing(0, 1, 1)
    job.store.set(job.keys.incarnation, 2)  # the restart
    job.store.get(job.keys.incarnation)  # (a TCPStore SET is not acknowledged: applied once this answers)
    time.sleep(2 * agent_server.DATA_FENCE_S)  # older than the fence's cache
    stale._request(DATA, 1, 0, 0, NBYTES)  # the header; its payload would follow
    stale.sock.settimeout(5)
    with pytest.raises(ReplicaRefused, match="incarnation 1 is not the job's current one \\(2\\)"):
        stale._reply()
    assert agent.refusals["stale"] == 1
    with pytest.raises(OSError):  # closed: the payload goes nowhere
        for _ in range(100):
            stale.sock.sendall(b"\xee" * NBYTES)
            time.sleep(0.01)
    assert bytes(slot.view()) == bytes(NBYTES)
    stale.close()


# -- 2. compare-and-set -------------------------------------------------------------------------------
class _Racing:
    """The store as a writer sees it, with one newer incarnation's commit landing between the writer's
    read of the record and its write (what compare-and-set is for)."""

    def __init__(self, raw, on_write):
        self.raw, self.on_write = raw, on_write

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def _race(self):
        on_write, self.on_write = self.on_write, None
        if on_write is not None:
            on_write()

    def compare_set(self, key, expected, desired):
        self._race()
        return self.raw.compare_set(key, expected, desired)

    def set(self, key, value):  # what the mutation calls instead
        self._race()
        return self.raw.set(key, value)


def _manifest(step, incarnation):
    return Manifest(step=step, world_size=1, shards=(ShardRecord(0, "memory:rank0", 1, "hmac-sha256:0"),),
                    tier="memory", placement={"incarnation": incarnation, "machines": 1, "holders": {}})


@pytest.mark.multiprocess
def test_a_publish_racing_a_newer_incarnation_never_overwrites_it(job):
    """Incarnation 1's rank 0 read the record and the job's incarnation (1), then the restart's rank 0
    (incarnation 2) published. Incarnation 1's write must fail (StaleRecord) and leave incarnation 2's
    record. (Under the mutation the write goes over it: no error, and the store holds step 5.)"""
    job.store.set(job.keys.incarnation, 1)
    job.store.publish(_manifest(4, incarnation=1))
    successor = kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)

    def restart():
        successor.set(job.keys.incarnation, 2)
        successor.publish(_manifest(3, incarnation=2))

    job.store.raw = _Racing(job.store.raw, restart)
    with pytest.raises(kvstore.StaleRecord, match="incarnation 1"):
        job.store.publish(_manifest(5, incarnation=1))
    reader = kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)
    assert reader.manifest().step == 3 and reader.newest_order == (2, 1)


# -- 3. the drain's MAC check -------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_the_drain_never_writes_a_replica_that_fails_its_mac(job, tmp_path):
    """Two ranks, each held by both agents; rank 1's replica is damaged in both agents' shared memory
    (bit rot: one byte of its tensor data, so the stream still parses). The drain writes nothing and
    says why. (Under the mutation it writes the version, rank 1's file from the damaged bytes, and
    ``why`` is empty.)"""
    agents = [job.agent(m, 2) for m in range(2)]
    manifest, _ = job.put_version(3, [agents, agents])
    for agent in agents:
        with job.client(agent) as client:
            corrupt_replica(client.stat()["holds"], 1, 3, manifest.shard(1).bytes - 5)  # the last tensor's bytes
    fresh = kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)  # as the launcher makes it
    drained = drain.drain_and_report(fresh, tmp_path / "checkpoints")
    assert drained.path is None and "rank 1 has no intact replica of step 3" in drained.why
    assert "fails its MAC" in drained.why
    assert manifest_names(tmp_path / "checkpoints") == []


@pytest.mark.multiprocess
def test_the_drain_writes_the_intact_copy_when_one_holder_is_damaged(job, tmp_path):
    agents = [job.agent(m, 2) for m in range(2)]
    manifest, streams = job.put_version(3, [agents, agents])
    with job.client(agents[0]) as client:  # rank 0's first holder
        corrupt_replica(client.stat()["holds"], 0, 3, manifest.shard(0).bytes - 5)
    drained = drain.persist_committed(kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth),
                                      tmp_path / "checkpoints")
    assert drained.why == "" and drained.step == 3


# -- 4. END checks the copy ---------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_end_checks_the_bytes_it_copied_not_the_inbox_a_trainer_can_still_write(job, agent, monkeypatch):
    """The machine's own trainer writes its version into an inbox file; END copies it into the agent's
    buffer and checks the MAC of the copy. A trainer (or one left from before a restart) that keeps
    writing into the inbox while END runs — here: as soon as END starts hashing — cannot change what END
    checks: the MAC covers exactly what the buffer holds, and the version completes as sent. (Under the
    mutation END hashes the scribbled inbox, not what it stored: the MAC fails and END is refused.)"""
    data = bytes(range(256)) * (NBYTES // 256)
    assert len(data) <= COPY_CHUNK  # one piece: copied, then hashed
    mac = checksum(data, "hmac-sha256", job.auth.replica)
    with job.client(agent, cls=LocalAgentClient) as local:
        path = local.begin(1, 0, NBYTES)
        fd = os.open(path, os.O_RDWR)
        kept = mmap.mmap(fd, NBYTES)  # the trainer's own mapping, kept past END
        os.close(fd)

        class Scribbling(Checksum):
            scribbled = False

            def update(self, piece):
                if not Scribbling.scribbled:  # the trainer writes while END hashes (once: END truncates it)
                    kept[:] = b"\xff" * NBYTES
                    Scribbling.scribbled = True
                super().update(piece)

        monkeypatch.setattr(agent_server, "Checksum", Scribbling)
        local.data(1, 0, 0, [memoryview(data)])
        local.end(1, 0, mac)
        assert Scribbling.scribbled
        assert bytes(local.get(1, 0, NBYTES)) == data
        local.verify(1, 0, mac)
        kept.close()
