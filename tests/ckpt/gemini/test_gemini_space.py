"""Protection never lapses silently (issue 44 item 2): with too little shared memory for every buffer the
agents on one host will hold, a ``ckpt=gemini`` run is refused at start-up with the numbers; a version
that still finds no room stops the run (``ckpt.on_no_space=stop``, the default) or sends every step to
the persistent tier (``persist``). The shared memory is a fake budget (``$DDLSCALE_SHM_BUDGET``) in a
directory of the test's own (``$DDLSCALE_SHM_DIR``), not a real 64 MiB mount."""

import os
import re
import subprocess
import sys

import pytest
from ckpt_runs import QUIET, ROOT, summary

from ddlscale.ckpt.gemini.protocol import SHM_BUDGET_ENV, SHM_DIR_ENV
from ddlscale.ckpt.version.manifest import list_manifests

pytestmark = pytest.mark.slow

MODEL = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=4000",
         "model.optimizer=sgd", "model.momentum=0.9"]
GEMINI = ["ckpt=gemini", "ckpt.profile_steps=2", "trainer.devices=3", "trainer.max_steps=12"]


def _run(tmp_path, budget, *overrides):
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    env = {**os.environ, SHM_DIR_ENV: str(shm), SHM_BUDGET_ENV: str(budget)}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *MODEL, *GEMINI, *overrides, *QUIET], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def _needed(tmp_path) -> int:
    """What the start-up check asks for on this host, read from its refusal under a tiny budget."""
    refused = _run(tmp_path, 4096, f"hydra.run.dir={tmp_path / 'tiny'}")
    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    # The numbers: free space, the 3 agents sharing it, ranks, replicas, version size, the total.
    assert "which the agents of 3 machine(s) share" in output and "ckpt.replicas=2" in output, output[-3000:]
    assert "0.0 MiB free in" in output
    return int(re.search(r"\((\d+) bytes\) in all", output).group(1))


def test_too_little_shared_memory_is_refused_at_start_up_then_a_full_one_stops_the_run(tmp_path):
    need = _needed(tmp_path)
    # Room for the estimate, not for the versions as captured (RNG and loop state ride along): the first
    # version that finds none stops the run, saying so, instead of training on unprotected.
    run = tmp_path / "run"
    stopped = _run(tmp_path, need, f"hydra.run.dir={run}")
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, output[-3000:]
    assert "ckpt.on_no_space=stop" in output and "cannot reserve" in output, output[-3000:]
    assert summary(run)["steps"] < 12


def test_on_no_space_persist_protects_every_step_on_disk(tmp_path):
    need = _needed(tmp_path)
    run = tmp_path / "run"
    done = _run(tmp_path, need, f"hydra.run.dir={run}", "ckpt.on_no_space=persist", "ckpt.persist_every=100")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "ckpt.on_no_space=persist: every step goes to" in output
    assert summary(run)["ckpt_persistent_count"] >= 5  # every step from the refusal on, not every 100
    assert list_manifests(run / "checkpoints")
