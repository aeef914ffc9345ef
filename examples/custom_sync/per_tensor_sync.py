"""A user-defined sync backend, living outside the ddlscale package.

PerTensorAllreduce sends every gradient in its own allreduce the moment it is ready — no fusion.
It is the shape of any new method: subclass GradSync, handle a ready gradient, finish the step.

Select it from the command line (see README.md beside this file):

    PYTHONPATH=examples/custom_sync python train.py \
        hydra.searchpath=[file://examples/custom_sync/conf] sync=per_tensor
"""

from __future__ import annotations

import torch

from ddlscale.comm import Pending
from ddlscale.sync import GradSync


class PerTensorAllreduce(GradSync):
    """One allreduce per parameter, issued in the shared backward order."""

    def on_setup(self) -> None:
        self._ready: set[int] = set()
        self._launched: list[tuple[int, Pending]] = []

    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        with self.timed("encode"):
            param.grad = param.grad.to_dense() * (1.0 / self.world_size)
        self._ready.add(index)
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        # Every rank must issue the same sequence: follow backward_order, never raw hook order.
        while len(self._launched) < len(self.backward_order):
            index = self.backward_order[len(self._launched)]
            if index not in self._ready:
                return
            self._launched.append((index, self.comm.allreduce(self.params[index].grad)))

    def finish(self) -> None:
        for index in self.backward_order:
            if index not in self._ready:  # unused this step: contribute zeros
                self.params[index].grad = torch.zeros_like(self.params[index])
                self._ready.add(index)
        self._launch_in_order()
        with self.timed("comm"):
            for _, pending in self._launched:
                pending.wait()
        self.on_setup()
