"""Measure Zen's three sparse-gradient properties on a workload, and how well each partitioner balances them.

Zen picks its synchronization scheme per tensor from statistics profiled over the first iterations:
how dense one worker's gradient is (d), how much the sum of k workers' gradients densifies (gamma_k,
property C2), how much the workers' index sets overlap (C1), and how skewed the non-zeros are over the
index space (C3). This tool measures exactly those on a workload's *initial* model, emulating
``workers`` data-parallel ranks in one process, and compares the push and pull balance of Zen's hash
partitioner h0 with the even contiguous split that a sparse parameter server and OmniReduce use.

Usage::

    python -m ddlscale.tools.sparsity model=lstm workers=8 [steps=3] [seed=0] [out=DIR] [model.key=value ...]

It writes ``results.csv``, ``results.md`` and ``results.png`` into ``out`` (default
``outputs/sparsity/<model>``). It is a tool, not an experiment: nothing of it is committed under
``experiments/results`` (the lstm and deepfm profiles made on 2026-11-30 are in git history).

Decisions the papers leave open, and why:

* Worker w's batch at step s is what rank w gets under DDP. Lightning replaces the model's sequential
  sampler with ``DistributedSampler(num_replicas=workers, rank=w, shuffle=False)``, which gives rank w
  samples w, w + workers, w + 2 * workers, ... (interleaved, *not* a contiguous block of the model's
  own batches), batched with the model's batch size and ``drop_last``. We build that sampler.
* Parameters are never updated. Zen profiles the first iterations, and a frozen model makes every
  step a sample of one distribution, so averaging over steps is meaningful.
* An element is non-zero when its value is != 0, in both layouts: a sparse COO gradient is coalesced,
  its rows are expanded to flat (row-major) element indices and exact zeros inside a row are dropped,
  so the numbers do not depend on ``model.sparse_embedding``.
* The support of the summed gradient is the union of the workers' index sets: exact float
  cancellation is vanishingly rare, and Zen's servers send the union anyway.
* The LSTM's sampled-softmax negatives depend on ``global_step``, which is 0 outside a Trainer, so
  every emulated step reuses one negative set. Within a step all ranks share it, as in real training.
"""

from __future__ import annotations

import csv
import functools
import itertools
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import instantiate
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from ddlscale.paths import CONF_DIR
from ddlscale.sync.sparse.hashing import HashPartitioner
from ddlscale.sync.sparse.rows import units_of
from ddlscale.workloads.workload import Workload

OUT_DIR = Path("outputs") / "sparsity"  # default out=: <model> below it, relative to the working directory
# Past half non-zero, a dense allreduce is cheaper than any sparse scheme, so such tensors are dense.
SPARSE_DENSITY = 0.5
USAGE = (
    "usage: python -m ddlscale.tools.sparsity model=NAME workers=N [steps=S] [seed=SEED] [out=DIR] "
    "[model.key=value ...]"
)
CLI_KEYS = ("model", "workers", "steps", "seed", "out")

ServerOf = Callable[[Tensor], Tensor]


class UsageError(ValueError):
    """Bad command-line input; ``main`` reports it in one line instead of a traceback."""


# ----------------------------------------------------------------------------- statistics


def nonzero_indices(grad: Tensor) -> Tensor:
    """Sorted flat (row-major) int64 indices of the non-zero elements of a dense or sparse COO gradient."""
    if grad.is_sparse:
        return _sparse_nonzero_indices(grad)
    if grad.layout != torch.strided:
        raise TypeError(f"unsupported gradient layout {grad.layout}")
    return (grad != 0).flatten().nonzero().squeeze(1)


def _sparse_nonzero_indices(grad: Tensor) -> Tensor:
    """Expand each stored entry (a row, for embeddings) to the flat indices of its dense block.

    Coalescing first merges duplicate rows (one per lookup of the same id) and sorts the entries, so
    the result is sorted and every index appears once.
    """
    flat, values = units_of(grad, 1)  # every stored element, one unit each
    return flat[values.reshape(-1) != 0]


def densification(index_sets: Sequence[Tensor], numel: int) -> list[float]:
    """gamma_k for k = 1..n (list position k-1): density of the first k workers' sum / d.

    d is the mean density over all n workers, so identical sets give gamma_k = 1 and disjoint
    equal-size sets give gamma_k = k. NaN when no worker has a non-zero (nothing to densify).
    """
    mean_count = sum(indices.numel() for indices in index_sets) / len(index_sets)
    if mean_count == 0:
        return [math.nan] * len(index_sets)
    covered = torch.zeros(numel, dtype=torch.bool)
    gammas = []
    for indices in index_sets:
        covered[indices] = True
        gammas.append(int(covered.sum()) / mean_count)
    return gammas


