"""DeepFM click-through-rate model: large Zipf-accessed embedding tables plus a small MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ddlscale.workloads.validation import (
    config_key,
    require_bool,
    require_float_at_least,
    require_int_at_least,
)
from ddlscale.workloads.workload import Workload
from ddlscale.workloads.zipf import sample_zipf

# Per-id teacher weight scale: a sum over 8 fields then has std ~2, so labels are informative.
_TEACHER_WEIGHT_STD = 0.7


class DeepFM(Workload):
    """First-order weights, FM pairwise term and an MLP, all reading one shared embedding table.

    All fields live in a single table of ``num_fields * field_size`` rows (field ``f`` owns rows
    ``f * field_size ...``), so one tensor carries the whole sparse gradient as in production CTR models.
    """

    def __init__(
        self,
        num_fields: int = 8,
        field_size: int = 20000,
        embed_dim: int = 16,
        mlp_dims: Sequence[int] = (64, 32),
        zipf_exponent: float = 1.1,
        sparse_embedding: bool = False,
        batch_size: int = 32,
        num_samples: int = 4096,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        data_seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_samples, lr, optimizer, momentum, data_seed)
        self.save_hyperparameters()
        self.num_fields = require_int_at_least("num_fields", num_fields, 1)
        self.field_size = require_int_at_least("field_size", field_size, 1)
        self.embed_dim = require_int_at_least("embed_dim", embed_dim, 1)
        self.mlp_dims = _hidden_widths(mlp_dims)
        self.zipf_exponent = require_float_at_least("zipf_exponent", zipf_exponent, 0.0)
        self.sparse_embedding = require_bool("sparse_embedding", sparse_embedding)

        num_rows = num_fields * field_size
        self.embedding = nn.Embedding(num_rows, embed_dim, sparse=sparse_embedding)
        self.first_order = nn.Embedding(num_rows, 1, sparse=sparse_embedding)
        self.bias = nn.Parameter(torch.zeros(1))
        self.mlp = _mlp(num_fields * embed_dim, self.mlp_dims)
        # Derived from the sizes, so kept out of checkpoints.
        self.register_buffer("field_offsets", torch.arange(num_fields) * field_size, persistent=False)
        self._init_tables()

    def _init_tables(self) -> None:
        # Small factors keep the FM term near zero at start; N(0, 1) would dominate the logit.
        nn.init.normal_(self.embedding.weight, std=0.01)
        nn.init.zeros_(self.first_order.weight)

    def make_dataset(self) -> TensorDataset:
        generator = self.data_generator()
        field_ids = sample_zipf(
            self.field_size, self.zipf_exponent, (self.num_samples, self.num_fields), generator
        )
        # A hidden teacher with one weight per id makes the labels learnable from the ids alone.
        teacher = torch.randn(self.num_fields * self.field_size, generator=generator) * _TEACHER_WEIGHT_STD
        offsets = torch.arange(self.num_fields) * self.field_size
        click_probability = torch.sigmoid(teacher[field_ids + offsets].sum(dim=1))
        labels = torch.bernoulli(click_probability, generator=generator)
        return TensorDataset(field_ids, labels)

    def logits(self, field_ids: Tensor) -> Tensor:
        """(batch, num_fields) per-field ids -> (batch,) click logits."""
        rows = field_ids + self.field_offsets
        factors = self.embedding(rows)  # (batch, fields, embed_dim)
        linear = self.first_order(rows).sum(dim=(1, 2)) + self.bias
        pairwise = 0.5 * (factors.sum(dim=1).pow(2) - factors.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.mlp(factors.flatten(1)).squeeze(1)
        return linear + pairwise + deep

    def loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        field_ids, labels = batch
        return F.binary_cross_entropy_with_logits(self.logits(field_ids), labels)


def _hidden_widths(mlp_dims: Sequence[int]) -> tuple[int, ...]:
    # Hydra hands lists over as ListConfig; normalise to a plain tuple of ints.
    if isinstance(mlp_dims, (str, bytes)) or not isinstance(mlp_dims, Sequence):
        raise ValueError(f"{config_key('mlp_dims')} must be a list of layer widths, got {mlp_dims!r}")
    return tuple(require_int_at_least("mlp_dims", width, 1) for width in mlp_dims)


def _mlp(in_features: int, hidden_widths: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden_widths:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers.append(nn.Linear(in_features, 1))
    return nn.Sequential(*layers)
