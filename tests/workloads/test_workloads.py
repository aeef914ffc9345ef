"""Contract tests for ddlscale.workloads: deterministic data, trainable models, sparse gradients."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor

from ddlscale.workloads import WORKLOADS, DeepFM, LSTMLanguageModel, Workload
from ddlscale.workloads.optimizers import SparseDenseAdam
from ddlscale.workloads.seeding import derive_seed
from ddlscale.workloads.zipf import markov_zipf_sequences, sample_zipf, zipf_probabilities

NAMES = sorted(WORKLOADS)
TRAIN_STEPS = 30
MODEL_SEED = 1234

# Plain SGD at the base default lr=0.1 barely moves sparse rows in 30 steps (each row sees few
# updates), so the embedding workloads train with the optimizer their real counterparts use.
TRAIN_OVERRIDES: dict[str, dict[str, Any]] = {
    "lstm": {"lr": 1.0},
    "deepfm": {"optimizer": "adam", "lr": 0.01},
    "cnn": {},
    "gpt": {},
}

# Which tables carry row-sparse gradients in the embedding-heavy workloads.
SPARSE_TABLES = {
    "lstm": ("input_embedding", "output_embedding", "output_bias"),
    "deepfm": ("embedding", "first_order"),
}


def build(name: str, **kwargs: Any) -> Workload:
    torch.manual_seed(MODEL_SEED)  # parameter init uses the global RNG; data never does
    return WORKLOADS[name](**kwargs)


def first_batch(model: Workload) -> tuple[Tensor, ...]:
    return next(iter(model.train_dataloader()))


def forward_backward(model: Workload) -> Tensor:
    model.zero_grad(set_to_none=True)
    loss = model.loss(first_batch(model))
    loss.backward()
    return loss


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(name: str, **kwargs: Any) -> tuple[list[float], dict[str, Tensor]]:
    """Train through Lightning's own loop; return per-step losses and the final parameters."""
    model = build(name, **kwargs)
    recorder = LossRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=TRAIN_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "few dataloader workers" and similar CPU-run advice
        trainer.fit(model)
    parameters = {key: value.detach().clone() for key, value in model.named_parameters()}
    return recorder.losses, parameters


@functools.cache
def reference_fit(name: str) -> tuple[list[float], dict[str, Tensor]]:
    return fit(name, **TRAIN_OVERRIDES[name])


def row_density(grad: Tensor) -> float:
    """Fraction of embedding rows with any non-zero gradient entry."""
    return (grad != 0).any(dim=1).float().mean().item()


# --- data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_dataset_is_a_pure_function_of_data_seed(name: str) -> None:
    first = build(name).make_dataset().tensors
    again = build(name).make_dataset().tensors
    other = build(name, data_seed=1).make_dataset().tensors
    assert len(first[0]) == build(name).num_samples
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("name", NAMES)
def test_data_and_loss_do_not_touch_global_rng(name: str) -> None:
    # Iterating a DataLoader draws a base seed from the global RNG, so the batch is fetched first.
    model = build(name)
    batch = first_batch(model)
    before = torch.get_rng_state()
    model.make_dataset()
    model.loss(batch).backward()
    assert torch.equal(before, torch.get_rng_state())


def test_loader_batches_in_order_without_dropping_full_batches() -> None:
    model = build("deepfm", batch_size=32, num_samples=100)
    loader = model.train_dataloader()
    assert len(loader) == 3  # drop_last: equal batch sizes on every rank
    ids, _ = next(iter(loader))
    assert torch.equal(ids, model.make_dataset().tensors[0][:32])


def test_zipf_probabilities_are_normalised_and_decreasing() -> None:
    probabilities = zipf_probabilities(1000, 1.1)
    assert probabilities.dtype == torch.float32
    assert probabilities.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert bool((probabilities[1:] <= probabilities[:-1]).all())


def test_sample_zipf_keeps_hot_ids_in_front_unless_shuffled() -> None:
    front = sample_zipf(1000, 1.1, (4, 500), torch.Generator().manual_seed(0))
    assert front.shape == (4, 500)
    assert torch.bincount(front.flatten(), minlength=1000).argmax().item() == 0
    shuffled = sample_zipf(1000, 1.1, (2000,), torch.Generator().manual_seed(0), shuffle_ids=True)
    assert torch.bincount(shuffled, minlength=1000).argmax().item() != 0


