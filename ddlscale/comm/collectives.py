"""Accounted collectives: the only way ddlscale's backends touch the network.

Each call charges the closed-form bytes of its algorithm (see :mod:`ddlscale.comm.volume`) to a
:class:`CommLedger` and timestamps its start and completion. Completion is taken from the work's
future callback, which fires on the communication thread when the collective really ends, so the
recorded spans show where the wire was busy — Gemini schedules checkpoint traffic into the gaps.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.comm import volume
from ddlscale.comm.groups import weak_group

SEGMENT_BYTES = 256 << 10  # point-to-point segment size on gloo (see Communicator._exchange)
SMALL_BYTES = 64 << 10  # below this per rank, gloo's own collectives win: one call, no per-peer ops
HEADER_BYTES = 8  # an exchanged message's length travels in front of it (Communicator.exchange)
# Communicator.exchange's pieces: whole messages up to 4 MiB, posted to every peer at once. Measured on
# 8 emulated machines at 1 Gbit/s, a 1.2 MB message to each of 7 peers took 1.21x its wire time in
# 4 MiB pieces and 1.74x in 256 KiB ones: with many peers in flight both directions stay busy without
# cutting, and every piece costs the host. The receive buffers for first pieces (one per source) are
# kept within EXCHANGE_BUFFER_BYTES, so large groups cut smaller.
EXCHANGE_PIECE_BYTES = 4 << 20
EXCHANGE_BUFFER_BYTES = 32 << 20


def _segments(tensor: torch.Tensor, segment_bytes: int) -> list[torch.Tensor]:
    """Pieces of at most ``segment_bytes``; none for an empty tensor (both sides know it is empty)."""
    flat = tensor.reshape(-1)
    step = max(1, segment_bytes // max(1, flat.element_size()))
    return [flat[i : i + step] for i in range(0, flat.numel(), step)]


@dataclass
class CollectiveRecord:
    """One collective as one rank saw it."""

    op: str
    bytes_sent: int
    bytes_recv: int
    start: float
    end: float | None = None  # perf_counter() at completion; None while in flight

    @property
    def duration(self) -> float | None:
        return None if self.end is None else self.end - self.start


@dataclass
class CommLedger:
    """The collectives one rank issued since the last :meth:`drain`."""

    records: list[CollectiveRecord] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def bytes_recv(self) -> int:
        return sum(r.bytes_recv for r in self.records)

    def drain(self) -> list[CollectiveRecord]:
        """Return the records so far and start a new, empty ledger."""
        records, self.records = self.records, []
        return records


class Pending:
    """An issued collective (one work or several); :meth:`wait` blocks until done, returns the result."""

    def __init__(self, works: list[Any], record: CollectiveRecord, result: Any = None):
        self._works = works
        self.record = record
        self.result = result
        self.on_wait: Any = None  # called once after the works complete (e.g. to settle the record's bytes)

    def wait(self) -> Any:
        for work in self._works:
            work.wait()
        self._works = []
        if self.record.end is None:
            self.record.end = clock.now()
        if self.on_wait is not None:
            self.on_wait, settle = None, self.on_wait
            settle()
        return self.result


def _stamp_completion(works: list[Any], record: CollectiveRecord) -> None:
    """Record the true completion time (the last work's) through futures, where the backend has them."""
    try:
        futures = [work.get_future() for work in works]
    except (AttributeError, RuntimeError):
        return
    remaining = [len(futures)]

    def done(_: Any) -> None:
        remaining[0] -= 1
        if remaining[0] == 0 and record.end is None:
            record.end = clock.now()

    for future in futures:
        future.add_done_callback(done)


class Message:
    """Bytes for :meth:`Communicator.exchange`, with room for their length in front.

    Build the payload in place (``payload`` is a view) so that framing it costs no copy.
    """

    def __init__(self, nbytes: int, device: torch.device | str = "cpu"):
        self.frame = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8, device=device)
        self.payload = self.frame[HEADER_BYTES:]

    @classmethod
    def of(cls, payload: torch.Tensor) -> Message:
        message = cls(payload.numel() * payload.element_size(), payload.device)
        message.payload.copy_(payload.reshape(-1).view(torch.uint8))
        return message

    def seal(self) -> torch.Tensor:
        """The frame with its length written in."""
        self.frame[:HEADER_BYTES].copy_(torch.tensor([self.payload.numel()], dtype=torch.int64).view(torch.uint8))
        return self.frame


