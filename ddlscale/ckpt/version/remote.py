"""A checkpoint directory on the emulated cluster's storage machine, through fsspec's WebDAV client.

``ckpt.dir=storage://<path>`` (:mod:`~ddlscale.ckpt.version.store`): ``<path>`` under the storage
machine's root (:mod:`ddlscale.cluster.storage`), reached with the endpoint and credentials the
launcher put in this process's environment. DCP writes a version through its own ``FsspecWriter``
(:meth:`RemoteStore.dcp_writer`); the tier's manifests, reads and pruning go through the same client.

The commit protocol over a store without fsync or directories' atomic renames: every object appears
whole or not at all (the server renames a PUT's body into place once it is complete, see
:mod:`ddlscale.cluster.storage`), and the manifest is one PUT, published after every file it names
was answered by the server. A reader lists manifests only; a version's files without a manifest
(a crash mid-write) are never read, and pruning removes them.

Hashes without a second trip over the link: a rank's writer hashes each file as DCP writes it and
leaves ``<file>.sha256`` beside it (JSON: size and sha256); rank 0's commit reads those few bytes
instead of reading back every rank's file over the shared link, which would double what a
checkpoint costs the store. A restore checks every file it reads against the manifest, as from a
local directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.store import Store, storage_root
from ddlscale.cluster.storage_client import PutStream, StorageEndpoint, as_oserror

DIGEST_SUFFIX = ".sha256"  # beside each file a writer hashed: {"bytes": n, "checksum": "sha256:<hex>"}


class RemoteStore(Store):
    """``root`` (a path under the server's root) through ``fs``, a webdav4 ``WebdavFileSystem``."""

    remote = True

    def __init__(self, fs: Any, root: str, spec: str) -> None:
        self.fs, self.root, self.spec = fs, root.strip("/"), spec.rstrip("/")

    @classmethod
    def on_storage_machine(cls, spec: str, key: str = "ckpt.dir") -> RemoteStore:
        """``storage://<path>`` on the endpoint the launcher handed this process."""
        root = storage_root(spec, key)
        endpoint = StorageEndpoint.from_env()
        if endpoint is None:
            raise ValueError(f"{key}={spec}: no storage machine serves this process; it is the emulated cluster's "
                             "(cluster=emulated cluster.storage.bandwidth=<rate>)")
        return cls(endpoint.filesystem(), root, spec)

    def _path(self, name: str = "") -> str:
        return posixpath.join(self.root, name) if name else self.root

    def names(self) -> list[str]:
        try:
            with as_oserror(self.locator("")):
                return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path(), detail=False)]
        except FileNotFoundError:
            return []

    def read(self, name: str) -> bytes:
        buffer = io.BytesIO()
        with as_oserror(self.locator(name)):
            self.fs.client.download_fileobj(self._path(name), buffer)
        return buffer.getvalue()

    def publish(self, name: str, data: bytes) -> None:
        with as_oserror(self.locator(name)):
            self.fs.pipe_file(self._path(name), data)  # one PUT: whole or not at all

    def rename(self, name: str, new: str) -> None:
        with as_oserror(self.locator(name)):
            self.fs.client.move(self._path(name), self._path(new), overwrite=True)  # MOVE: a rename on the server

    def remove(self, name: str) -> None:
        client = self.fs.client
        with contextlib.suppress(FileNotFoundError), as_oserror(self.locator(name)):
            if client.isdir(self._path(name)):
                # WebDAV deletes a collection by its URL with the trailing slash (nginx answers 409 without
                # it); webdav4 strips that slash, so this one request goes through its HTTP client.
                client.http.delete(f"{client.join_url(self._path(name))}/").raise_for_status()
            else:
                client.remove(self._path(name))

    def make(self) -> None:
        if self.root:
            with as_oserror(self.locator("")):
                self.fs.makedirs(self.root, exist_ok=True)

    def digest(self, name: str) -> tuple[int, str]:
        """The writer's record beside the file, if it left one; else the file read back and hashed."""
        try:
            record = json.loads(self.read(name + DIGEST_SUFFIX))
        except FileNotFoundError:
            data = self.read(name)
            return len(data), checksum(data)
        except ValueError as exc:
            raise OSError(f"{self.locator(name)}{DIGEST_SUFFIX}: unreadable ({exc})") from None
        size, digest = (record.get("bytes"), record.get("checksum")) if isinstance(record, dict) else (None, None)
        if not (isinstance(size, int) and size >= 0 and isinstance(digest, str) and digest.startswith("sha256:")):
            raise OSError(f"{self.locator(name)}{DIGEST_SUFFIX}: not a digest record")
        return size, digest

    def locator(self, name: str) -> str:
        return f"{self.spec}/{name}" if name else self.spec

    def same(self, other: Store) -> bool:
        return isinstance(other, RemoteStore) and other.root == self.root and other.fs.client.base_url == self.fs.client.base_url

    def __str__(self) -> str:
        return self.spec

    # -- writing -------------------------------------------------------------------------------------
    def open_write(self, name: str) -> PutStream:
        """A file whose bytes stream to the server as they are written; whole once closed."""
        return PutStream(self.fs, self._path(name))

    def dcp_writer(self, version_dir: str) -> FsspecWriter:
        """DCP's fsspec writer for one version: one file per rank, each a streamed PUT hashed on the way."""
        client = self.fs.client
        writer = FsspecWriter(f"webdav://{self._path(version_dir)}", single_file_per_rank=True, sync_files=False,
                              thread_count=1, overwrite=False, base_url=str(client.base_url), client=client,
                              skip_instance_cache=True)
        writer.fs = _HashingFileSystem(self)  # this store's client (and credentials), not a second one
        return writer


class _HashingFileSystem(FileSystem):
    """DCP's fsspec file system over a :class:`RemoteStore`: each file written as a streamed PUT, its
    digest left beside it for the commit (``.tmp`` files, renamed by DCP once written, are not)."""

    def __init__(self, store: RemoteStore) -> None:
        super().__init__()
        self.store, self.fs = store, store.fs

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = self.fs._strip_protocol(os.fspath(path))
        stream = PutStream(self.fs, target)
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()
        if not target.endswith(".tmp"):
            record = json.dumps({"bytes": stream.size, "checksum": stream.checksum()}).encode()
            with as_oserror(target + DIGEST_SUFFIX):
                self.fs.pipe_file(target + DIGEST_SUFFIX, record)
