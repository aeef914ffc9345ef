"""Holding a process group without keeping it alive.

c10d's registry owns every group, and ``destroy_process_group`` drops its references. A group that
something else still holds lives on, with gloo's worker threads, into interpreter shutdown; there a
worker that frees a finished collective's tensors needs the GIL, and Python ends such a thread in a
way that aborts the process ("terminate called without an active exception"). Held weakly, a group
ends at ``destroy_process_group``, its threads joined (with the GIL released) while Python still runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch.distributed as dist


def weak_group(group: dist.ProcessGroup | None) -> Callable[[], dist.ProcessGroup | None]:
    """A call that returns ``group`` for as long as c10d holds it (None stays None: the world)."""
    if group is None:
        return lambda: None
    ref = weakref.ref(group)

    def get() -> dist.ProcessGroup:
        held = ref()
        if held is None:
            raise RuntimeError("the process group has been destroyed (destroy_process_group)")
        return held

    return get
