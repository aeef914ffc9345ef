"""Aggregation schemes as the planners and the executors both see them: which compressors each
carries and what it costs.

A scheme is one class here: its ``name`` (what ``sync.comm`` and a plan say), :meth:`Aggregation.refusal`
(why it cannot carry a compressor, from what the compressor declares) and :meth:`Aggregation.price`
(its encode, communication and decode seconds on a :class:`Pricing`, vectorized over group sizes).
The executing class in :mod:`ddlscale.sync.compressed.schemes` subclasses it and adds the collectives,
so a rule is written once: the planners offer a compressor under a scheme exactly where the executor
carries it. A new scheme is a subclass here (in :data:`AGGREGATIONS`) and its executing subclass there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ddlscale.comm import volume
from ddlscale.comm.network import NetworkModel
from ddlscale.compress import Compressor
from ddlscale.compress.sparse import SparseCompressor

SIZE_BYTES = 8  # one int64: a size exchanged before an uneven collective
INDEX_BYTES = 4  # an int32 index of Zen's pairs
SMALL_BYTES = 64 << 10  # ddlscale.comm.collectives: below this gloo's ring allgather, above direct


@dataclass(frozen=True)
class Pricing:
    """What a scheme is priced from, for a row of units of one dtype under one option (arrays over
    the units): ``numel`` the elements it carries (a hierarchical group's chunk), over ``ranks``
    ranks on ``net``; ``payload(x)`` the packed bytes of a payload of x elements; ``encode(x)`` and
    ``decode(x)`` one compressor call on x elements; ``sized`` 1 where payload sizes vary (sizes are
    exchanged first), else 0; ``contexts``: decoding another rank's payload needs a context made by
    compressing zeros."""

    numel: np.ndarray
    ranks: int
    net: NetworkModel
    payload: Callable[[np.ndarray], np.ndarray]
    encode: Callable[[np.ndarray], np.ndarray]
    decode: Callable[[np.ndarray], np.ndarray]
    sized: float
    contexts: bool
    value_bytes: float = 4.0  # one value as the compressor sends it (Zen's pairs: an int32 index beside it)
    rounds: int = 1  # allreduce: the collectives the payload is split over (PowerSGD: P, then Q)

    def exchange_sizes(self) -> float:
        """The blocking exchange of one size per rank before an uneven collective (on the training
        thread while the group is launched: charged to encode)."""
        return self.sized * _exchange_sizes(self.net, self.ranks)


Price = tuple[np.ndarray | float, np.ndarray | float, np.ndarray | float]  # (encode_s, comm_s, decode_s)


class Aggregation:
    """One aggregation scheme. The flags say what it does to a payload; :meth:`refusal` reads them
    against what a compressor declares."""

    name = "?"
    needs_summable = False  # sums payloads with an allreduce
    divisible = False  # cuts a group into flat partitions (a compressor of matrices cannot follow)
    reencodes = False  # an owner compresses the aggregate again (a vote's tie cannot be sent in 1 bit)
    carries_powersgd = False  # PowerSGD's shared-Q power iteration needs summed factors

    def refusal(self, compressor: Compressor) -> str | None:
        """Why this scheme cannot carry ``compressor``, or None where it can."""
        if self.needs_summable and not (compressor.summable or compressor.reduces_itself):
            return (f"scheme {self.name} sums payloads with an allreduce, but compressor {compressor.name} is "
                    f"not summable; use allgather, alltoall or gather")
        if self.reencodes and compressor.votes:
            return (f"scheme {self.name} re-encodes each aggregate with the compressor, and {compressor.name}'s "
                    f"majority vote (+1, -1, or 0 on a tie) does not fit its 1-bit code; use allgather")
        if self.divisible and compressor.needs_matrices:
            return (f"scheme {self.name} cuts each group into flat partitions, but compressor {compressor.name} "
                    f"compresses whole matrices; use allreduce")
        if not self.carries_powersgd and compressor.reduces_itself:
            return (f"compressor {compressor.name} is Vogels et al.'s algorithm under allreduce only (one shared Q "
                    f"on every rank, a rank-r sum); under {self.name} each rank would run its own power "
                    f"iteration. Use sync.comm=allreduce")
        return None

    def carries(self, compressor: Compressor) -> bool:
        return self.refusal(compressor) is None

    def price(self, p: Pricing) -> Price:
        """(encode_s, comm_s, decode_s) of the groups ``p`` describes."""
        raise NotImplementedError


class Allreduce(Aggregation):
    name = "allreduce"
    needs_summable = True
    carries_powersgd = True

    def price(self, p: Pricing) -> Price:
        """Encode, allreduce the payload (in ``rounds`` collectives of equal shares), decode once."""
        comm = p.rounds * p.net.allreduce(p.payload(p.numel) / p.rounds, p.ranks)
        return p.encode(p.numel), comm, p.decode(p.numel)


class Allgather(Aggregation):
    name = "allgather"

    def price(self, p: Pricing) -> Price:
        """Encode (plus the local decode), sizes, allgather the packed payloads, decode and sum all n."""
        return (p.encode(p.numel) + p.exchange_sizes(), _allgather(p.net, p.payload(p.numel), p.ranks),
                p.ranks * p.decode(p.numel))


class AllToAll(Aggregation):
    name = "alltoall"
    divisible = True
    reencodes = True

    def price(self, p: Pricing) -> Price:
        """Encode the n partitions, all-to-all them (after their sizes); the owner decodes n pieces and
        re-encodes their sum, every rank allgathers the n sums and decodes them. The re-encode and the
        second collective run after backward: charged to decode and comm."""
        part = -(-p.numel // p.ranks)
        payload = p.payload(part)
        comm = (p.net.all_to_all(payload, p.ranks) + p.sized * _exchange_sizes(p.net, p.ranks)
                + _allgather(p.net, payload, p.ranks))
        contexts = p.ranks - 1 if p.contexts else 0
        return (p.ranks * p.encode(part) + p.exchange_sizes(), comm,
                2 * p.ranks * p.decode(part) + (1 + contexts) * p.encode(part))


class GatherBroadcast(Aggregation):
    name = "gather"
    reencodes = True

    def price(self, p: Pricing) -> Price:
        """Encode, gather to rank 0, which decodes n payloads, re-encodes the sum and broadcasts it (its
        size first); everyone decodes. Rank 0's path is the critical one."""
        payload = p.payload(p.numel)
        comm = (p.net.gather(payload, p.ranks) + p.sized * p.net.broadcast(SIZE_BYTES, p.ranks)
                + p.net.broadcast(payload, p.ranks))
        return (p.encode(p.numel) + p.exchange_sizes(), comm,
                p.ranks * p.decode(p.numel) + p.encode(p.numel) + p.decode(p.numel))


class ZenPushPull(Aggregation):
    name = "zen"

    def refusal(self, compressor: Compressor) -> str | None:
        if isinstance(compressor, SparseCompressor):
            return None
        return (f"scheme zen pushes (index, value) pairs, but compressor {compressor.name} is not a sparsifier; "
                f"zen carries topk, randomk, dgc and threshold")

    def price(self, p: Pricing) -> Price:
        """Encode; push each (index, value) to the rank its index hashes to (one exchange of ~1/n of
        the payload per peer); the owner sums, and every rank pulls each owner's share of the union as
        pairs or as a hash bitmap (:func:`~ddlscale.comm.volume.pull_as_bitmap`, as the executor
        decides). Both exchanges run after backward. The union is priced as if the ranks chose
        independently (:func:`~ddlscale.comm.volume.expected_union`), an upper estimate for top-k."""
        payload = p.payload(p.numel)
        pair = p.value_bytes + INDEX_BYTES
        kept = np.maximum(1.0, payload / pair)
        union = np.array([volume.expected_union(int(m), int(k), p.ranks) for m, k in zip(p.numel.tolist(), kept.tolist(),
                                                                                          strict=True)])
        bitmap = np.array([p.sized == 0 and volume.pull_as_bitmap(int(m), int(k), p.ranks) for m, k in
                           zip(p.numel.tolist(), kept.tolist(), strict=True)])
        share = union / p.ranks
        pulled = np.where(bitmap, np.ceil(p.numel / p.ranks / 8) + share * p.value_bytes, share * pair)
        # Two exchanges, batched with the step's other zen groups: their latency is paid once per step
        # (CostModel.fixed_s), not here.
        net = _without_latency(p.net)
        comm = net.all_to_all(payload / p.ranks, p.ranks) + net.all_to_all(pulled, p.ranks)
        return p.encode(p.numel), comm, 2 * p.decode(p.numel)


# Every scheme a plan or sync.comm may name, by name.
AGGREGATIONS: dict[str, Aggregation] = {a.name: a for a in (Allreduce(), Allgather(), AllToAll(), GatherBroadcast(),
                                                            ZenPushPull())}
SCHEMES = tuple(AGGREGATIONS)


def check_scheme(name: str, key: str = "sync.comm") -> str:
    """``name`` if it names a scheme, else a ValueError naming ``key``."""
    if name not in AGGREGATIONS:
        raise ValueError(f"{key} must be one of {', '.join(AGGREGATIONS)}; got {name!r}")
    return name


@functools.lru_cache(maxsize=64)
def _without_latency(net: NetworkModel) -> NetworkModel:
    """``net`` with no per-message latency: the bandwidth part of an exchange whose rounds are paid elsewhere."""
    return replace(net, latency_s=0.0, intra_latency_s=0.0)


@functools.lru_cache(maxsize=4096)
def _exchange_sizes(net: NetworkModel, n: int) -> float:
    """The blocking exchange of one size per rank before an uneven collective."""
    return net.all_to_all(SIZE_BYTES, n)


def _allgather(net: NetworkModel, piece_bytes: np.ndarray, n: int) -> np.ndarray:
    """Communicator's allgather: gloo's ring for small pieces, a direct exchange for large ones.

    The direct exchange of equal pieces is the uniform all-to-all (the same send matrix), priced in
    O(1) rather than through the n x n matrix ``allgather(..., "direct")`` builds.
    """
    ratio = net.efficiency.get("allgather", 1.0) / net.efficiency.get("all_to_all", 1.0)
    return np.where(piece_bytes * n <= SMALL_BYTES, net.allgather(piece_bytes, n, "ring"),
                    net.all_to_all(piece_bytes, n) * ratio)


