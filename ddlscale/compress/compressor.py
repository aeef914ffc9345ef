"""The Compressor contract: what travels, what stays local, and how payloads combine.

See the package docstring (``ddlscale/compress/__init__.py``) for the rules a backend relies on.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

Shape = int | Sequence[int]


@dataclass(frozen=True)
class Segment:
    """One member of a flat buffer a compressor is given, or the piece of a member an alltoall
    partition (or a machine's chunk) holds: ``numel`` elements of a tensor seen as a matrix of its
    first dimension by the rest (rows of ``cols`` elements: PowerSGD's matrices, onebit's columns),
    the piece starting ``start`` elements into its member. A flat member is one column."""

    numel: int
    cols: int = 1
    start: int = 0

    @classmethod
    def of(cls, shape: Sequence[int]) -> Segment:
        """A whole tensor of this shape (a vector or a scalar: one column)."""
        shape = tuple(int(d) for d in shape)
        return cls(math.prod(shape), max(1, math.prod(shape[1:])) if len(shape) >= 2 else 1)

    @property
    def whole_rows(self) -> bool:
        """Whether the piece is a block of whole rows (a matrix of its own)."""
        return self.start % self.cols == 0 and self.numel % self.cols == 0

    @property
    def rows(self) -> int:
        return self.numel // self.cols

    @property
    def columns(self) -> int:
        """How many of its member's columns the piece touches (an empty one: one, holding nothing)."""
        return max(1, min(self.cols, self.numel))


def pieces(members: Sequence[Segment], sizes: Sequence[int], offset: int = 0) -> list[list[Segment]]:
    """The pieces of ``members`` (consecutive in a buffer) that each of the consecutive ranges of
    ``sizes`` elements holds, the ranges starting ``offset`` elements into the buffer (empty pieces
    left out)."""
    out, member, used = [], 0, 0  # used: elements of members[member] in earlier ranges (or before offset)
    while offset > 0 and member < len(members):
        take = min(offset, members[member].numel - used)
        offset, used = offset - take, used + take
        if used == members[member].numel:
            member, used = member + 1, 0
    for size in sizes:
        share = []
        while size > 0 and member < len(members):
            whole = members[member]
            take = min(size, whole.numel - used)
            if take > 0:
                share.append(Segment(take, whole.cols, whole.start + used))
            size, used = size - take, used + take
            if used == whole.numel:
                member, used = member + 1, 0
        out.append(share)
    return out


@dataclass(frozen=True)
class Context:
    """What the decoder needs besides the payload. Rank-independent by contract: any rank's Context
    for the same tensor (same name, same step) decodes any rank's payload."""

    shape: torch.Size
    dtype: torch.dtype
    extra: Any = None  # compressor-specific, identical on every rank (e.g. shared-seed indices)
    # The members a per-member compressor was given (None: one flat member, the whole tensor).
    segments: tuple[Segment, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def members(self) -> tuple[Segment, ...]:
        return self.segments if self.segments is not None else (Segment(self.numel),)


@dataclass
class Compressed:
    """One compressed tensor: ``payload`` goes on the wire, ``ctx`` stays with the receiver."""

    payload: list[torch.Tensor]
    ctx: Context

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: every payload tensor, indices and scales included."""
        return sum(t.numel() * t.element_size() for t in self.payload)

    def with_payload(self, payload: list[torch.Tensor]) -> Compressed:
        """Another rank's payload decoded with this rank's context (the receiving side)."""
        return Compressed(list(payload), self.ctx)


class Compressor:
    """Base class: subclasses implement :meth:`encode`, :meth:`decode` and :meth:`payload_bytes`.

    Class attributes a backend reads (an instance may override them from its parameters):
    ``summable`` — payloads of different ranks may be summed elementwise (allreduce) and decoded;
    ``fixed_size`` — payload shapes depend only on the tensor's shape and dtype, so a receiver can
    size its buffers from its own payload; otherwise sizes must be exchanged first;
    ``per_member`` — given the members of a fused buffer (``compress(..., segments=)``), it keeps
    its per-tensor statistics per member, so fusing does not let a large tensor set a small one's
    scale: int8's scale, QSGD's buckets and norms, TernGrad's sigma and scale, the scaled signs'
    scale and the unscaled signs' zero rows, onebit's column means and PowerSGD's factors, each
    member's own (given the same random draws, a fused buffer decodes bit for bit as its members
    compressed alone); randomk draws k per member. Each member past the first adds up to
    ``member_bytes`` to the payload (its statistic; onebit: per column, unscaled signs: a bit per
    row). A compressor that is not per-member ignores segments: its operator on a fused buffer is
    defined by its own docstring (an elementwise one is unchanged by fusion; top-k and DGC select
    over the whole group);
    ``needs_matrices`` — it compresses matrices (PowerSGD): a scheme that would hand it flat pieces
    cutting through rows refuses it;
    ``unbiased`` — E[D(C(g))] = g: it runs without error feedback by default (:attr:`default_memory`);
    ``votes`` — :meth:`combine` is a majority vote, not a sum: no residual accounts for what it drops,
    and an owner cannot re-encode a tie in the compressor's own code;
    ``reduces_itself`` — under allreduce it runs its own collectives (:meth:`reduce`: PowerSGD's power
    iteration), so it is summable there and nowhere else;
    ``wire_dtype`` — a cast's narrower wire type (None: not a cast), whose sum rounds below the tensor's
    precision;
    ``shared_scale`` — its ranks agree on a scale per member before compressing (one small allreduce
    per group, in :meth:`agreed`: TernGrad's).
    Every backend and planner reads these; none probes a compressor for a method or attribute.
    """

    name: str = "?"
    summable: bool = False
    fixed_size: bool = True
    per_member: bool = False
    member_bytes: int = 0
    needs_matrices: bool = False
    unbiased: bool = False
    votes: bool = False
    reduces_itself: bool = False
    wire_dtype: torch.dtype | None = None
    shared_scale: bool = False

    seed: int = 0  # stochastic compressors set it from their config

    def __init__(self) -> None:
        self._steps: dict[str, int] = {}  # per-tensor call count: drives reproducible randomness

    # -- the public contract -------------------------------------------------------------------
    @property
    def default_memory(self) -> str:
        """The error feedback a run gets unless it names one: ``residual`` for a biased compressor
        (what it drops is sent later instead of lost), ``none`` for an unbiased one (its errors
        average out, and a residual would only add variance)."""
        return "none" if self.unbiased else "residual"

    def precondition(self, tensor: torch.Tensor, name: str, segments: Sequence[int | Segment] | None = None,
                     ranks: int = 1) -> torch.Tensor:
        """What this rank's gradient becomes before error feedback and compression, once per step and
        group (the identity here; DGC's momentum correction and local clipping, Signum's momentum).
        ``ranks``: how many ranks' tensors the scheme will combine. May return ``tensor`` itself."""
        return tensor

    @property
    def prepares_dense(self) -> bool:
        """Whether :meth:`precondition_dense` changes anything (a sync skips it otherwise)."""
        return False

    def precondition_dense(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """What this rank's gradient of a group that a planned sync sends dense (uncompressed: its dense
        steps and the groups a plan keeps dense) becomes, before error feedback: the identity here.
        DGC, which took over the optimizer's momentum, applies that momentum as the optimizer would.
        May return ``tensor`` itself."""
        return tensor

    def warmup_steps_left(self) -> int:
        """Steps of a schedule over the first steps (DGC's sparsity warm-up) still to run; 0 here."""
        return 0

    def synced_dense(self, steps: int) -> None:
        """``steps`` training steps were synced dense before this compressor's next one (a planned
        sync's profiling): a schedule over steps counts them, as they sent everything; nothing here."""

    def sent(self, name: str, decoded: torch.Tensor) -> None:
        """The first stage of ``name`` sent ``decoded`` (this rank's own payload decompressed), for state
        that depends on what was sent (DGC's momentum factor masking); nothing here."""

    @contextlib.contextmanager
    def agreed(self, tensor: torch.Tensor, comm: Any, segments: Sequence[int | Segment] | None = None
               ) -> Iterator[None]:
        """Around the first-stage compression of one group on ``comm`` (the ranks of its scheme):
        a compressor whose ranks must share a value first (TernGrad's scale per member) agrees on it
        here. ``segments``: the group's members, as :meth:`compress` takes them. The compressions
        inside cover ``tensor`` once, in order (a divisible scheme's partitions one after another).
        Nothing by default: no exchange."""
        yield

    def combine(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """What ``count`` ranks' decompressed tensors, summed into ``total``, aggregate to: their sum
        here (a majority vote in signSGD). May work in place."""
        return total

    def compress(self, tensor: torch.Tensor, name: str = "", segments: Sequence[int | Segment] | None = None) -> Compressed:
        """Compress one gradient. ``name`` keys any per-tensor state (momentum, factors, RNG).
        ``segments``: the members a flat buffer holds, in order (sizes, or :class:`Segment` with their
        matrix rows); a per-member compressor compresses each as if alone, any other ignores them."""
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name}: can only compress floating-point tensors, got {tensor.dtype}")
        members = self._members(tensor, segments)
        payload, extra = self.encode(tensor, name, members) if members is not None else self.encode(tensor, name)
        self._steps[name] = self._steps.get(name, 0) + 1
        flat = members is None or (len(members) == 1 and members[0].columns <= 1)
        return Compressed(payload, Context(tensor.shape, tensor.dtype, extra, None if flat else members))

    def decompress(self, compressed: Compressed) -> torch.Tensor:
        """A dense tensor of the original shape and dtype."""
        ctx = compressed.ctx
        return self.decode(compressed.payload, ctx).reshape(ctx.shape).to(ctx.dtype)

    def context(self, shape: Shape, dtype: torch.dtype, name: str = "",
                segments: Sequence[int | Segment] | None = None) -> Context:
        """The Context any rank's :meth:`compress` of ``name`` gives at this step, without its data
        (a receiver decoding a payload it did not compress), advancing ``name``'s step as
        :meth:`compress` does. Compressing zeros gives it in general; a compressor whose context
        holds no extra may answer without the work (override)."""
        return self.compress(torch.zeros(shape, dtype=dtype), name, segments).ctx

    def aggregate(self, items: Sequence[Compressed]) -> Compressed:
        """Elementwise sum of several ranks' payloads (what an allreduce would produce)."""
        if not self.summable:
            raise TypeError(f"compressor {self.name} payloads cannot be summed; gather and decode them")
        if not items:
            raise ValueError("aggregate needs at least one compressed tensor")
        summed = [torch.stack(parts).sum(0) for parts in zip(*(c.payload for c in items), strict=True)]
        return items[0].with_payload(summed)

    def decompress_sum(self, items: Sequence[Compressed]) -> torch.Tensor:
        """Elementwise sum of several ranks' tensors decompressed, added in the order given, in one
        new buffer (a decompressed tensor may alias its payload, which must stay untouched)."""
        if not items:
            raise ValueError("decompress_sum needs at least one compressed tensor")
        total = self.decompress(items[0])
        for k, item in enumerate(items[1:]):
            part = self.decompress(item)
            total = total + part if k == 0 else total.add_(part)
        return total

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        """Bytes :meth:`compress` puts on the wire for a tensor of this shape and dtype.

        ``kept`` — for variable-size compressors, the number of elements selected (the length of
        ``payload[0]``); without it, the largest possible size.
        """
        raise NotImplementedError

    def payload_bytes_many(self, numels: np.ndarray, dtype: torch.dtype, kept: np.ndarray | None = None) -> np.ndarray:
        """:meth:`payload_bytes` of flat tensors of each of ``numels`` elements (``kept``: each one's
        selected elements, negative where none is given), as one float array: what a planner prices
        thousands of candidate groups with. One call per tensor here; a compressor whose formula
        vectorizes overrides it with the same integers."""
        given = [None] * len(numels) if kept is None else [None if k < 0 else int(k) for k in kept.tolist()]
        return np.array([self.payload_bytes(int(n), dtype, k) for n, k in zip(numels.tolist(), given, strict=True)],
                        dtype=float)

    def _members(self, tensor: torch.Tensor, segments: Sequence[int | Segment] | None) -> tuple[Segment, ...] | None:
        """For a per-member compressor, ``segments`` as Segments (the tensor's own shape when none
        are given); None for any other."""
        if not self.per_member:
            return None
        if segments is None:
            return (Segment.of(tensor.shape),)
        members = tuple(s if isinstance(s, Segment) else Segment(int(s)) for s in segments)
        if any(s.numel < 0 for s in members) or sum(s.numel for s in members) != tensor.numel():
            raise ValueError(f"{self.name}: segments {[s.numel for s in members]} do not split a tensor of "
                             f"{tensor.numel()} elements")
        return members

    # -- what subclasses implement -------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], Any]:
        """(payload, Context.extra) for ``tensor`` (any shape; flatten as needed). A per-member
        compressor also takes its members (Segments) and its decode reads ``ctx.members``."""
        raise NotImplementedError

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        """The dense tensor (any shape with ``ctx.numel`` elements; dtype is fixed up after)."""
        raise NotImplementedError

    # -- checkpointed state --------------------------------------------------------------------
    def group_states(self) -> list[dict[str, torch.Tensor]]:
        """Per-name tensors laid out like the named tensor (a residual, a momentum), which a backend
        that regroups tensors into new fused buffers must re-lay out; as :meth:`Memory.group_states`."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Everything that changes future outputs; subclasses extend the dict."""
        return {"steps": dict(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = {str(k): int(v) for k, v in state["steps"].items()}

    # -- helpers for subclasses ----------------------------------------------------------------
    def uniform(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Uniform draws in [0, 1), one per element of ``like`` (its shape, device and dtype), from
        ``name``'s stream at this step (:meth:`generator`): a stochastic quantizer's rounding."""
        return torch.rand(like.shape, generator=self.generator(name, like.device), device=like.device,
                          dtype=like.dtype)

    def generator(self, name: str, device: torch.device, shared: bool = False) -> torch.Generator:
        """A fresh generator for this tensor's current step.

        Seeded from (seed, rank, name, step) by a stable hash rather than drawn from the global
        RNG: results do not depend on what else consumed random numbers, and restoring
        :meth:`state_dict` replays them exactly. ``shared=True`` leaves the rank out, so every rank
        draws the same numbers (randomk's aligned indices, PowerSGD's initial factors).
        """
        rank = 0 if shared else _rank()
        key = f"{self.seed}/{rank}/{name}/{self._steps.get(name, 0)}".encode()
        value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(value)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def _rank() -> int:
    """This process's global rank (0 outside torch.distributed): stochastic rounding and local
    sampling must differ across ranks, or their errors would be correlated instead of averaging out."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def sizes_of(members: Sequence[Segment] | None, numel: int) -> list[int]:
    """The members' element counts (one member of ``numel`` when None)."""
    return [numel] if members is None else [m.numel for m in members]


def member_max(magnitude: torch.Tensor, members: Sequence[Segment] | None) -> torch.Tensor:
    """The largest entry of each member of a flat non-negative tensor (0 for an empty one), as a
    1-D tensor. A maximum is exact, so one segmented pass equals each member's own ``max``."""
    sizes = sizes_of(members, magnitude.numel())
    if len(sizes) == 1:
        return (magnitude.max() if magnitude.numel() else magnitude.new_zeros(())).reshape(1)
    lengths = torch.tensor(sizes, device=magnitude.device)
    return torch.segment_reduce(magnitude, "max", lengths=lengths, unsafe=True, initial=0)


def per_element(values: torch.Tensor, members: Sequence[Segment] | None, numel: int) -> torch.Tensor:
    """One value per member, repeated over the member's elements (a single member's value as it is:
    it broadcasts, and the products are the same)."""
    sizes = sizes_of(members, numel)
    if len(sizes) == 1:
        return values
    return torch.repeat_interleave(values, torch.tensor(sizes, device=values.device), output_size=numel)


def numel_of(shape: Shape) -> int:
    return shape if isinstance(shape, int) else math.prod(shape)


def float_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def index_dtype(numel: int) -> torch.dtype:
    """Indices travel as int32 whenever they fit: half the bytes of int64."""
    return torch.int32 if numel <= 2**31 - 1 else torch.int64


def count_of(ratio: float, numel: int) -> int:
    """k = ceil(ratio * numel), at least 1 for a non-empty tensor. The product is rounded to 6
    decimals first, so floating-point noise does not add one (0.07 * 100 gives 7, not 8)."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(round(ratio * numel, 6))))


def counts_of(ratio: float, numels: np.ndarray) -> np.ndarray:
    """:func:`count_of` of each of ``numels``, the same integers: a product more than 1e-5 from an
    integer has the same ceiling whatever its 6-decimal rounding, so only the few nearer ones are
    rounded as Python rounds, one by one."""
    numels = np.asarray(numels, dtype=np.int64)
    product = ratio * numels.astype(np.float64)
    counts = np.ceil(product)
    for i in np.flatnonzero(np.abs(product - np.rint(product)) <= 1e-5).tolist():
        counts[i] = math.ceil(round(float(product[i]), 6))
    counts = np.minimum(numels, np.maximum(1, counts.astype(np.int64)))
    return np.where(numels == 0, 0, counts)


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """Compute dtype for scales, norms and sums: float32, or float64 for float64 input."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def check_ratio(ratio: Any, key: str = "compressor.ratio") -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{key} must be in (0, 1], got {ratio!r}")
    return float(ratio)


def check_unit_interval(value: Any, key: str) -> float:
    """A coefficient in [0, 1) (momentum, decay)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{key} must be in [0, 1), got {value!r}")
    return float(value)


def check_seed(value: Any, key: str = "compressor.seed") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def check_int(value: Any, key: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{key} must be an integer {bound}, got {value!r}")
    return value
