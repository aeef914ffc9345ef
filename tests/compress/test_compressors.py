"""Property tests of the compressors and error-feedback memories (ddlscale.compress)."""

from __future__ import annotations

import io
import math
import threading
import types

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import ddlscale.compress as C
from ddlscale.compress import bits
from ddlscale.compress.compressor import count_of, pieces
from ddlscale.compress.dgc import MIN_SAMPLE
from ddlscale.paths import CONF_DIR

NAMES = sorted(C.COMPRESSORS)
# Odd sizes, a single element, empty tensors, and matrices (PowerSGD compresses only those).
SHAPES = [(0,), (1,), (1, 1), (7,), (3, 0), (13, 5), (64, 33), (1027,), (5000,), (16, 8, 3, 3)]


def make(name: str, **params) -> C.Compressor:
    return C.build_compressor(name, **params)


def kept_of(compressor: C.Compressor, compressed: C.Compressed) -> int | None:
    return None if compressor.fixed_size else compressed.payload[0].numel()


# -- every compressor: sizes, dtypes, honest byte counts --------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_bytes_equal_the_wire_and_shapes_round_trip(name, dtype):
    compressor = make(name)
    gen = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        g = torch.randn(shape, generator=gen).to(dtype)
        compressed = compressor.compress(g, name=f"t{shape}")
        assert all(isinstance(t, torch.Tensor) for t in compressed.payload)
        assert compressed.nbytes == compressor.payload_bytes(shape, dtype, kept_of(compressor, compressed))
        out = compressor.decompress(compressed)
        assert out.shape == g.shape and out.dtype == g.dtype
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_payload_bytes_formula_on_large_shapes(name):
    """The formula itself, where the index width and packing arithmetic matter (no tensors built)."""
    compressor = make(name)
    dense = 4 * 4096 * 4096
    size = compressor.payload_bytes((4096, 4096), torch.float32)
    assert 0 < size <= (2 * dense if name in ("threshold",) else dense)


def test_compression_ratios_match_their_formulas():
    n, f = 1_000_003, torch.float32
    k = math.ceil(0.01 * n)
    assert make("topk", ratio=0.01).payload_bytes(n, f) == k * 8  # fp32 value + int32 index
    assert make("randomk", ratio=0.01, seed=3).payload_bytes(n, f) == k * 4  # indices regenerated
    assert make("randomk", ratio=0.01).payload_bytes(n, f) == k * 8
    assert make("dgc", ratio=0.01).payload_bytes(n, f, kept=k + 5) == (k + 5) * 8
    assert make("signsgd").payload_bytes(n, f) == math.ceil(n / 8) + 1  # signs, and a vector's one live-row bit
    assert make("signsgd").payload_bytes((1000, 7), f) == math.ceil(7000 / 8) + math.ceil(1000 / 8)  # a bit per row
    assert make("efsignsgd").payload_bytes(n, f) == math.ceil(n / 8) + 4
    assert make("onebit").payload_bytes(n, f) == math.ceil(n / 8) + 8  # a vector: one column
    assert make("onebit").payload_bytes((1000, 7), f) == math.ceil(7000 / 8) + 8 * 7  # two means per column
    assert make("terngrad").payload_bytes(n, f) == math.ceil(n / 4) + 4
    assert make("qsgd", levels=7, bucket_size=128).payload_bytes(n, f) == math.ceil(n / 2) + 4 * math.ceil(n / 128)
    assert make("qsgd", levels=127, bucket_size=512).payload_bytes(n, f) == n + 4 * math.ceil(n / 512)
    assert make("qsgd", levels=1000).payload_bytes(n, f) == 2 * n + 4 * math.ceil(n / 512)
    assert make("int8").payload_bytes(n, f) == n + 4
    assert make("fp16").payload_bytes(n, f) == 2 * n
    assert make("powersgd", rank=4).payload_bytes((512, 3, 3, 64), f) == (512 + 576) * 4 * 4
    assert make("powersgd", rank=4).payload_bytes((512,), f) == 512 * 4  # vectors pass uncompressed


@pytest.mark.parametrize("name", NAMES)
def test_any_ranks_context_decodes_any_ranks_payload(name):
    """Rule 1 of the interface: two ranks (instances) compress their own tensors under one name; each
    decodes the other's payload with its own Context exactly as the sender would."""
    params = {"seed": 5} if name == "randomk" else {}
    a, b = make(name, **params), make(name, **params)
    gen = torch.Generator().manual_seed(15)
    for step in range(2):
        ca = a.compress(torch.randn(24, 20, generator=gen), "w")
        cb = b.compress(torch.randn(24, 20, generator=gen), "w")
        assert torch.equal(a.decompress(ca.with_payload(cb.payload)), b.decompress(cb)), step


@pytest.mark.parametrize("name", NAMES)
def test_context_without_data_decodes_like_the_senders(name):
    """A receiver's ``context`` (no data of its own) decodes the sender's payload exactly and keeps
    the per-name step in line with a rank that compressed."""
    params = {"seed": 5} if name == "randomk" else {}
    sender, receiver = make(name, **params), make(name, **params)
    gen = torch.Generator().manual_seed(16)
    for step in range(3):
        sent = sender.compress(torch.randn(24, 20, generator=gen), "w")
        ctx = receiver.context((24, 20), torch.float32, "w")
        assert torch.equal(receiver.decompress(C.Compressed(sent.payload, ctx)), sender.decompress(sent)), step
    assert receiver.state_dict()["steps"] == sender.state_dict()["steps"]


# -- sparsifiers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,ratio", [(1, 0.01), (7, 0.5), (1000, 0.01), (1027, 0.07), (5000, 1.0)])
def test_topk_keeps_exactly_k_largest(n, ratio):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    compressor = make("topk", ratio=ratio)
    values, idx = compressor.compress(g).payload
    k = max(1, math.ceil(round(ratio * n, 6)))
    assert values.numel() == idx.numel() == k
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx.long()] = True
    assert kept.sum() == k
    if k < n:
        assert g[kept].abs().min() >= g[~kept].abs().max()
    out = compressor.decompress(compressor.compress(g))
    assert torch.equal(out[kept], g[kept]) and not out[~kept].any()


def test_topk_ties_go_to_the_lowest_positions():
    g = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.5, -2.0])
    _, idx = make("topk", ratio=0.5).compress(g).payload  # k = 4: both 3s, then the first two 2s
    assert idx.tolist() == [1, 2, 3, 4]
    assert idx.dtype == torch.int32