def overlap(index_sets: Sequence[Tensor]) -> float:
    """Mean Jaccard similarity |I_a ∩ I_b| / |I_a ∪ I_b| over all unordered pairs of workers (C1).

    Index sets must hold distinct indices (as ``nonzero_indices`` returns them).
    """
    if len(index_sets) < 2:
        raise ValueError(f"overlap needs at least 2 index sets, got {len(index_sets)}")
    pairs = list(itertools.combinations(index_sets, 2))
    return sum(_jaccard(first, second) for first, second in pairs) / len(pairs)


def _jaccard(first: Tensor, second: Tensor) -> float:
    """Two empty sets are identical, hence similarity 1."""
    shared = int(torch.isin(first, second, assume_unique=True).sum())
    union = first.numel() + second.numel() - shared
    return 1.0 if union == 0 else shared / union


def contiguous_partition(indices: Tensor, numel: int, parts: int) -> Tensor:
    """Partition of each index under the even contiguous split: index * parts // numel."""
    return indices.to(torch.int64) * parts // numel


def contiguous_server_of(numel: int, num_servers: int) -> ServerOf:
    """The sparse parameter server's / OmniReduce's owner function for a tensor of ``numel`` elements."""
    return functools.partial(contiguous_partition, numel=numel, parts=num_servers)


def skew(indices: Tensor, numel: int, parts: int) -> tuple[float, float]:
    """(share of non-zeros in the first of ``parts`` contiguous partitions, largest share of any) (C3).

    The first share is the paper's statistic; the largest share is what actually loads the busiest
    contiguous server. NaN for an empty set.
    """
    if indices.numel() == 0:
        return math.nan, math.nan
    counts = torch.bincount(contiguous_partition(indices, numel, parts), minlength=parts)
    shares = counts.double() / indices.numel()
    return float(shares[0]), float(shares.max())


def imbalance(index_sets: Sequence[Tensor], server_of: ServerOf, num_servers: int) -> tuple[float, float]:
    """(push, pull) imbalance of a partitioner, each max over servers / mean over servers.

    Push counts every item each server receives from all workers (its aggregation work and inbound
    traffic); pull counts the distinct indices each server owns after summing (what it must send to
    everyone). 1.0 is perfect balance; NaN when there is nothing to partition.
    """
    received = torch.zeros(num_servers, dtype=torch.int64)
    for indices in index_sets:
        received += torch.bincount(server_of(indices), minlength=num_servers)
    union = torch.unique(torch.cat(list(index_sets)))
    owned = torch.bincount(server_of(union), minlength=num_servers)
    return _max_over_mean(received), _max_over_mean(owned)


def _max_over_mean(counts: Tensor) -> float:
    total = int(counts.sum())
    return math.nan if total == 0 else int(counts.max()) * counts.numel() / total


# ----------------------------------------------------------------------------- per-tensor profile


@dataclass(frozen=True)
class TensorStats:
    """One parameter tensor's statistics: for one step, or averaged over steps."""

    name: str
    numel: int
    layout: str
    density: float
    gammas: list[float]  # gamma_k at position k-1, k = 1..workers
    overlap: float
    skew_first: float
    skew_max: float
    push_hash: float
    pull_hash: float
    push_contiguous: float
    pull_contiguous: float

    @property
    def is_sparse(self) -> bool:
        return 0 < self.density < SPARSE_DENSITY

    def gamma(self, k: int) -> float:
        return self.gammas[k - 1]


_AVERAGED_FIELDS = tuple(
    field.name for field in fields(TensorStats) if field.name not in ("name", "numel", "layout", "gammas")
)


def tensor_stats(
    name: str, layout: str, index_sets: Sequence[Tensor], numel: int, hashing: HashPartitioner
) -> TensorStats:
    """All statistics of one tensor at one step, from each worker's non-zero index set."""
    workers = len(index_sets)
    skews = [skew(indices, numel, workers) for indices in index_sets]
    push_hash, pull_hash = imbalance(index_sets, hashing.server_of, workers)
    push_contiguous, pull_contiguous = imbalance(index_sets, contiguous_server_of(numel, workers), workers)
    return TensorStats(
        name=name,
        numel=numel,
        layout=layout,
        density=sum(indices.numel() for indices in index_sets) / (workers * numel),
        gammas=densification(index_sets, numel),
        overlap=overlap(index_sets),
        skew_first=_mean_finite([first for first, _ in skews]),
        skew_max=_mean_finite([largest for _, largest in skews]),
        push_hash=push_hash,
        pull_hash=pull_hash,
        push_contiguous=push_contiguous,
        pull_contiguous=pull_contiguous,
    )


