"""Gemini's coordination lives in an existing key-value store: torch's TCPStore, or an etcd cluster.

``ckpt.store`` picks it. The TCPStore (the default, for one-machine runs) is one process: on the
emulated cluster it is the rendezvous store on machine 0, and losing that machine loses the job's
control state. ``ckpt.store=etcd`` keeps the same keys in an etcd cluster instead (one member on each
of the first three machines, :mod:`ddlscale.cluster.control_plane`), which outlives any one machine.
Both answer the few methods of TCPStore the checkpointer uses (:class:`KeyValue`). All of one job's
keys share a prefix, so several jobs can use one store. A single ``set`` is atomic: the commit record
of a version is one key.

Anyone who reaches the store can write to it, so every value Gemini trusts is signed with the job's
record key (:class:`JobStore`): a value that fails its signature reads as absent, is counted in
``refused`` and warned about. Deleting keys stays possible for such a writer — a store-level attacker
can stop a job, never make it restore or overwrite state the job did not write. Counters (``add``)
cannot be signed, so nothing trusted is one: acknowledgements and heartbeats are signed records.
"""

from __future__ import annotations

import datetime
import json
import time
import warnings
from typing import Any, Protocol

import torch.distributed as dist

from ddlscale import clock
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.ckpt.gemini.protocol import parse_address
from ddlscale.ckpt.version.manifest import Manifest, ManifestError
from ddlscale.cluster.control_plane import EtcdAddress, EtcdKeyValue, missing
from ddlscale.cluster.pgstore import listening_store

ETCD = "etcd"  # ckpt.store=etcd: the launcher starts the members (cluster=local, cluster=emulated)


