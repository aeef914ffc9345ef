"""Launched etcd members speak TLS to each other, with certificates of a certificate authority made for
the launch alone (issue 61 item 4): their peer URLs are https, each asks its peers for a certificate of
that CA, and the CA's key is gone once the members' certificates are signed. The first two tests need
openssl only; the last starts two members on loopback (etcd installed)."""

import json
import shutil
import socket
import ssl
import stat
import subprocess
import urllib.request

import pytest

from ddlscale.cluster.control_plane import EtcdMembers, Member, missing, peer_certificates
from ddlscale.cluster.local import free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def _members():
    return [Member(f"m{i}", "127.0.0.1", free_port(), free_port()) for i in range(2)]


def test_each_member_gets_a_certificate_of_a_ca_made_for_the_launch_whose_key_is_then_gone(tmp_path):
    members = _members()
    tls = peer_certificates(tmp_path / "tls", members)
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700
    assert not (tls / "ca-key.pem").exists()  # no further certificate can be made that the members accept
    for m in members:
        assert stat.S_IMODE((tls / f"{m.name}-key.pem").stat().st_mode) == 0o600
        verified = subprocess.run(["openssl", "verify", "-CAfile", str(tls / "ca.pem"), str(tls / f"{m.name}.pem")],
                                  capture_output=True, text=True)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        text = subprocess.run(["openssl", "x509", "-in", str(tls / f"{m.name}.pem"), "-noout", "-text"],
                              capture_output=True, text=True, check=True).stdout
        assert "IP Address:127.0.0.1" in text and "TLS Web Client Authentication" in text
    first = (tls / "ca.pem").read_bytes()
    again = peer_certificates(tmp_path / "tls", members)  # the next launch: a CA of its own
    assert (again / "ca.pem").read_bytes() != first


def test_the_members_are_started_with_https_peer_urls_and_client_certificate_auth(tmp_path):
    members = _members()
    cluster = EtcdMembers(members, tmp_path, run=None, token="job")
    argv = cluster._argv(0, "new", tmp_path / "m0.0")
    value = {flag: argv[argv.index(flag) + 1] for flag in ("--listen-peer-urls", "--initial-advertise-peer-urls",
                                                            "--initial-cluster", "--peer-cert-file", "--peer-key-file",
                                                            "--peer-trusted-ca-file")}
    assert value["--listen-peer-urls"] == f"https://127.0.0.1:{members[0].peer_port}"
    assert value["--initial-cluster"] == ",".join(f"{m.name}=https://127.0.0.1:{m.peer_port}" for m in members)
    assert value["--peer-trusted-ca-file"] == str(tmp_path / "tls" / "ca.pem")
    assert value["--peer-cert-file"] == str(tmp_path / "tls" / "m0.pem")
    assert "--peer-client-cert-auth" in argv


def _handshake(port: int, ca: str, cert: tuple[str, str] | None) -> str:
    """What a peer presenting ``cert`` gets from a member's peer port: its /members answer, or the error."""
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False
    if cert is not None:
        context.load_cert_chain(*cert)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                context.wrap_socket(raw) as tls:
            tls.sendall(b"GET /members HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = tls.recv(4096).decode(errors="replace")
            return answer or "closed"
    except (ssl.SSLError, OSError) as exc:
        return f"refused: {exc}"


@pytest.mark.multiprocess
@pytest.mark.skipif(missing(server=True) is not None, reason=f"etcd cannot run: {missing(server=True)}")
def test_launched_members_list_https_peers_and_refuse_a_peer_without_the_launchs_ca(tmp_path):
    members = _members()
    cluster = EtcdMembers(members, tmp_path / "etcd", lambda _, argv, **kw: subprocess.Popen(argv, **kw), "job")
    cluster.start()  # a healthy quorum of two: their peer traffic went over TLS
    try:
        request = urllib.request.Request(members[0].client_url + "/v3/cluster/member/list", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            listed = json.loads(response.read())["members"]
        assert sorted(url for m in listed for url in m["peerURLs"]) == sorted(m.peer_url for m in members)
        assert all(url.startswith("https://") for m in listed for url in m["peerURLs"])

        tls = tmp_path / "etcd" / "tls"
        other = peer_certificates(tmp_path / "other", members)  # what a member of another launch holds
        port = members[0].peer_port
        # A member of the launch is let in: the same request that a stranger's certificate cannot make.
        assert "200 OK" in _handshake(port, str(tls / "ca.pem"), (str(tls / "m1.pem"), str(tls / "m1-key.pem")))
        for cert in ((str(other / "m1.pem"), str(other / "m1-key.pem")), None):
            answer = _handshake(port, str(tls / "ca.pem"), cert)
            assert "200 OK" not in answer, answer
        plain = socket.create_connection(("127.0.0.1", port), timeout=10)  # plain http on the peer port
        plain.sendall(b"GET /members HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"200 OK" not in plain.recv(4096)
        plain.close()
    finally:
        cluster.stop()
