"""Checkpointing: the whole training state, tiers that keep it, and where replicas go.

Selected by ``ckpt=`` alone (``ckpt=none``, ``ckpt=disk``); the app builds the tier's callback from
the config and, when the tier names a version to resume from, passes it to ``trainer.fit(ckpt_path=)``.

Modules, one job each:

* :mod:`~ddlscale.ckpt.state` — what a rank's state is, as bytes. ``capture_shard(trainer,
  batch_idx, with_shared)`` -> :class:`Shard` (``rank``, immutable ``data`` bytes, ``checksum``),
  taken at ``on_train_batch_end``; ``decode(bytes, checksum)`` -> payload; ``assemble(shared_payload,
  own_payload)`` -> the dict Lightning restores; ``restore_local(trainer, local)`` at train start.
  The shared part (Lightning's checkpoint: parameters, optimizer state with step counters, LR
  schedulers, loop progress, callback states) is identical on all data-parallel ranks, so one
  rank's copy suffices; the local part (RNG streams, data position, sync-backend state) is per rank.
* :mod:`~ddlscale.ckpt.manifest` — the commit record of a version: ``Manifest(step, world_size,
  shards=(ShardRecord(rank, file, bytes, checksum), ...), shared_rank, tier, placement)``, written
  last and atomically; ``verify`` re-hashes every shard. The ``tier`` and ``placement`` fields are
  for tiers that do not keep files (a peer-memory tier records where the replicas live there).
* :mod:`~ddlscale.ckpt.io` — ``ManifestCheckpointIO``: Lightning loads a version through its
  CheckpointIO plugin point; ``load_version(manifest_path, rank)`` is the same as a function.
* :mod:`~ddlscale.ckpt.base` — ``Checkpointer``, the callback every tier subclasses: schedule
  (every K steps or HighFreq), restore of RNG and data position, ``summary.json`` figures. A tier
  implements ``save(trainer, batch_idx)`` (every rank, same step, collectives allowed) and
  ``resume_path(world_size)`` (launcher side, before workers start).
* :mod:`~ddlscale.ckpt.disk` — ``DiskCheckpointer`` (``ckpt=disk``): atomic, checksummed versions
  in torch.distributed.checkpoint format plus a manifest; ``keep``, ``bandwidth`` throttling,
  ``async_save``, ``resume=auto``.
* :mod:`~ddlscale.ckpt.dcp` — the DCP layout: ``DcpWriter`` (``dcp.async_save`` / ``dcp.save``, rank 0
  commits), ``DcpVersion`` (reads a version back through the manifest's JSON index, never unpickling).
* :mod:`~ddlscale.ckpt.reshard` — a version of N ranks restored on M: local state remapped, sync
  states handed to the backend to merge.
* :mod:`~ddlscale.ckpt.storage` — ``write_atomic`` (temporary name, fsync, rename, fsync dir).
* :mod:`~ddlscale.ckpt.placement` — ``PlacementPlan(N, m, kind)`` (group / mixed / ring):
  ``holders_of(shard)``, ``replicas_of(machine)``, ``peers_of``, ``recovery_source``; exact
  recovery probability, Gemini's bound, Monte-Carlo.

Gemini (``ckpt=gemini``), the peer-memory tier, adds:

* :mod:`~ddlscale.ckpt.snapshot` — the state as a byte stream (JSON plus raw tensors, never pickle) sent
  straight from live tensors (parameters and optimizer state; the rest copied at capture), rebuilt bit
  for bit; disk shards use the same stream.
* :mod:`~ddlscale.ckpt.auth` — the job's secret and the keys it derives (agent messages, store
  records, replica MACs).
* :mod:`~ddlscale.ckpt.replica` — the authenticated agent wire protocol and its client;
  :mod:`~ddlscale.ckpt.agent` — the per-machine agent: two reserved buffers per owner, MAC on END,
  fencing from the signed manifest and incarnation, heartbeats, root election.
* :mod:`~ddlscale.ckpt.interleave` — gaps between training collectives, the chunk plan, the sender
  with its staging sub-buffers (modes gemini / unpipelined / blocking).
* :mod:`~ddlscale.ckpt.kvstore` — the job's keys in torch's TCPStore or in etcd (``ckpt.store=etcd``), every trusted value signed;
  the manifest is one key.
* :mod:`~ddlscale.ckpt.gemini` — ``GeminiCheckpointer``: capture, commit, recovery (local, peer,
  persistent fallback agreed by all ranks).
* :mod:`~ddlscale.ckpt.launch` — secret, store and agents for cluster=local / emulated;
  :mod:`~ddlscale.ckpt.drain` — a launch's committed version to disk when it ends;
  :mod:`~ddlscale.ckpt.control`, :mod:`~ddlscale.ckpt.drill` and :mod:`~ddlscale.ckpt.security_drill` —
  watching a job, failure drills, the hostile-client drill.
"""

from importlib import import_module
from typing import Any

# Loaded on first use: the replica agent, the drain and the control tool import this package too, and
# must not pay for Lightning's import (seconds) every time a machine's agent starts.
_EXPORTS = {
    "HIGHFREQ": "base", "Checkpointer": "base", "DataPosition": "data", "DiskCheckpointer": "disk",
    "find_resumable": "disk", "GeminiCheckpointer": "gemini", "ManifestCheckpointIO": "io", "load_version": "io",
    "Manifest": "manifest", "ManifestError": "manifest", "ShardRecord": "manifest", "read_manifest": "manifest",
    "verify": "manifest", "PlacementPlan": "placement", "monte_carlo": "placement", "paper_bound": "placement",
    "recovery_probability": "placement", "RANK_STATE_KEY": "state", "SYNC_STATE_KEY": "state", "Shard": "state",
    "assemble": "state", "capture_shard": "state", "decode": "state", "restore_local": "state",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddlscale.ckpt' has no attribute {name!r}")
    return getattr(import_module(f"ddlscale.ckpt.{_EXPORTS[name]}"), name)
