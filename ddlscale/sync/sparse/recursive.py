"""Recursive doubling with merging: SparCML's sparse allreduce and Zen's Hierarchical Centralization.

Stage i (i = 0 .. log2 p - 1): each rank swaps its partial sum (a set of units: rows or elements)
with rank ``r XOR 2^i`` and merges the two, so after stage i it holds the sum of its aligned group
of 2^(i+1) ranks and after log2 p stages the global sum. Stage i moves the merged non-zeros of 2^i workers, gamma_{2^i} d M of them:
the T_hc formula. When n is not a power of two, the ranks r >= p = 2^floor(log2 n) first fold their
vector into rank r - p and get the result back at the end (SparCML's reduction to a power of two).

SparCML's dense switch: once a partial sum is so full that (index, value) pairs outweigh the dense
vector (density past ``dense_threshold``), it travels dense from then on; merging anything with a
dense vector is dense.

Merges always add the lower group's vector first, so both partners compute the same bits and every
rank ends with an identical result.

Several sections (tensors of different unit widths and dtypes, and dense vectors carried beside
them) share one chain (:class:`SectionedDoubling`): a stage is one swap whatever the step holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddlscale.comm import Communicator
from ddlscale.comm.collectives import Message
from ddlscale.sync.sparse import kernels
from ddlscale.sync.sparse.pushpull import INDEX_BYTES, pack_rows, unpack_rows
from ddlscale.sync.sparse.sections import frame, unframe


def break_even_density(unit_bytes: int) -> float:
    """Density where an (int32 index, unit) list weighs as much as the dense vector of units."""
    return unit_bytes / (INDEX_BYTES + unit_bytes)


def doubling(comm: Communicator, part, swap: Callable, send: Callable, recv: Callable, merge: Callable,
             on_stage: Callable[[int, object], None] | None = None):
    """Drive recursive doubling over ``comm``'s ranks for any representation of a partial result.

    ``swap(part, peer)`` exchanges with a peer and returns theirs; ``send(part, peer)`` and
    ``recv(peer)`` move one way (the fold of extra ranks); ``merge(lower, upper)`` combines two
    groups' partials, lower group first. ``on_stage(i, part)`` sees the partial after stage i.
    """
    rank, n = comm.rank, comm.size
    p = 1 << (n.bit_length() - 1)
    if rank >= p:  # an extra rank: fold in, then wait for the result
        send(part, rank - p)
        return recv(rank - p)
    if rank + p < n:
        part = merge(part, recv(rank + p))
    for i in range(p.bit_length() - 1):
        peer = rank ^ (1 << i)
        theirs = swap(part, peer)
        part = merge(part, theirs) if rank < peer else merge(theirs, part)
        if on_stage is not None:
            on_stage(i, part)
    if rank + p < n:
        send(part, rank + p)
    return part


@dataclass
class Partial:
    """A partial sum of units: sorted distinct ``indices`` with rows ``values`` (k, width), or, with
    ``indices`` None, every unit's row (units, width): the dense form."""

    indices: torch.Tensor | None
    values: torch.Tensor

    @property
    def is_dense(self) -> bool:
        return self.indices is None


@dataclass(frozen=True)
class Section:
    """One section of a doubling: ``units`` units of ``width`` values of ``dtype``; a sparse partial
    travels dense once more than ``dense_threshold`` of its units are in it (None: never)."""

    units: int
    width: int
    dtype: torch.dtype
    dense_threshold: float | None = None