def test_threshold_keeps_exactly_the_large_elements():
    g = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    compressor = make("threshold", threshold=1.0)
    out = compressor.decompress(compressor.compress(g))
    big = g.abs() >= 1.0
    assert torch.equal(out[big], g[big]) and not out[~big].any()


def test_dgc_keeps_between_k_and_2k_and_never_drops_a_larger_element():
    compressor = make("dgc", ratio=0.01, sample_ratio=0.01, warmup_steps=0)
    n = 50_000
    k = math.ceil(0.01 * n)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) ** 5,  # heavy tails
               torch.where(torch.rand(n, generator=gen) < 0.005, 100.0, 0.01), torch.ones(n)]
    for step, g in enumerate(samples * 3):
        values, idx = compressor.compress(g, "w").payload
        kept = torch.zeros(n, dtype=torch.bool)
        kept[idx.long()] = True
        assert k <= values.numel() <= 2 * k, step
        assert g[kept].abs().min() >= g[~kept].abs().max()
    # Too small to sample: exact top-k.
    assert compressor.compress(torch.randn(MIN_SAMPLE), "small").payload[0].numel() == math.ceil(0.01 * MIN_SAMPLE)


class FixedEstimate(C.DGC):
    """DGC with a chosen threshold estimate, to exercise each branch of the fallback rule."""

    def __init__(self, threshold: float, **params):
        super().__init__(**params)
        self.fixed = threshold

    def estimate(self, magnitude, name, k):
        return torch.tensor(self.fixed)


@pytest.mark.parametrize("threshold,expected", [
    (math.inf, "exact"),     # estimate too high: nothing passes -> exact top-k over everything
    (0.0, "exact"),          # estimate too low: everything passes -> exact top-k among candidates
    (8.79, "candidates"),    # 605 pass, within [k, 2k] = [500, 1000]: keep them all
])
def test_dgc_fallback_rule(threshold, expected):
    g = torch.arange(5000.0) / 500  # magnitudes 0 .. 9.998, distinct
    compressor = FixedEstimate(threshold, ratio=0.1)
    _, idx = compressor.compress(g).payload
    if expected == "exact":
        assert idx.tolist() == list(range(4500, 5000))
    else:
        assert idx.tolist() == list(range(4395, 5000))


