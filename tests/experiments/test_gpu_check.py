"""The prepared GPU check's compressed-sync section, run on CPU so it stays runnable for a GPU day."""

import pytest

from ddlscale.cluster import run_workers
from experiments.gpu_check import _compress_on, _sparse_on


@pytest.mark.multiprocess
def test_the_compressed_sync_check_passes_on_cpu():
    for result in run_workers(_compress_on, 2, "cpu"):
        assert result and all(v is True for v in result.values()), result


@pytest.mark.multiprocess
def test_the_sparse_sync_check_passes_on_cpu():
    for result in run_workers(_sparse_on, 2, "cpu"):
        assert result and all(v is True for v in result.values()), result
