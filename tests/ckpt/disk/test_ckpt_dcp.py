"""The persistent tier in DCP format: loadable by torch.distributed.checkpoint alone (Gemini's drained
versions too), read back by ddlscale without unpickling, written asynchronously; resuming at another
world size."""

import pickle

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed.checkpoint as dcp
from ckpt_runs import summary, train
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddlscale.ckpt import DiskCheckpointer, load_version, read_manifest
from ddlscale.ckpt.disk.reader import DcpVersion
from ddlscale.ckpt.disk.writer import DcpWriter
from ddlscale.ckpt.gemini.drain import persist_committed
from ddlscale.ckpt.state.data import DataPosition, consumed_samples, position_loader_at_sample
from ddlscale.ckpt.state.rng import capture_rng
from ddlscale.ckpt.state.shard import PAYLOAD_FORMAT, RANK_STATE_KEY, SYNC_STATE_KEY
from ddlscale.ckpt.state.snapshot import to_bytes
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, list_manifests, write_manifest
from ddlscale.compress.memory import ResidualMemory
from ddlscale.sync.compressed.regroup import load_summed_share

pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*")


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(24, 8, generator=generator), torch.randn(24, 1, generator=generator))
        return DataLoader(data, batch_size=8)


def _trained(tmp_path, steps=4):
    """A model trained ``steps`` steps, its optimizer, and the DCP version of its final state."""
    pl.seed_everything(3, verbose=False)
    model = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         callbacks=[DiskCheckpointer(every=steps, dir=str(tmp_path))], enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model)
    (manifest,) = list_manifests(tmp_path)
    return model, trainer.optimizers[0], manifest


def test_a_version_loads_with_torch_distributed_checkpoint_alone(tmp_path):
    model, optimizer, manifest = _trained(tmp_path)
    record = read_manifest(manifest)
    assert record.layout == "dcp" and (manifest.parent / record.files[-1].file).name == ".metadata"
    version_dir = manifest.parent / record.shards[0].file.split("/")[0]
    fresh = Regression()  # other initial weights, zeroed optimizer state of the same shapes
    state = {"model": fresh.state_dict(),
             "optimizer": {"0": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                           for i, s in optimizer.state_dict()["state"].items()}}}}
    dcp.load(state, checkpoint_id=str(version_dir))  # DCP's stock FileSystemReader, nothing of ddlscale
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    saved = optimizer.state_dict()["state"]
    assert all(torch.equal(state["optimizer"]["0"]["state"][i][k], v) for i in saved for k, v in saved[i].items())


def test_ddlscale_reads_a_version_without_unpickling(tmp_path, monkeypatch):
    model, _, manifest = _trained(tmp_path)
    record = read_manifest(manifest)
    # A hostile .metadata: DCP's reader would run this on unpickling. Its record is rewritten to match,
    # as whoever could write the directory could do.
    marker = tmp_path / "pwned"
    poison = pickle.dumps(type("P", (), {"__reduce__": lambda self: (open, (str(marker), "w"))})())
    meta = manifest.parent / record.files[-1].file
    meta.write_bytes(poison)
    dcp_record = {**record.dcp, "metadata": {"file": record.files[-1].file, "bytes": len(poison),
                                             "checksum": checksum(poison)}}
    write_manifest(manifest.parent, type(record)(**{**record.__dict__, "dcp": dcp_record}))

    def refuse(*args, **kwargs):
        raise AssertionError("ddlscale's restore path unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    loaded = load_version(manifest, rank=0)
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in model.state_dict().items())
    assert not marker.exists()


def test_a_tampered_data_file_is_refused_before_it_is_parsed(tmp_path):
    _, _, manifest = _trained(tmp_path)
    shard = manifest.parent / read_manifest(manifest).shards[0].file
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_version(manifest, rank=0)


