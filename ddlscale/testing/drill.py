"""Failure drills: a Gemini job on the emulated cluster, with real kills and machine replacements.

:class:`GeminiDrill` brings up N emulated machines, the store on machine 0 (never failed) — or with
``store="etcd"`` an etcd member on each of the first three machines, any one of which may fail — one
replica agent and one torchrun elastic agent per machine (which restarts its workers after a
failure), and a :mod:`~ddlscale.ckpt.gemini.control` process that reports committed versions and the root
agent's failure events (on machine 0, or with etcd on the last machine). Then a test or experiment
injects failures:

* :meth:`kill_trainer` — software failure: the machine's training process dies, its agent lives;
* :meth:`kill_machine` — every process of the machine dies (trainer, replica agent, torchrun agent);
  :meth:`replace` then starts a fresh replica agent and torchrun agent there, as a cloud operator
  would start a replacement machine at the same address (and, where an etcd member was, replaces
  that member: removed, added again, started with an empty data directory);
* :meth:`corrupt` — flip a byte of a committed replica (in its agent's shared-memory file).

Each torchrun agent's output goes to ``<run dir>/logs/machine<i>.<n>.log``. With ``dilation`` k > 1 the
cluster runs time-dilated (:mod:`ddlscale.clock`): its machines capped, its NICs slowed, and every
timeout here given in emulated seconds.

``python -m ddlscale.testing.drill recover`` runs one machine failure and prints the recovery
(:mod:`ddlscale.testing.recover_drill`); ``... drill security`` runs the hostile-client drill instead
(:mod:`ddlscale.testing.security_drill`): no cluster needed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddlscale.ckpt.gemini.agent.slots import remove_replicas
from ddlscale.ckpt.gemini.auth import SECRET_ENV
from ddlscale.ckpt.gemini.services import emulated_env, job_secret, start_emulated_agent, start_emulated_etcd
from ddlscale.cluster.context import job_name
from ddlscale.cluster.emulated import TRAIN_MODULE, EmulatedCluster


class GeminiDrill:
    def __init__(self, nodes: int, overrides: list[str], run_dir: Path, bandwidth: str = "1gbit", devices: int = 1,
                 max_restarts: int = 5, port: int = 29400, store: str = "tcp", dilation: float = 1.0) -> None:
        if store not in ("tcp", "etcd"):
            raise ValueError(f"drill store must be tcp or etcd, got {store!r}")
        self.nodes, self.devices, self.port, self.store_kind = nodes, devices, port, store
        self.etcd = None  # the etcd members, with store="etcd"
        self.run_dir = Path(run_dir)
        self.job = job_name(str(self.run_dir))
        self.args = [*overrides, f"trainer.devices={devices}", f"trainer.num_nodes={nodes}",
                     f"hydra.run.dir={self.run_dir}"]
        self.max_restarts = max_restarts
        self.cluster = EmulatedCluster(nodes, bandwidth, dilation=dilation, ranks_per_machine=devices)
        self.k = self.cluster.dilation  # waits below are emulated seconds, stretched to wall time by k
        self.agents: dict[int, subprocess.Popen] = {}
        self.trainers: dict[int, subprocess.Popen] = {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.committed: list[tuple[int, float]] = []  # (step, unix) as the control process saw them
        self._launches = 0

    # -- life cycle ------------------------------------------------------------------------------
    def __enter__(self) -> GeminiDrill:
        self._exit_stack = contextlib.ExitStack()
        self.secret = self._exit_stack.enter_context(job_secret())
        self.cluster.up()
        try:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            if self.store_kind == "etcd":
                self.etcd = start_emulated_etcd(self.cluster, self.run_dir / "etcd", self.job)
                self.store, watcher = str(self.etcd.address), self.nodes - 1
            else:
                self._store = self.cluster.start_rendezvous_store(self.port)
                self.store, watcher = f"{self.cluster.address(0)}:{self.port}", 0
            self._control = self.cluster.popen(
                watcher, [sys.executable, "-m", "ddlscale.ckpt.gemini.control", "--store", self.store, "--job", self.job],
                env={SECRET_ENV: str(self.secret)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if json.loads(self._control.stdout.readline()).get("ready") is not True:
                raise RuntimeError("the drill's control process did not start")
            threading.Thread(target=self._read_control, daemon=True).start()
            for machine in range(self.nodes):
                self._start_machine(machine)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cluster.down()
        remove_replicas(self.job)  # the killed agents' shared memory
        self._exit_stack.close()

    def _start_machine(self, machine: int) -> None:
        self.agents[machine] = start_emulated_agent(self.cluster, machine, self.store, self.job, self.secret)
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (self.nodes * self.devices)))}
        env = {**threads, **emulated_env(self.cluster, machine, self.store, self.job, self.secret)}
        self._launches += 1
        log = open(self.run_dir / "logs" / f"machine{machine}.{self._launches}.log", "w")  # noqa: SIM115
        self.trainers[machine] = self.cluster.torchrun(machine, self.args, nproc_per_node=self.devices,
                                                       port=self.port, max_restarts=self.max_restarts, env=env,
                                                       stdout=log, stderr=subprocess.STDOUT,
                                                       etcd=self.etcd.address if self.etcd else None, run_id=self.job)

    def _read_control(self) -> None:
        for line in self._control.stdout:
            record = json.loads(line)
            if "committed" in record:
                self.committed.append((record["committed"], record["unix"]))
            self.events.put(record)

    # -- observing -------------------------------------------------------------------------------
    def wait_for(self, predicate, timeout_s: float = 300.0) -> dict[str, Any]:
        """The next control record satisfying ``predicate``."""
        deadline = time.monotonic() + timeout_s * self.k
        while (left := deadline - time.monotonic()) > 0:
            try:
                record = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                self._check_alive()
                continue
            if predicate(record):
                return record
        raise TimeoutError(f"drill: nothing matched within {timeout_s:g} s")

    def wait_failed(self, machines: list[int], timeout_s: float = 60.0) -> None:
        """Until the root agent has reported every one of ``machines`` failed, in whatever order."""
        missing = set(machines)

        def reported(record: dict[str, Any]) -> bool:
            if record.get("event") == "failed":
                missing.discard(record.get("machine"))
            return not missing

        self.wait_for(reported, timeout_s)

    def wait_committed(self, step: int, timeout_s: float = 300.0) -> int:
        if self.committed and self.committed[-1][0] >= step:
            return self.committed[-1][0]
        return self.wait_for(lambda r: r.get("committed", -1) >= step, timeout_s)["committed"]

    def _check_alive(self) -> None:
        failed = {m: p.returncode for m, p in self.trainers.items() if p.poll() not in (None, 0)}
        if failed and all(p.poll() is not None for p in self.trainers.values()):
            raise RuntimeError(f"drill: every torchrun agent exited, codes {failed}; see {self.run_dir / 'logs'}")

    def finish(self, timeout_s: float = 600.0) -> None:
        """Wait for training to end on every machine; raise if any torchrun agent failed."""
        deadline = time.monotonic() + timeout_s * self.k
        for machine, process in self.trainers.items():
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"drill: torchrun on machine {machine} exited with {code}; "
                                   f"see {self.run_dir / 'logs'}")

    # -- failures --------------------------------------------------------------------------------
    def trainer_pids(self, machine: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.cluster.namespace(machine)], capture_output=True,
                             text=True).stdout.split()
        pids = []
        for pid in out:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"\0-m\0{TRAIN_MODULE}\0".encode() in cmdline:  # a worker: python -u -m ddlscale ...
                pids.append(int(pid))
        return pids

    def kill_trainer(self, machine: int) -> float:
        """SIGKILL the machine's training processes; when, as the workers' ``clock.timestamp()`` reads."""
        pids = self.trainer_pids(machine)
        if not pids:
            raise RuntimeError(f"drill: no training process on machine {machine}")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return time.time() / self.k

    def kill_machine(self, machine: int) -> None:
        self.cluster.kill_machine(machine)
        for process in (self.agents.get(machine), self.trainers.get(machine)):
            if process is not None:
                process.wait(timeout=30)

    def replace(self, machine: int) -> None:
        if self.etcd is not None and machine < len(self.etcd.members):
            via = next(m for m in range(len(self.etcd.members)) if m != machine)
            self.etcd.replace(machine, via, incarnation=self._launches)
        self._start_machine(machine)

    def _command(self, line: str, answer: str) -> Any:
        self._control.stdin.write(line + "\n")
        self._control.stdin.flush()
        record = self.wait_for(lambda r: answer in r or "error" in r, timeout_s=30)
        if "error" in record:
            raise RuntimeError(f"drill: {line!r} failed: {record['error']}")
        return record[answer]

    def corrupt(self, rank: int, machine: int) -> dict[str, Any]:
        """Flip a byte of ``rank``'s committed replica on ``machine``."""
        return self._command(f"corrupt {rank} {machine}", "corrupted")

    def stat(self, machine: int) -> dict[str, Any]:
        """What ``machine``'s agent holds: {owner rank: [{version, bytes, complete, ...}, ...]}."""
        return self._command(f"stat {machine}", "stat")["holds"]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["security"]:
        from ddlscale.testing.security_drill import main as security

        security(args[1:])
    elif args[:1] == ["recover"]:
        from ddlscale.testing.recover_drill import main as recover

        recover(args[1:])
    else:
        sys.exit("usage: python -m ddlscale.testing.drill security|recover [--help]   (the other drills run from "
                 "tests and experiments)")


if __name__ == "__main__":
    main()
