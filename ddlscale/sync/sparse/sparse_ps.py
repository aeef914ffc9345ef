"""A sparse parameter server with an even contiguous split (the baseline Zen's hashing fixes).

Same push / incremental sum / COO pull as Zen, at the same granularity (rows of an embedding), but
server s owns units [sM/n, (s+1)M/n). Under the skew of embedding gradients (most non-zeros among
the first rows) the first servers receive and send most of the traffic, so the busiest NIC, not the
average, sets the time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.partition import ContiguousPartitioner
from ddlscale.sync.sparse.pushpull import INDEX_BYTES
from ddlscale.sync.sparse.sparse_sync import SparseSync
from ddlscale.sync.sparse.traffic import (
    PUSH_PULL_ROUNDS,
    Exchanges,
    Sparsity,
    Traffic,
    coo_bytes,
    partitioned_seconds,
    push_pull_exchanges,
)


class SparsePSCost:
    """What the sparse parameter server moves: Zen's COO push and pull, priced from figures as if the
    contiguous split were balanced (it is not under skew: the real index sets show its busiest server)."""

    def traffic(self, s: Sparsity, exchanges: Exchanges) -> Traffic:
        return Traffic(coo_bytes(s), PUSH_PULL_ROUNDS, exchanges=push_pull_exchanges(s, exchanges))

    def projected_seconds(self, model: NetworkModel, sets: Sequence[torch.Tensor], numel: int,
                          unit_bytes: int) -> float:
        n, pair = len(sets), INDEX_BYTES + unit_bytes

        def contiguous(items):
            return items * n // numel
        return partitioned_seconds(model, sets, contiguous, n, pair, lambda s, mine: mine.numel() * pair)


class SparsePSSync(SparseSync):
    """``sync=sparse_ps``: push/pull through contiguous partitions, COO both ways."""

    def on_setup(self) -> None:
        self.partitioner = ContiguousPartitioner(self.world_size)
        super().on_setup()

    def scheme_cost(self) -> SparsePSCost:
        return SparsePSCost()

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        comm = self.sparse_comm
        group_by = functools.partial(self.partitioner.group, numel=units)  # ids ascending: runs, no reorder
        received = pushpull.push(comm, ids, values, group_by, self.timed)
        with self.timed("decode"):
            summed = pushpull.aggregate(received)
        pieces = pushpull.pull_coo(comm, *summed, self.timed)
        with self.timed("decode"):
            return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
