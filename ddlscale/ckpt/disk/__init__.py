"""``ckpt=disk``: the persistent tier, in torch.distributed.checkpoint (DCP) format.

* :mod:`~ddlscale.ckpt.disk.disk_checkpointer` — ``DiskCheckpointer``: every K steps a version, ``keep``,
  write-rate emulation, ``resume=auto``.
* :mod:`~ddlscale.ckpt.disk.layout` — how a version is laid out in DCP, and its items' names;
  :mod:`~ddlscale.ckpt.disk.writer` writes and commits versions (``DcpWriter``),
  :mod:`~ddlscale.ckpt.disk.reader` reads them back without unpickling (``DcpVersion``).
"""
