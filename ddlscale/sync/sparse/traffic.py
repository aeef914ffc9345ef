"""What a sparse scheme moves for one tensor, in the terms both of its pricings share.

Each scheme has one cost object beside its sync (``AGSparseCost`` in :mod:`.agsparse`, ``ZenCost`` in
:mod:`.zen`, ...) with two ways to price the same wire format:

- :meth:`traffic` from a tensor's profiled figures (:class:`Sparsity`: the mean over workers, closed
  forms): bytes per worker and message steps in sequence (:class:`Traffic`). Routing prices every
  profiled tensor this way, on one network (:meth:`Traffic.seconds`), against dense allreduce.
- ``projected_seconds`` from every worker's real index set: what each worker sends to whom, priced
  by :class:`~ddlscale.comm.network.NetworkModel` with the busiest NIC deciding
  (``experiments.zen_projection``, for clusters this host cannot hold).

A change to a scheme's wire format is made in its cost object once; the tests check both pricings
against the bytes the syncs really move.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse.pushpull import INDEX_BYTES, rows_bytes

SLACK = 1e-9  # profiled figures are running means: an ulp past their bound is still within it


@dataclass(frozen=True)
class Sparsity:
    """What routing reads about one tensor among ``n`` participants: its units, their density d,
    gamma_n, gamma_{2^i} for i = 0..log2 n where profiled (power-of-two n), values per unit and
    bytes per unit."""

    units: int
    density: float
    gamma: float
    gammas: list[float] | None
    n: int
    width: int
    unit_bytes: int

    def __post_init__(self) -> None:
        if self.units < 0 or not 0.0 <= self.density <= 1 + SLACK:
            raise ValueError(f"need units >= 0 and 0 <= density <= 1, got units={self.units!r}, "
                             f"density={self.density!r}")
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n (participants) must be an integer >= 1, got {self.n!r}")
        if self.gamma > self.n * (1 + SLACK):
            raise ValueError(f"gamma_{self.n} (the sum's density / d) is at most {self.n}, got {self.gamma!r}")
        if self.gammas is None:
            return
        stages = self.n.bit_length() - 1
        if 1 << stages != self.n:
            raise ValueError(f"gammas (gamma_1, gamma_2, ...) are profiled for a power-of-two n, got n={self.n}")
        if len(self.gammas) not in (stages, stages + 1):
            raise ValueError(f"gammas must hold gamma_1, gamma_2, ..., gamma_{self.n // 2} ({stages} values, "
                             f"optionally gamma_{self.n} after them), got {len(self.gammas)}")
        for i, gamma in enumerate(self.gammas):
            if not 1 - SLACK <= gamma <= (1 << i) * (1 + SLACK):
                raise ValueError(f"gamma_{1 << i} must lie in [1, {1 << i}], got {gamma!r}")

    @property
    def pair_bytes(self) -> int:
        """An (int32 index, row) pair on the wire."""
        return INDEX_BYTES + self.unit_bytes


@dataclass(frozen=True)
class Traffic:
    """One tensor's sync on one worker: the bytes it moves, the message steps it takes one after
    another, the collectives it issues on the busiest rank (``rounds``: what the run's ledger counts,
    each a meeting of the ranks whatever its bytes), and seconds of work beside the wire (Zen's HC:
    its merges)."""

    nbytes: float
    messages: int
    rounds: int
    work_s: float = 0.0

    def seconds(self, network: NetworkModel) -> float:
        """alpha per message step plus the bytes at the bandwidth: one price list for every scheme."""
        return self.nbytes * 8 / network.bandwidth_bps + self.messages * network.latency_s + self.work_s


@dataclass(frozen=True)
class Exchanges:
    """How many message steps one :meth:`Communicator.exchange` with n-1 peers takes: one message
    each, and a second where a message outgrows the first segment (or where sizes must go first, on
    NCCL: ``first_piece`` None)."""

    first_piece: float | None

    def steps(self, n: int, message_bytes: float) -> int:
        longer = self.first_piece is None or rows_bytes(0, 0) + message_bytes > self.first_piece
        return (n - 1) * (2 if longer else 1)


ONE_SEGMENT = Exchanges(math.inf)  # every message in one piece: the formulas' textbook form


PUSH_PULL_ROUNDS = 2  # a push and a pull: one exchange each


def doubling_rounds(n: int) -> int:
    """Collectives of recursive doubling on its busiest rank: a swap per stage over the largest power
    of two, and, where ranks are left over, receiving one's set before and sending the sum after."""
    core = 1 << (n.bit_length() - 1)
    return core.bit_length() - 1 + (2 if core < n else 0)


def push_pull_steps(s: Sparsity, exchanges: Exchanges) -> int:
    """A push and a pull, each one exchange with every peer of about 1/n of a worker's pairs."""
    per_peer = s.density * s.units / s.n * s.pair_bytes
    return 2 * exchanges.steps(s.n, per_peer)


def coo_bytes(s: Sparsity) -> float:
    """Push and pull as (index, row) pairs through a balanced partition:
    (4 + u) d M (1 + gamma_n)(n-1)/n bytes per worker (SYSTEMS.md's 8 d M (1 + gamma_n)(n-1)/n in fp32)."""
    return (INDEX_BYTES + s.unit_bytes) * s.density * s.units * (1 + s.gamma) * (s.n - 1) / s.n


# -- pricing real index sets (the projection) ---------------------------------------------------------
def partitioned_seconds(model: NetworkModel, sets: Sequence[torch.Tensor], owner: Callable, n: int,
                        item_bytes: float, pull_bytes: Callable[[int, torch.Tensor], float]) -> float:
    """All-to-all push of each worker's items to their owners, then a direct allgather of the sums.

    ``owner`` maps items to servers; ``pull_bytes(server, its union)`` is what that server sends.
    """
    push = [(torch.bincount(owner(items), minlength=n).double() * item_bytes).tolist() for items in sets]
    union = torch.unique(torch.cat(list(sets)))
    servers = owner(union)
    pieces = [pull_bytes(s, union[servers == s]) for s in range(n)]
    return model.all_to_all(push) + model.allgather(pieces, n, algorithm="direct")


def doubling_seconds(model: NetworkModel, sets: Sequence[torch.Tensor], numel: int, unit_bytes: int,
                     dense_threshold: float | None) -> float:
    """Recursive doubling with merging: stage s sends each aligned group-of-2^s union (busiest decides),
    as pairs, or dense past ``dense_threshold`` (None: never)."""
    n = len(sets)
    seconds, groups = 0.0, list(sets)
    while len(groups) > 1:
        sizes = [g.numel() for g in groups]
        nbytes = [numel * unit_bytes if dense_threshold is not None and s > dense_threshold * numel
                  else s * (INDEX_BYTES + unit_bytes) for s in sizes]
        seconds += model.send(max(nbytes))
        groups = [torch.unique(torch.cat(groups[i:i + 2])) for i in range(0, len(groups), 2)]
    return seconds if n > 1 else 0.0
