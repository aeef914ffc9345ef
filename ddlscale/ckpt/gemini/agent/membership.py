"""Which machines are alive, and which agent is the root: heartbeats, failure detection, root election.

Every agent heartbeats in the job's store (a signed count, so clocks need not agree) and watches the
others' counts; one whose count has not changed for ``failure_timeout_s`` is stale (one that never
counted is not up yet, not failed). The root agent records failures and replacements (``failed/<m>``,
``events``) and the live set (``alive``) that recovering trainers read; when the root itself goes
stale, another agent takes over through the store's compare-and-set.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from ddlscale import clock
from ddlscale.ckpt.gemini.kvstore import JobStore


class Membership:
    """One machine's part in the job's membership, run by :meth:`run` on its own thread.

    Args:
        machine, machines: this agent's machine, and how many there are.
        heartbeat_s, failure_timeout_s: how often to heartbeat; after how long without one a machine failed.
        stopped: set when the agent stops (the loop ends).
        on_store_lost: called once the store has been unreachable for 10 x ``failure_timeout_s``: the
            job (and its store) is over.
        on_beat: called after every heartbeat (the agent reads the commit record then).
    """

    def __init__(self, machine: int, machines: int, heartbeat_s: float, failure_timeout_s: float,
                 stopped: threading.Event, on_store_lost: Callable[[], None],
                 on_beat: Callable[[], None] = lambda: None) -> None:
        self.machine, self.machines = machine, machines
        self.heartbeat_s, self.failure_timeout_s = heartbeat_s, failure_timeout_s
        self.stopped, self.on_store_lost, self.on_beat = stopped, on_store_lost, on_beat
        self.is_root = False

    def run(self, store: JobStore) -> None:
        """Heartbeat; watch the root (and, as root, everyone); exit when the store is gone."""
        keys = store.keys
        beats = 0
        seen: dict[int, tuple[int, float]] = {}  # machine -> (last count, when it last changed)
        failed: set[int] = set()
        lost_store_since: float | None = None
        while not self.stopped.wait(clock.wall(self.heartbeat_s)):
            try:
                beats += 1
                store.set(keys.heartbeat(self.machine), beats)
                now = clock.now()
                for m in range(self.machines):
                    count = int(store.get(keys.heartbeat(m), 0))
                    if m not in seen or seen[m][0] != count:
                        seen[m] = (count, now)
                # A machine whose agent never heartbeated is not up yet, not failed.
                stale = {m for m, (count, t) in seen.items() if count > 0 and now - t > self.failure_timeout_s}
                was_root = self.is_root
                self._elect(store, stale)
                if self.is_root and not was_root:  # a new root starts from what the old one recorded
                    failed = {m for m in range(self.machines) if store.get(keys.failed(m)) is not None}
                if self.is_root:
                    failed = self._watch(store, stale, failed)
                self.on_beat()
                lost_store_since = None
            except (RuntimeError, OSError, ConnectionError):
                lost_store_since = lost_store_since or clock.now()
                if clock.now() - lost_store_since > 10 * self.failure_timeout_s:
                    self.on_store_lost()
                    return

    def _elect(self, store: JobStore, stale: set[int]) -> None:
        key = store.keys.root
        raw = store.raw.get(key) if store.raw.check([key]) else b""
        current = store.open(key, raw) if raw else None
        if current is None or current in stale:
            # compare_set: exactly one contender replaces a missing, forged or dead root.
            result = store.raw.compare_set(key, raw.decode(errors="replace"), store.signed(key, self.machine))
            current = store.open(key, result)
        self.is_root = current == self.machine

    def _watch(self, store: JobStore, stale: set[int], failed: set[int]) -> set[int]:
        """As root: record machines that stopped heartbeating and machines that came back."""
        keys = store.keys
        for m in sorted(stale - failed):
            store.set(keys.failed(m), {"detected_unix": clock.timestamp(), "by": self.machine})
            self._log(store, {"event": "failed", "machine": m, "unix": clock.timestamp(), "root": self.machine})
        for m in sorted(failed - stale):
            store.delete(keys.failed(m))
            self._log(store, {"event": "replaced", "machine": m, "unix": clock.timestamp(), "root": self.machine})
        store.set(keys.alive, [m for m in range(self.machines) if m not in stale])
        return set(stale)

    def _log(self, store: JobStore, event: dict[str, Any]) -> None:
        store.set(store.keys.events, [*store.get(store.keys.events, []), event])
        print(f"gemini root agent: {event}", file=sys.stderr, flush=True)
