"""The captured training state, in one process: RNG streams, data position, schedulers, atomic files."""

import os
import random
import threading
import time

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddlscale import clock
from ddlscale.ckpt import DataPosition, DiskCheckpointer, Manifest, ManifestError, ShardRecord, read_manifest
from ddlscale.ckpt.checkpointer import process_started_unix
from ddlscale.ckpt.state.data import ResumingBatchSampler, position_loader
from ddlscale.ckpt.state.shard import Shard, decode
from ddlscale.ckpt.version.atomic import write_atomic
from ddlscale.ckpt.version.manifest import list_manifests
from ddlscale.strategy import SYNC_STATE_KEY as STRATEGY_KEY

# Lightning's own use of a deprecated torch API, silenced by the app in its workers.
pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*")


class NoisyRegression(pl.LightningModule):
    """Dropout (torch RNG), numpy and python random draws, Adam and a step LR schedule: every stream
    and counter a restore could miss shows in the losses."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
        self.trace = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        jitter = float(np.random.rand()) + random.random()
        loss = ((self.net(x) - y) ** 2).mean() * (1 + 1e-3 * jitter)
        self.trace.append((self.global_step, float(loss)))
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(24, 8, generator=generator), torch.randn(24, 1, generator=generator))
        return DataLoader(data, batch_size=8)  # 3 batches per epoch


def _fit(max_steps, checkpointer=None, ckpt_path=None):
    pl.seed_everything(5, verbose=False)
    model = NoisyRegression()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         callbacks=[checkpointer] if checkpointer else [], enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("stop", [2, 3, 4, 6])  # mid-epoch and epoch boundaries
def test_resume_restores_rng_optimizer_scheduler_and_data_position(stop, tmp_path):
    straight = _fit(9)
    _fit(stop, DiskCheckpointer(every=stop, dir=str(tmp_path / "a")))
    (manifest,) = list_manifests(tmp_path / "a")
    resumed = _fit(9, DiskCheckpointer(every=100, dir=str(tmp_path / "b"), resume=str(manifest)), str(manifest))
    assert resumed.trace == straight.trace[stop:]
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), resumed.parameters(), strict=True))


class _ReturnedFromSave(DiskCheckpointer):
    """Sets ``returned`` each time a save has returned to training."""

    def __init__(self, returned, **kwargs):
        super().__init__(**kwargs)
        self.returned = returned

    def save(self, *args, **kwargs):
        super().save(*args, **kwargs)
        self.returned.set()


def test_highfreq_sets_the_interval_from_the_probe_checkpoint_without_waiting_for_it(tmp_path, monkeypatch):
    # At 2 Mbit/s a checkpoint (tens of kB) lasts far longer than a step: K = ceil(t_ckpt / T_iter) > 1.
    # The probe's write is held back until its save has returned to training: a save that waited for its
    # write would wait on the hold (until it gives up), and training with it.
    from ddlscale.ckpt.disk import writer as disk_writer

    returned, held, storage_writer = threading.Event(), [], disk_writer.storage_writer

    def held_back(*args, **kwargs):
        storage = storage_writer(*args, **kwargs)
        write_data = storage.write_data

        def write_after_the_save_returned(*a, **kw):
            if not held:  # the probe's
                held.append(returned.wait(60))
            return write_data(*a, **kw)

        storage.write_data = write_after_the_save_returned
        return storage

    monkeypatch.setattr(disk_writer, "storage_writer", held_back)
    checkpointer = _ReturnedFromSave(returned, every="highfreq", dir=str(tmp_path), keep=100, bandwidth="2mbit")
    _fit(400, checkpointer)
    steps = sorted(read_manifest(p).step for p in list_manifests(tmp_path))
    k = checkpointer.interval
    assert steps[0] == 3 and k > 1 and len(steps) >= 2 and steps[1] > 3  # the next once the probe is written
    assert checkpointer.due(steps[1] + k) and not checkpointer.due(steps[1] + 1)  # then every K steps
    assert all(b - a == k for a, b in zip(steps[1:], steps[2:], strict=False))
    assert held == [True]  # training did not wait for the probe's write: it was still held back
    assert k >= (steps[1] - 3) / 2  # K from the whole write, which the steps until its settling also took


def test_keep_prunes_old_versions_and_their_files(tmp_path):
    (tmp_path / ".step_000000001.manifest.json.tmp-99").write_text("partial")  # a crashed write
    _fit(5, DiskCheckpointer(every=1, dir=str(tmp_path), keep=2))
    assert [read_manifest(p).step for p in list_manifests(tmp_path)] == [5, 4]
    assert sorted(p.name.split(".")[0] for p in tmp_path.iterdir()) == ["step_000000004"] * 2 + ["step_000000005"] * 2


def test_prune_leaves_this_runs_version_in_flight_and_removes_the_rest(tmp_path):
    # Rank 0 prunes after committing step 4 while another rank already writes step 6 (same run token).
    from ddlscale.ckpt.version.manifest import write_manifest

    for name in ("step_000000004.run1", "step_000000006.run1", "step_000000002.run1", "step_000000006.old0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
    write_manifest(tmp_path, Manifest(step=4, world_size=1, shards=(ShardRecord(0, "step_000000004.run1/__0_0.distcp",
                                                                                1, "0" * 64),)))
    checkpointer = DiskCheckpointer(every=2, dir=str(tmp_path), keep=1)
    checkpointer._token = "run1"
    checkpointer.prune()
    # kept: the committed version and this run's step 6 in flight; gone: an unnamed older one of this run,
    # and another run's leftover past the newest manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004.manifest.json", "step_000000004.run1",
                                                         "step_000000006.run1"]
    checkpointer._token = None  # a prune outside a run (the drain) keeps nothing no manifest names
    checkpointer.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004.manifest.json", "step_000000004.run1"]


def test_position_loader_skips_batches_once_and_sets_the_epoch():
    loader = DataLoader(list(range(10)), batch_size=2)
    position_loader(loader, DataPosition.after_batch(epoch=0, batch_idx=2, num_batches=5))
    assert isinstance(loader.batch_sampler, ResumingBatchSampler) and len(loader) == 5
    assert [b.tolist() for b in loader] == [[6, 7], [8, 9]]
    assert len(list(loader)) == 5  # the next epoch is whole
    assert DataPosition.after_batch(3, 4, 5) == DataPosition(4, 0, 5, samples=0)


def test_write_atomic_is_all_or_nothing_and_paced(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    start = time.perf_counter()
    write_atomic(target, b"x" * 25_000, bandwidth_bps=2e6)  # 200 kbit at 2 Mbit/s: >= 0.1 s
    assert time.perf_counter() - start >= 0.09 and target.read_bytes() == b"x" * 25_000

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"x" * 25_000 and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_shards_and_manifests_refuse_corruption(tmp_path):
    shard = Shard.encode(0, {"format": "ddlscale-training-state/1", "local": {}, "shared": None})
    assert shard.decode()["local"] == {}
    with pytest.raises(ValueError, match="checksum mismatch"):
        decode(shard.data[:-1] + bytes([shard.data[-1] ^ 1]), shard.checksum)
    manifest = Manifest(step=1, world_size=2, shards=(ShardRecord(0, "a", 1, "0" * 64),))
    with pytest.raises(ManifestError, match="ranks 0..1"):
        Manifest.from_json(manifest.to_json())
    bad = tmp_path / "step_000000001.manifest.json"
    bad.write_text("{not json")
    with pytest.raises(ManifestError, match=str(bad)):
        read_manifest(bad)


def test_strategy_reads_the_sync_state_under_the_same_key():
    from ddlscale.ckpt import SYNC_STATE_KEY

    assert STRATEGY_KEY == SYNC_STATE_KEY


def test_the_process_start_is_on_the_progress_logs_clock_under_dilation():
    """A restart splits at the worker's launch: its start must read like clock.timestamp() (unix / k)."""
    started = process_started_unix()
    assert started is not None and started <= clock.timestamp()
    with clock.dilated(2):
        assert process_started_unix() == pytest.approx(started / 2)
        assert process_started_unix() <= clock.timestamp()
