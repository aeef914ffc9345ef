"""Aggregation schemes: how compressed tensors are combined across ranks (SYSTEMS.md, section 2).

Compressed tensors cannot be summed by an allreduce (quantizers and sparsifiers are not
associative), except casts, shared-index sparsifiers and PowerSGD's factors. So:

- ``allreduce`` (indivisible): allreduce the payload itself; only for summable compressors, and
  PowerSGD's two-allreduce path.
- ``allgather`` (indivisible): every rank gets every rank's payload, decodes each and sums them in
  rank order.
- ``alltoall`` (divisible): the tensor is cut into n partitions; partition j of every rank goes to
  rank j (all-to-all), which decodes the n pieces, sums, re-compresses the sum, and an allgather
  hands every rank every partition's compressed sum.
- ``gather`` (centralized): rank 0 receives every payload, decodes and sums them, re-compresses
  and broadcasts the result.

Each scheme has two halves: :meth:`Scheme.start` issues the first collective as soon as the
tensor is ready (during backward), :meth:`Scheme.finish` completes it after backward. Both take a
:class:`Job`; every scheme returns the *sum* over ranks of what the ranks started with (the
backend scales by 1/n before compressing, as dense allreduce does), and ``job.local`` — this rank's
own decompressed tensor, which error feedback subtracts.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ddlscale.comm import Communicator, volume
from ddlscale.compress import wire
from ddlscale.compress.base import Compressed, Compressor


@dataclass
class Job:
    """One tensor (a fused group's flat buffer) on its way through a scheme."""

    comm: Communicator
    compressor: Compressor
    tensor: torch.Tensor  # 1-D, scaled and compensated
    name: str
    shapes: list[tuple[int, ...]] | None = None  # the members' shapes, when the buffer holds whole tensors
    local: torch.Tensor | None = None  # this rank's decompressed contribution (for error feedback)
    state: dict[str, Any] = field(default_factory=dict)
    work: GroupWork | None = None  # when given, timed_work adds to it


@dataclass
class GroupWork:
    """One group's compressor work in one training step, in the units the planners' profile
    benchmarks: per kind (``encode``: error feedback, compress, local decompress, pack; ``decode``:
    unpack, decompress, sum) the seconds it took and the (elements, calls) it made. ``finish``: the
    seconds the training thread spent completing it after backward, waiting for its collectives
    included (its decode too, where the scheme decodes there)."""

    seconds: dict[str, float] = field(default_factory=lambda: {"encode": 0.0, "decode": 0.0, "finish": 0.0})
    calls: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {"encode": [], "decode": []})


@contextmanager
def timed_work(work: GroupWork | None, kind: str, numel: int = 0, calls: int = 0):
    """Add the time of the block to ``work`` (when there is one) as ``kind`` work, and ``calls``
    calls on ``numel`` elements each (none for a share of a call, such as error feedback's)."""
    if work is None:
        yield
        return
    start = time.perf_counter()
    yield
    work.seconds[kind] += time.perf_counter() - start
    if calls:
        work.calls[kind].append((numel, calls))


class Scheme:
    name = "?"
    needs_summable = False

    def check(self, compressor: Compressor, key: str) -> None:
        """Refuse a compressor this scheme cannot carry (before training starts)."""
        if self.needs_summable and not _allreducible(compressor):
            raise ValueError(
                f"{key}: scheme {self.name} sums payloads with an allreduce, but compressor "
                f"{compressor.name} is not summable; use allgather, alltoall or gather"
            )

    def start(self, job: Job) -> None:
        raise NotImplementedError

    def finish(self, job: Job) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def shaped(job: Job) -> torch.Tensor:
        """The tensor as the compressor should see it: its parameter's shape for a one-tensor group."""
        return job.tensor.view(job.shapes[0]) if job.shapes is not None and len(job.shapes) == 1 else job.tensor

    @staticmethod
    def segments(job: Job) -> list[int] | None:
        """A fused group's member sizes (per-member compressors keep a scale for each)."""
        return None if job.shapes is None or len(job.shapes) < 2 else [math.prod(shape) for shape in job.shapes]


def _allreducible(compressor: Compressor) -> bool:
    return compressor.summable or hasattr(compressor, "reduce")


def _sizes(job: Job, message: torch.Tensor) -> list[int]:
    """Every rank's message length: known locally for fixed-size compressors (same shape, same
    payload, same header everywhere), else one blocking exchange of sizes."""
    if job.compressor.fixed_size:
        return [message.numel()] * job.comm.size
    return job.comm.allgather_sizes(message.numel(), message.device)


