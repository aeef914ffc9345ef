"""Parallel sparse aggregation: push each unit to its owner, sum there, pull the sums back.

Push: worker w sends server s the units it owns (one exchange, uneven sizes); server s sums what
arrives (incremental aggregation: the server's bytes out are its *summed* units, not n copies).
Pull: every server's sums go to every worker, either as COO (an index and a row per unit) or as a
hash bitmap (one bit per owned unit, then the rows in owned order). An index costs 32 bits and a
bitmap one bit per unit of the tensor, so the bitmap wins once more than 1/32 of the units are in the
sum (SYSTEMS.md), whatever the row width; for wide rows the two differ by little, as the values
dominate both.

Wire format of a set of rows (one message): int64 count k, then k int32 indices (padded to 8 bytes),
then the k rows of values. Indices and values are two contiguous blocks, so packing is two copies
and unpacking two views, whatever the row width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ddlscale.comm import Communicator
from ddlscale.comm.collectives import Message
from ddlscale.sync.sparse import kernels

# Indices travel as int32, half of int64's bytes; SparseSync keeps each fused group's index space in range.
INDEX_DTYPE = torch.int32
INDEX_BYTES = INDEX_DTYPE.itemsize
COUNT_BYTES = 8


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def rows_bytes(count: int, row_bytes: int) -> int:
    """Payload bytes of ``count`` rows of ``row_bytes`` bytes each in the wire format."""
    return COUNT_BYTES + _aligned(count * INDEX_BYTES) + count * row_bytes


def pack_rows(ids: torch.Tensor, values: torch.Tensor) -> Message:
    """One message holding ``ids`` (int64, < 2^31) and their rows ``values`` (k, width)."""
    k = ids.numel()
    row_bytes = values[0].numel() * values.element_size() if k else 0
    message = Message(rows_bytes(k, row_bytes), ids.device)
    payload = message.payload
    payload[:COUNT_BYTES].copy_(torch.tensor([k], dtype=torch.int64).view(torch.uint8))
    start = COUNT_BYTES + _aligned(k * INDEX_BYTES)
    payload[COUNT_BYTES: COUNT_BYTES + k * INDEX_BYTES].view(INDEX_DTYPE).copy_(ids)
    if k:
        payload[start:].view(values.dtype).view(values.shape).copy_(values)
    return message


def unpack_rows(payload: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64, values (k, width)) from a payload of :func:`pack_rows` (the values are a view)."""
    k = int(payload[:COUNT_BYTES].view(torch.int64))
    ids = payload[COUNT_BYTES: COUNT_BYTES + k * INDEX_BYTES].view(INDEX_DTYPE).to(torch.int64)
    start = COUNT_BYTES + _aligned(k * INDEX_BYTES)
    return ids, payload[start: start + k * width * dtype.itemsize].view(dtype).view(k, width)


GroupBy = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, list[int]]]
Timed = Callable[[str], contextlib.AbstractContextManager]


def _untimed(phase: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def push(comm: Communicator, ids: torch.Tensor, values: torch.Tensor, group_by: GroupBy,
         timed: Timed = _untimed) -> list[tuple]:
    """Send every unit to its server; return what this rank received as a server, one (ids, values)
    per source rank in rank order (its own share among them, never sent). ``group_by(ids, values)``
    orders the units by server and counts them; ``timed(phase)`` splits encode, comm and decode."""
    peers = [p for p in range(comm.size) if p != comm.rank]
    with timed("encode"):
        ids, values, counts = group_by(ids, values)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        share = {p: (ids[starts[p]: starts[p + 1]], values[starts[p]: starts[p + 1]]) for p in range(comm.size)}
        messages = {p: pack_rows(*share[p]) for p in peers}
    with timed("comm"):
        received = comm.exchange(messages, peers, op="push")
    width, dtype = values.shape[1], values.dtype
    return [share[p] if p == comm.rank else unpack_rows(received[p], width, dtype) for p in range(comm.size)]


def aggregate(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the pieces a server received (rank 0's first: the same bits on every run); sorted ids.
    Units whose sum is exactly zero are dropped; NaN is kept."""
    ids = torch.cat([p[0] for p in pieces])
    values = torch.cat([p[1] for p in pieces])
    ids, values = kernels.sum_rows(ids, values)
    keep = (values != 0).any(dim=1)  # NaN != 0
    if bool(keep.all()):
        return ids, values
    return ids[keep], values[keep]


def pull_coo(comm: Communicator, ids: torch.Tensor, values: torch.Tensor, timed: Timed = _untimed) -> list[tuple]:
    """Every server's sums to every worker as (index, row) sets; one (ids, values) per server."""
    with timed("encode"):
        message = pack_rows(ids, values)
    peers = [p for p in range(comm.size) if p != comm.rank]
    with timed("comm"):
        received = comm.exchange(dict.fromkeys(peers, message), peers, op="pull")
    width, dtype = values.shape[1], values.dtype
    return [(ids, values) if p == comm.rank else unpack_rows(received[p], width, dtype) for p in range(comm.size)]


def pull_bitmap(comm: Communicator, owned: list[torch.Tensor], ids: torch.Tensor, values: torch.Tensor,
                timed: Timed = _untimed) -> list[tuple]:
    """Every server's sums as a bitmap over its owned set (sorted, known to every worker: the partition
    is a fixed function of the index), then the rows in owned order: no index travels, and the
    bitmaps total one bit per unit of the tensor whatever n is. Decoding a server's piece is one
    pass over its owned set: O(M/n)."""
    with timed("encode"):
        message = pack_bitmap(owned[comm.rank], ids, values)
    peers = [p for p in range(comm.size) if p != comm.rank]
    with timed("comm"):
        received = comm.exchange(dict.fromkeys(peers, message), peers, op="pull")
    width, dtype = values.shape[1], values.dtype
    with timed("decode"):
        return [(ids, values) if p == comm.rank else unpack_bitmap(received[p], members, width, dtype)
                for p, members in enumerate(owned)]


def pack_bitmap(mine: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> Message:
    """One message: a bitmap over ``mine`` (this server's owned ids, sorted) marking the sorted
    ``ids`` present, padded to 8 bytes, then their rows in that order."""
    position = torch.searchsorted(mine, ids.to(mine.dtype))  # ids are sorted: rows stay in owned order
    present = torch.zeros(mine.numel(), dtype=torch.bool, device=ids.device)
    present[position] = True
    bitmap = kernels.pack_bits(present)
    skip = _aligned(bitmap.numel())
    message = Message(skip + values.numel() * values.element_size(), ids.device)
    message.payload[:skip].zero_()  # the padding after the bitmap too
    message.payload[: bitmap.numel()] = bitmap
    message.payload[skip:].view(values.dtype).view(values.shape).copy_(values)
    return message


def unpack_bitmap(piece: torch.Tensor, members: torch.Tensor, width: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64, rows) from a payload of :func:`pack_bitmap` over the sender's owned ``members``."""
    skip = _aligned((members.numel() + 7) // 8)
    hits = kernels.unpack_bits(piece[:skip], members.numel()).nonzero().reshape(-1)
    return members[hits].to(torch.int64), piece[skip:].view(dtype).view(-1, width)
