"""Failure drills on the emulated cluster (4 machines, m = 2, groups {0,1} and {2,3}): real process kills,
machine replacements and replica corruption. After each, training continues and its losses from the
recovered step on and its final parameters are bit-identical to an uninterrupted run. Slow: each drill
runs a 4-machine job (about a minute here)."""

import time
from pathlib import Path

import pytest
from ckpt_runs import assert_continues
from ckpt_runs import summary as _summary

from ddlscale.cluster.emulated import unavailable_reason
from ddlscale.testing.drill import GeminiDrill

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")]

STEPS = 30
MODEL = ["model=cnn", "model.width=16", "model.num_blocks=2", "model.image_size=8", "model.num_samples=1024",
         "model.optimizer=sgd", "model.momentum=0.9", "trainer.enable_progress_bar=false", f"trainer.max_steps={STEPS}"]
GEMINI = [*MODEL, "ckpt=gemini", "ckpt.profile_steps=3", "ckpt.persist_every=5", "ckpt.chunk_kib=64"]


def _assert_continues(straight: Path, resumed: Path) -> int:
    from_step = _summary(resumed)["ckpt_resumed_step"]
    assert from_step is not None and _summary(resumed)["steps"] == STEPS
    assert_continues(straight, resumed, from_step, restarted_in_place=True)
    return from_step


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("drills") / "straight"
    with GeminiDrill(4, [*MODEL, "ckpt=none"], run) as drill:
        drill.finish()
    return run


def _drill(tmp_path, inject, bandwidth="1gbit"):
    run = tmp_path / "run"
    with GeminiDrill(4, GEMINI, run, bandwidth=bandwidth) as drill:
        drill.wait_committed(8)
        inject(drill)
        drill.finish()
        events = list(drill.events.queue)
    return run, events


@pytest.mark.e2e
def test_software_failure_every_machine_reloads_its_local_replica(straight, tmp_path):
    run, _ = _drill(tmp_path, lambda d: d.kill_trainer(1))
    from_step = _assert_continues(straight, run)
    assert from_step >= 8
    assert _summary(run)["ckpt_recovery_sources"] == ["local"] * 4


def _kill_and_replace(*machines):
    def inject(drill):
        for m in machines:
            drill.kill_machine(m)
        drill.wait_failed(list(machines))  # the root agent notices the silence, then the operator replaces
        for m in machines:
            drill.replace(m)
    return inject


@pytest.mark.e2e
def test_machine_failure_the_replacement_fetches_from_its_group_peer(straight, tmp_path):
    run, events = _drill(tmp_path, _kill_and_replace(1))
    from_step = _assert_continues(straight, run)
    assert from_step >= 8
    sources = _summary(run)["ckpt_recovery_sources"]
    assert sorted(sources) == ["local", "local", "local", "peer:0"]  # whichever rank landed on machine 1
    assert any(e.get("event") == "replaced" and e.get("machine") == 1 for e in events)


@pytest.mark.e2e
def test_whole_group_lost_falls_back_to_the_persistent_checkpoint(straight, tmp_path):
    run, _ = _drill(tmp_path, _kill_and_replace(2, 3))
    from_step = _assert_continues(straight, run)
    assert from_step % 5 == 0  # persist_every=5
    assert _summary(run)["ckpt_recovery_sources"] == ["persistent"] * 4


@pytest.mark.e2e
def test_kill_during_a_chunk_transfer_keeps_the_committed_version(straight, tmp_path):
    def inject(drill):
        # Wait until machine 0's agent is receiving a version of rank 1 (its group peer), then kill 1.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            holds = drill.stat(0)
            if any(not v["complete"] for v in holds.get("1", [])):
                break
        else:
            pytest.fail("never saw a version in flight")
        _kill_and_replace(1)(drill)

    run, _ = _drill(tmp_path, inject, bandwidth="100mbit")
    _assert_continues(straight, run)
    assert "peer:0" in _summary(run)["ckpt_recovery_sources"]


@pytest.mark.e2e
def test_corrupt_replica_is_caught_and_the_peer_copy_used(straight, tmp_path):
    def inject(drill):
        # Kill first, so no newer version can be committed past the corrupted one, then corrupt rank 1's
        # copy on its own machine before the restarted workers load it.
        drill.kill_trainer(1)
        time.sleep(1.0)
        corrupted = drill.corrupt(rank=1, machine=1)
        assert corrupted["version"] >= 8

    run, _ = _drill(tmp_path, inject)
    _assert_continues(straight, run)
    sources = _summary(run)["ckpt_recovery_sources"]
    assert sources[1] in ("peer:0", "persistent") and sources.count("local") >= 2
