"""Choosing the emulated cluster's time dilation k (``cluster.dilation``), and the probe behind ``auto``.

Time dilation (:mod:`ddlscale.clock`) slows the whole emulation by k: NICs at bandwidth / k with k
times the delay, every machine's CPU capped at ranks / k cores (:mod:`ddlscale.cluster.cpucap`),
device time k times longer, and every reported time divided by k. A larger k leaves the host more
room per emulated second, so the host stops deciding the figures; it costs k times the wall time.

``auto`` takes the smallest k at which the host is not the bottleneck, on two counts:

* **CPU share**: capped at 1/k core per rank, the machines' ranks fit this host's cores only from
  k = machines x ranks per machine / cores.
* **Moving bytes**: veth, bridge and tc run in the kernel on the same cores. A many-to-many exchange
  (an all-to-all among every rank, the pattern of sparse syncs and compressed exchanges) is timed on
  the cluster itself, capped as the job will be, and k grows until that exchange runs within
  :data:`TOLERANCE` of its wire time (the busiest NIC's bytes / bandwidth).

The probe's answer depends on the host, not the job, so it is cached per host and cluster shape
(:func:`cache_path`); ``python -m ddlscale.cluster dilation`` probes again and shows the steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ddlscale import clock
from ddlscale.clock import parse_factor

AUTO = "auto"
TOLERANCE = 1.15  # the probe's exchange within this factor of its wire time...
KNEE = 1.10  # ...or within this factor of its time at twice the k (slowing further buys nothing)
MAX_DILATION = 32
PROBE_WIRE_S = 0.25  # emulated seconds of wire time per timed exchange
PROBE_REPS = 5
MAX_BLOCK_BYTES = 16 << 20
PROBE_PORT = 29519
CACHE_ENV = "DDLSCALE_CACHE_DIR"
PROBE_VERSION = 3  # the probe and the shaping it measures: a cached answer of another version is not used
ROUND_BYTES = 64  # a small message: its serialization is nothing beside its round
ROUNDS = 200  # rounds timed per pattern
ROUND_SLACK, ROUND_SLACK_S = 0.25, 50e-6  # a round within the link's delay plus max(25%, 50 us) of it


def parse(value: object, key: str = "cluster.dilation") -> float | str:
    """``auto`` or a number >= 1."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_factor(value, key)
    except ValueError:
        raise ValueError(f"{key} must be auto or a number >= 1, got {value!r}") from None


def cpu_share(machines: int, ranks_per_machine: int, cores: int | None = None) -> float:
    """The k at which every rank's 1/k core fits on this host's cores."""
    return max(1.0, machines * ranks_per_machine / (cores or os.cpu_count() or 1))


@dataclass
class Choice:
    """The k a run uses and why: ``how`` is "configured" or "auto"; ``probes`` what each tried k measured."""

    k: float
    how: str
    cpu_share: float
    probes: list[dict[str, float]] = field(default_factory=list)
    why: str = ""  # why the search stopped at k
    cached: str | None = None  # where a cached probe came from (its file and date), None if probed now

    def describe(self) -> str:
        k = f"{self.k:g}"
        if self.how != AUTO:
            return f"time dilation k={k} (configured)"
        tried = ", ".join(f"{p['ratio']:.2f}x at k={p['k']:g}" for p in self.probes)
        rounds = ", ".join(f"{p['round_us']:.0f} us at k={p['k']:g}" for p in self.probes if "round_us" in p)
        gloo = next((p.get("gloo_ratio") for p in self.probes if p["k"] == self.k), None)
        library = f"; gloo's all_to_all of the same blocks {gloo:.2f}x at k={k}" if gloo else ""
        source = f"; cached {self.cached}" if self.cached else ""
        return (f"time dilation k={k} (auto: the CPU share needs k >= {self.cpu_share:g}; every rank sending to every "
                f"other at once over sockets took {tried} its wire time; a round of small messages {rounds}; "
                f"k={k}: {self.why}{library}{source})")

    def summary(self) -> dict[str, Any]:
        return {"dilation": self.k, "dilation_choice": asdict(self)}


# -- the cache --------------------------------------------------------------------------------------
def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddlscale"
    return Path(root) / "dilation.json"


