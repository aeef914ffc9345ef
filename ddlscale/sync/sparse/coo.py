"""Flat COO views of gradients: (indices, values) of the non-zeros, and back to a dense tensor."""

from __future__ import annotations

import math

import torch


def to_flat_coo(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat int64 indices and values of a gradient's non-zeros.

    Dense layout: the elements that are not zero (NaN counts as non-zero, so it propagates).
    Sparse COO (``nn.Embedding(sparse=True)``): every element of every stored slice (a row there).
    """
    if grad.is_sparse:
        return stored_elements(grad)
    flat = grad.reshape(-1)
    indices = torch.nonzero(flat != 0, as_tuple=False).reshape(-1)  # NaN != 0 is True
    return indices, flat[indices]


def stored_elements(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row-major int64 indices and values of every element of a sparse COO tensor's stored
    slices, zeros included, each index once (the tensor is coalesced first)."""
    grad = grad.coalesce()
    sparse_dim = grad.sparse_dim()
    width = math.prod(grad.shape[sparse_dim:])
    # Ravel every sparse dim: the first alone would make slices of different rows collide.
    slices = torch.zeros(grad._nnz(), dtype=torch.int64, device=grad.device)
    for dim, size in enumerate(grad.shape[:sparse_dim]):
        slices = slices * size + grad.indices()[dim]
    indices = (slices[:, None] * width + torch.arange(width, device=grad.device)).reshape(-1)
    return indices, grad.values().reshape(-1)  # values are (nnz, *dense dims): the same order


def scatter_dense(indices: torch.Tensor, values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A dense tensor shaped like ``like`` holding ``values`` at the (distinct) flat ``indices``."""
    out = torch.zeros(like.numel(), dtype=values.dtype, device=values.device)
    out[indices.to(torch.int64)] = values
    return out.view(like.shape)



def coo_slices(indices: torch.Tensor, values: torch.Tensor, like: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A sparse COO tensor shaped like ``like`` (``sparse_dim`` sparse dims) from distinct flat
    ``indices``: the slices they touch, built in O(non-zeros) rather than through a dense tensor."""
    width = math.prod(like.shape[sparse_dim:])
    indices = indices.to(torch.int64)
    slice_of = indices // width
    # Distinct slices in order through a presence map over all slices: no sort of the indices.
    present = torch.zeros(math.prod(like.shape[:sparse_dim]), dtype=torch.bool, device=indices.device)
    present[slice_of] = True
    slices = present.nonzero().reshape(-1)
    slot_of = torch.empty(present.numel(), dtype=torch.int64, device=indices.device)
    slot_of[slices] = torch.arange(slices.numel(), device=indices.device)
    slot = slot_of[slice_of]
    block = torch.zeros((slices.numel(), width), dtype=values.dtype, device=values.device)
    block[slot, indices % width] = values
    coords = torch.stack(torch.unravel_index(slices, like.shape[:sparse_dim])) if slices.numel() else \
        torch.empty((sparse_dim, 0), dtype=torch.int64)
    return torch.sparse_coo_tensor(coords, block.view(-1, *like.shape[sparse_dim:]), like.shape,
                                   is_coalesced=True, check_invariants=False)
