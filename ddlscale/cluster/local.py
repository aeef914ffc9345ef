"""Run a function on n local gloo ranks and collect what each returns.

Tests, micro-benchmarks and experiments use this to exercise collectives without a trainer. It
starts processes with torch.multiprocessing and initializes a gloo group over loopback.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddlscale.cluster import pgstore


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple, results: Any
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A forked child must not enter the parent's OpenMP pool (libgomp hangs after fork); one
    # intra-op thread per rank is also what n ranks on few cores should use.
    torch.set_num_threads(1)
    # A rank stuck past every collective's timeout prints where each of its threads is, then exits,
    # so the parent's error can say more than that nothing came back.
    faulthandler.dump_traceback_later(1.9 * timeout_s, exit=True)  # the parent waits 2 x timeout_s
    try:
        # Rank 0's store on loopback only (torch's own would listen on every interface).
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        pgstore.init_process_group("gloo", rank, world_size, timedelta(seconds=timeout_s))
        # Serialized here: tensors sent through a queue as shared memory die with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        outcome = (rank, True, buffer.getvalue())
    except BaseException:  # report every failure to the parent instead of hanging it
        outcome = (rank, False, traceback.format_exc())
    results.put(outcome)  # before tearing down: a teardown that blocks must not swallow the report
    if dist.is_initialized():
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def run_workers(
    fn: Callable, world_size: int, *args: Any, start_method: str = "fork", timeout_s: float = 120.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on each of ``world_size`` gloo ranks; return results by rank.

    ``fn`` and its results must be picklable for ``start_method="spawn"``; with ``"fork"`` (the
    default, fastest) only the results must be. A rank stuck in a collective because a peer died
    gives up after ``timeout_s``.
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, timeout_s, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    errors, reported = [], set()
    for _ in range(world_size):
        try:
            rank, ok, value = results.get(timeout=2 * timeout_s)
        except queue.Empty:
            silent = sorted(set(range(world_size)) - reported)
            for p in procs:
                p.kill()
            raise RuntimeError(f"ranks {silent} reported nothing within {2 * timeout_s:g} s (their threads' "
                               "stacks, dumped before exiting, are in the captured stderr)\n"
                               + "\n".join(errors)) from None
        reported.add(rank)
        if ok:
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=30)
    if errors:
        raise RuntimeError("worker failed\n" + "\n".join(errors))
    return [collected[r] for r in range(world_size)]
