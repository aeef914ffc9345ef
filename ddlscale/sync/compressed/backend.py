"""``sync=compress``: gradient compression with error feedback through any aggregation scheme.

Gradients are gathered into groups — one per tensor by default (``fusion: tensor``), DDP's buckets
(``fusion: bucket``) or a plan's fusion groups — each a flat buffer scaled by 1/n as dense allreduce
does. As soon as a group is complete (launching strictly in backward order, the same on every rank)
its buffer is compensated by the error-feedback memory, compressed and its first collective
issued, overlapping the rest of backward; after backward each scheme completes, the memory keeps
what compression lost, and the averaged gradients are written back.

Hierarchical groups reduce densely inside each machine first (reduce-scatter over the machine's
ranks), run the scheme across machines on this rank's chunk, then allgather inside the machine. A
compressor of matrices (PowerSGD) cannot take a chunk that cuts rows: there the machine's ranks
allreduce the group, its first rank (the leader) runs the scheme across machines on the whole
matrices, and broadcasts the result inside the machine.

Error feedback: ``memory`` (null: the compressor's default — residual for a biased compressor, none
for an unbiased one) keeps, per group, the compensated tensor minus this rank's share of the
scheme's result, so the second compression an owner applies in alltoall and gather is fed back too.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ddlscale.comm import Pending
from ddlscale.compress.compressor import Compressor, Segment, pieces
from ddlscale.compress.memory import MEMORIES, DecayedMemory, Memory
from ddlscale.compress.none import NoCompression
from ddlscale.compress.signsgd import SignSGD
from ddlscale.plan.choices import Choices, TensorChoice
from ddlscale.sync.compressed.compress_config import CompressConfig
from ddlscale.sync.compressed.regroup import GroupLayout, load_summed_share, regroup
from ddlscale.sync.compressed.schemes import SCHEMES, GroupWork, Job, scheme, timed_work
from ddlscale.sync.dense import DenseAllreduce

FLAT, CHUNK, LEADER = "flat", "chunk", "leader"  # how a group runs: whole, a machine's chunk, or at its leader


@dataclass
class _Flight:
    """A launched group: its job, its scheme and what error feedback needs at the end — or, for a
    group on dense allreduce's own path, only its pending allreduce. A leader group's other ranks
    have no job (they receive the result from the leader)."""

    job: Job | None
    scheme: Any
    compensated: torch.Tensor | None
    key: str
    layout: str
    pending: Pending | None = None
    work: GroupWork | None = None  # when CompressSync.work is a list


def feedback_refusal(compressor: Compressor | None, memory: Memory) -> str | None:
    """Why error feedback cannot be exact for this compressor (None when it can): a majority vote is
    not the sum of what the ranks sent, so no residual accounts for the difference (measured: an
    identity error of 4.99 on gradients of at most 0.032 with scaled signs)."""
    if compressor is None or memory.name == "none":
        return None
    if compressor.votes:
        return (f"memory={memory.name} with compressor={compressor.name} compressor.vote=true: the majority vote is "
                f"not the sum of what the ranks sent, so error feedback cannot account for what it drops. Use "
                f"memory=none (signSGD, Signum), or compressor=efsignsgd (scaled signs summed, compressor.vote=false).")
    return None


def feedback_warning(compressor: Compressor | None, memory: Memory) -> str | None:
    """Why error feedback would hurt this compressor (None when it would not): it needs a
    contraction, and a residual of an estimate scaled up, or of an unscaled sign, grows instead."""
    if compressor is None or memory.name == "none":
        return None
    if compressor.name == "randomk" and compressor.unbiased:
        return ("compressor=randomk with unbiased=true under error feedback: error feedback needs a contractive "
                "compressor, and random-k scaled by numel/k is not — its residual grows until the loss is NaN "
                "(measured on cnn and lstm). Set compressor.unbiased=false or memory=none.")
    if isinstance(compressor, SignSGD) and not compressor.scaled:
        return (f"compressor={compressor.name} sends unscaled signs (+-1 whatever the gradient's scale) under error "
                f"feedback: the residual g - sign(g) is of the order of 1 and grows instead of shrinking. Use "
                f"memory=none, or compressor=efsignsgd (scaled signs with error feedback).")
    return None


class CompressSync(DenseAllreduce):
    """``sync=compress``. Args:

    compressor: the compressor (``compressor=`` config group), ``None`` for none.
    comm: the aggregation scheme — allreduce, allgather, alltoall, gather, zen (sparsifiers: Zen's push / pull).
    memory: error feedback (``memory=`` config group) — a :class:`Memory`, or its name:
        ``residual`` (true EF), ``none``, ``decayed`` (with ``memory_beta``); ``None``: the
        compressor's default (:attr:`~ddlscale.compress.Compressor.default_memory`: residual for a
        biased compressor, none for an unbiased one). :attr:`memory_default` says which it was.
    hierarchical: dense inside a machine, compressed across machines; ``local_size`` ranks per
        machine (``None``: ``LOCAL_WORLD_SIZE``).
    fusion: ``tensor`` (compress each tensor alone) or ``bucket`` (DDP's buckets, ``bucket_mb``).
    choices: :class:`Choices` overriding the uniform choice per tensor, and the fusion groups.
    """

    schema = CompressConfig  # its keys and their checks
    needs_compressor = True  # sync=compress without one would be dense allreduce, mislabelled

    def __init__(self, compressor: Compressor | None = None, comm: str = "allgather", memory: Memory | str | None = None,
                 memory_beta: float = 0.9, hierarchical: bool = False, local_size: int | None = None,
                 fusion: str = "tensor", choices: Choices | None = None, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0):
        super().__init__(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        self.memory_default = memory is None
        if memory is None:
            memory = (compressor or NoCompression()).default_memory
        CompressConfig(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, comm=comm,
                       memory=memory if isinstance(memory, str) else None, memory_beta=memory_beta,
                       hierarchical=hierarchical, local_size=local_size, fusion=fusion)
        self.compressors: dict[str, Compressor] = {"none": NoCompression(), "default": compressor or NoCompression()}
        if isinstance(memory, str):
            memory = DecayedMemory(memory_beta) if memory == "decayed" else MEMORIES[memory]()
        refusal = feedback_refusal(compressor, memory)
        if refusal:
            raise ValueError(refusal)
        warning = feedback_warning(compressor, memory)
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=2)
        self.memory = memory
        self.fusion, self.local_size = fusion, local_size
        self.choices = choices or Choices(default=TensorChoice("default", comm, bool(hierarchical)))
        # When a list: every launched group's compressor work, as the planners' profile benchmarks
        # it, measured in training instead (one GroupWork per group and step).
        self.work: list[GroupWork] | None = None
        # The groups the error feedback and compressor state are laid out in now (each on_setup
        # re-lays it out from these into the new groups).
        self.state_layouts: dict[str, GroupLayout] = {}
        for name, choice in [("default", self.choices.default), *self.choices.tensors.items()]:
            self.check_choice(choice, "sync.comm" if name == "default" else f"plan[{name}]")

    def check_choice(self, choice: TensorChoice, key: str) -> None:
        if choice.compressor not in self.compressors:
            raise ValueError(f"{key}: unknown compressor {choice.compressor!r} ({', '.join(self.compressors)})")
        if choice.scheme not in SCHEMES:
            raise ValueError(f"{key}: scheme must be one of {', '.join(SCHEMES)}; got {choice.scheme!r}")
        scheme(choice.scheme).check(self.compressors[choice.compressor], key)

    # -- set-up ----------------------------------------------------------------------------------
    def on_setup(self) -> None:
        if not hasattr(self, "intra"):
            self.intra = self.inter = None
            if self.world_size > 1 and any(c.hierarchical for c in [self.choices.default, *self.choices.tensors.values()]):
                self.local_size, self.intra, self.inter = self.machine_communicators(self.local_size)
        super().on_setup()
        self._flights: list[_Flight | None] = [None] * len(self.buckets)
        self._group_choices = [self.choices.for_group([self.names[i] for i in b.members]) for b in self.buckets]
        before, self.state_layouts = self.state_layouts, self._layouts()
        regroup(self._group_states(), before, self.state_layouts, lambda flat: self.intra.allreduce(flat).wait())

    def _group_states(self) -> list[dict[str, torch.Tensor]]:
        """The per-group state of the memory and the compressors, each owner once."""
        owners = {id(o): o for o in [self.memory, *self.compressors.values()]}.values()
        return [state for owner in owners for state in owner.group_states()]

    def _hierarchical(self, b: int) -> bool:
        return self._group_choices[b].hierarchical and self.intra is not None

    def _layout(self, b: int) -> str:
        """How group ``b`` runs: flat (the whole buffer across every rank), as this rank's chunk of
        its machine's sum, or — for a compressor of matrices — whole at its machine's leader."""
        if not self._hierarchical(b):
            return FLAT
        return LEADER if self.compressors[self._group_choices[b].compressor].needs_matrices else CHUNK

    def _key(self, b: int) -> str:
        """Group ``b``'s name in the memory and the compressors; a hierarchical group's state is
        this rank's chunk (or, at a leader, its machine's whole buffer), so it is named apart from
        the same members' flat state."""
        key = "+".join(self.names[i] for i in self.buckets[b].members)
        return key if self._layout(b) == FLAT else f"{key}@machine"

    def _layouts(self) -> dict[str, GroupLayout]:
        machine = (self.intra.rank, self.local_size) if self.intra is not None else None
        return {self._key(b): GroupLayout(tuple((self.names[i], self.params[i].numel()) for i in bucket.members),
                                          None if self._layout(b) == FLAT else machine, self._layout(b) == LEADER)
                for b, bucket in enumerate(self.buckets)}

    def per_tensor_layouts(self) -> dict[str, GroupLayout]:
        """Every tensor a flat group of its own: how state waits while no groups of this sync run."""
        return {name: GroupLayout(((name, p.numel()),)) for name, p in zip(self.names, self.params, strict=True)}

    def _segments(self, b: int) -> list[Segment]:
        """Group ``b``'s members with their matrix rows, in buffer order."""
        return [Segment.of(self.params[i].shape) for i in self.buckets[b].members]

    def _assign(self, order: list[int]) -> list[list[int]]:
        restored = getattr(self, "_restored_groups", None)
        if restored is not None and restored[0] is self.choices:  # the layout the state was saved in
            return [list(g) for g in restored[1]]
        if self.choices.groups is not None:
            return self._plan_groups(order)
        if self.fusion == "tensor":
            return [[i] for i in order]
        return super()._assign(order)

    def _plan_groups(self, order: list[int]) -> list[list[int]]:
        """The plan's fusion groups as indices, launched in the order their first member is ready."""
        position = {i: k for k, i in enumerate(order)}
        groups = [[self.names.index(name) for name in names] for names in self.choices.groups]
        covered = sorted(i for g in groups for i in g)
        if covered != list(range(len(self.params))):
            raise ValueError("plan.groups must name every parameter exactly once")
        for g in groups:
            if len({self.params[i].dtype for i in g}) > 1:
                raise ValueError(f"plan.groups: {[self.names[i] for i in g]} mix dtypes")
        groups = [sorted(g, key=position.get) for g in groups]
        return sorted(groups, key=lambda g: position[g[-1]])

    # -- per step ----------------------------------------------------------------------------------
    def _launch_full_buckets(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self._next_launch
            bucket = self.buckets[b]
            if len(bucket.filled) < len(bucket.members):
                return
            self._flights[b] = self._start(b)
            bucket.pending = True  # marks "launched" for DenseAllreduce's double-ready check
            self._next_launch += 1

    def _dense_path(self, b: int, key: str) -> bool:
        """Whether group ``b`` is plain allreduce of what it holds: no compression, flat, a dtype error
        feedback would not widen, no residual left to add. It then runs exactly as DenseAllreduce
        does — in place in the bucket — instead of paying for a copy, a residual of zeros and a copy
        back (measured: +15% step time on the cnn for a plan that compresses nothing)."""
        choice, buffer = self._group_choices[b], self.buckets[b].buffer
        return (isinstance(self.compressors[choice.compressor], NoCompression) and choice.scheme == "allreduce"
                and not self._hierarchical(b)
                and buffer.dtype in (torch.float32, torch.float64) and self.memory.residual(key) is None)

    def _start(self, b: int) -> _Flight:
        bucket, choice = self.buckets[b], self._group_choices[b]
        key, layout = self._key(b), self._layout(b)
        work = None if self.work is None else GroupWork()
        if work is not None:
            self.work.append(work)
        if self._dense_path(b, key):
            if self.compressors["default"].prepares_dense:
                with self.timed("encode"), timed_work(work, "encode"):
                    bucket.buffer.copy_(self.dense_precondition(bucket.buffer, key))
            return _Flight(None, None, None, key, FLAT, self.comm.allreduce(bucket.buffer), work)
        compressor = self.compressors[choice.compressor]
        comm, tensor, segments = self.comm, bucket.buffer, self._segments(b)
        with self.timed("encode"):
            if layout == CHUNK:
                k = self.local_size
                size = math.ceil(tensor.numel() / k)
                padded = tensor.new_zeros(size * k)
                padded[: tensor.numel()] = tensor
                chunk = tensor.new_empty(size)
                self.intra.reduce_scatter(chunk, padded).wait()
                mine = min(size, max(0, tensor.numel() - self.intra.rank * size))  # the padding is no gradient
                comm, tensor = self.inter, chunk[:mine]
                segments = pieces(segments, [mine], self.intra.rank * size)[0]
            elif layout == LEADER:
                self.intra.allreduce(tensor).wait()  # every rank of the machine holds its sum
                comm = self.inter
                if self.intra.rank != 0:
                    # Only the leader runs the scheme; the others keep an empty residual under the
                    # group's name, so a regrouping finds the same names on every rank.
                    self.memory.update(key, self.memory.compensate(tensor[:0], key), tensor[:0])
                    return _Flight(None, None, None, key, layout, None, work)
            with timed_work(work, "encode"):  # the compressor's preparation and error feedback: part of encode
                if isinstance(compressor, NoCompression):
                    tensor = self.dense_precondition(tensor, key)
                else:
                    tensor = compressor.precondition(tensor, key, segments, comm.size)
                compensated = self.memory.compensate(tensor, key)
            # Its tensors by name (a machine's leader: apart from their flat state, as the key is).
            suffix = "" if layout == FLAT else "@machine"
            job = Job(comm, compressor, compensated.reshape(-1), key, segments, work=work,
                      feedback=self.memory.name != "none",
                      members=tuple(self.names[i] + suffix for i in bucket.members))
            chosen = scheme(choice.scheme)
            with compressor.agreed(job.tensor, comm, segments):
                chosen.start(job)
        return _Flight(job, chosen, compensated, key, layout, work=work)

    def dense_precondition(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """What a group sent uncompressed (a plan's dense group) gets before error feedback: the
        configured compressor's :meth:`~ddlscale.compress.Compressor.precondition_dense` (DGC: the
        optimizer's momentum it took over), so that such a tensor trains as it would uncompressed."""
        return self.compressors["default"].precondition_dense(tensor, key)

    def finish(self) -> None:
        for bucket in self.buckets[self._next_launch:]:  # no gradient this step: zeros, on every rank
            for slot, i in enumerate(bucket.members):
                if i not in bucket.filled:
                    bucket.views[slot].zero_()
                    bucket.filled.add(i)
        self._launch_full_buckets()
        together: dict[type, list[Job]] = {}  # per scheme, its jobs in group order
        for flight in self._flights:
            if flight is not None and flight.job is not None:
                together.setdefault(type(flight.scheme), []).append(flight.job)
        with self.timed("comm"):
            for kind, jobs in together.items():
                kind.finish_together(jobs)
        for b, bucket in enumerate(self.buckets):
            flight = self._flights[b]
            job, total = flight.job, None
            with self.timed("comm"), timed_work(flight.work, "finish"):
                if flight.pending is not None:
                    flight.pending.wait()  # dense allreduce's path: the sum is in the bucket already
                elif job is not None:
                    total = flight.scheme.finish(job)
                if flight.layout == CHUNK:
                    gathered = self.intra.allgather(_padded(total, math.ceil(bucket.buffer.numel() / self.local_size),
                                                            bucket.buffer.dtype)).wait()
                    total = torch.cat(gathered)
                elif flight.layout == LEADER:
                    if job is not None:
                        bucket.buffer.copy_(total)
                    self.intra.broadcast(bucket.buffer, src=0).wait()
                    total = None
            with self.timed("decode"):
                if job is not None:
                    with timed_work(job.work, "encode"):
                        if isinstance(job.compressor, NoCompression):
                            self.memory.forget(flight.key)  # sent whole: no error, and the dense path is open again
                        else:
                            self.memory.update(flight.key, flight.compensated, job.shared.reshape(flight.compensated.shape))
                            job.compressor.sent(flight.key, job.local)
                if total is not None:
                    bucket.buffer.copy_(total[: bucket.buffer.numel()])
                for slot, i in enumerate(bucket.members):
                    self._write_grad(i, bucket.views[slot])
            bucket.filled.clear()
            bucket.pending = None
            self._flights[b] = None
        self._next_launch = 0
        self._was_sparse.clear()

    def default_compressor(self) -> Compressor:
        return self.compressors["default"]

    def summary_fields(self) -> dict[str, Any]:
        return {"memory": self.memory.name, "memory_default": self.memory_default}

    # -- checkpointed state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Residuals and factors are keyed by group and laid out in its buffer: save the layout too.
        return {**super().state_dict(), **self.carried_state(), "groups": [list(b.members) for b in self.buckets]}

    def carried_state(self) -> dict[str, Any]:
        """The error feedback and compressor state, as a checkpoint keeps it (with the groups)."""
        return {"memory": self.memory.state_dict(),
                "compressors": {k: c.state_dict() for k, c in self.compressors.items()}}

    def load_carried(self, state: dict[str, Any]) -> None:
        """:meth:`carried_state` back, laid out in the groups ``state["groups"]`` lists: they are this
        sync's groups for the choices in force now; choices adopted later bring their own groups."""
        self.memory.load_state_dict(state["memory"])
        for k, c in self.compressors.items():
            c.load_state_dict(state["compressors"][k])
        self._restored_groups = (self.choices, [list(g) for g in state["groups"]])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_carried(state)
        super().load_state_dict(state)

    def merge_carried(self, states: list[dict[str, Any]], world_size: int) -> None:
        """This rank's share of the carried state of a run of ``len(states)`` ranks: error feedback
        and compressor memories summed over the saved ranks and shared out, total kept."""
        load_summed_share(self.memory, [s["memory"] for s in states], world_size)
        for k, c in self.compressors.items():
            load_summed_share(c, [s["compressors"][k] for s in states], world_size)
        chunked = sorted({key for state in self._group_states() for key in state if key.endswith("@machine")})
        if chunked:  # each rank's chunk of its machine's sum: summed position by position it is no total
            raise ValueError(f"the saved error feedback of hierarchical groups ({', '.join(chunked)}) cannot be "
                             f"resharded; resume at {len(states)} workers, or save from a run with "
                             "sync.hierarchical=false")
        self._restored_groups = (self.choices, [list(g) for g in states[0]["groups"]])

    def carry_per_tensor(self, states: list[dict[str, Any]], world_size: int) -> None:
        """:meth:`merge_carried`, then that state laid out per tensor (from the saved groups), to wait
        there until this sync builds groups: a planned sync resumed at another size profiles first."""
        self.merge_carried(states, world_size)
        self.wait_per_tensor({"+".join(self.names[i] for i in group):
                              GroupLayout(tuple((self.names[i], self.params[i].numel()) for i in group))
                              for group in states[0]["groups"]})

    def wait_per_tensor(self, saved: dict[str, GroupLayout]) -> None:
        """The loaded state, laid out in the groups ``saved``, re-laid out per tensor to wait there until
        this sync builds groups (the saved groups were another plan's, or calibration's)."""
        self._restored_groups = None
        self.state_layouts = self.per_tensor_layouts()
        regroup(self._group_states(), saved, self.state_layouts)

    def load_resharded(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        self.merge_carried(states, world_size)
        super().load_resharded(states, rank, world_size)


def _padded(chunk: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's result chunk at the machine's chunk length (the last ranks' chunks hold padding)."""
    out = chunk.new_zeros(size, dtype=dtype)
    out[: chunk.numel()] = chunk
    return out
