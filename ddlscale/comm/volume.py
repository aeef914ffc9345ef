"""Closed-form per-rank wire volume of each collective algorithm.

Every accounted collective in :mod:`ddlscale.comm.collectives` charges exactly these bytes, so a
test can hold a backend's reported traffic against the formula of the scheme it claims to run.
Volumes are payload bytes one rank puts on (``sent``) and takes off (``recv``) the wire; a rank's
own share never travels.
"""

from __future__ import annotations


def even_split(total: int, parts: int) -> list[int]:
    """Split ``total`` items into ``parts`` chunks whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def ring_allreduce(numel: int, elem_size: int, world: int, rank: int) -> tuple[int, int]:
    """Ring allreduce = reduce-scatter + allgather over ``world`` chunks.

    In each phase a rank forwards every chunk but one, so it sends and receives
    ``2 * (numel - own_chunk) * elem_size`` — the textbook ``2 (n-1)/n`` bytes when n divides numel.
    """
    if world == 1:
        return 0, 0
    own = even_split(numel, world)[rank]
    moved = 2 * (numel - own) * elem_size
    return moved, moved


def ring_allgather(piece_bytes: list[int], rank: int) -> tuple[int, int]:
    """Ring allgather of per-rank pieces (possibly padded to equal size by the caller).

    A rank receives every piece but its own and forwards every piece but the one its successor
    started with.
    """
    world = len(piece_bytes)
    if world == 1:
        return 0, 0
    total = sum(piece_bytes)
    return total - piece_bytes[(rank + 1) % world], total - piece_bytes[rank]


def direct_allgather(piece_bytes: list[int], rank: int) -> tuple[int, int]:
    """Allgather by sending one's piece straight to every peer (no padding of uneven pieces)."""
    world = len(piece_bytes)
    return (world - 1) * piece_bytes[rank], sum(piece_bytes) - piece_bytes[rank]


def all_to_all(send_bytes: list[int], recv_bytes: list[int], rank: int) -> tuple[int, int]:
    """Pairwise all-to-all: everything but the block a rank addresses to itself travels."""
    return sum(send_bytes) - send_bytes[rank], sum(recv_bytes) - recv_bytes[rank]


def ring_reduce_scatter(chunk_bytes: int, world: int) -> tuple[int, int]:
    """Ring reduce-scatter of ``world`` chunks of ``chunk_bytes``: n-1 chunks each way."""
    moved = (world - 1) * chunk_bytes
    return moved, moved


def flat_broadcast(nbytes: int, world: int, rank: int, src: int) -> tuple[int, int]:
    """Root sends the whole tensor to every other rank (gloo's and our accounting's model)."""
    if world == 1:
        return 0, 0
    return ((world - 1) * nbytes, 0) if rank == src else (0, nbytes)


def flat_gather(piece_bytes: list[int], rank: int, dst: int) -> tuple[int, int]:
    """Every rank sends its piece straight to the root."""
    if rank == dst:
        return 0, sum(piece_bytes) - piece_bytes[dst]
    return piece_bytes[rank], 0


def expected_union(numel: int, kept: int, n: int) -> float:
    """Elements in the union of ``n`` ranks' selections of ``kept`` of ``numel`` each, if they chose
    independently: numel (1 - (1 - kept/numel)^n). Real gradients' selections overlap more (top-k
    of correlated gradients), so this errs towards a larger union."""
    if numel <= 0:
        return 0.0
    return numel * (1.0 - (1.0 - min(kept, numel) / numel) ** n)


def pull_as_bitmap(numel: int, kept: int, n: int, index_bytes: int = 4) -> bool:
    """Zen's pull format for a tensor of ``numel`` units of which each of ``n`` ranks sends ``kept``:
    a hash bitmap (one bit per unit of the tensor, no indices) beats (index, value) pairs once the
    union holds more than one unit in 8 * ``index_bytes``, whatever the value width."""
    return expected_union(numel, kept, n) * index_bytes * 8 > numel
