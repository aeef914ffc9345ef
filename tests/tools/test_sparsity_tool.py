"""ddlscale.tools.sparsity: each statistic on hand-made index sets, hash vs contiguous balance, the CLI."""

import csv

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddlscale.sync.sparse.hashing import HashPartitioner
from ddlscale.tools.sparsity import (
    UsageError,
    contiguous_server_of,
    densification,
    imbalance,
    main,
    nonzero_indices,
    overlap,
    parse_args,
    reported_ks,
    skew,
    worker_loaders,
)
from ddlscale.workloads.zipf import zipf_probabilities

torch.set_num_threads(1)


def _disjoint_sets(count: int, size: int) -> list[torch.Tensor]:
    return [torch.arange(worker * size, (worker + 1) * size) for worker in range(count)]


# ----------------------------------------------------------------------------- nonzero_indices


def test_dense_indices_include_first_and_last_element():
    grad = torch.zeros(4, 5)
    grad[0, 0] = 1.0
    grad[2, 1] = -2.0
    grad[3, 4] = 3.0
    assert nonzero_indices(grad).tolist() == [0, 11, 19]


def test_sparse_coo_and_dense_layouts_give_the_same_indices():
    # Duplicate rows (summed by coalescing), a zero inside a stored row, and rows 0 and M-1 stored.
    indices = torch.tensor([[5, 0, 9, 5]])
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0], [4.0, 5.0], [6.0, 7.0]])
    grad = torch.sparse_coo_tensor(indices, values, (10, 2))
    expected = nonzero_indices(grad.to_dense())
    assert nonzero_indices(grad).tolist() == expected.tolist() == [0, 10, 11, 18, 19]


def test_embedding_gradients_agree_across_layouts():
    torch.manual_seed(0)
    dense_table = nn.Embedding(50, 3, sparse=False)
    sparse_table = nn.Embedding(50, 3, sparse=True)
    sparse_table.weight.data.copy_(dense_table.weight.data)
    ids = torch.tensor([[0, 7, 7, 49], [3, 0, 12, 49]])
    for table in (dense_table, sparse_table):
        table(ids).pow(2).sum().backward()
    assert sparse_table.weight.grad.is_sparse
    assert torch.equal(nonzero_indices(sparse_table.weight.grad), nonzero_indices(dense_table.weight.grad))
    assert nonzero_indices(dense_table.weight.grad).numel() == 5 * 3


def test_sparse_indices_with_two_sparse_dims():
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 0], [2, 0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), (2, 3, 2))
    assert nonzero_indices(grad).tolist() == nonzero_indices(grad.to_dense()).tolist() == [0, 10, 11]


# ----------------------------------------------------------------------------- densification and overlap


def test_identical_sets_do_not_densify_and_fully_overlap():
    sets = [torch.tensor([0, 3, 99])] * 4
    assert densification(sets, 100) == [1.0, 1.0, 1.0, 1.0]
    assert overlap(sets) == 1.0


def test_disjoint_equal_sets_densify_k_fold_and_never_overlap():
    sets = _disjoint_sets(4, 25)  # covers 0 and M-1 = 99
    assert densification(sets, 100) == [1.0, 2.0, 3.0, 4.0]
    assert overlap(sets) == 0.0


def test_partial_overlap_is_mean_jaccard():
    sets = [torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])]
    # pairs: 2/4, 3/3, 2/4
    assert overlap(sets) == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    assert densification(sets, 10) == pytest.approx([1.0, 4 / 3, 4 / 3])


def test_empty_sets_give_nan_gamma():
    gammas = densification([torch.empty(0, dtype=torch.int64)] * 2, 10)
    assert all(gamma != gamma for gamma in gammas)


# ----------------------------------------------------------------------------- skew and imbalance


def test_skew_counts_first_and_fullest_partition():
    assert skew(torch.tensor([0, 1, 2, 3]), 80, 8) == (1.0, 1.0)
    assert skew(torch.arange(80), 80, 8) == pytest.approx((1 / 8, 1 / 8))
    first, largest = skew(torch.tensor([0, 79, 78, 77]), 80, 8)  # M-1 lands in the last partition
    assert (first, largest) == (0.25, 0.75)


