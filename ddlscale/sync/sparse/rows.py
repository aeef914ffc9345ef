"""Gradients as sparse sets of units: rows of a (rows, width) view, each named by one index.

An embedding's gradient is sparse in whole rows: a token touches a row of D values, and PyTorch hands
it over as a hybrid sparse COO tensor (one index per row, values (nnz, D)). The sparse syncs send one
index per row and hash, partition and merge rows, so index bytes and per-index work shrink D-fold
against single elements. Width 1 is the element view, right where zeros are scattered one by one.

A gradient of a parameter shaped (R, ...) becomes (indices, values): int64 ids of the units that are
not all zero (NaN counts as non-zero, so it propagates) and their values, (k, width). A sparse COO
gradient is read in O(its non-zeros): its stored slices are its units when their width matches; a
dense gradient costs one pass over it, as it was already dense. Back from the sum, a gradient that
came in sparse goes out sparse (coalesced), never through a dense table; a dense one goes out dense.
"""

from __future__ import annotations

import math

import torch


def slice_width(shape: torch.Size | tuple[int, ...], sparse_dim: int) -> int:
    """Values in one slice over the first ``sparse_dim`` dims: a row of an (R, D) table is D."""
    return math.prod(shape[sparse_dim:])


def row_width(shape: torch.Size | tuple[int, ...]) -> int:
    """Values in one row (a slice over dim 0); 1 for vectors and scalars."""
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


def units_of(grad: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values (k, width)) of the units of ``grad`` that hold a non-zero, ids ascending."""
    if grad.is_sparse:
        grad = grad.coalesce()
        sparse_dim = grad.sparse_dim()
        stored = slice_width(grad.shape, sparse_dim)
        if stored % width == 0:  # each stored slice is a whole number of units
            slices = _ravel(grad.indices(), grad.shape[:sparse_dim])
            per_slice = stored // width
            values = grad.values().reshape(-1, width)
            if per_slice == 1:
                return slices, values
            ids = (slices[:, None] * per_slice + torch.arange(per_slice, device=slices.device)).reshape(-1)
            return ids, values
        grad = grad.to_dense()  # units wider than a stored slice: no layout without a dense pass
    view = grad.reshape(-1, width)
    ids = (view != 0).any(dim=1).nonzero().reshape(-1)  # NaN != 0
    return ids, view[ids]


def _ravel(coords: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Row-major flat ids of sparse coordinates (every sparse dim, so slices of different rows differ)."""
    flat = torch.zeros(coords.shape[1], dtype=torch.int64, device=coords.device)
    for dim, size in enumerate(shape):
        flat = flat * size + coords[dim]
    return flat


def grad_of(ids: torch.Tensor, values: torch.Tensor, like: torch.Tensor, sparse_dim: int | None,
            ids_sorted: bool = False) -> torch.Tensor:
    """The gradient of ``like`` holding ``values`` at the distinct unit ``ids``: dense when
    ``sparse_dim`` is None, else a coalesced sparse COO tensor with ``sparse_dim`` sparse dims."""
    width = values.shape[1] if values.dim() == 2 else 1
    if sparse_dim is None:
        out = torch.zeros((like.numel() // width, width), dtype=values.dtype, device=values.device)
        out[ids] = values.reshape(-1, width)
        return out.view(like.shape)
    stored = slice_width(like.shape, sparse_dim)
    if width != stored:  # units are not the slices: go through the slices' layout
        dense = grad_of(ids, values, like, None)
        keep = (dense.reshape(*like.shape[:sparse_dim], -1) != 0).any(dim=-1)
        coords = keep.nonzero().T
        return torch.sparse_coo_tensor(coords, dense[tuple(coords)], like.shape, is_coalesced=True,
                                       check_invariants=False)
    if not ids_sorted:
        ids, order = torch.sort(ids)
        values = values[order]
    coords = torch.stack(torch.unravel_index(ids, like.shape[:sparse_dim])) if ids.numel() else \
        torch.empty((sparse_dim, 0), dtype=torch.int64, device=ids.device)
    return torch.sparse_coo_tensor(coords, values.reshape(-1, *like.shape[sparse_dim:]), like.shape,
                                   is_coalesced=True, check_invariants=False)