def mean_over_steps(samples: Sequence[TensorStats]) -> TensorStats:
    """Average every statistic (gamma_k element-wise) over the profiled steps."""
    averaged = {name: _mean_finite([getattr(sample, name) for sample in samples]) for name in _AVERAGED_FIELDS}
    gammas = [_mean_finite(list(column)) for column in zip(*(sample.gammas for sample in samples), strict=True)]
    return replace(samples[0], gammas=gammas, **averaged)


def _mean_finite(values: Sequence[float]) -> float:
    """Mean that skips NaNs (a worker or step with no non-zeros has no skew), NaN if all are."""
    finite = [value for value in values if not math.isnan(value)]
    return sum(finite) / len(finite) if finite else math.nan


# ----------------------------------------------------------------------------- emulated workers


def worker_loaders(model: Workload, workers: int) -> list[DataLoader]:
    """One loader per emulated rank, sharded exactly as Lightning shards the model's loader under DDP."""
    template = model.train_dataloader()
    dataset = template.dataset
    return [
        DataLoader(
            dataset,
            batch_size=template.batch_size,
            sampler=DistributedSampler(dataset, num_replicas=workers, rank=rank, shuffle=False),
            drop_last=template.drop_last,
            collate_fn=template.collate_fn,
            num_workers=0,
        )
        for rank in range(workers)
    ]


