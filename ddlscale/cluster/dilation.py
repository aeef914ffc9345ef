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
PROBE_VERSION = 2  # the probe and the shaping it measures: a cached answer of another version is not used


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
        gloo = next((p.get("gloo_ratio") for p in self.probes if p["k"] == self.k), None)
        library = f"; gloo's all_to_all of the same blocks {gloo:.2f}x at k={k}" if gloo else ""
        source = f"; cached {self.cached}" if self.cached else ""
        return (f"time dilation k={k} (auto: the CPU share needs k >= {self.cpu_share:g}; every rank sending to every "
                f"other at once over sockets took {tried} its wire time; k={k}: {self.why}{library}{source})")

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
def search(probe: Any, start: float) -> tuple[float, list[dict[str, float]], str]:
    """The smallest k from ``start`` (doubling) at which the host no longer limits the exchange.

    ``probe(k)`` gives the sockets' exchange time over its wire time (and any other ratios, kept).
    The host limits it while slowing the emulation further still speeds the exchange up; it does not
    once the exchange is within :data:`TOLERANCE` of its wire time, or within :data:`KNEE` of its
    time at twice the k. The second case is the emulated network's own floor: TCP's many flows
    through shaped links, measured 1.2-1.3x on this host at any k. Returns (k, every probe, why).
    """
    def tried_at(k: float) -> dict[str, float]:
        ratios = probe(k)
        return {"k": k, "ratio": round(ratios["sockets"], 4),
                **{f"{kind}_ratio": round(r, 4) for kind, r in ratios.items() if kind != "sockets"}}

    k = float(max(1, math.ceil(start)))
    tried = [tried_at(k)]
    current = tried[-1]
    while True:
        if current["ratio"] <= TOLERANCE:
            return k, tried, f"within {TOLERANCE:g}x of its wire time"
        if k * 2 > MAX_DILATION:
            return k, tried, f"the largest k tried (the cap is {MAX_DILATION})"
        tried.append(tried_at(k * 2))
        doubled = tried[-1]
        if current["ratio"] <= KNEE * doubled["ratio"]:
            return k, tried, (f"within {KNEE:g}x of its time at k={k * 2:g}: what remains is the emulated "
                              "network's own, not the host's")
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


def probe_cluster(machines: int, ranks_per_machine: int, bandwidth_bps: float, latency_s: float,
                  start: float, log: Any = print) -> tuple[float, list[dict[str, float]], str]:
    """:func:`search` on a cluster of this shape, with one set of probe workers whose NICs and CPU
    caps are re-set for each k tried. Each probe also times gloo's all-to-all of the same
    blocks, reported beside it: the collective library's own excess, which no k removes."""
    from ddlscale.cluster.emulated import TCP_PAYLOAD_FRACTION, EmulatedCluster

    world = machines * ranks_per_machine
    nic_bytes = PROBE_WIRE_S * bandwidth_bps * TCP_PAYLOAD_FRACTION / 8
    block = int(min(MAX_BLOCK_BYTES, max(1 << 16, nic_bytes / (ranks_per_machine * (world - ranks_per_machine)))))
    wire_s = ranks_per_machine * (world - ranks_per_machine) * block * 8 / (bandwidth_bps * TCP_PAYLOAD_FRACTION)
    with EmulatedCluster(machines, f"{bandwidth_bps:g}bit", f"{latency_s:g}s", dilation=max(1.0, math.ceil(start)),
                         ranks_per_machine=ranks_per_machine, cap_cpus=True) as cluster:
        addresses = ",".join(cluster.address(m) for m in range(machines))
        workers = [cluster.popen(m, [sys.executable, "-m", "ddlscale.cluster.dilation", "--worker",
                                     str(m * ranks_per_machine + r), str(world), str(ranks_per_machine), addresses],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for m in range(machines) for r in range(ranks_per_machine)]
        try:
            def probe(k: float) -> dict[str, float]:
                cluster.set_dilation(k)
                for worker in workers:
                    worker.stdin.write(f"{block} {PROBE_REPS}\n")
                    worker.stdin.flush()
                replies = [worker.stdout.readline() for worker in workers]
                if not replies[0].startswith("RESULT "):
                    raise RuntimeError(f"the dilation probe's workers failed: {replies[0]!r}")
                walls = json.loads(replies[0][len("RESULT "):])
                ratios = {kind: statistics.median(times) / k / wire_s for kind, times in walls.items()}
                log(f"  k={k:g}: {block / 2**20:.2f} MiB to every peer at once: sockets {ratios['sockets']:.2f}x "
                    f"their wire time, gloo's all_to_all {ratios['gloo']:.2f}x")
                return ratios

            return search(probe, start)
        finally:
            for worker in workers:
                if worker.stdin:
                    worker.stdin.close()
            for worker in workers:
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()


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
    return peers


def _worker(rank: int, world: int, ranks_per_machine: int, addresses: list[str]) -> None:
    """One probe rank: for each ``BLOCK REPS`` line on stdin, time REPS exchanges of BLOCK bytes with
    every peer over plain sockets and as many gloo all-to-alls (each the slowest rank's wall time);
    rank 0 prints them."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addresses[0]}:{PROBE_PORT}", rank=rank, world_size=world)
    peers = _connect(rank, world, ranks_per_machine, addresses)

    def slowest(call: Any) -> float:
        dist.barrier()
        start = time.perf_counter()  # wall time: the launcher divides by the k it set
        call()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    for line in sys.stdin:
        block, reps = (int(x) for x in line.split())
        send = torch.zeros(world * block, dtype=torch.uint8)
        recv = torch.empty_like(send)
        calls = {"sockets": partial(_exchange, peers, block), "gloo": partial(dist.all_to_all_single, recv, send)}
        times: dict[str, list[float]] = {}
        for kind, call in calls.items():
            call()  # warm: the shaping just changed
            times[kind] = [slowest(call) for _ in range(reps)]
        print("RESULT " + json.dumps(times) if rank == 0 else "done", flush=True)
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