def test_async_save_keeps_the_state_as_of_the_save(tmp_path):
    live = torch.arange(1000, dtype=torch.float32)
    payload = {"format": "ddlscale-training-state/1", "local": {"rank": 0, "buffer": live},
               "shared": {"state_dict": {"w": live}}}
    writer = DcpWriter(tmp_path, rank=0, world_size=1, asynchronous=True)
    writer.save(7, "step_000000007.x", payload, {live.data_ptr()}, DataPosition(0, 1, 4, 8))
    writer.staged()  # what the optimizer step waits for
    live.mul_(-1)  # the optimizer step changes the referenced tensor in place
    writer.close()
    (manifest,) = list_manifests(tmp_path)
    back = DcpVersion(tmp_path, read_manifest(manifest)).payload(0)
    assert torch.equal(back["shared"]["state_dict"]["w"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(back["local"]["buffer"], torch.arange(1000, dtype=torch.float32))


def test_each_version_is_timed_and_a_save_behind_a_slow_write_waits_for_it(tmp_path):
    """Paced at 8 Mbit/s, a 400 kB version takes ~0.4 s to write: the save right after it waits that out."""
    payload = {"format": "ddlscale-training-state/1", "local": {"rank": 0},
               "shared": {"state_dict": {"w": torch.zeros(100_000)}}}
    writer = DcpWriter(tmp_path, rank=0, world_size=1, asynchronous=True, bandwidth_bps=8e6)
    writer.save(1, "step_000000001.x", payload, None, DataPosition(0, 1, 4, 8))
    writer.save(2, "step_000000002.x", payload, None, DataPosition(0, 2, 4, 8))
    writer.close()
    first, second = writer.timings
    assert first["step"] == 1 and first["waited_s"] < 0.05
    assert first["staged_s"] <= first["written_s"] <= first["committed_s"] and first["written_s"] > 0.3
    assert second["waited_s"] > 0.25  # the second save stalled on the first's write
    assert [read_manifest(p).step for p in list_manifests(tmp_path)] == [2, 1]


def test_a_long_wait_for_the_previous_version_is_said_with_its_timings(tmp_path, capsys):
    checkpointer = DiskCheckpointer(every=5, run_dir=str(tmp_path))
    checkpointer.write_timings = [{"step": 5, "waited_s": 0.0, "staged_s": 0.01, "written_s": 9.5, "committed_s": 9.6},
                                  {"step": 10, "waited_s": 7.75}]
    checkpointer._note_stall(rank=2)
    line = capsys.readouterr().out
    assert "rank 2 step 10: training waited 7.8 s for step 5's version" in line
    assert "written after 9.5 s, committed after 9.6 s; every 5 steps" in line
    checkpointer.write_timings[-1]["waited_s"] = 1.0  # a short wait is not a stall worth a line
    checkpointer._note_stall(rank=2)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("saved,resumed", [(4, 2), (2, 4), (3, 2)])
def test_error_feedback_is_summed_and_shared_out_keeping_its_total(saved, resumed):
    generator = torch.Generator().manual_seed(saved)
    states = [{"residuals": {"g0": torch.randn(50, generator=generator), "g1": torch.randn(7, generator=generator)}}
              for _ in range(saved)]
    states[-1]["residuals"].pop("g1")  # a rank that sent g1 whole carries no residual for it
    memories = [ResidualMemory() for _ in range(resumed)]
    for memory in memories:
        load_summed_share(memory, states, resumed)
    for name in ("g0", "g1"):
        before = sum(s["residuals"][name].double() for s in states if name in s["residuals"])
        after = sum(m.residual(name).double() for m in memories)
        assert memories[0].residual(name).dtype == torch.float32
        assert torch.allclose(after, before, rtol=0, atol=1e-6)


def _loader(dataset, batch, world, rank, shuffle):
    """A train loader as Lightning builds it under data parallelism (the workloads' drop_last=True)."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=11)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)


@pytest.mark.parametrize("saved,resumed,done", [(4, 2, 3), (2, 4, 3), (3, 2, 2)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_data_continues_at_the_same_global_sample(saved, resumed, done, shuffle):
    dataset, batch, epoch = list(range(203)), 4, 1
    before = [_loader(dataset, batch, saved, r, shuffle) for r in range(saved)]
    for loader in before:
        loader.sampler.set_epoch(epoch)
    trained = [i for loader in before for b in list(loader)[:done] for i in b.tolist()]
    samples = {consumed_samples(loader, done, saved) for loader in before}
    assert samples == {done * batch * saved}
    order = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=11).__iter__()) \
        if not shuffle else torch.randperm(len(dataset), generator=torch.Generator().manual_seed(11 + epoch)).tolist()
    (s,) = samples
    assert sorted(trained) == sorted(order[:s])  # what N ranks trained is a prefix of the epoch's order

    after = [_loader(dataset, batch, resumed, r, shuffle) for r in range(resumed)]
    counted = [position_loader_at_sample(loader, epoch, s) for loader in after]
    batches = [[b.tolist() for b in loader] for loader in after]
    for n, mine in zip(counted, batches, strict=True):
        assert n + len(mine) == len(_loader(dataset, batch, resumed, 0, shuffle))  # the epoch's batch count holds
    first_round = sorted(i for mine in batches for i in mine[0])
    assert first_round == sorted(order[s:s + batch * resumed])  # the next samples of the order, over M ranks
    rest = [i for mine in batches for b in mine for i in b]
    assert not set(rest) & set(trained) and len(rest) == len(set(rest))  # nothing trained twice in the epoch
    # A later checkpoint on the resumed ranks counts from there.
    assert {consumed_samples(loader, n + 2, resumed) for loader, n in zip(after, counted, strict=True)} == {
        s + 2 * batch * resumed}
    for loader in after:  # the next epoch is whole again
        loader.batch_sampler.sampler.set_epoch(epoch + 1)
        assert len(list(loader)) == len(_loader(dataset, batch, resumed, 0, shuffle))


# -- end to end, train.py on several workers (slow) ------------------------------------------------------
# 1024 samples of batch 32: 8 batches per epoch on 4 workers, 16 on 2; step 3 is mid-epoch on both.
CNN_EF = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=1024",
          "model.optimizer=sgd", "model.momentum=0.9", "sync=compress", "compressor=topk"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [(4, 2), (2, 4)])
def test_train_resumes_at_another_world_size(saved, resumed, tmp_path):
    first, second = tmp_path / "saved", tmp_path / "resumed"
    train(*CNN_EF, f"trainer.devices={saved}", "trainer.max_steps=3", "ckpt=disk", "ckpt.every=3",
          f"hydra.run.dir={first}", timeout=600)
    manifest = list_manifests(first / "checkpoints")[0]
    result = train(*CNN_EF, f"trainer.devices={resumed}", "trainer.max_steps=6", "ckpt=disk", "ckpt.every=3",
                   "ckpt.resume=auto", f"ckpt.dir={first / 'checkpoints'}", f"hydra.run.dir={second}", timeout=600)
    assert f"saved by {saved} workers; resuming on {resumed}" in result.stdout
    done = summary(second)
    assert done["steps"] == 6 and done["world_size"] == resumed and done["ckpt_resumed_step"] == 3
    assert (done["ckpt_resumed_world_size_saved"], done["ckpt_resumed_world_size"]) == (saved, resumed)
    # Parameters as loaded are the ones saved (the saving run ended on the checkpointed step).
    assert done["ckpt_loaded_param_sha256"] == summary(first)["param_sha256"]
    # Every resumed rank gets the saved optimizer state and the saved ranks' error feedback, merged.
    as_saved = load_version(manifest, rank=0)
    loaded = [load_version(manifest, rank=r, world_size=resumed) for r in range(resumed)]
    for state in loaded:
        assert all(torch.equal(state["state_dict"][k], v) for k, v in as_saved["state_dict"].items())
        momentum = as_saved["optimizer_states"][0]["state"]
        assert all(torch.equal(state["optimizer_states"][0]["state"][i]["momentum_buffer"], m["momentum_buffer"])
                   for i, m in momentum.items())
    sync_states = loaded[0][SYNC_STATE_KEY]["ranks"]
    assert len(sync_states) == saved
    memories = [ResidualMemory() for _ in range(resumed)]
    for memory in memories:
        load_summed_share(memory, [s["memory"] for s in sync_states], resumed)
    names = {k for s in sync_states for k in s["memory"]["residuals"]}
    assert names
    for name in names:
        total = sum(s["memory"]["residuals"][name].double() for s in sync_states if name in s["memory"]["residuals"])
        assert torch.allclose(sum(m.residual(name).double() for m in memories), total, rtol=0, atol=1e-6)



# -- Gemini's drain writes the same format ---------------------------------------------------------------
def _replica(rank, world, step, model, optimizer):
    """Rank ``rank``'s in-memory version as Gemini sends it: the whole state (the rank-shared part on every
    rank), one snapshot stream."""
    generator = torch.Generator().manual_seed(rank)
    local = {"rank": rank, "world_size": world, "global_step": step, "rng": capture_rng(),
             "data": DataPosition(0, step, 10, step * 8 * world).to_dict(),
             "sync": {"memory": {"residuals": {"g0": torch.randn(5, generator=generator)}}}}
    shared = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": step}
    return {"format": PAYLOAD_FORMAT, "local": local, "shared": shared}


@pytest.mark.multiprocess
def test_a_drained_gemini_version_loads_with_torch_distributed_checkpoint_alone(job, agent, tmp_path):
    step, world = 5, 2
    model = Regression()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.net(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    payloads = [_replica(r, world, step, model, optimizer) for r in range(world)]
    shards = []
    with job.client(agent) as client:
        for rank, payload in enumerate(payloads):
            data = to_bytes(payload)
            mac = checksum(data, "hmac-sha256", job.auth.replica)
            client.begin(step, rank, len(data))
            for offset in range(0, len(data), 1 << 16):
                client.data(step, rank, offset, [memoryview(data)[offset:offset + (1 << 16)]])
            client.end(step, rank, mac)
            shards.append(ShardRecord(rank, f"memory:rank{rank}", len(data), mac))
    job.store.publish(Manifest(step=step, world_size=world, shards=tuple(shards), epoch=0, batch=step, tier="memory",
                               placement={"incarnation": job.incarnation, "machines": 1,
                                          "holders": {str(r): [0] for r in range(world)}}))
    job.decide(step, "committed")

    drained = persist_committed(job.store, tmp_path / "checkpoints")
    written = drained.path
    assert drained.why == "" and drained.step == step
    record = read_manifest(written)
    assert (record.step, record.world_size, record.layout) == (step, world, "dcp")
    version_dir = written.parent / record.shards[0].file.split("/")[0]
    assert sorted(p.name for p in version_dir.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # DCP's stock reader, nothing of ddlscale: the model, the optimizer, and rank 1's own error feedback.
    fresh = Regression()
    state = {"model": fresh.state_dict(),
             "optimizer": {"0": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                           for i, s in optimizer.state_dict()["state"].items()}}},
             "rank1": {"sync": {"memory": {"residuals": {"g0": torch.zeros(5)}}}}}
    dcp.load(state, checkpoint_id=str(version_dir))
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    saved = optimizer.state_dict()["state"]
    assert all(torch.equal(state["optimizer"]["0"]["state"][i][k], v) for i in saved for k, v in saved[i].items())
    assert torch.equal(state["rank1"]["sync"]["memory"]["residuals"]["g0"],
                       payloads[1]["local"]["sync"]["memory"]["residuals"]["g0"])
    # ddlscale resumes from it as from any persistent version, each rank with its own local state.
    for rank in range(world):
        loaded = load_version(written, rank=rank)
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in model.state_dict().items())
        assert loaded[RANK_STATE_KEY]["rank"] == rank and loaded[RANK_STATE_KEY]["data"] == payloads[rank]["local"]["data"]
        assert torch.equal(loaded[SYNC_STATE_KEY]["ranks"][rank]["memory"]["residuals"]["g0"],
                           payloads[rank]["local"]["sync"]["memory"]["residuals"]["g0"])
    again = persist_committed(job.store, tmp_path / "checkpoints")  # nothing newer than what is there
    assert again.path == written and "already holds step 5" in again.why
