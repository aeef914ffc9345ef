"""Zipf-distributed ids: the skewed access pattern that makes embedding gradients sparse and hot-spotted."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def zipf_probabilities(n: int, exponent: float) -> Tensor:
    """p_i proportional to 1 / (i + 1)^exponent over ids 0..n-1; id 0 is the hottest.

    Normalised in float64 so the long tail of a large vocabulary does not lose mass to rounding.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not exponent >= 0.0:
        raise ValueError(f"exponent must be >= 0, got {exponent}")
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    weights = ranks.pow(-exponent)
    return (weights / weights.sum()).to(torch.float32)


def sample_zipf(
    n: int,
    exponent: float,
    shape: tuple[int, ...] | torch.Size,
    generator: torch.Generator,
    shuffle_ids: bool = False,
) -> Tensor:
    """Draw Zipf ids of the given shape from ``generator`` only (never the global RNG).

    ``shuffle_ids`` scatters the hot ids over the id space with a fixed permutation drawn from the
    same generator. It defaults to False because skew studies want the hot ids at the front.
    """
    permutation = torch.randperm(n, generator=generator) if shuffle_ids else None
    count = math.prod(shape)
    ids = torch.multinomial(zipf_probabilities(n, exponent), count, replacement=True, generator=generator)
    if permutation is not None:
        ids = permutation[ids]
    return ids.reshape(shape)


def markov_zipf_sequences(
    num: int,
    length: int,
    vocab_size: int,
    exponent: float,
    generator: torch.Generator,
) -> Tensor:
    """Token sequences a language model can learn: ``num`` rows of ``length`` ids.

    Each next token is ``successor[previous]`` with probability 1/2 (a fixed random permutation, so
    the mapping is learnable) and otherwise a fresh Zipf draw (so unigram statistics stay skewed).
    """
    successor = torch.randperm(vocab_size, generator=generator)
    sequences = torch.empty(num, length, dtype=torch.long)
    sequences[:, 0] = sample_zipf(vocab_size, exponent, (num,), generator)
    for position in range(1, length):
        fresh = sample_zipf(vocab_size, exponent, (num,), generator)
        follow = torch.rand(num, generator=generator) < 0.5
        sequences[:, position] = torch.where(follow, successor[sequences[:, position - 1]], fresh)
    return sequences
