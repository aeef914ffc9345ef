"""The per-message latency a cluster really has: small collectives timed on the sync group.

A configured alpha is the wire's; what a message step costs in practice also holds the collective
library's overhead and, on emulated machines sharing a host's cores, process scheduling. Backends
whose choices weigh message counts (``sync.network_latency: measured`` in espresso, cupcake and the
sparse syncs) measure it once before they decide.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.comm.collectives import Communicator
from ddlscale.comm.network import NetworkModel

MEASURED = "measured"  # sync.network_latency: probe the sync group instead of assuming an alpha
PROBE_CALLS = 20


def probe_latency(group: Any, world_size: int, bandwidth_bps: float, calls: int = PROBE_CALLS) -> dict[str, Any]:
    """The alphas that make the cost model predict small collectives as they run on ``group`` (every rank calls).

    Times ``calls`` back-to-back allreduces and allgathers of one float — a small dense bucket, and a
    compressed group's size exchange or small payload — and divides each by its message steps in the
    model (2(n-1) for the ring allreduce, (n-1) for the ring allgather): ``allreduce_alpha_s`` and
    ``exchange_alpha_s`` (for allgather and the other exchanges; gloo runs a tiny allgather several
    times slower than a tiny allreduce). On a real cluster that is the wire latency plus the library's
    per-message overhead; on emulated machines sharing a host it also holds the scheduling of their
    processes, which no configured alpha knows.
    """
    if world_size < 2:
        return {"allreduce_alpha_s": 0.0, "exchange_alpha_s": 0.0, "allgather_s": 0.0, "allreduce_s": 0.0,
                "calls": 0}
    one = torch.zeros(1)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    timed = {}
    for name, call in (("allgather", lambda: dist.all_gather(gathered, one, group=group)),
                       ("allreduce", lambda: dist.all_reduce(one, group=group))):
        call()  # warm
        dist.barrier(group=group)
        start = clock.now()
        for _ in range(calls):
            call()
        timed[name] = (clock.now() - start) / calls
    predict = {"allgather": lambda m: m.allgather(4, world_size, "ring"), "allreduce": lambda m: m.allreduce(4, world_size)}
    zero, unit = (NetworkModel(bandwidth_bps, alpha, 1) for alpha in (0.0, 1.0))  # unit: per message step
    alpha = {k: max(0.0, (timed[k] - predict[k](zero)) / (predict[k](unit) - predict[k](zero))) for k in timed}
    return {"allreduce_alpha_s": alpha["allreduce"], "exchange_alpha_s": alpha["allgather"],
            "allgather_s": timed["allgather"],
            "allreduce_s": timed["allreduce"], "calls": calls}


PROBE_TOTALS = (8 << 20, 32 << 20)  # bytes each rank sends in the two timed exchanges (its input, itself included)


def probe_exchange(group: Any, world_size: int, totals: tuple[int, int] = PROBE_TOTALS, calls: int = 5) -> dict[str, Any]:
    """The pairwise exchange's rate and fixed cost as ``group`` shows them (every rank calls).

    Times all-to-alls of two sizes through :class:`~ddlscale.comm.collectives.Communicator`, the
    path the syncs' exchanges take (every pair at once, in segments, on gloo), and puts a line
    through the two medians: its slope gives the rate each NIC achieves (``bandwidth_bps``, payload
    bits a second), its intercept the cost every exchange pays whatever its size (``fixed_s``). A
    NIC's nominal rate is what one flow gets; many flows sharing each link at once get less, and
    an exchange starts up more slowly than a tiny message's latency says (measured on the emulated
    cluster: the same at any dilation, so not the host's).
    """
    if world_size < 2:
        return {"bandwidth_bps": float("inf"), "fixed_s": 0.0, "times_s": [], "totals": list(totals)}
    comm = Communicator(group)
    medians = []
    for total in totals:
        block = max(1, total // world_size)
        send = torch.zeros(world_size * block, dtype=torch.uint8)
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send).wait()  # warm
        times = []
        for _ in range(calls):
            dist.barrier(group=group)
            start = clock.now()
            comm.all_to_all(recv, send).wait()
            times.append(clock.now() - start)
        medians.append(statistics.median(times))
    busiest = [(world_size - 1) * max(1, total // world_size) for total in totals]  # bytes each NIC carries each way
    slope = max(medians[1] - medians[0], 1e-9) / (busiest[1] - busiest[0])
    return {"bandwidth_bps": 8 / slope, "fixed_s": max(0.0, medians[0] - busiest[0] * slope),
            "times_s": medians, "totals": list(totals)}


def probe_bandwidth(group: Any, world_size: int) -> float:
    """A NIC's payload bit/s as the pairwise exchange achieves it (:func:`probe_exchange`'s rate)."""
    return probe_exchange(group, world_size)["bandwidth_bps"]
