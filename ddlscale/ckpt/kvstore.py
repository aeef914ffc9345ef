"""Gemini's coordination lives in an existing key-value store: torch's TCPStore.

The store must outlive every training process (on the emulated cluster it is the rendezvous store on
machine 0, where no failure is injected). All of one job's keys share a prefix, so several jobs can
use one store. A single ``set`` is atomic: the commit record of a version is one key.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

from ddlscale.ckpt.replica import parse_address


def connect(address: str, timeout_s: float = 10.0) -> dist.TCPStore:
    """A client of the TCPStore at ``HOST:PORT``; a clear error when it cannot be reached."""
    try:
        host, port = parse_address(address)
    except ValueError:
        raise ValueError(f"ckpt.store must be HOST:PORT, got {address!r}") from None
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise ConnectionError(
            f"ckpt.store {address}: key-value store unreachable after {timeout_s:g} s ({exc}); start one "
            "(the emulated cluster and cluster=local start it for you) or fix ckpt.store"
        ) from None


def serve(address: str) -> dist.TCPStore:
    """Host a TCPStore at ``HOST:PORT`` in this process."""
    host, port = parse_address(address)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(hours=24))


class Keys:
    """The names of one job's keys."""

    def __init__(self, job: str) -> None:
        self.prefix = f"gemini/{job}"

    def agent(self, machine: int) -> str:
        return f"{self.prefix}/agent/{machine}"  # "HOST:PORT" of machine's replica agent

    def heartbeat(self, machine: int) -> str:
        return f"{self.prefix}/hb/{machine}"  # a counter the agent bumps; staleness = failure

    @property
    def root(self) -> str:
        return f"{self.prefix}/root"  # machine id of the root agent

    def failed(self, machine: int) -> str:
        return f"{self.prefix}/failed/{machine}"  # set by the root when machine stops heartbeating

    @property
    def alive(self) -> str:
        return f"{self.prefix}/alive"  # JSON list of live machines, kept by the root

    @property
    def events(self) -> str:
        return f"{self.prefix}/events"  # JSON list of failure and replacement events

    @property
    def incarnation(self) -> str:
        return f"{self.prefix}/incarnation"  # bumped by every (re)start of the trainers

    def acks(self, incarnation: int, version: int) -> str:
        return f"{self.prefix}/i{incarnation}/v{version}/acks"  # verified replicas of the version

    def outcome(self, incarnation: int, version: int) -> str:
        return f"{self.prefix}/i{incarnation}/v{version}/outcome"  # "committed" or "failed", set by rank 0

    def shard(self, incarnation: int, version: int, rank: int) -> str:
        return f"{self.prefix}/i{incarnation}/v{version}/rank{rank}"

    @property
    def manifest(self) -> str:
        return f"{self.prefix}/manifest"  # the newest committed version's manifest


def get_json(store: dist.TCPStore, key: str, default: Any = None) -> Any:
    if not store.check([key]):
        return default
    return json.loads(store.get(key))


def set_json(store: dist.TCPStore, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))
