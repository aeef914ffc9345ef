"""The storage machine of an emulated cluster: a shared file store behind one shaped link.

Gemini's regime is a cloud file system shared by the whole job (FSx at 20 Gbit/s for 16 machines):
a persistent checkpoint crosses every machine's own NIC and then the store's one link, which all of
them share. The storage machine is that store. It is one more namespace on the cluster's bridge
(``<cluster>-st``, address ``10.213.0.254``), its veth born inside namespaces the cluster made,
its NIC shaped by tbf in both directions at ``cluster.storage.bandwidth`` / k like every link of the
cluster (:meth:`~ddlscale.cluster.emulated.EmulatedCluster._shape`), and it goes with the cluster:
its namespace is one of the cluster's, so ``down``, Ctrl-C, a crash and ``down --all`` remove it and
kill its server with the rest.

Its server is nginx's WebDAV module (Debian's ``nginx-core`` and ``libnginx-mod-http-dav-ext``):
HTTP PUT, GET, DELETE, MKCOL, COPY, MOVE and PROPFIND on a directory of this host
(``cluster.storage.root``). The client is what a user of such a store would use: fsspec's WebDAV file
system (``webdav4``), through which DCP's own ``FsspecWriter`` writes (:mod:`ddlscale.ckpt.version.store`).

Why WebDAV on nginx. This kernel has no NFS (no ``nfs`` in /proc/filesystems, neither client nor
server), and neither Debian 12 nor PyPI ships a production S3 server here (MinIO's server is not
packaged; moto is a mock). nginx is a server people run in production, in C, and light on this
2-core host: 8 machines writing at once through the tier's client path (each writer in its machine's
CPU cap) moved 0.952-0.954 of a 2 Gbit/s setting at k = 4 and 0.926 at k = 1; 2 machines 0.93-0.95 of
500 Mbit/s and 2 Gbit/s at k = 1, 0.95 at k = 2 (the ceiling is 0.956, TCP's payload per frame;
``python -m ddlscale.cluster storage-probe``, every repetition in docs/emulation.md: 13 of 16 within
10%, the others at 0.85-0.88 while other benchmarks held the host's load at 10-15). SFTP (not tried)
would put encryption and paramiko's Python framing on the writers' capped cores. Its PUT is atomic: the body
goes to a temporary file beside the root (``client_body_temp_path``, same file system) and is renamed
into place once complete, so a reader sees a whole object or none — what the tier's commit protocol
needs (the manifest published last, by one PUT).

Credentials are drawn per cluster (``secrets``): a user and a random password, the server keeps only
a salted hash (``{SSHA}`` in its htpasswd file, in a 0700 directory under ``/run/ddlscale/storage``)
and refuses every request without them (401). The launcher hands them to the workers in their
environment (:class:`~ddlscale.cluster.storage_client.StorageEndpoint`), never in a config, a log or
summary.json. The server's own CPU is not capped: a store's link, not its CPUs, bounds it in the
regime it stands for.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from ddlscale.cluster.storage_client import StorageEndpoint
from ddlscale.units import parse_bandwidth

HOST = 254  # its address's last byte: the machines have .1 to .250
PORT = 8080
USER = "ddlscale"
CONFIG_DIR = "/run/ddlscale/storage"  # per cluster: the server's config, hashed credentials, pid, log
NGINX = "nginx"
DAV_EXT_MODULE = "/usr/lib/nginx/modules/ngx_http_dav_ext_module.so"  # PROPFIND (listing), Debian's path
INCOMING = ".incoming"  # under the root: PUT bodies land here, then are renamed into place (same file system)
START_TIMEOUT_S = 10.0


def check_config(storage: Any, key: str = "cluster.storage") -> tuple[str | None, str | None]:
    """``cluster.storage`` as (bandwidth, root): (None, None) without a storage machine; a bad value names its key."""
    if storage is None:
        return None, None
    if not isinstance(storage, dict):
        raise ValueError(f"{key} must be a mapping with bandwidth and root, got {storage!r}")
    unknown = sorted(set(storage) - {"bandwidth", "root"})
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: not a key of {key} (it takes bandwidth and root)")
    bandwidth, root = storage.get("bandwidth"), storage.get("root")
    if bandwidth is not None:
        try:
            bps = parse_bandwidth(bandwidth)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{key}.bandwidth: {exc}") from None
        if bps <= 0:
            raise ValueError(f"{key}.bandwidth must be > 0 (or null: no storage machine), got {bandwidth!r}")
    if root is not None and (not isinstance(root, str) or not root):
        raise ValueError(f"{key}.root must be a directory of this host (or null: <run dir>/storage), got {root!r}")
    return (None if bandwidth is None else str(bandwidth)), root


def unavailable_reason() -> str | None:
    """Why a storage machine cannot serve here (None: it can)."""
    if shutil.which(NGINX) is None:
        return "no nginx (apt-get install nginx-core libnginx-mod-http-dav-ext)"
    if not Path(DAV_EXT_MODULE).exists():
        return f"no {DAV_EXT_MODULE} (apt-get install libnginx-mod-http-dav-ext)"
    try:
        import webdav4.fsspec  # noqa: F401
    except ImportError:
        return "no webdav4 (pip install 'ddlscale[storage]')"
    return None


def _htpasswd(user: str, password: str) -> str:
    """An htpasswd line nginx checks (``{SSHA}``: salted SHA-1); the password itself is not stored."""
    salt = secrets.token_bytes(8)
    digest = hashlib.sha1(password.encode() + salt).digest()
    return f"{user}:{{SSHA}}{base64.b64encode(digest + salt).decode()}\n"


def _nginx_conf(config: Path, root: Path, address: str) -> str:
    return f"""# The storage machine's WebDAV server (ddlscale.cluster.storage); written per cluster.
