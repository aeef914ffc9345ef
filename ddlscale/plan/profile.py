"""What a plan is computed from, measured on the first iterations of a real run and saved as JSON.

A :class:`Profile` holds, in backward order, every gradient tensor's size and the time its hook
fired; when backward ended; the rest of a step (forward, optimizer, data); the encode and decode
cost of each compressor a plan may use, fitted over a grid of sizes on this device
(:class:`~ddlscale.plan.fit.CostFit`); and the network the plan assumes (the cluster config's
bandwidth and latency, as :class:`~ddlscale.comm.network.NetworkModel` takes them). Saved with the
run, it lets ``python -m ddlscale.tools.plan`` recompute a plan offline, for other cluster sizes too.

Timing conventions (seconds): backward starts when the first gradient hook fires — the backward of
the loss and of the last layer before it is counted in ``rest_s`` instead, which no plan changes.
``rest_s`` is a step's period minus (backward end - backward start) minus the sync wait, so the
simulator's ``iteration = max(backward end, last decode) + rest_s`` is the whole step time.
``lag_s``: how much later than the profiled rank the slowest rank ended backward, counted from the
previous step's final collective, where the ranks last met (median over the profiled steps): every
collective waits for the last rank, and noisy or uneven workers make some rank the last.

``families``: what one option family (compressor key x scheme x layout, :func:`family`) was measured
to cost in compressed training steps beyond the fits and the network model — ``cpu_s``, seconds per
group on the training thread, and ``cpu_per_element_s`` (where a fused step was calibrated too: what
the family costs per element compressed rather than per group), either negative where the model
over-prices the family; ``lag_s`` and ``fused_lag_s``, the slowest rank's lag under it in its
layer-wise and in its fused steps (a compressed layout drifts the ranks apart otherwise than dense
sync: a gather root's n decodes, an owner's re-encodes, data-dependent sizes, compression during
backward or after it). A family without its own entry takes its compressor's (``<key>/*``), else
nothing extra and the dense ``lag_s``. Flat dense allreduce's family (``none/allreduce``) may carry
``beside_compression_s``: what each of its groups costs in a step that also compresses (a mixed
calibration step, ``sync.calibrate_mixed``).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ddlscale import clock
from ddlscale.compress import Compressor, Memory, build_compressor, class_path, packing
from ddlscale.compress.compressor import Segment
from ddlscale.plan.fit import CostFit

PROFILE_VERSION = 1
FAMILY_TERMS = ("cpu_s", "cpu_per_element_s", "lag_s", "fused_lag_s", "beside_compression_s")


def family(compressor: str, scheme: str, hierarchical: bool = False) -> str:
    """The key of an option family in :attr:`Profile.families`: ``default/allgather``, ``none/allreduce/hier``;
    ``default/*`` stands for every family of a compressor key without its own entry."""
    return f"{compressor}/{scheme}" + ("/hier" if hierarchical else "")


@dataclass(frozen=True)
class TensorProfile:
    """One gradient: ``ready_s`` after backward start; ``kept``: per compressor key, the fraction of
    elements a variable-size compressor kept on this tensor's real gradient (absent: fixed size)."""

    name: str
    numel: int
    shape: tuple[int, ...]
    dtype: str
    ready_s: float
    kept: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CompressorProfile:
    """A compressor's identity (to rebuild it offline) and its fitted costs.

    ``encode``: compress plus the local decompress error feedback needs; ``decode``: decompress one
    received payload and add it to a sum. ``side_encode``/``side_decode``: the same on the side
    device (the CPU beside a GPU; equal to ``encode``/``decode`` where training runs on the CPU).
    ``header_bytes``: the wire header one packed payload adds. ``member_encode_s`` /
    ``member_decode_s``: what each member of a fused buffer past the first adds to an encode /
    decode, and ``fused_encode_per_element_s`` / ``fused_decode_per_element_s`` what a buffer of
    several members adds per element (a pass that applies each member's scale), for compressors
    that scale per member (0 for the others; the fits are of one tensor).
    """

    name: str
    params: dict[str, Any]
    encode: CostFit
    decode: CostFit
    side_encode: CostFit
    side_decode: CostFit
    header_bytes: int = 0
    samples: list[dict[str, float]] = field(default_factory=list)
    calibration: dict[str, float] = field(default_factory=dict)  # in training / benchmark (PlannedSync)
    member_encode_s: float = 0.0  # a per-member compressor's extra seconds per fused member past the first
    member_decode_s: float = 0.0
    fused_encode_per_element_s: float = 0.0
    fused_decode_per_element_s: float = 0.0
    target: str = ""  # its class, ``module.Class`` (a compressor defined outside ddlscale too; "": by name)

    def build(self) -> Compressor:
        """The compressor profiled: its class (or registered name) built from its parameters."""
        return build_compressor(self.target or self.name, **self.params)

    def calibrated(self, encode: float, decode: float, **facts: float) -> CompressorProfile:
        """These fits scaled to what the same work cost inside training steps (on the training
        device; the side device's fits too where it is the same CPU)."""
        scaled = replace(self, member_encode_s=self.member_encode_s * encode,
                         member_decode_s=self.member_decode_s * decode,
                         fused_encode_per_element_s=self.fused_encode_per_element_s * encode,
                         fused_decode_per_element_s=self.fused_decode_per_element_s * decode)
        return scaled._refitted(self.encode.scaled(encode), self.decode.scaled(decode),
                                {"encode": encode, "decode": decode, **facts})

    def _refitted(self, encode: CostFit, decode: CostFit, calibration: dict[str, float]) -> CompressorProfile:
        """New training-device fits; the side device's follow them where it is the same CPU."""
        same = self.side_encode == self.encode and self.side_decode == self.decode
        return replace(self, encode=encode, decode=decode, side_encode=encode if same else self.side_encode,
                       side_decode=decode if same else self.side_decode, calibration=calibration)


@dataclass
class Profile:
    tensors: list[TensorProfile]
    backward_end_s: float
    rest_s: float
    world_size: int
    network: dict[str, Any]
    compressors: dict[str, CompressorProfile]
    device: str = "cpu"
    step_s: float | None = None  # median measured step with dense sync (for predicted vs measured)
    steps: int = 0  # measured steps averaged
    lag_s: float = 0.0  # how much later than this rank the slowest one ended backward (median)
    widens: bool = False  # error feedback compresses bf16/fp16 gradients as float32 (Memory.widens)
    families: dict[str, dict[str, float]] = field(default_factory=dict)  # per option family: FAMILY_TERMS

    def family_terms(self, key: str) -> dict[str, float]:
        """What option family ``key`` (:func:`family`) was measured to cost: its own entry, else its
        compressor's ``<key>/*``, else nothing."""
        found = self.families.get(key)
        return found if found is not None else self.families.get(key.split("/", 1)[0] + "/*", {})

    def with_family(self, key: str, **terms: float) -> Profile:
        """This profile with option family ``key``'s measured terms set (others kept)."""
        unknown = set(terms) - set(FAMILY_TERMS)
        if unknown:
            raise ValueError(f"unknown family terms {sorted(unknown)}; known: {FAMILY_TERMS}")
        return replace(self, families={**self.families, key: {**self.families.get(key, {}), **terms}})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["version"] = PROFILE_VERSION
        for key, comp in self.compressors.items():
            for what in ("encode", "decode", "side_encode", "side_decode"):
                out["compressors"][key][what] = getattr(comp, what).to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r} is not {PROFILE_VERSION}")
        tensors = [TensorProfile(t["name"], int(t["numel"]), tuple(t["shape"]), t["dtype"], float(t["ready_s"]),
                                 {k: float(v) for k, v in t.get("kept", {}).items()}) for t in data["tensors"]]
        compressors = {
            key: CompressorProfile(c["name"], dict(c["params"]), *(CostFit.from_dict(c[w]) for w in
                                   ("encode", "decode", "side_encode", "side_decode")),
                                   int(c.get("header_bytes", 0)), list(c.get("samples", [])),
                                   dict(c.get("calibration", {})),
                                   *(float(c.get(k, 0.0)) for k in MEMBER_COSTS), str(c.get("target", "")))
            for key, c in data["compressors"].items()
        }
        return cls(tensors, float(data["backward_end_s"]), float(data["rest_s"]), int(data["world_size"]),
                   dict(data["network"]), compressors, data.get("device", "cpu"), data.get("step_s"),
                   int(data.get("steps", 0)), float(data.get("lag_s", 0.0)), bool(data.get("widens", False)),
                   {key: {t: float(v) for t, v in terms.items() if t in FAMILY_TERMS}
                    for key, terms in data.get("families", {}).items()})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


# -- per-step hook timestamps ----------------------------------------------------------------------
class StepRecorder:
    """Timestamps of one rank's gradient hooks, backward end and step end over several steps."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._current: dict[int, float] = {}
        self._backward_end: float | None = None

    def ready(self, index: int) -> None:
        self._current.setdefault(index, clock.now())

    def backward_end(self) -> None:
        self._backward_end = clock.now()

    def step_end(self) -> None:
        end = clock.now()
        self.steps.append({"ready": self._current, "backward_end": self._backward_end or end, "end": end})
        self._current, self._backward_end = {}, None

    def _measured(self, warmup: int) -> list[int]:
        return [k for k in range(max(1, warmup), len(self.steps)) if self.steps[k]["ready"]]

    def spans(self, warmup: int = 1) -> list[float]:
        """Per measured step: the previous step's end (its final collective, where the ranks met)
        to this step's backward end — what :func:`slowest_lag` compares across ranks."""
        return [self.steps[k]["backward_end"] - self.steps[k - 1]["end"] for k in self._measured(warmup)]

    def summary(self, order: Sequence[int], warmup: int = 1) -> dict[str, Any]:
        """Median ready times in ``order`` (made non-decreasing), backward end, rest of the step.

        The first ``warmup`` steps are not measured (allocator and thread-pool warm-up); each
        measured step needs the previous one's end for its period. Medians, not means: a few
        profiled steps on a busy host often hold one that is several times slower. A tensor whose hook never fired
        is ready at backward end (the backend zero-fills it then).
        """
        measured = self._measured(warmup)
        if not measured:
            raise ValueError(f"profiling needs more than {max(1, warmup)} steps with gradients; got {len(self.steps)}")
        ready = {i: [] for i in order}
        ends, rests, periods = [], [], []
        for k in measured:
            step = self.steps[k]
            start = min(step["ready"].values())
            backward = step["backward_end"] - start
            for i in order:
                ready[i].append(step["ready"].get(i, step["backward_end"]) - start)
            period = step["end"] - self.steps[k - 1]["end"]
            ends.append(backward)
            periods.append(period)
            rests.append(max(0.0, period - (step["end"] - start)))
        backward_end = statistics.median(ends)
        ready_s, latest = [], 0.0
        for i in order:  # backward order is the order the hooks fire: keep the times monotone
            latest = min(backward_end, max(latest, statistics.median(ready[i])))
            ready_s.append(latest)
        return {"ready_s": ready_s, "backward_end_s": backward_end, "rest_s": statistics.median(rests),
                "step_s": statistics.median(periods), "steps": len(measured)}


def slowest_lag(spans: Sequence[Sequence[float]], rank: int = 0) -> float:
    """How much later than ``rank`` the slowest rank ends backward: the median over steps of
    max over ranks of ``spans[r][k]`` minus ``spans[rank][k]`` (:meth:`StepRecorder.spans` of every
    rank; durations, so no clock is shared). 0 for one rank or no steps."""
    steps = min((len(s) for s in spans), default=0)
    if len(spans) < 2 or steps == 0:
        return 0.0
    return statistics.median(max(s[k] for s in spans) - spans[rank][k] for k in range(steps))


# -- compressor costs on this device -------------------------------------------------------------------
def size_grid(largest: int, smallest: int = 256, cap: int = 1 << 22) -> list[int]:
    """Powers of 4 from ``smallest`` up to the first one >= ``largest`` (at most ``cap``)."""
    top = min(cap, max(smallest, 1 << max(0, math.ceil(math.log2(max(1, largest))))))
    sizes, size = [], smallest
    while size < top:
        sizes.append(size)
        size *= 4
    return [*sizes, top]


def _timed(fn, budget_s: float, device: torch.device, max_calls: int = 50, min_calls: int = 3) -> float:
    """Median seconds per call over ``min_calls`` to ``max_calls`` calls filling about ``budget_s``
    (at least three: one call of a large size is as likely to be an outlier as not)."""
    fn()  # warm-up
    times: list[float] = []
    deadline = clock.now() + budget_s
    while len(times) < max_calls and (len(times) < min_calls or clock.now() < deadline):
        start = clock.now()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock.now() - start)
    return statistics.median(times)


SUM_PROBE = 4  # messages a timed decode sums: the model charges each rank's message a share


def measure_costs(compressor: Compressor, sizes: Sequence[int], device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, budget_s: float = 0.02,
                  memory: Memory | None = None, members: int = 1) -> tuple[CostFit, CostFit, list]:
    """(encode fit, decode fit, samples) of ``compressor`` on ``device`` over ``sizes`` elements
    (each a fused buffer of ``members`` equal tensors: what a per-member compressor pays per member;
    for a compressor of matrices each member a matrix as near square as :func:`matrix_of` makes it,
    since PowerSGD passes a vector uncompressed).

    Timed is what CompressSync does per group around the compressor, not the compressor alone:
    encode = the compressor's preparation (DGC's momentum correction...), error-feedback compensate,
    compress, the local decompress error feedback needs, pack the payload into one message, update
    the residual; decode = one message's share of summing
    :data:`SUM_PROBE` received messages (unpack, decompress, add: ``decompress_sum``, which a
    sparse compressor does in one zeroed buffer for all). Works on copies, so the caller's
    per-tensor state (momentum, residuals, step counters) is untouched.
    """
    device = torch.device(device)
    comp = copy.deepcopy(compressor)
    mem = copy.deepcopy(memory) if memory is not None else Memory()
    gen = torch.Generator(device="cpu").manual_seed(0)
    samples = []
    for size in sizes:
        x = torch.randn(size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        name = f"profile/{size}"
        count = max(1, min(members, size))
        sizes_ = [size // count + (k < size % count) for k in range(count)]
        segments = ([matrix_of(n) for n in sizes_] if compressor.needs_matrices
                    else None if count == 1 else sizes_)

        def encode(x=x, name=name, segments=segments):
            compensated = mem.compensate(comp.precondition(x, name, segments), name)
            compressed = comp.compress(compensated, name, segments)
            local = comp.decompress(compressed)
            packing.pack(compressed.payload)
            mem.update(name, compensated, local.reshape(compensated.shape))
            comp.sent(name, local)

        compressed = comp.compress(x, name, segments)
        message = packing.pack(compressed.payload)

        def decode(compressed=compressed, message=message):
            comp.decompress_sum([compressed.with_payload(packing.unpack(message)) for _ in range(SUM_PROBE)])

        samples.append({"numel": size, "encode_s": _timed(encode, budget_s, device),
                        "decode_s": _timed(decode, budget_s, device) / SUM_PROBE})
    sizes_ = [s["numel"] for s in samples]
    return (CostFit.fit(sizes_, [s["encode_s"] for s in samples]),
            CostFit.fit(sizes_, [s["decode_s"] for s in samples]), samples)


def matrix_of(numel: int) -> Segment:
    """``numel`` elements as the matrix a compressor of matrices is timed on: rows a power of two
    as near sqrt(numel) as divides it (the grid's sizes are powers of 4: square). PowerSGD's work
    grows with rows x columns x rank, so per element it is about the same for any shape."""
    rows = 1 << (max(1, numel).bit_length() - 1) // 2
    while numel % rows:
        rows //= 2
    return Segment(numel, numel // rows)


def matrix_kept(compressor: Compressor, shape: Sequence[int], dtype: torch.dtype) -> float | None:
    """For a compressor of matrices (PowerSGD), what its payload of a tensor of this shape holds, in
    factor-sized elements over the tensor's elements: the ``kept`` fraction the cost model prices
    it by, which fused groups sum over their members (None for any other compressor)."""
    if not compressor.needs_matrices:
        return None
    numel = max(1, math.prod(shape))
    factor = torch.promote_types(dtype, torch.float32).itemsize
    return compressor.payload_bytes(tuple(shape), dtype) / factor / numel


def compressor_params(compressor: Compressor) -> dict[str, Any]:
    """The constructor arguments that rebuild ``compressor`` (its public attributes of those names)."""
    import inspect

    names = list(inspect.signature(type(compressor).__init__).parameters)[1:]
    return {k: getattr(compressor, k) for k in names if hasattr(compressor, k)}


def header_bytes(compressor: Compressor) -> int:
    """Bytes the wire header adds to one packed payload of a flat tensor."""
    compressed = copy.deepcopy(compressor).compress(torch.randn(1024), "profile/header")
    return int(packing.pack(compressed.payload).numel()) - compressed.nbytes


def profile_compressor(compressor: Compressor, largest: int, device: str | torch.device = "cpu",
                       budget_s: float = 0.02, memory: Memory | None = None) -> CompressorProfile:
    """Measure ``compressor`` (``none`` included: the executor's per-group work is not free) on the
    training device and, beside a GPU, on the CPU (the side device)."""
    sizes = size_grid(largest)
    encode, decode, samples = measure_costs(compressor, sizes, device, budget_s=budget_s, memory=memory)
    side_encode, side_decode = encode, decode
    if torch.device(device).type != "cpu":
        side_encode, side_decode, side_samples = measure_costs(compressor, sizes, "cpu", budget_s=budget_s,
                                                               memory=memory)
        for sample, side in zip(samples, side_samples, strict=True):
            sample.update(side_encode_s=side["encode_s"], side_decode_s=side["decode_s"])
    params = {} if compressor.name == "none" else compressor_params(compressor)
    members = member_costs(compressor, device, budget_s, memory) if compressor.per_member else {}
    return CompressorProfile(compressor.name, params, encode, decode, side_encode, side_decode,
                             header_bytes(compressor), samples, **members, target=class_path(compressor))


MEMBER_COSTS = ("member_encode_s", "member_decode_s", "fused_encode_per_element_s", "fused_decode_per_element_s")
MEMBER_PROBE = ((1 << 16, 1 << 22), 64)  # elements (small: members cost most; large: passes cost most), members
MEMBER_ROUNDS = 5


def member_costs(compressor: Compressor, device: str | torch.device = "cpu", budget_s: float = 0.02,
                 memory: Memory | None = None) -> dict[str, float]:
    """What fusing adds to a per-member compressor's encode and decode (the :data:`MEMBER_COSTS`):
    buffers of two sizes timed whole and as :data:`MEMBER_PROBE` members each. The extra grows with
    the members (a kernel or more each) and with the elements (a pass applying each member's scale),
    so two sizes with as many members separate the two."""
    (small, large), members = MEMBER_PROBE
    extra = []  # (encode, decode) seconds that fusing added, at each size
    for size in (small, large):
        # Whole and split alternately, the median difference: a host's drift between two long
        # timings of a large buffer is as big as what fusing adds to it.
        rounds = []
        for _ in range(MEMBER_ROUNDS):
            whole, split = (measure_costs(compressor, [size], device, budget_s=budget_s, memory=memory,
                                          members=count)[2][0] for count in (1, members))
            rounds.append({what: split[f"{what}_s"] - whole[f"{what}_s"] for what in ("encode", "decode")})
        extra.append({what: statistics.median(r[what] for r in rounds) for what in ("encode", "decode")})
    out = {}
    for what in ("encode", "decode"):
        per_element = max(0.0, (extra[1][what] - extra[0][what]) / (large - small))
        out[f"member_{what}_s"] = max(0.0, (extra[0][what] - per_element * small) / (members - 1))
        out[f"fused_{what}_per_element_s"] = per_element
    return out
