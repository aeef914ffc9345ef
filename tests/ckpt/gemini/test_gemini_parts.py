"""Gemini's parts on their own: snapshot streams, the replica agent's buffers, the interleaving plan."""

import collections
import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from gemini_job import free_port

from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.control import corrupt_replica
from ddlscale.ckpt.gemini.interleave import (
    ReplicaSender,
    Transfer,
    Wire,
    busy_periods,
    chunks_per_gap,
    gaps,
    is_stable,
    profile_gaps,
)
from ddlscale.ckpt.gemini.protocol import DATA, END, NO_VERSION, AgentClient, ReplicaError
from ddlscale.ckpt.state.snapshot import capture, rebuild
from ddlscale.ckpt.version.checksum import Checksum, checksum, matches
from ddlscale.paths import CONF_DIR


def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait for ``condition()``, which another thread makes true: a busy host may take seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# -- snapshots ------------------------------------------------------------------------------------
def _payload():
    torch.manual_seed(0)
    weight, moment = torch.randn(64, 32), torch.randn(64, 32)
    payload = {
        "state_dict": collections.OrderedDict(weight=weight, bias=torch.zeros(3)),
        "optimizer": {"state": {0: {"exp_avg": moment, "step": torch.tensor(7.0)}}},
        "buffer": torch.arange(4096, dtype=torch.float64),
        "strided": torch.randn(64, 64).t(),
        "other": ("text", 3, [torch.ones(2)]),
    }
    return payload, {weight.data_ptr(), moment.data_ptr()}


