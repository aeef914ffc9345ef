"""PyTorch's own sparse allreduce, as its users call it: ``dist.all_reduce`` on a sparse COO tensor.

On gloo it exchanges every rank's non-zero count, ring-allgathers every rank's int64 indices and its
values, and sums locally — AGsparse with 8-byte indices over three ring allgathers of n-1 steps each.
A hybrid tensor (an embedding's gradient: one index per row, values (nnz, D)) goes as it is: one
index per row. Here each fused group of units is that hybrid tensor, shaped (units, width); a lone
embedding table is exactly its gradient. NCCL has no sparse allreduce: CPU (gloo) only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse.sparse_sync import SparseSync
from ddlscale.sync.sparse.traffic import Exchanges, Sparsity, Traffic

INDEX_BYTES = torch.int64.itemsize  # gloo sends int64 indices


class GlooSparseCost:
    """What gloo's sparse allreduce moves: every rank's int64 indices and values to every other, as
    three ring allgathers (counts, indices, values)."""

    def traffic(self, s: Sparsity, exchanges: Exchanges) -> Traffic:
        # One call, as the ledger counts it; three ring allgathers inside.
        return Traffic((INDEX_BYTES + s.unit_bytes) * s.density * s.units * (s.n - 1), 1, allgathers=3)

    def projected_seconds(self, model: NetworkModel, sets: Sequence[torch.Tensor], numel: int,
                          unit_bytes: int) -> float:
        return model.allgather([s.numel() * (INDEX_BYTES + unit_bytes) for s in sets], len(sets))


class GlooSparseSync(SparseSync):
    """``sync=gloo_sparse``: each fused group through ``dist.all_reduce`` of one hybrid sparse COO tensor."""

    max_group_units = torch.iinfo(torch.int64).max  # gloo sends int64 indices

    def on_setup(self) -> None:
        if self.world_size > 1 and self.device.type != "cpu":
            raise ValueError(f"sync=gloo_sparse runs on CPU tensors over gloo, got device {self.device}")
        super().on_setup()

    def scheme_cost(self) -> GlooSparseCost:
        return GlooSparseCost()

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        with self.timed("encode"):
            local = torch.sparse_coo_tensor(ids[None], values, (units, width), is_coalesced=True,
                                            check_invariants=False)
        with self.timed("comm"):
            total = self.sparse_comm.sparse_allreduce(local).wait()
        with self.timed("decode"):
            total = total.coalesce()
            return total.indices()[0], total.values()
