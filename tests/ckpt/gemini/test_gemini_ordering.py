"""Ordering nobody can rewind (issue 61 item 2). Anyone who reaches the store can write an old signed
commit record back (a replay: its signature still holds) or delete it. Commit records are ordered by
(incarnation, seq), numbered by their writer from the newest it has seen or written, never from the key;
the agents remember the newest they have seen; while the store is behind it they refuse BEGIN, the run
stops loudly at one step on every rank, and a restart or the drain takes the newest from the agents.

The acceptance (store replay and store delete: the run stops loudly or stays protected, never trains
unprotected) is :func:`test_a_store_set_back_stops_the_run_loudly_and_the_newest_version_survives` here,
in-process with real agents, and ``test_a_store_set_back_mid_run_stops_train_py_loudly_then_it_resumes``
end to end (slow)."""

import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from gemini_job import payload

from ddlscale.ckpt.gemini import drain, kvstore
from ddlscale.ckpt.gemini.interleave import ReplicaSender
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaStoreBehind
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.io import load_version
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord

NBYTES = 4096


def _manifest(step, incarnation):
    return Manifest(step=step, world_size=1, shards=(ShardRecord(0, "memory:rank0", 1, "hmac-sha256:0"),),
                    tier="memory", placement={"incarnation": incarnation, "machines": 1, "holders": {}})


def _fresh(job):
    """A new reader or writer of the job's store, as a restarted rank 0 or the launcher's drain makes one."""
    return kvstore.JobStore(kvstore.connect(job.address), job.name, job.auth)


def _attack(job, attack, old_record):
    """What anyone who reaches the store can do to the commit record: write an old one back, or delete it."""
    key = job.keys.manifest
    if attack == "replay":
        job.store.raw.set(key, old_record)
        job.store.raw.get(key)  # (a TCPStore SET is not acknowledged: applied once this answers)
    else:
        assert job.store.raw.delete_key(key)


