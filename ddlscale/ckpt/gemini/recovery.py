"""Recovery of a Gemini job: the committed version back from peers' memory, else from the persistent tier
(a directory, or the emulated cluster's storage machine).

``resume=auto``, decided before workers start: the newest committed manifest names the version
(:meth:`~GeminiRecovery.resume_path`) — the store's, or a newer one an agent has seen when the store
went back (:func:`~ddlscale.ckpt.gemini.kvstore.consult_agents`). Then every rank fetches its own
replica — from its machine's agent (software failure), else from a live holder (machine failure, the
replacement took the rank) — and checks its MAC. All ranks agree by one collective: if any rank found no intact replica (whole
group lost, MAC mismatch), everyone loads the newest persistent checkpoint instead. Restoring parses a
snapshot stream (JSON and raw tensors): no unpickling.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.ckpt.disk.disk_checkpointer import find_resumable
from ddlscale.ckpt.gemini.kvstore import consult_agents
from ddlscale.ckpt.gemini.protocol import ReplicaError
from ddlscale.ckpt.state.shard import assemble
from ddlscale.ckpt.state.snapshot import rebuild
from ddlscale.ckpt.version.checksum import matches
from ddlscale.ckpt.version.io import load_version
from ddlscale.ckpt.version.manifest import SUFFIX, ManifestError, step_of

PATH_PREFIX = "gemini:"


class GeminiRecovery:
    """The recovery half of :class:`~ddlscale.ckpt.gemini.gemini_checkpointer.GeminiCheckpointer`, kept apart
    from capture and commit. It reads the checkpointer's store and agents (``_connect``, ``_agent``,
    ``committed_manifest``, ``store``, ``auth``, ``machine``, ``device``) and its persistent tier
    (``persist_dir``: a path, or ``storage://`` on the storage machine; ``persist_bps``), and sets
    ``recovery`` for the summary.
    """

    # -- before workers start -----------------------------------------------------------------------
    def resume_path(self, world_size: int) -> str | None:
        if self.resume is None:
            return None
        store = self._connect()
        consult_agents(store)  # the newest committed version the agents know of, whatever the store says now
        manifest = self.committed_manifest(store)
        if manifest is not None and manifest.world_size == world_size:
            return f"{PATH_PREFIX}{manifest.step}"
        found = self._persistent_path(world_size)
        if found is not None and os.environ.get("RANK", "0") == "0":
            print(f"ckpt=gemini: resuming from step {step_of(found)}, the newest version in {self.persist_dir} "
                  "(no committed version in memory)", flush=True)
        return found

    def _persistent_path(self, world_size: int) -> str | None:
        """The newest persistent version that verifies: its manifest's path, or its ``storage://`` name on
        the storage machine (read over its link; a missing directory holds none)."""
        if self.persist_dir is None:
            return None
        found = find_resumable(self.persist_dir, world_size, set_aside=False)
        return str(found) if found is not None else None

    # -- in the workers, once the process group is up ----------------------------------------------
    def load_path(self, path: str) -> dict[str, Any] | None:
        if path.endswith(SUFFIX):  # a persistent version resume_path chose: read at the tier's rate, timed
            start = clock.now()
            # The name as given: a storage:// name through Path would lose its "//".
            loaded = load_version(path, dist.get_rank() if dist.is_initialized() else 0, self.persist_bps,
                                  dist.get_world_size() if dist.is_initialized() else 1)
            self.recovery = {"source": "persistent", "retrieve_s": clock.now() - start, "tier": "disk"}
            return loaded
        if not path.startswith(PATH_PREFIX):
            return None
        if self.store is None:
            self.store = self._connect()
        rank = dist.get_rank() if dist.is_initialized() else 0
        start = clock.now()
        data, source = self._fetch(int(path[len(PATH_PREFIX):]), rank)
        # On the strategy's device: NCCL reduces only GPU tensors.
        ok = torch.tensor([1 if data is not None else 0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank restores the same version, or none does
        if int(ok) == 1:
            payload = rebuild(data)
            self.recovery = {"source": source, "retrieve_s": clock.now() - start, "tier": "memory"}
            return assemble(payload, payload)
        return self._fall_back(rank, start)

    def _fetch(self, step: int, rank: int) -> tuple[bytearray | None, str]:
        """This rank's replica of ``step``, checksum-verified: own machine's agent first, then live holders."""
        manifest = self.committed_manifest()
        if manifest is None or manifest.step != step:  # the store went back since resume_path: ask the agents
            consult_agents(self.store)
            manifest = self.committed_manifest()
        if manifest is None or manifest.step != step:
            warnings.warn(f"gemini: version {step} is no longer the committed one", stacklevel=2)
            return None, "none"
        record = manifest.shard(rank)
        machine = self.machine
        holders = [int(h) for h in manifest.placement["holders"][str(rank)]]
        alive = self.store.get(self.store.keys.alive, list(range(manifest.placement["machines"])))
        order = ([machine] if machine in holders else []) + [h for h in holders if h != machine and h in alive]
        for holder in order:
            try:
                with self._agent(holder, timeout_s=5.0) as client:
                    data = client.get(step, rank, max_bytes=record.bytes)
            except (ReplicaError, OSError) as exc:
                warnings.warn(f"gemini: rank {rank} cannot read its replica on machine {holder}: {exc}", stacklevel=2)
                continue
            if len(data) != record.bytes or not matches(data, record.checksum, self.auth.replica):
                warnings.warn(f"gemini: replica of rank {rank} on machine {holder} fails its MAC", stacklevel=2)
                continue
            return data, "local" if holder == machine else f"peer:{holder}"
        return None, "none"

    def _fall_back(self, rank: int, start: float) -> dict[str, Any]:
        """No intact in-memory copy for some rank: everyone loads the newest persistent version."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        choice: list[str | None] = [None, None]  # rank 0's pick of the persistent versions, or why none fits
        if rank == 0:
            try:
                choice[0] = self._persistent_path(world)
            except ValueError as exc:  # the others wait in the broadcast: they must raise it too
                choice[1] = str(exc)
            if choice[0] is not None:
                # Training goes back to that version: the committed one in memory (unrestorable) is stale,
                # and the agents would keep its buffers from the replayed steps.
                self.store.clear_manifest(f"fell back to {choice[0]}", self.incarnation)
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise RuntimeError(f"gemini: persistent fallback failed: {choice[1]}")
        if choice[0] is None:
            why = ("set ckpt.persist_every" if self.persistent is None else
                   f"none was written to {self.persist_dir} yet (ckpt.persist_every={self.persistent.interval})")
            raise RuntimeError(
                "gemini: the committed version cannot be restored (a whole placement group is lost or its "
                f"replicas fail their MACs) and there is no persistent checkpoint: {why}"
            )
        warnings.warn(f"gemini: falling back to the persistent checkpoint {choice[0]}", stacklevel=2)
        try:
            loaded = load_version(choice[0], rank, self.persist_bps, world)
        except ManifestError as exc:
            raise RuntimeError(f"gemini: persistent fallback failed: {exc}") from None
        self.recovery = {"source": "persistent", "retrieve_s": clock.now() - start, "tier": "disk"}
        return loaded
