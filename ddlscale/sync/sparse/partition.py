"""The even contiguous split of a sparse parameter server (and OmniReduce's aggregators).

Server s owns indices [s*M/n, (s+1)*M/n): balanced for uniform indices, badly imbalanced under the
skew of real embedding gradients, where most non-zeros sit among the first rows — the imbalance
Zen's hash partition (:mod:`.hashing`) removes.
"""

from __future__ import annotations

import torch


class ContiguousPartitioner:
    """Server s owns the contiguous index range [s*M/n, (s+1)*M/n) of a tensor of M units."""

    def __init__(self, num_servers: int):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.num_servers = num_servers

    def bounds(self, numel: int) -> list[int]:
        return [s * numel // self.num_servers for s in range(self.num_servers + 1)]

    def server_of(self, indices: torch.Tensor, numel: int) -> torch.Tensor:
        upper = torch.tensor(self.bounds(numel)[1:], dtype=torch.int64, device=indices.device)
        return torch.searchsorted(upper, indices.to(torch.int64), right=True)

    def group(self, indices: torch.Tensor, values: torch.Tensor, numel: int):
        """(indices, values, count per server) for *ascending* indices: each server's units are
        already a contiguous run, so grouping is a binary search per boundary, no reordering."""
        edges = torch.tensor(self.bounds(numel), dtype=torch.int64, device=indices.device)
        cuts = torch.searchsorted(indices, edges).tolist()
        return indices, values, [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
