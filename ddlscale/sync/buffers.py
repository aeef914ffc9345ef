"""Rank 0's buffers on every rank before each training step, as DDP's ``broadcast_buffers``, but
sent only where they change.

DDP sends every buffer every step. A buffer no rank changes is equal everywhere already, and sending
it costs a collective a step for nothing, whatever the sync method (DeepFM's constant field offsets:
1.2-5 ms a step on the emulated cluster). Which buffers change is measured, not declared: a
BatchNorm's running statistics change in place without their version counter moving, and a
non-persistent buffer may change as well as a persistent one.

So the first step sends every buffer, as DDP would (a restored checkpoint's included), and keeps a
copy of each; before the second step every rank compares its buffers with its copy, and one
collective agrees which changed on any rank. Those go out every step from then on, exactly as DDP
sends them (so where buffers change the result is DDP's, bit for bit); the rest never again. A buffer
that stayed put in the first step and changes later is not sent: each rank checks it against its copy
every step and warns once, as telling the other ranks would take a collective every step.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ddlscale.comm import Communicator


class BufferBroadcast:
    """Keeps ``module``'s buffers equal to rank 0's over ``comm`` (call :meth:`before_step` on every
    rank before each training step)."""

    def __init__(self, module: torch.nn.Module, comm: Communicator):
        self.module, self.comm = module, comm
        self.steps = 0
        self.changing: list[str] | None = None  # agreed before the second step
        self.constant: dict[str, torch.Tensor] = {}  # the first step's copy of every other buffer
        self.warned: set[str] = set()

    def before_step(self) -> None:
        buffers = {name: b for name, b in self.module.named_buffers() if b.numel() > 0}
        if not buffers:
            return
        self.steps += 1
        if self.steps == 1:
            self._send(list(buffers.values()))
            self.constant = {name: b.detach().clone() for name, b in buffers.items()}
            return
        if self.changing is None:
            self.changing = self._agree_changing(buffers)
            self.constant = {name: copy for name, copy in self.constant.items() if name not in self.changing}
        for name, copy in self.constant.items():
            if name not in self.warned and (name not in buffers or not _same(copy, buffers[name])):
                self.warned.add(name)
                warnings.warn(f"buffer {name!r} did not change in the first training step but had by step "
                              f"{self.steps}: it is no longer sent from rank 0 each step, so ranks may disagree "
                              "on it", stacklevel=2)
        self._send([buffers[name] for name in self.changing if name in buffers])

    def _agree_changing(self, buffers: dict[str, torch.Tensor]) -> list[str]:
        """The buffers that differ from their copy on any rank (every rank names the same buffers)."""
        device = next(iter(buffers.values())).device  # NCCL reduces device tensors only
        moved = torch.tensor([float(name not in self.constant or not _same(self.constant[name], b))
                              for name, b in buffers.items()], device=device)
        # Once, and outside the accounted traffic like the backward order: set-up, not a step's sync.
        dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=self.comm.group)
        return [name for name, flag in zip(buffers, moved.tolist(), strict=True) if flag]

    def _send(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            self.comm.broadcast_coalesced(tensors, src=0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
