"""The commit record of a checkpoint version: which shard files make it up, their sizes and hashes.

A version exists only once its manifest exists. Shards are written first (each atomically), the
manifest last and atomically, so a manifest never names a partial file; a reader still verifies
every shard's checksum, which also catches later corruption of the storage.

Layout of a checkpoint directory (the step is the version)::

    step_000000012.manifest.json        the commit record
    step_000000012.<token>/rank_00000.ckpt   shard of rank 0 (also holds the rank-shared state)
    step_000000012.<token>/rank_00001.ckpt

``<token>`` is drawn once per run, so a run that rewrites a step (after resuming from an older
version) never writes into files a committed manifest names; its manifest then atomically replaces
the old one.

The same record (with ``tier`` and ``placement`` set) describes a version held in peers' memory.

The directory is a :class:`~ddlscale.ckpt.version.store.Store`: a path of this machine (functions
given a ``Path`` use it as one) or a directory on the emulated cluster's storage machine.

``layout`` says how a version's files hold the state: ``snapshot`` (one snapshot stream per rank, as
above: versions written before the persistent tier and Gemini's drain moved to DCP, still read) or
``dcp`` (a torch.distributed.checkpoint directory, see :mod:`ddlscale.ckpt.disk.layout`): there ``shards`` are
the ranks' DCP data files, and ``dcp`` holds DCP's own ``.metadata`` file's record and the item index
ddlscale reads instead of that (pickled) file.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddlscale.ckpt.version.checksum import matches
from ddlscale.ckpt.version.store import Store, locate, open_store

FORMAT = "ddlscale-ckpt-manifest/1"
SUFFIX = ".manifest.json"
REJECTED_SUFFIX = ".rejected"
LAYOUTS = ("snapshot", "dcp")
_NAME = re.compile(r"step_(\d{9,})" + re.escape(SUFFIX))


class ManifestError(ValueError):
    """A manifest that cannot be read, or a version that fails verification; the message names the file."""


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    file: str  # relative to the checkpoint directory
    bytes: int
    checksum: str  # "<algorithm>:<hex>" (ddlscale.ckpt.version.checksum)


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` already trained
    shared_rank: int = 0  # the shard that also holds the rank-shared (Lightning) state
    tier: str = "disk"
    placement: dict[str, Any] | None = None
    layout: str = "snapshot"
    dcp: dict[str, Any] | None = None  # layout dcp: {"metadata": ShardRecord fields, "index": {item: [file, offset, length]}}
    created_unix: float = field(default_factory=time.time)
    format: str = FORMAT

    @property
    def name(self) -> str:
        return manifest_name(self.step)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def shard(self, rank: int) -> ShardRecord:
        for record in self.shards:
            if record.rank == rank:
                return record
        raise ManifestError(f"step {self.step}: no shard for rank {rank} (world size {self.world_size})")

    @property
    def files(self) -> tuple[ShardRecord, ...]:
        """Every file the version consists of: the shards, and for a DCP version DCP's metadata file."""
        if self.dcp is None:
            return self.shards
        return (*self.shards, ShardRecord(**{**self.dcp["metadata"], "rank": -1}))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> Manifest:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{where}: not a readable manifest ({exc})") from exc
        return cls.from_dict(raw, where)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "manifest") -> Manifest:
        try:
            if raw.get("format") != FORMAT:
                raise ManifestError(f"{where}: unknown format {raw.get('format')!r}, expected {FORMAT}")
            shards = tuple(ShardRecord(int(s["rank"]), str(s["file"]), int(s["bytes"]), str(s["checksum"]))
                           for s in raw["shards"])
            manifest = cls(**{**raw, "shards": shards})
            if manifest.dcp is not None:  # its records must be well-formed before anything reads them
                record = manifest.files[-1]
                if not (isinstance(record.file, str) and isinstance(record.bytes, int) and isinstance(record.checksum, str)
                        and isinstance(manifest.dcp["index"], dict)):
                    raise TypeError("malformed dcp record")
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{where}: not a readable manifest ({exc})") from exc
        if sorted(s.rank for s in manifest.shards) != list(range(manifest.world_size)):
            raise ManifestError(f"{where}: shards do not cover ranks 0..{manifest.world_size - 1}")
        if manifest.layout not in LAYOUTS or (manifest.layout == "dcp") != isinstance(manifest.dcp, dict):
            raise ManifestError(f"{where}: layout {manifest.layout!r} with dcp record {type(manifest.dcp).__name__}")
        return manifest


def manifest_name(step: int) -> str:
    return f"step_{step:09d}{SUFFIX}"


def step_of(path: Path | str) -> int | None:
    name = path.name if isinstance(path, Path) else str(path).rpartition("/")[2]
    match = _NAME.fullmatch(name)  # never a temporary or set-aside file
    return int(match.group(1)) if match else None


def manifest_names(directory: Path | Store) -> list[str]:
    """Names of the manifests in ``directory``, newest step first."""
    found = [(step, name) for name in open_store(directory).names() if (step := step_of(name)) is not None]
    return [name for _, name in sorted(found, reverse=True)]


def list_manifests(directory: Path | Store) -> list[Any]:
    """Manifests in ``directory``, newest step first: paths (a store on the storage machine: ``storage://`` names)."""
    store = open_store(directory)
    return [store.locator(name) for name in manifest_names(store)]


def read_manifest(path: Path | str) -> Manifest:
    store, name = locate(path)
    try:
        text = store.read(name).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read ({exc})") from exc
    return Manifest.from_json(text, where=str(path))


def write_manifest(directory: Path | Store, manifest: Manifest) -> Any:
    """Publish ``manifest`` atomically: from here on the version exists. Its path (or ``storage://`` name)."""
    store = open_store(directory)
    store.publish(manifest.name, manifest.to_json().encode())
    return store.locator(manifest.name)


def read_shard(directory: Path | Store, record: ShardRecord) -> bytes:
    """A shard's bytes, checked against its record; ManifestError naming the file otherwise."""
    store = open_store(directory)
    path = store.locator(record.file)
    try:
        data = store.read(record.file)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read shard ({exc})") from exc
    if len(data) != record.bytes:
        raise ManifestError(f"{path}: {len(data)} bytes, manifest says {record.bytes}")
    if not matches(data, record.checksum):
        raise ManifestError(f"{path}: checksum mismatch (corrupt shard)")
    return data


def verify(directory: Path | Store, manifest: Manifest) -> None:
    """Read and hash every file of ``manifest``; raise ManifestError naming the first bad file."""
    for record in manifest.files:
        read_shard(directory, record)