def test_markov_sequences_follow_the_successor_map_half_the_time() -> None:
    generator = torch.Generator().manual_seed(0)
    sequences = markov_zipf_sequences(2000, 10, 500, 1.1, generator)
    successor = torch.randperm(500, generator=torch.Generator().manual_seed(0))
    followed = (sequences[:, 1:] == successor[sequences[:, :-1]]).float().mean().item()
    assert 0.45 < followed < 0.6  # 0.5 by construction plus Zipf draws that coincide


# --- model --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_gives_finite_loss_and_every_gradient(name: str) -> None:
    model = build(name)
    loss = forward_backward(model)
    assert torch.isfinite(loss)
    for key, parameter in model.named_parameters():
        assert parameter.grad is not None, key
        values = parameter.grad.coalesce().values() if parameter.grad.is_sparse else parameter.grad
        assert bool(torch.isfinite(values).all()), key


@pytest.mark.parametrize("name", NAMES)
def test_hyperparameters_are_recorded(name: str) -> None:
    model = build(name, batch_size=8, data_seed=3)
    assert model.hparams["batch_size"] == 8
    assert model.hparams["data_seed"] == 3


def test_registry_lists_the_four_workloads() -> None:
    assert set(WORKLOADS) == {"lstm", "deepfm", "cnn", "gpt"}
    assert all(issubclass(cls, Workload) for cls in WORKLOADS.values())


def test_gpt_attention_is_causal() -> None:
    model = build("gpt").eval()
    tokens = first_batch(model)[0][:2]
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.vocab_size
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :-1], model(changed)[:, :-1])


def test_deepfm_accepts_mlp_dims_as_a_list() -> None:
    model = build("deepfm", mlp_dims=[8, 4, 2])
    assert model.mlp_dims == (8, 4, 2)


# --- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_training_lowers_the_loss(name: str) -> None:
    losses, _ = reference_fit(name)
    assert len(losses) == TRAIN_STEPS
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"{name}: mean loss first 5 steps {first:.4f}, last 5 steps {last:.4f}")
    assert last < first


@pytest.mark.parametrize("name", NAMES)
def test_training_is_bit_reproducible(name: str) -> None:
    losses, parameters = reference_fit(name)
    again_losses, again_parameters = fit(name, **TRAIN_OVERRIDES[name])
    assert losses == again_losses
    assert parameters.keys() == again_parameters.keys()
    for key, value in parameters.items():
        assert torch.equal(value, again_parameters[key]), key


@pytest.mark.parametrize("name", sorted(SPARSE_TABLES))
def test_sparse_adam_trains_sparse_tables_in_lightning(name: str) -> None:
    losses, _ = fit(name, sparse_embedding=True, optimizer="sparse_adam", lr=0.01)
    assert sum(losses[-5:]) < sum(losses[:5])


def test_lstm_negatives_depend_only_on_seed_and_step() -> None:
    model, twin = build("lstm"), build("lstm")
    cpu = torch.device("cpu")
    assert torch.equal(model.draw_negatives(7, cpu), twin.draw_negatives(7, cpu))
    assert not torch.equal(model.draw_negatives(7, cpu), model.draw_negatives(8, cpu))
    other_seed = build("lstm", data_seed=1)
    assert not torch.equal(model.draw_negatives(7, cpu), other_seed.draw_negatives(7, cpu))


# --- sparse gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SPARSE_TABLES))
def test_sparse_embedding_gives_sparse_coo_gradients(name: str) -> None:
    model = build(name, sparse_embedding=True)
    forward_backward(model)
    for table in SPARSE_TABLES[name]:
        grad = getattr(model, table).weight.grad
        assert grad is not None and grad.layout == torch.sparse_coo, table
    dense = [p for p in model.parameters() if p.grad is not None and not p.grad.is_sparse]
    assert dense, "only the embedding tables should be sparse"


@pytest.mark.parametrize("name", sorted(SPARSE_TABLES))
def test_dense_embedding_gradients_touch_few_rows(name: str) -> None:
    model = build(name)
    forward_backward(model)
    for table in SPARSE_TABLES[name]:
        grad = getattr(model, table).weight.grad
        assert grad is not None and grad.layout == torch.strided, table
        density = row_density(grad)
        print(f"{name}.{table}: {density:.4%} of rows have non-zero gradient")
        assert 0.0 < density < 0.5, table


