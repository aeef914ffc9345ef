"""When a launch ends, its newest committed in-memory version goes to the persistent directory.

The agents die with the launch that started them (``cluster=local``, ``cluster=emulated``), and with
them the in-memory versions. So on the way out the launcher reads the newest committed manifest (the
store's, or a newer one an agent has seen: the store's key can be set back), fetches every
rank's replica from a live holder, checks its MAC, parses it (a snapshot stream: JSON and raw tensors,
nothing unpickled) and writes the version as the persistent tier writes its own, one rank at a time
(a rank's replica is fetched, checked, written into its DCP file and dropped before the next one's
is fetched; a first pass reads each for its items' shapes only, which DCP's plan needs): a
torch.distributed.checkpoint directory and a manifest with every file's sha256, committed atomically
(:mod:`ddlscale.ckpt.disk.writer`), so it loads with DCP's tools alone and resumes at any world size. The
same command run again into the same run directory (``hydra.run.dir=``; a run that did not finish
prints that command) then resumes from it instead of from step 0 — after
a normal end, a failure past ``cluster.max_restarts``, or any stop: a signal to the launcher, a signal
to every process of the job at once (a scheduler's; the agents then keep their replicas until
:func:`~ddlscale.ckpt.gemini.stopping.mark_drained` or the deadline, see :mod:`ddlscale.ckpt.gemini.agent`), SLURM's SIGUSR1; not after
the launcher itself is SIGKILLed first. Agents a user started drain themselves: the root, given
``--persist-dir``, runs this. The deadline follows the version's size and the rate its bytes move at
(:func:`~ddlscale.ckpt.gemini.stopping.deadline_for`), unless given.

The directory is a path, or ``storage://<path>`` on the emulated cluster's storage machine (its endpoint
and credentials in the environment, as the launcher hands them to the workers): written there as the
persistent tier writes, through DCP's fsspec writer, each file's sha256 taken as it is sent and the
manifest published last, in one PUT.

    python -m ddlscale.ckpt.gemini.drain --store HOST:PORT --job JOB --dir RUN/checkpoints   # $DDLSCALE_SECRET_FILE

Run so, it marks the drain's end for the agents when it is done.
"""

from __future__ import annotations

import argparse
import contextlib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscale import clock
from ddlscale.ckpt.disk.disk_checkpointer import DiskCheckpointer
from ddlscale.ckpt.disk.writer import write_version
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.ckpt.gemini.kvstore import JobStore, connect, consult_agents
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaError
from ddlscale.ckpt.gemini.stopping import DISK_RATE_BPS, deadline_for, mark_drained
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.shard import decode
from ddlscale.ckpt.version.checksum import matches
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, manifest_names, step_of
from ddlscale.ckpt.version.store import open_store

KEEP = 2  # persistent versions kept, as the persistent tier keeps them
CONSULT_S = 5.0  # how long the drain asks each agent what it holds


class DrainError(RuntimeError):
    """The committed version could not be written; the message says why (for the user, not a trace)."""


@dataclass(frozen=True)
class Drained:
    """What a drain did: ``path``, the written version's manifest, or ``why`` nothing was written."""

    path: Path | str | None  # a local path, or a storage:// name on the storage machine
    why: str = ""
    step: int | None = None


def persist_committed(store: JobStore, directory: Path | str, deadline_s: float | None = None,
                      rate_bps: float | None = None) -> Drained:
    """Write the committed version to ``directory`` (a path or ``storage://<path>``), one rank's replica at
    a time (each fetched from a live holder and checked against its MAC), within ``deadline_s`` seconds
    (None: :func:`deadline_for` the version's size at ``rate_bps``); nothing is written when ``directory``
    already holds that step or a newer one, or when some rank has no intact replica."""
    # The agents' newest, not the store's alone: a record written back or deleted must not make the drain
    # write an older version, or none; nor an incarnation key set back make every agent refuse it as stale.
    # A dead machine's agent costs its timeout.
    seen = consult_agents(store, timeout_s=CONSULT_S if deadline_s is None else min(CONSULT_S, deadline_s / 8))
    manifest = store.manifest()
    if not isinstance(manifest, Manifest):
        why = ("no version was committed in memory" if manifest is None
               else "the job went back to a persistent version and committed none since")
        return Drained(None, why)
    if deadline_s is None:
        deadline_s = deadline_for(sum(shard.bytes for shard in manifest.shards), rate_bps)
    deadline = clock.now() + deadline_s
    target = open_store(directory, "ckpt.persist_dir")
    existing = manifest_names(target)
    if existing and (step_of(existing[0]) or 0) >= manifest.step:
        return Drained(target.locator(existing[0]), f"{existing[0]} already holds step {step_of(existing[0])}",
                       manifest.step)
    incarnation = max(int(store.get(store.keys.incarnation, 0)), seen)
    alive = store.get(store.keys.alive, list(range(manifest.placement["machines"])))

    def payload_of(rank: int) -> dict[str, Any]:
        record = manifest.shard(rank)
        holders = sorted(manifest.placement["holders"][str(rank)], key=lambda h: h not in alive)
        data, tried = _replica(store, incarnation, manifest.step, rank, record, holders, deadline)
        if data is None:
            raise DrainError(f"rank {rank} has no intact replica of step {manifest.step} ({tried})")
        payload = decode(data, where=f"replica of rank {rank} of step {manifest.step}")
        if rank != manifest.shared_rank:
            payload["shared"] = None  # every replica carries the rank-shared state: the version keeps one copy
        return payload

    position = DataPosition.from_dict(payload_of(manifest.shared_rank)["local"]["data"])
    version_dir = f"step_{manifest.step:09d}.{uuid.uuid4().hex[:8]}"
    try:
        written = write_version(target, version_dir, manifest.step, manifest.world_size, payload_of, position)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error says what went wrong, not the cleanup's
            target.remove(version_dir)  # never committed: nothing names it
        raise
    DiskCheckpointer(dir=str(directory), keep=KEEP).prune()
    return Drained(target.locator(written.name), step=manifest.step)