# -- randomk --------------------------------------------------------------------------------------
def z_scores(samples: torch.Tensor, expected: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """Per element: (sample mean - expectation) / its standard error, from the known variance."""
    trials = samples.shape[0]
    stderr = (variance / trials).sqrt().clamp(min=1e-12)
    return (samples.double().mean(0) - expected) / stderr


@pytest.mark.parametrize("n,ratio", [(40, 0.25), (400, 0.05)])  # permutation / sparse-draw sampling
def test_randomk_unbiased_option_is_unbiased(n, ratio):
    g = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    trials = 3000
    k = math.ceil(ratio * n)
    compressor = make("randomk", ratio=ratio, unbiased=True)
    samples = torch.stack([compressor.decompress(compressor.compress(g, "g")) for _ in range(trials)])
    assert ((samples != 0).sum(1) == k).all()  # without replacement: k distinct positions
    variance = g**2 * (n / k - 1)  # x_i n/k with probability k/n, else 0
    assert z_scores(samples, g, variance).abs().max() < 5
    # Without the option the estimate is shrunk by k/n.
    plain = make("randomk", ratio=ratio, unbiased=False)
    samples = torch.stack([plain.decompress(plain.compress(g, "g")) for _ in range(trials)])
    variance = g**2 * (k / n) * (1 - k / n)
    assert z_scores(samples, g * k / n, variance).abs().max() < 5


def test_randomk_shared_seed_aligns_ranks_and_is_summable():
    a, b = make("randomk", ratio=0.1, seed=7), make("randomk", ratio=0.1, seed=7)
    assert a.summable and not make("randomk", ratio=0.1).summable
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ga, gb = torch.randn(500, generator=gen), torch.randn(500, generator=gen)
        ca, cb = a.compress(ga, "w"), b.compress(gb, "w")
        assert len(ca.payload) == 1  # values only: indices are regenerated
        assert torch.equal(ca.ctx.extra, cb.ctx.extra)
        # Rank a decodes b's payload with its own context; the sum of payloads decodes to the sum.
        assert torch.equal(a.decompress(ca.with_payload(cb.payload)), b.decompress(cb))
        summed = a.decompress(a.aggregate([ca, cb]))
        assert torch.allclose(summed, a.decompress(ca) + b.decompress(cb))


# -- quantizers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("levels,bucket", [(1, 16), (4, 64), (127, 8)])
def test_qsgd_unbiased_and_within_its_variance_bound(levels, bucket):
    g = torch.randn(64, generator=torch.Generator().manual_seed(levels), dtype=torch.float64)
    g[3] = 0.0
    compressor = make("qsgd", levels=levels, bucket_size=bucket, seed=11)
    trials = 3000
    samples = torch.stack([compressor.decompress(compressor.compress(g, "g")) for _ in range(trials)])
    # Exact per-element variance of the stochastic rounding: (norm / s)^2 p (1 - p).
    norms = g.view(-1, bucket).norm(dim=1).repeat_interleave(bucket)
    r = g.abs() * levels / norms
    p = r - r.floor()
    variance = (norms / levels) ** 2 * p * (1 - p)
    assert z_scores(samples, g, variance).abs().max() < 5
    bound = min(bucket / levels**2, math.sqrt(bucket) / levels) * g.square().sum()
    assert variance.sum() <= bound
    measured = (samples - g).square().sum(1).mean()
    assert measured <= bound * 1.1  # Monte-Carlo noise on a mean of 3000 squared errors


@pytest.mark.parametrize("clip", [None, 2.5])
def test_terngrad_unbiased(clip):
    """Unbiased for the gradient it quantizes: the gradient itself, or (the paper's default) the
    gradient clipped to 2.5 standard deviations."""
    raw = torch.randn(48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    raw[0] = 8.0  # an outlier the clipping cuts
    g = raw if clip is None else raw.clamp(-clip * raw.std(), clip * raw.std())
    compressor = make("terngrad", seed=2, clip=clip)
    samples = torch.stack([compressor.decompress(compressor.compress(raw, "g")) for _ in range(3000)])
    s = g.abs().max().float().double()  # the scale travels as float32
    assert set(samples.unique().tolist()) <= {-s.item(), 0.0, s.item()}
    variance = g.abs() * (s - g.abs())
    assert z_scores(samples, g, variance).abs().max() < 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_efsignsgd_scale_preserves_the_l1_norm(dtype):
    g = torch.randn(1001, generator=torch.Generator().manual_seed(4)).to(dtype)
    g[::7] = 0  # zeros decode to +scale and still count
    compressor = make("efsignsgd")
    out = compressor.decompress(compressor.compress(g))
    assert torch.isclose(out.double().abs().sum(), g.double().abs().sum(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    nonzero = g != 0
    assert torch.equal(out[nonzero].sign(), g[nonzero].sign())


# -- fusion: a fused group's members as if compressed alone --------------------------------------
# Top-k and DGC select over the whole group, randomk draws the group's positions: their own tests below.
FUSED_AS_ALONE = [n for n in NAMES if n not in ("topk", "dgc", "randomk")]
# Members of a fused buffer: vectors, an empty one, matrices; scales 1e-3 to 10 apart (the case:
# a 1e-3-scale layer beside unit-scale ones), a zero element and an all-zero row.
FUSED_SHAPES, FUSED_SCALES = [(5,), (0,), (13, 10), (1,), (8, 8), (700,)], [1.0, 1.0, 1e-3, 10.0, 1e-2, 1.0]


def fused_parts(gen: torch.Generator, dtype: torch.dtype) -> list[torch.Tensor]:
    parts = [(torch.randn(shape, generator=gen) * scale).to(dtype) for shape, scale in zip(FUSED_SHAPES, FUSED_SCALES,
                                                                                          strict=True)]
    parts[2][3, 4] = 0
    parts[4][2] = 0
    return parts


def replay_uniforms(compressors: list[C.Compressor], parts: list[torch.Tensor], gen: torch.Generator) -> None:
    """One draw of uniforms per element for the fused buffer ``group``; member k alone (``group#k``) gets
    its slice: the same draws, so a stochastic quantizer can be compared bit for bit (the group's own
    stream is another draw of the same distribution)."""
    draws = torch.rand(sum(p.numel() for p in parts), generator=gen)
    table = {"group": draws, **{f"group#{k}": piece for k, piece in enumerate(draws.split([p.numel() for p in parts]))}}
    for compressor in compressors:
        compressor.uniform = lambda name, like: table[name].to(like.dtype).reshape(like.shape)


@pytest.mark.parametrize("name", FUSED_AS_ALONE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_buffer_decodes_bit_for_bit_as_its_members_compressed_alone(name, dtype):
    """Given its members (with their matrix rows), one compression of the flat buffer decodes bit for bit
    as each member prepared and compressed by itself, over 3 steps of state (momenta, PowerSGD's Q):
    int8's scale, QSGD's buckets, TernGrad's sigma and scale, the signs' scale or zero rows, onebit's
    columns and PowerSGD's factors are each member's own; the elementwise ones have nothing to keep."""
    segments = [C.Segment.of(shape) for shape in FUSED_SHAPES]
    fused, alone = make(name), make(name)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        parts = fused_parts(gen, dtype)
        replay_uniforms([fused, alone], parts, gen)
        flat = torch.cat([p.reshape(-1) for p in parts])
        compressed = fused.compress(fused.precondition(flat, "group", segments), "group", segments)
        got = fused.decompress(compressed)
        want = torch.cat([alone.decompress(alone.compress(alone.precondition(p, f"group#{k}"), f"group#{k}")).reshape(-1)
                          for k, p in enumerate(parts)])
        assert torch.equal(got, want), (name, step)
        alone_bytes = sum(alone.payload_bytes(shape, dtype) for shape in FUSED_SHAPES)
        assert compressed.nbytes <= alone_bytes, (name, "fusion never adds bytes")
        if fused.per_member:  # the members' statistics travel: every member's bytes beyond the first's are there
            vectors = [C.Segment(p.numel()) for p in parts]
            flat_bytes = make(name).compress(flat, "vectors", vectors).nbytes
            assert flat_bytes <= fused.payload_bytes(flat.numel(), dtype) + fused.member_bytes * (len(parts) - 1)


def test_a_small_layer_fused_with_a_large_one_keeps_its_own_precision():
    """The issue's measurement: a 1e-3-scale layer fused with a unit-scale one under one scale per group
    (TernGrad) came out with a relative error of 24, against 1 alone. Per member, the small layer's
    root-mean-square error over 20 draws is what it is alone, and far below one scale's."""
    gen = torch.Generator().manual_seed(7)
    small, large = torch.randn(1000, generator=gen) * 1e-3, torch.randn(1000, generator=gen)
    both = torch.cat([small, large])
    for name in ("int8", "qsgd", "terngrad"):
        compressor = make(name, bucket_size=4096) if name == "qsgd" else make(name)  # one bucket over both

        def rms(segments, x=both, compressor=compressor):
            errors = [compressor.decompress(compressor.compress(x, "g", segments))[:1000] - small for _ in range(20)]
            return (torch.stack(errors).pow(2).mean(0).sum().sqrt() / small.norm()).item()

        error = {"fused": rms([1000, 1000]), "one scale": rms(None), "alone": rms(None, small)}
        assert error["fused"] < 1.2 * error["alone"] + 0.01 and error["one scale"] > 5 * error["fused"], (name, error)


@pytest.mark.parametrize("seed", [None, 4])
def test_randomk_samples_each_member_of_a_fused_buffer_as_if_alone(seed):
    """k = ceil(ratio * n) distinct positions inside every member, each scaled by its own n / k: a fused
    buffer is sampled as densely, tensor by tensor, as compressing each alone (and stays unbiased)."""
    segments = [5, 0, 130, 1, 3, 64, 4000]
    counts = [count_of(0.1, n) for n in segments]
    ends = torch.tensor(segments).cumsum(0)
    g = torch.randn(sum(segments), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fused, other_rank = (make("randomk", ratio=0.1, seed=seed, unbiased=True) for _ in range(2))
    trials, samples = 2000, []
    for _ in range(trials):
        compressed = fused.compress(g, "group", segments)
        idx = compressed.ctx.extra if seed is not None else compressed.payload[1]
        assert torch.bincount(torch.searchsorted(ends, idx.long(), right=True), minlength=len(segments)).tolist() == counts
        assert bool((idx[1:] > idx[:-1]).all())  # distinct, ascending
        assert compressed.nbytes <= fused.payload_bytes(g.numel(), g.dtype) + fused.member_bytes * (len(segments) - 1)
        if seed is not None:  # a shared seed draws the same positions on every rank
            assert torch.equal(other_rank.compress(g, "group", segments).ctx.extra, idx)
        samples.append(fused.decompress(compressed))
    member = torch.searchsorted(ends, torch.arange(g.numel()), right=True)
    n, k = torch.tensor(segments, dtype=torch.float64)[member], torch.tensor(counts, dtype=torch.float64)[member]
    assert z_scores(torch.stack(samples), g, g**2 * (n / k - 1)).abs().max() < 5  # unbiased, member by member




def test_topk_selects_over_the_whole_group():
    """Top-k of a fused buffer is top-k of the group (Cupcake's operator): k = ceil(ratio * N) of the
    largest magnitudes across members, the segments changing nothing."""
    segments = [C.Segment.of(shape) for shape in FUSED_SHAPES]
    parts = fused_parts(torch.Generator().manual_seed(5), torch.float32)
    flat = torch.cat([p.reshape(-1) for p in parts])
    topk = make("topk", ratio=0.05)
    fused = topk.compress(flat, "g", segments)
    assert fused.ctx.segments is None
    assert all(torch.equal(a, b) for a, b in zip(fused.payload, topk.compress(flat, "h").payload, strict=True))
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[fused.payload[1].long()] = True
    assert int(kept.sum()) == count_of(0.05, flat.numel())
    assert flat[kept].abs().min() >= flat[~kept].abs().max()  # across members
    assert not kept[5:135].any()  # the 1e-3-scale member sends nothing this step: its residual holds it


def test_dgc_selects_over_the_group_and_prepares_each_member_as_alone():
    """DGC's selection is the group's (k..2k of its numel, every kept magnitude >= every dropped one,
    across members); its momentum correction, masking and clipping are each member's: the fused
    group's velocity and preconditioned tensor are its members' alone, bit for bit."""
    segments = [C.Segment.of(shape) for shape in FUSED_SHAPES]
    sizes = [s.numel for s in segments]
    fused, alone = (make("dgc", ratio=0.05, momentum=0.9, clip_norm=1.0, warmup_steps=0) for _ in range(2))
    gen = torch.Generator().manual_seed(6)
    for step in range(3):
        parts = fused_parts(gen, torch.float32)
        flat = torch.cat([p.reshape(-1) for p in parts])
        prepared = fused.precondition(flat, "group", segments, ranks=4)
        want = [alone.precondition(p, f"group#{k}", ranks=4).reshape(-1) for k, p in enumerate(parts)]
        assert torch.equal(prepared, torch.cat(want)), step
        decoded = fused.decompress(fused.compress(prepared, "group", segments))
        kept = decoded != 0
        k = count_of(0.05, flat.numel())
        assert k <= int(kept.sum()) <= 2 * k
        assert prepared[kept].abs().min() >= prepared[~kept].abs().max()
        fused.sent("group", decoded)
        for name, piece in zip([f"group#{k}" for k in range(len(parts))], decoded.split(sizes), strict=True):
            alone.sent(name, piece)  # masking: each member's velocity zeroed where the group sent it
        velocity = fused.state_dict()["velocity"]["group"]
        assert torch.equal(velocity, torch.cat([alone.state_dict()["velocity"][f"group#{k}"] for k in range(len(parts))]))


class FakeMax:
    """A communicator of two ranks whose other rank holds ``other``: allreduce(MAX) in place."""

    size = 2

    def __init__(self, other: torch.Tensor):
        self.other, self.calls = other, []

    def allreduce(self, tensor, op):
        self.calls.append(tensor.numel())
        tensor.copy_(torch.maximum(tensor, self.other.to(tensor.dtype)))
        return types.SimpleNamespace(wait=lambda: None)


def test_terngrad_shares_each_members_scale_across_ranks():
    """Scaler sharing per member: one max-allreduce of a scale per member; each member (and each piece of
    one in a divisible scheme's partitions) then uses its own member's shared s, never another's."""
    segments = [C.Segment(n) for n in (50, 30, 20)]
    gen = torch.Generator().manual_seed(9)
    x = torch.cat([torch.randn(50, generator=gen), torch.randn(30, generator=gen) * 1e-3, torch.randn(20, generator=gen)])
    other = torch.tensor([0.5, 7e-3, 9.0])  # the other rank's scales: larger for the last two members
    fused, comm = make("terngrad", clip=None), FakeMax(other)
    own = torch.stack([p.abs().max() for p in x.split([50, 30, 20])])
    with fused.agreed(x, comm, segments):
        scales = fused.compress(x, "g", segments).payload[1]
    assert comm.calls == [3] and torch.equal(scales, torch.maximum(own, other))
    alone = make("terngrad", clip=None)
    for k, piece in enumerate(x.split([50, 30, 20])):
        with alone.agreed(piece, FakeMax(other[k: k + 1])):
            assert torch.equal(alone.compress(piece, f"m{k}").payload[1], scales[k: k + 1])
    # Two partitions (an alltoall): pieces [0:40] and [40:100], the second holding parts of all three members.
    cut = pieces(segments, [40, 60])
    with fused.agreed(x, FakeMax(other), segments):
        first = fused.compress(x[:40], "g/0", cut[0]).payload[1]
        second = fused.compress(x[40:], "g/1", cut[1]).payload[1]
    piece_own = torch.stack([p.abs().max() for p in x[40:].split([10, 30, 20])])
    assert torch.equal(first, torch.maximum(x[:40].abs().max(), scales[:1]))
    assert torch.equal(second, torch.maximum(piece_own, scales))  # the agreed s of each piece's own member


# -- zeros in the 1-bit encodings -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_unscaled_signs_send_an_all_zero_row_as_zero(name):
    """One bit per row says whether it holds a non-zero: an all-zero row (an embedding row absent from
    the batch), an all-zero vector, or such a row cut by a partition decodes to 0, so a rank with
    nothing there abstains from the vote instead of voting +1; a zero inside a live row is still +1."""
    compressor = make(name, momentum=0.0)
    table = torch.randn(6, 4, generator=torch.Generator().manual_seed(8))
    table[[1, 4]] = 0
    table[0, 2] = 0
    decoded = compressor.decompress(compressor.compress(table, "emb"))
    assert torch.equal(decoded[[1, 4]], torch.zeros(2, 4)) and decoded[0, 2] == 1.0
    live = table.abs().sum(1) != 0
    assert torch.equal(decoded[live], torch.where(table[live] < 0, -1.0, 1.0))
    assert torch.equal(compressor.decompress(compressor.compress(torch.zeros(9), "v")), torch.zeros(9))
    # A partition's piece of the table, from the middle of row 0 to the middle of row 5.
    piece = C.Segment(17, cols=4, start=3)
    got = compressor.decompress(compressor.compress(table.reshape(-1)[3:20], "piece", [piece]))
    assert torch.equal(got, decoded.reshape(-1)[3:20])
    # Four ranks vote on a row that is zero on three of them: the fourth's sign wins, not +1 from zeros.
    ranks = [torch.zeros(2, 3) for _ in range(4)]
    ranks[3][0] = torch.tensor([-1.0, -2.0, -3.0])
    vote = compressor.combine(compressor.decompress_sum([compressor.compress(r, f"r{k}") for k, r in enumerate(ranks)]), 4)
    assert torch.equal(vote, torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]))


def test_scaled_signs_and_onebit_send_an_all_zero_member_or_column_as_zero():
    """Where the encoding has a scale, it carries a zero: efsignsgd's all-zero member (scale 0), onebit's
    all-zero column (both means 0); a zero inside a live one decodes to its scale, and onebit's column
    sums stay exact."""
    efsignsgd, onebit = make("efsignsgd"), make("onebit")
    x = torch.cat([torch.zeros(10), torch.randn(10, generator=torch.Generator().manual_seed(2))])
    assert torch.equal(efsignsgd.decompress(efsignsgd.compress(x, "g", [10, 10]))[:10], torch.zeros(10))
    m = torch.randn(8, 3, generator=torch.Generator().manual_seed(3))
    m[:, 1] = 0
    m[2, 0] = 0
    out = onebit.decompress(onebit.compress(m, "w"))
    assert torch.equal(out[:, 1], torch.zeros(8))
    assert torch.allclose(out.sum(0), m.sum(0), atol=1e-6)


def test_segments_are_checked_and_ignored_where_they_do_not_apply():
    with pytest.raises(ValueError, match=r"segments \[3, 3\] do not split a tensor of 7 elements"):
        make("efsignsgd").compress(torch.ones(7), "g", [3, 3])
    x = torch.randn(40)
    topk = make("topk", ratio=0.25)
    assert topk.compress(x, "g", [20, 20]).ctx.segments is None  # a global top-k has no scale to split
    assert make("efsignsgd").compress(x, "g", [40]).ctx.segments is None  # one member: the plain payload


def test_onebit_two_means_keep_the_sum():
    g = torch.randn(999, generator=torch.Generator().manual_seed(6)) + 0.3
    compressor = make("onebit")
    out = compressor.decompress(compressor.compress(g))
    assert torch.isclose(out.sum(), g.sum(), rtol=1e-4)
    assert torch.allclose(out[g >= 0], g[g >= 0].mean()) and torch.allclose(out[g < 0], g[g < 0].mean())


def test_onebit_keeps_two_means_per_column():
    """Per column of the (first dim x the rest) matrix: elements decode to their column's side means,
    so every column keeps its own sum and scale; fused members and partition pieces keep them too."""
    g = torch.randn(40, 3, 2, generator=torch.Generator().manual_seed(6)) * torch.tensor([1.0, 10.0, 100.0, 0.1, 1.0, 3.0]).view(1, 3, 2)
    compressor = make("onebit")
    out = compressor.decompress(compressor.compress(g)).reshape(40, 6)
    matrix = g.reshape(40, 6)
    for j in range(6):
        column, decoded = matrix[:, j], out[:, j]
        assert torch.allclose(decoded[column >= 0], column[column >= 0].mean())
        assert torch.allclose(decoded[column < 0], column[column < 0].mean())
        assert torch.isclose(decoded.sum(), column.sum(), rtol=1e-4, atol=1e-5)
    # A piece of it that starts and ends inside rows (an alltoall partition) decodes as if its own
    # columns were those elements of the whole's columns it holds.
    piece = C.Segment(100, cols=6, start=9)
    part = matrix.reshape(-1)[9:109]
    got = compressor.decompress(compressor.compress(part, "piece", [piece]))
    column = (9 + torch.arange(100)) % 6
    for j in range(6):
        mine, decoded = part[column == j], got[column == j]
        assert torch.allclose(decoded[mine >= 0], mine[mine >= 0].mean())
        assert torch.allclose(decoded[mine < 0], mine[mine < 0].mean())


def test_signsgd_sends_signs_and_takes_the_majority_vote():
    compressor = make("signsgd")
    g = torch.tensor([0.3, -2.0, 0.0, -1e-9, 5.0])
    assert torch.equal(compressor.decompress(compressor.compress(g)), torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]))
    ranks = [torch.tensor([1.0, -1.0, 1.0, -3.0]), torch.tensor([2.0, -1.0, -1.0, 0.5]),
             torch.tensor([-5.0, 4.0, -1.0, 0.5]), torch.tensor([-1.0, 0.25, 7.0, -0.5])]
    items = [compressor.compress(x, f"rank{k}") for k, x in enumerate(ranks)]
    vote = compressor.combine(compressor.decompress_sum(items), len(items))
    # Signs per element: (+ + - -), (- - + +), (+ - - +), (- + + -): all ties, so 0 (the sign of the sum).
    assert torch.equal(vote, torch.tensor([0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(compressor.combine(torch.tensor([3.0, -1.0, -3.0]), 3), torch.tensor([1.0, -1.0, -1.0]))
    assert make("efsignsgd").combine(torch.tensor([3.0, -1.0]), 2).tolist() == [3.0, -1.0]  # summed


def test_signum_sends_the_sign_of_its_momentum():
    compressor = make("signum", momentum=0.5)
    g1, g2 = torch.tensor([1.0, -1.0, 4.0]), torch.tensor([-3.0, 0.5, -1.0])
    m1 = compressor.precondition(g1, "w")
    assert torch.equal(m1, 0.5 * g1)
    m2 = compressor.precondition(g2, "w")
    assert torch.equal(m2, 0.5 * m1 + 0.5 * g2)  # [-1.25, 0, 0.5]
    assert compressor.decompress(compressor.compress(m2, "w")).tolist() == [-1.0, 1.0, 1.0]
    assert torch.equal(make("signum", momentum=0.0).precondition(g1, "w"), g1)  # momentum 0: signSGD


def test_dgc_momentum_correction_accumulation_and_masking_by_hand():
    """DGC's Algorithm with momentum correction and factor masking on a 4-element tensor, k = 1:
    u_t = m u_{t-1} + g_t, v_t = v_{t-1} + u_t (the residual memory's p = e + u), send top-1 of v,
    zero v and u where sent. Checked against values worked out by hand."""
    dgc, memory = make("dgc", ratio=0.25, momentum=0.5), C.ResidualMemory()
    grads = [torch.tensor([1.0, 2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 0.0, -1.0]),
             torch.tensor([0.0, 0.0, 4.0, 0.0])]
    sent = []
    for g in grads:
        p = memory.compensate(dgc.precondition(g, "w"), "w")
        decoded = dgc.decompress(dgc.compress(p, "w"))
        memory.update("w", p, decoded)
        dgc.sent("w", decoded)
        sent.append(decoded.tolist())
    # t1: u = [1, 2, 0, -1], v = u: send 2 at index 1; v = [1, 0, 0, -1], u = [1, 0, 0, -1].
    # t2: u = 0.5 [1, 0, 0, -1] + [1, 0, 0, -1] = [1.5, 0, 0, -1.5]; v = [2.5, 0, 0, -2.5]: send 2.5 at 0
    #     (ties go to the lower position); v = [0, 0, 0, -2.5], u = [0, 0, 0, -1.5].
    # t3: u = [0, 0, 4, -0.75]; v = [0, 0, 4, -3.25]: send 4 at 2.
    assert sent == [[0.0, 2.0, 0.0, 0.0], [2.5, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 0.0]]
    assert memory.residual("w").tolist() == [0.0, 0.0, 0.0, -3.25]
    assert dgc.state_dict()["velocity"]["w"].tolist() == [0.0, 0.0, 0.0, -0.75]
    unmasked = make("dgc", ratio=0.25, momentum=0.5, momentum_masking=False)
    unmasked.precondition(grads[0], "w")
    unmasked.sent("w", torch.tensor([0.0, 2.0, 0.0, 0.0]))
    assert unmasked.state_dict()["velocity"]["w"].tolist() == [1.0, 2.0, 0.0, -1.0]


def test_dgc_clips_each_tensor_locally_and_warms_up_its_sparsity():
    dgc = make("dgc", ratio=0.001, clip_norm=2.0, warmup_steps=8)
    g = torch.cat([torch.full((4,), 3.0), torch.full((4,), 0.1)])  # member norms 6 and 0.2
    clipped = dgc.precondition(g, "w", [4, 4], ranks=4)  # each member to at most 2 / sqrt(4) = 1
    assert torch.allclose(clipped[:4].norm(), torch.tensor(1.0)) and torch.equal(clipped[4:], g[4:])
    densities = [dgc.density()]
    for _ in range(9):
        dgc.precondition(g, "w", [4, 4], ranks=4)
        densities.append(dgc.density())
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]
    assert make("dgc", ratio=0.1, warmup_steps=8).density() == 0.25  # never below ratio, never above 25%


def test_powersgd_compresses_each_member_of_a_fused_buffer_as_its_own_matrix():
    a, b, v = low_rank((12, 10), 1, seed=1), low_rank((6, 2, 4), 2, seed=2), torch.randn(5)
    fused, alone = make("powersgd", rank=2), make("powersgd", rank=2)
    segments = [C.Segment.of(a.shape), C.Segment.of(v.shape), C.Segment.of(b.shape)]
    compressed = fused.compress(torch.cat([a.reshape(-1), v, b.reshape(-1)]), "group", segments)
    assert [tuple(p.shape) for p in compressed.payload] == [(12, 2), (10, 2), (5,), (6, 2), (8, 2)]
    want = torch.cat([alone.decompress(alone.compress(t, f"m{k}")).reshape(-1) for k, t in enumerate((a, v, b))])
    assert torch.allclose(fused.decompress(compressed), want, atol=1e-4)
    with pytest.raises(ValueError, match="not whole rows"):
        fused.compress(a.reshape(-1)[3:50], "piece", [C.Segment(47, cols=10, start=3)])


def test_pieces_cut_members_into_consecutive_ranges():
    members = [C.Segment(3), C.Segment(0), C.Segment(5, cols=5), C.Segment(2)]
    cut = pieces(members, [4, 3, 3])
    assert [[p.numel for p in part] for part in cut] == [[3, 1], [3], [1, 2]]
    assert [(p.cols, p.start) for p in cut[1]] == [(5, 1)] and cut[2][0].start == 4
    assert [p.numel for p in pieces([C.Segment(10)], [4, 3, 3])[2]] == [3]
    assert [[(p.numel, p.start) for p in part] for part in pieces([C.Segment(6), C.Segment(4)], [5], 3)] \
        == [[(3, 3), (2, 0)]]


def test_int8_error_is_at_most_half_a_step():
    g = torch.randn(4097, generator=torch.Generator().manual_seed(7))
    compressor = make("int8")
    out = compressor.decompress(compressor.compress(g))
    step = g.abs().max() / 127
    assert (out - g).abs().max() <= step / 2 * (1 + 1e-5)
    assert compressor.decompress(compressor.compress(torch.zeros(5))).eq(0).all()


@pytest.mark.parametrize("name,wire,tolerance", [("fp16", torch.float16, 2**-11), ("bf16", torch.bfloat16, 2**-8)])
def test_half_casts_round_trip(name, wire, tolerance):
    compressor = make(name)
    exact = torch.randn(1000, generator=torch.Generator().manual_seed(8)).to(wire).float()
    assert torch.equal(compressor.decompress(compressor.compress(exact)), exact)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(9))
    out = compressor.decompress(compressor.compress(g))
    assert ((out - g).abs() <= tolerance * g.abs()).all()
    half = exact.to(torch.bfloat16)  # a bf16 gradient comes back as bf16
    assert compressor.decompress(compressor.compress(half)).dtype == torch.bfloat16


# -- PowerSGD -------------------------------------------------------------------------------------
def low_rank(shape: tuple[int, ...], rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n, m = shape[0], math.prod(shape[1:])
    return (torch.randn(n, rank, generator=gen) @ torch.randn(rank, m, generator=gen)).reshape(shape)


@pytest.mark.parametrize("shape,true_rank,rank", [((40, 30), 2, 2), ((16, 8, 3, 3), 3, 4), ((64, 50), 1, 4)])
def test_powersgd_exact_on_low_rank_matrices_in_one_step(shape, true_rank, rank):
    """A random first Q is in general position, so one power iteration spans col(M) exactly."""
    g = low_rank(shape, true_rank, seed=true_rank)
    compressor = make("powersgd", rank=rank)
    out = compressor.decompress(compressor.compress(g, "w"))
    assert torch.allclose(out, g, atol=1e-4 * g.abs().max())


def test_powersgd_warm_start_converges_on_full_rank_matrices():
    g = torch.randn(60, 40, generator=torch.Generator().manual_seed(1))
    u, s, vh = torch.linalg.svd(g)
    best = (u[:, :2] * s[:2]) @ vh[:2]  # the best rank-2 approximation
    compressor = make("powersgd", rank=2)
    errors = [(compressor.decompress(compressor.compress(g, "w")) - best).norm().item() for _ in range(30)]
    assert errors[-1] < 0.05 * errors[0] and errors[-1] < 0.05 * best.norm()


def test_powersgd_passes_vectors_and_unprofitable_matrices_through():
    compressor = make("powersgd", rank=4)
    for g in (torch.randn(100), torch.randn(3, 3), torch.randn(())):
        c = compressor.compress(g, f"v{g.shape}")
        assert len(c.payload) == 1 and torch.equal(compressor.decompress(c), g)


class ThreadGroup:
    """An in-process stand-in for a process group: ranks are threads, allreduce sums in place."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def allreduce_for(self, rank: int):
        def allreduce(t: torch.Tensor) -> None:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()
            t.copy_(total)
        return allreduce


def run_ranks(world: int, fn) -> list:
    """fn(rank, allreduce) on ``world`` threads sharing one ThreadGroup; their results in rank order."""
    group = ThreadGroup(world)
    results: list = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group.allreduce_for(rank))
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def test_powersgd_reduce_over_ranks_is_exact_on_a_common_low_rank_sum():
    """Ranks hold A B_r^T: their sum A (sum B_r)^T has rank r, so the factor allreduces reproduce it."""
    world, rank = 3, 2
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(50, rank, generator=gen)
    grads = [(a @ torch.randn(rank, 36, generator=gen)).reshape(50, 4, 9) for _ in range(world)]
    vectors = [torch.randn(7, generator=gen) for _ in range(world)]
    compressors = [make("powersgd", rank=rank) for _ in range(world)]

    def step(r: int, allreduce):
        return compressors[r].reduce(grads[r], "w", allreduce), compressors[r].reduce(vectors[r], "b", allreduce)

    results = run_ranks(world, step)
    total = torch.stack(grads).sum(0)
    for m, v in results:
        assert m.shape == total.shape
        assert torch.allclose(m, total, atol=1e-4 * total.abs().max())
        assert torch.allclose(v, torch.stack(vectors).sum(0))
    states = [c.state_dict()["q"]["w"] for c in compressors]
    assert all(torch.equal(states[0], s) for s in states)  # warm starts stay identical on every rank


# -- error feedback -------------------------------------------------------------------------------
def run_feedback(compressor: C.Compressor, memory: C.Memory, steps: int = 50, n: int = 301):
    gen = torch.Generator().manual_seed(10)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        total += g.double()
        p = memory.compensate(g, "w")
        out = compressor.decompress(compressor.compress(p, "w"))
        memory.update("w", p, out)
        sent += out.double()
    return sent, memory.residual("w").double(), total


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05}), ("efsignsgd", {}), ("onebit", {}),
                                         ("dgc", {"ratio": 0.1}), ("int8", {}), ("terngrad", {})])
def test_residual_memory_telescopes_over_50_steps(name, params):
    sent, residual, total = run_feedback(make(name, **params), C.ResidualMemory())
    assert torch.allclose(sent + residual, total, atol=1e-4)
    assert (sent - total).abs().max() > 1e-2  # the compressor did drop something


def test_decayed_memory_breaks_the_identity():
    sent, residual, total = run_feedback(make("topk", ratio=0.05), C.DecayedMemory(beta=0.9))
    gap = (sent + residual - total).norm()
    assert gap > 0.1 * total.norm()


def test_defaults_feed_back_what_biased_compressors_drop():
    """Biased compressors default to residual error feedback, unbiased ones (and the vote signs,
    which are no contraction) to none."""
    defaults = {name: make(name).default_memory for name in NAMES}
    assert {n for n, m in defaults.items() if m == "none"} == {"none", "qsgd", "terngrad", "randomk", "signsgd",
                                                                "signum"}
    assert make("randomk", unbiased=False).default_memory == "residual"
    assert make("signsgd", scaled=True, vote=False).name == "efsignsgd"  # one class, three configurations


def test_memories_keep_bf16_residuals_in_float32():
    memory = C.ResidualMemory()
    g = torch.randn(10).to(torch.bfloat16)
    p = memory.compensate(g, "w")
    assert p.dtype == torch.float32
    memory.update("w", p, torch.zeros(10))
    assert memory.residual("w").dtype == torch.float32
    with pytest.raises(ValueError, match="changed shape"):
        memory.compensate(torch.randn(11), "w")
    assert C.NoMemory().compensate(g, "w") is g


# -- checkpointed state ---------------------------------------------------------------------------
def through_bytes(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("name,params", [("powersgd", {"rank": 2}), ("signum", {}), ("qsgd", {"levels": 4}),
                                         ("randomk", {"ratio": 0.1}), ("terngrad", {}),
                                         ("dgc", {"ratio": 0.01, "momentum": 0.9, "warmup_steps": 6})])
def test_state_dict_restores_bit_identical_behaviour(name, params):
    gen = torch.Generator().manual_seed(13)
    grads = [torch.randn(48, 40, generator=gen) for _ in range(8)]

    def step(compressor, g):  # what a backend does once per step: prepare, compress, say what was sent
        compressed = compressor.compress(compressor.precondition(g, "w"), "w")
        compressor.sent("w", compressor.decompress(compressed))
        return compressed

    original = make(name, **params)
    for g in grads[:4]:
        step(original, g)
    restored = make(name, **params)
    restored.load_state_dict(through_bytes(original.state_dict()))
    fresh = make(name, **params)
    for g in grads[4:]:
        a, b, c = step(original, g), step(restored, g), step(fresh, g)
        assert all(torch.equal(x, y) for x, y in zip(a.payload, b.payload, strict=True))
        assert torch.equal(original.decompress(a), restored.decompress(b))
    assert not all(torch.equal(x, y) for x, y in zip(a.payload, c.payload, strict=True))  # state mattered


def test_memory_state_dict_round_trip():
    memory = C.ResidualMemory()
    p = memory.compensate(torch.randn(20), "w")
    memory.update("w", p, torch.zeros(20))
    other = C.ResidualMemory()
    other.load_state_dict(through_bytes(memory.state_dict()))
    g = torch.randn(20)
    assert torch.equal(memory.compensate(g, "w"), other.compensate(g, "w"))


# -- aggregation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_aggregate_only_where_summable(name):
    compressor = make(name)
    gen = torch.Generator().manual_seed(14)
    grads = [torch.randn(33, 8, generator=gen) for _ in range(3)]
    items = [compressor.compress(g, "w") for g in grads]
    if not compressor.summable:
        with pytest.raises(TypeError, match="cannot be summed"):
            compressor.aggregate(items)
        return
    summed = compressor.decompress(compressor.aggregate(items))
    expected = sum(compressor.decompress(c) for c in items)
    assert torch.allclose(summed, expected, atol=0.05 if name == "bf16" else 1e-2)  # summed on the wire dtype


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decompress_sum_adds_every_payload_in_order_and_leaves_them_untouched(name, dtype):
    """What a receiver does with every rank's payload equals decompressing each and adding them in
    rank order, bit for bit (exactly representable data), whatever shortcut the compressor takes."""
    compressor = make(name)
    gen = torch.Generator().manual_seed(15)
    items = [compressor.compress((torch.randint(-8, 9, (33, 8), generator=gen) / 4).to(dtype), f"rank{k}")
             for k in range(4)]
    payloads = [[p.clone() for p in item.payload] for item in items]
    want = compressor.decompress(items[0]).clone()
    for item in items[1:]:
        want = want + compressor.decompress(item)
    got = compressor.decompress_sum(items)
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(a, b) for item, before in zip(items, payloads, strict=True)
               for a, b in zip(item.payload, before, strict=True))
    assert torch.equal(compressor.decompress_sum(items[:1]), compressor.decompress(items[0]))
    with pytest.raises(ValueError, match="at least one"):
        compressor.decompress_sum([])


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,key", [
    ("topk", {"ratio": 1.5}, "compressor.ratio"),
    ("topk", {"ratio": 0}, "compressor.ratio"),
    ("randomk", {"ratio": -0.1}, "compressor.ratio"),
    ("randomk", {"unbiased": "yes"}, "compressor.unbiased"),
    ("randomk", {"seed": 1.5}, "compressor.seed"),
    ("dgc", {"sample_ratio": 2.0}, "compressor.sample_ratio"),
    ("threshold", {"threshold": -1.0}, "compressor.threshold"),
    ("powersgd", {"rank": 0}, "compressor.rank"),
    ("powersgd", {"rank": 1.5}, "compressor.rank"),
    ("qsgd", {"levels": 0}, "compressor.levels"),
    ("qsgd", {"bucket_size": 0}, "compressor.bucket_size"),
    ("signum", {"momentum": 1.0}, "compressor.momentum"),
    ("signsgd", {"vote": "yes"}, "compressor.vote"),
    ("dgc", {"momentum": -0.1}, "compressor.momentum"),
    ("dgc", {"clip_norm": 0.0}, "compressor.clip_norm"),
    ("dgc", {"warmup_steps": -1}, "compressor.warmup_steps"),
    ("dgc", {"momentum_masking": 1}, "compressor.momentum_masking"),
    ("terngrad", {"seed": "x"}, "compressor.seed"),
])
def test_bad_parameters_name_their_key(name, params, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make(name, **params)


def test_bad_names_and_memory_parameters():
    with pytest.raises(ValueError, match=r"memory\.beta"):
        C.DecayedMemory(beta=1.5)
    with pytest.raises(ValueError, match="compressor must be one of"):
        C.build_compressor("zip")
    with pytest.raises(ValueError, match="memory must be one of"):
        C.build_memory("forgetful")
    with pytest.raises(TypeError, match="floating-point"):
        make("topk").compress(torch.arange(5))


def test_every_compressor_and_memory_has_a_config_that_builds_it():
    for name, cls in C.COMPRESSORS.items():
        cfg = OmegaConf.load(CONF_DIR / "compressor" / f"{name}.yaml")
        if name == "none":
            continue  # `_target_: null` until the compress backend consumes it
        built = instantiate(cfg)
        assert isinstance(built, cls) and built.name == name
        assert vars(built) == vars(C.build_compressor(name))  # the config is the registry's preset
    for name, cls in C.MEMORIES.items():
        assert isinstance(instantiate(OmegaConf.load(CONF_DIR / "memory" / f"{name}.yaml")), cls)
    assert {p.stem for p in (CONF_DIR / "compressor").glob("*.yaml")} == set(C.COMPRESSORS)


# -- bit packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("width", bits.WIDTHS)
@pytest.mark.parametrize("count", [0, 1, 5, 8, 13, 64])
def test_bit_packing_round_trips(width, count):
    codes = torch.randint(0, 2**width, (count,), generator=torch.Generator().manual_seed(count), dtype=torch.uint8)
    packed = bits.pack(codes, width)
    assert packed.numel() == bits.packed_bytes(count, width)
    assert torch.equal(bits.unpack(packed, width, count), codes)


@pytest.mark.parametrize("width", bits.WIDTHS)
def test_lookup_segments_reads_each_code_through_its_own_segments_table(width):
    """Segments that start and end inside bytes, empty ones and one-code ones: every code decodes
    through its segment's row of values, as a lookup of that segment alone would."""
    gen = torch.Generator().manual_seed(width)
    for segments in [(7, 0, 1, 9, 16, 3), (8, 8), (1,), (0, 5, 0), (13, 2, 1, 1, 40)]:
        codes = torch.randint(0, 2**width, (sum(segments),), generator=gen, dtype=torch.uint8)
        values = torch.randn(len(segments), 2**width, generator=gen)
        owner = torch.arange(len(segments)).repeat_interleave(torch.tensor(segments))
        got = bits.lookup_segments(bits.pack(codes, width), width, segments, values)
        assert torch.equal(got, values[owner, codes.long()]), segments
