"""An emulated cluster on one host: network namespaces, a bridge, and per-machine NIC limits.

Each emulated machine is a network namespace with one interface ``eth0`` on a private subnet,
joined by a veth pair to a bridge in a separate "switch" namespace. ``tc`` shapes both directions
of every machine's link (tbf for rate, netem for delay), so each machine has its own full-duplex
NIC of the configured bandwidth — the bottleneck real clusters have, on real sockets.

Safety rules this module keeps: every link is created from inside namespaces it created (the
host's own interfaces are never touched), addresses exist only inside those namespaces, and
everything is torn down on exit, on Ctrl-C, on SIGTERM and when the owning block raises.

Several people may run clusters on one host. Each cluster records its owner when it is made (a
JSON file per cluster under ``/run/ddlscale/clusters``, or ``$DDLSCALE_CLUSTER_DIR``: the owning
process's pid and start time, which tell it from a later process given the same pid), so
``python -m ddlscale.cluster down --all`` removes only clusters whose owner is gone — what a
SIGKILLed owner left behind — never a live one, nor one made by ``up`` to be kept.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddlscale.clock import ENV as DILATION_ENV
from ddlscale.clock import parse_factor
from ddlscale.cluster.cpucap import CpuShares, find_controller
from ddlscale.cluster.cpuload import CpuLedger
from ddlscale.cluster.stop import start_time
from ddlscale.cluster.storage import StorageMachine
from ddlscale.comm.network import NetworkModel
from ddlscale.paths import PACKAGE_DIR
from ddlscale.units import parse_bandwidth, parse_time

# TCP over IPv4 over Ethernet carries 1448 payload bytes per 1514-byte frame (timestamps on): the
# shaped rate counts frames, so payload moves at this fraction of the NIC's bandwidth.
TCP_PAYLOAD_FRACTION = 1448 / 1514
ALPHA = "100us"  # per message step across veth + bridge + TCP, as measured on this host
# cluster.latency=auto: one machine's one-way delay to another in a datacenter, NIC to NIC through a
# top-of-rack switch and the kernel's TCP on both ends: round trips of 20-50 us are typical there (the
# papers' clusters: 25-400 Gbit/s in one or two racks). Only where the kernel has netem.
DATACENTER_LATENCY = "25us"
AUTO_LATENCY = "auto"

PREFIX = "ddl"  # every namespace this module creates starts with it
SUBNET = "10.213.0"  # machine i has SUBNET.(i+1)/24, inside its namespace only
MAX_NODES = 250  # addresses .1 to .250 of the /24
# torch's c10d rendezvous defaults (seconds), which a dilated cluster stretches by k.
RENDEZVOUS_SECONDS = {"join_timeout": 600, "last_call_timeout": 30, "close_timeout": 30, "heartbeat": 5,
                      "keep_alive_interval": 5}
# The app the workers run, as `python -m ddlscale`: an installed package has no train.py to run by path.
TRAIN_MODULE = "ddlscale"


def train_env() -> dict[str, str]:
    """The workers' PYTHONPATH, led by the folder this process imports ddlscale from: ``-m ddlscale``
    then runs the launcher's own ddlscale (as a train.py run by path did, its folder first on sys.path),
    not another copy the environment holds (a second checkout's editable install, an older wheel)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH")) if p)}


OWNERS_ENV = "DDLSCALE_CLUSTER_DIR"
OWNERS_DIR = "/run/ddlscale/clusters"  # /run is emptied at boot, like the namespaces themselves


def owners_dir() -> Path:
    return Path(os.environ.get(OWNERS_ENV) or OWNERS_DIR)


def owner_record(name: str) -> dict[str, Any] | None:
    """What cluster ``name`` recorded about its owner when it was made (None: no record)."""
    try:
        return json.loads((owners_dir() / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether the process that made a cluster still runs (the same process, not a reused pid)."""
    pid = record.get("owner_pid")
    return pid is not None and start_time(pid) == record.get("owner_start")


def _record_owner(name: str, keep: bool) -> None:
    pid = os.getpid()
    record = {"name": name, "kept": keep, "owner_pid": None if keep else pid,
              "owner_start": None if keep else start_time(pid), "owner_argv": sys.argv,
              "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = owners_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def forget_owner(name: str) -> None:
    (owners_dir() / f"{name}.json").unlink(missing_ok=True)


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"missing {' and '.join(missing)} (install iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _has_qdisc(ns: str, kind: str) -> bool:
    """Whether the kernel offers a qdisc kind (tried on the namespace's loopback, then removed)."""
    tried = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", kind],
                           capture_output=True)
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return tried.returncode == 0


_NETEM: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has tc's netem qdisc (the only way here to delay a link), tried once."""
    global _NETEM
    if _NETEM is None:
        if unavailable_reason() is not None:
            return False
        probe = f"{PREFIX}probe{os.getpid()}"
        _sh("ip", "netns", "add", probe)
        try:
            _NETEM = _has_qdisc(probe, "netem")
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return _NETEM


def resolve_latency(latency: str | float) -> float:
    """``cluster.latency`` in seconds: a time, or ``auto`` (:data:`DATACENTER_LATENCY` where the kernel
    can delay a link, else 0: this emulation cannot add a delay it has no qdisc for)."""
    if isinstance(latency, str) and latency.strip().lower() == AUTO_LATENCY:
        return parse_time(DATACENTER_LATENCY) if netem_available() else 0.0
    return parse_time(latency)


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in out if pid.isdigit()]


def _kill_namespace_processes(ns: str, signum: int = signal.SIGKILL) -> None:
    for pid in _namespace_pids(ns):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def remove_namespaces(names: Sequence[str], grace_s: float = 0.0) -> None:
    """Kill every process inside, then delete the namespaces (their veths go with them). With
    ``grace_s``, the processes are asked first (SIGTERM) and given that long to finish."""
    if grace_s > 0:
        for ns in names:
            _kill_namespace_processes(ns, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_namespace_pids(ns) for ns in names):
            time.sleep(0.1)
    for ns in names:
        _kill_namespace_processes(ns)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class EmulatedCluster:
    """N emulated machines with NICs of ``bandwidth`` (tc units, e.g. "1gbit") and one-way ``latency``.

    ``dilation`` (k >= 1) slows the whole emulation by k (:mod:`ddlscale.clock`): the NICs are
    shaped to bandwidth / k with k times the delay, every process started on a machine learns k
    (``$DDLSCALE_DILATION``) and joins its machine's cgroup, which gives it ``ranks_per_machine / k``
    cores of this host (``cpu``: "shares" by weight, "quota" by CFS quota; :mod:`ddlscale.cluster.cpucap`;
    ``cap_cpus=False``: the machines share the host's cores as they come). ``bandwidth`` and
    ``latency`` stay the emulated cluster's own: they are what the cost model and every reported
    figure refer to. ``latency`` is one machine's one-way delay to another (half on each of the two
    links a message crosses); ``"auto"`` is :data:`DATACENTER_LATENCY` where the kernel has netem,
    else 0 (:func:`resolve_latency`).

    Use as a context manager (``with EmulatedCluster(4, "1gbit") as cluster: ...``) or call
    :meth:`up` / :meth:`down`. ``keep=True`` leaves it up when the owner exits (the CLI's ``up``).

    ``storage_bandwidth`` adds a storage machine (:mod:`ddlscale.cluster.storage`): a WebDAV server
    over the host directory ``storage_root``, behind one link of that bandwidth shared by every machine.
    """

    def __init__(self, nodes: int, bandwidth: str = "1gbit", latency: str = "0ms", name: str | None = None,
                 keep: bool = False, dilation: float = 1.0, ranks_per_machine: int = 1, cap_cpus: bool = True,
                 cpu: str = "shares", storage_bandwidth: str | None = None, storage_root: str | Path | None = None):
        if not isinstance(nodes, int) or nodes < 1 or nodes > MAX_NODES:
            raise ValueError(f"cluster.nodes must be an integer in [1, {MAX_NODES}], got {nodes!r}")
        self.nodes = nodes
        self.bandwidth_bps = parse_bandwidth(bandwidth)
        self.latency_s = resolve_latency(latency)
        self.dilation = parse_factor(dilation, "cluster.dilation")
        self.ranks_per_machine = ranks_per_machine
        self.name = name or f"{PREFIX}{uuid.uuid4().hex[:6]}"
        if not self.name.startswith(PREFIX) or len(self.name) > 12:
            raise ValueError(f"cluster name must start with {PREFIX!r} and have at most 12 characters: {self.name!r}")
        self.keep = keep
        self.is_up = False
        self.cap_cpus, self.cpu_mode = cap_cpus, cpu
        self.cpu_shares: CpuShares | None = None
        self.cpu_cap_missing: str | None = None  # why the machines run without their CPU shares, if they do
        # -- storage machine (ddlscale.cluster.storage) --
        self.storage = None if storage_bandwidth is None else StorageMachine(self, storage_bandwidth, storage_root)
        self.storage_endpoint = None  # set once it serves: what the workers get

    # -- names and addresses ---------------------------------------------------------------
    def storage_env(self) -> dict[str, str]:
        """What a process on a machine needs to reach the storage machine (its endpoint and credentials,
        handed through the environment); empty without one."""
        return self.storage_endpoint.env() if self.storage_endpoint is not None else {}

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def namespace(self, machine: int) -> str:
        return f"{self.name}-m{machine}"

    def address(self, machine: int) -> str:
        return f"{SUBNET}.{machine + 1}"

    @property
    def namespaces(self) -> list[str]:
        storage = [self.storage.namespace] if self.storage is not None else []  # storage machine
        return [self.namespace(i) for i in range(self.nodes)] + storage + [self.switch]

    def network_model(self, gpus_per_machine: int = 1) -> NetworkModel:
        """The cost model of this cluster: payload bandwidth of its NICs, its message latency. The
        host's own share of the emulation is removed by time dilation, not modelled."""
        return NetworkModel(
            bandwidth_bps=self.bandwidth_bps * TCP_PAYLOAD_FRACTION,
            latency_s=parse_time(ALPHA) + self.latency_s,
            gpus_per_machine=gpus_per_machine,
        )

    # -- life cycle --------------------------------------------------------------------------
    def up(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"emulated cluster unavailable: {reason}")
        if not self.keep:
            atexit.register(self.down)
            _teardown_on_sigterm()
        _record_owner(self.name, self.keep)  # first: a build that dies half-way is owned too
        try:
            self._cap_cpus()  # first: the storage machine's server starts in the cluster's cgroups
            self._build()
        except BaseException:
            self.down()
            raise
        self.is_up = True
        return self

    def _build(self) -> None:
        sw = self.switch
        _sh("ip", "netns", "add", sw)
        if self.latency_s > 0 and not _has_qdisc(sw, "netem"):
            raise RuntimeError(
                f"cluster.latency={self.latency_s * 1e3:g}ms needs tc's netem qdisc, which this kernel lacks; "
                "use cluster.latency=0ms"
            )
        _sh("ip", "netns", "exec", sw, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", sw, "ip", "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.namespace(i), f"v{i}"
            _sh("ip", "netns", "add", ns)
            # Both ends are born inside our namespaces: the host's interfaces are never involved.
            _sh("ip", "netns", "exec", sw, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _sh("ip", "netns", "exec", sw, "ip", "link", "set", port, "master", "br0")
            _sh("ip", "netns", "exec", sw, "ip", "link", "set", port, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # the machine's upload
            self._shape(sw, port)  # its download: the switch port's egress toward it
        if self.storage is not None:  # storage machine: one more namespace on the bridge, and its server
            self.storage_endpoint = self.storage.build()

    def _shape(self, ns: str, dev: str, verb: str = "add", bandwidth_bps: float | None = None) -> None:
        """Shape one direction of a link to the dilated rate and delay (``verb`` "replace": re-shape;
        ``bandwidth_bps``: a link of another bandwidth than the machines', the storage machine's)."""
        bandwidth_bps = self.bandwidth_bps if bandwidth_bps is None else bandwidth_bps
        rate = f"{int(bandwidth_bps / self.dilation)}bit"
        # A burst of ~1 ms of the NIC's traffic (at least 64 KiB) keeps tbf accurate without starving
        # TCP; its queue holds 100 ms. Both in bytes, the same at every k (in emulated time: 1 ms and
        # 100 ms): a burst sized to the dilated rate would split the 64 KiB segments TCP hands down
        # and wake the receiver per packet, which costs the capped machine CPU the real NIC's would not.
        burst = max(int(bandwidth_bps / 8 / 1000), 64 * 1024)
        tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", f"{100 * self.dilation:.0f}ms"]
        if self.latency_s > 0:  # a message crosses two links: its sender's upload, its receiver's download
            delay = f"{self.latency_s / 2 * self.dilation * 1e6:.0f}us"
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", "handle", "1:", "netem",
                "delay", delay)
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "parent", "1:", "handle", "2:", *tbf)
        else:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", dev, "root", *tbf)

    def _cap_cpus(self) -> None:
        """Give every machine ranks / k cores of this host (see :mod:`ddlscale.cluster.cpucap`)."""
        if not self.cap_cpus:
            return
        controller = find_controller()
        if controller is None:
            self.cpu_cap_missing = "no writable cgroup CPU controller on this host: CPU work is not slowed by k"
            if self.dilation > 1:
                warnings.warn(f"cluster.dilation={self.dilation:g}: {self.cpu_cap_missing}", stacklevel=3)
            return
        self.cpu_shares = CpuShares(controller, self.name, self.nodes, self.ranks_per_machine, self.dilation,
                                    self.cpu_mode)

    def set_dilation(self, dilation: float) -> None:
        """Re-shape a running cluster to another k (the processes already started keep the k they were given)."""
        self.dilation = parse_factor(dilation, "cluster.dilation")
        for i in range(self.nodes):
            self._shape(self.namespace(i), "eth0", "replace")
            self._shape(self.switch, f"v{i}", "replace")
        if self.storage is not None:  # storage machine
            self.storage.shape("replace")
        if self.cpu_shares is not None:
            self.cpu_shares.set_dilation(self.dilation)

    def cpu_cap(self) -> str:
        """What gives each machine its CPU, in words (for printouts and summaries)."""
        if self.cpu_shares is not None:
            return self.cpu_shares.describe()
        return self.cpu_cap_missing or "not capped: the machines share the host's cores"

    def cpu_ledger(self) -> CpuLedger:
        """An account of the CPU each machine receives from now on (:mod:`ddlscale.cluster.cpuload`)."""
        shares = self.cpu_shares
        machines = shares.accounting if shares is not None else [None] * self.nodes
        own = [shares.reserve_accounting] if shares is not None else []
        return CpuLedger(machines, own, self.ranks_per_machine, self.dilation)

    def down(self, grace_s: float = 0.0) -> None:
        """Remove the cluster; ``grace_s``: first let its processes stop on SIGTERM for up to that long."""
        remove_namespaces([ns for ns in self.namespaces if ns in set(list_namespaces(self.name))], grace_s)
        if self.cpu_shares is not None:
            self.cpu_shares.remove()
            self.cpu_shares = None
        if self.storage is not None:  # storage machine: its server went with its namespace
            self.storage.forget()
            self.storage_endpoint = None
        forget_owner(self.name)
        self.is_up = False

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    # -- running things on machines ----------------------------------------------------------------
    def popen(self, machine: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any):
        """Start ``argv`` inside machine ``machine``'s namespace (and CPU cap), told the cluster's k."""
        full_env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", DILATION_ENV: f"{self.dilation:g}", **(env or {})}
        command = ["ip", "netns", "exec", self.namespace(machine), *argv]
        if self.cpu_shares is not None:
            command = self.cpu_shares.wrap(machine, command)
        return subprocess.Popen(command, env=full_env, **kwargs)

    def kill_machine(self, machine: int) -> None:
        """Machine failure: every process of that machine dies at once (trainer, agents...)."""
        _kill_namespace_processes(self.namespace(machine))

    def start_rendezvous_store(self, port: int = 29400):
        """A TCPStore on machine 0 that outlives every agent, for torchrun's c10d rendezvous.

        Hosted by an agent, the store would die with it: peers then fail to leave the rendezvous at
        the end, and a failure injected into that machine would take the whole job down.
        """
        code = (
            "import datetime, signal, time\n"
            "from ddlscale.cluster.pgstore import listening_store\n"
            # A stop of the whole job (SIGTERM to every process, SLURM's SIGUSR1) is not for it: the drain
            # that follows reads Gemini's keys here. Its owner removes it with the cluster (SIGKILL).
            "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1): signal.signal(s, signal.SIG_IGN)\n"
            # On this machine's address alone: torch's TCPStore would listen on every interface.
            f"s = listening_store('{self.address(0)}', {port}, datetime.timedelta(hours=24))\n"
            "print('ready', flush=True)\n"
            "while True: time.sleep(3600)"
        )
        store = self.popen(0, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        if store.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the rendezvous store on {self.address(0)}:{port} did not start")
        return store

    def rendezvous_conf(self) -> str:
        """torchrun's c10d rendezvous options: its timeouts and keep-alive stretched by k.

        The agents run capped like every process on their machine, and torch's rendezvous keeps wall
        time: at k = 8 on 8 machines an agent's rounds of the rendezvous outlasted its peers' patience
        with its keep-alives (5 s, three missed) and the rendezvous never completed.
        """
        k = self.dilation
        stretched = {name: seconds * k for name, seconds in RENDEZVOUS_SECONDS.items()}
        return ",".join(["is_host=false", *(f"{name}={seconds:.0f}" for name, seconds in stretched.items())])

    def torchrun(self, machine: int, script_args: Sequence[str], nproc_per_node: int = 1, port: int = 29400,
                 module: str = TRAIN_MODULE, max_restarts: int = 0, etcd: Any = None, run_id: str = "none",
                 **popen_kwargs: Any):
        """One torchrun agent on ``machine``, joining the store of :meth:`start_rendezvous_store` — or,
        given ``etcd`` (an :class:`~ddlscale.cluster.control_plane.EtcdAddress`), the rendezvous kept in
        those etcd members (:mod:`ddlscale.cluster.etcd_rendezvous`), which no single machine holds."""
        if etcd is not None:
            rendezvous = ["--rdzv-backend=ddlscale-etcd", f"--rdzv-endpoint={etcd.rendezvous_endpoint}",
                          f"--rdzv-id={run_id}"]
        else:
            rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.address(0)}:{port}",
                          f"--rdzv-conf={self.rendezvous_conf()}", f"--rdzv-id={run_id}"]
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nodes}", f"--nproc-per-node={nproc_per_node}", *rendezvous,
            f"--local-addr={self.address(machine)}", f"--max-restarts={max_restarts}",
            "--module", module, *script_args,
        ]
        # Workers' process-group store: a fresh one per rendezvous round, hosted by that round's rank 0.
        # The shared agent store outlives rounds, and after a restart whose agents disagree on the
        # restart count the workers read the previous round's addresses and fail to connect.
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **train_env(), **(popen_kwargs.pop("env", None) or {})}
        return self.popen(machine, argv, env=env, **popen_kwargs)


_SIGTERM_INSTALLED = False


def _teardown_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks and atexit run the teardown."""
    global _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def exit_cleanly(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_cleanly)
    _SIGTERM_INSTALLED = True
