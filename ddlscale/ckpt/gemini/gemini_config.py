"""Gemini's typed config: ``ckpt=gemini``'s keys, every range and choice checked in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddlscale.ckpt.checkpointer import HIGHFREQ, parse_every
from ddlscale.ckpt.disk.disk_config import write_rate
from ddlscale.ckpt.gemini.interleave import MODES
from ddlscale.ckpt.gemini.kvstore import check_address
from ddlscale.ckpt.gemini.placement import KINDS
from ddlscale.ckpt.version.checksum import KEYED
from ddlscale.schema import Schema, choice, integer, is_number, number

ON_NO_SPACE = ("stop", "persist")  # what a version no holder had room for does: stop the run, or persist every step
# Steps between persistent versions by default: what losing a whole replica group (every holder of some
# machine's replica at once) can cost is at most this many steps again, plus reading the version back.
# Written asynchronously (DCP's async_save), one every 100 steps costs training one capture per 100 steps.
PERSIST_EVERY = 100


@dataclass
class GeminiConfig(Schema):
    """``ckpt.*`` of :class:`~ddlscale.ckpt.gemini.gemini_checkpointer.GeminiCheckpointer` (its docstring
    says what each key does)."""

    group = "ckpt"
    every: Any = 1
    replicas: int = 2
    placement: str = "mixed"
    mode: str = "gemini"
    chunk_kib: int = 1024
    subbuffers: int = 4
    mu: float = 0.8
    checksum: str = "hmac-sha256"
    profile_steps: int = 20
    persist_every: Any = PERSIST_EVERY  # steps between persistent checkpoints, or None: none
    persist_dir: Any = None
    persist_bandwidth: Any = None
    store: Any = None  # HOST:PORT (or etcd's), or None: $DDLSCALE_STORE
    commit_timeout_s: float = 30.0
    resume: Any = "auto"
    on_no_space: str = "stop"
    drain_deadline_s: Any = None  # seconds a launch's drain may take; None: from the version's size and rate

    def check(self) -> None:
        if self.every == HIGHFREQ:
            raise ValueError(f"{self.key('every')}: gemini checkpoints every K steps (1 by default); "
                             f"{HIGHFREQ} is for ckpt=disk")
        parse_every(self.every, self.key("every"))
        choice(self.key("resume"), self.resume, (None, "auto"))
        integer(self.key("replicas"), self.replicas)
        choice(self.key("placement"), self.placement, KINDS)
        choice(self.key("mode"), self.mode, MODES)
        integer(self.key("chunk_kib"), self.chunk_kib)
        integer(self.key("subbuffers"), self.subbuffers)
        # mu < 1 (SYSTEMS.md section 4): gap and chunk times are medians, so a plan filling whole gaps
        # would spill chunks into the next collective.
        if not (is_number(self.mu) and 0 < self.mu < 1):
            raise ValueError(f"{self.key('mu')} must be in (0, 1), got {self.mu!r}")
        choice(self.key("checksum"), self.checksum, KEYED)
        integer(self.key("profile_steps"), self.profile_steps)
        check_address(self.store)
        if not (is_number(self.commit_timeout_s) and self.commit_timeout_s > 0 and self.commit_timeout_s < float("inf")):
            raise ValueError(f"{self.key('commit_timeout_s')} must be a finite number > 0, got {self.commit_timeout_s!r}")
        write_rate(self.persist_bandwidth, self.key("persist_bandwidth"))
        if self.persist_every is not None:
            integer(self.key("persist_every"), self.persist_every)
        if self.drain_deadline_s is not None:
            number(self.key("drain_deadline_s"), self.drain_deadline_s, above=0, what="a number of seconds")
        choice(self.key("on_no_space"), self.on_no_space, ON_NO_SPACE)
        if self.on_no_space == "persist" and self.persist_every is None:
            raise ValueError(f"{self.key('on_no_space')}=persist falls back to the persistent tier: "
                             f"set {self.key('persist_every')}")