def drain_and_report(store: JobStore, directory: Path | str, deadline_s: float | None = None,
                     rate_bps: float | None = None) -> Drained:
    """:func:`persist_committed`, its outcome printed for the user in one line: what was written and
    that the same command continues from it, or why nothing was (never a traceback: the launch is
    ending anyway). A version committed while it ran (on a stop the trainers get the signal as the drain
    does, and a step may still finish) is newer: it is written too, twice at most."""
    drained = _attempt(store, directory, deadline_s, rate_bps)
    for _ in range(2):
        if drained.path is None or drained.why:
            break
        _report(drained, directory)
        newer = _attempt(store, directory, deadline_s, rate_bps)
        if newer.path is None or newer.why:  # nothing newer ("already holds"), or it failed: the written one stands
            return drained
        drained = newer
    _report(drained, directory)
    return drained


def _attempt(store: JobStore, directory: Path | str, deadline_s: float | None, rate_bps: float | None) -> Drained:
    try:
        return persist_committed(store, directory, deadline_s, rate_bps)
    except Exception as exc:  # the store or every holder gone, the disk full: say so, plainly
        return Drained(None, str(exc) if isinstance(exc, (DrainError, OSError)) else f"{type(exc).__name__}: {exc}")


def _report(drained: Drained, directory: Path | str) -> None:
    if drained.path is not None and not drained.why:
        # A run that did not finish prints the command that continues from it (ddlscale.trainer.rundir).
        print(f"ckpt=gemini: committed step {drained.step} written to {drained.path}", flush=True)
    elif drained.path is not None:
        print(f"ckpt=gemini: nothing to write on the way out: {drained.why}", flush=True)
    else:
        print(f"ckpt=gemini: no version written to {directory} on the way out: {drained.why}", flush=True)


def _replica(store: JobStore, incarnation: int, step: int, rank: int, record: ShardRecord, holders: list[int],
             deadline: float) -> tuple[bytearray | None, str]:
    """Rank ``rank``'s replica of ``step`` from the first holder that has it intact, and what was tried."""
    tried = []
    for holder in holders:
        left = deadline - clock.now()
        if left <= 0:
            raise DrainError(f"out of time fetching rank {rank}'s replica of step {step}")
        address = store.get(store.keys.agent(holder))
        if address is None:
            tried.append(f"machine {holder}: no agent registered")
            continue
        try:
            with AgentClient(address, store.auth, incarnation, timeout_s=min(10.0, left)) as client:
                data = client.get(step, rank, max_bytes=record.bytes)
        except (ReplicaError, OSError) as exc:
            tried.append(f"machine {holder}: {exc}")
            continue
        if len(data) == record.bytes and matches(data, record.checksum, store.auth.replica):
            return data, ""
        tried.append(f"machine {holder}: fails its MAC")
    return None, "; ".join(tried) or "no holders"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a Gemini job's committed version to a directory")
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds the drain may take (default: from the version's size at --rate)")
    parser.add_argument("--rate", type=float, default=None,
                        help=f"bits/s the replicas move at to the directory (default {DISK_RATE_BPS:g})")
    args = parser.parse_args(argv)
    store = JobStore(connect(args.store), args.job, JobKeys.from_env(args.job))
    drain_and_report(store, args.dir, args.deadline, args.rate)
    with contextlib.suppress(RuntimeError, OSError):  # the agents then wait out their deadline instead
        mark_drained(store)


if __name__ == "__main__":
    main()
