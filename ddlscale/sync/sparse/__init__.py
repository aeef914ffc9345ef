"""Sparse gradient synchronization: Zen and the baselines it is measured against."""

from ddlscale.sync.sparse.agsparse import AGSparseSync
from ddlscale.sync.sparse.gloo_sparse import GlooSparseSync
from ddlscale.sync.sparse.hashing import HashPartitioner
from ddlscale.sync.sparse.omnireduce import OmniReduceSync
from ddlscale.sync.sparse.partition import ContiguousPartitioner
from ddlscale.sync.sparse.sparcml import SparCMLSync
from ddlscale.sync.sparse.sparse_ps import SparsePSSync
from ddlscale.sync.sparse.sparse_sync import SparseSync
from ddlscale.sync.sparse.zen import ZenSync

__all__ = [
    "AGSparseSync", "ContiguousPartitioner", "GlooSparseSync", "HashPartitioner", "OmniReduceSync",
    "SparCMLSync", "SparsePSSync", "SparseSync", "ZenSync",
]
