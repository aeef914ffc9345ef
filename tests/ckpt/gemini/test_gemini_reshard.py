"""ckpt=gemini resumed on another number of machines: from the persistent tier (the in-memory replicas are
per rank of the old world size), with parameters and optimizer state as saved, and a placement of the
new machines in the versions the resumed run commits; the old size's committed manifest is cleared from
the job's store as the new size's rank 0 sets up, so its in-memory version is never restored again."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from ckpt_runs import summary, train

from ddlscale.ckpt import load_version, read_manifest
from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, read_secret
from ddlscale.ckpt.gemini.env import MACHINE_ENV, MACHINES_ENV, STORE_ENV
from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.services import local_gemini
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, list_manifests
from ddlscale.cluster.context import JOB_ENV

# 192 samples of batch 32: 3 batches per epoch on 2 workers, 2 on 3; step 4 is mid-epoch on 2 workers.
CNN = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=192",
       "model.optimizer=sgd", "model.momentum=0.9"]
GEMINI = ["ckpt=gemini", "ckpt.profile_steps=2", "ckpt.persist_every=3"]  # replicas: 2, placement: mixed


def _committed(env):
    """The committed manifest in the launch's store (the launch is still up)."""
    job = env["DDLSCALE_JOB"]
    store = kvstore.JobStore(kvstore.connect(env["DDLSCALE_STORE"]), job, JobKeys(read_secret(env[SECRET_ENV]), job))
    return store.manifest()


def _launch(machines, run, job, *overrides):
    """train.py on ``machines`` workers (cluster=local: a machine per worker), its store and agents hosted
    here so the committed manifest can be read before the launch ends and drains it to the run's
    checkpoints; (stdout, committed manifest)."""
    with local_gemini(machines, job, persist_dir=run / "checkpoints") as env:
        result = train(*CNN, *GEMINI, f"trainer.devices={machines}", f"hydra.run.dir={run}", *overrides, timeout=600)
        return result.stdout, _committed(env)


@pytest.mark.e2e
@pytest.mark.slow
def test_gemini_resumes_from_its_persistent_tier_on_another_machine_count(tmp_path):
    run, job = tmp_path / "run", f"t{tmp_path.name}"
    _, before = _launch(2, run, job, "trainer.max_steps=4")
    saved = summary(run)
    assert (before.step, before.world_size, before.placement["machines"]) == (4, 2, 2)
    # Persistent tier: step 3 by the trainers; step 4, the committed version, drained as the launch ended.
    drained = list_manifests(run / "checkpoints")[0]
    assert read_manifest(drained).step == 4 and read_manifest(drained).layout == "dcp"

    stdout, after = _launch(3, run, job, "trainer.max_steps=6")  # the same run directory, one machine more
    assert "ckpt=gemini: resuming from step 4" in stdout and "saved by 2 workers; resuming on 3" in stdout
    resumed = summary(run)
    assert resumed["ckpt_recovery_sources"] == ["persistent"] * 3 and resumed["ckpt_resumed_step"] == 4
    assert (resumed["ckpt_resumed_world_size_saved"], resumed["ckpt_resumed_world_size"]) == (2, 3)
    assert resumed["ckpt_loaded_param_sha256"] == saved["param_sha256"]  # parameters as the 2 workers left them
    assert resumed["steps"] == 6 and resumed["ckpt_last_committed"] == 6  # training went on, and so did Gemini
    # Every resumed rank restored the saved optimizer state (what each of the 3 ranks loads from the version).
    as_saved = load_version(drained, rank=0)
    momentum = as_saved["optimizer_states"][0]["state"]
    assert momentum
    for rank in range(3):
        loaded = load_version(drained, rank=rank, world_size=3)
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in as_saved["state_dict"].items())
        assert all(torch.equal(loaded["optimizer_states"][0]["state"][i]["momentum_buffer"], m["momentum_buffer"])
                   for i, m in momentum.items())
    # The resumed run's versions are placed over its 3 machines (mixed, m=2: one ring of 3), not the old 2.
    plan = PlacementPlan(3, 2, "mixed")
    assert (after.step, after.world_size) == (6, 3)
    assert after.placement["machines"] == 3 and after.placement["machine_of"] == [0, 1, 2]
    assert after.placement["holders"] == {str(r): list(plan.holders_of(r)) for r in range(3)}
    assert before.placement["holders"] == {str(r): list(PlacementPlan(2, 2, "mixed").holders_of(r)) for r in range(2)}