load_module {DAV_EXT_MODULE};
daemon off;
worker_processes 1;
user root root;
pid {config}/nginx.pid;
error_log {config}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    client_max_body_size 0;
    client_body_buffer_size 1m;
    client_body_temp_path {root}/{INCOMING};
    proxy_temp_path {config}/proxy;
    fastcgi_temp_path {config}/fastcgi;
    uwsgi_temp_path {config}/uwsgi;
    scgi_temp_path {config}/scgi;
    server {{
        listen {address}:{PORT};
        root {root};
        location / {{
            auth_basic "ddlscale storage";
            auth_basic_user_file {config}/htpasswd;
            dav_methods PUT DELETE MKCOL COPY MOVE;
            dav_ext_methods PROPFIND OPTIONS;
            create_full_put_path on;
            dav_access user:rw;
        }}
        location /{INCOMING}/ {{ return 403; }}
    }}
}}
"""


class StorageMachine:
    """The storage machine of ``cluster`` (an :class:`~ddlscale.cluster.emulated.EmulatedCluster`):
    a NIC of ``bandwidth`` (each direction, shared by every machine) and a WebDAV server over ``root``.

    Built by the cluster (:meth:`build` after its machines), removed with it (its namespace is one of
    the cluster's; :meth:`forget` removes the server's config directory)."""

    def __init__(self, cluster: Any, bandwidth: str | float, root: str | Path | None) -> None:
        try:
            self.bandwidth_bps = parse_bandwidth(bandwidth)
        except ValueError as exc:
            raise ValueError(f"cluster.storage.bandwidth: {exc}") from None
        if self.bandwidth_bps <= 0:
            raise ValueError(f"cluster.storage.bandwidth must be > 0, got {bandwidth!r}")
        if root is None:
            raise ValueError("cluster.storage.root: a storage machine needs a directory of this host to serve")
        self.cluster = cluster
        self.root = Path(root).resolve()
        self.endpoint: StorageEndpoint | None = None
        self.server: subprocess.Popen | None = None

    @property
    def namespace(self) -> str:
        return f"{self.cluster.name}-st"

    @property
    def address(self) -> str:
        return self.cluster.address(HOST - 1)

    @property
    def config_dir(self) -> Path:
        return Path(CONFIG_DIR) / self.cluster.name

    def build(self) -> StorageEndpoint:
        """Join the bridge behind a shaped NIC and start the server; the endpoint the workers get."""
        from ddlscale.cluster.emulated import _sh

        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cluster.storage: the storage machine cannot serve here: {reason}")
        sw, ns = self.cluster.switch, self.namespace
        _sh("ip", "netns", "add", ns)
        # Born inside the cluster's namespaces, like every machine's link.
        _sh("ip", "netns", "exec", sw, "ip", "link", "add", "vst", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "netns", "exec", sw, "ip", "link", "set", "vst", "master", "br0")
        _sh("ip", "netns", "exec", sw, "ip", "link", "set", "vst", "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address}/24", "dev", "eth0")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        self.shape()
        return self._serve()

    def shape(self, verb: str = "add") -> None:
        """Both directions of its link at the storage bandwidth / k (``verb`` "replace": re-shape)."""
        self.cluster._shape(self.namespace, "eth0", verb, bandwidth_bps=self.bandwidth_bps)  # what it serves
        self.cluster._shape(self.cluster.switch, "vst", verb, bandwidth_bps=self.bandwidth_bps)  # what it takes in

    def _serve(self) -> StorageEndpoint:
        config = self.config_dir
        shutil.rmtree(config, ignore_errors=True)
        config.mkdir(mode=0o700, parents=True)
        os.chmod(config, 0o700)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / INCOMING).mkdir(mode=0o700, exist_ok=True)
        password = secrets.token_urlsafe(24)
        fd = os.open(config / "htpasswd", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(_htpasswd(USER, password))
        (config / "nginx.conf").write_text(_nginx_conf(config, self.root, self.address))
        self._start_server()
        self.endpoint = StorageEndpoint(f"http://{self.address}:{PORT}/", USER, password)
        return self.endpoint

    def _start_server(self) -> None:
        config = self.config_dir
        log = open(config / "server.out", "ab")
        # Not a machine: the store's link bounds it, not its CPUs (see the module's docstring); in a cgroup of
        # the cluster's own, so it competes for the host as the cluster does.
        argv = ["ip", "netns", "exec", self.namespace, NGINX, "-p", str(config), "-c", str(config / "nginx.conf"),
                "-e", str(config / "error.log")]
        shares = self.cluster.cpu_shares
        self.server = subprocess.Popen(shares.wrap_service("st", argv) if shares is not None else argv, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self._wait_listening()

    def revive(self) -> None:
        """Start the server again if it ended, on the same directory and credentials: a stop of the whole
        job signals it with every other process, and the drain that follows writes here."""
        if self.server is not None and self.server.poll() is not None:
            self._start_server()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                break
            listening = subprocess.run(["ip", "netns", "exec", self.namespace, "ss", "-Hltn", f"sport = :{PORT}"],
                                       capture_output=True, text=True).stdout
            if f":{PORT}" in listening:
                return
            time.sleep(0.05)
        errors = (self.config_dir / "error.log").read_text()[-2000:] if (self.config_dir / "error.log").exists() else ""
        raise RuntimeError(f"the storage machine's server (nginx) did not start listening on {self.address}:{PORT}: "
                           f"{errors.strip() or 'no error logged'}")

    def forget(self) -> None:
        """After the cluster removed its namespaces (and with them the server): its config directory."""
        if self.server is not None:
            try:
                self.server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.config_dir, ignore_errors=True)
        self.endpoint = None


def forget_config(name: str) -> None:
    """Remove cluster ``name``'s storage server config (``down --name`` / ``down --all``)."""
    shutil.rmtree(Path(CONFIG_DIR) / name, ignore_errors=True)
