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
from ddlscale.ckpt.gemini.protocol import AgentClient, ReplicaError, parse_address
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
        self._newest: tuple[int, int] | None = None  # the newest commit record seen or written (see manifest)
        self._newest_value: Any = None
        self._newest_raw: str | None = None
        self.behind: str | None = None  # why the store's commit record was behind the newest, at the last read

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
    # Anyone who reaches the store can write an old signed record back (its signature still holds) or
    # delete the key, and the store cannot tell. So a record's place is its own: (incarnation, seq), seq
    # counting the records of its incarnation, signed with it. A writer numbers its next record from the
    # newest it has seen or written itself, never from what the key holds, and writes it by compare-and-
    # set on the record it follows. Anyone who has seen a newer record than the key holds (or one when
    # the key holds none) knows the store went back: the agents then refuse BEGIN, and a writer refuses
    # to write (:class:`StoreWentBack`); the run stops, and a restart or the drain takes the newest record
    # from the agents (:func:`consult_agents`), who outlive the trainers. (etcd's revision would not do:
    # a replay written back gets a new one.)

    def _read_record(self) -> tuple[bytes, dict[str, Any] | None]:
        """The commit record's raw bytes (b"" when absent) and its value (None when absent or not signed)."""
        key = self.keys.manifest
        raw = bytes(self.raw.get(key)) if self.raw.check([key]) else b""
        value = self.open(key, raw) if raw else None
        return raw, value if isinstance(value, dict) else None

    def _adopt(self, raw: bytes | str, value: dict[str, Any]) -> bool:
        """Take ``value`` as the newest record when it is newer than the newest seen."""
        if self._newest is not None and _order(value) <= self._newest:
            return False
        self._newest, self._newest_value = _order(value), value
        self._newest_raw = raw.decode() if isinstance(raw, bytes) else raw
        return True

    def _went_back(self, value: dict[str, Any] | None) -> str | None:
        """Why the store's record ``value`` is behind the newest seen here, or None when it is not."""
        if self._newest is None:
            return None
        if value is None:
            return f"store key {self.keys.manifest} lost its commit record (the newest seen is {self._newest})"
        if _order(value) < self._newest:
            return (f"store key {self.keys.manifest} went back to commit record {_order(value)} (the newest seen "
                    f"is {self._newest}): an old record written back")
        return None

    @property
    def newest_record(self) -> str | None:
        """The newest commit record seen here, signed, as the store held it (what STAT reports)."""
        return self._newest_raw

    @property
    def newest_order(self) -> tuple[int, int] | None:
        return self._newest

    def witness(self, raw: bytes | str) -> bool:
        """Learn of a commit record from elsewhere (an agent's STAT): taken as the newest when its signature
        holds and it is newer than any seen here."""
        value = self.open(self.keys.manifest, raw)
        return isinstance(value, dict) and self._adopt(raw, value)

    def manifest(self, strict: bool = False) -> Manifest | None | str:
        """The committed manifest; None when there is none; ``CLEARED`` when the job declared that it has
        none any more (it went back to a persistent version). When the store went back (``behind`` says
        why): ``strict`` raises :class:`StoreWentBack`; otherwise the newest record seen here counts."""
        raw, value = self._read_record()
        self.behind = self._went_back(value)
        if self.behind is not None:
            if value is not None:
                self.refused += 1
            if strict:
                raise StoreWentBack(self.behind)
            warnings.warn(f"gemini: {self.behind}; the newest is used", stacklevel=2)
            value = self._newest_value
        elif value is not None:
            self._adopt(raw, value)
        if value is None:
            return None
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

    def clear_manifest(self, reason: str, incarnation: int) -> None:
        """Declare that the job has no committed version in memory any more (it goes back to a persistent
        one, or runs at another world size): over whatever record the key holds, older ones included."""
        self._advance({"cleared": True, "reason": reason}, incarnation, over_older=True)

    def restore(self, incarnation: int) -> None:
        """Write the newest record seen here again, as a record of ``incarnation``: the store went back
        (``behind``) and the job, restarted, puts it forward (over whatever the key holds)."""
        value = {k: v for k, v in self._newest_value.items() if k not in ("incarnation", "seq")}
        self._advance(value, incarnation, over_older=True)

    def _advance(self, value: dict[str, Any], incarnation: int, attempts: int = 5, over_older: bool = False) -> None:
        """Write the commit record ``value`` of ``incarnation`` by compare-and-set on the record there.
        Refused (:class:`StaleRecord`) when the job or the record there is of a newer incarnation (a trainer
        left from before a restart must not publish over its successors), and (:class:`StoreWentBack`) when
        the record there is older than the newest this writer has seen or written (unless ``over_older``):
        it never numbers a record from one written back."""
        key = self.keys.manifest
        for _ in range(attempts):
            current = int(self.get(self.keys.incarnation, 0))
            if incarnation < current:
                raise StaleRecord(f"a commit record of incarnation {incarnation}: the job is at {current}")
            raw, there = self._read_record()
            there_order = _order(there) if there is not None else (0, 0)
            newest = max(there_order, self._newest or (0, 0))
            if newest[0] > incarnation:
                raise StaleRecord(f"a commit record of incarnation {newest[0]} exists, newer than {incarnation}")
            went_back = self._went_back(there)
            if went_back is not None and not over_older:
                raise StoreWentBack(went_back)
            record = {**value, "incarnation": incarnation, "seq": newest[1] + 1 if newest[0] == incarnation else 1}
            desired = self.signed(key, record)
            if bytes(self.raw.compare_set(key, raw.decode(errors="replace"), desired)) == desired.encode():
                self._adopt(desired, record)
                self.behind = None
                return
        raise RuntimeError(f"gemini: store key {key} kept changing under compare-and-set")


def consult_agents(store: JobStore, machines: int | None = None, timeout_s: float = 5.0) -> int:
    """Ask the agents of ``machines`` machines (None: 0, 1, ... as long as one is registered) for the newest
    commit record each has seen; each one whose signature holds feeds ``store``'s newest
    (:meth:`JobStore.witness`), so that :meth:`JobStore.manifest` answers the newest any of them saw, not
    what the key holds now. An agent that is not registered or cannot be reached is passed over. Returns
    the highest incarnation they have seen (0: none)."""
    incarnation, machine = 0, 0
    while machines is None or machine < machines:
        address = store.get(store.keys.agent(machine))
        machine += 1
        if address is None:
            if machines is None:
                break
            continue
        try:
            with AgentClient(address, store.auth, 0, timeout_s=timeout_s) as client:  # STAT: any incarnation
                seen = client.stat().get("seen", {})
        except (ReplicaError, OSError, ValueError):
            continue
        if seen.get("record"):
            store.witness(seen["record"])
        incarnation = max(incarnation, int(seen.get("incarnation", 0)))
    return incarnation


class StaleRecord(RuntimeError):
    """A commit record that would go over one of a newer incarnation."""


class StoreWentBack(RuntimeError):
    """The store holds an older commit record than one seen or written here, or none: someone wrote an old
    one back, or deleted it."""


def _order(value: dict[str, Any]) -> tuple[int, int]:
    """Where a commit record stands: (incarnation, seq)."""
    return int(value.get("incarnation", 0)), int(value.get("seq", 0))


CLEARED = "cleared"
