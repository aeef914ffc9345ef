"""ckpt=gemini resumed on another number of machines: from the persistent tier (the in-memory replicas are
per rank of the old world size), with parameters and optimizer state as saved, and a placement of the
new machines in the versions the resumed run commits."""

import pytest
import torch
from ckpt_runs import summary, train

from ddlscale.ckpt import load_version, read_manifest
from ddlscale.ckpt.gemini import store as kvstore
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, read_secret
from ddlscale.ckpt.gemini.launch import local_gemini
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.version.manifest import list_manifests

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
