"""The ``sparse_adam`` choice: SparseAdam on sparse embedding tables, Adam on every other parameter.

torch.optim.SparseAdam rejects dense gradients and Adam rejects sparse ones, while Lightning's
automatic optimization drives exactly one optimizer. This class steps both halves as one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


class SparseDenseAdam(torch.optim.Optimizer):
    """One optimizer whose first groups are updated by SparseAdam and the rest by Adam.

    Both halves share this optimizer's ``param_groups`` dicts and ``state`` mapping, so learning-rate
    schedulers, ``state_dict`` and Lightning's optimizer-state device moves see every parameter.
    """

    def __init__(self, sparse_params: Iterable[Tensor], dense_params: Iterable[Tensor], lr: float) -> None:
        self.sparse_adam = torch.optim.SparseAdam(list(sparse_params), lr=lr)
        dense = list(dense_params)
        # Adam refuses an empty parameter list; a model made only of embedding tables needs no Adam.
        self.adam = torch.optim.Adam(dense, lr=lr) if dense else None
        groups = list(self.sparse_adam.param_groups)
        if self.adam is not None:
            groups += self.adam.param_groups
        self._num_sparse_groups = len(self.sparse_adam.param_groups)
        super().__init__(groups, defaults={"lr": lr})
        self._share_with_halves()

    def _share_with_halves(self) -> None:
        self.sparse_adam.param_groups = self.param_groups[: self._num_sparse_groups]
        self.sparse_adam.state = self.state
        if self.adam is not None:
            self.adam.param_groups = self.param_groups[self._num_sparse_groups :]
            self.adam.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The base class rebuilds ``state`` and ``param_groups`` as new objects; re-link the halves.
        super().load_state_dict(state_dict)
        self._share_with_halves()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sparse_adam.step()
        if self.adam is not None:
            self.adam.step()
        return loss
