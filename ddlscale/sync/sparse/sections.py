"""One push and one pull for every tensor of a step: Zen's exchange over several sections at once.

A step's sparse tensors differ in row width and dtype (an LSTM's 64-wide tables beside its 1-wide
output bias; DeepFM's factors beside its first-order weights), and a pull format suits each. Synced
group by group they pay two rounds each; on a host where a round costs milliseconds that, not the
bytes, decides the step. Here the tensors share one index space, laid out section by section (a
section: a contiguous id range of one width, dtype and pull format), the hash h0 of the global id
picks each unit's server, and every message carries one piece per section: one exchange pushes every
section's units and one pulls every section's sums.

A dense section carries dense tensors index-free (a small MLP beside the embedding tables): its
values laid end to end, server p owns the contiguous slice [pL/n, (p+1)L/n) of its L values, as a
reduce-scatter splits them. The push sends each server its slice, the server adds the n slices in
source-rank order, and the pull sends its sum to every worker: a ring allreduce's bytes
(2 (n-1)/n L values per worker) in the two rounds the sparse sections pay anyway, where a ring takes
2 (n-1) steps of its own.

A message is the sections' pieces in order, each as an int64 byte length and the piece (pushpull's
row set, a hash bitmap and rows, or a dense slice's values), padded to 8 bytes so that every piece's
values are aligned views. The sum of one unit is what the per-tensor exchange computes, bit for bit:
a server adds the pieces in source-rank order in both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddlscale.comm import Communicator
from ddlscale.comm.collectives import Message
from ddlscale.sync.sparse.pushpull import (
    GroupBy,
    Timed,
    _aligned,
    _untimed,
    pack_bitmap,
    pack_rows,
    unpack_bitmap,
    unpack_rows,
)

LENGTH_BYTES = 8

Rows = tuple[torch.Tensor | None, torch.Tensor]  # (ids int64, values (k, width)), or (None, a dense slice)


def dense_bounds(length: int, servers: int) -> list[int]:
    """Where each server's slice of a dense section of ``length`` values starts, and the end."""
    return [p * length // servers for p in range(servers + 1)]


def _dense_piece(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1).view(torch.uint8)


def frame(pieces: Sequence[torch.Tensor], device: torch.device | str) -> Message:
    """One message of byte ``pieces``, each behind its length and padded to 8 bytes."""
    sizes = [p.numel() for p in pieces]
    message = Message(sum(LENGTH_BYTES + _aligned(s) for s in sizes), device)
    payload, at = message.payload, 0
    lengths = torch.tensor(sizes, dtype=torch.int64).view(torch.uint8)
    for k, (piece, size) in enumerate(zip(pieces, sizes, strict=True)):
        payload[at: at + LENGTH_BYTES].copy_(lengths[k * LENGTH_BYTES: (k + 1) * LENGTH_BYTES])
        payload[at + LENGTH_BYTES: at + LENGTH_BYTES + size].copy_(piece)
        payload[at + LENGTH_BYTES + size: at + LENGTH_BYTES + _aligned(size)].zero_()
        at += LENGTH_BYTES + _aligned(size)
    return message


def unframe(payload: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The ``count`` pieces of a :func:`frame` payload (views); an error if the lengths disagree with it."""
    pieces, at = [], 0
    for _ in range(count):
        if at + LENGTH_BYTES > payload.numel():
            raise ValueError(f"a batched message of {payload.numel()} bytes ends before its {count} sections")
        size = int(payload[at: at + LENGTH_BYTES].view(torch.int64))
        if size < 0 or at + LENGTH_BYTES + size > payload.numel():
            raise ValueError(f"a section of {size} bytes overruns a batched message of {payload.numel()} bytes")
        pieces.append(payload[at + LENGTH_BYTES: at + LENGTH_BYTES + size])
        at += LENGTH_BYTES + _aligned(size)
    if at != payload.numel():
        raise ValueError(f"a batched message holds {payload.numel() - at} bytes past its {count} sections")
    return pieces


def push(comm: Communicator, sections: Sequence[Rows], group_by: GroupBy, timed: Timed = _untimed) -> list[list[Rows]]:
    """Every section's units to their servers in one exchange; per section, what this rank received
    as a server, one (ids, values) per source rank in rank order (its own share among them). A dense
    section, ``(None, values)``, sends each server its slice (:func:`dense_bounds`) and receives
    ``(None, slice)`` from each source."""
    peers = [p for p in range(comm.size) if p != comm.rank]
    device = sections[0][1].device
    with timed("encode"):
        shares = []
        for ids, values in sections:
            if ids is None:
                bounds = dense_bounds(values.numel(), comm.size)
                shares.append([(None, values[bounds[p]: bounds[p + 1]]) for p in range(comm.size)])
                continue
            ids, values, counts = group_by(ids, values)
            starts = [0]
            for c in counts:
                starts.append(starts[-1] + c)
            shares.append([(ids[starts[p]: starts[p + 1]], values[starts[p]: starts[p + 1]]) for p in range(comm.size)])
        messages = {p: frame([pack_rows(*share[p]).payload if share[p][0] is not None else _dense_piece(share[p][1])
                              for share in shares], device) for p in peers}
    with timed("comm"):
        received = comm.exchange(messages, peers, op="push")
    pieces = {p: unframe(received[p], len(sections)) for p in peers}
    return [[share[p] if p == comm.rank
             else (None, pieces[p][k].view(values.dtype)) if ids is None
             else unpack_rows(pieces[p][k], values.shape[1], values.dtype)
             for p in range(comm.size)]
            for k, (share, (ids, values)) in enumerate(zip(shares, sections, strict=True))]


def pull(comm: Communicator, sums: Sequence[Rows], owned: Sequence[Sequence[torch.Tensor] | None],
         timed: Timed = _untimed) -> list[list[Rows]]:
    """Every server's sums of every section to every worker in one exchange: a section with
    ``owned`` (each server's owned ids in it, sorted) as a hash bitmap, one without as COO, a dense
    one (``(None, the server's summed slice)``) as its values. Per section, one (ids, values) per
    server, or ``(None, slice)`` for a dense section."""
    peers = [p for p in range(comm.size) if p != comm.rank]
    device = sums[0][1].device
    with timed("encode"):
        pieces = [_dense_piece(values) if ids is None
                  else pack_rows(ids, values).payload if mine is None
                  else pack_bitmap(mine[comm.rank], ids, values).payload
                  for (ids, values), mine in zip(sums, owned, strict=True)]
        message = frame(pieces, device)
    with timed("comm"):
        received = comm.exchange(dict.fromkeys(peers, message), peers, op="pull")
    with timed("decode"):
        split = {p: unframe(received[p], len(sums)) for p in peers}
        out = []
        for k, ((ids, values), mine) in enumerate(zip(sums, owned, strict=True)):
            width, dtype = values.shape[-1], values.dtype
            out.append([(ids, values) if p == comm.rank
                        else (None, split[p][k].view(dtype)) if ids is None
                        else unpack_rows(split[p][k], width, dtype) if mine is None
                        else unpack_bitmap(split[p][k], mine[p], width, dtype)
                        for p in range(comm.size)])
        return out


def owned_in(owned: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Each server's owned ids within [lo, hi) of the joint space (views: the sets are sorted)."""
    out = []
    for mine in owned:
        bounds = torch.searchsorted(mine, torch.tensor([lo, hi], dtype=mine.dtype, device=mine.device)).tolist()
        out.append(mine[bounds[0]: bounds[1]])
    return out