def _seen_by(agents, order, timeout_s=5.0):
    """Until every agent has seen the commit record ``order`` (each reads it at every heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while any(a.view.store.newest_order != order for a in agents):
        assert time.monotonic() < deadline, [a.view.store.newest_order for a in agents]
        time.sleep(0.05)


# -- the writer ---------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("attack", ["replay", "delete"])
def test_a_writer_never_numbers_a_record_from_one_written_back(job, attack):
    """The issue's bug: the writer numbered its next record from whatever the key held, so after a replay
    (or a deletion) every later commit sat below what the agents had seen, and they ignored it as a replay
    while the store said it was committed. Now the writer refuses (StoreWentBack), writing nothing."""
    job.store.set(job.keys.incarnation, 1)
    job.store.publish(_manifest(1, 1))
    old = job.store.raw.get(job.keys.manifest)
    job.store.publish(_manifest(2, 1))
    job.store.publish(_manifest(3, 1))
    assert job.store.newest_order == (1, 3)
    _attack(job, attack, old)
    with pytest.raises(kvstore.StoreWentBack, match="went back to commit record \\(1, 1\\)|lost its commit record"):
        job.store.publish(_manifest(4, 1))
    assert (job.store.raw.get(job.keys.manifest) == old) if attack == "replay" else \
        not job.store.raw.check([job.keys.manifest])  # nothing written over it
    job.store.restore(1)  # the job's writer puts its newest forward: step 3, numbered above it
    job.store.publish(_manifest(4, 1))
    assert _fresh(job).manifest().step == 4 and job.store.newest_order == (1, 5)


@pytest.mark.multiprocess
def test_a_new_incarnation_numbers_from_one_and_outranks_every_older_record(job):
    job.store.set(job.keys.incarnation, 1)
    for step in (1, 2, 3):
        job.store.publish(_manifest(step, 1))
    restarted = _fresh(job)
    assert restarted.manifest().step == 3
    restarted.set(job.keys.incarnation, 2)
    restarted.publish(_manifest(2, 2))  # back to an earlier step, as a fall-back does: still newer
    assert restarted.newest_order == (2, 1)
    reader = _fresh(job)
    assert reader.manifest().step == 2 and reader.behind is None


# -- the agents ---------------------------------------------------------------------------------------
def _put(job, client, version, fill=1):
    data = bytes([fill]) * NBYTES
    client.begin(version, 0, NBYTES)
    client.data(version, 0, 0, [memoryview(data)])
    client.end(version, 0, checksum(data, "hmac-sha256", job.auth.replica))


@pytest.mark.multiprocess
@pytest.mark.parametrize("attack", ["replay", "delete"])
def test_agents_refuse_begin_while_the_store_is_behind_and_a_restart_puts_it_forward(job, attack):
    agents = [job.agent(m, 2) for m in range(2)]
    job.store.set(job.keys.incarnation, 1)
    with job.client(agents[0]) as client:
        _put(job, client, 1)
        job.commit(1, NBYTES)
        old = job.store.raw.get(job.keys.manifest)
        _put(job, client, 2, fill=2)
        job.commit(2, NBYTES)
    _seen_by(agents, (1, 2))
    _attack(job, attack, old)
    for agent in agents:
        with job.client(agent) as client, pytest.raises(ReplicaStoreBehind, match="no version begins here"):
            client.begin(3, 0, NBYTES)
        assert agent.refusals["store_behind"] == 1
    # The restart's rank 0: a store with no history learns the newest from the agents, raises the
    # incarnation above anything they saw, and writes the newest record again.
    restarted = _fresh(job)
    assert kvstore.consult_agents(restarted, 2) == 1
    assert restarted.manifest().step == 2 and restarted.behind is not None
    restarted.set(job.keys.incarnation, 2)
    restarted.restore(2)
    with job.client(agents[0], incarnation=2) as client:
        _put(job, client, 3, fill=3)  # versions begin again; the committed one (2) is kept
        assert bytes(client.get(2, 0, NBYTES)) == bytes([2]) * NBYTES


@pytest.mark.multiprocess
def test_an_incarnation_set_back_stops_begin_and_the_agents_tell_the_true_one(job, agent):
    """The incarnation key set back (an old signed value written again) would make every request of the
    job's trainers look newer than the store says, and a restart number its incarnation below the one
    the agents fence with. The agents refuse BEGIN, and STAT — answered whatever the incarnation asked
    with — tells a restart or the drain the highest they have seen."""
    job.store.set(job.keys.incarnation, 1)
    old = job.store.raw.get(job.keys.incarnation)
    job.store.set(job.keys.incarnation, 5)
    with job.client(agent, incarnation=5) as client:
        _put(job, client, 1)
        job.store.raw.set(job.keys.incarnation, old)
        job.store.raw.get(job.keys.incarnation)
        with pytest.raises(ReplicaStoreBehind, match="went back to 1 \\(this agent has seen 5\\)"):
            client.begin(2, 0, NBYTES)
    with AgentClient(agent.address, job.auth, 0) as anyone:
        assert anyone.stat()["seen"]["incarnation"] == 5
    assert kvstore.consult_agents(_fresh(job)) == 5


# -- the run ------------------------------------------------------------------------------------------
def _ranks(job, monkeypatch, agents):
    """Two ranks on machines 0 and 1, m = 2 (each agent holds both ranks' replicas), blocking sends, each
    with its own store connection; their state is :func:`gemini_job.payload`'s."""
    from ddlscale.ckpt.gemini import gemini_checkpointer as gemini

    plan = PlacementPlan(2, 2)
    monkeypatch.setattr(gemini, "capture_local", lambda t, b: payload(t.global_rank, 2, t.global_step)["local"])
    monkeypatch.setattr(gemini, "capture_shared", lambda t: payload(0, 2, t.global_step)["shared"])
    monkeypatch.setattr(gemini, "unchanged_until_step", lambda trainer: set())
    ranks = []
    for rank in range(2):
        checkpointer = gemini.GeminiCheckpointer(replicas=2, mode="blocking", commit_timeout_s=5)
        checkpointer.store, checkpointer.auth = _fresh(job), job.auth
        checkpointer.plan, checkpointer.machine_of, checkpointer.rank = plan, [0, 1], rank
        checkpointer.incarnation = job.incarnation
        holders = list(plan.holders_of(rank))
        checkpointer.sender = ReplicaSender(rank, [job.client(agents[h]) for h in holders], holders, 4096, 2,
                                            "blocking", "hmac-sha256", job.auth.replica,
                                            before_begin=checkpointer._before_begin, on_done=checkpointer._on_sent)
        trainer = SimpleNamespace(global_step=0, global_rank=rank, current_epoch=0, num_training_batches=1000,
                                  world_size=2, is_global_zero=rank == 0)
        ranks.append((checkpointer, trainer))
    return ranks


def _train_step(ranks, step):
    """Step ``step`` on every rank (rank 0 last: its commit reads rank 1's record): the optimizer step,
    where a decided outcome is acted on, then the version's capture and send. Returns what each rank
    raised (nothing: the step trained)."""
    raised = []
    for checkpointer, trainer in reversed(ranks):
        trainer.global_step = step
        try:
            checkpointer.on_before_optimizer_step(trainer, None, None)
        except RuntimeError as exc:
            raised.append(str(exc))
            continue
        checkpointer.save(trainer, step - 1)
    return raised


@pytest.mark.multiprocess
@pytest.mark.parametrize("attack", ["replay", "delete"])
def test_a_store_set_back_stops_the_run_loudly_and_the_newest_version_survives(job, monkeypatch, tmp_path, attack):
    """Acceptance, in-process: versions 1-4 committed, then the commit record set back to version 2's (or
    deleted). Every rank stops at the same step, within two steps, saying why; nothing is committed after
    the attack; version 4 stays intact at both agents; the drain (which trusts the agents over the store)
    writes version 4; a restart finds version 4 through the agents, restores it, and versions begin again."""
    agents = [job.agent(m, 2) for m in range(2)]
    job.store.set(job.keys.incarnation, 1)
    ranks = _ranks(job, monkeypatch, agents)
    old = None
    for step in (1, 2, 3, 4):
        assert _train_step(ranks, step) == []
        if step == 2:
            old = job.store.raw.get(job.keys.manifest)
    writer = ranks[0][0].store
    assert writer.manifest().step == 4
    _seen_by(agents, writer.newest_order)
    _attack(job, attack, old)

    stopped = None
    for step in range(5, 9):
        raised = _train_step(ranks, step)
        if raised:
            stopped = step
            assert len(raised) == 2, raised  # every rank, at the same step
            assert all("ckpt=gemini: the job's store went back" in message for message in raised), raised
            assert all("rather than training on unprotected" in message for message in raised)
            break
    assert stopped is not None and stopped <= 7, stopped  # versions 5 and 6 refused, then the stop
    assert [job.store.get(job.keys.outcome(1, v)) for v in range(5, stopped)] == ["store_went_back"] * (stopped - 5)
    for checkpointer, _ in ranks:
        checkpointer.sender.abandon()

    # The newest committed version is still whole at both agents.
    newest = writer._newest_value["manifest"]
    for agent in agents:
        with job.client(agent) as client:
            for rank in range(2):
                client.verify(4, rank, newest["shards"][rank]["checksum"])
    # The drain, from a store connection with no history (the launcher's): version 4, not 2 or nothing.
    drained = drain.drain_and_report(_fresh(job), tmp_path / "checkpoints")
    assert drained.why == "" and drained.step == 4, drained
    loaded = load_version(drained.path, rank=1)
    assert torch.equal(loaded["state_dict"]["weight"], payload(0, 2, 4)["shared"]["state_dict"]["weight"])
    # A restart: version 4 through the agents, then put forward; the agents accept versions again.
    restarted = _fresh(job)
    incarnation = 1 + max(kvstore.consult_agents(restarted, 2), restarted.newest_order[0])
    assert restarted.manifest().step == 4 and restarted.behind is not None
    restarted.set(job.keys.incarnation, incarnation)
    restarted.restore(incarnation)
    assert _fresh(job).manifest().step == 4
    with job.client(agents[1], incarnation=incarnation) as client:
        client.begin(5, 1, NBYTES)


# -- end to end (slow) --------------------------------------------------------------------------------
CNN = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=4000",
       "model.optimizer=sgd", "model.momentum=0.9", "strategy.device_time_s=0.05"]
