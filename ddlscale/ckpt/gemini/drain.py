"""When a launch ends, its newest committed in-memory version goes to the persistent directory.

The agents die with the launch that started them (``cluster=local``, ``cluster=emulated``), and with
them the in-memory versions. So on the way out the launcher reads the committed manifest, fetches every
rank's replica from a live holder, checks its MAC, parses it (a snapshot stream: JSON and raw tensors,
nothing unpickled) and writes the version as the persistent tier writes its own: a
torch.distributed.checkpoint directory and a manifest with every file's sha256, committed atomically
(:mod:`ddlscale.ckpt.disk.writer`), so it loads with DCP's tools alone and resumes at any world size. Running
the same command again in the same run directory then resumes from it instead of from step 0 — after
a normal end, a failure past ``cluster.max_restarts``, or Ctrl-C; not after the launcher itself is
SIGKILLed.

    python -m ddlscale.ckpt.gemini.drain --store HOST:PORT --job JOB --dir RUN/checkpoints   # $DDLSCALE_SECRET_FILE
"""

from __future__ import annotations

import argparse
import uuid
import warnings
from pathlib import Path

from ddlscale.ckpt.disk.checkpointer import DiskCheckpointer
from ddlscale.ckpt.disk.writer import write_version
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaError
from ddlscale.ckpt.gemini.store import JobStore, connect
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.shard import decode
from ddlscale.ckpt.version.checksum import matches
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, list_manifests, step_of

KEEP = 2  # persistent versions kept, as the persistent tier keeps them


def persist_committed(store: JobStore, directory: Path) -> Path | None:
    """Write the committed version to ``directory``; its manifest's path, or None when there is nothing
    newer than what ``directory`` holds (or some rank has no intact replica left)."""
    manifest = store.manifest()
    if not isinstance(manifest, Manifest):
        return None
    existing = list_manifests(directory)
    if existing and (step_of(existing[0]) or 0) >= manifest.step:
        return None
    incarnation = int(store.get(store.keys.incarnation, 0))
    alive = store.get(store.keys.alive, list(range(manifest.placement["machines"])))
    payloads = []
    for rank in range(manifest.world_size):
        record = manifest.shard(rank)
        holders = sorted(manifest.placement["holders"][str(rank)], key=lambda h: h not in alive)
        data = _replica(store, incarnation, manifest.step, rank, record, holders)
        if data is None:
            warnings.warn(f"gemini: rank {rank} has no intact replica of step {manifest.step}: not persisted",
                          stacklevel=2)
            return None
        payload = decode(data, where=f"replica of rank {rank} of step {manifest.step}")
        if rank != manifest.shared_rank:
            payload["shared"] = None  # every replica carries the rank-shared state: the version keeps one copy
        payloads.append(payload)
    position = DataPosition.from_dict(payloads[manifest.shared_rank]["local"]["data"])
    version_dir = f"step_{manifest.step:09d}.{uuid.uuid4().hex[:8]}"
    written = write_version(directory, version_dir, manifest.step, payloads, position)
    DiskCheckpointer(dir=str(directory), keep=KEEP).prune()
    return directory / written.name


def announce(written: Path | None) -> None:
    if written is not None:
        print(f"ckpt=gemini: committed version written to {written}; the same command in this run directory "
              "continues from it", flush=True)


def _replica(store: JobStore, incarnation: int, step: int, rank: int, record: ShardRecord,
             holders: list[int]) -> bytearray | None:
    for holder in holders:
        address = store.get(store.keys.agent(holder))
        if address is None:
            continue
        try:
            with AgentClient(address, store.auth, incarnation, timeout_s=10.0) as client:
                data = client.get(step, rank, max_bytes=record.bytes)
        except (ReplicaError, OSError):
            continue
        if len(data) == record.bytes and matches(data, record.checksum, store.auth.replica):
            return data
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a Gemini job's committed version to a directory")
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    store = JobStore(connect(args.store), args.job, JobKeys.from_env(args.job))
    announce(persist_committed(store, Path(args.dir)))


if __name__ == "__main__":
    main()
