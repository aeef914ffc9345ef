"""The hostile-client drill: everything a stranger on the network (or a stale trainer) might try
against a Gemini job, each expected to be refused.

    python -m ddlscale.testing.security_drill       # or: python -m ddlscale.testing.drill security

It starts a job on loopback — a secret, a store, one replica agent process — and a legitimate trainer
of incarnation 1 commits a version. Then it tries, printing one line per attempt and whether it was
refused and how: reading the replica without the secret, with a forged MAC, by replaying a recorded
request; writing as a stale incarnation; the old fault-injection op; overwriting the committed
version; allocations by length prefixes (a 1 TiB version, 1 GiB DATA prefixes with no payload, an
oversized MAC text), with the agent's memory measured before and after; 300 slow connections, then
the job's own request; the commit record deleted from the store, then a BEGIN; forged store records (a
manifest, an agent address, an acknowledgement); and restoring crafted bytes that would run code if
anything unpickled them. It ends with the agent's refusal counters. Exit status 1 if any attempt
was not refused.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ddlscale.ckpt.gemini.auth import MAC_BYTES, SECRET_ENV, JobKeys, create_secret_file, read_secret
from ddlscale.ckpt.gemini.kvstore import JobStore, connect, serve
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.protocol import (
    BEGIN,
    DATA,
    END,
    GET,
    HELLO,
    MAGIC,
    OK,
    PROTOCOL,
    REPLY,
    REQUEST,
    AgentClient,
    ReplicaError,
    parse_address,
    recv_bytes,
    request_mac,
)
from ddlscale.ckpt.gemini.stopping import mark_drained
from ddlscale.ckpt.state.shard import decode
from ddlscale.ckpt.state.snapshot import MAGIC as STREAM_MAGIC
from ddlscale.ckpt.state.snapshot import rebuild
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.manifest import (
    Manifest,
    ManifestError,
    ShardRecord,
    read_manifest,
    read_shard,
    write_manifest,
)

JOB = "security-drill"
OLD_CORRUPT_OP = 7  # the fault-injection op the protocol used to have
VERSION = 1


class Raw:
    """A hand-made connection to an agent: whatever bytes an attacker likes."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_connection(parse_address(address), timeout=5)
        _, _, self.nonce = HELLO.unpack(recv_bytes(self.sock, HELLO.size))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def header(self, op: int, seq: int, incarnation: int, version: int, owner: int, a: int = 0, b: int = 0) -> bytes:
        return REQUEST.pack(MAGIC, op, seq, incarnation, version, owner, a, b)

    def outcome(self) -> str:
        """What came back: a refusal's text, a success, or a closed connection."""
        try:
            status, _, length = REPLY.unpack(recv_bytes(self.sock, REPLY.size + MAC_BYTES)[:REPLY.size])
            body = bytes(recv_bytes(self.sock, min(length, 4096)))
            if status != OK:
                return f"refused: {body.decode(errors='replace')}"
            return f"answered, {length} bytes: {body[:40]!r}"
        except OSError as exc:
            return f"closed: {exc or 'nothing returned'}"
        finally:
            self.sock.close()