class SectionedDoubling:
    """Sum several sections' partials by recursive doubling, in one chain: each stage's swap carries
    every section (one message: one section as it is, several framed as :mod:`.sections` frames a
    batch's pieces), and each section merges on its own. So tensors of any width and dtype, and
    dense vectors beside row sets, pay log2 n swaps a step together, not log2 n each.

    A section's partial is a row set (:class:`Partial` with indices) or dense from the start (a dense
    tensor carried index-free: every stage moves and adds the whole vector). Merging two row sets is
    one linear pass over their sorted indices (:func:`kernels.merge_rows`). ``timed(phase)``, a context
    manager such as ``GradSync.timed``, splits the time into "comm" (swaps) and "decode" (merges).
    """

    def __init__(self, comm: Communicator, sections: list[Section],
                 timed: Callable[[str], contextlib.AbstractContextManager] | None = None):
        self.comm, self.sections = comm, sections
        self.timed = timed or (lambda phase: contextlib.nullcontext())

    def run(self, parts: list[Partial]) -> list[Partial]:
        """Every section's global sum, in every rank's hands alike (a sparse one with ascending ids)."""
        self.device = parts[0].values.device
        ready = []
        for k, part in enumerate(parts):
            if not part.is_dense and part.indices.numel() > 1 and not bool((part.indices[1:] > part.indices[:-1]).all()):
                indices, order = torch.sort(part.indices)
                part = Partial(indices, part.values[order])
            ready.append(self._maybe_dense(k, part))
        return doubling(self.comm, ready, self._swap, self._send, self._recv, self._merge)

    # -- the wire: a row set (pushpull's format) or, flagged by a count of -1, every unit's row --
    def _message(self, parts: list[Partial]) -> Message:
        if len(parts) == 1:
            return self._section_message(parts[0])
        return frame([self._section_message(part).payload for part in parts], self.device)

    def _section_message(self, part: Partial) -> Message:
        if not part.is_dense:
            return pack_rows(part.indices, part.values)
        message = Message(8 + part.values.numel() * part.values.element_size(), part.values.device)
        message.payload[:8].copy_(torch.tensor([-1], dtype=torch.int64).view(torch.uint8))
        message.payload[8:].view(part.values.dtype).copy_(part.values.reshape(-1))
        return message

    def _decode(self, payload: torch.Tensor) -> list[Partial]:
        pieces = [payload] if len(self.sections) == 1 else unframe(payload, len(self.sections))
        return [self._decode_section(section, piece) for section, piece in zip(self.sections, pieces, strict=True)]

    @staticmethod
    def _decode_section(section: Section, payload: torch.Tensor) -> Partial:
        if int(payload[:8].view(torch.int64)) < 0:
            return Partial(None, payload[8:].view(section.dtype).view(section.units, section.width))
        return Partial(*unpack_rows(payload, section.width, section.dtype))

    def _swap(self, parts: list[Partial], peer: int) -> list[Partial]:
        with self.timed("comm"):
            received = self.comm.exchange({peer: self._message(parts)}, [peer], op="swap")
        return self._decode(received[peer])

    def _send(self, parts: list[Partial], peer: int) -> None:
        with self.timed("comm"):
            self.comm.exchange({peer: self._message(parts)}, [], op="send")

    def _recv(self, peer: int) -> list[Partial]:
        with self.timed("comm"):
            received = self.comm.exchange({}, [peer], op="recv", device=self.device)
        return self._decode(received[peer])

    # -- merging ---------------------------------------------------------------------------------
    def _merge(self, lower: list[Partial], upper: list[Partial]) -> list[Partial]:
        with self.timed("decode"):
            return [self._merged(k, a, b) for k, (a, b) in enumerate(zip(lower, upper, strict=True))]

    def _merged(self, k: int, lower: Partial, upper: Partial) -> Partial:
        if lower.is_dense or upper.is_dense:
            total = self._densify(k, lower)
            if upper.is_dense:
                total += upper.values
            else:
                total.index_add_(0, upper.indices, upper.values)
            return Partial(None, total)
        indices, values = kernels.merge_rows(lower.indices, lower.values, upper.indices, upper.values)
        keep = (values != 0).any(dim=1)  # NaN != 0: NaN is kept
        if not bool(keep.all()):
            indices, values = indices[keep], values[keep]
        return self._maybe_dense(k, Partial(indices, values))

    def _densify(self, k: int, part: Partial) -> torch.Tensor:
        if part.is_dense:
            return part.values.clone()
        section = self.sections[k]
        dense = torch.zeros((section.units, section.width), dtype=section.dtype, device=part.values.device)
        dense[part.indices] = part.values
        return dense

    def _maybe_dense(self, k: int, part: Partial) -> Partial:
        threshold = self.sections[k].dense_threshold
        if threshold is not None and not part.is_dense and part.indices.numel() > threshold * self.sections[k].units:
            return Partial(None, self._densify(k, part))
        return part


class SparseDoubling:
    """Sum one row set over ``units`` units by recursive doubling (SparCML; Zen's HC for one section);
    ``dense_threshold=None`` never switches. Each stage is one message each way (the set's own length
    travels in front, see :meth:`Communicator.exchange`)."""

    def __init__(self, comm: Communicator, units: int, width: int, dtype: torch.dtype,
                 dense_threshold: float | None, timed: Callable[[str], contextlib.AbstractContextManager] | None = None):
        self.chain = SectionedDoubling(comm, [Section(units, width, dtype, dense_threshold)], timed)

    def run(self, indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The global sum as (ascending ids, rows); units that cancel to zero are dropped."""
        total, = self.chain.run([Partial(indices, values)])
        if total.is_dense:
            nonzero = (total.values != 0).any(dim=1).nonzero().reshape(-1)  # NaN counts as non-zero
            return nonzero, total.values[nonzero]
        return total.indices, total.values


def union_counts(comm: Communicator, id_sets: list[torch.Tensor]) -> list[list[int]]:
    """Profile densification: merge non-zero index sets up the doubling stages.

    ``id_sets``: this rank's sorted distinct unit ids of several tensors. Returns, per stage i, the
    size per tensor of the union over this rank's aligned group of 2^(i+1) ranks (the units HC's
    stage i+1 sends). The sets travel as they are, so time and memory follow the non-zeros, never
    the tables' sizes. ``comm.size`` must be a power of two.
    """
    if comm.size & (comm.size - 1):
        raise ValueError(f"union_counts needs a power-of-two group, got {comm.size} ranks")
    counts: list[list[int]] = []

    def swap(sets: list[torch.Tensor], peer: int) -> list[torch.Tensor]:
        sizes = torch.tensor([s.numel() for s in sets], dtype=torch.int64)
        message = Message.of(torch.cat([sizes, *sets]))
        payload = comm.exchange({peer: message}, [peer], op="profile")[peer].view(torch.int64)
        theirs = payload[len(sets):]
        return list(torch.split(theirs, payload[: len(sets)].tolist()))

    def merge(lower: list[torch.Tensor], upper: list[torch.Tensor]) -> list[torch.Tensor]:
        return [kernels.merge_rows(a, torch.empty((a.numel(), 0)), b, torch.empty((b.numel(), 0)))[0]
                for a, b in zip(lower, upper, strict=True)]

    def count(_: int, sets: list[torch.Tensor]) -> None:
        counts.append([s.numel() for s in sets])

    doubling(comm, [s.to(torch.int64) for s in id_sets], swap, None, None, merge, on_stage=count)
    return counts