GEMINI = ["ckpt=gemini", "ckpt.profile_steps=2", "trainer.devices=2"]


def _committed_step(raw: bytes) -> int:
    """The step a signed commit record names (its signature aside: this is the attacker's view)."""
    return int(re.search(rb'"step": (\d+)', raw).group(1))


@pytest.mark.e2e
@pytest.mark.slow  # two train.py runs, about a minute on 2 cores
@pytest.mark.parametrize("attack", ["replay", "delete"])
def test_a_store_set_back_mid_run_stops_train_py_loudly_then_it_resumes(tmp_path, attack):
    """Acceptance, end to end: ``train.py ckpt=gemini`` on the agents and store of ``local_gemini`` (the
    real-cluster recipe: the user's), the commit record set back (or deleted) mid-run by someone who
    reaches the store. The run stops within a few steps, non-zero, saying the store went back; the same
    command in another run directory resumes from memory at the agents' newest version (the store put
    forward), and trains on, protected; and the drain when the agents stop writes its last version."""
    from ckpt_runs import QUIET, ROOT, summary

    from ddlscale.ckpt.checkpointer import PROGRESS_FILE
    from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, read_secret
    from ddlscale.ckpt.gemini.env import STORE_ENV
    from ddlscale.ckpt.gemini.services import local_gemini
    from ddlscale.ckpt.version.manifest import list_manifests, read_manifest

    def steps(run):
        path = run / PROGRESS_FILE
        lines = path.read_text().splitlines() if path.exists() else []
        return [int(line.split()[1]) for line in lines if line.startswith("step ")]

    job_id = f"t{tmp_path.name}"
    log = tmp_path / "first.log"
    with local_gemini(2, job_id, persist_dir=tmp_path / "checkpoints") as env:
        store = kvstore.JobStore(kvstore.connect(env[STORE_ENV]), job_id, JobKeys(read_secret(env[SECRET_ENV]), job_id))
        key = store.keys.manifest
        first = tmp_path / "first"
        with open(log, "w") as out:  # a file, not a pipe nobody reads while we wait
            launcher = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *CNN, *GEMINI,
                                         "trainer.max_steps=1000", f"hydra.run.dir={first}", *QUIET], cwd=ROOT,
                                        stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            old = None
            while True:
                assert launcher.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "training never got going"
                raw = bytes(store.raw.get(key)) if store.raw.check([key]) else b""
                if raw and old is None and _committed_step(raw) >= 3:
                    old = raw
                if raw and _committed_step(raw) >= 10:
                    break
                time.sleep(0.05)
            newest_before = _committed_step(raw)
            attacked_at = max(steps(first))
            if attack == "replay":
                store.raw.set(key, old.decode())
            else:
                store.raw.delete_key(key)
            launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        output = log.read_text()
        assert launcher.returncode != 0, output[-3000:]
        assert "the job's store went back" in output, output[-3000:]
        assert max(steps(first)) <= attacked_at + 6, (attacked_at, max(steps(first)))  # stopped within a few steps

        # The same command, from memory: the newest version an agent saw (the newest before the attack, or
        # the one before it when no agent had read that one yet: it is seen at the next BEGIN or heartbeat).
        again = tmp_path / "again"
        resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *CNN, *GEMINI,
                                  f"trainer.max_steps={newest_before + 8}", f"hydra.run.dir={again}", *QUIET],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        result = summary(again)
        assert result["ckpt_resumed_step"] >= newest_before - 1, (result["ckpt_resumed_step"], newest_before)
        assert result["ckpt_recovery_sources"] == ["local", "local"]
        assert "writing the newest again, as the agents saw it" in resumed.stdout + resumed.stderr
        last = result["ckpt_last_committed"]
    manifests = list_manifests(tmp_path / "checkpoints")
    assert manifests and read_manifest(manifests[0]).step == last
