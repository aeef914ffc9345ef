"""cluster=slurm: refused in one line where it cannot train, and a sweep through Hydra's submitit
launcher run by a real SLURM on this machine (Debian's slurm-wlm and munge: a controller and a node
daemon started here, state and sockets in a temporary directory, on loopback; skipped, saying why,
where they cannot start)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddlscale.cluster.local import free_port

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false"]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "squeue", "scancel", "scontrol")
START_S = 60.0  # slurmd registers within seconds; a loaded host may take ten times as long


@pytest.fixture
def no_controller(tmp_path) -> dict[str, str]:
    """An environment whose SLURM has no controller running: a slurm.conf naming a port nothing listens
    on, and none of a SLURM job's variables (the suite may itself run inside one)."""
    conf = tmp_path / "slurm.conf"
    host = socket.gethostname().split(".")[0]
    conf.write_text(f"ClusterName=nocontroller\nSlurmctldHost={host}(127.0.0.1)\nSlurmctldPort={free_port()}\n"
                    f"NodeName={host} CPUs=1\nPartitionName=p Nodes={host} Default=YES\n")
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_CONF": str(conf)}


def _train(*overrides, env, timeout=240):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _last_line(result) -> str:
    return (result.stderr.strip().splitlines() or [""])[-1]


@pytest.mark.e2e
def test_cluster_slurm_outside_slurm_is_refused_in_one_line_and_trains_nothing(no_controller, tmp_path):
    result = _train("cluster=slurm", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}/run", *QUIET,
                    env=no_controller)
    assert result.returncode != 0
    refusal = _last_line(result)
    assert refusal.startswith("ddlscale: invalid config: cluster=slurm "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr
    assert "GLOBAL_RANK" not in result.stdout + result.stderr  # no rank started
    assert not (tmp_path / "run").exists()  # nothing trained, nothing left


@pytest.mark.e2e
def test_a_slurm_sweep_without_a_controller_is_refused_in_one_line_before_any_job(no_controller, tmp_path):
    sweep = tmp_path / "sweep"
    result = _train("-m", "cluster=slurm", "seed=1,2", "trainer.max_steps=2", f"hydra.sweep.dir={sweep}", *QUIET,
                    env=no_controller)
    assert result.returncode != 0
    refusal = _last_line(result)
    assert refusal.startswith("ddlscale: invalid config: cluster=slurm trains through SLURM, and "), result.stderr
    assert "; cluster=local trains on this machine" in refusal
    if shutil.which("scontrol"):  # SLURM's own answer, not its banner
        assert "(scontrol ping: Slurmctld(primary) at " in refusal and " is DOWN)" in refusal, refusal
    assert "Traceback" not in result.stderr and "submitit" not in result.stderr  # not the launcher's crash
    assert not sweep.exists()  # no sweep folder, no job submitted


class LocalSlurm:
    """A one-machine SLURM of this test's own: munged, slurmctld and slurmd run as root in the
    foreground, every file under ``directory``, the daemons' ports free ones on loopback. Clients find
    it through ``env`` (SLURM_CONF); nothing of the host's own SLURM or munge is used or touched."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.conf = directory / "slurm.conf"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                    "SLURM_CONF": str(self.conf)}
        self.processes: list[subprocess.Popen] = []

    def start(self) -> str | None:
        """Start the daemons and wait for the node to be idle; None, or why SLURM cannot run here."""
        missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
        if missing:
            return f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge)"
        if os.geteuid() != 0:
            return "the daemons run as root here, and this is not root"
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = self.dir / "munge.socket"
        self._start("munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                    f"--seed-file={self.dir}/munged.seed")
        if not self._wait(socket_path.exists, 10.0):
            return f"munged did not start: {self._tail('munged.log')}"
        node = self._node_line()
        if node is None:
            return "slurmd -C did not describe this machine"
        (self.dir / "state").mkdir()
        (self.dir / "spool").mkdir()
        (self.dir / "plugstack.conf").write_text("")  # none of the host's SPANK plug-ins
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(f"""\
ClusterName=ddlscaletest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={self.dir}/state
SlurmdSpoolDir={self.dir}/spool
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd.pid
SlurmctldLogFile={self.dir}/slurmctld.log
SlurmdLogFile={self.dir}/slurmd.log
PlugStackConfig={self.dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        self._start("slurmctld", "-D", "-c", "-i", "-f", str(self.conf))
        self._start("slurmd", "-D", "-f", str(self.conf))
        if not self._wait(lambda: self.node_state() == "idle", START_S):
            return (f"the node did not become idle in {START_S:.0f} s (state {self.node_state()!r}; slurmctld: "
                    f"{self._tail('slurmctld.log')}; slurmd: {self._tail('slurmd.log')})")
        return None

    def node_state(self) -> str:
        result = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""

    def jobs(self) -> list[str]:
        result = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return result.stdout.split()

    def job_state(self, job_id: str) -> str:
        result = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True,
                                text=True)
        return next((field.partition("=")[2] for field in result.stdout.split() if field.startswith("JobState=")), "")

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop the daemons started here (slurmd before its controller)."""
        left = self.jobs() if self.conf.exists() and self.processes else []
        if left:  # a failed test's jobs: their steps end before slurmd does
            subprocess.run(["scancel", "--full", *left], env=self.env, capture_output=True)
            self._wait(lambda: not self.jobs(), 30.0)
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _start(self, name: str, *args: str) -> None:
        """Start one daemon in the foreground, its own output to NAME.out (it logs to NAME.log)."""
        with open(self.dir / f"{name}.out", "wb") as out:
            self.processes.append(subprocess.Popen([name, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT))

    def _node_line(self) -> str | None:
        result = subprocess.run(["slurmd", "-C"], env=self.env, capture_output=True, text=True)
        return next((line for line in result.stdout.splitlines() if line.startswith("NodeName=")), None)

    def _tail(self, log: str) -> str:
        path = self.dir / log
        lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else ["no log"]
        return " | ".join(lines[-3:])

    @staticmethod
    def _wait(condition, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.5)
        return condition()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        reason = cluster.start()
        if reason is not None:
            if os.environ.get("DDLSCALE_REQUIRE_SLURM"):  # .ci/run installed SLURM: not running is a failure
                pytest.fail(f"SLURM required (DDLSCALE_REQUIRE_SLURM) but it did not start: {reason}")
            pytest.skip(f"no SLURM of the test's own: {reason}")
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.root
def test_a_sweep_through_the_submitit_launcher_trains_in_slurm_jobs(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    result = _train("-m", "cluster=slurm", "seed=1,2", "trainer.max_steps=2", f"hydra.sweep.dir={sweep}",
                    "hydra.launcher.timeout_min=10", *QUIET, env=slurm.env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(path.read_text()) for path in sorted(sweep.glob("*/summary.json"))]
    assert [s["seed"] for s in summaries] == [1, 2], result.stderr[-3000:]
    job_ids = {s["slurm_job_id"] for s in summaries}
    assert len(job_ids) == 2 and all(job_id and job_id.isdigit() for job_id in job_ids)  # a SLURM job each
    for summary in summaries:
        assert summary["world_size"] == 2 and summary["steps"] == 2  # both tasks of the job trained, as ranks
    # SLURM's own record of those jobs: run to the end and exited 0 (its tasks may still be finishing).
    assert slurm._wait(lambda: all(slurm.job_state(job_id) == "COMPLETED" for job_id in job_ids), 60.0), \
        [slurm.job_state(job_id) for job_id in job_ids]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.root
def test_tasks_srun_starts_train_as_the_ranks_of_one_run(slurm, tmp_path):
    run = tmp_path / "run"
    # Lightning takes --ntasks-per-node (not --ntasks) as the devices per node.
    srun = ["srun", "--nodes=1", "--ntasks-per-node=2", sys.executable, str(ROOT / "train.py")]
    result = subprocess.run([*srun, "cluster=slurm", "trainer.max_steps=2", f"hydra.run.dir={run}", *QUIET], cwd=ROOT,
                            env=slurm.env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 and summary["slurm_job_id"].isdigit()
    assert result.stdout.count("ddlscale: finished 2 steps") == 1  # rank 0 reports, once
