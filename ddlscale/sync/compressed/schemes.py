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
- ``zen`` (sparsifiers only): Zen's balanced push / sum / pull (:mod:`ddlscale.sync.sparse.pushpull`)
  at element granularity: each selected (index, value) goes to the rank its index hashes to, which
  sums what arrives; every rank pulls every owner's sums. A rank receives about the union of the
  selections instead of n selections, and nothing is compressed twice.

Each scheme has two halves: :meth:`Scheme.start` issues the first collective as soon as the
tensor is ready (during backward), :meth:`Scheme.finish` completes it after backward. Both take a
:class:`Job`; every scheme returns what the ranks' tensors aggregate to — their *sum* (the backend
scales by 1/n before compressing, as dense allreduce does), or what the compressor's
:meth:`~ddlscale.compress.Compressor.combine` makes of it (signSGD's vote) — and sets
``job.local``, this rank's own payload decompressed, and ``job.share``, this rank's share of the
result: the shares of all ranks sum to it exactly. Error feedback subtracts the share, so nothing a
compression drops is lost: where an owner compresses a partition's sum a second time, the error of
that second compression is in its share (and so in its residual) too.

A scheme's rules (which compressors it carries) and price are its
:class:`~ddlscale.plan.aggregation.Aggregation`'s, which its class here subclasses: a new scheme is
an Aggregation subclass there and its executing subclass here, registered in :data:`SCHEMES`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ddlscale import clock
from ddlscale.comm import Communicator, volume
from ddlscale.compress import packing
from ddlscale.compress.compressor import Compressed, Compressor, Segment, pieces
from ddlscale.plan import aggregation
from ddlscale.plan.aggregation import Aggregation
from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.hashing import HashPartitioner


@dataclass
class Job:
    """One tensor (a fused group's flat buffer) on its way through a scheme."""

    comm: Communicator
    compressor: Compressor
    tensor: torch.Tensor  # 1-D, preconditioned and compensated
    name: str
    segments: list[Segment] | None = None  # its members, or the pieces of them it holds (None: one flat member)
    local: torch.Tensor | None = None  # this rank's own payload decompressed: what its first compression sent
    share: torch.Tensor | None = None  # this rank's share of the result (None: ``local``)
    state: dict[str, Any] = field(default_factory=dict)
    work: GroupWork | None = None  # when given, timed_work adds to it
    feedback: bool = False  # error feedback subtracts ``shared``: every rounding of the result must be in a share
    # The names of the tensors it holds, in buffer order: they key per-tensor state that is not laid
    # out like the buffer (PowerSGD's Q), so that it follows each tensor into any group.
    members: tuple[str, ...] = ()

    @property
    def shared(self) -> torch.Tensor:
        return self.local if self.share is None else self.share


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
    start = clock.now()
    yield
    work.seconds[kind] += clock.now() - start
    if calls:
        work.calls[kind].append((numel, calls))


class Scheme(Aggregation):
    """An aggregation scheme as it runs: its rules and price are its :class:`Aggregation`'s."""

    def check(self, compressor: Compressor, key: str) -> None:
        """Refuse a compressor this scheme cannot carry (before training starts)."""
        reason = self.refusal(compressor)
        if reason is not None:
            raise ValueError(f"{key}: {reason}")

    def start(self, job: Job) -> None:
        raise NotImplementedError

    def finish(self, job: Job) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def finish_together(cls, jobs: list[Job]) -> None:
        """Called once per step, before any :meth:`finish`, with this rank's jobs of this scheme in
        group order (each communicator's jobs the same on all its ranks): a scheme whose exchanges
        are blocking may complete them for all its groups at once here. Nothing by default."""

    @staticmethod
    def second_stage(job: Job, total: torch.Tensor, name: str, segments: list[Segment] | None,
                     at: int = 0) -> tuple[Compressed, torch.Tensor]:
        """An owner's compression of what the ranks' tensors aggregate to over ``total`` (their summed
        decoded payloads for the elements from ``at`` on): (the compressed result, it decoded). What
        that compression drops stays in this rank's share of the result, so error feedback keeps it."""
        compressor = job.compressor
        summed = compressor.compress(compressor.combine(total, job.comm.size), name, segments)
        decoded = compressor.decompress(summed).reshape(-1)
        if job.share is None:
            job.share = job.local.clone()
        job.share[at: at + total.numel()] += decoded - total
        return summed, decoded


def _sizes(job: Job, message: torch.Tensor) -> list[int]:
    """Every rank's message length: known locally for fixed-size compressors (same shape, same
    payload, same header everywhere), else one blocking exchange of sizes."""
    if job.compressor.fixed_size:
        return [message.numel()] * job.comm.size
    return job.comm.allgather_sizes(message.numel(), message.device)


def _decode_sum(compressor: Compressor, like: Compressed, messages: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's payload decoded with this rank's context and summed in rank order."""
    return compressor.decompress_sum([like.with_payload(packing.unpack(message)) for message in messages])


class Allreduce(aggregation.Allreduce, Scheme):
    """Sum the payloads with an allreduce. A payload narrower than the tensor (fp16/bf16 casts) sums
    in its own precision, and that rounding — several times each rank's cast error — would be in no
    rank's share. Under error feedback such a group is therefore reduced as a ring allreduce is,
    reduce-scatter then allgather, with the owner of each partition summing the n 16-bit pieces in
    float32 and casting the sum once (:class:`AllToAll`: the same bytes on the wire); the cast's
    error stays in the owner's share, so the shares sum to the result exactly."""

    @staticmethod
    def rounds(job: Job) -> bool:
        """Whether summing ``job``'s payloads would round below the tensor's precision unaccounted."""
        wire_dtype = job.compressor.wire_dtype
        return job.feedback and wire_dtype is not None and wire_dtype.itemsize < job.tensor.element_size()

    def start(self, job: Job) -> None:
        if job.compressor.reduces_itself:  # PowerSGD: allreduces inside its own steps
            return
        if self.rounds(job):
            job.state["owners"] = AllToAll()
            job.state["owners"].start(job)
            return
        with timed_work(job.work, "encode", job.tensor.numel(), 1):
            compressed = job.compressor.compress(job.tensor, job.name, job.segments)
            job.local = job.compressor.decompress(compressed).reshape(-1)  # before the allreduce overwrites it
        payload = [p.clone() if p.data_ptr() == job.tensor.data_ptr() else p for p in compressed.payload]
        job.state["compressed"] = compressed.with_payload(payload)
        job.state["pending"] = [job.comm.allreduce(p) for p in payload]

    def finish(self, job: Job) -> torch.Tensor:
        if job.compressor.reduces_itself:
            return self._power_iteration(job)
        if "owners" in job.state:
            return job.state["owners"].finish(job)
        for pending in job.state["pending"]:
            pending.wait()
        with timed_work(job.work, "decode", job.tensor.numel(), 1):
            return job.compressor.decompress(job.state["compressed"]).reshape(-1)

    @staticmethod
    def _power_iteration(job: Job) -> torch.Tensor:
        """PowerSGD: each member as its own matrix, warm-started under its tensor's name (so its Q
        follows the tensor across regroupings), all factors of the group in shared allreduces;
        error feedback subtracts this rank's own share of the result. Its compute is timed as the
        profile benchmarks it: up to Q's allreduce encode (P = M Q, orthogonalize, Q = M^T P, this
        rank's share), after it decode (P Q^T)."""
        waited, last = [0.0], [None]

        def allreduce(t: torch.Tensor) -> None:
            start = clock.now()
            job.comm.allreduce(t).wait()
            last[0] = clock.now()
            waited[0] += last[0] - start

        segments = job.segments or [Segment(job.tensor.numel())]
        members = [piece.view(s.rows, s.cols) for piece, s in
                   zip(torch.split(job.tensor, [s.numel for s in segments]), segments, strict=True)]
        if len(job.members) == len(members):
            names = list(job.members)
        else:  # a buffer given without its tensors' names (a direct caller): its members by position
            names = [f"{job.name}#{k}" for k in range(len(members))] if len(members) > 1 else [job.name]
        own: list[torch.Tensor] = []
        start = clock.now()
        reduced = job.compressor.reduce_many(members, names, allreduce, own)
        end = clock.now()
        if job.work is not None:
            decode = end - last[0] if last[0] is not None else 0.0
            numel = job.tensor.numel()
            for kind, seconds in (("encode", end - start - waited[0] - decode), ("decode", decode)):
                job.work.seconds[kind] += seconds
                job.work.calls[kind].append((numel, 1))
        job.local = torch.cat([t.reshape(-1) for t in own])
        return torch.cat([t.reshape(-1) for t in reduced])


def _compress_whole(job: Job) -> tuple[Compressed, torch.Tensor]:
    """Compress the whole tensor, keep this rank's decompressed copy for error feedback, pack it."""
    with timed_work(job.work, "encode", job.tensor.numel(), 1):
        compressed = job.compressor.compress(job.tensor, job.name, job.segments)
        job.local = job.compressor.decompress(compressed).reshape(-1)
        return compressed, packing.pack(compressed.payload)


class Allgather(aggregation.Allgather, Scheme):
    def start(self, job: Job) -> None:
        compressed, message = _compress_whole(job)
        job.state.update(compressed=compressed, pending=job.comm.allgather_uneven(message, _sizes(job, message)))

    def finish(self, job: Job) -> torch.Tensor:
        messages = job.state["pending"].wait()
        with timed_work(job.work, "decode", job.tensor.numel(), len(messages)):
            total = _decode_sum(job.compressor, job.state["compressed"], messages).reshape(-1)
            return job.compressor.combine(total, len(messages))


class AllToAll(aggregation.AllToAll, Scheme):
    """Divisible: partition j is reduced at rank j, then every partition's sum is allgathered."""

    def start(self, job: Job) -> None:
        n = job.comm.size
        sizes = volume.even_split(job.tensor.numel(), n)
        members = job.state["members"] = pieces(job.segments or [Segment(job.tensor.numel())], sizes)
        with timed_work(job.work, "encode", sizes[0], n):
            compressed = [job.compressor.compress(p, f"{job.name}/{j}", members[j])
                          for j, p in enumerate(torch.split(job.tensor, sizes))]
            job.local = torch.cat([job.compressor.decompress(c).reshape(-1) for c in compressed])
            messages = [packing.pack(c.payload) for c in compressed]
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
                         lengths=splits_in, sizes=sizes)

    def finish(self, job: Job) -> torch.Tensor:
        comm, compressor, mine, members = job.comm, job.compressor, job.state["mine"], job.state["members"]
        sizes = job.state["sizes"]
        job.state["pending"].wait()
        pieces_in = torch.split(job.state["received"], job.state["splits"])
        with timed_work(job.work, "decode", mine.ctx.numel, len(pieces_in)):
            partial = _decode_sum(compressor, mine, list(pieces_in)).reshape(-1)
        # The owner re-compresses its partition's aggregate (keeping that compression's error in
        # its share); everyone decodes every partition's.
        summed, decoded = self.second_stage(job, partial, f"{job.name}/{comm.rank}/sum", members[comm.rank],
                                            sum(sizes[: comm.rank]))
        message = packing.pack(summed.payload)
        # Fixed-size: the sum of partition j packs to what partition j did in the first stage.
        lengths = (job.state["lengths"] if compressor.fixed_size
                   else comm.allgather_sizes(message.numel(), message.device))
        gathered = comm.allgather_uneven(message, lengths).wait()
        out = []
        for j, piece in enumerate(gathered):
            if j == comm.rank:
                out.append(decoded)
                continue
            ctx = compressor.context(sizes[j], partial.dtype, f"{job.name}/{j}/sum", members[j])
            out.append(compressor.decompress(Compressed(packing.unpack(piece), ctx)).reshape(-1))
        return torch.cat(out)


class GatherBroadcast(aggregation.GatherBroadcast, Scheme):
    """Centralized: rank 0 decodes and sums every payload, re-compresses and broadcasts the sum."""

    def start(self, job: Job) -> None:
        compressed, message = _compress_whole(job)
        sizes = _sizes(job, message)
        padded = message.new_zeros(max(sizes))  # gather takes equal sizes: pad, charged
        padded[: message.numel()] = message
        job.state.update(compressed=compressed, sizes=sizes, pending=job.comm.gather(padded, dst=0))

    def finish(self, job: Job) -> torch.Tensor:
        comm, compressor = job.comm, job.compressor
        gathered: list[torch.Tensor] | None = job.state["pending"].wait()
        decoded = None
        if comm.rank == 0:
            messages = [m[:size] for m, size in zip(gathered, job.state["sizes"], strict=True)]
            with timed_work(job.work, "decode", job.tensor.numel(), len(messages)):
                total = _decode_sum(compressor, job.state["compressed"], messages).reshape(-1)
            summed, decoded = self.second_stage(job, total, f"{job.name}/sum", job.segments)
            message = packing.pack(summed.payload)
            size = torch.tensor([message.numel()], dtype=torch.int64, device=job.tensor.device)
        else:
            size = torch.tensor([job.state["sizes"][0]], dtype=torch.int64, device=job.tensor.device)
        if not compressor.fixed_size:
            comm.broadcast(size, src=0).wait()
        if comm.rank != 0:
            message = torch.empty(int(size), dtype=torch.uint8, device=job.tensor.device)
        comm.broadcast(message, src=0).wait()
        if decoded is not None:
            return decoded
        ctx = compressor.context(job.tensor.numel(), job.tensor.dtype, f"{job.name}/sum", job.segments)
        return compressor.decompress(Compressed(packing.unpack(message), ctx)).reshape(-1)


class ZenPushPull(aggregation.ZenPushPull, Scheme):
    """Sparsifiers' selections through Zen's hash-partitioned push, sum and pull, one unit per
    element (the thesis's two halves: compression makes gradients sparse, Zen syncs sparse ones).
    The sum is exact, so this rank's share is what it sent and error feedback loses nothing.

    Blocking exchanges, so they run after backward: in :meth:`finish_together`, one push and one
    pull for all of a communicator's zen groups (a group alone, or past int32 indices, in its own
    :meth:`finish`); compression runs in :meth:`start`, as the other schemes do. The cost model
    (:mod:`ddlscale.plan.pricing`) prices it so: each group's exchanges without their latency, the
    two rounds' latency once per step (``CostModel.fixed_s``)."""

    SEED = 0x5EED  # a constant every rank shares: no agreement round needed
    # One per world size, kept across steps (a Scheme is made per launch): the owned sets the
    # bitmap pull decodes against are computed once per tensor size, not every step.
    _partitioners: dict[int, HashPartitioner] = {}

    def start(self, job: Job) -> None:
        if job.tensor.numel() >= 2**31:
            raise ValueError(f"{job.name}: scheme zen indexes elements as int32; {job.tensor.numel()} elements "
                             f"do not fit (fuse less: sync.bucket_mb)")
        with timed_work(job.work, "encode", job.tensor.numel(), 1):
            compressed = job.compressor.compress(job.tensor, job.name, job.segments)
            job.local = job.compressor.decompress(compressed).reshape(-1)
            values, idx = job.compressor.entries(compressed.payload, compressed.ctx)
        job.state.update(ids=idx.to(torch.int64), values=values.reshape(-1, 1).to(job.tensor.dtype))

    def finish(self, job: Job) -> torch.Tensor:
        if "total" in job.state:  # summed with the other groups in finish_together
            return job.state.pop("total")
        total, decode_s = self._push_pull([job], job.tensor.numel())
        _charge_decode(job, decode_s, 1.0)
        return job.compressor.combine(total, job.comm.size)

    @classmethod
    def finish_together(cls, jobs: list[Job]) -> None:
        """One push and one pull for all groups of one communicator and dtype, their elements in one
        index space (group after group): two exchange rounds per step instead of two per group.
        Each round's fixed cost (a message to every peer, the ranks meeting) is paid once; the
        hashing spreads the joint space as evenly as each group's. Measured on 8 emulated machines
        (lstm, top-k 1%, layer-wise), per-group rounds made Zen slower than an allgather per group."""
        batches: dict[tuple[int, torch.dtype], list[Job]] = {}
        for job in jobs:
            batches.setdefault((id(job.comm), job.tensor.dtype), []).append(job)
        for batch in batches.values():
            numel = sum(job.tensor.numel() for job in batch)
            if len(batch) < 2 or numel == 0 or numel >= 2**31:
                continue  # alone, empty, or past int32 indices: each group in its own finish
            started = clock.now()
            total, decode_s = cls._push_pull(batch, numel)
            elapsed, at = clock.now() - started, 0
            for job in batch:
                n = job.tensor.numel()
                job.state["total"] = job.compressor.combine(total[at: at + n], job.comm.size)
                # Each group's part of the joint exchange and its decode, by its size (the planners'
                # calibration reads per-group work; a joint figure would be one sample at the whole
                # model's size).
                _charge_decode(job, decode_s, n / numel)
                if job.work is not None:
                    job.work.seconds["finish"] += elapsed * n / numel
                at += n

    @classmethod
    def _push_pull(cls, jobs: list[Job], numel: int) -> tuple[torch.Tensor, float]:
        """The summed selections of ``jobs`` (one communicator, one dtype), laid end to end, and the
        seconds spent decoding (summing at the owner, scattering the pulled sums)."""
        comm, first = jobs[0].comm, jobs[0]
        partitioner = cls._partitioners.setdefault(comm.size, HashPartitioner(comm.size, cls.SEED))
        offsets, at = [], 0
        for job in jobs:
            offsets.append(at)
            at += job.tensor.numel()
        ids = torch.cat([job.state["ids"] + offset for job, offset in zip(jobs, offsets, strict=True)])
        values = torch.cat([job.state["values"] for job in jobs])
        received = pushpull.push(comm, ids, values, partitioner.group)
        started = clock.now()
        summed_ids, summed = pushpull.aggregate(received)
        decode_s = clock.now() - started
        # The format every rank can decide alike: fixed-size selections have a known count.
        fixed = all(job.compressor.fixed_size for job in jobs)
        if fixed and volume.pull_as_bitmap(numel, ids.numel(), comm.size, pushpull.INDEX_BYTES):
            pulled = pushpull.pull_bitmap(comm, partitioner.owned(numel, ids.device), summed_ids, summed)
        else:
            pulled = pushpull.pull_coo(comm, summed_ids, summed)
        started = clock.now()
        total = first.tensor.new_zeros(numel)
        for piece_ids, piece_values in pulled:
            total[piece_ids] = piece_values.reshape(-1)
        return total, decode_s + clock.now() - started


def _charge_decode(job: Job, seconds: float, share: float) -> None:
    """Add ``share`` of a zen exchange's decode to ``job``'s work: its seconds, and two calls (the
    owner's sum, the scatter) on the job's elements, as the fits count them."""
    if job.work is not None:
        job.work.seconds["decode"] += seconds * share
        job.work.calls["decode"] += [(job.tensor.numel(), 1)] * 2


SCHEMES: dict[str, type[Scheme]] = {s.name: s for s in (Allreduce, Allgather, AllToAll, GatherBroadcast, ZenPushPull)}


def scheme(name: str, key: str = "sync.comm") -> Scheme:
    if name not in SCHEMES:
        raise ValueError(f"{key} must be one of {', '.join(SCHEMES)}; got {name!r}")
    return SCHEMES[name]()