class _Module(torch.nn.Linear):
    """What set-up sizes the shared memory from: parameters and an optimizer."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _commit_on_two_ranks(job, agents, step=4, nbytes=3000):
    """Step ``step`` committed by incarnation 1 on 2 ranks (machines 0 and 1, m = 2): each rank's replica
    on both agents, MACs that check, and the manifest in the store, as the old launch left them."""
    job.store.set(job.keys.incarnation, 1)
    shards, holders = [], {}
    for rank in range(2):
        data = bytes([rank + 1]) * nbytes
        mac = checksum(data, "hmac-sha256", job.auth.replica)
        for machine in range(2):
            with job.client(agents[machine], incarnation=1) as client:
                client.begin(step, rank, nbytes)
                client.data(step, rank, 0, [memoryview(data)])
                client.end(step, rank, mac)
        shards.append(ShardRecord(rank, f"memory:rank{rank}", nbytes, mac))
        holders[str(rank)] = list(PlacementPlan(2, 2).holders_of(rank))
    job.store.publish(Manifest(step=step, world_size=2, shards=tuple(shards), tier="memory",
                               placement={"kind": "mixed", "machines": 2, "replicas": 2, "machine_of": [0, 1],
                                          "holders": holders, "incarnation": 1}))
    job.decide(step, "committed", incarnation=1)


def _rank0_reader(job):
    """Rank 0 of a launch on machine 0 as recovery sees it: the job's store, agents and keys."""
    reader = GeminiCheckpointer(replicas=1)
    reader.store, reader.auth, reader.machine, reader.incarnation = job.store, job.auth, 0, job.incarnation
    return reader


@pytest.mark.multiprocess
def test_a_run_at_another_world_size_clears_the_old_sizes_manifest(job, monkeypatch):
    """Issue 44 item 10: rank 0 of a launch at another world size clears the committed manifest the old
    size left in the job's store (its replicas are per rank of 2 ranks), before anything reads it: the
    agents stop keeping its buffers, and its version is restored from memory by no later launch, of either
    size, though its replicas are still intact in the agents' memory."""
    # What the launchers export: the job's store and name; the relaunch below runs on 1 machine.
    for name, value in ((STORE_ENV, job.address), (JOB_ENV, job.name), (MACHINES_ENV, "1"), (MACHINE_ENV, "0")):
        monkeypatch.setenv(name, value)
    agents = [job.agent(m, 2) for m in range(2)]
    _commit_on_two_ranks(job, agents)
    # As the old launch left it: at 2 ranks the version is restorable from memory, and the agents keep it.
    assert _rank0_reader(job).resume_path(2) == "gemini:4"
    assert _rank0_reader(job)._fetch(4, 0)[1] == "local"
    assert all(a.view.committed(0) == 4 for a in agents)
    # At 1 rank it is not (resume_path, before the workers: the persistent tier, here none).
    assert _rank0_reader(job).resume_path(1) is None

    # The relaunch on 1 rank (machine 0) sets up: a new incarnation, and the old size's manifest cleared.
    checkpointer = GeminiCheckpointer(replicas=1, mode="blocking", placement="ring")
    strategy = SimpleNamespace(root_device=torch.device("cpu"), broadcast=lambda obj, src=0: obj,
                               checkpoint_io=None, sync=None)
    trainer = SimpleNamespace(world_size=1, global_rank=0, node_rank=0, num_nodes=1, global_step=0,
                              is_global_zero=True, strategy=strategy)
    checkpointer.setup(trainer, _Module(4, 4), "fit")
    try:
        assert checkpointer.incarnation == 2
        assert job.store.manifest() == kvstore.CLEARED
        record = job.store.get(job.keys.manifest)
        assert record["incarnation"] == 2 and "runs on 1 ranks now; step 4 was committed on 2" in record["reason"]
        # The agents read the clearing: the old buffers are no longer the committed version's.
        assert all(a.view.committed(0) is None for a in agents)
        # Its replicas are still intact in memory, yet no launch restores them: not this one (its fetch
        # finds no committed version 4, and with no persistent tier it says so)...
        with job.client(agents[0], incarnation=2) as client:
            assert bytes(client.get(4, 0, 3000)) == bytes([1]) * 3000
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert checkpointer._fetch(4, 0) == (None, "none")
            with pytest.raises(RuntimeError, match="cannot be restored .* no persistent checkpoint"):
                checkpointer.load_path("gemini:4")
        assert any("version 4 is no longer the committed one" in str(w.message) for w in caught)
        # ... nor a later one back at the old size.
        assert _rank0_reader(job).resume_path(2) is None
    finally:
        checkpointer.teardown(trainer, None, "fit")
