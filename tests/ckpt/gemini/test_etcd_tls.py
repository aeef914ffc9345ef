"""ckpt.store=etcd+https://...: the job's keys in an etcd member that speaks TLS only and asks clients for
certificates (issue 44 item 8). The certificates are made here with openssl: a CA, the member's (for
127.0.0.1) and a client's; etcd runs on loopback with its data in the test's directory."""

import shutil
import subprocess
import time

import pytest

from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.cluster.control_plane import EtcdKeyValue, missing
from ddlscale.cluster.local import free_port

REASON = missing(server=True) or (None if shutil.which("openssl") else "openssl not installed")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"etcd over TLS cannot run: {REASON}")


def _openssl(*argv, cwd):
    subprocess.run(["openssl", *argv], cwd=cwd, check=True, capture_output=True)


def _certificates(directory):
    """ca.pem; server.pem/-key.pem for IP 127.0.0.1; client.pem/-key.pem; all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca-key.pem", "-out", "ca.pem", cwd=directory)
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}-key.pem",
                 "-out", f"{name}.csr", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    directory = tmp_path_factory.mktemp("etcd-tls")
    _certificates(directory)
    client_port, peer_port = free_port(), free_port()
    url = f"https://127.0.0.1:{client_port}"
    log = open(directory / "etcd.log", "w")  # noqa: SIM115
    member = subprocess.Popen(
        ["etcd", "--name", "tls0", "--data-dir", str(directory / "data"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"tls0=http://127.0.0.1:{peer_port}", "--enable-v2=true",
         "--cert-file", str(directory / "server.pem"), "--key-file", str(directory / "server-key.pem"),
         "--trusted-ca-file", str(directory / "ca.pem"), "--client-cert-auth"],
        stdout=log, stderr=subprocess.STDOUT)
    log.close()
    address = (f"etcd+https://127.0.0.1:{client_port}?ca_cert={directory / 'ca.pem'}"
               f"&cert={directory / 'client.pem'}&key={directory / 'client-key.pem'}")
    deadline = time.monotonic() + 60
    while True:
        try:
            EtcdKeyValue(address, timeout_s=2).set("probe", "1")
            break
        except Exception:
            assert member.poll() is None and time.monotonic() < deadline, (directory / "etcd.log").read_text()[-3000:]
            time.sleep(0.5)
    yield address, directory, client_port
    member.terminate()
    member.wait(timeout=10)


def test_the_jobs_keys_round_trip_through_etcd_over_tls(tls_etcd):
    address, _, _ = tls_etcd
    store = kvstore.JobStore(kvstore.connect(address), "tls", JobKeys(b"t" * 32, "tls"))
    store.set(store.keys.incarnation, 4)
    assert store.get(store.keys.incarnation) == 4
    key = store.keys.root
    first = store.signed(key, 1)
    assert bytes(store.raw.compare_set(key, "", first)) == first.encode()
    assert bytes(store.raw.compare_set(key, "", store.signed(key, 2))) == first.encode()  # lost the race
    assert store.get(key) == 1 and store.refused == 0


def test_a_client_without_a_certificate_is_turned_away(tls_etcd):
    _, directory, port = tls_etcd
    anonymous = f"etcd+https://127.0.0.1:{port}?ca_cert={directory / 'ca.pem'}"
    with pytest.raises(Exception):  # noqa: B017 - the TLS handshake fails, however the client reports it
        EtcdKeyValue(anonymous, timeout_s=2).set("intruder", "1")
