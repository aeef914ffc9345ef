"""Watch a Gemini job from inside its network, and inject replica faults.

Prints one JSON line per newly committed version (``{"committed": step, "unix": ...}``) and per root
agent event (``{"event": "failed", "machine": m, ...}``). Commands on stdin, one per line:

* ``corrupt RANK MACHINE`` — flip one byte of RANK's committed replica on MACHINE's agent;
* ``stat MACHINE`` — what MACHINE's agent holds.

On the emulated cluster it runs in machine 0's namespace (the store is reachable only there); the
failure drills in :mod:`ddlscale.ckpt.drill` read its output::

    python -m ddlscale.ckpt.control --store 10.213.0.1:29400 --job myrun
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from ddlscale.ckpt import kvstore
from ddlscale.ckpt.manifest import Manifest
from ddlscale.ckpt.replica import AgentClient, ReplicaError

_print_lock = threading.Lock()


def emit(record: dict) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


def watch(address: str, keys: kvstore.Keys, poll_s: float) -> None:
    store = kvstore.connect(address)
    last_step, seen_events = None, 0
    while True:
        if store.check([keys.manifest]):
            manifest = Manifest.from_json(store.get(keys.manifest).decode(), "gemini manifest")
            if manifest.step != last_step:
                last_step = manifest.step
                emit({"committed": manifest.step, "incarnation": manifest.placement.get("incarnation"),
                      "unix": time.time()})
        events = kvstore.get_json(store, keys.events, [])
        for event in events[seen_events:]:
            emit(event)
        seen_events = len(events)
        time.sleep(poll_s)


def command(address: str, keys: kvstore.Keys, line: str) -> dict:
    store = kvstore.connect(address)
    words = line.split()
    if words[:1] == ["corrupt"] and len(words) == 3:
        rank, machine = int(words[1]), int(words[2])
        manifest = Manifest.from_json(store.get(keys.manifest).decode(), "gemini manifest")
        record = manifest.shard(rank)
        with AgentClient(store.get(keys.agent(machine)).decode()) as client:
            client.corrupt(manifest.step, rank, record.bytes // 2)
        return {"corrupted": {"rank": rank, "machine": machine, "version": manifest.step}}
    if words[:1] == ["stat"] and len(words) == 2:
        with AgentClient(store.get(keys.agent(int(words[1]))).decode()) as client:
            return {"stat": {"machine": int(words[1]), "holds": client.stat()}}
    return {"error": f"unknown command {line.strip()!r}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="watch a Gemini job; inject replica faults")
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--poll", type=float, default=0.05)
    args = parser.parse_args(argv)
    keys = kvstore.Keys(args.job)
    threading.Thread(target=watch, args=(args.store, keys, args.poll), daemon=True).start()
    emit({"ready": True})
    for line in sys.stdin:
        if line.strip():
            try:
                emit(command(args.store, keys, line))
            except (ReplicaError, OSError, ValueError, RuntimeError) as exc:
                emit({"error": str(exc)})


if __name__ == "__main__":
    main()
