"""A stop that reaches every process of a ``ckpt=gemini`` job at once writes the newest committed version,
and the same command resumes from it (issue 61 item 1, acceptance). As schedulers stop a job:

* SIGTERM to every process at once (SLURM's scancel, a preemption, systemd stopping the unit), then SIGKILL
  to whatever is left after a grace time;
* SLURM's warning before a time limit (``--signal=USR1@<seconds>``): SIGUSR1 to every process, SIGTERM to
  every process at the limit, SIGKILL after KillWait.

Before, the agents deleted their replicas on SIGTERM and the drain found "no intact replica ... Connection
refused": nothing was written. Each test trains >= 10 steps first. On ``cluster=local`` (3 ranks, each its
own machine) and on the emulated cluster with the persistent tier on its storage machine, behind a slow
link (Gemini's regime), whose server, store and agents get the signal too."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ckpt_runs import QUIET, ROOT, summary

from ddlscale.ckpt.checkpointer import PROGRESS_FILE
from ddlscale.ckpt.version.manifest import list_manifests, read_manifest
from ddlscale.cluster import storage
from ddlscale.cluster.emulated import unavailable_reason as cluster_unavailable
from ddlscale.cluster.stop import descendants, start_time

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=4000",
         "model.optimizer=sgd", "model.momentum=0.9", "strategy.device_time_s=0.05"]
GEMINI = ["ckpt=gemini", "ckpt.profile_steps=2"]
LOCAL = ["trainer.devices=3"]
EMULATED = ["cluster=emulated", "cluster.nodes=2", "cluster.dilation=1", "trainer.devices=1",
            "cluster.storage.bandwidth=100mbit"]
AFTER_STEPS = 10
KILL_WAIT_S = 60.0  # the scheduler's grace before SIGKILL (systemd's TimeoutStopSec, SLURM's KillWait)
STORAGE_REASON = cluster_unavailable() or storage.unavailable_reason()


def _steps(run: Path) -> list[int]:
    path = run / PROGRESS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split()[1]) for line in lines if line.startswith("step ")]


class _Job:
    """train.py and every process below it (in a session of its own, as a scheduler's job is), found
    through /proc each time it is signalled: what it has started since, and what it started before
    (even once its parent is gone), all count."""

    def __init__(self, argv: list[str]) -> None:
        self.launcher = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
        self.seen: dict[int, int] = {self.launcher.pid: start_time(self.launcher.pid)}
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.launcher.stdout), daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def alive(self) -> dict[int, int]:
        if self.launcher.poll() is None:
            self.seen.update(descendants(self.launcher.pid))
        return {pid: t for pid, t in self.seen.items() if start_time(pid) == t}

    def signal(self, signum: int) -> None:
        """``signum`` to every process of the job at once."""
        for pid in self.alive():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _stop_whole_job(run: Path, signals: list[tuple[float, int]], extra: list[str]) -> tuple[_Job, int]:
    """Train until >= AFTER_STEPS steps, then each (delay, signal) to every process of the job in turn;
    SIGKILL to what is left KILL_WAIT_S after the last. Returns the job and the steps it trained."""
    job = _Job([sys.executable, str(ROOT / "train.py"), *MODEL, *GEMINI, *extra, "trainer.max_steps=1000",
                f"hydra.run.dir={run}", *QUIET])
    deadline = time.monotonic() + 300
    try:
        while len(_steps(run)) < AFTER_STEPS:
            assert job.launcher.poll() is None, job.output[-3000:]
            assert time.monotonic() < deadline, "training never got going"
            time.sleep(0.1)
        job.alive()  # every process it has now
        for delay, signum in signals:
            time.sleep(delay)
            job.signal(signum)
        try:
            job.launcher.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        assert job.launcher.poll() is not None, f"the launcher outlived the grace time\n{job.output[-3000:]}"
        gone = time.monotonic() + 5  # what exits with the launcher (multiprocessing's resource tracker) may lag
        while job.alive() and time.monotonic() < gone:
            time.sleep(0.1)
        left = job.alive()
        assert not left, f"processes of the job outlived it: {left}\n{job.output[-3000:]}"
    finally:
        job.signal(signal.SIGKILL)
    job.reader.join(timeout=10)
    return job, max(_steps(run))


def _assert_persisted_and_resumes(run: Path, job: _Job, trained: int, signum: int, extra: list[str],
                                  directory: Path, shown: str) -> None:
    output = job.output
    assert job.launcher.returncode == 128 + signum, output[-3000:]
    assert "no intact replica" not in output and "Connection refused" not in output, output[-3000:]
    manifests = list_manifests(directory)
    assert manifests, output[-3000:]
    step = read_manifest(manifests[0]).step
    # The newest committed version: the last trained step's, or the one before (its send was cut short).
    assert trained - 1 <= step <= trained, (step, trained, output[-3000:])
    assert f"ckpt=gemini: committed step {step} written to {shown}/{manifests[0].name}" in output, output[-3000:]
    assert summary(run)["status"] == "interrupted"

    again = subprocess.run([sys.executable, str(ROOT / "train.py"), *MODEL, *GEMINI, *extra,
                            f"trainer.max_steps={step + 3}", f"hydra.run.dir={run}", *QUIET],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(rf"ckpt=gemini: resuming from step {step}\b", again.stdout), again.stdout[-3000:]
    resumed = summary(run)
    assert resumed["ckpt_resumed_step"] == step and resumed["steps"] == step + 3
    assert set(resumed["ckpt_recovery_sources"]) == {"persistent"}


def test_a_sigterm_to_every_process_persists_the_newest_committed_version_and_resumes_there(tmp_path):
    run = tmp_path / "run"
    job, trained = _stop_whole_job(run, [(0.0, signal.SIGTERM)], LOCAL)
    _assert_persisted_and_resumes(run, job, trained, signal.SIGTERM, LOCAL, run / "checkpoints",
                                  str(run / "checkpoints"))


def test_slurms_warning_then_its_sigterm_persist_the_newest_committed_version_and_resume_there(tmp_path):
    """``--signal=USR1@<seconds>`` to every task, then the time limit's SIGTERM a few seconds later (a short
    lead: what the drain must fit in), then KillWait's SIGKILL. The later SIGTERM cuts nothing short."""
    run = tmp_path / "run"
    job, trained = _stop_whole_job(run, [(0.0, signal.SIGUSR1), (3.0, signal.SIGTERM)], LOCAL)
    _assert_persisted_and_resumes(run, job, trained, signal.SIGUSR1, LOCAL, run / "checkpoints",
                                  str(run / "checkpoints"))


@pytest.mark.root
@pytest.mark.skipif(STORAGE_REASON is not None, reason=f"storage machine unavailable: {STORAGE_REASON}")
@pytest.mark.parametrize("store", ["tcpstore", "etcd"])
def test_a_sigterm_to_every_process_of_an_emulated_cluster_persists_through_its_slow_storage_link(tmp_path, store):
    """Every process of the job gets SIGTERM: the trainers, the agents, the rendezvous store (or the etcd
    members) and the storage machine's server. The store ignores it, the members and the server are started
    again on their data, the agents keep their replicas until machine 0's drain has written them over the
    100 Mbit/s link."""
    from ddlscale.cluster.control_plane import missing

    if store == "etcd" and missing(server=True):
        pytest.skip(f"etcd cannot run: {missing(server=True)}")
    run = tmp_path / "run"
    extra = [*EMULATED, f"cluster.storage.root={tmp_path / 'store'}", *(["ckpt.store=etcd"] if store == "etcd" else [])]
    job, trained = _stop_whole_job(run, [(0.0, signal.SIGTERM)], extra)
    _assert_persisted_and_resumes(run, job, trained, signal.SIGTERM, extra, tmp_path / "store" / "gemini",
                                  "storage://gemini")
