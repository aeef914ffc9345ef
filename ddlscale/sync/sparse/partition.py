"""Who owns which index: Zen's hash partition and the even contiguous split of a parameter server.

A partitioner answers three questions about a tensor of ``numel`` elements: which server owns each
index (``server_of``), the sorted set each server owns, and each index's position in that set
(``layout``) — so servers sum into compact buffers and the hash-bitmap pull can name owned indices
by one bit each.
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse import native


class ContiguousPartitioner:
    """Server s owns indices [s*M/n, (s+1)*M/n): what sparse parameter servers and OmniReduce do.

    Balanced for uniform indices, badly imbalanced under the skew of real embedding gradients.
    """

    def __init__(self, num_servers: int):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.num_servers = num_servers
        self._layouts: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def bounds(self, numel: int) -> list[int]:
        return [s * numel // self.num_servers for s in range(self.num_servers + 1)]

    def server_of(self, indices: torch.Tensor, numel: int) -> torch.Tensor:
        upper = torch.tensor(self.bounds(numel)[1:], dtype=torch.int64)
        return torch.searchsorted(upper, indices.to(torch.int64), right=True)

    def layout(self, numel: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        if numel not in self._layouts:
            edges = self.bounds(numel)
            owned = [torch.arange(edges[s], edges[s + 1], dtype=torch.int64) for s in range(self.num_servers)]
            position = torch.arange(numel, dtype=torch.int64) - torch.repeat_interleave(
                torch.tensor(edges[:-1]), torch.tensor([o.numel() for o in owned])
            )
            self._layouts[numel] = (owned, position)
        return self._layouts[numel]


def split_by_server_reference(
    server: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, num_servers: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Reorder (index, value) pairs so each server's are contiguous; return the count per server."""
    order = torch.argsort(server, stable=True)
    counts = torch.bincount(server, minlength=num_servers).tolist()
    return indices[order], values[order], counts


def partition_reference(indices: torch.Tensor, values: torch.Tensor, seed: int, num_servers: int):
    """Hash then split: what ``native.partition`` fuses into one pass."""
    from ddlscale.sync.sparse.hashing import server_of_reference

    return split_by_server_reference(server_of_reference(indices, seed, num_servers), indices, values, num_servers)


def split_by_server(
    server: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, num_servers: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Reorder (index, value) pairs so each server's are contiguous (input order kept within a server);
    return the count per server. A counting sort in C++ where that was measured faster."""
    return native.split_by_server(server, indices, values, num_servers)
