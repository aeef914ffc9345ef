"""Recursive doubling with merging: SparCML's sparse allreduce and Zen's Hierarchical Centralization.

Stage i (i = 0 .. log2 p - 1): each rank swaps its partial sum with rank ``r XOR 2^i`` and merges
the two, so after stage i it holds the sum of its aligned group of 2^(i+1) ranks and after log2 p
stages the global sum. Stage i moves the merged non-zeros of 2^i workers, gamma_{2^i} d M of them:
the T_hc formula. When n is not a power of two, the ranks r >= p = 2^floor(log2 n) first fold their
vector into rank r - p and get the result back at the end (SparCML's reduction to a power of two).

SparCML's dense switch: once a partial sum is so full that (index, value) pairs outweigh the dense
vector (density past ``dense_threshold``), it travels dense from then on; merging anything with a
dense vector is dense.

Merges always add the lower group's vector first, so both partners compute the same bits and every
rank ends with an identical result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddlscale.comm import Communicator
from ddlscale.sync.sparse.pushpull import INDEX_BYTES, pack_pairs, unpack_pairs


def break_even_density(value_bytes: int) -> float:
    """Density where an (int32 index, value) pair list weighs as much as the dense vector."""
    return value_bytes / (INDEX_BYTES + value_bytes)


def doubling(comm: Communicator, part, swap: Callable, send: Callable, recv: Callable, merge: Callable,
             on_stage: Callable[[int, object], None] | None = None):
    """Drive recursive doubling over ``comm``'s ranks for any representation of a partial result.

    ``swap(part, peer)`` exchanges with a peer and returns theirs; ``send(part, peer)`` and
    ``recv(peer)`` move one way (the fold of extra ranks); ``merge(lower, upper)`` combines two
    groups' partials, lower group first. ``on_stage(i, part)`` sees the partial after stage i.
    """
    rank, n = comm.rank, comm.size
    p = 1 << (n.bit_length() - 1)
    if rank >= p:  # an extra rank: fold in, then wait for the result
        send(part, rank - p)
        return recv(rank - p)
    if rank + p < n:
        part = merge(part, recv(rank + p))
    for i in range(p.bit_length() - 1):
        peer = rank ^ (1 << i)
        theirs = swap(part, peer)
        part = merge(part, theirs) if rank < peer else merge(theirs, part)
        if on_stage is not None:
            on_stage(i, part)
    if rank + p < n:
        send(part, rank + p)
    return part


@dataclass
class Partial:
    """A partial sum: sorted distinct ``indices`` with ``values``, or ``dense`` (then indices is None)."""

    indices: torch.Tensor | None
    values: torch.Tensor

    @property
    def is_dense(self) -> bool:
        return self.indices is None


class SparseDoubling:
    """Sum COO vectors of length ``numel`` by recursive doubling; ``dense_threshold=None`` never switches.

    ``timed(phase)``, a context manager such as ``GradSync.timed``, splits the time into "comm"
    (swaps) and "decode" (merges).
    """

    def __init__(self, comm: Communicator, numel: int, dtype: torch.dtype, dense_threshold: float | None,
                 timed: Callable[[str], contextlib.AbstractContextManager] | None = None):
        self.comm, self.numel, self.dtype = comm, numel, dtype
        self.dense_threshold = dense_threshold
        self.timed = timed or (lambda phase: contextlib.nullcontext())

    def run(self, indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The global sum as flat COO (indices ascending); zeros that cancel are dropped."""
        order = torch.argsort(indices)  # distinct already (one gradient's non-zeros)
        part = self._maybe_dense(Partial(indices[order], values[order]))
        total = doubling(self.comm, part, self._swap, self._send, self._recv, self._merge)
        if total.is_dense:
            nonzero = torch.nonzero(total.values).reshape(-1)  # NaN counts as non-zero
            return nonzero, total.values[nonzero]
        return total.indices, total.values

    # -- the wire format: a header (non-zero count, -1 for dense), then pairs or the dense vector --
    def _header(self, part: Partial) -> torch.Tensor:
        return torch.tensor([-1 if part.is_dense else part.indices.numel()], dtype=torch.int64)

    def _payload(self, part: Partial) -> torch.Tensor:
        return part.values if part.is_dense else pack_pairs(part.indices, part.values)

    def _buffer(self, count: int) -> torch.Tensor:
        if count < 0:
            return torch.empty(self.numel, dtype=self.dtype)
        return torch.empty((count, INDEX_BYTES + self.dtype.itemsize), dtype=torch.uint8)

    def _decode(self, count: int, payload: torch.Tensor) -> Partial:
        if count < 0:
            return Partial(None, payload)
        return Partial(*unpack_pairs(payload, self.dtype))

    def _swap(self, part: Partial, peer: int) -> Partial:
        with self.timed("comm"):
            count = torch.empty(1, dtype=torch.int64)
            self.comm.sendrecv(self._header(part), count, peer).wait()
            payload = self.comm.sendrecv(self._payload(part), self._buffer(int(count)), peer).wait()
        return self._decode(int(count), payload)

    def _send(self, part: Partial, peer: int) -> None:
        with self.timed("comm"):
            self.comm.send(self._header(part), peer).wait()
            self.comm.send(self._payload(part), peer).wait()

    def _recv(self, peer: int) -> Partial:
        with self.timed("comm"):
            count = int(self.comm.recv(torch.empty(1, dtype=torch.int64), peer).wait())
            payload = self.comm.recv(self._buffer(count), peer).wait()
        return self._decode(count, payload)

    # -- merging ---------------------------------------------------------------------------------
    def _merge(self, lower: Partial, upper: Partial) -> Partial:
        with self.timed("decode"):
            return self._merged(lower, upper)

    def _merged(self, lower: Partial, upper: Partial) -> Partial:
        if lower.is_dense or upper.is_dense:
            total = self._densify(lower)
            if upper.is_dense:
                total += upper.values
            else:
                total.index_add_(0, upper.indices, upper.values)
            return Partial(None, total)
        indices, slot = torch.unique(torch.cat([lower.indices, upper.indices]), return_inverse=True)
        summed = torch.zeros(indices.numel(), dtype=self.dtype)
        summed.index_add_(0, slot, torch.cat([lower.values, upper.values]))  # lower group's first
        keep = summed != 0  # NaN != 0: NaN is kept
        return self._maybe_dense(Partial(indices[keep], summed[keep]))

    def _densify(self, part: Partial) -> torch.Tensor:
        if part.is_dense:
            return part.values.clone()
        dense = torch.zeros(self.numel, dtype=self.dtype)
        dense[part.indices] = part.values
        return dense

    def _maybe_dense(self, part: Partial) -> Partial:
        if (self.dense_threshold is not None and not part.is_dense
                and part.indices.numel() > self.dense_threshold * self.numel):
            return Partial(None, self._densify(part))
        return part


def union_counts(comm: Communicator, bitmaps: torch.Tensor, lengths: list[int]) -> list[list[int]]:
    """Profile densification: OR packed non-zero bitmaps up the doubling stages.

    ``bitmaps``: this rank's packed masks of several tensors, concatenated (``lengths`` bytes each).
    Returns, per stage i, the set-bit count per tensor of the union over this rank's aligned group
    of 2^(i+1) ranks (the non-zeros HC's stage i+1 sends). ``comm.size`` must be a power of two.
    """
    if comm.size & (comm.size - 1):
        raise ValueError(f"union_counts needs a power-of-two group, got {comm.size} ranks")
    counts: list[list[int]] = []

    def swap(part: torch.Tensor, peer: int) -> torch.Tensor:
        return comm.sendrecv(part, torch.empty_like(part), peer).wait()

    def count(_: int, part: torch.Tensor) -> None:
        counts.append([int(c.sum()) for c in torch.split(_POPCOUNT[part.to(torch.int64)], lengths)])

    doubling(comm, bitmaps, swap, None, None, torch.bitwise_or, on_stage=count)
    return counts


_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int64)  # set bits per byte
