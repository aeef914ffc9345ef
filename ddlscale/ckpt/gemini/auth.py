"""The job's secret, and what it authenticates.

A Gemini job's launcher draws 32 random bytes when it starts the job (:func:`create_secret_file`),
writes them, hex-encoded, to a file only its owner may read, and hands that file's path to the
trainers and replica agents in ``$DDLSCALE_SECRET_FILE``. Anyone who can reach an agent or the store
but cannot read that file can neither read, write nor forge anything the checkpointer trusts.

From the secret each process derives one key per purpose (HMAC-SHA256 of a label and the job id), so
a MAC made for one purpose, or for another job sharing the secret, never verifies for this one:

* ``message`` — every request to a replica agent and every reply (:mod:`ddlscale.ckpt.gemini.protocol`);
* ``record`` — every store value the checkpointer trusts, bound to its key name (:mod:`ddlscale.ckpt.gemini.kvstore`);
* ``replica`` — the MAC of a replica's bytes: computed by its sender, checked by every holder before
  the replica counts and by every reader before it is restored (:mod:`ddlscale.ckpt.version.checksum`).

HMAC-SHA256 (Python's ``hmac``) is the MAC throughout: with SHA extensions it hashes ~1.9 GB/s on
this host's cores, and it is what every Python has.

On a real cluster, create the file once and copy it to every machine (readable by the job's user only)::

    python -m ddlscale.ckpt.gemini.auth new /path/to/secret     # then export DDLSCALE_SECRET_FILE=/path/to/secret
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

SECRET_ENV = "DDLSCALE_SECRET_FILE"
SECRET_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256


class SecretError(RuntimeError):
    """No usable job secret; the message says what to do."""


def write_secret(path: str | Path) -> Path:
    """A new random secret at ``path`` (which must not exist), created readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return Path(path)


def create_secret_file(directory: str | Path) -> Path:
    """A new secret in ``directory/secret`` (the directory should be private: ``tempfile.mkdtemp``
    makes it 0700)."""
    return write_secret(Path(directory) / "secret")


def read_secret(path: str | Path) -> bytes:
    """The secret in ``path``; refused when others than its owner may read it, or it is malformed."""
    path = Path(path)
    try:
        info = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise SecretError(f"job secret {path}: cannot read ({exc})") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"job secret {path} is accessible to group or others (mode {stat.filemode(info.st_mode)}): "
                          f"chmod 600 {path}")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise SecretError(f"job secret {path}: expected {2 * SECRET_BYTES} hex digits "
                          "(python -m ddlscale.ckpt.gemini.auth new PATH makes one)")
    return secret


class JobKeys:
    """One job's keys, derived from its secret and its id."""

    def __init__(self, secret: bytes, job: str) -> None:
        self.job = job

        def derive(purpose: str) -> bytes:
            return hmac.new(secret, f"ddlscale-gemini/{purpose}/{job}".encode(), hashlib.sha256).digest()

        self.message, self.record, self.replica = derive("message"), derive("record"), derive("replica")

    @classmethod
    def from_env(cls, job: str) -> JobKeys:
        """The keys of ``job`` from the secret ``$DDLSCALE_SECRET_FILE`` names."""
        path = os.environ.get(SECRET_ENV)
        if not path:
            raise SecretError(
                f"ckpt=gemini needs the job's secret: ${SECRET_ENV} names a file only the job's user can read "
                "(cluster=local and cluster=emulated make one; on a real cluster: python -m ddlscale.ckpt.gemini.auth "
                "new PATH, copy it to every machine, export the variable)")
        return cls(read_secret(path), job)

    # -- store records ---------------------------------------------------------------------------
    def sign(self, name: str, value: str) -> str:
        """``value`` as stored under key ``name``: ``<hex MAC>.<value>``, the MAC binding both."""
        return f"{self._record_mac(name, value)}.{value}"

    def open(self, name: str, signed: bytes | str) -> str | None:
        """The value a signed record holds, or None when it was not signed with this job's key for ``name``."""
        text = signed.decode(errors="replace") if isinstance(signed, bytes) else signed
        mac, dot, value = text.partition(".")
        if not dot or not hmac.compare_digest(mac, self._record_mac(name, value)):
            return None
        return value

    def _record_mac(self, name: str, value: str) -> str:
        return hmac.new(self.record, f"{len(name)}:{name}".encode() + value.encode(), hashlib.sha256).hexdigest()

    # -- agent messages --------------------------------------------------------------------------
    def message_mac(self, *parts: bytes | bytearray | memoryview) -> bytes:
        mac = hmac.new(self.message, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="make a Gemini job secret")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="write a new random secret, readable by its owner only")
    new.add_argument("path")
    args = parser.parse_args(argv)
    path = write_secret(args.path)
    print(f"wrote {path}; copy it to every machine (mode 600) and export {SECRET_ENV}={path}")


if __name__ == "__main__":
    main()