def gradient_index_sets(model: Workload, batch: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Non-zero flat indices of every parameter's gradient for one batch (empty when it gets none).

    Gradients are left on the parameters so the caller can read their layout.
    """
    model.zero_grad(set_to_none=True)
    model.loss(batch).backward()
    return {
        name: nonzero_indices(param.grad) if param.grad is not None else torch.empty(0, dtype=torch.int64)
        for name, param in model.named_parameters()
    }


def _layout_name(grad: Tensor | None) -> str:
    if grad is None:
        return "none"
    return "sparse COO" if grad.is_sparse else "dense"


def profile(model: Workload, workers: int, steps: int, hashing: HashPartitioner | None = None) -> list[TensorStats]:
    """Statistics of every parameter tensor, averaged over ``steps`` steps of ``workers`` emulated ranks."""
    loaders = worker_loaders(model, workers)
    if len(loaders[0]) < steps:
        raise UsageError(
            f"steps={steps} needs {steps} batches per worker, but with workers={workers} each gets "
            f"{len(loaders[0])}; raise model.num_samples or lower steps"
        )
    hashing = hashing or HashPartitioner(workers)
    batches = [iter(loader) for loader in loaders]
    model.train()
    samples: dict[str, list[TensorStats]] = {}
    for _ in range(steps):
        per_worker = [gradient_index_sets(model, next(worker_batches)) for worker_batches in batches]
        for name, param in model.named_parameters():
            sets = [worker_sets[name] for worker_sets in per_worker]
            stats = tensor_stats(name, _layout_name(param.grad), sets, param.numel(), hashing)
            samples.setdefault(name, []).append(stats)
    model.zero_grad(set_to_none=True)
    return [mean_over_steps(tensor_samples) for tensor_samples in samples.values()]


# ----------------------------------------------------------------------------- command line


@dataclass(frozen=True)
class ToolArgs:
    """Parsed command line."""

    model: str = "lstm"
    workers: int = 8
    steps: int = 3
    seed: int = 0
    out: Path | None = None
    model_overrides: tuple[str, ...] = ()


def parse_args(argv: Sequence[str]) -> ToolArgs:
    """``key=value`` tokens; ``model.*`` ones go to Hydra unchanged, unknown keys are rejected by name."""
    values: dict[str, str] = {}
    overrides: list[str] = []
    for token in argv:
        key, separator, value = token.partition("=")
        if not separator or not key:
            raise UsageError(f"expected key=value, got {token!r}\n{USAGE}")
        if key.startswith("model."):
            overrides.append(token)
        elif key in CLI_KEYS:
            values[key] = value
        else:
            raise UsageError(f"unknown key {key!r}: expected one of {', '.join(CLI_KEYS)} or model.<field>")
    defaults = ToolArgs()
    return ToolArgs(
        model=values.get("model", defaults.model),
        workers=_int_at_least("workers", values.get("workers"), defaults.workers, 2),
        steps=_int_at_least("steps", values.get("steps"), defaults.steps, 1),
        seed=_int_at_least("seed", values.get("seed"), defaults.seed, 0),
        out=Path(values["out"]) if values.get("out") else None,
        model_overrides=tuple(overrides),
    )


def _int_at_least(key: str, text: str | None, default: int, minimum: int) -> int:
    if text is None:
        return default
    try:
        number = int(text)
    except ValueError:
        raise UsageError(f"{key} must be an integer, got {text!r}") from None
    if number < minimum:
        raise UsageError(f"{key} must be >= {minimum}, got {number}")
    return number


def compose_model(name: str, seed: int, overrides: Sequence[str] = ()) -> Workload:
    """Build the workload from ddlscale/conf/model/<name>.yaml exactly as train.py would, seeded for reproducibility.

    ``seed`` is the top-level config seed (it also sets ``model.data_seed`` unless overridden) and
    seeds the global RNG the layers initialize from.
    """
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"model={name}", f"seed={seed}", *overrides])
        torch.manual_seed(seed)
        return instantiate(cfg.model)
    except HydraException as error:
        raise UsageError(f"cannot build model {name!r} with {list(overrides)}: {error}") from error


# ----------------------------------------------------------------------------- reporting


def reported_ks(workers: int) -> list[int]:
    """k = 2, 4, 8, ... up to ``workers``, plus ``workers`` itself: the gammas the HC cost model reads."""
    ks = [2**power for power in range(1, workers.bit_length()) if 2**power <= workers]
    return ks if ks and ks[-1] == workers else [*ks, workers]


def machine_line() -> str:
    """Where and when the numbers were taken."""
    return (
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )


def sparse_table(stats: Sequence[TensorStats], workers: int) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted rows of the sparse tensors' full statistics."""
    ks = reported_ks(workers)
    headers = [
        "tensor", "M", "layout", "d", *(f"gamma_{k}" for k in ks), "overlap", "skew first", "skew max",
        "push hash", "push contig", "pull hash", "pull contig",
    ]
    rows = [
        [
            s.name, str(s.numel), s.layout, f"{100 * s.density:.3f}%", *(f"{s.gamma(k):.2f}" for k in ks),
            f"{s.overlap:.3f}", f"{100 * s.skew_first:.1f}%", f"{100 * s.skew_max:.1f}%",
            f"{s.push_hash:.3f}", f"{s.push_contiguous:.3f}", f"{s.pull_hash:.3f}", f"{s.pull_contiguous:.3f}",
        ]
        for s in stats
        if s.is_sparse
    ]
    return headers, rows


def dense_table(stats: Sequence[TensorStats]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the tensors left out as dense (d >= 0.5) or gradient-free (d = 0)."""
    headers = ["tensor", "M", "layout", "d"]
    rows = [[s.name, str(s.numel), s.layout, f"{100 * s.density:.1f}%"] for s in stats if not s.is_sparse]
    return headers, rows


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Space-aligned columns for the terminal."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [headers, ["-" * width for width in widths], *rows]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


DEFINITIONS = """\
- d: fraction of non-zero elements in one worker's gradient (mean over workers and steps).
- gamma_k: density of the sum of the first k workers' gradients / d (1 = identical index sets, k = disjoint).
- overlap: mean Jaccard |I_a ∩ I_b| / |I_a ∪ I_b| over worker pairs.
- skew first / max: share of a worker's non-zeros in the first / the fullest of `workers` equal contiguous partitions.
- push: max over servers of items received from all workers / mean; pull: max over servers of distinct
  summed indices owned / mean. hash = Zen's h0 (HashPartitioner), contig = even contiguous split."""


def write_csv(stats: Sequence[TensorStats], workers: int, path: Path) -> None:
    """Every tensor, raw numbers, gamma_k for every k."""
    scalar_names = [name for name in _AVERAGED_FIELDS if name != "density"]
    headers = ["tensor", "kind", "numel", "layout", "density", *(f"gamma_{k}" for k in range(1, workers + 1))]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*headers, *scalar_names])
        for s in stats:
            kind = "sparse" if s.is_sparse else "dense"
            writer.writerow(
                [s.name, kind, s.numel, s.layout, s.density, *s.gammas, *(getattr(s, n) for n in scalar_names)]
            )