def _decode_sum(compressor: Compressor, like: Compressed, messages: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's payload decoded with this rank's context and summed in rank order."""
    return compressor.decompress_sum([like.with_payload(wire.unpack(message)) for message in messages])


class Allreduce(Scheme):
    name = "allreduce"
    needs_summable = True

    def start(self, job: Job) -> None:
        if hasattr(job.compressor, "reduce"):  # PowerSGD: allreduces inside its own steps
            return
        with timed_work(job.work, "encode", job.tensor.numel(), 1):
            compressed = job.compressor.compress(self.shaped(job), job.name, self.segments(job))
            job.local = job.compressor.decompress(compressed).reshape(-1)  # before the allreduce overwrites it
        payload = [p.clone() if p.data_ptr() == job.tensor.data_ptr() else p for p in compressed.payload]
        job.state["compressed"] = compressed.with_payload(payload)
        job.state["pending"] = [job.comm.allreduce(p) for p in payload]

    def finish(self, job: Job) -> torch.Tensor:
        if hasattr(job.compressor, "reduce"):
            def allreduce(t: torch.Tensor) -> None:
                job.comm.allreduce(t).wait()

            # Each member as its own matrix (one matrix for a flat chunk), all factors of the group in
            # shared allreduces; error feedback subtracts this rank's own share of the result.
            shapes = job.shapes or [tuple(job.tensor.shape)]
            members = [m.view(shape) for m, shape in zip(
                torch.split(job.tensor, [math.prod(s) for s in shapes]), shapes, strict=True)]
            names = [f"{job.name}#{k}" for k in range(len(members))] if job.shapes else [job.name]
            own: list[torch.Tensor] = []
            total = torch.cat([t.reshape(-1) for t in job.compressor.reduce_many(members, names, allreduce, own)])
            job.local = torch.cat([t.reshape(-1) for t in own])
            return total
        for pending in job.state["pending"]:
            pending.wait()
        with timed_work(job.work, "decode", job.tensor.numel(), 1):
            return job.compressor.decompress(job.state["compressed"]).reshape(-1)


def _compress_whole(scheme: Scheme, job: Job) -> tuple[Compressed, torch.Tensor]:
    """Compress the whole tensor, keep this rank's decompressed copy for error feedback, pack it."""
    with timed_work(job.work, "encode", job.tensor.numel(), 1):
        compressed = job.compressor.compress(scheme.shaped(job), job.name, scheme.segments(job))
        job.local = job.compressor.decompress(compressed).reshape(-1)
        return compressed, wire.pack(compressed.payload)


class Allgather(Scheme):
    name = "allgather"

    def start(self, job: Job) -> None:
        compressed, message = _compress_whole(self, job)
        job.state.update(compressed=compressed, pending=job.comm.allgather_uneven(message, _sizes(job, message)))

    def finish(self, job: Job) -> torch.Tensor:
        messages = job.state["pending"].wait()
        with timed_work(job.work, "decode", job.tensor.numel(), len(messages)):
            return _decode_sum(job.compressor, job.state["compressed"], messages).reshape(-1)


class AllToAll(Scheme):
    """Divisible: partition j is reduced at rank j, then every partition's sum is allgathered."""

    name = "alltoall"

    def start(self, job: Job) -> None:
        n = job.comm.size
        sizes = volume.even_split(job.tensor.numel(), n)
        members = job.state["members"] = _clip(self.segments(job), sizes)
        with timed_work(job.work, "encode", sizes[0], n):
            compressed = [job.compressor.compress(p, f"{job.name}/{j}", members[j])
                          for j, p in enumerate(torch.split(job.tensor, sizes))]
            job.local = torch.cat([job.compressor.decompress(c).reshape(-1) for c in compressed])
            messages = [wire.pack(c.payload) for c in compressed]
        splits_in = [m.numel() for m in messages]
        if job.compressor.fixed_size:  # partition j has the same length on every rank
            splits_out = [splits_in[job.comm.rank]] * n
        else:
            recv_sizes = torch.empty(n, dtype=torch.int64, device=job.tensor.device)
            job.comm.all_to_all(recv_sizes, torch.tensor(splits_in, dtype=torch.int64, device=job.tensor.device)).wait()
            splits_out = recv_sizes.tolist()
        received = torch.empty(sum(splits_out), dtype=torch.uint8, device=job.tensor.device)
        pending = job.comm.all_to_all(received, torch.cat(messages), splits_out, splits_in,
                                      same_splits=job.compressor.fixed_size)
        job.state.update(mine=compressed[job.comm.rank], received=received, splits=splits_out, pending=pending,
                         lengths=splits_in)

    def finish(self, job: Job) -> torch.Tensor:
        comm, compressor, mine, members = job.comm, job.compressor, job.state["mine"], job.state["members"]
        job.state["pending"].wait()
        pieces = torch.split(job.state["received"], job.state["splits"])
        with timed_work(job.work, "decode", mine.ctx.numel, len(pieces)):
            partial = _decode_sum(compressor, mine, list(pieces)).reshape(-1)
        # The owner re-compresses its partition's sum; everyone decodes every partition's.
        summed = compressor.compress(partial, f"{job.name}/{comm.rank}/sum", members[comm.rank])
        message = wire.pack(summed.payload)
        # Fixed-size: the sum of partition j packs to what partition j did in the first stage.
        sizes = (job.state["lengths"] if compressor.fixed_size
                 else comm.allgather_sizes(message.numel(), message.device))
        gathered = comm.allgather_uneven(message, sizes).wait()
        sizes = volume.even_split(job.tensor.numel(), comm.size)
        out = []
        for j, piece in enumerate(gathered):
            ctx = summed.ctx if j == comm.rank else compressor.context(sizes[j], partial.dtype, f"{job.name}/{j}/sum",
                                                                       members[j])
            out.append(compressor.decompress(Compressed(wire.unpack(piece), ctx)).reshape(-1))
        return torch.cat(out)


class GatherBroadcast(Scheme):
    """Centralized: rank 0 decodes and sums every payload, re-compresses and broadcasts the sum."""

    name = "gather"

    def start(self, job: Job) -> None:
        compressed, message = _compress_whole(self, job)
        sizes = _sizes(job, message)
        padded = message.new_zeros(max(sizes))  # gather takes equal sizes: pad, charged
        padded[: message.numel()] = message
        job.state.update(compressed=compressed, sizes=sizes, pending=job.comm.gather(padded, dst=0))

    def finish(self, job: Job) -> torch.Tensor:
        comm, compressor = job.comm, job.compressor
        gathered: list[torch.Tensor] | None = job.state["pending"].wait()
        if comm.rank == 0:
            messages = [m[:size] for m, size in zip(gathered, job.state["sizes"], strict=True)]
            with timed_work(job.work, "decode", job.tensor.numel(), len(messages)):
                total = _decode_sum(compressor, job.state["compressed"], messages)
            summed = compressor.compress(total, f"{job.name}/sum", self.segments(job))
            message = wire.pack(summed.payload)
            size = torch.tensor([message.numel()], dtype=torch.int64, device=job.tensor.device)
        else:
            size = torch.tensor([job.state["sizes"][0]], dtype=torch.int64, device=job.tensor.device)
        if not compressor.fixed_size:
            comm.broadcast(size, src=0).wait()
        if comm.rank != 0:
            message = torch.empty(int(size), dtype=torch.uint8, device=job.tensor.device)
        comm.broadcast(message, src=0).wait()
        ctx = summed.ctx if comm.rank == 0 else compressor.context(self.shaped(job).shape, job.tensor.dtype,
                                                                   f"{job.name}/sum", self.segments(job))
        return compressor.decompress(Compressed(wire.unpack(message), ctx)).reshape(-1)


def _clip(segments: list[int] | None, sizes: list[int]) -> list[list[int] | None]:
    """Each consecutive partition's share of the members (empty shares left out)."""
    if segments is None:
        return [None] * len(sizes)
    out, member, used = [], 0, 0  # used: elements of segments[member] already in earlier partitions
    for size in sizes:
        share = []
        while size > 0 and member < len(segments):
            take = min(size, segments[member] - used)
            if take > 0:
                share.append(take)
            size, used = size - take, used + take
            if used == segments[member]:
                member, used = member + 1, 0
        out.append(share)
    return out


SCHEMES: dict[str, type[Scheme]] = {s.name: s for s in (Allreduce, Allgather, AllToAll, GatherBroadcast)}


def scheme(name: str, key: str = "sync.comm") -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"{key} must be one of {', '.join(SCHEMES)}; got {name!r}")
    return SCHEMES[name]()
