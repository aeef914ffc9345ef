"""A rank's state as bytes, and back.

* :mod:`~ddlscale.ckpt.state.shard` — what the state is: the rank-shared part (Lightning's checkpoint)
  and the rank-local part (RNG, data position, sync-backend state); capture, assemble, restore.
* :mod:`~ddlscale.ckpt.state.snapshot` — the byte stream (JSON plus raw tensors, never pickle).
* :mod:`~ddlscale.ckpt.state.rng`, :mod:`~ddlscale.ckpt.state.data` — RNG streams and data position.
* :mod:`~ddlscale.ckpt.state.reshard` — a version of N ranks restored on M.
"""
