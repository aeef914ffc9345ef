"""The control plane survives any one machine: with ckpt.store=etcd (rendezvous, manifests, incarnations
and liveness in etcd members on the first three machines), the machine hosting the first member — and
a trainer, a replica agent and a torchrun agent — is killed; the job restarts on the three survivors plus
a replacement (whose etcd member is replaced too) and resumes from the newest committed in-memory
version, its losses and final parameters bit-identical to an uninterrupted run. Slow: two 4-machine runs."""

import csv

import pytest
from ckpt_runs import losses
from ckpt_runs import summary as _summary

from ddlscale.cluster.control_plane import missing
from ddlscale.cluster.emulated import unavailable_reason
from ddlscale.testing.drill import GeminiDrill

REASON = unavailable_reason() or missing(server=True)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"etcd drill cannot run: {REASON}")]

STEPS = 30
MODEL = ["model=cnn", "model.width=16", "model.num_blocks=2", "model.image_size=8", "model.num_samples=1024",
         "model.optimizer=sgd", "model.momentum=0.9", "trainer.enable_progress_bar=false", f"trainer.max_steps={STEPS}"]
GEMINI = [*MODEL, "ckpt=gemini", "ckpt.store=etcd", "ckpt.profile_steps=3", "ckpt.persist_every=5",
          "ckpt.chunk_kib=64"]


@pytest.mark.e2e
def test_losing_the_first_etcd_members_machine_resumes_from_memory(tmp_path):
    straight = tmp_path / "straight"
    with GeminiDrill(4, [*MODEL, "ckpt=none"], straight) as drill:
        drill.finish()
    run = tmp_path / "run"
    with GeminiDrill(4, GEMINI, run, store="etcd") as drill:
        drill.wait_committed(8)
        drill.kill_machine(0)  # etcd member m0, replica agent 0, torchrun agent 0 and its trainer
        drill.wait_failed([0])  # noticed by the root agent, through the two surviving members
        newest = drill.committed[-1][0]  # nothing commits while a rank is gone
        drill.replace(0)  # a new machine 0: a new etcd member (empty data), agent and torchrun agent
        drill.finish()
        events = list(drill.events.queue)
    summary = _summary(run)
    assert summary["steps"] == STEPS and summary["ckpt_resumed_step"] == newest >= 8
    # metrics.csv is continued across restarts: its last rows are the resumed steps, each as the straight run had it
    with open(run / "metrics.csv") as file:
        resumed = list(csv.DictReader(file))[newest - STEPS:]
    expected = losses(straight)
    assert [int(row["step"]) for row in resumed] == list(range(newest, STEPS))
    assert all((row["train_loss"],) == expected[int(row["step"])] for row in resumed)
    assert summary["param_sha256"] == _summary(straight)["param_sha256"]
    assert sorted(summary["ckpt_recovery_sources"]) == ["local", "local", "local", "peer:1"]  # machine 0's from 1
    assert any(e.get("event") == "replaced" and e.get("machine") == 0 for e in events)
    first, *replacement = sorted((run / "etcd").glob("m0.*/member/wal"))  # the member's data, then its successor's
    assert len(replacement) == 1 and any(replacement[0].iterdir())
