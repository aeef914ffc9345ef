"""ckpt=gemini end to end: versions restored from local or peer memory, or the persistent tier, continue
training bit-identically. Local-mode tests run in the default suite; the failure drills with real
process kills on the emulated cluster are marked slow."""

import subprocess
import sys

import pytest
from ckpt_runs import QUIET, ROOT, assert_continues
from ckpt_runs import summary as _summary
from ckpt_runs import train as _train

from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, read_secret
from ddlscale.ckpt.gemini.control import agent_client, corrupt_replica
from ddlscale.ckpt.gemini.services import local_gemini

CNN = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=192",
       "model.optimizer=sgd", "model.momentum=0.9"]
GEMINI = ["ckpt=gemini", "ckpt.profile_steps=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("gemini") / "straight"
    _train(*CNN, "trainer.devices=2", "trainer.max_steps=8", f"hydra.run.dir={run}")
    return run


def _corrupt(env, rank, machine):
    """Flip a byte of ``rank``'s committed replica in ``machine``'s agent's shared memory (bit rot)."""
    job = env["DDLSCALE_JOB"]
    store = kvstore.JobStore(kvstore.connect(env["DDLSCALE_STORE"]), job, JobKeys(read_secret(env[SECRET_ENV]), job))
    manifest = store.manifest()
    with agent_client(store, machine) as client:
        corrupt_replica(client.stat()["holds"], rank, manifest.step, manifest.shard(rank).bytes // 2)


@pytest.mark.e2e
@pytest.mark.parametrize("corrupt, source, from_step", [
    # Every rank reloading its own machine's replica is also rank 1's part of the next case: slow run only.
    pytest.param([], ["local", "local"], 4, marks=pytest.mark.slow),
    ([(0, 0)], ["peer:1", "local"], 4),  # rank 0's own copy is corrupt: its peer's copy is used
    # every copy of rank 1 corrupt: disk, step 3 (~27 s; test_no_intact_copy_... covers the refusal by default)
    pytest.param([(1, 1), (1, 0)], ["persistent", "persistent"], 3, marks=pytest.mark.slow),
])
def test_restart_restores_from_memory_or_falls_back(straight, tmp_path, corrupt, source, from_step):
    common = [*CNN, *GEMINI, "trainer.devices=2", "ckpt.persist_every=3", f"ckpt.persist_dir={tmp_path / 'disk'}"]
    with local_gemini(2, f"t{tmp_path.name}") as env:
        _train(*common, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'first'}")
        first = _summary(tmp_path / "first")
        assert first["ckpt_committed"] == 4 and first["ckpt_last_committed"] == 4
        for rank, machine in corrupt:
            _corrupt(env, rank, machine)
        _train(*common, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'resumed'}")
    resumed = tmp_path / "resumed"
    summary = _summary(resumed)
    assert summary["ckpt_recovery_sources"] == source
    assert summary["ckpt_resumed_step"] == from_step
    assert_continues(straight, resumed, from_step)


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.e2e
def test_no_intact_copy_and_no_persistent_tier_is_a_clear_error(tmp_path):
    with local_gemini(2, f"t{tmp_path.name}") as env:
        _train(*CNN, *GEMINI, "trainer.devices=2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'a'}")
        _corrupt(env, 1, 1)
        _corrupt(env, 1, 0)
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *CNN, *GEMINI, "trainer.devices=2",
                                 "trainer.max_steps=4", "ckpt.persist_every=null", f"hydra.run.dir={tmp_path / 'b'}",
                                 *QUIET],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "there is no persistent checkpoint: set ckpt.persist_every" in result.stderr


@pytest.mark.e2e
def test_gemini_interleaves_after_profiling_and_commits_every_step(tmp_path):
    run = tmp_path / "run"
    _train(*CNN, "ckpt=gemini", "ckpt.profile_steps=3", "trainer.devices=2", "trainer.max_steps=24",
           f"hydra.run.dir={run}")
    summary = _summary(run)
    assert summary["ckpt_committed"] == 24 and summary["ckpt_last_committed"] == 24
    assert summary["ckpt_mode"] == "gemini" and summary["ckpt_bytes"] > 0
    assert summary["ckpt_interleave_gaps"] >= 2 and summary["ckpt_interleave_chunk_s"] > 0
    assert summary["ckpt_complete_s"] >= 0 and summary["ckpt_stall_s"] >= 0
