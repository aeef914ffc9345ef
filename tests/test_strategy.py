"""DDLStrategy + DenseAllreduce against stock Lightning DDP: same model, seed and data."""

import os
from itertools import pairwise
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import DDPStrategy

from ddlscale.strategy import DDLStrategy
from ddlscale.sync import DenseAllreduce
from ddlscale.sync.sparse.zen import ZenSync
from ddlscale.workloads import LSTMLanguageModel, ResNetCNN

STEPS = 20


def _fit(make_model, strategy, world, accumulate=1, clip=None):
    os.environ.pop("MASTER_PORT", None)  # a fresh port per fit (see conftest.py)
    pl.seed_everything(7, verbose=False)
    model = make_model()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(model)  # spawn: rank 0's final weights come back into `model`
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class _StockDDP(DDPStrategy):
    """Stock DDP whose spawned workers end their process groups at teardown, as DDLStrategy's do.
    Left to interpreter shutdown, a group's gloo thread can abort a worker after training finished
    ("terminate called without an active exception", see ddlscale.comm.groups), failing the test for
    nothing it compares."""

    def teardown(self) -> None:
        super().teardown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _gloo_threads() -> list[str]:
    """This process's threads that gloo started (their names: pt_gloo_runloop, gloo_tcp_loop...)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name)


class _ReportsThreads:
    """Each worker writes, once teardown is over, the gloo threads it still runs to ``report``/rank."""

    report: Path

    def teardown(self) -> None:
        super().teardown()
        (self.report / str(self.global_rank)).write_text(" ".join(_gloo_threads()))


class _DDLReportsThreads(_ReportsThreads, DDLStrategy):
    pass


class _StockDDPReportsThreads(_ReportsThreads, _StockDDP):
    pass


def _small_lstm(**kwargs):
    return LSTMLanguageModel(vocab_size=2000, embed_dim=16, hidden_dim=32, num_sampled=64,
                             num_samples=2048, lr=0.5, **kwargs)


def _small_cnn():
    return ResNetCNN(width=8, num_blocks=2, num_samples=2048, lr=0.05, momentum=0.9)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "make_model,world,accumulate,clip",
    [
        pytest.param(_small_cnn, 2, 1, None, marks=pytest.mark.slow),  # ~12 s; lstm covers 2 ranks
        (_small_lstm, 2, 2, 0.5),  # accumulation and clipping after the sync
        (_small_lstm, 3, 1, None),
        pytest.param(_small_cnn, 3, 2, None, marks=pytest.mark.slow),  # ~18 s; lstm-3 covers an odd world
    ],
    ids=["cnn-2", "lstm-2-accum-clip", "lstm-3", "cnn-3-accum"],
)
def test_dense_matches_stock_ddp(make_model, world, accumulate, clip):
    ours = _fit(make_model, DDLStrategy(sync=DenseAllreduce()), world, accumulate, clip)
    ddp = _fit(make_model, _StockDDP(start_method="spawn"), world, accumulate, clip)
    start = torch.cat([p.detach().flatten() for p in (pl.seed_everything(7, verbose=False), make_model())[1].parameters()])
    assert not torch.equal(ours, start), "training moved the parameters"
    # Same buckets as DDP's reducer, same scaling before the sum: the very same bits, even on 3
    # workers where a different summation order alone drifts by ~1e-4 after 20 steps of the CNN.
    assert torch.equal(ours, ddp)


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.multiprocess
def test_third_party_module_by_registry_name():
    """Lightning's own demo model trains unchanged with strategy="ddlscale", equal to DDP."""
    ours = _fit(BoringModel, "ddlscale", 2)
    ddp = _fit(BoringModel, _StockDDP(start_method="spawn"), 2)
    assert torch.equal(ours, ddp)


class _Manual(BoringModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from /proc")
@pytest.mark.parametrize("kind", ["zen-hierarchical", "stock-ddp"])
def test_workers_end_every_process_group_at_teardown(kind, tmp_path):
    """No gloo thread is left when teardown is over: a process group that lives on into interpreter
    shutdown can abort the worker after training finished (ddlscale.comm.groups). Zen holds three
    groups of its own besides the world: its sparse lane and the machine groups (here 1 rank each)."""
    if kind == "stock-ddp":
        strategy, make_model = _StockDDPReportsThreads(start_method="spawn"), _small_cnn
    else:
        sync = ZenSync(hierarchical=True, local_size=1, profile_steps=1)
        strategy, make_model = _DDLReportsThreads(sync=sync), lambda: _small_lstm(sparse_embedding=True)
    strategy.report = tmp_path
    _fit(make_model, strategy, 2)
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == {"0": "", "1": ""}


@pytest.mark.multiprocess
def test_manual_optimization_is_refused_clearly():
    with pytest.raises(Exception, match="automatic optimization"):
        _fit(_Manual, DDLStrategy(), 1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="strategy.start_method"):
        DDLStrategy(start_method="threads")
    with pytest.raises(TypeError, match="GradSync"):
        DDLStrategy(sync="dense")
    with pytest.raises(ValueError, match="strategy.device_time_s must be a number >= 0"):
        DDLStrategy(device_time_s=-0.1)


class _StepClock(BoringModel):
    """Appends the time each training step's forward starts to ``path`` (the fit may run in a child)."""

    def __init__(self, path):
        super().__init__()
        self.path = str(path)

    def training_step(self, batch, batch_idx):
        import time

        with open(self.path, "a") as f:
            f.write(f"{time.perf_counter()}\n")
        return super().training_step(batch, batch_idx)


@pytest.mark.slow  # the default run's time: make test-slow runs it
def test_device_time_idles_each_step_without_changing_training(tmp_path):
    def fit(device_time, path):
        pl.seed_everything(0)
        model = _StepClock(path)
        trainer = pl.Trainer(max_steps=4, strategy=DDLStrategy(device_time_s=device_time), devices=1,
                             accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model)
        starts = [float(line) for line in Path(path).read_text().split()]
        return [b - a for a, b in pairwise(starts)], [p.detach().clone() for p in model.parameters()]

    _, quick_params = fit(0.0, tmp_path / "quick")
    gaps, slow_params = fit(0.25, tmp_path / "slow")
    # Each step idles before its forward, so consecutive forwards are at least that far apart (a
    # lower bound, not a timing: a busy host only widens the gaps).
    assert len(gaps) == 3 and min(gaps) >= 0.25
    assert all(torch.equal(a, b) for a, b in zip(quick_params, slow_params, strict=True))