def write_markdown(stats: Sequence[TensorStats], args: ToolArgs, command: str, path: Path) -> None:
    sparse_headers, sparse_rows = sparse_table(stats, args.workers)
    dense_headers, dense_rows = dense_table(stats)
    text = "\n\n".join([
        f"# Sparsity profile: {args.model}, {args.workers} workers, {args.steps} steps",
        f"Machine: {machine_line()}",
        f"Command: `{command}`",
        f"## Sparse tensors (0 < d < {SPARSE_DENSITY})",
        markdown_table(sparse_headers, sparse_rows) if sparse_rows else "none",
        "## Dense tensors (left out)",
        markdown_table(dense_headers, dense_rows) if dense_rows else "none",
        "## Definitions",
        DEFINITIONS,
    ])
    path.write_text(text + "\n")


def write_plot(stats: Sequence[TensorStats], args: ToolArgs, path: Path) -> None:
    """gamma_k vs k per sparse tensor, and push/pull imbalance of hash vs contiguous per sparse tensor."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sparse = [s for s in stats if s.is_sparse]
    figure = Figure(figsize=(13, 5))
    FigureCanvasAgg(figure)
    gamma_axes, balance_axes = figure.subplots(1, 2)
    _plot_gammas(gamma_axes, sparse, args.workers)
    _plot_imbalance(balance_axes, sparse)
    figure.suptitle(f"{args.model}: {args.workers} workers, {args.steps} steps — {machine_line()}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _plot_gammas(axes, sparse: Sequence[TensorStats], workers: int) -> None:
    ks = list(range(1, workers + 1))
    for s in sparse:
        axes.plot(ks, s.gammas, marker="o", label=s.name)
    axes.plot(ks, ks, "k--", linewidth=1, label="gamma_k = k (disjoint)")
    axes.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="gamma_k = 1 (identical)")
    axes.set_xticks(ks)
    axes.set_xlabel("k (workers summed)")
    axes.set_ylabel("gamma_k")
    axes.set_title("densification (C2)")
    axes.legend(fontsize=8)


def _plot_imbalance(axes, sparse: Sequence[TensorStats]) -> None:
    series = [
        ("push, hash", "push_hash"), ("push, contiguous", "push_contiguous"),
        ("pull, hash", "pull_hash"), ("pull, contiguous", "pull_contiguous"),
    ]
    width = 0.8 / len(series)
    for offset, (label, attribute) in enumerate(series):
        positions = [index + (offset - 1.5) * width for index in range(len(sparse))]
        axes.bar(positions, [getattr(s, attribute) for s in sparse], width=width, label=label)
    axes.axhline(1.0, color="black", linewidth=1)
    axes.set_xticks(range(len(sparse)), [s.name for s in sparse], rotation=15, fontsize=8)
    axes.set_ylabel("max / mean over servers")
    axes.set_title("partition imbalance (1 = balanced)")
    axes.legend(fontsize=8)


def write_outputs(stats: Sequence[TensorStats], args: ToolArgs, command: str, out_dir: Path) -> list[Path]:
    """results.csv, results.md and results.png in ``out_dir`` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.csv", out_dir / "results.md", out_dir / "results.png"]
    write_csv(stats, args.workers, paths[0])
    write_markdown(stats, args, command, paths[1])
    write_plot(stats, args, paths[2])
    return paths


def console_report(stats: Sequence[TensorStats], args: ToolArgs) -> str:
    sparse_headers, sparse_rows = sparse_table(stats, args.workers)
    dense_headers, dense_rows = dense_table(stats)
    return "\n\n".join([
        f"{args.model}: {args.workers} workers, {args.steps} steps, seed {args.seed} ({machine_line()})",
        "sparse tensors:\n" + (text_table(sparse_headers, sparse_rows) if sparse_rows else "none"),
        "dense tensors:\n" + (text_table(dense_headers, dense_rows) if dense_rows else "none"),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(token in ("-h", "--help") for token in argv):
        print(USAGE)
        return 0
    torch.set_num_threads(1)  # a profiling tool on a shared machine; the work is tiny anyway
    try:
        args = parse_args(argv)
        model = compose_model(args.model, args.seed, args.model_overrides)
        stats = profile(model, args.workers, args.steps)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(console_report(stats, args))
    command = " ".join(["python -m ddlscale.tools.sparsity", *argv])
    paths = write_outputs(stats, args, command, args.out or OUT_DIR / args.model)
    print("\nwrote " + ", ".join(str(path) for path in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
