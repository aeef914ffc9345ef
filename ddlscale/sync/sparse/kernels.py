"""The data kernels of the sparse syncs, each in one place: its pure-PyTorch definition (``*_reference``)
beside the dispatch that runs the native C++/CUDA kernel (``ddlscale/csrc/``) where :mod:`.native` allows.

Every op works on *units*: rows of a (rows, width) view of a gradient, or single elements (width
1). Indices are int64 row ids, values are (k, width). The native kernels return the reference's
result bit for bit (tests/sync/sparse/test_native_kernels.py); values are moved as raw bytes or summed in the
reference's order, so every dtype, NaN payloads included, comes out the same.

Consumers (hashing, partition, pushpull, recursive) import this module only; it imports only
:mod:`.native`, so data flows one way and the package has no import circle.
"""

from __future__ import annotations

import torch

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


# -- h0: which server owns an index ------------------------------------------------------------------
def server_of_reference(indices: torch.Tensor, seed: int, num_servers: int) -> torch.Tensor:
    """h0: (fmix64(index ^ seed) & (2^63 - 1)) % num_servers, int64 in, int64 out."""
    hashed = fmix64(indices.to(torch.int64) ^ seed)
    return (hashed & _MASK63) % num_servers


def server_of(indices: torch.Tensor, seed: int, num_servers: int) -> torch.Tensor:
    ops = native.ops_for("server_of", indices) if num_servers >= 1 and not indices.is_floating_point() else None
    if ops is not None:
        return ops.server_of(indices.to(torch.int64), int(seed), num_servers)
    return server_of_reference(indices, seed, num_servers)


# -- grouping (index, row) pairs by server ------------------------------------------------------------
def split_by_server_reference(server: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                              num_servers: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(indices, values) with each server's pairs contiguous, in input order; the count per server."""
    order = torch.argsort(server, stable=True)
    counts = torch.bincount(server, minlength=num_servers).tolist()
    return indices[order], values[order], counts


def _groupable(*tensors: torch.Tensor) -> bool:
    *ids, values = tensors
    return all(t.dtype == torch.int64 and t.dim() == 1 for t in ids) and values.dim() >= 1


def split_by_server(server: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, num_servers: int):
    ops = native.ops_for("split_by_server", server, indices, values) if _groupable(server, indices, values) else None
    if ops is not None:
        idx, val, counts = ops.group_by_server(server, indices, values, num_servers)
        return idx, val, counts.tolist()
    return split_by_server_reference(server, indices, values, num_servers)


def partition_reference(indices: torch.Tensor, values: torch.Tensor, seed: int, num_servers: int):
    """Hash then split: what the native ``partition`` fuses into one pass."""
    return split_by_server_reference(server_of_reference(indices, seed, num_servers), indices, values, num_servers)


def partition(indices: torch.Tensor, values: torch.Tensor, seed: int, num_servers: int):
    ops = None
    if _groupable(indices, values) and num_servers >= 1:
        ops = native.ops_for("partition", indices, values)
    if ops is not None:
        idx, val, counts = ops.partition(indices, values, int(seed), num_servers)
        return idx, val, counts.tolist()
    return partition_reference(indices, values, seed, num_servers)


# -- the hash bitmap's owned sets -------------------------------------------------------------------
def owned_sets_reference(numel: int, seed: int, num_servers: int) -> tuple[torch.Tensor, list[int]]:
    """Every server's owned indices among 0..numel-1, sorted and concatenated (int32 where they fit:
    4 bytes per index is all the bitmap pull keeps), and the count per server."""
    owner = server_of_reference(torch.arange(numel, dtype=torch.int64), seed, num_servers)
    order = torch.argsort(owner, stable=True)  # stable: each set comes out sorted
    counts = torch.bincount(owner, minlength=num_servers).tolist()
    return order.to(torch.int32 if numel <= 1 << 31 else torch.int64), counts


def owned_sets(numel: int, seed: int, num_servers: int) -> tuple[torch.Tensor, list[int]]:
    ops = native.ops_for("owned_sets", device="cpu", numel=numel) if numel >= 0 and num_servers >= 1 else None
    if ops is not None:
        owned, counts = ops.owned_sets(numel, int(seed), num_servers)
        return owned, counts.tolist()
    return owned_sets_reference(numel, seed, num_servers)


# -- bitmaps ----------------------------------------------------------------------------------------
def pack_bits_reference(mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask -> uint8 bitmap, 8 entries per byte (little-endian bit order)."""
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    ops = native.ops_for("pack_bits", mask) if mask.dtype == torch.bool and mask.dim() == 1 else None
    if ops is not None:
        return ops.pack_bits(mask)
    return pack_bits_reference(mask)


def unpack_bits_reference(bitmap: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` bits of a bitmap as a bool tensor."""
    bits = (bitmap[:, None] >> torch.arange(8, dtype=torch.uint8, device=bitmap.device)) & 1
    return bits.reshape(-1)[:length].bool()


def unpack_bits(bitmap: torch.Tensor, length: int) -> torch.Tensor:
    ok = bitmap.dtype == torch.uint8 and bitmap.dim() == 1 and length >= 0
    ops = native.ops_for("unpack_bits", bitmap) if ok else None
    if ops is not None:
        return ops.unpack_bits(bitmap, length)
    return unpack_bits_reference(bitmap, length)


# -- summing row sets -------------------------------------------------------------------------------
def merge_rows_reference(lower_idx: torch.Tensor, lower_val: torch.Tensor, upper_idx: torch.Tensor,
                         upper_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of two row sets with sorted, distinct indices: their union, sorted; a row in both is
    lower + upper (in that order), a row in one is copied unchanged."""
    indices = torch.cat([lower_idx, upper_idx]).unique(sorted=True)
    values = lower_val.new_empty((indices.numel(), lower_val.shape[1]))
    at_lower, at_upper = torch.searchsorted(indices, lower_idx), torch.searchsorted(indices, upper_idx)
    in_lower = torch.zeros(indices.numel(), dtype=torch.bool, device=indices.device)
    in_lower[at_lower] = True
    both = in_lower[at_upper]
    values[at_upper[~both]] = upper_val[~both]
    values[at_lower] = lower_val
    values[at_upper[both]] = values[at_upper[both]] + upper_val[both]
    return indices, values


def merge_rows(lower_idx: torch.Tensor, lower_val: torch.Tensor, upper_idx: torch.Tensor,
               upper_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ops = None
    if lower_val.dim() == 2 and upper_val.dim() == 2 and lower_idx.dtype == upper_idx.dtype == torch.int64:
        ops = native.ops_for("merge_rows", lower_idx, lower_val, upper_idx, upper_val)
    if ops is not None:
        return ops.merge_rows(lower_idx, lower_val, upper_idx, upper_val)
    return merge_rows_reference(lower_idx, lower_val, upper_idx, upper_val)


def sum_rows(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that may repeat -> sorted distinct indices and each one's rows summed in input order
    (so the sum is the same on every run). Sort-based: O(k log k) in the rows given, never in the
    table's size."""
    unique, slot = torch.unique(indices, sorted=True, return_inverse=True)
    summed = values.new_zeros((unique.numel(), *values.shape[1:]))
    summed.index_add_(0, slot, values)
    return unique, summed
