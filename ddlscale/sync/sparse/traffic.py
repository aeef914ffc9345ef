"""What a sparse scheme moves for one tensor, in the terms both of its pricings share.

Each scheme has one cost object beside its sync (``AGSparseCost`` in :mod:`.agsparse`, ``ZenCost`` in
:mod:`.zen`, ...) with two ways to price the same wire format:

- :meth:`traffic` from a tensor's profiled figures (:class:`Sparsity`: the mean over workers, closed
  forms): bytes per worker and rounds in sequence, by kind (:class:`Traffic`). Routing prices every
  profiled tensor this way, on one price list (:class:`RoundCosts`: each kind of round as measured
  on the sync group, and the bandwidth), against dense allreduce, and chooses robustly to the
  noise of those measurements (:func:`decide`).
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
from typing import Any

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
class RoundCosts:
    """What one round of each kind costs on the sync group, and the bandwidth bytes move at: the one
    price list every sparse sync routes on.

    A round is a meeting of the ranks: whatever its few bytes, it costs the wake-ups of its slowest
    message. Its kinds: an n-way exchange (a push, a pull, an all-to-all: a message to every peer at
    once), a pairwise swap (a doubling stage, a fold), a small allreduce (what a dense bucket pays
    beside its bytes) and a small ring allgather (gloo's sparse allreduce runs three). Measured on
    the group (``network_latency: measured``, :func:`ddlscale.comm.probe.probe_latency`), each is
    priced as it really runs: an exchange is not n-1 swaps. From a configured alpha they are the
    textbook's message steps (:meth:`textbook`).
    """

    bandwidth_bps: float
    exchange_s: float
    swap_s: float
    allreduce_s: float
    allgather_s: float

    @classmethod
    def textbook(cls, network: NetworkModel, n: int) -> RoundCosts:
        """alpha per message step: an exchange with n-1 peers or a ring allgather n-1 steps, a swap one,
        a ring allreduce 2(n-1)."""
        alpha = network.latency_s
        return cls(network.bandwidth_bps, (n - 1) * alpha, alpha, 2 * (n - 1) * alpha, (n - 1) * alpha)

    def wire_seconds(self, nbytes: float) -> float:
        return nbytes * 8 / self.bandwidth_bps


@dataclass(frozen=True)
class Traffic:
    """One tensor's sync on one worker: the bytes it moves, the rounds it takes one after another by
    kind (``exchanges``, ``swaps``, ``allgathers``: a message longer than an exchange's first piece
    counts twice), the collectives it issues on the busiest rank (``rounds``: what the run's ledger
    counts), and seconds of work beside the wire (Zen's HC: its merges)."""

    nbytes: float
    rounds: int
    exchanges: int = 0
    swaps: int = 0
    allgathers: int = 0
    work_s: float = 0.0

    def seconds(self, costs: RoundCosts) -> float:
        """Its rounds at their measured prices plus its bytes and work: one price list for every scheme."""
        return self.bytes_seconds(costs) + self.rounds_seconds(costs)

    def bytes_seconds(self, costs: RoundCosts) -> float:
        """Its bytes at the bandwidth and its work: what it adds to rounds another tensor pays for."""
        return costs.wire_seconds(self.nbytes) + self.work_s

    def rounds_seconds(self, costs: RoundCosts) -> float:
        return self.exchanges * costs.exchange_s + self.swaps * costs.swap_s + self.allgathers * costs.allgather_s


@dataclass(frozen=True)
class Exchanges:
    """How many rounds one message takes in a :meth:`Communicator.exchange`: one, and a second where
    it outgrows the first piece the receiver posts (or where sizes must go first, on NCCL:
    ``first_piece`` None)."""

    first_piece: float | None

    def rounds(self, message_bytes: float) -> int:
        longer = self.first_piece is None or rows_bytes(0, 0) + message_bytes > self.first_piece
        return 2 if longer else 1


ONE_SEGMENT = Exchanges(math.inf)  # every message in one piece: the formulas' textbook form


PUSH_PULL_ROUNDS = 2  # a push and a pull: one exchange each


def doubling_rounds(n: int) -> int:
    """Collectives of recursive doubling on its busiest rank: a swap per stage over the largest power
    of two, and, where ranks are left over, receiving one's set before and sending the sum after."""
    core = 1 << (n.bit_length() - 1)
    return core.bit_length() - 1 + (2 if core < n else 0)


def push_pull_exchanges(s: Sparsity, exchanges: Exchanges) -> int:
    """A push and a pull, each one exchange with every peer of about 1/n of a worker's pairs."""
    return 2 * exchanges.rounds(s.density * s.units / s.n * s.pair_bytes)


@dataclass(frozen=True)
class Option:
    """One way to route: the bytes through a worker's NIC (from the profile alone: the same in every
    run of a job) and the cost model's seconds (on the rounds this run measured)."""

    nbytes: float
    seconds: float


def decide(options: dict[str, Option], margin: float, incumbent: str | None = None) -> dict[str, Any]:
    """The route among ``options``, robust to the noise of measured rounds.

    Bytes come from the profile, the same in every repetition of a job; seconds from rounds timed at
    start-up, which move between repetitions. So seconds only say which options are in the running:
    those within ``margin`` of the fastest (a faster one must beat them by more than the margin).
    Among those the route is the incumbent (a re-profile keeps what is in force) or else the one with
    the fewest bytes, the first in ``options``' order on a tie. An argmin of seconds would pick
    between near-equal options by the noise of the day; this picks by bytes, and moves only where a
    measurement moves an option across the margin. Returns the decision as recorded (summary.json's
    ``route_decisions``): chosen, the fewest-bytes option (``default``), margin and every option."""
    names = list(options)
    fastest = min(option.seconds for option in options.values())
    running = [k for k in names if options[k].seconds <= (1 + margin) * fastest]
    default = min(names, key=lambda k: (options[k].nbytes, names.index(k)))
    chosen = incumbent if incumbent in running else min(running, key=lambda k: (options[k].nbytes, names.index(k)))
    return {"chosen": chosen, "default": default, "margin": margin,
            "options": {k: {"bytes": o.nbytes, "seconds": o.seconds} for k, o in options.items()}}


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
