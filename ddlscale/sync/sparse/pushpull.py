"""Parallel sparse aggregation: push each index to its owner, sum there, pull the sums back.

Push: worker w sends server s the (index, value) pairs it owns (all-to-all, uneven sizes); server s
adds what arrives into a compact buffer over its owned set (incremental aggregation: the server's
bytes out are its *summed* non-zeros, not n copies). Pull: every server's sums go to every worker
(allgather), either as COO (index + value, 2 words per non-zero) or as a hash bitmap (one bit per
owned index, then the values in owned order) — the bitmap wins once the summed density exceeds
about 1/32 (SYSTEMS.md).
"""

from __future__ import annotations

import torch

from ddlscale.comm import Communicator
from ddlscale.sync.sparse import native
from ddlscale.sync.sparse.partition import split_by_server

# Indices travel as int32, half of int64's bytes; SparseSync keeps each fused group's index space in range.
INDEX_DTYPE = torch.int32
INDEX_BYTES = INDEX_DTYPE.itemsize


def pack_pairs(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(index, value) pairs as rows of bytes — int32 index then the value — so one message carries both."""
    width = INDEX_BYTES + values.element_size()
    rows = torch.empty((indices.numel(), width), dtype=torch.uint8)
    rows[:, :INDEX_BYTES] = indices.to(INDEX_DTYPE).view(torch.uint8).view(-1, INDEX_BYTES)
    rows[:, INDEX_BYTES:] = values.contiguous().view(torch.uint8).view(-1, values.element_size())
    return rows


def unpack_pairs(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Fresh column blocks: .contiguous() may keep a one-row slice's odd stride, which view() rejects.
    count, width = rows.shape
    index_bytes = torch.empty((count, INDEX_BYTES), dtype=torch.uint8).copy_(rows[:, :INDEX_BYTES])
    value_bytes = torch.empty((count, width - INDEX_BYTES), dtype=torch.uint8).copy_(rows[:, INDEX_BYTES:])
    return index_bytes.view(INDEX_DTYPE).reshape(-1).to(torch.int64), value_bytes.view(dtype).reshape(-1)


def push(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, servers: torch.Tensor):
    """All-to-all of (index, value) pairs by owning server; returns what this rank received."""
    n = comm.size
    indices, values, counts = split_by_server(servers, indices, values, n)
    send_counts = torch.tensor(counts, dtype=torch.int64)
    recv_counts = torch.empty(n, dtype=torch.int64)
    comm.all_to_all(recv_counts, send_counts).wait()
    recv_splits = recv_counts.tolist()
    rows = pack_pairs(indices, values)
    received = rows.new_empty((sum(recv_splits), rows.shape[1]))
    comm.all_to_all(received, rows, recv_splits, counts).wait()
    return unpack_pairs(received, values.dtype)


def aggregate(recv_idx: torch.Tensor, recv_val: torch.Tensor, owned: torch.Tensor, position: torch.Tensor):
    """Sum received pairs over this server's owned set; return the owned mask of non-zero sums.

    Pairs are added in arrival order (rank 0's first), the same on every run: deterministic.
    """
    compact = torch.zeros(owned.numel(), dtype=recv_val.dtype)
    compact.index_add_(0, position[recv_idx], recv_val)
    nonzero = (compact != 0) | torch.isnan(compact)
    return compact, nonzero


def pull_coo(comm: Communicator, owned: torch.Tensor, compact: torch.Tensor, nonzero: torch.Tensor):
    """Allgather each server's summed non-zeros as (index, value); returns the global sum's COO."""
    rows = pack_pairs(owned[nonzero], compact[nonzero])
    sizes = comm.allgather_sizes(rows.numel(), rows.device)
    pieces = comm.allgather_uneven(rows, sizes).wait()
    return unpack_pairs(torch.cat(pieces).view(-1, rows.shape[1]), compact.dtype)


def pack_bits_reference(mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask -> uint8 bitmap, 8 entries per byte (little-endian bit order)."""
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits_reference(bitmap: torch.Tensor, length: int) -> torch.Tensor:
    bits = (bitmap[:, None] >> torch.arange(8, dtype=torch.uint8, device=bitmap.device)) & 1
    return bits.reshape(-1)[:length].bool()


# The C++ kernels where measured faster (bit-identical; see native.NATIVE_FROM).
pack_bits = native.pack_bits
unpack_bits = native.unpack_bits


def pull_bitmap(comm: Communicator, owned_sets: list[torch.Tensor], compact: torch.Tensor, nonzero: torch.Tensor):
    """Allgather each server's bitmap over its owned set, then its non-zero values in owned order.

    Every worker knows every owned set (the partition is a fixed function of the index), so the
    bitmaps total M/8 bytes whatever n is and no index travels. Bitmap and values go as one message
    (the bitmap padded to 8 bytes so the values stay aligned): one exchange of sizes, one allgather.
    """
    bitmap_bytes = [_aligned((s.numel() + 7) // 8) for s in owned_sets]
    own_bitmap, values = bitmap_bytes[comm.rank], compact[nonzero].view(torch.uint8)
    packed = pack_bits(nonzero)
    message = torch.zeros(own_bitmap + values.numel(), dtype=torch.uint8)
    message[: packed.numel()] = packed
    message[own_bitmap:] = values
    pieces = comm.allgather_uneven(message).wait()
    indices, values = [], []
    for owned, skip, piece in zip(owned_sets, bitmap_bytes, pieces, strict=True):
        indices.append(owned[unpack_bits(piece[:skip], owned.numel())])
        values.append(piece[skip:].view(compact.dtype))
    return torch.cat(indices), torch.cat(values)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 8) * 8
