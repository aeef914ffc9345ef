"""The native kernels (ddlscale/csrc/zen_cpu.cpp) against their pure-PyTorch references in
ddlscale.sync.sparse.kernels, bit for bit, and the fallback to those references when the kernels
cannot be built.

The extension is built once (cached on disk under $DDLSCALE_EXT_DIR or ~/.cache/ddlscale/ext);
without a compiler or ninja the comparisons skip, saying so, and the fallback tests still run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from ddlscale.sync.sparse import kernels, native
from ddlscale.sync.sparse.hashing import HashPartitioner
from ddlscale.sync.sparse.kernels import (
    merge_rows_reference,
    owned_sets_reference,
    pack_bits,
    pack_bits_reference,
    partition_reference,
    server_of_reference,
    split_by_server,
    split_by_server_reference,
    unpack_bits,
    unpack_bits_reference,
)

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MASK64 = (1 << 64) - 1
C1, C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


@pytest.fixture(scope="module")
def ops():
    try:
        return native.build("cpu")
    except native.NativeUnavailable as error:
        if error.missing_tool:
            pytest.skip(f"native CPU kernels cannot be built here: {error}")
        raise


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes: NaN payloads and -0.0 count, unlike torch.equal."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def same_sums(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical but for NaN payloads: a sum of two NaNs may carry either one's payload, and
    bf16/fp16 arithmetic goes through float, which canonicalizes them; a copied row keeps its bits."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    keep = ~torch.isnan(a)
    return same_bits(a[keep], b[keep])


def unfmix64(h: int) -> int:
    """The input fmix64 maps to h (x ^= x >> 33 undoes itself; the multipliers are odd, so invertible)."""
    h ^= h >> 33
    h = h * pow(C2, -1, 1 << 64) & MASK64
    h ^= h >> 33
    h = h * pow(C1, -1, 1 << 64) & MASK64
    return h ^ (h >> 33)


def as_int64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def random_indices(count: int, numel: int, g: torch.Generator) -> torch.Tensor:
    picked = torch.randint(0, numel, (count,), generator=g, dtype=torch.int64)
    return torch.cat([torch.tensor([0, numel - 1]), picked])  # both ends of the index space


def with_nans(values: torch.Tensor) -> torch.Tensor:
    """Special values at the front: quiet NaN, NaN with a payload, -0.0, inf."""
    k = min(4, values.shape[0])
    special = torch.tensor([float("nan"), float("nan"), -0.0, float("inf")], dtype=torch.float64)[:k]
    values[:k] = special.to(values.dtype).reshape(-1, *([1] * (values.dim() - 1)))
    if values.dtype == torch.float32 and k > 1:
        values.view(torch.int32)[1] = 0x7FC0_0001  # payload must survive
    return values


def test_server_of_is_bit_exact(ops):
    g = torch.Generator().manual_seed(0)
    for numel in (1, 7, 1000, 2**31 - 1, 2**40):
        for seed in (0, 0x5EED, 2**63 - 1):
            indices = random_indices(2000, numel, g)
            for n in (*range(1, 9), 12, 1000, 1_000_003, 2**62 + 1, 2**63 - 1):
                assert torch.equal(ops.server_of(indices, seed, n), server_of_reference(indices, seed, n)), (numel, n)
    full = torch.randint(-(2**63), 2**63 - 1, (10_000,), generator=g, dtype=torch.int64)  # negatives too
    assert torch.equal(ops.server_of(full, 3, 7), server_of_reference(full, 3, 7))
    assert ops.server_of(torch.empty(0, dtype=torch.int64), 1, 3).numel() == 0


def test_modulo_at_the_edges_of_the_hash_range(ops):
    """Indices whose hash is 0, 1, 2^63 - 1, 2^64 - 1 and multiples of n (+-1) near 2^63: the
    multiply-shift modulo in C++ must agree with % everywhere."""
    seed = 0x5EED
    for n in (3, 5, 6, 7, 1000, 1_000_003, 2**62 + 1, 2**63 - 1):
        top = (1 << 63) - 1
        targets = {0, 1, top, top + 1, MASK64, top - top % n, top - top % n - 1, n - 1, n, n + 1}
        hashes = [t & MASK64 for t in targets if t >= 0]
        indices = torch.tensor([as_int64(unfmix64(h) ^ seed) for h in hashes], dtype=torch.int64)
        expected = torch.tensor([(h & top) % n for h in hashes], dtype=torch.int64)
        assert torch.equal(server_of_reference(indices, seed, n), expected)
        assert torch.equal(ops.server_of(indices, seed, n), expected), n


def test_partition_and_split_are_bit_exact(ops):
    g = torch.Generator().manual_seed(1)
    for case in range(40):
        numel = int(torch.randint(1, 10**6, (1,), generator=g))
        count = [0, 1, 5, 300, 40_000][case % 5]
        indices = random_indices(count, numel, g) if count else torch.empty(0, dtype=torch.int64)
        dtype = DTYPES[case % len(DTYPES)]
        values = with_nans(torch.randn(indices.numel(), generator=g).to(dtype))
        n = case % 8 + 1
        seed = int(torch.randint(0, 2**62, (1,), generator=g))
        got_idx, got_val, got_counts = ops.partition(indices, values, seed, n)
        ref_idx, ref_val, ref_counts = partition_reference(indices, values, seed, n)
        assert got_counts.tolist() == ref_counts and torch.equal(got_idx, ref_idx) and same_bits(got_val, ref_val)
        server = server_of_reference(indices, seed, n)
        got_idx, got_val, got_counts = ops.group_by_server(server, indices, values, n)
        ref_idx, ref_val, ref_counts = split_by_server_reference(server, indices, values, n)
        assert got_counts.tolist() == ref_counts and torch.equal(got_idx, ref_idx) and same_bits(got_val, ref_val)


def test_values_of_every_row_width_and_alignment(ops):
    """Values move as raw rows: 1-16 byte rows, multi-column rows, and a view whose start is not
    aligned to its row width all come out bit-identical."""
    g = torch.Generator().manual_seed(2)
    indices = random_indices(5000, 10**5, g)
    m = indices.numel()
    base = torch.randn(m + 1, 2, generator=g).to(torch.float16)
    cases = [torch.randint(-100, 100, (m,), generator=g, dtype=torch.int8),
             torch.randn(m, generator=g, dtype=torch.float64).to(torch.complex128),
             torch.randn(m, 3, generator=g), base.view(-1)[1: 2 * m + 1].view(m, 2),
             torch.rand(m, generator=g) > 0.5]
    for values in cases:
        got = ops.partition(indices, values, 9, 5)
        ref = partition_reference(indices, values, 9, 5)
        assert got[2].tolist() == ref[2] and torch.equal(got[0], ref[0]) and same_bits(got[1], ref[1]), values.dtype


def test_owned_sets_are_bit_exact(ops):
    for numel in (0, 1, 17, 100_003):
        for n in range(1, 9):
            owned, counts = ops.owned_sets(numel, 0x5EED, n)
            ref_owned, ref_counts = owned_sets_reference(numel, 0x5EED, n)
            assert counts.tolist() == ref_counts and owned.dtype == ref_owned.dtype == torch.int32
            assert torch.equal(owned, ref_owned)


def _row_sets(g, count, universe, width, dtype):
    ids = torch.randperm(universe, generator=g)[:count].sort().values
    return ids, with_nans(torch.randn(count, width, generator=g).to(dtype)) if count else \
        torch.empty((0, width), dtype=dtype)


def test_merge_rows_is_bit_exact(ops):
    """The linear merge of two sorted row sets: the union, shared rows lower + upper, NaN payloads,
    -0.0 and inf included; widths 0 (id sets alone), 1 and 64; empty sides."""
    g = torch.Generator().manual_seed(6)
    for case in range(24):
        dtype, width = DTYPES[case % len(DTYPES)], (0, 1, 64)[case % 3]
        universe = (5, 300, 100_000)[case % 3]
        sizes = [(0, 0), (0, 3), (4, 0), (5, 5), (200, 250), (3000, 2000)][case % 6]
        lower = _row_sets(g, min(sizes[0], universe), universe, width, dtype)
        upper = _row_sets(g, min(sizes[1], universe), universe, width, dtype)
        got, ref = ops.merge_rows(*lower, *upper), merge_rows_reference(*lower, *upper)
        assert torch.equal(got[0], ref[0]) and same_sums(got[1], ref[1]), (case, dtype, width)


def test_bitmaps_are_bit_exact(ops):
    g = torch.Generator().manual_seed(3)
    for length in (*range(0, 70), 1000, 100_003):
        for p in (0.0, 0.1, 0.5, 1.0):
            mask = torch.rand(length, generator=g) < p
            bitmap = ops.pack_bits(mask)
            assert torch.equal(bitmap, pack_bits_reference(mask)), (length, p)
            for k in {0, max(length - 3, 0), length, length + 5, 8 * bitmap.numel()}:
                assert torch.equal(ops.unpack_bits(bitmap, k), unpack_bits_reference(bitmap, k)), (length, k)
    noise = torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8)
    assert torch.equal(ops.unpack_bits(noise, 32_770), unpack_bits_reference(noise, 32_770))


def test_integrated_entry_points_match_the_references(ops):
    """What the sync backends call (HashPartitioner, split_by_server, pack/unpack_bits) = references."""
    g = torch.Generator().manual_seed(4)
    part = HashPartitioner(5, seed=11)
    indices = random_indices(10_000, 2**20, g)
    values = torch.randn(indices.numel(), generator=g)
    assert torch.equal(part.server_of(indices), server_of_reference(indices, part.seed, 5))
    server = part.server_of(indices)
    got, ref = split_by_server(server, indices, values, 5), split_by_server_reference(server, indices, values, 5)
    assert got[2] == ref[2] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    got = part.group(indices, values)
    assert got[2] == ref[2] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    owned = part.owned(4099)
    ref_owned, ref_counts = owned_sets_reference(4099, part.seed, 5)
    assert torch.equal(torch.cat(owned), ref_owned) and [o.numel() for o in owned] == ref_counts
    mask = torch.rand(1001, generator=g) < 0.3
    assert torch.equal(pack_bits(mask), pack_bits_reference(mask))
    assert torch.equal(unpack_bits(pack_bits(mask), 1001), mask)


def _fallback_results() -> list[bool]:
    g = torch.Generator().manual_seed(5)
    indices = random_indices(3000, 10**6, g)
    values = torch.randn(indices.numel(), generator=g).to(torch.bfloat16)
    mask = torch.rand(77, generator=g) < 0.5
    got = kernels.partition(indices, values, 7, 3)
    ref = partition_reference(indices, values, 7, 3)
    lower, upper = indices.unique()[:100], indices.unique()[50:200]
    merged = kernels.merge_rows(lower, torch.ones(100, 2), upper, torch.ones(150, 2))
    return [torch.equal(kernels.server_of(indices, 7, 3), server_of_reference(indices, 7, 3)),
            got[2] == ref[2] and torch.equal(got[0], ref[0]) and same_bits(got[1], ref[1]),
            torch.equal(kernels.pack_bits(mask), pack_bits_reference(mask)),
            torch.equal(kernels.unpack_bits(kernels.pack_bits(mask), 77), mask),
            torch.equal(merged[0], indices.unique()[:200]) and float(merged[1].sum()) == 2 * 250]


@pytest.mark.parametrize("how", ["disabled", "no-compiler", "build-fails"])
def test_fallback_warns_once_and_gives_the_same_results(how, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})  # forget this process's loaded extension
    if how == "disabled":
        monkeypatch.setenv("DDLSCALE_NATIVE", "0")
        reason = "DDLSCALE_NATIVE=0"
    elif how == "no-compiler":  # nothing cached in a fresh directory, and no compiler to build it
        monkeypatch.setenv("DDLSCALE_EXT_DIR", str(tmp_path))
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
        reason = "no C++ compiler"
    else:  # the compiler rejects the build (here: a flag it does not know)
        if native.shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler to fail")
        monkeypatch.setenv("DDLSCALE_EXT_DIR", str(tmp_path))
        monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS, "--no-such-flag"])
        reason = "build failed"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert all(_fallback_results()) and all(_fallback_results())
    messages = [str(w.message) for w in caught if issubclass(w.category, native.NativeKernelWarning)]
    assert len(messages) == 1 and reason in messages[0], messages
    assert native.cpu_ops() is None and reason in native.unavailable_reason("cpu")


@pytest.mark.multiprocess
def test_env_switch_in_a_fresh_process():
    """DDLSCALE_NATIVE=0 in a new process: the warning says why, the partitioner still works."""
    code = ("import warnings; warnings.simplefilter('always'); import torch\n"
            "from ddlscale.sync.sparse import HashPartitioner, native\n"
            "from ddlscale.sync.sparse.kernels import server_of_reference\n"
            "x = torch.arange(1000)\n"
            "assert torch.equal(HashPartitioner(4, 9).server_of(x), server_of_reference(x, 9, 4))\n"
            "assert native.cpu_ops() is None\n")
    env = {**os.environ, "DDLSCALE_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("NativeKernelWarning") == 1 and "DDLSCALE_NATIVE=0" in done.stderr
