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


def probe_bandwidth(group: Any, world_size: int, block_bytes: int = 1 << 20, calls: int = 3) -> float:
    """A NIC's bandwidth as an all-to-all of ``block_bytes`` per peer shows it (every rank calls).

    Each rank sends and receives (n-1) blocks at once, so its NIC carries (n-1) * block_bytes each
    way; the median of ``calls`` timed exchanges, less the message steps' latency measured with one
    tiny exchange, gives bit/s. On the emulated cluster it lands near the shaped rate times TCP's
    payload fraction; on a shared host it also holds the host's copying, which is the point of
    measuring.
    """
    if world_size < 2:
        return float("inf")
    send = torch.zeros(world_size * block_bytes, dtype=torch.uint8)
    recv = torch.empty_like(send)
    tiny, tiny_out = torch.zeros(world_size, dtype=torch.uint8), torch.empty(world_size, dtype=torch.uint8)

    def timed(out: torch.Tensor, data: torch.Tensor) -> float:
        dist.barrier(group=group)
        start = clock.now()
        dist.all_to_all_single(out, data, group=group)
        return clock.now() - start

    timed(recv, send)  # warm
    base = statistics.median(timed(tiny_out, tiny) for _ in range(calls))
    full = statistics.median(timed(recv, send) for _ in range(calls))
    return (world_size - 1) * block_bytes * 8 / max(full - base, 1e-9)