class KeyValue(Protocol):
    """What the checkpointer asks of a store: TCPStore's names, so a TCPStore is one as it is."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...
    def delete_key(self, key: str) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


def check_address(address: str | None) -> None:
    """Refuse a ``ckpt.store`` value that cannot work, naming the key (``etcd`` alone is checked where
    the members are started, which needs the server too)."""
    if address is None or address == ETCD:
        return
    if not isinstance(address, str):
        raise ValueError(f"ckpt.store must be null, etcd, HOST:PORT or etcd://HOST:PORT,...; got {address!r}")
    if address.startswith("etcd"):
        try:
            EtcdAddress.parse(address)
        except ValueError as exc:
            raise ValueError(f"ckpt.store: {exc}") from None
        reason = missing(server=False)
        if reason:
            raise ValueError(f"ckpt.store={address}: {reason}")
        return
    try:
        parse_address(address)
    except ValueError:
        raise ValueError(f"ckpt.store must be null, etcd, HOST:PORT or etcd://HOST:PORT,...; got {address!r}") from None


def connect(address: str, timeout_s: float = 10.0) -> KeyValue:
    """A client of the store at ``address`` (``HOST:PORT``: a TCPStore; ``etcd://...``: an etcd cluster);
    a clear error when it cannot be reached."""
    if address.startswith("etcd"):
        try:
            return EtcdKeyValue(address, timeout_s)
        except ValueError as exc:
            raise ValueError(f"ckpt.store: {exc}") from None
    try:
        host, port = parse_address(address)
    except ValueError:
        raise ValueError(f"ckpt.store must be HOST:PORT or etcd://HOST:PORT,..., got {address!r}") from None
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=clock.wall_timeout(timeout_s))
    except (RuntimeError, OSError) as exc:
        raise ConnectionError(
            f"ckpt.store {address}: key-value store unreachable after {timeout_s:g} s ({exc}); start one "
            "(the emulated cluster and cluster=local start it for you) or fix ckpt.store"
        ) from None


def serve(address: str) -> dist.TCPStore:
    """Host a TCPStore at ``HOST:PORT`` in this process, listening on ``HOST`` only (TCPStore alone would
    listen on every interface: ``127.0.0.1`` keeps a one-machine job's store off the network)."""
    host, port = parse_address(address)
    return listening_store(host, port, datetime.timedelta(hours=24))


class Keys:
    """The names of one job's keys."""

    def __init__(self, job: str) -> None:
        self.prefix = f"gemini/{job}"

    def agent(self, machine: int) -> str:
        return f"{self.prefix}/agent/{machine}"  # "HOST:PORT" of machine's replica agent

    def heartbeat(self, machine: int) -> str:
        return f"{self.prefix}/hb/{machine}"  # a count the agent raises; staleness = failure

    @property
    def root(self) -> str:
        return f"{self.prefix}/root"  # machine id of the root agent

    def failed(self, machine: int) -> str:
        return f"{self.prefix}/failed/{machine}"  # set by the root when machine stops heartbeating

    @property
    def alive(self) -> str:
        return f"{self.prefix}/alive"  # list of live machines, kept by the root

    @property
    def events(self) -> str:
        return f"{self.prefix}/events"  # list of failure and replacement events

    @property
    def incarnation(self) -> str:
        return f"{self.prefix}/incarnation"  # raised by every (re)start of the trainers

    def outcome(self, incarnation: int, version: int) -> str:
        return f"{self.prefix}/i{incarnation}/v{version}/outcome"  # "committed" or "failed", set by rank 0

    def shard(self, incarnation: int, version: int, rank: int) -> str:
        return f"{self.prefix}/i{incarnation}/v{version}/rank{rank}"  # rank's record: size, MAC, verified holders

    @property
    def manifest(self) -> str:
        return f"{self.prefix}/manifest"  # the newest committed version's manifest (or "cleared")


class JobStore:
    """One job's keys in a store, every value JSON signed under its key name with the job's key."""

    def __init__(self, store: KeyValue, job: str, auth: JobKeys) -> None:
        self.raw, self.keys, self.auth = store, Keys(job), auth
        self.refused = 0  # values read that failed their signature, or went back (replays)
        self._newest: tuple[int, int] | None = None  # the newest commit record seen (see manifest)
        self._newest_value: Any = None

    def set(self, key: str, value: Any) -> None:
        self.raw.set(key, self.signed(key, value))

    def signed(self, key: str, value: Any) -> str:
        return self.auth.sign(key, json.dumps(value))

    def get(self, key: str, default: Any = None) -> Any:
        """The value under ``key``; ``default`` when absent or not signed by this job."""
        if not self.raw.check([key]):
            return default
        return self.open(key, self.raw.get(key), default)

    def open(self, key: str, raw: bytes, default: Any = None) -> Any:
        text = self.auth.open(key, raw)
        if text is None:
            self.refused += 1
            warnings.warn(f"gemini: store key {key} holds a value not signed with this job's secret: ignored",
                          stacklevel=3)
            return default
        return json.loads(text)

    def wait(self, key: str, timeout_s: float) -> None:
        self.raw.wait([key], clock.wall_timeout(timeout_s))

    def wait_all(self, keys: list[str], timeout_s: float, poll_s: float = 0.002) -> bool:
        """Until every key exists (True) or ``timeout_s`` passed (False); the store's own ``wait``
        would raise after its client timeout instead."""
        deadline = clock.now() + timeout_s
        while not self.raw.check(keys):
            if clock.now() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def delete(self, key: str) -> None:
        self.raw.delete_key(key)

    # -- the commit record ------------------------------------------------------------------------
    # A signed record can be written back later by anyone who reaches the store (a replay: its signature
    # still holds). So each commit record carries where it stands, (incarnation, seq): seq counts the
    # records written, each one by compare-and-set on the one it follows. A reader refuses a record
    # older than the newest it has seen (``refused`` counts it), so the agents, which read it for as long
    # as the job runs, are never moved back; and no record goes over one of a newer incarnation.

    def manifest(self) -> Manifest | None | str:
        """The committed manifest; None when there is none; ``CLEARED`` when the job declared that it
        has none any more (it went back to a persistent version)."""
        value = self.get(self.keys.manifest)
        if not isinstance(value, dict):
            return None
        order = _order(value)
        if self._newest is not None and order < self._newest:
            self.refused += 1
            warnings.warn(f"gemini: store key {self.keys.manifest} went back to an older record {order} (newest "
                          f"seen {self._newest}): a replay, ignored", stacklevel=2)
            value = self._newest_value
        else:
            self._newest, self._newest_value = order, value
        if value.get("cleared"):
            return CLEARED
        try:
            return Manifest.from_dict(value.get("manifest"), f"store key {self.keys.manifest}")
        except ManifestError as exc:
            warnings.warn(f"gemini: {exc}", stacklevel=2)
            return None

    def publish(self, manifest: Manifest) -> None:
        """One signed key: from here on the version is committed (see :meth:`_advance`)."""
        self._advance({"manifest": manifest.to_dict()}, int(manifest.placement.get("incarnation", 0)))

    def clear_manifest(self, reason: str, incarnation: int | None = None) -> None:
        if incarnation is None:
            incarnation = int(self.get(self.keys.incarnation, 0))
        self._advance({"cleared": True, "reason": reason}, incarnation)

    def _advance(self, value: dict[str, Any], incarnation: int, attempts: int = 5) -> None:
        """Write the commit record ``value`` of ``incarnation`` by compare-and-set on the record there;
        refused (:class:`StaleRecord`) when the job or the record there is of a newer incarnation (a
        trainer left from before a restart must not publish over its successors)."""
        key = self.keys.manifest
        for _ in range(attempts):
            current = int(self.get(self.keys.incarnation, 0))
            if incarnation < current:
                raise StaleRecord(f"a commit record of incarnation {incarnation}: the job is at {current}")
            raw = self.raw.get(key) if self.raw.check([key]) else b""
            there = self.open(key, raw) if raw else None
            there_order = _order(there) if isinstance(there, dict) else (0, 0)
            if there_order[0] > incarnation:
                raise StaleRecord(f"the commit record there is of incarnation {there_order[0]}, newer than {incarnation}")
            record = {**value, "incarnation": incarnation, "seq": there_order[1] + 1}
            desired = self.signed(key, record)
            if bytes(self.raw.compare_set(key, raw.decode() if raw else "", desired)) == desired.encode():
                self._newest, self._newest_value = _order(record), record
                return
        raise RuntimeError(f"gemini: store key {key} kept changing under compare-and-set")


class StaleRecord(RuntimeError):
    """A commit record that would go over one of a newer incarnation."""


def _order(value: dict[str, Any]) -> tuple[int, int]:
    """Where a commit record stands: (incarnation, seq)."""
    return int(value.get("incarnation", 0)), int(value.get("seq", 0))


CLEARED = "cleared"