def test_snapshot_round_trip_is_bit_exact_and_keeps_container_types():
    payload, live = _payload()
    out = rebuild(capture(payload, live).to_bytes())
    assert type(out["state_dict"]) is collections.OrderedDict
    assert torch.equal(out["state_dict"]["weight"], payload["state_dict"]["weight"])
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], payload["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(out["strided"], payload["strided"]) and out["other"][:2] == ("text", 3)
    assert out["buffer"].dtype == torch.float64 and torch.equal(out["buffer"], payload["buffer"])
    small = {"bool": torch.tensor([True, False]), "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
             "int": torch.tensor(2**40), "empty": torch.empty(0, 3), "step": torch.tensor(7.0)}
    out = rebuild(capture(small, set()).to_bytes())  # all inline in the skeleton
    for key, tensor in small.items():
        assert out[key].dtype == tensor.dtype and out[key].shape == tensor.shape and torch.equal(out[key], tensor)


def test_snapshot_references_live_tensors_and_copies_the_rest():
    payload, live = _payload()
    snapshot = capture(payload, live)
    before = snapshot.to_bytes()
    payload["buffer"].add_(1)  # mutated before the step (a BatchNorm statistic, say): must not show
    assert snapshot.to_bytes() == before
    payload["state_dict"]["weight"].add_(1)  # a parameter: sent from where it lives (no copy)
    assert snapshot.to_bytes() != before


def test_snapshot_pieces_cover_any_byte_range():
    payload, live = _payload()
    snapshot = capture(payload, live)
    whole = snapshot.to_bytes()
    for offset, length in [(0, 10), (5, 9000), (snapshot.nbytes - 7, 7), (100, snapshot.nbytes - 100)]:
        got = b"".join(p.numpy().tobytes() for p in snapshot.pieces(offset, length))
        assert got == whole[offset:offset + length]


def test_rebuild_rejects_foreign_and_truncated_streams():
    payload, live = _payload()
    data = capture(payload, live).to_bytes()
    with pytest.raises(ValueError, match="not a ddlscale snapshot"):
        rebuild(b"X" * len(data))
    with pytest.raises(ValueError):
        rebuild(data[:-5])


# -- the agent ------------------------------------------------------------------------------------
def _put(job, client, version, data, mac=None, chunk=1000, outcome="failed"):
    """Write ``version`` to the agent; then record its commit outcome (``None``: leave it undecided)."""
    client.begin(version, 0, len(data))
    for offset in range(0, len(data), chunk):
        client.data(version, 0, offset, [memoryview(data)[offset:offset + chunk]])
    try:
        client.end(version, 0, mac or checksum(data, "hmac-sha256", job.auth.replica))
    finally:
        if outcome == "committed":
            job.commit(version, len(data))
        elif outcome is not None:
            job.decide(version, outcome)


@pytest.mark.multiprocess
def test_agent_stores_verifies_and_returns_a_replica(job, agent):
    data = bytes(range(256)) * 40
    with job.client(agent) as client:
        _put(job, client, 1, data)
        assert bytes(client.get(1, 0, max_bytes=len(data))) == data
        client.verify(1, 0, checksum(data, "hmac-sha256", job.auth.replica))
        client.verify(1, 0, checksum(data, "blake2b", job.auth.replica))  # either MAC, named in the text
        holds = client.stat()["holds"]
        assert [{k: v[k] for k in ("version", "bytes", "complete")} for v in holds["0"]] == [
            {"version": 1, "bytes": len(data), "complete": True}]


@pytest.mark.multiprocess
def test_a_mac_mismatch_never_completes_and_the_previous_version_stays(job, agent):
    good, bad = b"a" * 5000, b"b" * 5000
    with job.client(agent) as client:
        _put(job, client, 1, good, outcome="committed")
        with pytest.raises(ReplicaError, match="MAC mismatch"):
            _put(job, client, 2, bad, mac=checksum(b"something else", "hmac-sha256", job.auth.replica))
        with pytest.raises(ReplicaError, match="no complete version 2"):
            client.get(2, 0, max_bytes=5000)
        assert bytes(client.get(1, 0, max_bytes=5000)) == good
        # A plain checksum of the right bytes is no MAC: it never completes a replica either.
        with pytest.raises(ReplicaError, match="MAC mismatch"):
            _put(job, client, 3, bad, mac=checksum(bad, "sha256"))


@pytest.mark.multiprocess
def test_the_committed_version_survives_any_number_of_newer_writes(job, agent):
    """Two buffers per owner: v1 committed, v2 complete but failed; v3 must overwrite v2, never v1."""
    versions = {v: bytes([v]) * 3000 for v in (1, 2, 3, 4)}
    with job.client(agent) as client:
        _put(job, client, 1, versions[1], outcome="committed")
        _put(job, client, 2, versions[2])
        _put(job, client, 3, versions[3])
        assert bytes(client.get(1, 0, 3000)) == versions[1] and bytes(client.get(3, 0, 3000)) == versions[3]
        with pytest.raises(ReplicaError):
            client.get(2, 0, 3000)
        job.commit(3, 3000)  # now 3 is committed: 1 may go
        _put(job, client, 4, versions[4])
        assert bytes(client.get(3, 0, 3000)) == versions[3] and bytes(client.get(4, 0, 3000)) == versions[4]
    first, second = agent.replicas.slots[0]
    assert first.buf is not second.buf  # the two buffers never alias


@pytest.mark.multiprocess
def test_a_sender_dying_mid_version_leaves_the_committed_one_intact(job, agent):
    committed = b"c" * 4000
    with job.client(agent) as client:
        _put(job, client, 1, committed, outcome="committed")
    dying = job.client(agent)
    dying.begin(2, 0, 4000)
    dying.data(2, 0, 0, [memoryview(b"x" * 1000)])
    dying.sock.shutdown(__import__("socket").SHUT_RDWR)
    dying.close()
    time.sleep(0.1)
    with job.client(agent) as client:
        assert bytes(client.get(1, 0, 4000)) == committed
        assert bytes(client.get(NO_VERSION, 0, 4000)) == committed  # the newest complete one
        with pytest.raises(ReplicaError):
            client.get(2, 0, 4000)


@pytest.mark.multiprocess
def test_the_committed_version_is_never_rewritten_not_even_by_its_own_number(job, agent):
    """After a fall-back to a disk version behind the committed one, replayed steps reach the committed
    version's number again: that must not reset the only copy in memory, whatever the client sends."""
    committed, replayed = b"c" * 4000, b"r" * 4000
    with job.client(agent) as client:
        _put(job, client, 10, committed, outcome="committed")
        with pytest.raises(ReplicaError, match="version 10 of rank 0 is the committed one"):
            client.begin(10, 0, len(replayed))
        assert bytes(client.get(10, 0, 4000)) == committed  # intact, and the connection still in step
    job.store.clear_manifest("fell back to disk", job.incarnation)  # the job itself says nothing is committed any more
    with job.client(agent) as client:
        _put(job, client, 10, replayed)
        assert bytes(client.get(10, 0, 4000)) == replayed


@pytest.mark.parametrize("algorithm, key", [("sha256", None), ("hmac-sha256", b"k" * 32), ("blake2b", b"k" * 32)])
def test_a_checksum_catches_every_single_bit_flip_and_streams_like_one_shot(algorithm, key):
    data = bytearray(torch.randint(0, 256, (3000,), dtype=torch.uint8).numpy().tobytes())
    expected = checksum(data, algorithm, key)
    assert expected.startswith(f"{algorithm}:") and matches(data, expected, key)
    streamed = Checksum(algorithm, key)
    for offset in range(0, len(data), 700):
        streamed.update(memoryview(data)[offset:offset + 700])
    assert streamed.text() == expected
    for bit in range(0, len(data) * 8, 37):
        data[bit // 8] ^= 1 << bit % 8
        assert not matches(data, expected, key)
        data[bit // 8] ^= 1 << bit % 8
    if key is not None:
        assert not matches(data, expected) and not matches(data, expected, b"another key")
    with pytest.raises(ValueError, match="md5"):
        Checksum("md5")
    with pytest.raises(ValueError, match="not a checksum"):
        matches(data, "md5:00")


@pytest.mark.multiprocess
def test_an_unknown_mac_algorithm_never_completes_a_replica(job, agent):
    with job.client(agent) as client:
        with pytest.raises(ReplicaError, match="MAC mismatch"):
            _put(job, client, 1, b"q" * 100, mac="md5:0123")
        client.stat()  # the connection is still in step


@pytest.mark.multiprocess
def test_corruption_is_caught_by_verify(job, agent):
    data = b"z" * 4000
    with job.client(agent) as client:
        _put(job, client, 1, data)
        corrupt_replica(client.stat()["holds"], 0, 1, 1234)  # bit rot in the shared-memory file
        with pytest.raises(ReplicaError, match="missing or corrupt"):
            client.verify(1, 0, checksum(data, "hmac-sha256", job.auth.replica))


@pytest.mark.multiprocess
def test_unreachable_agent_and_store_fail_clearly(job):
    port = free_port()
    with pytest.raises(ReplicaError, match=f"127.0.0.1:{port} unreachable"):
        AgentClient(f"127.0.0.1:{port}", job.auth, 0, timeout_s=1)
    with pytest.raises(ConnectionError, match=f"ckpt.store 127.0.0.1:{port}: key-value store unreachable"):
        kvstore.connect(f"127.0.0.1:{port}", timeout_s=1)
    with pytest.raises(ValueError, match="ckpt.store must be HOST:PORT"):
        kvstore.connect("nowhere")


@pytest.mark.multiprocess
def test_agents_elect_one_root_that_reports_a_dead_machine(job):
    # A silence of failure_timeout_s means a dead machine: 2 s, which a live agent's 0.1 s heartbeats never
    # leave on a busy host either (all three agents' threads share this process).
    agents = [job.agent(m, 3, heartbeat_s=0.1, failure_timeout_s=2.0) for m in range(3)]
    _until(lambda: any(a.is_root for a in agents), "no root elected")
    assert sum(a.is_root for a in agents) == 1
    root = next(a for a in agents if a.is_root)
    root.stop()  # the root's machine dies: another agent must take over and report it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.store.get(job.keys.failed(root.machine)) is None:
        time.sleep(0.1)
    assert job.store.get(job.keys.failed(root.machine)) is not None
    survivors = [a for a in agents if a is not root]
    assert sum(a.is_root for a in survivors) == 1
    events = job.store.get(job.keys.events)
    assert {"event": "failed", "machine": root.machine} in [{k: e[k] for k in ("event", "machine")} for e in events]
    assert root.machine not in job.store.get(job.keys.alive)


# -- interleaving ---------------------------------------------------------------------------------
def test_gaps_between_merged_busy_periods():
    assert busy_periods([(5, 6), (1, 3), (2, 4)]) == [(1, 4), (5, 6)]
    assert gaps([(1, 3), (2, 4), (5, 6)], horizon=10) == [1, 1, 4]
    assert gaps([], horizon=2.5) == [2.5]
    assert profile_gaps([[1, 2, 3], [3, 2, 1], [2, 2, 2], [9, 9]]) == [2, 2, 2]  # modal length, median
    assert chunks_per_gap([0.1, 0.05, 0.0], chunk_s=0.01, mu=0.8) == [8, 4, 0]
    assert is_stable([1.0] * 9 + [5.0]) and not is_stable([1.0, 1.5, 2.0, 1.0])


KEY = b"k" * 32  # a replica key for senders writing to stand-ins


def _sender(destinations, mode="gemini", chunk_bytes=1000, subbuffers=2, on_done=lambda t: None, key=KEY, **kwargs):
    """A sender of rank 0 whose destinations are machines 0, 1, ... in order."""
    return ReplicaSender(0, destinations, list(range(len(destinations))), chunk_bytes=chunk_bytes,
                         subbuffers=subbuffers, mode=mode, checksum="hmac-sha256", key=key,
                         before_begin=kwargs.pop("before_begin", lambda t: None), on_done=on_done, **kwargs)


class _Recorder:
    """Stands in for an agent connection; records when each chunk went and what the wire was doing."""

    def __init__(self, wire):
        self.wire, self.sent, self.data_bytes = wire, [], bytearray()
        self.address = "fake"

    def begin(self, version, owner, nbytes):
        self.data_bytes = bytearray(nbytes)

    def data(self, version, owner, offset, pieces):
        self.sent.append(self.wire())
        blob = b"".join(bytes(p) for p in pieces)
        self.data_bytes[offset:offset + len(blob)] = blob

    def end(self, version, owner, expected):
        if not matches(self.data_bytes, expected, KEY):
            raise ReplicaError("MAC mismatch")

    def close(self):
        pass


@pytest.mark.parametrize("mode", ["gemini", "unpipelined"])
def test_sender_fills_only_idle_gaps_up_to_the_plan_and_the_rest_at_the_deadline(mode):
    state = {"wire": Wire(completed=0, idle=True, finished=False)}
    recorder = _Recorder(lambda: state["wire"])
    done = []
    sender = _sender([recorder], mode, chunk_bytes=1024, subbuffers=3, on_done=done.append, wire=lambda: state["wire"])
    sender.plan = [2, 0, 1]  # gap 0: two chunks, gap 1: none, last gap: one
    data = torch.randint(0, 255, (40 * 1024,), dtype=torch.uint8)
    snapshot = capture({"x": data}, set())
    sender.submit(Transfer(5, snapshot))
    sender.iteration_started()
    # The sender thread runs when the host lets it: wait for what it must send; the sleeps give it time
    # to send more than it may (which a busy host can only hide, never fake).
    _until(lambda: len(recorder.sent) >= 2, "gap 0's chunks not sent")
    time.sleep(0.1)
    assert len(recorder.sent) == 2  # gap 0's quota
    state["wire"] = Wire(completed=0, idle=False, finished=False)  # a collective in flight
    time.sleep(0.05)
    state["wire"] = Wire(completed=1, idle=True, finished=False)  # gap 1: nothing planned
    time.sleep(0.05)
    assert len(recorder.sent) == 2
    state["wire"] = Wire(completed=0, idle=True, finished=True)  # after the last collective
    _until(lambda: len(recorder.sent) >= 3, "the last gap's chunk not sent")
    time.sleep(0.1)
    assert len(recorder.sent) == 3
    assert all(w.idle for w in recorder.sent)
    sender.deadline()  # everything left goes now, and is checked
    assert bytes(recorder.data_bytes) == snapshot.to_bytes()
    assert done and done[0].verified == [0] and done[0].error is None
    sender.close()


def test_a_transfers_time_to_complete_is_emulated_time_under_dilation():
    """captured and finished on one clock: at k = 2 the span was once -16000 s (wall minus emulated)."""
    from ddlscale import clock

    recorder = _Recorder(lambda: None)
    with clock.dilated(2):
        sender = _sender([recorder], "blocking", chunk_bytes=4096)
        transfer = Transfer(1, capture({"x": torch.arange(1000)}, set()))
        sender.submit(transfer)
        assert transfer.finished is not None and 0 <= transfer.finished - transfer.captured < 60


def test_blocking_mode_sends_everything_before_submit_returns():
    recorder = _Recorder(lambda: None)
    sender = _sender([recorder], "blocking", chunk_bytes=4096)
    snapshot = capture({"x": torch.arange(10_000)}, set())
    transfer = Transfer(1, snapshot)
    sender.submit(transfer)
    assert transfer.done.is_set() and bytes(recorder.data_bytes) == snapshot.to_bytes()
    with pytest.raises(ValueError, match="ckpt.mode must be one of"):
        _sender([], "eager")


@pytest.mark.multiprocess
def test_sender_thread_pipeline_matches_the_stream_across_many_chunks(job, agent):
    sender = _sender([job.client(agent)], subbuffers=4, key=job.auth.replica)
    snapshot = capture({"x": torch.randn(50_000)}, set())
    transfer = Transfer(3, snapshot)
    sender.submit(transfer)
    threading.Timer(0.01, sender.iteration_started).start()
    sender.deadline()
    assert transfer.error is None and transfer.verified == [0]
    with job.client(agent) as reader:
        assert bytes(reader.get(3, 0, snapshot.nbytes)) == snapshot.to_bytes()
    sender.close()


class _Flaky(AgentClient):
    """A real agent connection whose requests fail like a timeout: ``fail`` holds (op, version) pairs
    failed once — DATA with half its payload on the wire, END with its reply unread; the first byte of
    every version in ``corrupt`` is flipped on the way, so the agent's MAC check fails."""

    def __init__(self, job, agent, fail=(), corrupt=()):
        super().__init__(agent.address, job.auth, job.incarnation, timeout_s=5.0)
        self.fail, self.corrupt = set(fail), set(corrupt)

    def data(self, version, owner, offset, pieces):
        blob = b"".join(bytes(p) for p in pieces)
        if offset == 0 and version in self.corrupt:
            blob = bytes([blob[0] ^ 0xFF]) + blob[1:]
        if ("data", version) in self.fail:
            self.fail.discard(("data", version))
            self._request(DATA, version, owner, offset, len(blob))
            self.sock.sendall(blob[:len(blob) // 2])
            raise TimeoutError("timed out")
        super().data(version, owner, offset, [memoryview(blob)])

    def end(self, version, owner, expected):
        if ("end", version) in self.fail:
            self.fail.discard(("end", version))
            text = expected.encode()
            self._request(END, version, owner, len(text), text=text)
            raise TimeoutError("timed out")
        super().end(version, owner, expected)


@pytest.mark.multiprocess
@pytest.mark.parametrize("op", ["data", "end"])
def test_a_failed_request_gets_a_fresh_connection_and_a_failed_mac_never_counts(job, agent, op):
    """On the old connection the agent would read the next header as DATA payload, or the next END would
    read BEGIN's OK and count a copy that failed its MAC."""
    client = _Flaky(job, agent, fail=[(op, 1)], corrupt=[2])
    done = []
    sender = _sender([client], "blocking", on_done=done.append, key=job.auth.replica)
    snapshots = {v: capture({"x": torch.full((1000,), float(v))}, set()) for v in (1, 2, 3)}
    for version, snapshot in snapshots.items():
        sender.submit(Transfer(version, snapshot))
    assert [t.verified for t in done] == [[], [], [0]]
    assert "timed out" in done[0].error and "MAC mismatch" in done[1].error and done[2].error is None
    with job.client(agent) as reader:
        assert bytes(reader.get(3, 0, snapshots[3].nbytes)) == snapshots[3].to_bytes()
    sender.close()


def _failing_snapshot(fail_at):
    """A snapshot whose staging copy fails from byte ``fail_at`` on (a failed device copy, say)."""
    snapshot = capture({"x": torch.randn(20_000)}, set())
    pieces = snapshot.pieces

    def failing(offset, length):
        if offset >= fail_at:
            raise RuntimeError("copy to the staging buffer failed")
        return pieces(offset, length)

    snapshot.pieces = failing
    return snapshot


class _Breaks(_Recorder):
    """A holder whose connection breaks at the third chunk."""

    def data(self, version, owner, offset, pieces):
        if len(self.sent) == 2:
            raise ConnectionResetError("connection reset by peer")
        super().data(version, owner, offset, pieces)


@pytest.mark.parametrize("failing", ["copier", "send"])
def test_a_failed_copy_or_send_fails_the_version_without_hanging_and_frees_its_snapshot(failing):
    """A copier that raised left the sender waiting for its next chunk forever; a send given up part-way
    left the copier waiting for a sub-buffer forever, holding the snapshot."""
    holder = (_Recorder if failing == "copier" else _Breaks)(lambda: None)
    done = []
    sender = _sender([holder], subbuffers=3, on_done=done.append)
    snapshot = _failing_snapshot(10_000) if failing == "copier" else capture({"x": torch.randn(20_000)}, set())
    released = weakref.ref(snapshot)
    transfer = Transfer(1, snapshot)
    del snapshot
    sender.submit(transfer)
    sender.iteration_started()
    assert transfer.done.wait(10) and transfer.settled.wait(10), "the sender hung"
    assert done == [transfer] and transfer.verified == []
    assert ("staging buffer failed" if failing == "copier" else "connection reset") in transfer.error
    gc.collect()
    assert released() is None  # nothing (no stuck copier) holds the snapshot
    assert not any(t.name == "gemini-copier" for t in threading.enumerate())
    sender.close()


def test_a_failed_commit_fails_its_version_and_the_sender_goes_on():
    """Commit bookkeeping that raised (the store unreachable, say) killed the sender thread, and the next
    step's deadline waited forever for a version nobody would send."""
    calls = []

    def on_done(transfer):
        calls.append(transfer.version)
        if transfer.version == 1:
            raise ConnectionError("store unreachable")

    sender = _sender([_Recorder(lambda: None)], on_done=on_done)
    transfers = [Transfer(v, capture({"x": torch.full((500,), float(v))}, set())) for v in (1, 2)]
    with pytest.warns(UserWarning, match="committing version 1: store unreachable"):
        for transfer in transfers:
            sender.submit(transfer)
            sender.iteration_started()
            assert transfer.done.wait(10) and transfer.settled.wait(10), "the sender hung"
    assert calls == [1, 2] and "store unreachable" in transfers[0].error and transfers[1].error is None
    sender.close()


def _one_rank_checkpointer(monkeypatch, job, captured):
    """Rank 0 of a one-machine job: a Gemini checkpointer on the job's store, its sender writing into a
    recorder, with each save capturing ``captured()``; and a stand-in trainer."""
    from types import SimpleNamespace

    from ddlscale.ckpt.gemini import gemini_checkpointer as gemini
    from ddlscale.ckpt.gemini.placement import PlacementPlan

    checkpointer = gemini.GeminiCheckpointer(replicas=1)
    checkpointer.store, checkpointer.auth = job.store, job.auth
    checkpointer.plan, checkpointer.machine_of = PlacementPlan(1, 1, "mixed"), [0]
    checkpointer.sender = _sender([_Recorder(lambda: None)], chunk_bytes=4096, before_begin=checkpointer._before_begin,
                                  on_done=checkpointer._on_sent)
    monkeypatch.setattr(gemini, "capture_local", lambda trainer, batch_idx: {"sync": captured()})
    monkeypatch.setattr(gemini, "capture_shared", lambda trainer: {})
    monkeypatch.setattr(gemini, "unchanged_until_step", lambda trainer: set())
    trainer = SimpleNamespace(global_step=0, current_epoch=0, num_training_batches=100, world_size=1,
                              is_global_zero=True)
    return checkpointer, trainer


def _save_steps(checkpointer, trainer, steps: int) -> list[float]:
    """Save versions 1..steps, each next iteration's deadline first; what each deadline waited."""
    waited = []
    for step in range(1, steps + 1):
        if checkpointer.transfers:  # the next iteration starts; its optimizer step is the deadline
            checkpointer.sender.iteration_started()
            waited.append(checkpointer.sender.deadline())
        trainer.global_step = step
        checkpointer.save(trainer, step - 1)
    return waited


@pytest.mark.multiprocess
def test_only_the_version_in_flight_keeps_its_snapshot(monkeypatch, job):
    """Finished transfers stay listed for the figures, but not their snapshots: each holds copies of the
    state the next step changes (error feedback: a model's worth), so keeping them grows every step."""
    residual = torch.randn(10_000)  # not live: copied at every capture, like error feedback
    checkpointer, trainer = _one_rank_checkpointer(monkeypatch, job, lambda: residual)
    _save_steps(checkpointer, trainer, 4)
    assert [t.snapshot is not None for t in checkpointer.transfers] == [False, False, False, True]
    checkpointer.sender.close()
    assert all(t.snapshot is None for t in checkpointer.transfers)
    figures = checkpointer.figures(trainer)
    assert figures["ckpt_committed"] == 4 and figures["ckpt_bytes"] > residual.numel() * 4


@pytest.mark.multiprocess
def test_a_commit_that_raises_says_failed_and_the_next_version_does_not_wait_for_it(monkeypatch, job):
    """Every rank's next version waits for the outcome key; a commit that raised before writing it held
    each of them for commit_timeout_s + slack (40 s), and that version then failed too."""
    from ddlscale.ckpt.gemini import gemini_checkpointer as gemini

    checkpointer, trainer = _one_rank_checkpointer(monkeypatch, job, lambda: torch.randn(1000))
    to_dict, calls = gemini.Manifest.to_dict, []

    def first_fails(manifest):
        calls.append(manifest.step)
        if len(calls) == 1:
            raise OSError("manifest could not be written")
        return to_dict(manifest)

    monkeypatch.setattr(gemini.Manifest, "to_dict", first_fails)
    with pytest.warns(UserWarning, match="committing version 1: manifest could not be written"):
        waited = _save_steps(checkpointer, trainer, 3)
        checkpointer.sender.close()
    assert max(waited) < checkpointer.commit_timeout_s  # no version sat out the outcome wait
    assert calls == [1, 2, 3] and checkpointer.committed == [2, 3]
    assert job.store.get(job.keys.outcome(checkpointer.incarnation, 1)) == "failed"


@pytest.mark.multiprocess
def test_falling_back_to_disk_forgets_the_stale_committed_version(monkeypatch, tmp_path, job):
    """Training goes back to the disk version, so its replayed steps must not be kept from their buffers
    by the old manifest (whose version could not be restored); with no disk version it stays, so a
    restart fails the same clear way instead of starting from scratch."""
    from ddlscale.ckpt.gemini import gemini_checkpointer as gemini
    from ddlscale.ckpt.gemini import recovery

    (tmp_path / "disk").mkdir()
    checkpointer = gemini.GeminiCheckpointer(replicas=1, persist_every=3, persist_dir=str(tmp_path / "disk"))
    checkpointer.store = job.store
    job.commit(12)
    monkeypatch.setattr(recovery, "find_resumable", lambda directory, world, set_aside: None)
    with pytest.raises(RuntimeError, match="there is no persistent checkpoint"):
        checkpointer._fall_back(0, time.perf_counter())
    assert checkpointer.committed_manifest().step == 12
    persistent = tmp_path / "step-9.manifest.json"
    monkeypatch.setattr(recovery, "find_resumable", lambda directory, world, set_aside: persistent)
    monkeypatch.setattr(recovery, "load_version", lambda path, rank, bps, world: {"from": path})
    assert checkpointer._fall_back(0, time.perf_counter()) == {"from": str(persistent)}  # its name, as resolved
    assert checkpointer.committed_manifest() is None and job.store.manifest() == kvstore.CLEARED


def _fall_back_on(rank, world, directory):
    from ddlscale.ckpt.gemini import gemini_checkpointer as gemini
    from ddlscale.ckpt.gemini import recovery

    def mismatch(directory, world_size, set_aside):
        raise ValueError(f"ckpt.resume: step 9 holds 4 ranks, this run has {world_size}")

    recovery.find_resumable = mismatch  # in this forked worker only; rank 0 alone reads the directory
    try:
        gemini.GeminiCheckpointer(replicas=1, persist_every=3, persist_dir=directory)._fall_back(rank, 0.0)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.multiprocess
def test_a_persistent_version_that_does_not_fit_is_the_same_error_on_every_rank(tmp_path):
    from ddlscale.cluster import run_workers

    expected = "gemini: persistent fallback failed: ckpt.resume: step 9 holds 4 ranks, this run has 2"
    assert run_workers(_fall_back_on, 2, str(tmp_path), timeout_s=30) == [expected] * 2  # no rank left waiting


@pytest.mark.parametrize("env, machines", [
    ({}, [0, 0, 0, 0, 1, 1, 1, 1]),  # torchrun, 2 nodes x 4: a machine per node, whatever LOCAL_WORLD_SIZE
    ({"DDLSCALE_MACHINES": "2"}, [0, 0, 0, 0, 1, 1, 1, 1]),
    ({"DDLSCALE_MACHINES": "8"}, list(range(8))),  # cluster=local: an agent per rank
    ({"DDLSCALE_MACHINE": "3", "DDLSCALE_MACHINES": "4"}, [3] * 8),  # the launcher knows best
])
def test_a_ranks_machine_is_its_node_unless_the_launcher_says(monkeypatch, env, machines):
    from ddlscale.ckpt.gemini.env import MACHINE_ENV, MACHINES_ENV, machine_layout

    for key in (MACHINE_ENV, MACHINES_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    layouts = [machine_layout(rank, 8, node_rank=rank // 4, nodes=2) for rank in range(8)]
    assert layouts == [(m, int(env.get(MACHINES_ENV, 2))) for m in machines]


def test_machines_that_are_neither_nodes_nor_ranks_need_each_ranks_machine(monkeypatch):
    from ddlscale.ckpt.gemini.env import MACHINE_ENV, machine_layout

    monkeypatch.delenv(MACHINE_ENV, raising=False)
    monkeypatch.setenv("DDLSCALE_MACHINES", "4")
    with pytest.raises(ValueError, match="set DDLSCALE_MACHINE to each rank's machine"):
        machine_layout(5, 8, node_rank=1, nodes=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", [{}, {"DDLSCALE_MACHINES": "1"}])
def test_the_placement_check_counts_machines_as_the_workers_do(monkeypatch, env):
    """torchrun, 2 nodes x 2 workers: two machines (not four ranks), or what the launcher says."""
    from hydra import compose, initialize_config_dir

    from ddlscale.trainer import ConfigError, check_config

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("DDLSCALE_MACHINES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    overrides = ["ckpt=gemini", "ckpt.replicas=2", "cluster=torchrun", "trainer.devices=2", "trainer.num_nodes=2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if not env:
        check_config(cfg)
        return
    with pytest.raises(ConfigError, match="m \\(replicas\\) must be <= N \\(machines\\) = 1"):
        check_config(cfg)


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("overrides, message", [
    (["cluster=emulated", "cluster.nodes=2", "ckpt.replicas=3"], "m \\(replicas\\) must be <= N \\(machines\\) = 2"),
    (["ckpt.replicas=0"], "ckpt.replicas must be an integer >= 1"),
    (["trainer.devices=3", "ckpt.placement=group"], "group placement needs m \\(replicas\\) to divide N"),
    (["ckpt.placement=star"], "ckpt.placement must be one of"),
    (["ckpt.mode=eager"], "ckpt.mode must be one of"),
    (["ckpt.mu=0"], "ckpt.mu must be in"),
    (["ckpt.mu=1"], "ckpt.mu must be in \\(0, 1\\), got 1"),  # mu < 1, as the design says
    (["ckpt.commit_timeout_s=0"], "ckpt.commit_timeout_s must be a finite number > 0, got 0"),
    (["ckpt.commit_timeout_s=-5"], "ckpt.commit_timeout_s must be a finite number > 0, got -5"),
    (["ckpt.commit_timeout_s=inf"], "ckpt.commit_timeout_s must be a finite number > 0, got inf"),
    (["ckpt.commit_timeout_s=true"], "ckpt.commit_timeout_s must be a finite number > 0, got True"),
    (["ckpt.commit_timeout_s=soon"], "ckpt.commit_timeout_s must be a finite number > 0, got 'soon'"),
    (["ckpt.persist_every=3", "ckpt.persist_bandwidth=fast"], "ckpt\\.persist_bandwidth: bad bandwidth 'fast'"),
    (["ckpt.persist_every=3", "ckpt.persist_bandwidth=0"], "ckpt\\.persist_bandwidth must be > 0"),
    (["ckpt.checksum=md5"], "ckpt.checksum must be one of"),
    (["ckpt.checksum=crc32"], "ckpt.checksum must be one of hmac-sha256, blake2b"),  # no MAC: refused
    (["ckpt.every=highfreq"], "highfreq is for ckpt=disk"),
])
def test_bad_gemini_values_name_the_key(overrides, message):
    from hydra import compose, initialize_config_dir

    from ddlscale.trainer import ConfigError, check_config

    with initialize_config_dir(config_dir=str(CONF_DIR),
                               version_base="1.3"):
        cfg = compose("config", overrides=["ckpt=gemini", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


@pytest.mark.multiprocess
def test_own_machine_writes_go_straight_into_the_agents_shared_memory(job, agent):
    from ddlscale.ckpt.gemini.protocol import LocalAgentClient

    data = bytes(range(200)) * 100
    with job.client(agent, cls=LocalAgentClient) as local:
        path = local.begin(1, 0, len(data))
        assert Path(path).stat().st_mode & 0o077 == 0  # readable by the job's user only
        local.data(1, 0, 0, [memoryview(data)[:5000], memoryview(data)[5000:]])
        assert Path(path).read_bytes()[:len(data)] == data  # written straight into the shared-memory file
        local.end(1, 0, checksum(data, "hmac-sha256", job.auth.replica))
        assert not Path(path).exists()  # copied into the agent's own buffer at END, then removed
    with job.client(agent) as reader:
        assert bytes(reader.get(1, 0, len(data))) == data


@pytest.mark.multiprocess
def test_a_replacement_agent_starts_empty_and_stopping_frees_the_memory(job, agent):
    from ddlscale.ckpt.gemini.agent.slots import ReplicaStore
    from ddlscale.ckpt.gemini.protocol import shm_dir

    store = ReplicaStore("ddl-test-leftover-m0")
    slot = store.begin(0, 1, 4096, 0, None, lambda inc, v: False)
    assert slot.path.exists() and slot.path.stat().st_blocks * 512 >= 4096  # reserved, not sparse
    ReplicaStore("ddl-test-leftover-m0")  # a new agent of that machine: the old memory is gone
    assert not slot.path.exists()
    with job.client(agent) as client:
        _put(job, client, 1, b"q" * 3000)
    files = list(shm_dir().glob(f"{agent.replicas.prefix}-*"))
    assert files
    agent.stop()
    assert not any(f.exists() for f in files)
