"""Pricing a plan's options: the cost of one way to synchronize one tensor (or fused group), an
:class:`Option` made a TensorTask.

An option is {compressor (``none`` or the configured one), aggregation scheme, flat or hierarchical,
compression device}. Its times come from three sources and nowhere else: the compressor's
``payload_bytes`` for what travels, the :class:`~ddlscale.comm.network.NetworkModel` for how long the
collectives take, and the profiled encode/decode fits. :meth:`CostModel.task` turns (unit, option)
into the :class:`~ddlscale.comm.timeline.TensorTask` the iteration simulator schedules, so Espresso
and Cupcake score plans with one model.

The collectives are those :class:`~ddlscale.sync.compressed.CompressSync` issues (SYSTEMS.md §2), each
priced by its scheme's :class:`~ddlscale.plan.aggregation.Aggregation`:

- ``allreduce`` (summable payloads): encode, allreduce the payload, decode once;
- ``allgather``: encode (plus the local decode error feedback needs), exchange sizes, allgather the
  packed payloads, decode and sum all n;
- ``alltoall``: encode each of the n partitions, all-to-all them (after their sizes), then the owner
  decodes n pieces, re-encodes the sum, every rank allgathers the n sums and decodes them — the
  re-encode and the second collective run after backward, so they are charged to decode and comm;
- ``gather``: encode, gather to rank 0, which decodes n payloads, re-encodes the sum and
  broadcasts it (sizes first); everyone decodes — rank 0's path is the critical one;
- the size exchange before an uneven allgather / all-to-all / gather *blocks* the training thread
  while the group is launched (CompressSync waits for it inside the gradient hook), so it is
  charged to encode, on the compute stream, not to the asynchronous communication;
- hierarchical: a dense reduce-scatter among a machine's k ranks (blocking, so charged to encode),
  the scheme across the m machines on a 1/k chunk with the NIC shared by the k concurrent inter
  groups, and an allgather inside the machine after backward (charged to decode).

Beyond the fits and the network, each option family (compressor x scheme x layout) carries what
calibration measured it to cost in compressed training steps (:attr:`Profile.families`): ``cpu_s``
per group and ``cpu_per_element_s`` per element of the group on the training thread (charged to
encode; either may be negative where the model over-prices the family, and a group's encode is
never below zero in total), and ``lag_s`` / ``fused_lag_s``, the slowest rank's lag under it in
layer-wise and in fused steps (the task's lag: a group of one tensor takes the first, a fused group
the second), in place of the one lag profiled under dense sync.

Three schemes run otherwise than their plain collective, and are priced as they run:

- ``zen`` under CompressSync batches all of a step's zen groups of one communicator into one push
  and one pull (``ZenPushPull.finish_together``): a group's exchanges are priced without their
  per-message latency, and the two rounds' latency is a fixed cost per step and layout
  (:meth:`CostModel.fixed_s`) that the planners add once where a plan holds zen; the exchanges
  block, so they run after backward: a zen group's collective waits for backward end (its lag);
- ``allreduce`` of a cast narrower than the gradient (fp16/bf16 of float32) under error feedback
  sums at the partitions' owners in float32 (``Allreduce.rounds``): priced as ``alltoall``;
- TernGrad with ``shared_scale`` agrees on the ranks' largest scalar by a blocking max-allreduce
  of 4 bytes per group before it compresses: charged to encode;
- PowerSGD (``allreduce`` only: its factors sum) runs its whole power iteration in the scheme's
  ``finish``, after backward (``Allreduce.finish``: P = M Q, an allreduce of P, orthogonalize,
  Q = M^T P, an allreduce of Q): its collectives wait for backward end as zen's do, its payload is
  the factors of each member matrix (the tensors' ``kept`` fraction, from their shapes) in two
  allreduces, and a hierarchical group runs whole at each machine's first rank (a machine
  allreduce, PowerSGD across the machines' leaders on a NIC each, a broadcast inside the machine).

"Encode" and "decode" are the profiled per-group work of the executor (error feedback, compress,
pack / unpack, decompress, sum), ``none`` included where it is not free (hierarchical: error
feedback on the reduced chunk); a flat uncompressed group runs as dense allreduce does, in place.

Device: ``compute`` runs encode/decode on the training stream (TensorTask.encode_on_compute: GPU
compression that delays backward; on a CPU-only host, the training thread, which is what
CompressSync does); ``side`` on a second stream (the CPU beside a GPU, or a helper thread) with the
side fits. Where only a CPU exists, the side device is a model: CompressSync runs every encode on
the training thread, so the plan says so when it offloads.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.comm.timeline import TensorTask
from ddlscale.compress import Compressor
from ddlscale.plan.aggregation import AGGREGATIONS, SCHEMES, Pricing
from ddlscale.plan.choices import TensorChoice
from ddlscale.plan.fit import CostFit
from ddlscale.plan.profile import Profile, family
from ddlscale.units import parse_time

DEVICES = ("compute", "side")


@dataclass(frozen=True, order=True)
class Option:
    """One way to synchronize a unit. ``compressor`` is a CompressSync key: ``none`` or ``default``."""

    compressor: str
    scheme: str
    hierarchical: bool = False
    device: str = "compute"

    @property
    def compressed(self) -> bool:
        return self.compressor != "none"

    def label(self, names: dict[str, str] | None = None) -> str:
        comp = (names or {}).get(self.compressor, self.compressor)
        text = f"{comp}/{self.scheme}" + ("/hier" if self.hierarchical else "")
        return text + ("@side" if self.device == "side" and self.compressed else "")

    def tensor_choice(self) -> TensorChoice:
        return TensorChoice(self.compressor, self.scheme, self.hierarchical)

    def on(self, device: str) -> Option:
        return replace(self, device=device)

    @property
    def family(self) -> str:
        """Its key in :attr:`Profile.families` (the device is not part of it)."""
        return family(self.compressor, self.scheme, self.hierarchical)


DENSE = Option("none", "allreduce")
_FREE = CostFit()


@dataclass(frozen=True)
class Unit:
    """A tensor or a fused group of consecutive tensors, as the planner sees it."""

    names: tuple[str, ...]
    numel: int
    dtype: str
    ready_s: float  # of its last member: a group is complete when its last gradient is
    shape: tuple[int, ...] | None = None  # a single tensor's shape (PowerSGD compresses matrices)
    kept: dict[str, float] = field(default_factory=dict)  # per compressor key: fraction kept
    members: int = 0  # the tensors it holds where ``names`` is left out (Cupcake's DP prices unnamed groups)

    @property
    def tensors(self) -> int:
        """How many tensors it holds: a per-member compressor pays per tensor of a fused buffer."""
        return self.members or len(self.names)

    @property
    def label(self) -> str:
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]} ({len(self.names)})"


class CostModel:
    """Times of every option for every unit on one cluster.

    Args:
        profile: the measured profile (compressor fits, ready times).
        compressors: the compressor objects by key (for ``payload_bytes`` and ``summable``).
        world_size: ranks (default: the profile's).
        network: the cluster (default: from the profile's ``network`` entry).
    """

    def __init__(self, profile: Profile, compressors: dict[str, Compressor], world_size: int | None = None,
                 network: NetworkModel | None = None):
        self.profile = profile
        self.compressors = dict(compressors)
        if set(profile.compressors) != set(self.compressors):
            raise ValueError(f"compressor objects {sorted(self.compressors)} do not match the profiled "
                             f"compressors {sorted(profile.compressors)}")
        self.n = world_size or profile.world_size
        net = profile.network
        self.network = network or NetworkModel.of(net.get("bandwidth", "1gbit"), net.get("latency", "100us"),
                                                  int(net.get("gpus_per_machine", 1)),
                                                  efficiency=net.get("efficiency"))
        self.k = min(self.network.gpus_per_machine, self.n)
        # Hierarchical: k inter-machine groups run at once, one per local rank: each gets 1/k of the NIC.
        self.across = NetworkModel(self.network.bandwidth_bps / self.k, self.network.latency_s, 1,
                                   efficiency=self.network.efficiency)
        # A machine's leader alone across machines (PowerSGD's hierarchical groups): the whole NIC.
        self.leaders = replace(self.across, bandwidth_bps=self.network.bandwidth_bps)
        # Allgather and the other exchanges may pay another per-message latency than allreduce does
        # (a measured profile has both: sync.network_latency=measured).
        exchange = parse_time(net["exchange_latency"]) if "exchange_latency" in net else self.network.latency_s
        self.exchange, self.exchange_across = (replace(m, latency_s=exchange) for m in (self.network, self.across))
        self._cache: dict[tuple, tuple[float, float, float]] = {}
        self.beside = False  # priced for a plan that compresses: uncompressed groups pay beside_compression_s

    def beside_compression(self) -> CostModel:
        """This model for plans that compress any group: each uncompressed group (flat or
        hierarchical) also pays what calibration measured a dense group to cost beside compressed
        ones (``none/allreduce``'s ``beside_compression_s``, after backward, on the training thread).
        Measured on the emulated cluster: in a plan that compressed the embeddings, each small dense
        allreduce still had 3-6 ms to wait for at the step's end, where alone they cost well under a
        millisecond — compression on the training threads holds up the other ranks' part of them; a
        hierarchical dense group waited about as long (its three collectives meet the same late
        ranks once), so it pays the same per group. A plan that compresses nothing is priced by the
        plain model (:meth:`plainly`)."""
        return self._beside(True)

    def plainly(self) -> CostModel:
        """This model with uncompressed groups priced as they run alone (the plain model)."""
        return self._beside(False)

    def _beside(self, beside: bool) -> CostModel:
        if self.beside == beside:
            return self
        other = copy.copy(self)
        other._cache, other.beside = {}, beside
        return other

    # -- the option space ------------------------------------------------------------------------
    @property
    def hierarchical_possible(self) -> bool:
        return 1 < self.k < self.n and self.n % self.k == 0

    def allows(self, option: Option) -> bool:
        """Incompatible combinations are not options (allreduce of a non-summable compressor...)."""
        comp = self.compressors.get(option.compressor)
        if comp is None or option.scheme not in SCHEMES or option.device not in DEVICES:
            return False
        if option.hierarchical and not self.hierarchical_possible:
            return False
        if option.device == "side" and not option.compressed:
            return False  # nothing to offload: the executor's own work stays on the training thread
        if not AGGREGATIONS[option.scheme].carries(comp):
            return False
        return option.compressed or option.scheme == "allreduce"  # uncompressed through allgather & co never wins

    def options(self, schemes: Sequence[str] = SCHEMES, device: str = "compute") -> list[Option]:
        """Every allowed option on ``device``: dense allreduce plus each compressor x scheme x layout."""
        out = []
        for comp in self.compressors:
            for scheme in schemes:
                for hier in (False, True):
                    option = Option(comp, scheme, hier, device)
                    if self.allows(option):
                        out.append(option)
        return out

    # -- costs -------------------------------------------------------------------------------------
    def costs(self, unit: Unit, option: Option) -> tuple[float, float, float]:
        """(encode_s, comm_s, decode_s) of ``unit`` under ``option``."""
        return self.costs_of(unit.numel, unit.dtype, option, unit.kept.get(option.compressor), unit.tensors, unit.shape)

    def costs_of(self, numel: int, dtype: str, option: Option, kept: float | None = None, tensors: int = 1,
                 shape: tuple[int, ...] | None = None) -> tuple[float, float, float]:
        """:meth:`costs` of a unit given by its fields (``kept``: the fraction ``option``'s compressor
        keeps, if profiled)."""
        key = (numel, dtype, shape, kept, tensors, option)
        found = self._cache.get(key)
        if found is None:
            arrays = self.costs_many(np.array([numel]), dtype, option, np.array([np.nan if kept is None else kept]),
                                     np.array([tensors]), [shape])
            found = self._cache[key] = tuple(float(a[0]) for a in arrays)
        return found

    def tasks(self, units: Sequence[Unit], option: Option) -> list[TensorTask]:
        """:meth:`task` of every unit under ``option``, priced together (per dtype)."""
        out: list[TensorTask | None] = [None] * len(units)
        by_dtype: dict[str, list[int]] = {}
        for i, unit in enumerate(units):
            by_dtype.setdefault(unit.dtype, []).append(i)
        for dtype, at in by_dtype.items():
            picked = [units[i] for i in at]
            costs = self.costs_many(np.array([u.numel for u in picked]), dtype, option,
                                    np.array([u.kept.get(option.compressor, np.nan) for u in picked]),
                                    np.array([u.tensors for u in picked]), [u.shape for u in picked])
            for i, unit, encode, comm, decode in zip(at, picked, *(c.tolist() for c in costs), strict=True):
                out[i] = TensorTask(unit.label, unit.ready_s, encode, comm, decode, option.device == "compute",
                                    self.lag(unit.ready_s, option, unit.tensors))
        return out

    def costs_many(self, numel: np.ndarray, dtype: str, option: Option, kept: np.ndarray | None = None,
                   tensors: np.ndarray | None = None, shapes: Sequence[tuple[int, ...] | None] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(encode_s, comm_s, decode_s) arrays of units of one dtype under ``option``, all at once: a
        fusion DP prices about N^2/2 candidate groups, a whole row per call.

        Per unit: ``numel`` its elements, ``kept`` the fraction ``option``'s compressor keeps (NaN:
        not profiled; default all NaN), ``tensors`` how many tensors it holds (default 1),
        ``shapes`` a single tensor's shape or None (default all None)."""
        if not self.allows(option):
            raise ValueError(f"option {option.label()} is not allowed here")
        numel = np.asarray(numel, dtype=np.int64)
        kept = np.full(numel.shape, np.nan) if kept is None else np.asarray(kept, dtype=float)
        tensors = np.ones_like(numel) if tensors is None else np.asarray(tensors, dtype=np.int64)
        shapes = [None] * numel.size if shapes is None else list(shapes)
        encode, comm, decode = self._costs(numel, dtype, shapes, kept, tensors, option)
        return tuple(np.broadcast_to(np.asarray(a, dtype=float), numel.shape) for a in (encode, comm, decode))

    def task(self, unit: Unit, option: Option) -> TensorTask:
        encode, comm, decode = self.costs(unit, option)
        return TensorTask(unit.label, unit.ready_s, encode, comm, decode, option.device == "compute",
                          self.lag(unit.ready_s, option, unit.tensors))

    def lag(self, ready_s: float | np.ndarray, option: Option | None = None,
            tensors: int | np.ndarray = 1) -> float | np.ndarray:
        """How much later than the profiled rank the slowest one issues a collective of a unit of
        ``tensors`` tensors ready at ``ready_s`` under ``option``: the lag at backward end measured
        for its family — in its fused steps for a fused group (``fused_lag_s``), in its layer-wise
        steps for one tensor (``lag_s``) — else the profile's, under dense sync
        (:attr:`Profile.lag_s`), grown in proportion to the time since the ranks last met (the
        previous step's final collective)."""
        prof = self.profile
        lag: float | np.ndarray = prof.lag_s
        if option is not None:
            terms = prof.family_terms(option.family)
            alone = terms.get("lag_s", prof.lag_s)
            fused = terms.get("fused_lag_s", alone)
            if fused == alone:  # the common case (no fused steps measured): no per-group choice to make
                lag = alone
            elif isinstance(tensors, np.ndarray):
                lag = np.where(tensors > 1, fused, alone)
            else:
                lag = fused if tensors > 1 else alone
        if option is not None and self.after_backward(option):
            # These exchanges block, so CompressSync runs them after backward (zen's batched in
            # finish_together, PowerSGD's power iteration in Allreduce.finish): they wait from the
            # group's ready time to backward end, then for the slowest rank's backward end. (Encodes
            # stolen after this group's also delay backward end; not counted here, so this is a
            # lower bound on the wait.)
            return prof.backward_end_s - ready_s + lag
        if not (lag.any() if isinstance(lag, np.ndarray) else lag):
            return 0.0 * ready_s
        return lag * (prof.rest_s + ready_s) / (prof.rest_s + prof.backward_end_s)

    def after_backward(self, option: Option) -> bool:
        """Whether ``option``'s collectives run only after backward: zen's (batched, blocking) and
        PowerSGD's (its power iteration runs in the scheme's finish)."""
        return option.scheme == "zen" or (option.compressed and self.compressors[option.compressor].reduces_itself)

    def zen_rounds_s(self, hierarchical: bool = False) -> float:
        """The latency of zen's push and pull rounds, paid once per step for all of a layout's zen
        groups (they are batched per communicator)."""
        if self.n == 1:
            return 0.0
        net, ranks = (self.exchange_across, self.n // self.k) if hierarchical else (self.exchange, self.n)
        return 2 * float(net.all_to_all(0.0, ranks))

    def fixed_s(self, options: Sequence[Option]) -> float:
        """What a plan under ``options`` costs per step beyond its tasks: zen's two rounds, once per
        layout it uses zen in."""
        return sum(self.zen_rounds_s(hier) for hier in sorted({o.hierarchical for o in options if o.scheme == "zen"}))

    def _fits(self, option: Option) -> tuple[CostFit, CostFit]:
        prof = self.profile.compressors.get(option.compressor)
        if prof is None:
            return CostFit(), CostFit()
        if option.device == "side":
            return prof.side_encode, prof.side_decode
        return prof.encode, prof.decode

    def _payload(self, dtype_name: str, kept_fraction: np.ndarray, tensors: np.ndarray, total: np.ndarray,
                 option: Option, numel: np.ndarray, shapes: list) -> np.ndarray:
        """Bytes of one packed payload of ``numel`` of each unit's ``total`` elements (its real kept fraction)."""
        if not option.compressed:
            return numel * element_size(dtype_name)  # the gradient itself (NoCompression's payload)
        comp = self.compressors[option.compressor]
        dtype = _dtype(dtype_name)
        if self.profile.widens:  # the memory hands the compressor p = g + e in float32
            dtype = torch.promote_types(dtype, torch.float32)
        # The kept fraction prices a variable-size payload (from the real gradients), and a payload of
        # matrix factors (from the shapes: PowerSGD's members' factors over the members' elements).
        known = np.isfinite(kept_fraction) & (not comp.fixed_size or comp.needs_matrices)
        kept = np.where(known, np.maximum(1, np.round(np.nan_to_num(kept_fraction) * numel)), 0).astype(np.int64)
        header = self.profile.compressors[option.compressor].header_bytes
        # The compressor's own formula: over every flat group at once, and one at a time for a unit
        # priced by its shape (PowerSGD's matrices).
        flat = np.array([shape is None for shape in shapes], dtype=bool)
        packed = np.empty(flat.size)
        if flat.any():
            numels = np.asarray(numel, dtype=np.int64)[flat]
            packed[flat] = comp.payload_bytes_many(numels, dtype, np.where(known, kept, -1)[flat])
        for i in np.flatnonzero(~flat).tolist():
            packed[i] = comp.payload_bytes(shapes[i], dtype, int(kept[i]) if known[i] else None)
        # A per-member compressor's scales for a fused group's other members, in proportion to the
        # elements this payload holds (an alltoall partition holds about its share of them).
        members = 0 if option.hierarchical or not comp.per_member else comp.member_bytes * (tensors - 1)
        return packed + header + members * numel / np.maximum(1, total)

    def _costs(self, total: np.ndarray, dtype: str, shapes: list, kept: np.ndarray, tensors: np.ndarray,
               option: Option) -> tuple[np.ndarray | float, ...]:
        n, k, net = self.n, self.k, self.network
        if n == 1:
            return 0.0, 0.0, 0.0
        dense_bytes = total * element_size(dtype)
        comp = self.compressors.get(option.compressor) if option.compressed else None
        scheme = option.scheme
        if scheme == "allreduce" and comp is not None and self._owners_sum(comp, dtype):
            scheme = "alltoall"  # Allreduce.rounds: the owners sum the 16-bit pieces in float32
        # What calibration measured this family to cost per group on the training thread (flat dense
        # groups run on dense allreduce's own path and pay nothing per group).
        terms = self.profile.family_terms(option.family) if comp or option.hierarchical else {}
        # PowerSGD's hierarchical groups run whole at each machine's leader (CompressSync's LEADER
        # layout: it compresses whole matrices), not as chunks.
        leader = option.hierarchical and comp is not None and comp.needs_matrices
        # Per group (its Python, its blocking calls) and per element of the group (the CPU the ranks'
        # compression takes from each other's training threads, in proportion to what they compress).
        encode = terms.get("cpu_s", 0.0) + terms.get("cpu_per_element_s", 0.0) * total
        decode = 0.0
        if self.beside and comp is None:
            decode += self.profile.family_terms(DENSE.family).get("beside_compression_s", 0.0)
        allreduce_net, allreduce_ranks = (self.across, n // k) if option.hierarchical else (net, n)
        if comp is not None and comp.shared_scale:
            encode += float(allreduce_net.allreduce(4.0, allreduce_ranks))  # TernGrad's max of the ranks' scalars
        numel, ranks, across = total, n, net if scheme == "allreduce" else self.exchange
        if leader:
            encode += net.allreduce(dense_bytes, k)  # the machine's sum at every rank (blocking)
            decode += net.broadcast(dense_bytes, k)  # the leader's result to the machine
            ranks, across = n // k, self.leaders
        elif option.hierarchical:
            encode += net.reduce_scatter(dense_bytes, k)  # one machine: its intra links
            decode += net.allgather(dense_bytes / k, k)
            numel, shapes, ranks = -(-total // k), [None] * total.size, n // k
            across = self.across if scheme == "allreduce" else self.exchange_across
        # A flat dense group runs on dense allreduce's own path (CompressSync._dense_path): nothing
        # per group beyond the 1/n copy that the profiled backward already holds (and, beside
        # compression, the cost calibrated for that, above).
        enc_fit, dec_fit = self._fits(option) if option.compressed or option.hierarchical else (_FREE, _FREE)
        extra_encode = extra_decode = extra_encode_per_element = extra_decode_per_element = 0.0
        if comp is not None and comp.per_member and (leader or not option.hierarchical):
            # Each member of a fused buffer past the first adds its measured cost to every encode and
            # decode (an all-to-all partition holds about its share of the members), and fusing its
            # measured cost per element.
            extra = _extra_members(tensors, scheme, ranks)
            prof = self.profile.compressors[option.compressor]
            extra_encode, extra_decode = prof.member_encode_s * extra, prof.member_decode_s * extra
            extra_encode_per_element = np.where(extra > 0, prof.fused_encode_per_element_s, 0.0)
            extra_decode_per_element = np.where(extra > 0, prof.fused_decode_per_element_s, 0.0)
        priced = Pricing(
            numel, ranks, across,
            lambda x, shapes=shapes: self._payload(dtype, kept, tensors, total, option, x,
                                                  shapes if x is numel else [None] * x.size),
            lambda x: enc_fit.many(x, extra_encode, extra_encode_per_element),
            lambda x: dec_fit.many(x, extra_decode, extra_decode_per_element),
            # Fixed-size payloads need no size exchange (CompressSync knows every rank's length).
            0.0 if comp is None or comp.fixed_size else 1.0,
            # A receiver's context for another rank's payload, built without data (Compressor.context:
            # compressing zeros, unless the compressor knows it from shape and dtype alone).
            comp is not None and type(comp).context is Compressor.context,
            float(torch.promote_types(_dtype(dtype), torch.float32).itemsize if self.profile.widens
                  else element_size(dtype)),
            2 if comp is not None and comp.reduces_itself else 1)  # PowerSGD: P's allreduce, then Q's
        scheme_encode, comm, scheme_decode = AGGREGATIONS[scheme].price(priced)
        # A family's measured correction may be negative (the model over-prices it), but no group
        # holds the training thread for less than no time.
        return np.maximum(0.0, encode + scheme_encode), comm, decode + scheme_decode

    def _owners_sum(self, comp: Compressor, dtype: str) -> bool:
        """Whether an allreduce of ``comp``'s payloads runs as the owners' float32 sum: a cast narrower
        than the gradient under error feedback (the memory widens: it is one)."""
        wire_dtype = comp.wire_dtype
        return self.profile.widens and wire_dtype is not None and wire_dtype.itemsize < element_size(dtype)


def _extra_members(tensors: int | np.ndarray, scheme: str, ranks: int) -> int | np.ndarray:
    """Members past the first in what one call compresses: an all-to-all partition holds about its
    share of a fused buffer's members."""
    return np.maximum((-(-tensors // ranks) if scheme == "alltoall" else tensors) - 1, 0)


@functools.cache
def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the profile")
    return dtype


@functools.cache
def element_size(name: str) -> int:
    """Bytes per element of a dtype named as a profile names it (``torch.float32``)."""
    return _dtype(name).itemsize


def units_of(profile: Profile) -> list[Unit]:
    """One unit per profiled tensor, in backward order."""
    return [Unit((t.name,), t.numel, t.dtype, t.ready_s, tuple(t.shape), dict(t.kept)) for t in profile.tensors]


def fuse(units: Sequence[Unit]) -> Unit:
    """Consecutive units as one flat buffer (they must share a dtype): ready with the last one,
    kept fractions averaged by size."""
    if len({u.dtype for u in units}) != 1:
        raise ValueError(f"cannot fuse units of different dtypes: {[u.label for u in units]}")
    if len(units) == 1:
        return units[0]
    numel = sum(u.numel for u in units)
    keys = set.intersection(*(set(u.kept) for u in units))
    kept = {key: sum(u.kept[key] * u.numel for u in units) / max(1, numel) for key in keys}
    return Unit(tuple(n for u in units for n in u.names), numel, units[0].dtype, max(u.ready_s for u in units),
                None, kept)
