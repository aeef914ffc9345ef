"""etcd as a job's control plane: its address, a key-value client with TCPStore's methods, its members.

Why etcd's v2 API and the python-etcd client: torchrun's etcd rendezvous (``etcd`` and ``etcd-v2`` in
``torch.distributed.elastic.rendezvous``) speaks etcd's v2 API through python-etcd, so a job that
rendezvouses through etcd has that client and that API already; its own keys (manifests,
incarnations, liveness) use the same ones: one client library, one set of endpoints, one way to fail.
(The v3 API would need a second client, and no Python v3 client is kept up.) Debian's etcd 3.4 serves
v2 when started with ``--enable-v2``; its v2 writes and quorum reads go through raft like v3's.

Addresses name every member, so that losing one loses nothing: ``etcd://HOST:PORT,HOST:PORT,...``, or
``etcd+https://...?ca_cert=CA&cert=CERT&key=KEY`` for TLS with client certificates.

:class:`EtcdMembers` starts and stops members (one process each, data directory under the run
directory) through a ``run(member, argv, **popen_kwargs)`` callable: ``subprocess.Popen`` on loopback,
an emulated machine's ``popen`` on the emulated cluster. The members speak TLS to each other, each
presenting a certificate that a certificate authority made for this launch alone signed, and asking
the same of its peers (:func:`peer_certificates`): whoever reaches the peer port cannot join the
cluster or read its raft traffic. (Clients still speak plain HTTP to them; every value the job trusts
is signed with its secret.) Health checks and member replacement run
where the members are reachable, as this file run as a script (``python control_plane.py health ...``),
which imports nothing but the standard library: no torch start-up inside a namespace.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

SCHEMES = {"etcd": "http", "etcd+https": "https"}
CLIENT_PORT, PEER_PORT = 2379, 2380
ROOT = "/ddlscale"  # every key of ours lives under it; torchrun's rendezvous uses /torch/elastic
INSTALL = ("install etcd with `apt-get update && apt-get install -y etcd-server` (Debian/Ubuntu; etcd >= 3.4) and "
           "its Python client with `pip install python-etcd` (or `pip install -e '.[etcd]'`)")


def missing(server: bool = True) -> str | None:
    """Why etcd cannot be used here (None: it can). ``server``: this machine must also run members."""
    lacking = []
    if server and shutil.which("etcd") is None:
        lacking.append("the etcd server (no `etcd` on PATH)")
    if server and shutil.which("openssl") is None:
        lacking.append("openssl (it makes the members' peer certificates)")
    try:
        import etcd  # noqa: F401  (python-etcd)
    except ImportError:
        lacking.append("the python-etcd client")
    return f"missing {' and '.join(lacking)}; {INSTALL}" if lacking else None


@dataclass(frozen=True)
class EtcdAddress:
    """Where a job's etcd members answer, and how to talk to them."""

    endpoints: tuple[tuple[str, int], ...]
    protocol: str = "http"
    tls: dict[str, str] = field(default_factory=dict)  # ca_cert, cert, key: files

    @staticmethod
    def parse(text: str) -> EtcdAddress:
        scheme, sep, rest = str(text).partition("://")
        if not sep or scheme not in SCHEMES:
            raise ValueError(f"an etcd address is etcd://HOST:PORT[,HOST:PORT...] or etcd+https://...; got {text!r}")
        hosts, _, query = rest.partition("?")
        endpoints = []
        for item in hosts.split(","):
            host, colon, port = item.strip().rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"etcd endpoint {item!r} in {text!r} is not HOST:PORT")
            endpoints.append((host, int(port)))
        tls = dict(parse_qsl(query))
        unknown = set(tls) - {"ca_cert", "cert", "key"}
        if unknown:
            raise ValueError(f"etcd address {text!r}: unknown options {sorted(unknown)} (ca_cert, cert, key)")
        return EtcdAddress(tuple(endpoints), SCHEMES[scheme], tls)

    def __str__(self) -> str:
        scheme = next(s for s, p in SCHEMES.items() if p == self.protocol)
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"{scheme}://{hosts}" + (f"?{urlencode(self.tls)}" if self.tls else "")

    @property
    def urls(self) -> list[str]:
        return [f"{self.protocol}://{h}:{p}" for h, p in self.endpoints]

    @property
    def rendezvous_endpoint(self) -> str:
        """torchrun's ``--rdzv-endpoint`` for the ``ddlscale-etcd`` backend: every member."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def client(self, timeout_s: float = 10.0) -> Any:
        """A python-etcd client that knows every member and moves on when the one it uses stops answering."""
        import etcd

        cert = (self.tls["cert"], self.tls["key"]) if "cert" in self.tls and "key" in self.tls else self.tls.get("cert")
        try:
            return etcd.Client(host=self.endpoints, protocol=self.protocol, read_timeout=timeout_s,
                               allow_reconnect=True, cert=cert, ca_cert=self.tls.get("ca_cert"))
        except etcd.EtcdException as exc:
            raise ConnectionError(f"etcd at {self}: no member answers ({exc})") from None


class EtcdKeyValue:
    """The methods of torch's TCPStore that a job's store uses, on etcd v2 keys under ``/ddlscale``.

    A key name is a path (``gemini/job/manifest``): no key may be a prefix directory of another.
    Values are text (our signed records are ASCII). Reads that decide something (``get``) are quorum
    reads: linearizable, as a TCPStore's single server is; ``check`` reads a member's own copy, as a key
    it sees is committed and one it misses is only a wait. Connection errors and a cluster between
    leaders are retried until ``timeout_s``, then raised as ``ConnectionError`` (which the agents treat
    as a lost store, as they do a TCPStore's).
    """

    def __init__(self, address: EtcdAddress | str, timeout_s: float = 10.0) -> None:
        import etcd

        self._etcd = etcd
        self.address = address if isinstance(address, EtcdAddress) else EtcdAddress.parse(address)
        self.timeout_s = timeout_s
        self.client = self.address.client(timeout_s)

    def _path(self, key: str) -> str:
        return f"{ROOT}/{key.strip('/')}"

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """``method`` with retries while the cluster is unreachable or electing a leader."""
        etcd = self._etcd
        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        while True:
            try:
                return method(*args, **kwargs)
            except (etcd.EtcdKeyNotFound, etcd.EtcdCompareFailed, etcd.EtcdAlreadyExist, etcd.EtcdWatchTimedOut,
                    etcd.EtcdEventIndexCleared, etcd.EtcdNotFile, etcd.EtcdNotDir):
                raise
            except etcd.EtcdException as exc:
                if time.monotonic() + delay > deadline:
                    raise ConnectionError(f"etcd at {self.address}: {exc}") from None
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
                if not self.client._machines_cache:  # every member failed once: try them all again
                    self.client._machines_cache = self.address.urls

    def set(self, key: str, value: str | bytes) -> None:
        self._call(self.client.write, self._path(key), _text(value))

    def _read(self, key: str, quorum: bool = True) -> bytes | None:
        try:
            return self._call(self.client.read, self._path(key), quorum=quorum).value.encode()
        except self._etcd.EtcdKeyNotFound:
            return None

    def get(self, key: str) -> bytes:
        """The value (waiting up to the client timeout for it, as TCPStore does)."""
        value = self._read(key)
        if value is None:
            self.wait([key])
            value = self._read(key)
        if value is None:
            raise LookupError(f"etcd key {key} deleted while read")
        return value

    def check(self, keys: list[str]) -> bool:
        return all(self._read(key, quorum=False) is not None for key in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key exists; raises ``TimeoutError`` after ``timeout`` (default: the client's)."""
        deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else self.timeout_s)
        for key in keys:
            while not self._wait_one(key, deadline):
                pass

    def _wait_one(self, key: str, deadline: float) -> bool:
        """True once ``key`` exists; False to be called again (a change that was not its creation)."""
        etcd = self._etcd
        try:
            self._call(self.client.read, self._path(key))
            return True
        except etcd.EtcdKeyNotFound as missing_key:
            index = int(missing_key.payload.get("index", 0)) if getattr(missing_key, "payload", None) else 0
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"etcd key {key} not set within the wait's timeout")
        try:  # a watch from the index the miss was read at: a creation in between is not lost
            self.client.read(self._path(key), wait=True, waitIndex=index + 1, timeout=min(left, 5.0))
        except (etcd.EtcdWatchTimedOut, etcd.EtcdEventIndexCleared, etcd.EtcdConnectionFailed):
            pass
        except etcd.EtcdException:
            time.sleep(0.05)
        return False

    def delete_key(self, key: str) -> bool:
        try:
            self._call(self.client.delete, self._path(key))
            return True
        except self._etcd.EtcdKeyNotFound:
            return False

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` if the value is ``expected`` (``""``: if the key is absent); returns the value
        after the attempt, as TCPStore's compare_set does."""
        etcd = self._etcd
        condition = {"prevExist": False} if not _text(expected) else {"prevValue": _text(expected)}
        try:
            self._call(self.client.write, self._path(key), _text(desired), **condition)
            return _text(desired).encode()
        except (etcd.EtcdCompareFailed, etcd.EtcdAlreadyExist, etcd.EtcdKeyNotFound):
            current = self._read(key)
            return b"" if current is None else current


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


# -- members ------------------------------------------------------------------------------------------
@dataclass
class Member:
    name: str
    host: str
    client_port: int = CLIENT_PORT
    peer_port: int = PEER_PORT

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"https://{self.host}:{self.peer_port}"  # peer TLS (peer_certificates)


CERT_DAYS = "3650"  # the certificates die with the launch's CA key, removed once they are signed


def _openssl(*argv: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *argv], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {argv[0]} failed: {done.stderr.strip()[-500:]}")


def peer_certificates(directory: Path, members: list[Member]) -> Path:
    """In ``directory`` (made 0700, emptied first): ``ca.pem``, a certificate authority of this launch, and
    per member ``<name>.pem`` and ``<name>-key.pem``, signed by it for the member's address, for serving
    and for connecting (etcd uses one certificate for both). The CA's key is deleted once they are signed:
    no other certificate can ever be made that the members accept."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # P-256: made in milliseconds
    _openssl("req", "-x509", *ec, "-days", CERT_DAYS, "-subj", "/CN=ddlscale etcd peers", "-keyout", "ca-key.pem",
             "-out", "ca.pem", cwd=directory)
    for m in members:
        kind = "IP" if all(part.isdigit() for part in m.host.split(".")) or ":" in m.host else "DNS"
        (directory / f"{m.name}.ext").write_text(f"subjectAltName={kind}:{m.host}\n"
                                                 "extendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("req", *ec, "-subj", f"/CN={m.name}", "-keyout", f"{m.name}-key.pem", "-out", f"{m.name}.csr",
                 cwd=directory)
        _openssl("x509", "-req", "-in", f"{m.name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-days", CERT_DAYS, "-extfile", f"{m.name}.ext", "-out", f"{m.name}.pem", cwd=directory)
    (directory / "ca-key.pem").unlink()
    for key in directory.glob("*-key.pem"):
        key.chmod(0o600)
    return directory


class EtcdMembers:
    """An etcd cluster of ``members`` started through ``run`` (see the module's docstring), data under
    ``directory``. Timing is set for hosts whose cores are shared by the whole job, as the emulated
    cluster's are: a heartbeat of 200 ms and elections after 2 s keep a starved member from calling one."""

    def __init__(self, members: list[Member], directory: Path, run: Any, token: str) -> None:
        self.members, self.directory, self.run, self.token = members, Path(directory), run, token
        self.processes: dict[int, subprocess.Popen] = {}
        self.started: dict[int, tuple[str, int]] = {}  # member -> (cluster state, incarnation) it last started with
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tls = self.directory / "tls"

    @property
    def address(self) -> EtcdAddress:
        return EtcdAddress(tuple((m.host, m.client_port) for m in self.members))

    def _argv(self, i: int, state: str, data: Path) -> list[str]:
        m = self.members[i]
        initial = ",".join(f"{o.name}={o.peer_url}" for o in self.members)
        return ["etcd", "--name", m.name, "--data-dir", str(data),
                "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", initial, "--initial-cluster-state", state,
                "--initial-cluster-token", self.token, "--enable-v2=true",
                "--heartbeat-interval", "200", "--election-timeout", "2000",
                "--peer-cert-file", str(self.tls / f"{m.name}.pem"), "--peer-key-file", str(self.tls / f"{m.name}-key.pem"),
                "--peer-trusted-ca-file", str(self.tls / "ca.pem"), "--peer-client-cert-auth"]

    def _start(self, i: int, state: str, incarnation: int) -> None:
        data = self.directory / f"{self.members[i].name}.{incarnation}"
        log = open(self.directory / f"{self.members[i].name}.{incarnation}.log", "a")  # noqa: SIM115
        self.processes[i] = self.run(i, self._argv(i, state, data), stdout=log, stderr=subprocess.STDOUT)
        self.started[i] = (state, incarnation)
        log.close()

    def start(self, timeout_s: float = 60.0) -> EtcdMembers:
        # A launch's control state lives as long as the launch, as a TCPStore's does: what a previous
        # launch in this directory left (its members' addresses, its keys) is not taken over.
        for old in self.directory.glob("m*.*"):
            if old.is_dir():
                shutil.rmtree(old)
            elif old.suffix == ".log":
                old.unlink()
        peer_certificates(self.tls, self.members)
        for i in range(len(self.members)):
            self._start(i, "new", 0)
        self.admin(0, ["health", str(self.address), str(timeout_s)], timeout_s + 30)
        return self

    def revive(self, timeout_s: float = 60.0) -> None:
        """Start again, on their own data, the members whose process ended, and wait for a healthy quorum.
        A stop of the whole job signals every process, the members too; what they committed is on their
        disks, and the drain that follows reads it."""
        ended = [i for i, process in self.processes.items() if process.poll() is not None]
        for i in ended:
            self._start(i, *self.started[i])  # on data that exists, etcd takes its membership from there
        if ended:
            self.admin(ended[0], ["health", str(self.address), str(timeout_s)], timeout_s + 30)

    def replace(self, i: int, via: int, incarnation: int, timeout_s: float = 60.0) -> None:
        """Member ``i``'s machine was replaced (its data is gone): take the old member out, add a new one
        at the same address with an empty data directory, start it and wait until the cluster is healthy.
        ``via``: a member that is up, whose machine runs the membership change."""
        m = self.members[i]
        self.admin(via, ["replace", str(self.address), m.name, m.peer_url], 60)
        self._start(i, "existing", incarnation)
        self.admin(via, ["health", str(self.address), str(timeout_s), m.client_url], timeout_s + 30)

    def admin(self, i: int, argv: list[str], timeout_s: float) -> str:
        """This file run as a script on member ``i``'s machine (where the members are reachable)."""
        process = self.run(i, [sys.executable, str(Path(__file__).resolve()), *argv], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            out = "timed out"
        if process.returncode != 0:
            raise RuntimeError(f"etcd {argv[0]} on member {i}'s machine failed: {out.strip()[-2000:]} "
                               f"(member logs in {self.directory})")
        return out

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


# -- administration over etcd's v3 JSON gateway (standard library only) -------------------------------
def _post(url: str, path: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return json.loads(response.read()).get("health") in (True, "true")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def _wait_healthy(address: EtcdAddress, timeout_s: float, member: str | None = None) -> None:
    """Until a quorum of members answers healthy (a member reports health only with a leader), and
    ``member`` (a client URL) among them when given."""
    deadline = time.monotonic() + timeout_s
    quorum = len(address.urls) // 2 + 1
    while sum(_healthy(url) for url in address.urls) < quorum or (member is not None and not _healthy(member)):
        if time.monotonic() > deadline:
            raise SystemExit(f"etcd at {address}: no healthy quorum after {timeout_s:g} s")
        time.sleep(0.2)


def _replace(address: EtcdAddress, name: str, peer_url: str) -> None:
    for url in address.urls:
        if _healthy(url):
            break
    else:
        raise SystemExit(f"etcd at {address}: no member healthy")
    members = _post(url, "/v3/cluster/member/list", {}).get("members", [])
    for member in members:
        if member.get("name") == name or peer_url in member.get("peerURLs", []):
            _post(url, "/v3/cluster/member/remove", {"ID": member["ID"]})
    _post(url, "/v3/cluster/member/add", {"peerURLs": [peer_url]})


def _main(argv: list[str]) -> None:
    if argv[:1] == ["health"] and len(argv) in (3, 4):
        _wait_healthy(EtcdAddress.parse(argv[1]), float(argv[2]), argv[3] if len(argv) == 4 else None)
    elif argv[:1] == ["replace"] and len(argv) == 4:
        _replace(EtcdAddress.parse(argv[1]), argv[2], argv[3])
    else:
        raise SystemExit("usage: control_plane.py health ADDRESS TIMEOUT_S [MEMBER_URL] | replace ADDRESS NAME PEER_URL")
    print("ok", flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
