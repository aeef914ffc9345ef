"""Zen's balanced partitioning: a fixed hash h0 of the flat index decides which server owns it.

Why a hash: push balance needs every worker to send ~|I_i|/n of its non-zeros to each server, and
pull balance needs every server to own ~|union I|/n of them — so the same index must always go to
the same server (a function of the index alone, identical on every rank), and that function must
scatter the skewed, clustered indices of real gradients evenly. Contiguous splits fail the second
need under skew (>60% of non-zeros in the first 1/8 of embedding tables); data-dependent splits
(sorting, thresholds) cost too much. h0 here is MurmurHash3's 64-bit finalizer (fmix64) of the index
xor a seed — full avalanche, so clusters of nearby indices spread over all servers.

Indices are 0-based and every value 0..M-1 is hashed, index 0 included (a known bug class in
1-based hash tables is dropping it).

``server_of_reference`` and ``layout_reference`` are the pure-PyTorch definitions; the partitioner
calls them through :mod:`ddlscale.sync.sparse.native`, which runs the C++ kernels (bit-identical)
where they were measured faster.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ddlscale.sync.sparse import native

_MASK63 = (1 << 63) - 1
# fmix64 multipliers as signed int64 (torch has no uint64 arithmetic; multiplication wraps).
_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)


def _logical_shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as if x were unsigned 64-bit (torch's >> on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer on int64 tensors (bit-exact with the unsigned original)."""
    x = x ^ _logical_shift_right(x, 33)
    x = x * _C1
    x = x ^ _logical_shift_right(x, 33)
    x = x * _C2
    return x ^ _logical_shift_right(x, 33)


def server_of_reference(indices: torch.Tensor, seed: int, num_servers: int) -> torch.Tensor:
    """h0: (fmix64(index ^ seed) & (2^63 - 1)) % num_servers, int64 in, int64 out."""
    hashed = fmix64(indices.to(torch.int64) ^ seed)
    return (hashed & _MASK63) % num_servers


def layout_reference(numel: int, seed: int, num_servers: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(owned index set per server, sorted; position of every index within its owner's set)."""
    all_indices = torch.arange(numel, dtype=torch.int64)
    owner = server_of_reference(all_indices, seed, num_servers)
    order = torch.argsort(owner, stable=True)  # stable: each set comes out sorted
    counts = torch.bincount(owner, minlength=num_servers).tolist()
    owned = list(torch.split(order, counts))
    position = torch.empty(numel, dtype=torch.int64)
    for members in owned:
        position[members] = torch.arange(members.numel(), dtype=torch.int64)
    return owned, position


class HashPartitioner:
    """Maps flat indices of a tensor to ``num_servers`` partitions by h0 = fmix64(index ^ seed).

    Also precomputes, per tensor size ``M``, each server's owned index set ``I_s`` (sorted) and
    every index's position inside it, so a server aggregates into a compact ``|I_s|``-long buffer
    and the hash-bitmap pull can send one bit per owned index.
    """

    def __init__(self, num_servers: int, seed: int = 0x5EED):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.num_servers = num_servers
        self.seed = int(seed) & _MASK63
        self._layouts: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def server_of(self, indices: torch.Tensor) -> torch.Tensor:
        """Owning server of each flat index (int64 in, int64 out)."""
        return native.server_of(indices, self.seed, self.num_servers)

    def layout(self, numel: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(owned index set per server, position of every index within its owner's set)."""
        if numel not in self._layouts:
            self._layouts[numel] = native.hash_layout(numel, self.seed, self.num_servers)
        return self._layouts[numel]

    def clear_layouts(self) -> None:
        """Forget the cached layouts (16 bytes per element each), e.g. when the fused sizes change."""
        self._layouts.clear()

    def fingerprint(self) -> str:
        return hashlib.sha256(f"fmix64:{self.seed}:{self.num_servers}".encode()).hexdigest()

    def verify_agreement(self, group: dist.ProcessGroup | None = None) -> None:
        """Raise unless every rank hashes with the same seed and server count (one small collective)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        mine = self.fingerprint()
        everyone: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        if len(set(everyone)) != 1:
            raise RuntimeError(f"ranks disagree on the hash partitioner (seed/servers): {everyone}")


def agreed_seed(seed: int | None, group: dist.ProcessGroup | None = None) -> int:
    """Rank 0's seed (or a fresh one when None), the same on every rank."""
    chosen = [seed if seed is not None else int(torch.randint(0, 2**62, ()).item())]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(chosen, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return int(chosen[0])
