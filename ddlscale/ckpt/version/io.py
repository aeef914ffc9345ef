"""Lightning reads a committed version through its CheckpointIO plugin point.

``trainer.fit(ckpt_path=<manifest>)`` makes every rank call ``strategy.load_checkpoint(path)``; this
plugin answers with that rank's assembled state (the shared part from the shared shard, the local
part from its own shard, both checksum-verified). A tier that keeps no files (Gemini's peer memory)
answers its own paths through ``loader``. Any other path goes to the wrapped plugin, so ordinary
``.ckpt`` files keep working. A version saved at another world size is resharded on the way
(:mod:`~ddlscale.ckpt.state.reshard`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_fabric.plugins import CheckpointIO

from ddlscale import clock
from ddlscale.ckpt.disk.reader import DcpVersion
from ddlscale.ckpt.state.reshard import assemble_resharded
from ddlscale.ckpt.state.shard import assemble, decode
from ddlscale.ckpt.version.atomic import pace
from ddlscale.ckpt.version.manifest import SUFFIX, read_manifest, read_shard
from ddlscale.ckpt.version.store import locate


def load_version(manifest_path: Path | str, rank: int, bandwidth_bps: float | None = None,
                 world_size: int | None = None) -> dict[str, Any]:
    """Rank ``rank``'s restorable checkpoint dict from the version ``manifest_path`` commits (a path, or a
    ``storage://`` name on the storage machine), read at most at ``bandwidth_bps`` when given (emulated
    remote storage on a local disk). ``world_size`` (default: the version's) other than the version's
    resumes at that size (:mod:`~ddlscale.ckpt.state.reshard`)."""
    start = clock.now()
    manifest = read_manifest(manifest_path)
    world = manifest.world_size if world_size is None else world_size
    if not 0 <= rank < world:
        raise RuntimeError(f"{manifest_path}: rank {rank} is not one of {world} ranks")
    directory, _ = locate(manifest_path)
    if manifest.layout == "dcp":
        version = DcpVersion(directory, manifest)
        payload_of, bytes_read = version.payload, lambda: version.bytes_read
    else:
        read: list[int] = []

        def payload_of(r: int) -> dict[str, Any]:
            record = manifest.shard(r)
            read.append(record.bytes)
            return decode(read_shard(directory, record), where=str(directory.locator(record.file)))  # verified

        def bytes_read() -> int:
            return sum(read)

    shared = payload_of(manifest.shared_rank)
    if world == manifest.world_size:
        loaded = assemble(shared, shared if rank == manifest.shared_rank else payload_of(rank))
    else:
        saved = [shared if r == manifest.shared_rank else payload_of(r) for r in range(manifest.world_size)]
        loaded = assemble_resharded(shared, [p["local"] for p in saved], rank, world)
    pace(bytes_read(), bandwidth_bps, start)
    return loaded


class ManifestCheckpointIO(CheckpointIO):
    """Loads ``*.manifest.json`` versions for ``rank`` of ``world_size``; delegates everything else to ``inner``.

    ``loader(path)``: a tier's own loader, asked first; it returns None for paths that are not its.
    """

    def __init__(self, inner: CheckpointIO, rank: int, loader: Callable[[str], dict[str, Any] | None] | None = None,
                 world_size: int | None = None) -> None:
        self.inner = inner
        self.rank = rank
        self.loader = loader
        self.world_size = world_size

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if self.loader is not None and (loaded := self.loader(str(path))) is not None:
            return loaded
        if str(path).endswith(SUFFIX):
            return load_version(str(path), self.rank, world_size=self.world_size)
        kwargs = {} if map_location is None else {"map_location": map_location}
        return self.inner.load_checkpoint(path, weights_only=weights_only, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
