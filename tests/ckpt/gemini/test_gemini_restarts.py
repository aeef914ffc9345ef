"""Restarts that work as documented: the README's torchrun recipe after a kill (no extra environment),
``cluster=local`` with ``cluster.max_restarts``, and the same command run again in a run directory.
Each continues bit-identically to an uninterrupted run. Slow: each runs two or three trainings."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_runs import QUIET, ROOT, assert_continues
from ckpt_runs import summary as _summary
from ckpt_runs import train as _train
from gemini_job import free_port

from ddlscale.ckpt.checkpointer import PROGRESS_FILE
from ddlscale.ckpt.gemini.services import local_gemini

pytestmark = pytest.mark.slow

STEPS = 40
MODEL = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=4000",
         "model.optimizer=sgd", "model.momentum=0.9", "strategy.device_time_s=0.05"]
GEMINI = ["ckpt=gemini", "ckpt.profile_steps=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("restarts") / "straight"
    _train(*MODEL, "trainer.devices=2", f"trainer.max_steps={STEPS}", f"hydra.run.dir={run}")
    return run


def _steps_done(run: Path) -> int:
    path = run / PROGRESS_FILE
    return sum(line.startswith("step ") for line in path.read_text().splitlines()) if path.exists() else 0


def _kill_rank(run: Path, rank: int, after_steps: int, timeout_s: float = 240) -> None:
    """SIGKILL the worker of ``rank`` of the run in ``run`` once it has trained ``after_steps`` steps."""
    deadline = time.monotonic() + timeout_s
    while _steps_done(run) < after_steps:
        assert time.monotonic() < deadline, "training never got going"
        time.sleep(0.2)
    for pid in subprocess.run(["pgrep", "-f", f"hydra.run.dir={run}"], capture_output=True, text=True).stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b" ".join(environ):
            os.kill(int(pid), signal.SIGKILL)
            return
    pytest.fail(f"no worker of rank {rank} found")


def _torchrun_recipe(run: Path, tmp_path: Path, kill_after: int | None) -> None:
    """Two torchrun agents on loopback, as the README's recipe runs one per machine, with Gemini's agents
    started beside them (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE); optionally rank 1's worker is killed."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    with local_gemini(2, f"t{tmp_path.name}{run.name}") as gemini_env:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--max-restarts=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(ROOT / "train.py"), "cluster=torchrun",
                "trainer.num_nodes=2", "trainer.devices=1", *MODEL, f"trainer.max_steps={STEPS}", *GEMINI,
                f"hydra.run.dir={run}", *QUIET]
        agents = [subprocess.Popen(argv, cwd=ROOT, env={**env, **gemini_env}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        if kill_after is not None:
            _kill_rank(run, 1, after_steps=kill_after)
        outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]


@pytest.mark.e2e
def test_the_readme_torchrun_recipe_restarts_after_a_kill(tmp_path):
    """A killed worker's restart must not hang in process-group set-up (torchrun's shared store still holds
    the previous round's addresses). Compared with the same recipe uninterrupted: one process per node
    computes with other thread counts than cluster=local's workers."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    _torchrun_recipe(straight, tmp_path, kill_after=None)
    _torchrun_recipe(run, tmp_path, kill_after=10)
    summary = _summary(run)
    assert summary["ckpt_recovery_sources"] == ["local", "local"] and summary["ckpt_resumed_step"] >= 8
    assert_continues(straight, run, summary["ckpt_resumed_step"], restarted_in_place=True)


@pytest.mark.e2e
def test_cluster_local_with_max_restarts_recovers_from_the_agents(straight, tmp_path):
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *MODEL, f"trainer.max_steps={STEPS}",
                                 *GEMINI, "trainer.devices=2",
                                 "cluster.max_restarts=1", f"hydra.run.dir={run}", *QUIET], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _kill_rank(run, 1, after_steps=10)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output[-4000:]
    summary = _summary(run)
    assert summary["ckpt_recovery_sources"] == ["local", "local"] and summary["ckpt_resumed_step"] >= 8
    assert_continues(straight, run, summary["ckpt_resumed_step"], restarted_in_place=True)
    lines = (run / PROGRESS_FILE).read_text().splitlines()
    assert [line.split()[0] for line in lines if line.startswith(("start", "resumed"))] == ["start", "resumed"]
    assert [line.split()[0] for line in lines].count("launched") == 2  # the restarted worker's launch, timed


@pytest.mark.e2e
def test_running_the_same_command_again_resumes_from_the_newest_committed_version(straight, tmp_path):
    run = tmp_path / "run"
    first = [*MODEL, *GEMINI, "trainer.devices=2", f"hydra.run.dir={run}"]
    _train(*first, "trainer.max_steps=15")
    again = _train(*first, f"trainer.max_steps={STEPS}")  # the command again, trained further: not from step 0
    assert "ckpt=gemini: resuming from step 15" in again.stdout
    summary = _summary(run)
    assert summary["ckpt_resumed_step"] == 15 and summary["ckpt_recovery_sources"] == ["persistent", "persistent"]
    assert_continues(straight, run, 15, restarted_in_place=True)  # one metrics.csv across both commands