def test_sparse_and_dense_embedding_gradients_agree() -> None:
    dense_model, sparse_model = build("lstm"), build("lstm", sparse_embedding=True)
    forward_backward(dense_model)
    forward_backward(sparse_model)
    for table in SPARSE_TABLES["lstm"]:
        dense_grad = getattr(dense_model, table).weight.grad
        sparse_grad = getattr(sparse_model, table).weight.grad.to_dense()
        torch.testing.assert_close(sparse_grad, dense_grad)


# --- optimizers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dense_optimizers_step(name: str, optimizer: str) -> None:
    model = build(name, optimizer=optimizer, momentum=0.9 if optimizer == "sgd" else 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    optim = model.configure_optimizers()
    forward_backward(model)
    optim.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("name", sorted(SPARSE_TABLES))
def test_adam_with_sparse_embedding_is_rejected(name: str) -> None:
    model = build(name, sparse_embedding=True, optimizer="adam")
    with pytest.raises(ValueError, match="model.optimizer") as error:
        model.configure_optimizers()
    assert "model.sparse_embedding" in str(error.value)


@pytest.mark.parametrize("name", NAMES)
def test_sparse_adam_without_sparse_gradients_is_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="model.optimizer"):
        build(name, optimizer="sparse_adam").configure_optimizers()


def test_sparse_dense_adam_state_dict_round_trips() -> None:
    model = build("deepfm", sparse_embedding=True, optimizer="sparse_adam", lr=0.01)
    optim = model.configure_optimizers()
    assert isinstance(optim, SparseDenseAdam)
    forward_backward(model)
    optim.step()
    state = copy.deepcopy(optim.state_dict())  # state_dict() aliases the live moment tensors
    assert len(state["state"]) == len(list(model.parameters()))

    restored_model = build("deepfm", sparse_embedding=True, optimizer="sparse_adam", lr=0.01)
    restored_model.load_state_dict(model.state_dict())
    restored = restored_model.configure_optimizers()
    restored.load_state_dict(state)
    for run_model, run_optim in ((model, optim), (restored_model, restored)):
        forward_backward(run_model)
        run_optim.step()
    for a, b in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(a, b)


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "key"),
    [
        ("cnn", {"batch_size": 0}, "model.batch_size"),
        ("gpt", {"batch_size": 64, "num_samples": 32}, "model.num_samples"),
        ("lstm", {"lr": 0.0}, "model.lr"),
        ("deepfm", {"optimizer": "rmsprop"}, "model.optimizer"),
        ("cnn", {"momentum": -0.5}, "model.momentum"),
        ("gpt", {"data_seed": -1}, "model.data_seed"),
        ("gpt", {"data_seed": 2**32}, "model.data_seed"),
        ("lstm", {"vocab_size": 1}, "model.vocab_size"),
        ("lstm", {"num_sampled": 0}, "model.num_sampled"),
        ("lstm", {"sparse_embedding": "yes"}, "model.sparse_embedding"),
        ("deepfm", {"mlp_dims": [64, 0]}, "model.mlp_dims"),
        ("deepfm", {"field_size": 0}, "model.field_size"),
        ("cnn", {"num_blocks": 0}, "model.num_blocks"),
        ("gpt", {"n_head": 3}, "model.n_head"),
        ("gpt", {"zipf_exponent": -1.0}, "model.zipf_exponent"),
    ],
)
def test_bad_arguments_name_their_config_key(name: str, kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        WORKLOADS[name](**kwargs)


def test_batch_size_message_is_readable() -> None:
    with pytest.raises(ValueError, match=r"^model\.batch_size must be >= 1, got 0$"):
        LSTMLanguageModel(batch_size=0)
    with pytest.raises(ValueError, match=r"model\.mlp_dims"):
        DeepFM(mlp_dims="64,32")  # type: ignore[arg-type]


def test_derived_seeds_fit_the_generator_and_do_not_alias() -> None:
    seeds = {
        derive_seed(salt, data_seed, step) for salt in (1, 2) for data_seed in (0, 1) for step in range(50)
    }
    assert len(seeds) == 200
    assert all(0 <= seed < 2**32 for seed in seeds)
