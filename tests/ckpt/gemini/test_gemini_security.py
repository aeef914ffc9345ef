"""Gemini on a shared cluster: hostile messages refused and counted, lengths bounded, shared memory
reserved or refused, fencing decided by the agent alone, the commit rule, and restore paths that
never unpickle."""

import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddlscale.ckpt.checkpointer import PROGRESS_FILE
from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.interleave import ReplicaSender
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaError, ReplicaRefused, ReplicaStoreBehind
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord

ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parents[2]  # gemini_job.py


def _put(job, client, version, data, outcome="failed"):
    client.begin(version, 0, len(data))
    client.data(version, 0, 0, [memoryview(data)])
    client.end(version, 0, checksum(data, "hmac-sha256", job.auth.replica))
    if outcome == "committed":
        job.commit(version, len(data))
    elif outcome is not None:
        job.decide(version, outcome)


# -- item 1: authentication -------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_the_security_drill_refuses_every_hostile_attempt():
    """``python -m ddlscale.testing.drill security``: anonymous, forged, replayed and stale requests, the
    old fault-injection op, overwriting the committed version, oversized lengths, slow connections, the
    commit record deleted, forged store records, pickled checkpoints — each refused, the committed version intact, the refusals counted."""
    result = subprocess.run([sys.executable, "-m", "ddlscale.testing.drill", "security"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("[refused]") for line in lines) == 14  # by the agent itself, counted
    assert sum(line.startswith("[held]") for line in lines) == 6  # store, client and restore checks
    assert not any("NOT REFUSED" in line or "EXECUTED" in line for line in lines)
    assert "committed version 1 intact after all attempts: True" in lines
    counters = next(line for line in lines if line.startswith("agent's refusal counters"))
    for reason in ("unauthenticated", "replayed", "stale", "unknown_op", "fenced", "bounds", "evicted", "store_behind"):
        assert f"'{reason}'" in counters


@pytest.mark.multiprocess
def test_requests_without_the_secret_or_from_a_stale_incarnation_are_refused_and_counted(job, agent):
    data = b"s" * 4096
    job.store.set(job.keys.incarnation, 3)
    with job.client(agent) as client:
        _put(job, client, 1, data, outcome="committed")
    stranger = SimpleNamespace(**{**vars(job), "auth": type(job.auth)(b"another secret!!", job.name)})
    with pytest.raises(ConnectionError, match="a reply that fails its MAC"):  # its JOIN; nor can it trust the answer
        AgentClient(agent.address, stranger.auth, 3)
    with AgentClient(agent.address, job.auth, 2) as client:
        with pytest.raises(ReplicaRefused, match="incarnation 2 is not the job's current one \\(3\\)"):
            client.get(1, 0, len(data))
    with job.client(agent) as client:
        refused = client.stat()["refused"]
        assert bytes(client.get(1, 0, len(data))) == data  # the job itself still reads it
    assert refused == {"unauthenticated": 1, "stale": 1}


@pytest.mark.multiprocess
def test_a_trainer_of_an_earlier_incarnation_cannot_begin_a_version_after_a_restart(job, agent):
    """The agent reads the incarnation afresh at BEGIN: no client of the new incarnation need have spoken
    to it first."""
    job.store.set(job.keys.incarnation, 1)
    with job.client(agent, incarnation=1) as zombie:
        _put(job, zombie, 1, b"z" * 1000, outcome=None)
        job.store.set(job.keys.incarnation, 2)  # the job restarted; this trainer was left behind
        with pytest.raises(ReplicaRefused, match="incarnation 1 is not the job's current one \\(2\\)"):
            zombie.begin(2, 0, 1000)


@pytest.mark.multiprocess
def test_store_values_not_signed_by_the_job_read_as_absent_and_are_counted(job):
    job.commit(4)
    raw = job.store.raw
    raw.set(job.keys.manifest, Manifest(step=9, world_size=1, shards=(ShardRecord(0, "m", 1, "x"),)).to_json())
    raw.set(job.keys.agent(0), "10.9.9.9:1")
    reader = kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)
    # A TCPStore SET is not acknowledged: another connection may look before the server applied it.
    reader.wait(job.keys.agent(0), 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert reader.manifest() is None and reader.get(job.keys.agent(0)) is None
        key = job.keys.incarnation  # a value signed for another key does not verify under this one
        raw.set(key, job.store.signed(job.keys.outcome(0, 1), 99))
        reader.wait(key, 10)
        assert reader.get(key, "absent") == "absent"
    assert reader.refused == 3


# -- item 2: no code execution from checkpoint bytes --------------------------------------------------
def test_restore_paths_never_unpickle(tmp_path, monkeypatch):
    """A whole training-state payload (optimizer state, RNG tuples, numpy arrays) round-trips through
    the disk tier and the snapshot stream with every unpickler disabled."""
    import random

    import numpy as np

    from ddlscale.ckpt.state.shard import PAYLOAD_FORMAT, Shard
    from ddlscale.ckpt.state.snapshot import capture, rebuild
    from ddlscale.ckpt.version.io import load_version
    from ddlscale.ckpt.version.manifest import write_manifest

    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    local = {"rank": 0, "world_size": 1, "global_step": 1, "data": {"epoch": 0, "batch": 1, "num_batches": 9},
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
             "sync": {"residual": torch.randn(5), 3: (1, 2.5)}}
    payload = {"format": PAYLOAD_FORMAT, "local": local,
               "shared": {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}}
    shard = Shard.encode(0, payload)
    (tmp_path / "s").mkdir()
    (tmp_path / "s/rank_00000.ckpt").write_bytes(shard.data)
    path = write_manifest(tmp_path, Manifest(step=1, world_size=1, shards=(
        ShardRecord(0, "s/rank_00000.ckpt", len(shard.data), shard.checksum),)))

    def refuse(*args, **kwargs):
        raise AssertionError("something unpickled checkpoint bytes")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = load_version(path, 0)
    streamed = rebuild(capture(payload, set()).to_bytes())
    for restored in (loaded, {**streamed["shared"], "ddlscale_rank": streamed["local"]}):
        assert torch.equal(restored["state_dict"]["weight"], model.weight)
        saved = optimizer.state_dict()["state"][0]
        assert all(torch.equal(restored["optimizer_states"][0]["state"][0][k], v) for k, v in saved.items())
        assert restored["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
        rng = restored["ddlscale_rank"]["rng"]
        assert rng["python"] == random.getstate() and np.array_equal(rng["numpy"][1], np.random.get_state()[1])
        assert restored["ddlscale_rank"]["sync"][3] == (1, 2.5)


@pytest.mark.parametrize("kind", ["set", "object", "numpy objects"])
def test_state_a_checkpoint_cannot_hold_is_refused_at_capture_naming_where(kind):
    import numpy as np

    from ddlscale.ckpt.state.snapshot import capture

    value, message = {"set": ({1, 2}, "builtins.set at state\\['x'\\]"),
                      "object": (SimpleNamespace(a=1), "SimpleNamespace at state\\['x'\\]"),
                      "numpy objects": (np.array([object()]), "numpy array of dtype object at state\\['x'\\]")}[kind]
    with pytest.raises(TypeError, match=message):
        capture({"x": value}, set())


@pytest.mark.parametrize("damage, error", [
    (lambda s: s[:20], "skeleton of .* bytes runs past"),
    (lambda s: s[:-1], "truncated|describes"),
    (lambda s: s + b"x", "holds .* bytes, its skeleton describes"),
])
def test_a_damaged_stream_is_refused_before_allocating(damage, error):
    from ddlscale.ckpt.state.snapshot import rebuild, to_bytes

    stream = to_bytes({"w": torch.randn(100), "n": 3})
    with pytest.raises(ValueError, match=error):
        rebuild(damage(stream))


def test_a_stream_naming_unknown_tags_or_dtypes_is_refused():
    import json
    import struct

    from ddlscale.ckpt.state.snapshot import MAGIC, rebuild

    for skeleton in ({"__ddl__": "os.system", "items": []}, {"__ddl__": "tensor", "dtype": "object", "shape": [1]},
                     {"__ddl__": "ndarray", "dtype": "O", "shape": [1], "segment": 0}):
        text = json.dumps(skeleton).encode()
        with pytest.raises(ValueError, match="unknown tag|not one a checkpoint may hold"):
            rebuild(struct.pack("<8sQ", MAGIC, len(text)) + text + b"\0" * 8)


# -- item 3: bounded, reserved ------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_begin_beyond_the_limit_is_refused_before_anything_is_reserved(job):
    agent = job.agent(max_version_bytes=1 << 20)
    with job.client(agent) as client:
        with pytest.raises(ReplicaRefused, match="a version of 2097152 bytes \\(this agent takes 16 to 1048576\\)"):
            client.begin(1, 0, 2 << 20)
    assert not list(Path("/dev/shm").glob(f"{agent.replicas.prefix}-*"))


SMALL_SHM = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from gemini_job import Job
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.gemini.protocol import LocalAgentClient, ReplicaSpaceError

job = Job(Path(sys.argv[2]))
agent = job.agent()
try:
    with job.client(agent) as client:
        client.begin(1, 0, 8 << 20)
    print("NOT REFUSED")
except ReplicaSpaceError as exc:
    print("refused:", exc)
# A version that fits is reserved in full: filling the rest of /dev/shm must not break writing it.
data = os.urandom(1 << 20)  # its buffer and the file the trainer writes: 2 MiB of the 4
with job.client(agent, cls=LocalAgentClient) as local:
    local.begin(2, 0, len(data))
    with open("/dev/shm/filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError as exc:
            print("filled /dev/shm:", exc.strerror)
    local.data(2, 0, 0, [memoryview(data)])
    local.end(2, 0, checksum(data, "hmac-sha256", job.auth.replica))
    print("written through shared memory:", bytes(local.get(2, 0, len(data))) == data)
job.close()
'''


@pytest.mark.multiprocess
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_small_dev_shm_refuses_clearly_and_a_reserved_version_never_faults(tmp_path):
    """/dev/shm of 4 MiB in a private mount namespace (Docker's default is 64 MB): BEGIN of 8 MiB is
    refused naming the free space; a 1 MiB version is reserved whole, so the trainer writing it through
    shared memory after /dev/shm filled up gets no SIGBUS."""
    (tmp_path / "job").mkdir(mode=0o700)
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    shell = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} {script} {TESTS} {tmp_path / 'job'}"
    result = subprocess.run(["unshare", "-m", "sh", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout}{result.stderr[-3000:]}"
    out = result.stdout
    assert "refused: agent" in out and "cannot reserve 8.0 MiB" in out and "in /dev/shm" in out
    assert "MiB free of 4.0 MiB" in out
    assert "filled /dev/shm: No space left on device" in out and "written through shared memory: True" in out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_training_on_a_too_small_dev_shm_stops_at_start_up_naming_why(tmp_path):
    """``python train.py ckpt=gemini`` with a 4 MiB /dev/shm (the GPT's buffers need about 38 MiB per
    machine) stops before its first step with the error naming the free space, ckpt.replicas and the
    version size, instead of training unprotected or dying of SIGBUS."""
    run = tmp_path / "run"
    command = " ".join([sys.executable, str(ROOT / "train.py"), "model=gpt", "ckpt=gemini", "trainer.devices=2",
                        "trainer.max_steps=5", "trainer.enable_progress_bar=false", f"hydra.run.dir={run}"])
    shell = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {command}"
    result = subprocess.run(["unshare", "-m", "sh", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert re.search(r"MiB free (in /dev/shm|of 4\.0 MiB)", out), out[-3000:]
    assert "ckpt.replicas=2" in out and re.search(r"of about [\d.]+ MiB each", out) and "in all" in out, out[-3000:]
    assert "Enlarge it" in out, out[-3000:]
    progress = run / PROGRESS_FILE
    assert not progress.exists() or not any(line.startswith("step ") for line in progress.read_text().splitlines())


@pytest.mark.multiprocess
def test_the_space_error_names_the_free_space_ckpt_replicas_and_the_version_size():
    from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer

    message = GeminiCheckpointer(replicas=2)._space_message(
        "agent x: cannot reserve 96.0 MiB (100663296 bytes) for version 1 of rank 0 in /dev/shm: 60.1 MiB free of "
        "64.0 MiB", 96 << 20, world=8, machines=4)
    assert "60.1 MiB free of 64.0 MiB" in message and "ckpt.replicas=2" in message
    # 2 buffers x 2 replicas x 2 ranks, and 1 file per own rank: 10 versions
    assert "versions of 96.0 MiB need about 960.0 MiB of /dev/shm per machine" in message


# -- item 4: fencing by the agent alone ---------------------------------------------------------------
@pytest.mark.multiprocess
def test_a_newer_version_whose_commit_is_undecided_is_kept_until_decided(job, agent):
    with job.client(agent) as client:
        _put(job, client, 1, b"1" * 3000, outcome="committed")
        _put(job, client, 2, b"2" * 3000, outcome=None)  # rank 0 is still counting its acknowledgements
        with pytest.raises(ReplicaError, match="both buffers of rank 0 hold versions that must be kept \\(1, 2\\)"):
            client.begin(3, 0, 3000)
        job.decide(2, "failed")
        _put(job, client, 3, b"3" * 3000)
        assert bytes(client.get(1, 0, 3000)) == b"1" * 3000 and bytes(client.get(3, 0, 3000)) == b"3" * 3000


@pytest.mark.multiprocess
def test_a_manifest_deleted_or_forged_by_a_stranger_does_not_unprotect_the_committed_version(job, agent):
    """The agent has seen version 1 committed: while the store holds no record (deleted, or one that fails
    its signature), no version begins there, and version 1 stays. Once the job writes its newest record
    again (a restart does, from what the agents saw), versions go on, version 1 still kept."""
    with job.client(agent) as client:
        _put(job, client, 1, b"1" * 3000, outcome="committed")
        _put(job, client, 2, b"2" * 3000)  # its BEGIN read the record of version 1
        job.store.raw.delete_key(job.keys.manifest)  # anyone who reaches the store can delete a key
        with pytest.raises(ReplicaStoreBehind, match="lost its commit record"):
            client.begin(3, 0, 3000)
        job.store.raw.set(job.keys.manifest, Manifest(step=3, world_size=1, shards=(
            ShardRecord(0, "m", 3000, "x"),)).to_json())  # or write one, unsigned
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ReplicaStoreBehind, match="lost its commit record"):
                client.begin(3, 0, 3000)
        assert agent.refusals["store_behind"] == 2
        job.store.restore(job.incarnation)  # the job's own writer has seen version 1's record
        _put(job, client, 3, b"3" * 3000)
        _put(job, client, 4, b"4" * 3000)
        assert bytes(client.get(1, 0, 3000)) == b"1" * 3000  # still the committed one


@pytest.mark.multiprocess
def test_a_previous_incarnations_undecided_version_is_not_kept(job, agent):
    with job.client(agent) as client:
        _put(job, client, 1, b"1" * 3000, outcome="committed")
        _put(job, client, 2, b"2" * 3000, outcome=None)  # the job died before deciding it
    job.store.set(job.keys.incarnation, 1)  # the restarted job
    with job.client(agent) as client:
        _put(job, client, 2, b"n" * 3000)
        assert bytes(client.get(1, 0, 3000)) == b"1" * 3000 and bytes(client.get(2, 0, 3000)) == b"n" * 3000


# -- item 5: the commit rule --------------------------------------------------------------------------
class _Corrupting(AgentClient):
    """A connection that flips a byte of every DATA chunk of the versions in ``versions``."""

    versions: set[int] = set()

    def data(self, version, owner, offset, pieces):
        blob = bytearray(b"".join(bytes(p) for p in pieces))
        if version in self.versions:
            blob[0] ^= 0xFF
        super().data(version, owner, offset, [memoryview(blob)])


def _two_rank_job(job, monkeypatch, missing):
    """Ranks 0 and 1 on machines 0 and 1, m = 2 (each machine holds both ranks' replicas), blocking sends;
    the replica of rank ``missing[0]`` on machine ``missing[1]`` is corrupted in transit at version 2."""
    from ddlscale.ckpt.gemini import gemini_checkpointer as gemini

    agents = [job.agent(m, 2) for m in range(2)]
    plan = PlacementPlan(2, 2)
    monkeypatch.setattr(gemini, "capture_local", lambda trainer, batch_idx: {"rank": trainer.global_rank})
    monkeypatch.setattr(gemini, "capture_shared", lambda trainer: {"w": torch.full((512,), float(trainer.global_step))})
    monkeypatch.setattr(gemini, "unchanged_until_step", lambda trainer: set())
    ranks = []
    for rank in range(2):
        checkpointer = gemini.GeminiCheckpointer(replicas=2, mode="blocking", commit_timeout_s=5)
        checkpointer.store, checkpointer.auth = job.store, job.auth
        checkpointer.plan, checkpointer.machine_of = plan, [0, 1]
        holders = list(plan.holders_of(rank))
        clients = []
        for h in holders:
            cls = type("Damaged", (_Corrupting,), {"versions": {2}}) if (rank, h) == missing else AgentClient
            clients.append(job.client(agents[h], cls=cls))
        checkpointer.sender = ReplicaSender(rank, clients, holders, 4096, 2, "blocking", "hmac-sha256",
                                            job.auth.replica, before_begin=checkpointer._before_begin,
                                            on_done=checkpointer._on_sent)
        trainer = SimpleNamespace(global_step=0, global_rank=rank, current_epoch=0, num_training_batches=100,
                                  world_size=2, is_global_zero=rank == 0)
        ranks.append((checkpointer, trainer))
    return ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("missing", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_a_version_missing_any_one_replicas_verified_ack_is_never_committed(job, monkeypatch, missing):
    """World 2 x m 2 = 4 replicas per version; one fails its holder's MAC check at version 2: 3 verified
    acks are not enough (a rule counting world-size acks would commit it), and versions 1 and 3 commit."""
    ranks = _two_rank_job(job, monkeypatch, missing)
    committed = []
    for step in (1, 2, 3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for checkpointer, trainer in reversed(ranks):  # rank 0 last: its commit reads rank 1's record
                trainer.global_step = step
                checkpointer.save(trainer, step - 1)
        committed.append((job.store.manifest().step, job.store.get(job.keys.outcome(0, step))))
        if step == 2:
            assert any("version 2 not committed (3 of 4 replicas verified)" in str(w.message) for w in caught)
    assert committed == [(1, "committed"), (1, "failed"), (3, "committed")]
    for checkpointer, _ in ranks:
        checkpointer.sender.close()
