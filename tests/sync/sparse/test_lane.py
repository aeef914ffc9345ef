"""The sparse syncs' lane: its own process group, on the world's timeout."""

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster.local import run_workers
from ddlscale.sync.sparse.lane import shared_lane


def _lane(rank, world):
    lane = shared_lane()
    assert shared_lane() is lane  # one per world, shared by every sparse backend of the process
    timeout = lane.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    summed = torch.ones(1)
    lane.submit(lambda: dist.all_reduce(summed, group=lane.group)).result()
    return timeout, float(summed)


@pytest.mark.multiprocess
def test_the_lane_runs_collectives_on_the_world_s_timeout():
    """A lane collective that a peer never joins fails within the world's timeout (not new_group's 30
    minutes), so a desynchronized lane reports where each rank was instead of hanging the job."""
    for timeout, summed in run_workers(_lane, 2, timeout_s=7.0):
        assert timeout == 7.0 and summed == 2.0
