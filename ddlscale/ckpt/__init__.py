"""Checkpointing: the whole training state, the tiers that keep it, and where replicas go.

Selected by ``ckpt=`` alone (``none``, ``disk``, ``gemini``). Where to look:

* :mod:`~ddlscale.ckpt.checkpointer` — ``Checkpointer``, the callback every tier subclasses (when to save,
  what to restore, summary figures) and its launch hooks (``validate_launch``, ``services``).
* :mod:`~ddlscale.ckpt.state` — a rank's state as bytes: capture, snapshot stream, RNG, data
  position, resharding to another world size.
* :mod:`~ddlscale.ckpt.version` — a committed version: manifest, checksums, atomic storage, loading.
* :mod:`~ddlscale.ckpt.disk` — ``ckpt=disk``, the persistent tier in torch.distributed.checkpoint format.
* :mod:`~ddlscale.ckpt.gemini` — ``ckpt=gemini``: in-memory replicas on peers' agents, their
  placement, the commit protocol, the job's store, launching and draining.

The fault and hostile-client drills are in :mod:`ddlscale.testing`.
"""

from importlib import import_module
from typing import Any

# Loaded on first use: the replica agent, the drain and the control tool import this package too, and
# must not pay for Lightning's import (seconds) every time a machine's agent starts.
_EXPORTS = {
    "HIGHFREQ": "checkpointer", "Checkpointer": "checkpointer",
    "DataPosition": "state.data", "RANK_STATE_KEY": "state.shard", "SYNC_STATE_KEY": "state.shard",
    "Shard": "state.shard", "assemble": "state.shard", "capture_shard": "state.shard", "decode": "state.shard",
    "restore_local": "state.shard",
    "ManifestCheckpointIO": "version.io", "load_version": "version.io", "Manifest": "version.manifest",
    "ManifestError": "version.manifest", "ShardRecord": "version.manifest", "read_manifest": "version.manifest",
    "verify": "version.manifest",
    "DiskCheckpointer": "disk.disk_checkpointer", "find_resumable": "disk.disk_checkpointer",
    "GeminiCheckpointer": "gemini.gemini_checkpointer", "PlacementPlan": "gemini.placement",
    "monte_carlo": "gemini.placement", "paper_bound": "gemini.placement", "recovery_probability": "gemini.placement",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddlscale.ckpt' has no attribute {name!r}")
    return getattr(import_module(f"ddlscale.ckpt.{_EXPORTS[name]}"), name)
