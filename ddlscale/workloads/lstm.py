"""Embedding-heavy LSTM language model trained with a sampled softmax (the One Billion Word shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ddlscale.workloads.seeding import derive_seed
from ddlscale.workloads.validation import require_bool, require_float_at_least, require_int_at_least
from ddlscale.workloads.workload import Workload
from ddlscale.workloads.zipf import markov_zipf_sequences

# Keeps the negative-sampling stream distinct from the data stream that shares ``data_seed``.
_NEGATIVES_SALT = 0x6E6567


class LSTMLanguageModel(Workload):
    """Both the input and the output embedding tables receive row-sparse gradients each step.

    The sampled softmax touches only the rows of the batch's targets plus ``num_sampled`` uniform
    negatives, as in large-vocabulary LM training, so the output table is as sparse as the input one.
    """

    def __init__(
        self,
        vocab_size: int = 20000,
        embed_dim: int = 64,
        hidden_dim: int = 128,
        seq_len: int = 20,
        num_sampled: int = 512,
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
        self.vocab_size = require_int_at_least("vocab_size", vocab_size, 2)
        self.embed_dim = require_int_at_least("embed_dim", embed_dim, 1)
        self.hidden_dim = require_int_at_least("hidden_dim", hidden_dim, 1)
        self.seq_len = require_int_at_least("seq_len", seq_len, 1)
        self.num_sampled = require_int_at_least("num_sampled", num_sampled, 1)
        self.zipf_exponent = require_float_at_least("zipf_exponent", zipf_exponent, 0.0)
        self.sparse_embedding = require_bool("sparse_embedding", sparse_embedding)

        self.input_embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse_embedding)
        self.lstm = nn.LSTM(embed_dim, hidden_dim, batch_first=True)
        self.projection = nn.Linear(hidden_dim, embed_dim)
        # Output softmax weights and bias are embedding tables so that gathering candidate rows
        # yields sparse gradients, and so the optimizer's sparse-table detection covers them.
        self.output_embedding = nn.Embedding(vocab_size, embed_dim, sparse=sparse_embedding)
        self.output_bias = nn.Embedding(vocab_size, 1, sparse=sparse_embedding)
        self._init_tables()

    def _init_tables(self) -> None:
        # N(0, 1) rows (the nn.Embedding default) would saturate the LSTM and the logits at start.
        nn.init.uniform_(self.input_embedding.weight, -0.1, 0.1)
        nn.init.uniform_(self.output_embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.output_bias.weight)

    def make_dataset(self) -> TensorDataset:
        sequences = markov_zipf_sequences(
            self.num_samples, self.seq_len + 1, self.vocab_size, self.zipf_exponent, self.data_generator()
        )
        return TensorDataset(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())

    def hidden_states(self, inputs: Tensor) -> Tensor:
        """(batch, seq_len) token ids -> (batch, seq_len, embed_dim) vectors to score against rows."""
        outputs, _ = self.lstm(self.input_embedding(inputs))
        return self.projection(outputs)

    def draw_negatives(self, step: int, device: torch.device) -> Tensor:
        """Uniform negatives that depend only on (data_seed, step).

        Every rank draws the same negatives at the same step, and reruns are bit-identical, because
        the global RNG is never touched.
        """
        generator = torch.Generator().manual_seed(derive_seed(_NEGATIVES_SALT, self.data_seed, step))
        negatives = torch.randint(self.vocab_size, (self.num_sampled,), generator=generator)
        return negatives.to(device)

    def loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        inputs, targets = batch
        hidden = self.hidden_states(inputs).reshape(-1, self.embed_dim)
        flat_targets = targets.reshape(-1)
        # global_step is shared by all ranks; outside a Trainer it is 0, so negatives stay fixed.
        negatives = self.draw_negatives(self.global_step, flat_targets.device)
        candidates, positions = torch.unique(torch.cat([flat_targets, negatives]), return_inverse=True)
        target_positions = positions[: flat_targets.numel()]
        weights = F.embedding(candidates, self.output_embedding.weight, sparse=self.sparse_embedding)
        bias = F.embedding(candidates, self.output_bias.weight, sparse=self.sparse_embedding).squeeze(1)
        logits = hidden @ weights.T + bias
        return F.cross_entropy(logits, target_positions)
