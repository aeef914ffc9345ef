"""Common shape of every benchmark workload: a LightningModule that owns its synthetic data."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ddlscale.workloads.optimizers import SparseDenseAdam
from ddlscale.workloads.validation import (
    require_choice,
    require_float_at_least,
    require_float_positive,
    require_int_at_least,
)

OPTIMIZERS = ("sgd", "adam", "sparse_adam")
_MAX_DATA_SEED = 2**32 - 1


class Workload(pl.LightningModule):
    """Base class: validated training hyper-parameters, optimizer choice and a deterministic loader.

    Subclasses implement ``make_dataset`` (built only from ``data_seed``, so every rank and every
    rerun sees the same samples) and ``loss``; they call ``save_hyperparameters()`` themselves so
    Lightning records their full argument list.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_samples: int = 4096,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        data_seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = require_int_at_least("batch_size", batch_size, 1)
        self.num_samples = require_int_at_least("num_samples", num_samples, self.batch_size)
        self.lr = require_float_positive("lr", lr)
        self.optimizer_name = require_choice("optimizer", optimizer, OPTIMIZERS)
        self.momentum = require_float_at_least("momentum", momentum, 0.0)
        self.data_seed = require_int_at_least("data_seed", data_seed, 0)
        if data_seed > _MAX_DATA_SEED:
            # torch's CPU generator keeps only 32 seed bits; larger seeds would alias smaller ones.
            raise ValueError(f"model.data_seed must be <= {_MAX_DATA_SEED}, got {data_seed}")

    def make_dataset(self) -> Dataset:
        """Pre-generated tensors built from a local generator seeded with ``data_seed``."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_dataset()")

    def loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        """Scalar training loss of one batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss()")

    def data_generator(self) -> torch.Generator:
        """A fresh generator per dataset build, so building twice gives the same data."""
        return torch.Generator().manual_seed(self.data_seed)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        # No sync_dist: logging must not add collectives to the communication being measured.
        self.log("train_loss", loss, prog_bar=True, on_step=True)
        return loss

    def train_dataloader(self) -> DataLoader:
        # shuffle=False and no workers keep batches deterministic; under DDP Lightning swaps in a
        # DistributedSampler, which then decides each rank's shard.
        return DataLoader(
            self.make_dataset(),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=0,
            drop_last=True,
        )

    def sparse_embeddings(self) -> list[nn.Embedding]:
        return [module for module in self.modules() if isinstance(module, nn.Embedding) and module.sparse]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        sparse_params = [embedding.weight for embedding in self.sparse_embeddings()]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if self.optimizer_name == "adam":
            if sparse_params:
                raise ValueError(
                    "model.optimizer=adam cannot update sparse gradients; "
                    "set model.sparse_embedding=false or use model.optimizer=sparse_adam"
                )
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        if not sparse_params:
            raise ValueError(
                f"model.optimizer=sparse_adam needs sparse embedding gradients, which {type(self).__name__} "
                "only has with model.sparse_embedding=true; otherwise use model.optimizer=adam"
            )
        sparse_ids = {id(param) for param in sparse_params}
        dense_params = [param for param in self.parameters() if id(param) not in sparse_ids]
        return SparseDenseAdam(sparse_params, dense_params, lr=self.lr)
