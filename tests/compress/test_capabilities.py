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