def cache_key(machines: int, ranks_per_machine: int, bandwidth_bps: float, latency_s: float) -> str:
    host = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores {platform.release()}"
    return (f"{host} | {machines}x{ranks_per_machine} ranks, {bandwidth_bps:g} bit/s, {latency_s:g} s delay "
            f"| probe {PROBE_VERSION}")


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    path = cache_path()
    data = _read_cache()
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


# -- one machine, dilated in place ---------------------------------------------------------------
@contextlib.contextmanager
def dilated_here(k: float, ranks: int) -> Iterator[str]:
    """Run this process, and every process it starts meanwhile, as one emulated machine of ``ranks``
    ranks at dilation k: capped at ranks / k cores (:mod:`ddlscale.cluster.cpucap`), told k through
    ``$DDLSCALE_DILATION`` and :func:`ddlscale.clock.dilated`. For experiments on one machine (no
    NIC to shape): each rank gets one emulated core of its own and the host keeps the rest for the
    kernel and the launcher, as a machine with spare cores would. Yields the cap in words."""
    from ddlscale.cluster.cpucap import CpuShares, find_controller, own_group

    k = parse_factor(k, "dilation")
    controller = find_controller() if k > 1 else None
    if k > 1 and controller is None:
        raise RuntimeError("dilation on one machine needs a writable cgroup CPU controller (root, cgroups)")
    shares = CpuShares(controller, f"ddlh{os.getpid() % 100000}", 1, ranks, k) if controller else None
    home = own_group(controller) if controller else None
    saved = os.environ.get(clock.ENV)
    os.environ[clock.ENV] = f"{k:g}"
    try:
        if shares is not None:
            (shares.groups[0] / "cgroup.procs").write_text(f"{os.getpid()}\n")
        with clock.dilated(k):
            yield f"{ranks}/{k:g} core of this host" if shares else "not capped (k = 1)"
    finally:
        if shares is not None:  # back where it was, then the empty group can go
            (home / "cgroup.procs").write_text(f"{os.getpid()}\n")
            shares.remove()
        if saved is None:
            os.environ.pop(clock.ENV, None)
        else:
            os.environ[clock.ENV] = saved


# -- the search -------------------------------------------------------------------------------------
def round_target(latency_s: float) -> float:
    """What a small message's round may cost in reported time: the configured one-way delay plus
    max(25%, 50 us) of it (a datacenter round costs 10-100 us; serialization of a small message is
    nothing at these rates)."""
    return latency_s + max(ROUND_SLACK * latency_s, ROUND_SLACK_S)


def search(probe: Any, start: float, round_target_s: float) -> tuple[float, list[dict[str, float]], str]:
    """The smallest k from ``start`` (doubling) at which the host no longer limits the emulated network.

    ``probe(k)`` gives the sockets' exchange time over its wire time (``sockets``, any other ratios kept
    beside it) and the reported seconds of a concurrent n-way round of small messages (``round_s``).
    The host limits the bytes while the exchange is beyond :data:`TOLERANCE` of its wire time, and the
    rounds while a round costs more than ``round_target_s`` (the host's per-packet work and thread
    wake-ups, which shrink as k leaves each machine more of the host between its messages); it stops
    limiting one once that holds, or once doubling k no longer speeds it beyond :data:`KNEE` (what
    remains is the emulated network's own: TCP's many flows through shaped links run 1.2-1.3x their
    wire time on this host at any k). k doubles until both hold. Returns (k, every probe, why).
    """
    def tried_at(k: float) -> dict[str, float]:
        measured = probe(k)
        return {"k": k, "ratio": round(measured["sockets"], 4), "round_us": round(measured["round_s"] * 1e6, 1),
                **{f"{kind}_ratio": round(r, 4) for kind, r in measured.items() if kind not in ("sockets", "round_s")}}

    k = float(max(1, math.ceil(start)))
    tried = [tried_at(k)]
    current = tried[-1]
    target_us = round_target_s * 1e6
    while True:
        bytes_ok, rounds_ok = current["ratio"] <= TOLERANCE, current["round_us"] <= target_us
        if bytes_ok and rounds_ok:
            return k, tried, f"within {TOLERANCE:g}x of its wire time and rounds within {target_us:.0f} us"
        if k * 2 > MAX_DILATION:
            return k, tried, f"the largest k tried (the cap is {MAX_DILATION})"
        tried.append(tried_at(k * 2))
        doubled = tried[-1]
        bytes_done = bytes_ok or current["ratio"] <= KNEE * doubled["ratio"]
        rounds_done = rounds_ok or current["round_us"] <= KNEE * doubled["round_us"]
        if bytes_done and rounds_done:
            return k, tried, (f"k={k * 2:g} was within {KNEE:g}x of it in bytes and rounds: what remains is the "
                              "emulated network's own, not the host's")
        k, current = k * 2, doubled