def test_imbalance_of_a_fully_skewed_contiguous_split():
    sets = [torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])]
    push, pull = imbalance(sets, contiguous_server_of(80, 4), 4)
    assert push == 4.0 and pull == 4.0  # everything lands on server 0


def test_imbalance_of_an_even_split_is_one():
    sets = [torch.arange(0, 80, 2), torch.arange(1, 80, 2)]
    assert imbalance(sets, contiguous_server_of(80, 4), 4) == (1.0, 1.0)


def test_hash_balances_zipf_skew_that_breaks_the_contiguous_split():
    rows, dim, workers = 50_000, 64, 8
    numel = rows * dim
    generator = torch.Generator().manual_seed(0)
    probabilities = zipf_probabilities(rows, 1.2)
    sets = []
    for _ in range(workers):
        hot_rows = torch.multinomial(probabilities, 8000, replacement=True, generator=generator).unique()
        sets.append((hot_rows[:, None] * dim + torch.arange(dim)).flatten())
    assert min(s.numel() for s in sets) >= 1e5  # M * d per worker
    hash_push, hash_pull = imbalance(sets, HashPartitioner(workers).server_of, workers)
    contiguous_push, contiguous_pull = imbalance(sets, contiguous_server_of(numel, workers), workers)
    print(f"hash push {hash_push:.3f} pull {hash_pull:.3f}; "
          f"contiguous push {contiguous_push:.3f} pull {contiguous_pull:.3f}")
    assert hash_push <= 1.1 and hash_pull <= 1.1
    assert contiguous_push > 3 and contiguous_pull > 3
    assert skew(sets[0], numel, workers)[0] > 0.6  # the paper's C3 threshold


# ----------------------------------------------------------------------------- emulated workers and CLI


class _ToyWorkload:
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(40)), batch_size=3, shuffle=False, drop_last=True)


def test_worker_loaders_interleave_like_distributed_sampler():
    loaders = worker_loaders(_ToyWorkload(), 4)
    for rank, loader in enumerate(loaders):
        batches = [batch[0].tolist() for batch in loader]
        assert batches[0] == [rank, rank + 4, rank + 8]
        assert batches[1] == [rank + 12, rank + 16, rank + 20]
        assert len(batches) == 3  # 10 samples per rank, drop_last keeps 3 full batches


def test_parse_args_routes_model_overrides_and_names_bad_keys():
    args = parse_args(["model=deepfm", "workers=4", "model.field_size=100", "steps=2"])
    assert (args.model, args.workers, args.steps, args.model_overrides) == ("deepfm", 4, 2, ("model.field_size=100",))
    with pytest.raises(UsageError, match="'wrokers'"):
        parse_args(["wrokers=4"])
    with pytest.raises(UsageError, match="workers"):
        parse_args(["workers=1"])
    with pytest.raises(UsageError, match="steps"):
        parse_args(["steps=two"])


def test_reported_ks_double_up_to_workers():
    assert reported_ks(8) == [2, 4, 8]
    assert reported_ks(6) == [2, 4, 6]
    assert reported_ks(2) == [2]


def test_cli_end_to_end_on_a_tiny_lstm(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output goes under the working directory's outputs/, never into the repo
    argv = ["model=lstm", "workers=4", "steps=1", "model.vocab_size=2000", "model.num_samples=512"]
    assert main(argv) == 0
    assert "input_embedding.weight" in capsys.readouterr().out
    tmp_path = tmp_path / "outputs" / "sparsity" / "lstm"
    with (tmp_path / "results.csv").open() as handle:
        rows = {row["tensor"]: row for row in csv.DictReader(handle)}
    embedding = rows["input_embedding.weight"]
    assert embedding["kind"] == "sparse" and 0 < float(embedding["density"]) < 0.5
    assert 1.0 <= float(embedding["gamma_4"]) <= 4.0
    assert rows["lstm.weight_hh_l0"]["kind"] == "dense"
    assert "Machine:" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_unknown_key_with_its_name(capsys):
    assert main(["model=lstm", "bogus=1"]) == 2
    assert "'bogus'" in capsys.readouterr().err
