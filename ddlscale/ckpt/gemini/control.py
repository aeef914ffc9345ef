"""Watch a Gemini job from inside its network, and damage replicas for drills.

Prints one JSON line per newly committed version (``{"committed": step, "unix": ...}``) and per root
agent event (``{"event": "failed", "machine": m, ...}``). Commands on stdin, one per line:

* ``corrupt RANK MACHINE`` — flip one byte of RANK's committed replica on MACHINE, in the agent's
  shared-memory file (as bit rot would: the replica protocol has no fault-injection op);
* ``stat MACHINE`` — what MACHINE's agent holds, and what it refused.

It holds the job's secret (``$DDLSCALE_SECRET_FILE``), as everything that talks to a job must. On the
emulated cluster it runs inside an emulated machine (the store is reachable only there: machine 0 with
the TCPStore, the last machine with etcd, so that it outlives machine 0); the failure drills in
:mod:`ddlscale.testing.drill` read its output::

    python -m ddlscale.ckpt.gemini.control --store 10.213.0.1:29400 --job myrun
    python -m ddlscale.ckpt.gemini.control --store etcd://10.213.0.1:2379,10.213.0.2:2379,10.213.0.3:2379 --job myrun
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddlscale import clock
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.ckpt.gemini.kvstore import JobStore, connect
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaError
from ddlscale.ckpt.version.manifest import Manifest

_print_lock = threading.Lock()


def emit(record: dict) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


def agent_client(store: JobStore, machine: int) -> AgentClient:
    """A connection to ``machine``'s agent as the job's current incarnation."""
    address = store.get(store.keys.agent(machine))
    if address is None:
        raise ReplicaError(f"no agent registered for machine {machine}")
    return AgentClient(address, store.auth, int(store.get(store.keys.incarnation, 0)))


def corrupt_replica(holds: dict[str, Any], owner: int, version: int, offset: int) -> Path:
    """Flip the byte at ``offset`` of ``owner``'s complete replica of ``version`` in its agent's
    shared-memory file (``holds``: the agent's STAT)."""
    for slot in holds.get(str(owner), []):
        if slot["complete"] and slot["version"] == version:
            path = Path(slot["path"])
            with open(path, "r+b") as file:
                file.seek(offset)
                byte = file.read(1)
                file.seek(offset)
                file.write(bytes([byte[0] ^ 0xFF]))
            return path
    raise ReplicaError(f"no complete version {version} of rank {owner} there to corrupt")


def watch(store: JobStore, poll_s: float) -> None:
    last_step, seen_events = None, 0
    while True:
        manifest = store.manifest()
        if isinstance(manifest, Manifest) and manifest.step != last_step:
            last_step = manifest.step
            emit({"committed": manifest.step, "incarnation": manifest.placement.get("incarnation"), "unix": clock.timestamp()})
        events = store.get(store.keys.events, [])
        for event in events[seen_events:]:
            emit(event)
        seen_events = len(events)
        time.sleep(poll_s)


def command(store: JobStore, line: str) -> dict:
    words = line.split()
    if words[:1] == ["corrupt"] and len(words) == 3:
        rank, machine = int(words[1]), int(words[2])
        manifest = store.manifest()
        if not isinstance(manifest, Manifest):
            return {"error": "nothing committed"}
        with agent_client(store, machine) as client:
            corrupt_replica(client.stat()["holds"], rank, manifest.step, manifest.shard(rank).bytes // 2)
        return {"corrupted": {"rank": rank, "machine": machine, "version": manifest.step}}
    if words[:1] == ["stat"] and len(words) == 2:
        with agent_client(store, int(words[1])) as client:
            stat = client.stat()
        return {"stat": {"machine": int(words[1]), "holds": stat["holds"], "refused": stat["refused"]}}
    return {"error": f"unknown command {line.strip()!r}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="watch a Gemini job; damage replicas for drills")
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--poll", type=float, default=0.05)
    args = parser.parse_args(argv)

    def open_store() -> JobStore:
        return JobStore(connect(args.store), args.job, JobKeys.from_env(args.job))

    threading.Thread(target=watch, args=(open_store(), args.poll), daemon=True).start()
    emit({"ready": True})
    commands = open_store()
    for line in sys.stdin:
        if line.strip():
            try:
                emit(command(commands, line))
            except (ReplicaError, OSError, ValueError, RuntimeError) as exc:
                emit({"error": str(exc)})


if __name__ == "__main__":
    main()
