"""Lightning checkpoints carry the sync backend's per-rank state, and resuming is bit-exact."""

import os

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from ddlscale.strategy import SYNC_STATE_KEY, DDLStrategy
from ddlscale.sync import DenseAllreduce
from ddlscale.workloads import LSTMLanguageModel


def _model():
    # 320 samples / (32 per batch x 2 ranks) = 5 steps per epoch: step 5 ends an epoch.
    return LSTMLanguageModel(vocab_size=1000, embed_dim=16, hidden_dim=16, num_sampled=32,
                             num_samples=320, lr=0.5)


def _fit(max_steps, ckpt_dir=None, resume=None):
    os.environ.pop("MASTER_PORT", None)  # a fresh port per fit (see conftest.py)
    pl.seed_everything(11, verbose=False)
    model = _model()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)] if ckpt_dir else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDLStrategy(sync=DenseAllreduce()), max_steps=max_steps,
        logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=resume)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.multiprocess
def test_resume_from_lightning_checkpoint_is_bit_exact(tmp_path):
    straight = _fit(10)
    _fit(5, ckpt_dir=tmp_path / "a")
    (first,) = sorted((tmp_path / "a").glob("*.ckpt"))
    resumed = _fit(10, ckpt_dir=tmp_path / "b", resume=str(first))
    assert torch.equal(straight, resumed)

    saved = torch.load(first, weights_only=False)[SYNC_STATE_KEY]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    assert [s["steps"] for s in saved["ranks"]] == [5, 5]
    last = max((tmp_path / "b").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    # The resumed backend continued counting from the restored state.
    assert [s["steps"] for s in torch.load(last, weights_only=False)[SYNC_STATE_KEY]["ranks"]] == [10, 10]


@pytest.mark.multiprocess
def test_a_checkpoint_of_two_ranks_resumes_on_one(tmp_path):
    """Lightning's checkpoint carries every rank's sync state; at another world size the backend
    takes it over rather than refusing, and training goes on from the saved weights."""
    _fit(5, ckpt_dir=tmp_path)
    (ckpt,) = sorted(tmp_path.glob("*.ckpt"))
    pl.seed_everything(11, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DDLStrategy(), max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    model = _model()
    trainer.fit(model, ckpt_path=str(ckpt))  # in a worker process: the trainer here keeps its own counters
    assert trainer.state.finished
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    trained = model.state_dict()
    assert saved.keys() == trained.keys() and any(not torch.equal(saved[k], trained[k]) for k in saved)
