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
PROBE_CALLS = 30


def _median_call(call: Any, group: Any, calls: int) -> float:
    """The median seconds of ``calls`` calls, each started together on every rank (a barrier before
    each: a call is timed as one round, not pipelined behind the previous one). A median, so that one
    call the host delayed moves nothing."""
    call()  # warm
    times = []
    for _ in range(calls):
        dist.barrier(group=group)
        start = clock.now()
        call()
        times.append(clock.now() - start)
    return statistics.median(times)


def probe_latency(group: Any, world_size: int, bandwidth_bps: float, calls: int = PROBE_CALLS) -> dict[str, Any]:
    """The alphas that make the cost model predict small collectives as they run on ``group`` (every rank calls).

    Times three patterns, each ``calls`` times (:func:`_median_call`):

    * ``exchange_round_s``: one concurrent n-way exchange round, every rank sending one float to every
      other at once through :class:`~ddlscale.comm.collectives.Communicator` (the path of a push, a pull
      or a compressed exchange). The model prices an all-to-all as n-1 message steps, so
      ``exchange_alpha_s`` is the round / (n-1) (a ring allgather's steps run one after another, each
      paying its own wake-ups: divided the same way it overstated the round; measured as a round it
      is the pattern the syncs run).
    * ``swap_s``: one pairwise swap with one peer (rank xor 1), a recursive-doubling step.
    * ``allreduce_s``: an allreduce of one float (a small dense bucket); ``allreduce_alpha_s`` is it
      over the ring's 2(n-1) steps.
    * ``allgather_s``: a ring allgather of one float (a compressed group's size exchange or small
      payload); ``allgather_alpha_s`` is it over the ring's n-1 steps: what the planned syncs price
      their allgathers with (gloo runs a tiny allgather several times slower than a tiny allreduce).

    On a real cluster that is the wire latency plus the library's per-message overhead; on emulated
    machines it also holds what the host adds, which :mod:`ddlscale.cluster.cpucap` keeps small.
    """
    if world_size < 2:
        return {"allreduce_alpha_s": 0.0, "exchange_alpha_s": 0.0, "allgather_alpha_s": 0.0, "exchange_round_s": 0.0,
                "swap_s": 0.0, "allreduce_s": 0.0, "allgather_s": 0.0, "calls": 0}
    comm = Communicator(group)
    rank = dist.get_rank(group)
    one, gathered = torch.zeros(world_size), torch.zeros(world_size)
    mine, theirs = torch.zeros(1), torch.zeros(1)
    pieces = [torch.zeros(1) for _ in range(world_size)]
    partner = rank ^ 1 if (rank ^ 1) < world_size else rank  # odd n: the last rank swaps with itself
    timed = {
        "exchange": _median_call(lambda: comm.all_to_all(gathered, one).wait(), group, calls),
        "swap": _median_call(lambda: comm.sendrecv(mine, theirs, partner).wait() if partner != rank else None,
                             group, calls),
        "allreduce": _median_call(lambda: dist.all_reduce(mine, group=group), group, calls),
        "allgather": _median_call(lambda: dist.all_gather(pieces, mine, group=group), group, calls),
    }
    zero, unit = (NetworkModel(bandwidth_bps, alpha, 1) for alpha in (0.0, 1.0))  # unit: per message step
    steps = {"exchange": lambda m: m.all_to_all(4.0, world_size), "allreduce": lambda m: m.allreduce(4, world_size),
             "allgather": lambda m: m.allgather(4, world_size, "ring")}
    alpha = {k: max(0.0, (timed[k] - f(zero)) / (f(unit) - f(zero))) for k, f in steps.items()}
    return {"allreduce_alpha_s": alpha["allreduce"], "exchange_alpha_s": alpha["exchange"],
            "allgather_alpha_s": alpha["allgather"], "exchange_round_s": timed["exchange"], "swap_s": timed["swap"],
            "allreduce_s": timed["allreduce"], "allgather_s": timed["allgather"], "calls": calls}


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
