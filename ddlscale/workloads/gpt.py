"""Small decoder-only transformer LM: dense attention/MLP weights with a tied embedding head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ddlscale.workloads.validation import config_key, require_float_at_least, require_int_at_least
from ddlscale.workloads.workload import Workload
from ddlscale.workloads.zipf import markov_zipf_sequences

_INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, d_model = x.shape
        # (batch, length, 3 * d_model) -> three (batch, heads, length, head_dim) tensors.
        q, k, v = (
            self.qkv(x).view(batch, length, 3, self.n_head, d_model // self.n_head).permute(2, 0, 3, 1, 4)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, d_model))


class TransformerBlock(nn.Module):
    """Pre-LN: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(Workload):
    """Token + learned position embeddings, ``n_layer`` blocks, final LN, head tied to the token table."""

    def __init__(
        self,
        vocab_size: int = 2048,
        d_model: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        seq_len: int = 16,
        zipf_exponent: float = 1.1,
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
        self.d_model = require_int_at_least("d_model", d_model, 1)
        self.n_layer = require_int_at_least("n_layer", n_layer, 1)
        self.n_head = require_int_at_least("n_head", n_head, 1)
        if d_model % n_head != 0:
            raise ValueError(f"{config_key('n_head')} must divide model.d_model={d_model}, got {n_head}")
        self.seq_len = require_int_at_least("seq_len", seq_len, 1)
        self.zipf_exponent = require_float_at_least("zipf_exponent", zipf_exponent, 0.0)

        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.Sequential(*(TransformerBlock(d_model, n_head) for _ in range(n_layer)))
        self.final_norm = nn.LayerNorm(d_model)
        self.apply(_init_weights)
        nn.init.normal_(self.position_embedding, std=_INIT_STD)

    def make_dataset(self) -> TensorDataset:
        sequences = markov_zipf_sequences(
            self.num_samples, self.seq_len + 1, self.vocab_size, self.zipf_exponent, self.data_generator()
        )
        return TensorDataset(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())

    def forward(self, tokens: Tensor) -> Tensor:
        """(batch, length <= seq_len) ids -> (batch, length, vocab_size) next-token logits."""
        x = self.token_embedding(tokens) + self.position_embedding[: tokens.shape[1]]
        x = self.final_norm(self.blocks(x))
        return F.linear(x, self.token_embedding.weight)

    def loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def _init_weights(module: nn.Module) -> None:
    # GPT-2 style small init; the N(0, 1) embedding default would blow up the tied output logits.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=_INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
