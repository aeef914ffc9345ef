"""A second lane for sparse syncs: its own process group and its own thread, so that a sparse tensor's
push and pull run while backward goes on, as the dense buckets' allreduces do.

A sparse scheme is a chain of dependent exchanges (a push, then a pull; or log n doubling stages):
unlike an allreduce it cannot be launched as one asynchronous call. So a group's whole sync runs as a
job on one worker thread. Collectives must reach every rank in one order per process group, and the
training thread keeps issuing dense allreduces meanwhile, so the jobs use a process group of their
own, created once per process (every rank creates it at the same point of set-up) and shared by every
sparse backend of the process; jobs run in submission order, which is the same on every rank.
``concurrent.futures`` supplies the thread and hands back results and exceptions.

Neither a lane nor the table of lanes keeps a process group alive (see :mod:`ddlscale.comm.groups`):
a lane ends with its world.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ddlscale.comm.groups import weak_group

_lanes: weakref.WeakKeyDictionary[Any, SyncLane] = weakref.WeakKeyDictionary()  # by world group


class SyncLane:
    """One process group over the world's ranks and one thread running submitted jobs in order."""

    def __init__(self) -> None:
        # The world's timeout, not new_group's 30-minute default: a lane collective that a peer never
        # joins fails on every rank as the world's would, naming where each rank was.
        world = dist.distributed_c10d._get_default_group()
        timeout = world._get_backend(torch.device("cpu")).options._timeout if dist.get_backend() == "gloo" else None
        self._group = weak_group(dist.new_group(list(range(dist.get_world_size())), backend=dist.get_backend(),
                                                timeout=timeout))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddlscale-sparse")

    @property
    def group(self) -> dist.ProcessGroup:
        """The lane's process group (an error once it is destroyed)."""
        return self._group()

    def submit(self, job, *args: Any) -> Future:
        return self._executor.submit(job, *args)


def shared_lane() -> SyncLane:
    """This process's lane for the current default process group (a new one after re-initialization)."""
    world = dist.distributed_c10d._get_default_group()
    if world not in _lanes:
        _lanes.clear()  # lanes of a destroyed world are dead
        _lanes[world] = SyncLane()
    return _lanes[world]