class Communicator:
    """Accounted collectives over one process group (the world by default).

    Ranks given to and returned by methods are ranks *within the group*, so the same backend code
    runs on intra- and inter-machine sub-groups.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, ledger: CommLedger | None = None):
        self._group = weak_group(group)  # c10d owns it: destroy_process_group must end it (see groups)
        self.ledger = ledger if ledger is not None else CommLedger()
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # NCCL pipelines large messages itself; gloo needs our segmented point-to-point exchange.
        self.segment_bytes = SEGMENT_BYTES if dist.get_backend(group) == "gloo" else None
        # exchange()'s first receive per source and its pieces (gloo; None: sizes go first).
        self.piece_bytes = None if self.segment_bytes is None else max(
            SEGMENT_BYTES, min(EXCHANGE_PIECE_BYTES, EXCHANGE_BUFFER_BYTES // max(1, self.size - 1)))

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the world's)."""
        return self._group()

    # -- bookkeeping -------------------------------------------------------------------------
    def _issue(self, op: str, sent: int, recv: int, launch, result: Any = None) -> Pending:
        record = CollectiveRecord(op, sent, recv, clock.now())
        self.ledger.records.append(record)
        works = launch()
        point_to_point = isinstance(works, list)
        works = [w for w in (works if point_to_point else [works]) if w is not None]
        # Future callbacks on gloo's point-to-point works can abort the process at exit
        # ("terminate called without an active exception"), so those end at wait() instead.
        if works and not point_to_point:
            _stamp_completion(works, record)
        return Pending(works, record, result)

    def _exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list[Any]:
        """Post every send and receive at once, cut into segments (gloo) so both directions flow.

        gloo's TCP pair moves one large message at a time: two ranks exchanging 32 MB each way as
        single messages take twice as long as one-way, whereas 1 MB segments keep both directions
        busy (measured on the emulated cluster; 256 KiB beat 1 and 4 MiB). Both sides cut a block identically: by element
        count, into pieces of at most ``SEGMENT_BYTES``.
        """
        # Interleave sends and receives segment by segment, peer by peer: queued in blocks, the
        # receives would wait behind every send and the exchange would run one way at a time.
        queues = [[dist.P2POp(dist.isend, piece, self._global(peer), self.group)
                   for piece in _segments(tensor, self.segment_bytes)] for peer, tensor in sends]
        queues += [[dist.P2POp(dist.irecv, piece, self._global(peer), self.group)
                    for piece in _segments(tensor, self.segment_bytes)] for peer, tensor in recvs]
        ops = [op for batch in itertools.zip_longest(*queues) for op in batch if op is not None]
        return dist.batch_isend_irecv(ops) if ops else []

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
        """In-place ring allreduce of a dense tensor."""
        sent, recv = volume.ring_allreduce(tensor.numel(), tensor.element_size(), self.size, self.rank)
        return self._issue(
            "allreduce", sent, recv,
            lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True), tensor,
        )

    def allgather(self, tensor: torch.Tensor) -> Pending:
        """Allgather of equal-sized tensors; the result is a list, one tensor per rank."""
        return self._allgather_direct(tensor.contiguous(), [tensor.shape] * self.size, "allgather")

    def allgather_sizes(self, numel: int, device: torch.device) -> list[int]:
        """Blocking exchange of one integer per rank (the sizes an uneven allgather needs).

        An all-to-all of the integer repeated: one round of tiny messages, where gloo's ring allgather
        takes n-1 in sequence (measured on 8 emulated machines: 4.2 vs 11.7 ms; on 4: 2.9 vs 3.0 ms).
        """
        mine = torch.full((self.size,), numel, dtype=torch.int64, device=device)
        everyone = torch.empty_like(mine)
        self.all_to_all(everyone, mine).wait()
        return everyone.tolist()

    def allgather_uneven(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> Pending:
        """Allgather of 1-D tensors of different lengths, without padding; the result is a list.

        ``sizes`` (every rank's length) skips the size exchange when already known.
        """
        flat = tensor.reshape(-1).contiguous()
        if sizes is None:
            sizes = self.allgather_sizes(flat.numel(), flat.device)
        return self._allgather_direct(flat, [torch.Size([n]) for n in sizes], "allgather_uneven")

    def _allgather_direct(self, tensor: torch.Tensor, shapes: list[torch.Size], op: str) -> Pending:
        """Every rank sends its piece to each peer: the ring's bytes per rank, in one round.

        With gloo this beats gloo's own ring allgather, which serializes its two large messages
        per step (measured 1.7-2.2x the ideal time on the emulated cluster). NCCL with equal
        pieces keeps its own ring.
        """
        out = [tensor.new_empty(shape) for shape in shapes]
        pieces = [shape.numel() * tensor.element_size() for shape in shapes]
        if len(set(pieces)) == 1 and (self.segment_bytes is None or sum(pieces) <= SMALL_BYTES):
            sent, recv = volume.ring_allgather(pieces, self.rank)
            return self._issue(op, sent, recv,
                               lambda: dist.all_gather(out, tensor, group=self.group, async_op=True), out)
        if self.segment_bytes is None or max(pieces) * self.size <= SMALL_BYTES:
            return self._allgather_padded(tensor.reshape(-1), [s.numel() for s in shapes], op)
        out[self.rank] = tensor.clone()
        sent, recv = volume.direct_allgather(pieces, self.rank)
        peers = [r for r in range(self.size) if r != self.rank]
        return self._issue(
            op, sent, recv,
            lambda: self._exchange([(p, tensor) for p in peers], [(p, out[p]) for p in peers]), out,
        )

    def _allgather_padded(self, flat: torch.Tensor, numels: list[int], op: str) -> Pending:
        """Uneven allgather through the backend's own allgather, padding to the longest piece.

        The padding travels and is charged: worth it only for small pieces, where one native call
        beats per-peer messages.
        """
        longest = max(numels)
        padded = flat.new_zeros(longest)
        padded[: flat.numel()] = flat
        out = [padded.new_empty(longest) for _ in range(self.size)]
        sent, recv = volume.ring_allgather([longest * flat.element_size()] * self.size, self.rank)
        trimmed = [piece[:n] for piece, n in zip(out, numels, strict=True)]
        return self._issue(op, sent, recv,
                           lambda: dist.all_gather(out, padded, group=self.group, async_op=True), trimmed)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        same_splits: bool = False,
    ) -> Pending:
        """All-to-all along dim 0 with (optionally uneven) splits; ``output`` receives the blocks.

        ``same_splits``: every rank passes the same ``input_splits``, so each knows every rank's bytes.
        """
        row = math.prod(input.shape[1:]) * input.element_size()  # bytes per dim-0 row (empty input too)
        in_splits = input_splits or volume.even_split(input.shape[0], self.size)
        out_splits = output_splits or volume.even_split(output.shape[0], self.size)
        sent, recv = volume.all_to_all([s * row for s in in_splits], [s * row for s in out_splits], self.rank)
        # gloo: small exchanges go through its own call, but every rank must take the same path, or
        # each waits for messages the others never send. So decide from the busiest rank's bytes,
        # known everywhere when the splits are even or the same on every rank. Other uneven splits
        # tell a rank only its own bytes, and agreeing on them would add a collective to every
        # exchange: those always go point to point.
        if self.segment_bytes is None or (
            (same_splits or (input_splits is None and output_splits is None))
            and self._busiest_all_to_all([s * row for s in in_splits]) <= SMALL_BYTES
        ):
            return self._issue(
                "all_to_all", sent, recv,
                lambda: dist.all_to_all_single(
                    output, input, output_splits, input_splits, group=self.group, async_op=True
                ),
                output,
            )
        in_blocks = list(torch.split(input, in_splits))
        out_blocks = list(torch.split(output, out_splits))
        out_blocks[self.rank].copy_(in_blocks[self.rank])
        peers = [r for r in range(self.size) if r != self.rank]
        return self._issue(
            "all_to_all", sent, recv,
            lambda: self._exchange([(p, in_blocks[p]) for p in peers], [(p, out_blocks[p]) for p in peers]),
            output,
        )

    def _busiest_all_to_all(self, blocks: list[int]) -> int:
        """Most bytes any rank sends or receives when every rank sends ``blocks`` (block j to rank j)."""
        return max(max(volume.all_to_all(blocks, [b] * self.size, r)) for r, b in enumerate(blocks))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Ring reduce-scatter: ``input`` holds ``size`` equal chunks, ``output`` gets this rank's sum."""
        chunk = output.numel() * output.element_size()
        sent, recv = volume.ring_reduce_scatter(chunk, self.size)
        return self._issue(
            "reduce_scatter", sent, recv,
            lambda: dist.reduce_scatter_tensor(output, input, group=self.group, async_op=True), output,
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        sent, recv = volume.flat_broadcast(tensor.numel() * tensor.element_size(), self.size, self.rank, src)
        return self._issue(
            "broadcast", sent, recv,
            lambda: dist.broadcast(tensor, self._global(src), group=self.group, async_op=True), tensor,
        )

    def broadcast_coalesced(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Blocking broadcast of many small tensors in a few flat messages (DDP's buffer sync)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sent, recv = volume.flat_broadcast(nbytes, self.size, self.rank, src)
        record = CollectiveRecord("broadcast_coalesced", sent, recv, clock.now())
        self.ledger.records.append(record)
        group = self.group if self.group is not None else dist.group.WORLD
        dist._broadcast_coalesced(group, tensors, 64 * 2**20, self._global(src))
        record.end = clock.now()

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Pending:
        """Gather equal-sized tensors to ``dst``; the result there is a list, elsewhere None."""
        nbytes = tensor.numel() * tensor.element_size()
        sent, recv = volume.flat_gather([nbytes] * self.size, self.rank, dst)
        out = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == dst else None
        return self._issue(
            "gather", sent, recv,
            lambda: dist.gather(tensor, out, dst=self._global(dst), group=self.group, async_op=True), out,
        )

    def sparse_allreduce(self, tensor: torch.Tensor) -> Pending:
        """The backend's own in-place allreduce of a sparse COO tensor, as ``dist.all_reduce`` runs it
        (gloo: the non-zero counts, then ring allgathers of every rank's int64 indices and values,
        summed locally); the result is the coalesced sum.

        The charged bytes are those ring allgathers' over every rank's (indices, values). Every
        rank's count is needed for them, so a tiny all-to-all of counts is launched beside the call,
        asynchronously, and read when the call is waited for: the accounting adds no round to the
        call's own path, and its few bytes are not charged.
        """
        tensor = tensor.coalesce()
        per_nonzero = tensor.sparse_dim() * 8 + math.prod(tensor.values().shape[1:]) * tensor.element_size()
        mine = torch.full((self.size,), tensor._nnz(), dtype=torch.int64)
        everyone = torch.empty_like(mine)
        counting = dist.all_to_all_single(everyone, mine, group=self.group, async_op=True)
        pending = self._issue("sparse_allreduce", 0, 0,
                              lambda: dist.all_reduce(tensor, group=self.group, async_op=True), tensor)

        def charge() -> None:
            counting.wait()
            pending.record.bytes_sent, pending.record.bytes_recv = volume.ring_allgather(
                [int(c) * per_nonzero for c in everyone], self.rank)

        pending.on_wait = charge
        return pending

    def exchange(self, messages: dict[int, Message], sources: list[int], op: str = "exchange",
                 device: torch.device | str | None = None) -> dict[int, torch.Tensor]:
        """Send ``messages[peer]`` to each peer and receive one message from each of ``sources``, whose
        sizes this rank does not know; returns {source: payload bytes} on ``device`` (default: the
        messages' device). Blocking; one round.

        A push, a pull, a doubling stage: every sparse scheme moves messages whose sizes only their
        senders know. Exchanging the sizes first costs a second round of messages. Here, on gloo,
        each message carries its length in front, and the receiver posts a first receive of one
        segment (gloo accepts a shorter message into a larger buffer); only a message longer than
        that is completed by a second receive, posted as soon as its length is read, while the
        other peers' messages keep flowing (pieces of :attr:`piece_bytes`). The 8-byte lengths travel
        and are charged. NCCL receives need exact
        sizes: there the lengths go first, then the payloads. gloo's point-to-point runs on host
        memory, so device messages are staged through it.
        """
        device = torch.device(device) if device is not None else next(
            (m.frame.device for m in messages.values()), torch.device("cpu"))
        record = CollectiveRecord(op, sum(HEADER_BYTES + m.payload.numel() for m in messages.values()), 0,
                                  clock.now())
        self.ledger.records.append(record)
        if self.piece_bytes is None:
            received = self._exchange_sized_first(messages, sources, device)
        else:
            received = {p: t.to(device) for p, t in self._exchange_framed(messages, sources).items()}
        record.bytes_recv = sum(HEADER_BYTES + payload.numel() for payload in received.values())
        record.end = clock.now()
        return received

    def _exchange_framed(self, messages: dict[int, Message], sources: list[int]) -> dict[int, torch.Tensor]:
        first = self.piece_bytes
        frames = {id(m): m.seal().cpu() for m in messages.values()}
        sends = []
        heads = {p: torch.empty(first, dtype=torch.uint8) for p in sources}
        # Post each first receive before any send so no peer's first piece waits on a receive.
        head_works = {p: dist.irecv(heads[p], self._global(p), self.group) for p in sources}
        queues = [[frames[id(m)][:first], *_segments(frames[id(m)][first:], first)] for m in messages.values()]
        peers = list(messages)
        for pieces in itertools.zip_longest(*queues):  # first pieces of every peer first, then the tails
            for peer, piece in zip(peers, pieces, strict=True):
                if piece is not None:
                    sends.append(dist.isend(piece, self._global(peer), self.group))
        received, tails = {}, []
        for p in sources:
            head_works[p].wait()
            length = int(heads[p][:HEADER_BYTES].view(torch.int64))
            if HEADER_BYTES + length <= first:
                received[p] = heads[p][HEADER_BYTES: HEADER_BYTES + length]
                continue
            frame = torch.empty(HEADER_BYTES + length, dtype=torch.uint8)
            frame[:first] = heads[p]
            tails += [dist.irecv(piece, self._global(p), self.group) for piece in _segments(frame[first:], first)]
            received[p] = frame[HEADER_BYTES:]
        for work in tails + sends:
            work.wait()
        return received

    def _exchange_sized_first(self, messages: dict[int, Message], sources: list[int],
                              device: torch.device) -> dict[int, torch.Tensor]:
        lengths = {p: torch.tensor([m.payload.numel()], dtype=torch.int64, device=device) for p, m in messages.items()}
        heard = {p: torch.empty(1, dtype=torch.int64, device=device) for p in sources}
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for p, t in lengths.items()]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in heard.items()]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        received = {p: torch.empty(int(t), dtype=torch.uint8, device=device) for p, t in heard.items()}
        ops = [dist.P2POp(dist.isend, m.payload, self._global(p), self.group) for p, m in messages.items() if m.payload.numel()]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for p, t in received.items() if t.numel()]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return received

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int) -> Pending:
        """Swap with one peer: ``send`` goes to ``peer`` while ``recv`` fills from it (both ways at once)."""
        sent, got = send.numel() * send.element_size(), recv.numel() * recv.element_size()
        if self.segment_bytes is None:
            launch = lambda: dist.batch_isend_irecv([  # noqa: E731
                dist.P2POp(dist.isend, send, self._global(peer), self.group),
                dist.P2POp(dist.irecv, recv, self._global(peer), self.group)])
        else:
            launch = lambda: self._exchange([(peer, send)], [(peer, recv)])  # noqa: E731
        return self._issue("sendrecv", sent, got, launch, recv)

    def send(self, tensor: torch.Tensor, dst: int) -> Pending:
        nbytes = tensor.numel() * tensor.element_size()
        return self._issue("send", nbytes, 0, lambda: dist.isend(tensor, self._global(dst), group=self.group))

    def recv(self, tensor: torch.Tensor, src: int) -> Pending:
        nbytes = tensor.numel() * tensor.element_size()
        return self._issue(
            "recv", 0, nbytes, lambda: dist.irecv(tensor, self._global(src), group=self.group), tensor
        )
