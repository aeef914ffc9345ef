"""A committed version: the record that makes it exist, and reading it back.

* :mod:`~ddlscale.ckpt.version.manifest` — the commit record (step, world size, every shard's size
  and checksum), written last and atomically; ``verify`` re-hashes every shard.
* :mod:`~ddlscale.ckpt.version.checksum` — sha256 and the keyed MACs.
* :mod:`~ddlscale.ckpt.version.atomic` — atomic writes (temporary name, fsync, rename) and pacing.
* :mod:`~ddlscale.ckpt.version.io` — loading a version on one rank; Lightning's CheckpointIO plugin.
"""
