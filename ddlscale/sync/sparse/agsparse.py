"""AGsparse: allgather every worker's units and sum locally (Horovod's sparse allreduce).

One-shot centralization: no partition, no incremental sum, so each worker receives all n-1 other
workers' units — (4 + u) d M (n-1) bytes for M units of u bytes (an embedding row, or one value). In
fp32 elements, 8 d M (n-1): it beats dense allreduce only when d < 1/n. At row granularity it is the
algorithm PyTorch's gloo sparse allreduce runs (:mod:`.gloo_sparse`), with int32 indices and one
exchange where gloo takes three ring allgathers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.pushpull import INDEX_BYTES
from ddlscale.sync.sparse.sparse_sync import SparseSync
from ddlscale.sync.sparse.traffic import Exchanges, Sparsity, Traffic


class AGSparseCost:
    """What AGsparse moves: every worker's (index, unit) pairs to every other worker, one exchange."""

    def traffic(self, s: Sparsity, exchanges: Exchanges) -> Traffic:
        return Traffic(s.pair_bytes * s.density * s.units * (s.n - 1), 1,
                       exchanges=exchanges.rounds(s.pair_bytes * s.density * s.units))

    def projected_seconds(self, model: NetworkModel, sets: Sequence[torch.Tensor], numel: int,
                          unit_bytes: int) -> float:
        return model.allgather([s.numel() * (INDEX_BYTES + unit_bytes) for s in sets], len(sets), algorithm="direct")


class AGSparseSync(SparseSync):
    """``sync=agsparse``: allgather of (int32 row index, row) sets, summed on every worker."""

    def scheme_cost(self) -> AGSparseCost:
        return AGSparseCost()

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        comm = self.sparse_comm
        pieces = pushpull.pull_coo(comm, ids, values, self.timed)  # the same allgather of row sets
        with self.timed("decode"):
            return pushpull.aggregate(pieces)  # in rank order: deterministic
