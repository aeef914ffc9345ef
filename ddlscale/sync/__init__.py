"""Gradient-synchronization backends behind the GradSync seam."""

from ddlscale.sync.dense import DenseAllreduce
from ddlscale.sync.grad_sync import GradSync, StepSyncStats

__all__ = ["DenseAllreduce", "GradSync", "StepSyncStats"]
