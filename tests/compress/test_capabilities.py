"""What a compressor can do is declared on it, with one type per capability: the schemes, the memory
checks and the planners read these attributes and never probe for a method."""

import pytest
import torch

from ddlscale.compress import COMPRESSORS, build_compressor
from ddlscale.sync.compressed.schemes import scheme


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_every_compressor_declares_each_capability_with_its_type(name):
    comp = build_compressor(name)
    for flag in ("summable", "fixed_size", "per_member", "needs_matrices", "unbiased", "votes", "reduces_itself",
                 "shared_scale"):
        assert isinstance(getattr(comp, flag), bool), flag
    assert comp.wire_dtype is None or isinstance(comp.wire_dtype, torch.dtype)
    # Running its own collectives under allreduce means defining reduce(): declared where it is.
    assert comp.reduces_itself == any("reduce" in vars(k) for k in type(comp).__mro__)


def test_the_declared_capabilities_are_the_algorithms():
    assert build_compressor("powersgd").reduces_itself and not build_compressor("topk").reduces_itself
    assert build_compressor("signsgd").votes and build_compressor("signum").votes
    assert not build_compressor("efsignsgd").votes  # scaled signs summed, no vote
    assert build_compressor("fp16").wire_dtype == torch.float16 and build_compressor("bf16").wire_dtype == torch.bfloat16
    assert build_compressor("int8").wire_dtype is None
    assert build_compressor("terngrad").shared_scale and not build_compressor("terngrad", shared_scale=False).shared_scale


def test_the_schemes_refuse_by_the_declared_capabilities():
    with pytest.raises(ValueError, match="majority vote"):
        scheme("alltoall").check(build_compressor("signsgd"), "sync.comm")
    scheme("alltoall").check(build_compressor("efsignsgd"), "sync.comm")
    with pytest.raises(ValueError, match="allreduce only"):
        scheme("allgather").check(build_compressor("powersgd"), "sync.comm")
    scheme("allreduce").check(build_compressor("powersgd"), "sync.comm")


def test_counts_of_is_count_of_on_every_size():
    import numpy as np

    from ddlscale.compress.compressor import count_of, counts_of

    sizes = np.array([0, 1, 2, 7, 99, 100, 101, 1000, 12345, 2**31 - 1, 2**31 + 5, 3 * 10**9], dtype=np.int64)
    sizes = np.concatenate([sizes, np.random.default_rng(0).integers(0, 10**8, 2000)])
    for ratio in (0.001, 0.01, 0.07, 0.1, 1 / 3, 0.5, 0.999, 1.0):
        assert counts_of(ratio, sizes).tolist() == [count_of(ratio, int(n)) for n in sizes.tolist()], ratio


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_payload_bytes_many_is_payload_bytes_of_each(name):
    import numpy as np

    comp = build_compressor(name)
    sizes = np.array([1, 3, 64, 100, 1000, 4097, 123457, 2**31 + 3], dtype=np.int64)
    kept = np.array([-1, 1, 5, -1, 10, 40, -1, 7], dtype=np.int64)
    for dtype in (torch.float32, torch.float16):
        for given in (None, kept):
            many = comp.payload_bytes_many(sizes, dtype, given)
            one = [comp.payload_bytes(int(n), dtype, None if given is None or k < 0 else int(k))
                   for n, k in zip(sizes.tolist(), kept.tolist(), strict=True)]
            assert many.tolist() == [float(b) for b in one], (dtype, given)