class RunsCode:
    """Unpickling this runs ``touch marker``: what a crafted checkpoint would do to an unpickling reader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Drill:
    """``agent_argv``: the agent to drill (default: ``python -m ddlscale.ckpt.gemini.agent``), followed by
    the drill's own arguments; a test passes a deliberately weakened one."""

    def __init__(self, workdir: Path, agent_argv: list[str] | None = None) -> None:
        secret = create_secret_file(workdir)
        self.auth = JobKeys(read_secret(secret), JOB)
        self.stranger = JobKeys(secrets.token_bytes(32), JOB)  # same job id, not its secret
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.store_address = f"127.0.0.1:{probe.getsockname()[1]}"
        self.server = serve(self.store_address)
        self.store = JobStore(connect(self.store_address), JOB, self.auth)
        self.agent = subprocess.Popen(
            [*(agent_argv or [sys.executable, "-m", "ddlscale.ckpt.gemini.agent"]), "--machine", "0", "--machines", "1",
             "--bind", "127.0.0.1:0", "--store", self.store_address, "--job", JOB],
            env={**os.environ, SECRET_ENV: str(secret)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.agent.stdout.readline().split()
        if line[:1] != ["ready"]:
            raise RuntimeError(f"the drill's agent did not start: {self.agent.stderr.read()}")
        self.address = line[1]
        threading.Thread(target=self.agent.stderr.read, daemon=True).start()  # keep its log pipe drained
        self.results: list[tuple[str, bool, str]] = []  # attempts on the agent
        self.checks: list[tuple[str, bool, str]] = []  # everything else: store records, client, restore
        self.data = bytes(range(256)) * 64  # rank 0's committed replica, 16 KiB

    def close(self) -> None:
        mark_drained(self.store)  # nothing to drain: a stopped agent need not keep its replicas for one
        self.agent.terminate()
        self.agent.wait(timeout=10)

    # -- the legitimate job -----------------------------------------------------------------------
    def commit(self) -> None:
        """Incarnation 1's rank 0 writes VERSION and commits it, as a trainer would."""
        self.store.set(self.store.keys.incarnation, 1)
        mac = checksum(self.data, "hmac-sha256", self.auth.replica)
        with AgentClient(self.address, self.auth, 1) as client:
            client.begin(VERSION, 0, len(self.data))
            client.data(VERSION, 0, 0, [memoryview(self.data)])
            client.end(VERSION, 0, mac)
        self.store.publish(Manifest(step=VERSION, world_size=1, shards=(ShardRecord(0, "memory:rank0", len(self.data),
                                                                                    mac),),
                                    tier="memory", placement={"incarnation": 1, "machines": 1, "holders": {"0": [0]}}))
        self.store.set(self.store.keys.outcome(1, VERSION), "committed")

    def committed_intact(self) -> bool:
        with AgentClient(self.address, self.auth, 1) as client:
            return bytes(client.get(VERSION, 0, len(self.data))) == self.data

    # -- attempts -----------------------------------------------------------------------------------
    def refusal_count(self) -> int | None:
        """The agent's refusal counters, summed (None: it cannot be asked: not refused by it, then)."""
        try:
            with AgentClient(self.address, self.auth, 1, timeout_s=5) as client:
                return sum(int(n) for n in client.stat()["refused"].values())
        except (ReplicaError, OSError):
            return None

    def attempt(self, what: str, run: Callable[[], str], refused: Callable[[str], bool] | None = None) -> None:
        """An attempt on the agent. Refused only when the agent itself refused it: its refusal counters
        rose (every refusal of a hostile request is counted by reason); a dead agent, a timeout or a
        client-side error refuses nothing. ``refused``: a further condition on the outcome."""
        before = self.refusal_count()
        try:
            outcome = run()
        except ReplicaError as exc:  # the agent's own answer, raised by the client
            outcome = f"refused: {exc}"
        except Exception as exc:
            outcome = f"error: {type(exc).__name__}: {exc}"
        after = self.refusal_count()
        counted = before is not None and after is not None and after > before
        ok = counted and (refused is None or refused(outcome))
        self.results.append((what, ok, outcome))
        tally = f"agent's counters {before} -> {after}"
        print(f"[{'refused' if ok else 'NOT REFUSED'}] {what}\n      -> {outcome} ({tally})", flush=True)

    def check(self, what: str, run: Callable[[], str]) -> None:
        """A check that does not go through the agent (store records, a client facing a fake agent,
        restoring crafted bytes): held when its outcome says refused."""
        try:
            outcome = run()
        except Exception as exc:  # the client side's own refusal: what this check is about
            outcome = f"refused: {type(exc).__name__}: {exc}"
        ok = outcome.startswith("refused")
        self.checks.append((what, ok, outcome))
        print(f"[{'held' if ok else 'FAILED'}] {what}\n      -> {outcome}", flush=True)

    def anonymous_get(self) -> str:
        raw = Raw(self.address)
        raw.send(struct.pack("<4sBqiqq", b"GMNI", 4, VERSION, 0, 0, 0))  # the old protocol's GET, no MAC
        return raw.outcome()

    def forged_get(self) -> str:
        raw = Raw(self.address)
        header = raw.header(GET, 1, 1, VERSION, 0)
        raw.send(header + request_mac(self.stranger, raw.nonce, header))
        return raw.outcome()

    def replay_elsewhere(self) -> str:
        recorded = Raw(self.address)  # a legitimate request, recorded off the wire...
        header = recorded.header(GET, 1, 1, VERSION, 0)
        message = header + request_mac(self.auth, recorded.nonce, header)
        recorded.sock.close()
        raw = Raw(self.address)  # ...and sent on another connection (another nonce)
        raw.send(message)
        return raw.outcome()

    def replay_same(self) -> str:
        raw = Raw(self.address)
        header = raw.header(GET, 1, 1, VERSION, 0)
        message = header + request_mac(self.auth, raw.nonce, header)
        raw.send(message)
        recv_bytes(raw.sock, REPLY.size + MAC_BYTES + len(self.data))  # the genuine answer
        raw.send(message)  # the same request again on the same connection
        return raw.outcome()

    def stale_begin(self) -> str:
        with AgentClient(self.address, self.auth, 0) as zombie:  # holds the secret, but incarnation 0
            zombie.begin(VERSION + 1, 0, len(self.data))
        return "accepted"

    def corrupt_op(self) -> str:
        raw = Raw(self.address)
        header = raw.header(OLD_CORRUPT_OP, 1, 1, VERSION, 0, a=100)
        raw.send(header + request_mac(self.auth, raw.nonce, header))  # even signed: no such op
        return raw.outcome()

    def overwrite_committed(self) -> str:
        raw = Raw(self.address)  # BEGIN of the committed version, "keep" field set to nothing to keep
        header = raw.header(BEGIN, 1, 1, VERSION, 0, a=len(self.data), b=-1)
        raw.send(header + request_mac(self.auth, raw.nonce, header))
        return raw.outcome()

    def huge_begin(self, keys: JobKeys) -> str:
        raw = Raw(self.address)
        header = raw.header(BEGIN, 1, 1, VERSION + 1, 0, a=1 << 40)
        raw.send(header + request_mac(keys, raw.nonce, header))
        return raw.outcome()

    def data_prefixes(self, keys: JobKeys) -> str:
        """Two DATA requests announcing 1 GiB and sending nothing; signed, they go to a version of 16 KiB
        the same connection just began."""
        before = rss_kib(self.agent.pid)
        outcomes = []
        for _ in range(2):
            raw = Raw(self.address)
            seq = 1
            if keys is self.auth:
                begin = raw.header(BEGIN, seq, 1, VERSION + 1, 0, a=len(self.data))
                raw.send(begin + request_mac(keys, raw.nonce, begin))
                _, _, length = REPLY.unpack(recv_bytes(raw.sock, REPLY.size))
                recv_bytes(raw.sock, MAC_BYTES + length)  # BEGIN's answer: the buffer's file
                seq += 1
            header = raw.header(DATA, seq, 1, VERSION + 1, 0, a=0, b=1 << 30)  # 1 GiB announced, nothing sent
            raw.send(header + request_mac(keys, raw.nonce, header))
            outcomes.append(raw.outcome())
        grew = (rss_kib(self.agent.pid) - before) / 1024
        verdict = "refused" if all(o.startswith(("refused", "closed")) for o in outcomes) and grew < 64 else "accepted"
        return f"{verdict}: agent memory grew {grew:.1f} MiB; {outcomes[-1]}"

    def huge_mac_text(self) -> str:
        raw = Raw(self.address)
        header = raw.header(END, 1, 1, VERSION, 0, a=1 << 30)
        raw.send(header + b"\0" * MAC_BYTES)
        return raw.outcome()

    def slow_connections(self, count: int = 300) -> str:
        """``count`` connections that each begin a request (one byte of its header) and go quiet, as one
        byte every few seconds would; then the job's own request, while they are open."""
        strangers = []
        try:
            for _ in range(count):
                raw = Raw(self.address)
                raw.send(MAGIC[:1])
                strangers.append(raw)
            with AgentClient(self.address, self.auth, 1, timeout_s=5) as client:
                client.stat()
            return f"refused: {count} slow connections held no slot; the job's own request was served"
        finally:
            for raw in strangers:
                raw.sock.close()

    def store_set_back(self) -> str:
        """The commit record deleted from the store (anyone who reaches the store can), then a BEGIN: the
        agent has seen the record, so it begins nothing until the job writes it again."""
        deadline = time.monotonic() + 10
        with AgentClient(self.address, self.auth, 1) as client:
            while not client.stat()["seen"]["record"]:  # the agent reads it at every heartbeat
                if time.monotonic() > deadline:
                    return "error: the agent never saw the commit record"
                time.sleep(0.1)
            self.store.raw.delete_key(self.store.keys.manifest)
            try:
                client.begin(VERSION + 1, 0, len(self.data))
                return "accepted"
            finally:
                self.store.restore(1)  # the job's writer puts its newest record back

    def oversized_reply(self) -> str:
        """A fake agent answering a client with a 1 TiB reply length."""
        listener = socket.create_server(("127.0.0.1", 0))

        def fake() -> None:
            conn, _ = listener.accept()
            conn.sendall(HELLO.pack(MAGIC, PROTOCOL, b"\0" * 16))
            conn.recv(4096)
            conn.sendall(REPLY.pack(0, 1, 1 << 40) + b"\0" * MAC_BYTES)
            conn.close()

        threading.Thread(target=fake, daemon=True).start()
        with AgentClient(f"127.0.0.1:{listener.getsockname()[1]}", self.auth, 1) as client:
            client.stat()
        listener.close()
        return "accepted"

    def forged_manifest(self) -> str:
        fake = Manifest(step=99, world_size=1, shards=(ShardRecord(0, "memory:rank0", 1, "hmac-sha256:00"),),
                        tier="memory", placement={"incarnation": 1, "machines": 1, "holders": {"0": [0]}})
        saved = self.store.raw.get(self.store.keys.manifest)
        self.store.raw.set(self.store.keys.manifest, fake.to_json())  # unsigned, as a stranger can write it
        try:
            reader = JobStore(connect(self.store_address), JOB, self.auth)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                read = reader.manifest()
            return (f"refused: a checkpointer reads {read!r} (counted {reader.refused} forged value)" if read is None
                    else f"accepted: read step {read.step}")
        finally:
            self.store.raw.set(self.store.keys.manifest, saved)

    def forged_address(self) -> str:
        key = self.store.keys.agent(0)
        saved = self.store.raw.get(key)
        self.store.raw.set(key, "10.0.0.66:4444")  # send the replicas to the stranger's machine
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                read = self.store.get(key)
            return "refused: the address reads as unregistered" if read is None else f"accepted: {read}"
        finally:
            self.store.raw.set(key, saved)

    def forged_ack(self) -> str:
        """Rank 1's record of version 7 claiming both holders verified it, signed with another key; counted
        by the commit rule as rank 0 counts (2 ranks on 2 machines, m = 2)."""
        forged = {"bytes": 1, "checksum": "hmac-sha256:00", "verified": [0, 1]}
        key = self.store.keys.shard(1, 7, 1)
        self.store.raw.set(key, self.stranger.sign(key, json.dumps(forged)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record = self.store.get(key)
        counted = PlacementPlan(2, 2).verified([[0, 1], record and record["verified"]], [0, 1])
        return (f"refused: the commit counts {counted} of 4 replicas (rank 1's acknowledgement is forged)" if counted < 4
                else "accepted")

    def pickled_replica(self, marker: Path) -> str:
        # Even with a MAC that matches (an insider), the bytes are parsed, never unpickled.
        skeleton = pickle.dumps(RunsCode(marker))
        stream = struct.pack("<8sQ", STREAM_MAGIC, len(skeleton)) + skeleton
        try:
            rebuild(stream)
            return "accepted"
        except ValueError as exc:
            return f"{'refused' if not marker.exists() else 'EXECUTED'}: {exc}"

    def pickled_shard(self, directory: Path, marker: Path) -> str:
        buffer = io.BytesIO()
        torch.save({"format": "ddlscale-training-state/1", "x": RunsCode(marker)}, buffer)
        data = buffer.getvalue()
        (directory / "step_000000005.x").mkdir()
        (directory / "step_000000005.x/rank_00000.ckpt").write_bytes(data)
        path = write_manifest(directory, Manifest(step=5, world_size=1, shards=(
            ShardRecord(0, "step_000000005.x/rank_00000.ckpt", len(data), checksum(data, "sha256")),)))
        try:
            decode(read_shard(directory, read_manifest(path).shard(0)), where=str(path))  # load_version's reading
            return "accepted"
        except (ValueError, ManifestError) as exc:
            return f"{'refused' if not marker.exists() else 'EXECUTED'}: {exc}"

    def run(self, workdir: Path) -> bool:
        self.commit()
        print(f"job {JOB!r}: agent {self.address}, store {self.store_address}; incarnation 1 committed version "
              f"{VERSION} of rank 0 ({len(self.data)} bytes)\n", flush=True)
        self.attempt("anonymous GET of the committed replica (the old protocol, no MAC)", self.anonymous_get)
        self.attempt("GET signed with a key that is not the job's", self.forged_get)
        self.attempt("a recorded genuine GET replayed on another connection", self.replay_elsewhere)
        self.attempt("a genuine GET replayed on its own connection", self.replay_same)
        self.attempt("BEGIN from a stale trainer (the secret, but incarnation 0 of 1)", self.stale_begin)
        self.attempt("the old CORRUPT fault-injection op, signed", self.corrupt_op)
        self.attempt("BEGIN that would overwrite the committed version (client says: keep nothing)",
                     self.overwrite_committed)
        self.attempt("BEGIN of a 1 TiB version, without the secret", lambda: self.huge_begin(self.stranger))
        self.attempt("BEGIN of a 1 TiB version, signed", lambda: self.huge_begin(self.auth))
        self.attempt("two DATA prefixes of 1 GiB with no payload, without the secret",
                     lambda: self.data_prefixes(self.stranger), lambda o: o.startswith("refused"))
        self.attempt("two DATA prefixes of 1 GiB with no payload, signed", lambda: self.data_prefixes(self.auth),
                     lambda o: o.startswith("refused"))
        self.attempt("END announcing a 1 GiB MAC text", self.huge_mac_text)
        self.attempt("300 connections each sending one byte of a request, then nothing", self.slow_connections)
        self.attempt("the commit record deleted from the store, then BEGIN", self.store_set_back)
        self.check("a fake agent answering a trainer with a 1 TiB reply", self.oversized_reply)
        self.check("an unsigned manifest naming version 99 written into the store", self.forged_manifest)
        self.check("an unsigned agent address pointing the replicas elsewhere", self.forged_address)
        self.check("an acknowledgement of both replicas signed with another key", self.forged_ack)
        marker = workdir / "code-ran"
        self.check("a replica stream whose skeleton is a pickle running os.system", lambda: self.pickled_replica(marker))
        self.check("a persistent shard made by torch.save with a payload running os.system",
                     lambda: self.pickled_shard(workdir, marker))
        intact = self.committed_intact()
        with AgentClient(self.address, self.auth, 1) as client:
            refused = client.stat()["refused"]
        print(f"\ncommitted version {VERSION} intact after all attempts: {intact}")
        print(f"agent's refusal counters: {refused}")
        missed = [what for what, ok, _ in self.results if not ok]
        failed = [what for what, ok, _ in self.checks if not ok]
        print(f"{len(self.results) - len(missed)} of {len(self.results)} attempts on the agent refused by it"
              + (f"; NOT refused: {missed}" if missed else ""))
        print(f"{len(self.checks) - len(failed)} of {len(self.checks)} other checks held"
              + (f"; FAILED: {failed}" if failed else ""))
        return not missed and not failed and intact


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m ddlscale.testing.drill security", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddlscale-security-") as scratch:
        drill = Drill(Path(scratch))
        try:
            ok = drill.run(Path(scratch))
        finally:
            drill.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
