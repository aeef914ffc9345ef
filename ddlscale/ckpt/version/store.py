"""Where a checkpoint directory lives: a directory of this machine, or one on a remote store.

The persistent tier reads and writes its directory only through a :class:`Store`, by names relative
to it (``step_000000012.manifest.json``, ``step_000000012.<token>/__0_0.distcp``). ``ckpt.dir`` says
which kind:

* a path: :class:`LocalStore`, a directory of this machine's file system (files appear whole through
  :func:`~ddlscale.ckpt.version.atomic.write_atomic`, fsynced);
* ``storage://<path>``: that path on the emulated cluster's storage machine
  (:mod:`ddlscale.cluster.storage`), through its WebDAV server and fsspec's client
  (:class:`~ddlscale.ckpt.version.remote.RemoteStore`).

What every kind must keep (the commit protocol rests on it): :meth:`Store.publish` is all or nothing —
a reader sees the whole object under its name or none; and a name once published is read back as
published until removed or published again.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ddlscale.ckpt.version.atomic import fsync_dir, write_atomic
from ddlscale.ckpt.version.checksum import Checksum

SCHEME = "storage://"  # ckpt.dir's prefix for a directory on the emulated cluster's storage machine


class Store:
    """A checkpoint directory's operations; ``name``: relative to it, ``/``-separated."""

    remote = False

    def names(self) -> list[str]:
        """The entries directly in the directory (none when it does not exist)."""
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        """A file's bytes; OSError (FileNotFoundError when absent) otherwise."""
        raise NotImplementedError

    def publish(self, name: str, data: bytes) -> None:
        """Write ``name`` all or nothing, replacing what was there."""
        raise NotImplementedError

    def rename(self, name: str, new: str) -> None:
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """A file, or a directory with all in it; already gone is fine."""
        raise NotImplementedError

    def make(self) -> None:
        """Create the directory (and its parents) if it is not there."""
        raise NotImplementedError

    def digest(self, name: str) -> tuple[int, str]:
        """Size and sha256 (``"sha256:<hex>"``) of a file the tier wrote, for its commit record."""
        raise NotImplementedError

    def sync(self, name: str) -> None:
        """Make a directory's entries durable before a manifest names them (where that takes a step)."""

    def locator(self, name: str) -> Any:
        """What names the entry to a user, in messages, and as Lightning's ``ckpt_path``."""
        raise NotImplementedError

    def same(self, other: Store) -> bool:
        raise NotImplementedError


class LocalStore(Store):
    """A directory of this machine (every tier's only kind before remote stores)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def names(self) -> list[str]:
        return [entry.name for entry in self.path.iterdir()] if self.path.is_dir() else []

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def publish(self, name: str, data: bytes) -> None:
        write_atomic(self.path / name, data)

    def rename(self, name: str, new: str) -> None:
        (self.path / name).replace(self.path / new)

    def remove(self, name: str) -> None:
        entry = self.path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

    def make(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def digest(self, name: str) -> tuple[int, str]:
        summer, size = Checksum("sha256"), 0
        with open(self.path / name, "rb") as handle:
            while chunk := handle.read(1 << 22):
                summer.update(chunk)
                size += len(chunk)
        return size, summer.text()

    def sync(self, name: str) -> None:
        fsync_dir(self.path / name)

    def locator(self, name: str) -> Path:
        return self.path / name

    def same(self, other: Store) -> bool:
        return isinstance(other, LocalStore) and self.path.resolve() == other.path.resolve()

    def __str__(self) -> str:
        return str(self.path)


def storage_root(spec: str, key: str = "ckpt.dir") -> str:
    """The path under the storage machine's root that ``storage://<path>`` names; refused, naming ``key``,
    when it would climb out of that root (checked at launch too, before any worker starts)."""
    root = spec[len(SCHEME):].strip("/")
    if any(part in ("..", ".") for part in root.split("/")):
        raise ValueError(f"{key}={spec}: a path under the storage machine's root, without '.' or '..'")
    return root


def open_store(directory: str | Path | Store, key: str = "ckpt.dir") -> Store:
    """The store ``directory`` names (``storage://<path>``: on the emulated cluster's storage machine,
    whose endpoint the launcher put in this process's environment); a bad one names ``key``."""
    if isinstance(directory, Store):
        return directory
    if isinstance(directory, str) and directory.startswith(SCHEME):
        from ddlscale.ckpt.version.remote import RemoteStore

        return RemoteStore.on_storage_machine(directory, key)
    return LocalStore(directory)


def locate(ref: str | Path) -> tuple[Store, str]:
    """The store and name of one entry (a manifest's path or ``storage://`` reference)."""
    text = str(ref)
    if text.startswith(SCHEME):
        parent, _, name = text.rstrip("/").rpartition("/")
        return open_store(parent if parent != SCHEME.rstrip("/") else SCHEME), name
    path = Path(ref)
    return LocalStore(path.parent), path.name
