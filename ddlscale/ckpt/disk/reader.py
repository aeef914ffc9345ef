"""Reading a committed DCP version back, rank by rank, without unpickling anything.

Why ddlscale does not read the files with DCP's reader: ``FileSystemReader.read_metadata`` unpickles
``.metadata`` (``pickle.load``: whoever can write the directory runs code in every process that
resumes), and ``read_data`` ``torch.load``-s each item (the weights-only unpickler: restricted, but
an unpickler). ddlscale's restore path runs neither. Its index of the items (file, offset, length) is
taken, at commit, from the ``Metadata`` object DCP returns in memory, and written as JSON into the
manifest with a sha256 of every file; a reader checks a file's hash before parsing a byte of it,
finds an item's raw storage bytes by the item's zip directory alone (``torch.save`` stores a tensor's
storage as an uncompressed zip member) and takes dtype and shape from the skeleton, which the
snapshot decoder (:func:`~ddlscale.ckpt.state.snapshot.rebuild_skeleton`) rebuilds: JSON, containers,
tensors, numeric arrays, nothing else.
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

from ddlscale.ckpt.disk.layout import SKELETON_FORMAT, skeleton_item
from ddlscale.ckpt.state.snapshot import rebuild_skeleton
from ddlscale.ckpt.version.manifest import Manifest, ManifestError, read_shard
from ddlscale.ckpt.version.store import Store, open_store


def _storage_bytes(blob: bytes, where: str) -> bytearray:
    """The raw storage bytes of one item: ``torch.save``'s zip, read through its directory alone (its
    pickled ``data.pkl`` is never looked at)."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            infos = archive.infolist()
            storages = [i for i in infos if i.filename.split("/")[-2:-1] == ["data"]]
            if len(storages) != 1:
                raise ValueError(f"{len(storages)} storages, expected one")
            info = storages[0]
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError("a compressed storage")
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            if order and archive.read(order[0]).decode() != sys.byteorder:
                raise ValueError(f"stored {archive.read(order[0]).decode()}-endian on a {sys.byteorder}-endian host")
            return bytearray(archive.read(info))  # zipfile checks the member's CRC
    except (zipfile.BadZipFile, ValueError, UnicodeDecodeError, EOFError) as exc:
        raise ManifestError(f"{where}: not a tensor item ({exc})") from None


class DcpVersion:
    """A committed DCP version, read rank by rank; every file's hash is checked before it is parsed."""

    def __init__(self, directory: Path | Store, manifest: Manifest) -> None:
        if manifest.layout != "dcp":
            raise ValueError("not a DCP version")
        self.store = open_store(directory)
        self.manifest = manifest
        self._files: dict[str, bytes] = {}
        self.bytes_read = 0

    def _file(self, name: str) -> bytes:
        if name not in self._files:
            record = next((r for r in self.manifest.shards if r.file.rpartition("/")[2] == name), None)
            if record is None:
                raise ManifestError(f"step {self.manifest.step}: the index names {name!r}, which no shard record covers")
            self._files[name] = read_shard(self.store, record)  # size and sha256 checked
            self.bytes_read += record.bytes
        return self._files[name]

    def _item(self, name: str) -> bytearray:
        entry = self.manifest.dcp["index"].get(name)
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry[1:])):
            raise ManifestError(f"step {self.manifest.step}: no readable index entry for item {name!r}")
        file, offset, length = entry
        blob = self._file(file)
        if offset + length > len(blob):
            raise ManifestError(f"step {self.manifest.step}: item {name!r} lies outside {file}")
        return _storage_bytes(blob[offset:offset + length], f"{file}[{name}]")

    def payload(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s payload (``{"format", "local", "shared"}``), tensors on the CPU."""
        where = f"step {self.manifest.step} rank {rank}"
        try:
            record = json.loads(bytes(self._item(skeleton_item(rank))))
        except ValueError as exc:
            raise ManifestError(f"{where}: unreadable skeleton ({exc})") from None
        if not isinstance(record, dict) or record.get("format") != SKELETON_FORMAT or record.get("rank") != rank:
            raise ManifestError(f"{where}: not a ddlscale rank skeleton")
        segments = record.get("segments")
        if not isinstance(segments, list) or not all(isinstance(s, str) for s in segments):
            raise ManifestError(f"{where}: malformed segment list")

        def fetch(index: int, nbytes: int) -> bytearray:
            if not 0 <= index < len(segments):
                raise ValueError(f"segment {index} not in the skeleton's list")
            return self._item(segments[index])

        try:
            return rebuild_skeleton(record.get("skeleton"), fetch)
        except ValueError as exc:
            raise ManifestError(f"{where}: {exc}") from None
