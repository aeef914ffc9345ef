"""Ways to start workers: local process groups here; emulated and real clusters beside it."""

from ddlscale.cluster.local import free_port, run_workers

__all__ = ["free_port", "run_workers"]
