"""``ckpt=disk``: the persistent tier, in torch.distributed.checkpoint (DCP) format.

* :mod:`~ddlscale.ckpt.disk.checkpointer` — ``DiskCheckpointer``: every K steps a version, ``keep``,
  write-rate emulation, ``resume=auto``.
* :mod:`~ddlscale.ckpt.disk.dcp` — how a version is laid out in DCP, written (``DcpWriter``) and read
  back without unpickling (``DcpVersion``).
"""