def choose(setting: float | str, machines: int, ranks_per_machine: int, bandwidth_bps: float, latency_s: float,
           fresh: bool = False, log: Any = print) -> Choice:
    """The run's k: a configured number as it is, ``auto`` from the cache or a new probe."""
    share = cpu_share(machines, ranks_per_machine)
    if setting != AUTO:
        return Choice(float(setting), "configured", share)
    if machines * ranks_per_machine < 2:
        return Choice(max(1.0, float(math.ceil(share))), AUTO, share)
    key = cache_key(machines, ranks_per_machine, bandwidth_bps, latency_s)
    entry = None if fresh else _read_cache().get(key)
    if entry:
        return Choice(float(entry["k"]), AUTO, share, entry["probes"], entry.get("why", ""),
                      f"{entry['date']} in {cache_path()}")
    log(f"probing the host for cluster.dilation=auto ({machines} machines x {ranks_per_machine} ranks; cached after)")
    k, tried, why = probe_cluster(machines, ranks_per_machine, bandwidth_bps, latency_s, share, log)
    _write_cache(key, {"k": k, "probes": tried, "why": why, "date": time.strftime("%Y-%m-%d %H:%M")})
    return Choice(k, AUTO, share, tried, why)


class ProbeCluster:
    """An emulated cluster of probe workers (:func:`_worker`), one per rank, re-set to each k tried.

    ``exchange(block, reps)``: wall seconds of every rank sending ``block`` bytes to every other at
    once, over sockets and through gloo; ``rounds(n)``: wall seconds per message round of each
    pattern of :func:`_rounds`. The workers keep their connections across k: only the links' shaping
    and the machines' CPU shares change.
    """

    def __init__(self, machines: int, ranks_per_machine: int, bandwidth_bps: float, latency_s: float, k: float,
                 cpu: str = "shares"):
        from ddlscale.cluster.emulated import EmulatedCluster

        self.machines, self.ranks_per_machine = machines, ranks_per_machine
        self.world = machines * ranks_per_machine
        self.cluster = EmulatedCluster(machines, f"{bandwidth_bps:g}bit", f"{latency_s:g}s", dilation=k,
                                       ranks_per_machine=ranks_per_machine, cpu=cpu)
        self.workers: list[subprocess.Popen] = []

    def __enter__(self) -> ProbeCluster:
        cluster = self.cluster.up()
        try:
            addresses = ",".join(cluster.address(m) for m in range(self.machines))
            self.workers = [cluster.popen(m, [sys.executable, "-m", "ddlscale.cluster.dilation", "--worker",
                                              str(m * self.ranks_per_machine + r), str(self.world),
                                              str(self.ranks_per_machine), addresses],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                            for m in range(self.machines) for r in range(self.ranks_per_machine)]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for worker in self.workers:
            if worker.stdin:
                worker.stdin.close()
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        self.cluster.down()

    @property
    def k(self) -> float:
        return self.cluster.dilation

    def set_dilation(self, k: float) -> None:
        self.cluster.set_dilation(k)

    def _ask(self, command: str) -> Any:
        """The workers' answer to ``command``, with ``starved``: whether a machine got less CPU than its
        share meanwhile (:mod:`ddlscale.cluster.cpuload`: then the answer is the host's, not the cluster's)."""
        ledger = self.cluster.cpu_ledger()
        ledger.start()
        for worker in self.workers:
            worker.stdin.write(command + "\n")
            worker.stdin.flush()
        replies = [worker.stdout.readline() for worker in self.workers]
        if not replies[0].startswith("RESULT "):
            raise RuntimeError(f"the dilation probe's workers failed: {replies[0]!r}")
        return {**json.loads(replies[0][len("RESULT "):]), "starved": ledger.finish()["starved"]}

    def exchange(self, block: int, reps: int) -> dict[str, list[float]]:
        return self._ask(f"{block} {reps}")

    def rounds(self, count: int = ROUNDS) -> dict[str, float]:
        return self._ask(f"ROUNDS {count}")


def probe_cluster(machines: int, ranks_per_machine: int, bandwidth_bps: float, latency_s: float,
                  start: float, log: Any = print) -> tuple[float, list[dict[str, float]], str]:
    """:func:`search` on a cluster of this shape, with one set of probe workers whose NICs and CPU
    shares are re-set for each k tried. Each probe also times gloo's all-to-all of the same
    blocks, reported beside it: the collective library's own excess, which no k removes."""
    from ddlscale.cluster.emulated import TCP_PAYLOAD_FRACTION

    world = machines * ranks_per_machine
    nic_bytes = PROBE_WIRE_S * bandwidth_bps * TCP_PAYLOAD_FRACTION / 8
    block = int(min(MAX_BLOCK_BYTES, max(1 << 16, nic_bytes / (ranks_per_machine * (world - ranks_per_machine)))))
    wire_s = ranks_per_machine * (world - ranks_per_machine) * block * 8 / (bandwidth_bps * TCP_PAYLOAD_FRACTION)
    with ProbeCluster(machines, ranks_per_machine, bandwidth_bps, latency_s, max(1.0, math.ceil(start))) as probes:
        def probe(k: float) -> dict[str, float]:
            probes.set_dilation(k)
            walls = probes.exchange(block, PROBE_REPS)
            starved = walls.pop("starved")
            measured = {kind: statistics.median(times) / k / wire_s for kind, times in walls.items()}
            rounds = probes.rounds()
            measured["round_s"] = rounds["exchange"] / k
            if starved or rounds["starved"]:
                log(f"  k={k:g}: a probe machine got less CPU than its share (another process was busy): "
                    "this k is the host's answer under load; probe again on a quiet host (--fresh)")
            log(f"  k={k:g}: {block / 2**20:.2f} MiB to every peer at once: sockets {measured['sockets']:.2f}x "
                f"their wire time, gloo's all_to_all {measured['gloo']:.2f}x; a round of small messages to every "
                f"peer {measured['round_s'] * 1e6:.0f} us")
            return measured

        return search(probe, start, round_target(latency_s))


def _exchange(peers: dict[int, Any], block: int) -> None:
    """Send ``block`` bytes to every peer and receive as many from each, all at once (a thread per
    direction per peer: the kernel's sockets, not one loop, decide how the bytes flow)."""
    out = memoryview(bytes(block))

    def receive(sock: Any) -> None:
        into, got = memoryview(bytearray(block)), 0
        while got < block:
            n = sock.recv_into(into[got:])
            if n == 0:
                raise ConnectionError("a probe peer closed its socket")
            got += n

    threads = [threading.Thread(target=sock.sendall, args=(out,)) for sock in peers.values()]
    threads += [threading.Thread(target=receive, args=(sock,)) for sock in peers.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _connect(rank: int, world: int, ranks_per_machine: int, addresses: list[str]) -> dict[int, Any]:
    """A TCP connection to every other rank: each rank listens, connects to the ranks above it and
    accepts the ranks below (a connection carries both directions)."""
    import socket

    import torch.distributed as dist

    def where(r: int) -> tuple[str, int]:
        return addresses[r // ranks_per_machine], PROBE_PORT + 1 + r

    listener = socket.create_server(where(rank))
    dist.barrier()  # every rank listens before anyone connects
    peers: dict[int, Any] = {}
    for peer in range(rank + 1, world):
        sock = socket.create_connection(where(peer))
        sock.sendall(rank.to_bytes(4, "big"))
        peers[peer] = sock
    for _ in range(rank):
        sock, _ = listener.accept()
        peers[int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")] = sock
    listener.close()
    for sock in peers.values():  # a small message leaves at once: rounds are timed, not Nagle's waits
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peers


def _recv_exactly(sock: Any, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = sock.recv_into(into[got:])
        if n == 0:
            raise ConnectionError("a probe peer closed its socket")
        got += n


def _rounds(rank: int, world: int, peers: dict[int, Any], rounds: int) -> dict[str, float]:
    """This rank's wall seconds per message round, each pattern ``rounds`` times back to back.

    ``pingpong``: rank 0 and rank 1 bounce a small message (one-way: half a round trip; the others
    wait). ``exchange``: every rank sends a small message to every other, then reads one from each
    (a concurrent n-way exchange round: what a sparse sync's push or a compressed exchange costs
    besides its bytes). ``gloo``: the same round as gloo's ``all_to_all_single`` of one float per peer
    (the collective library's own round). Per pattern: total / rounds, and ``<pattern>_cpu``: the CPU
    seconds this process used per round (its syscalls, and the kernel's forwarding of what it sends,
    which runs in its context) — what one round costs a machine with a core of its own.
    """
    import torch
    import torch.distributed as dist

    message = bytes(ROUND_BYTES)
    into = memoryview(bytearray(ROUND_BYTES))
    took: dict[str, float] = {}

    def timed(name: str, one_round: Any) -> None:
        one_round()  # warm
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(rounds):
            one_round()
        took[name] = (time.perf_counter() - start) / rounds
        took[f"{name}_cpu"] = (time.process_time() - cpu) / rounds  # this process's own CPU: not dilated

    def pingpong() -> None:
        if rank < 2:
            peer = peers[1 - rank]
            if rank == 0:
                peer.sendall(message)
            _recv_exactly(peer, into)
            if rank == 1:
                peer.sendall(message)

    def exchange() -> None:
        for sock in peers.values():
            sock.sendall(message)
        for sock in peers.values():
            _recv_exactly(sock, into)

    send, recv = torch.zeros(world), torch.zeros(world)
    timed("pingpong", pingpong)
    took["pingpong"] /= 2  # one way
    took["pingpong_cpu"] /= 2
    timed("exchange", exchange)
    timed("gloo", lambda: dist.all_to_all_single(recv, send))
    return took


def _worker(rank: int, world: int, ranks_per_machine: int, addresses: list[str]) -> None:
    """One probe rank. Each line on stdin is a command, answered on rank 0's stdout:

    ``BLOCK REPS``: time REPS exchanges of BLOCK bytes with every peer over plain sockets and as many
    gloo all-to-alls (each the slowest rank's wall time). ``ROUNDS N``: time N message rounds of each
    pattern of :func:`_rounds` (the slowest rank's seconds per round).
    """
    import datetime

    import torch
    import torch.distributed as dist

    from ddlscale.cluster import pgstore

    torch.set_num_threads(1)
    # Rank 0's store on machine 0's address alone (torch's own would listen on every interface).
    os.environ.update(MASTER_ADDR=addresses[0], MASTER_PORT=str(PROBE_PORT))
    pgstore.init_process_group("gloo", rank, world, datetime.timedelta(minutes=30))
    peers = _connect(rank, world, ranks_per_machine, addresses)

    def slowest(values: dict[str, float]) -> dict[str, float]:
        names = sorted(values)
        took = torch.tensor([values[n] for n in names], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return dict(zip(names, took.tolist(), strict=True))

    for line in sys.stdin:
        command, *numbers = line.split()
        if command == "ROUNDS":
            result: Any = slowest(_rounds(rank, world, peers, int(numbers[0])))
        else:
            block, reps = int(command), int(numbers[0])
            send = torch.zeros(world * block, dtype=torch.uint8)
            recv = torch.empty_like(send)
            calls = {"sockets": partial(_exchange, peers, block), "gloo": partial(dist.all_to_all_single, recv, send)}
            result = {}
            for kind, call in calls.items():
                call()  # warm: the shaping just changed
                result[kind] = []
                for _ in range(reps):
                    dist.barrier()
                    start = time.perf_counter()  # wall time: the launcher divides by the k it set
                    call()
                    result[kind].append(slowest({"t": time.perf_counter() - start})["t"])
        print("RESULT " + json.dumps(result) if rank == 0 else "done", flush=True)
    for sock in peers.values():
        sock.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.cluster.dilation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        rank, world, ranks_per_machine, addresses = args.worker
        _worker(int(rank), int(world), int(ranks_per_machine), addresses.split(","))
        return 0
    parser.error("run the probe with: python -m ddlscale.cluster dilation --nodes N [--bandwidth B]")
    return 2


if __name__ == "__main__":
    sys.exit(main())
