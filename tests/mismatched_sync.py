"""A sync backend with a rank-dependent launch: rank 1 issues one collective more than rank 0 on its
third step. The bug class a new backend can have; tests run it through train.py by ``sync._target_``."""

import torch
import torch.distributed as dist

from ddlscale.sync import DenseAllreduce


class ExtraCollectiveOnRank1(DenseAllreduce):
    def finish(self) -> None:
        super().finish()
        if self.rank == 1 and self.steps == 2:
            dist.all_reduce(torch.zeros(4), group=self.comm.group)
