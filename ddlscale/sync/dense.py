"""Dense bucketed allreduce: the baseline every other backend is measured against.

It reproduces PyTorch DDP's reducer: gradients are scaled by 1/n while being copied into flat
buckets (DDP's own order of operations, so results match it bit for bit), a bucket's allreduce is
launched as soon as it and every earlier bucket are full — overlapping with the rest of backward —
and buckets are rebuilt in the observed backward order after the first step. As in DDP the first
bucket is small, so communication starts early in backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddlscale import clock
from ddlscale.comm import Pending
from ddlscale.sync.dense_config import DenseConfig
from ddlscale.sync.grad_sync import GradSync


def to_sparse_slices(dense: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """``dense.to_sparse(sparse_dim)``, coalesced, without its slow path (36 ms for a 20000x64 table).

    Keeps the slices over the first ``sparse_dim`` dims that hold any non-zero (NaN included).
    """
    slices = dense.reshape(*dense.shape[:sparse_dim], -1)
    keep = (slices != 0).any(dim=-1)
    indices = keep.nonzero().T
    return torch.sparse_coo_tensor(indices, dense[tuple(indices)], dense.shape, is_coalesced=True,
                                   check_invariants=False)


class Bucket:
    """A flat buffer holding several parameters' gradients, all of one dtype.

    The buffer is allocated when first used: a sparse sync's tensors sit in a bucket until their
    first gradients route them sparse, and an embedding table's worth of zeros must not be paid
    for a bucket that is rebuilt without it.
    """

    def __init__(self, members: list[int], params: list[torch.Tensor], device: torch.device | str):
        self.members = members
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        self.dtype, self.device = params[0].dtype, device
        self.filled: set[int] = set()
        self.pending: Pending | None = None
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            start = 0
            for shape in self.shapes:
                size = shape.numel()
                self._views.append(self._buffer[start : start + size].view(shape))
                start += size
        return self._buffer

    @property
    def views(self) -> list[torch.Tensor]:
        """Per member, shaped like its parameter, aliasing :attr:`buffer`."""
        self.buffer  # noqa: B018 - allocates on first use
        return self._views


class DenseAllreduce(GradSync):
    """Average gradients by bucketed ring allreduce, overlapped with backward.

    Args:
        bucket_mb: bucket capacity in MiB (DDP's ``bucket_cap_mb``); larger buckets mean fewer,
            longer collectives and less overlap.
        first_bucket_mb: capacity of the first bucket to launch; small so the network is busy early.
    """

    schema = DenseConfig  # its keys and their checks

    def __init__(self, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0):
        DenseConfig(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)  # refuses what no run can use
        super().__init__()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.first_bucket_bytes = int(first_bucket_mb * 2**20)
        # What a sync this one serves does to a full bucket (each member's gradient over n) before its
        # allreduce: a planned sync's momentum for DGC in its dense steps. None: nothing.
        self.before_launch: Callable[[Bucket], None] | None = None

    def on_setup(self) -> None:
        if self._order_known:
            groups = self._assign(self.backward_order)
        else:
            # Before any backward, DDP assigns buckets over the registration order and reverses the
            # bucket list; doing the same keeps even the first step's sums in DDP's order.
            groups = list(reversed(self._assign(list(range(len(self.params))))))
        self.buckets = [self._make_bucket(members) for members in groups]
        self.slot_of = {
            i: (b, slot) for b, bucket in enumerate(self.buckets) for slot, i in enumerate(bucket.members)
        }
        self._next_launch = 0
        self._was_sparse: dict[int, int] = {}  # param index -> sparse_dim of its COO gradient

    def _assign(self, order: list[int]) -> list[list[int]]:
        """DDP's rule: add tensors in order, close a bucket once it reaches its cap (the first one
        smaller), and never mix dtypes."""
        groups: list[list[int]] = []
        size = 0
        closed = True
        for i in order:
            p = self.params[i]
            if closed or self.params[groups[-1][0]].dtype != p.dtype:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += p.numel() * p.element_size()
            cap = self.first_bucket_bytes if len(groups) == 1 else self.bucket_bytes
            closed = size >= cap
        return groups

    def _make_bucket(self, members: list[int]) -> Bucket:
        return Bucket(members, [self.params[i] for i in members], self.device)

    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        b, slot = self.slot_of[index]
        bucket = self.buckets[b]
        if bucket.pending is not None:
            raise RuntimeError(
                f"gradient of {self.names[index]!r} became ready twice in one step "
                "(backward called twice before the optimizer step?)"
            )
        start = clock.now()  # not self.timed(): this runs once per parameter per step
        grad = param.grad
        if grad.is_sparse:
            self._was_sparse[index] = grad.sparse_dim()
            grad = grad.to_dense()
        torch.mul(grad, 1.0 / self.world_size, out=bucket.views[slot])
        self._timers["encode"] += clock.now() - start
        bucket.filled.add(index)
        self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        # Launch strictly in bucket order so every rank issues the same sequence of collectives.
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.filled) < len(bucket.members):
                return
            if self.before_launch is not None:
                with self.timed("encode"):
                    self.before_launch(bucket)
            bucket.pending = self.comm.allreduce(bucket.buffer)
            self._next_launch += 1

    def finish(self) -> None:
        # Parameters that got no gradient this step contribute zeros, on every rank alike.
        for bucket in self.buckets[self._next_launch :]:
            for slot, i in enumerate(bucket.members):
                if i not in bucket.filled:
                    bucket.views[slot].zero_()
                    bucket.filled.add(i)
        self._launch_full_buckets()
        for bucket in self.buckets:
            with self.timed("comm"):
                bucket.pending.wait()
            with self.timed("decode"):
                for slot, i in enumerate(bucket.members):
                    self._write_grad(i, bucket.views[slot])
            bucket.filled.clear()
            bucket.pending = None
        self._next_launch = 0
        self._was_sparse.clear()

    def _write_grad(self, index: int, average: torch.Tensor) -> None:
        p = self.params[index]
        if index in self._was_sparse:
            p.grad = to_sparse_slices(average, self._was_sparse[index])
        else:
            # The gradient becomes a view of the bucket (DDP's gradient_as_bucket_view): no copy.
            # The next backward either allocates a fresh gradient (zero_grad(set_to_none=True)) or
            # accumulates into this view, which the hook then scales in place.
            p.grad = average
