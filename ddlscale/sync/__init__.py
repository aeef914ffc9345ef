"""Gradient-synchronization backends behind the GradSync seam."""

from ddlscale.sync.base import GradSync, StepSyncStats
from ddlscale.sync.dense import DenseAllreduce

__all__ = ["DenseAllreduce", "GradSync", "StepSyncStats"]
