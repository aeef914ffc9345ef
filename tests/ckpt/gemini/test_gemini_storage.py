"""Gemini's persistent tier on the emulated cluster's storage machine: ``ckpt.persist_dir=storage://<path>``
(``storage://gemini`` by default there) for the periodic versions, the drain at the end of a launch and
resume; refused, naming the key, where it cannot work; local directories as before.

The first tests run in this process (no cluster, no server); the last one trains on an emulated cluster
with a storage machine (nginx) and is slow."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddlscale.ckpt.gemini import drain, recovery
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys
from ddlscale.ckpt.gemini.gemini_checkpointer import GeminiCheckpointer
from ddlscale.ckpt.gemini.services import persist_emulated
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.rng import capture_rng
from ddlscale.ckpt.state.shard import PAYLOAD_FORMAT, RANK_STATE_KEY
from ddlscale.ckpt.state.snapshot import to_bytes
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.io import load_version
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, manifest_names
from ddlscale.cluster import storage
from ddlscale.cluster.emulated import EmulatedCluster
from ddlscale.cluster.emulated import unavailable_reason as cluster_unavailable
from ddlscale.cluster.storage_client import PASSWORD_ENV, URL_ENV, USER_ENV, StorageEndpoint
from ddlscale.paths import CONF_DIR

ROOT = Path(__file__).resolve().parents[3]
ENDPOINT = StorageEndpoint("http://10.213.0.254:8080/", "ddlscale", "not-a-real-password")


@pytest.fixture
def no_storage_env(monkeypatch):
    for key in (URL_ENV, USER_ENV, PASSWORD_ENV):
        monkeypatch.delenv(key, raising=False)


# -- where the persistent tier is ---------------------------------------------------------------------------
def test_persist_dir_resolves_as_the_disk_tier_resolves_ckpt_dir(tmp_path, monkeypatch, no_storage_env):
    run = str(tmp_path)
    assert GeminiCheckpointer(run_dir=run).persist_dir == tmp_path / "checkpoints"  # as before
    local = GeminiCheckpointer(persist_every=3, persist_dir=str(tmp_path / "disk"), run_dir=run)
    assert local.persist_dir == tmp_path / "disk" and local.persistent.dir == tmp_path / "disk"
    # A storage:// URL stays one (a Path would fold it to storage:/run/g), here and in the disk tier below.
    remote = GeminiCheckpointer(persist_every=3, persist_dir="storage://run/g", run_dir=run)
    assert remote.persist_dir == "storage://run/g" and remote.persistent.dir == "storage://run/g"
    # The launching process has no endpoint in its environment: the launch says whether a storage machine serves.
    assert GeminiCheckpointer(run_dir=run).persist_target(storage=True) == "storage://gemini"
    assert GeminiCheckpointer(run_dir=run).persist_target(storage=False) == tmp_path / "checkpoints"
    for key, value in ENDPOINT.env().items():  # a worker the launcher handed the storage machine
        monkeypatch.setenv(key, value)
    worker = GeminiCheckpointer(persist_every=3, run_dir=run)
    assert worker.persist_dir == "storage://gemini" and worker.persistent.dir == "storage://gemini"
    assert GeminiCheckpointer(persist_dir=str(tmp_path / "disk"), run_dir=run).persist_dir == tmp_path / "disk"


def _config(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


STORAGE = ["cluster=emulated", "cluster.nodes=2", "cluster.storage.bandwidth=1gbit"]


@pytest.mark.parametrize("overrides, message", [
    (["ckpt.persist_dir=storage://x"], r"ckpt\.persist_dir=storage://x: .*storage machine.*cluster\.storage\.bandwidth"),
    (["ckpt.persist_every=5", "ckpt.persist_dir=storage://x"], r"ckpt\.persist_dir=storage://x"),
    ([*STORAGE, "ckpt.persist_bandwidth=100mbit"], r"ckpt\.persist_bandwidth .*set ckpt\.persist_bandwidth=null"),
    ([*STORAGE, "ckpt.persist_dir=storage://run/g", "ckpt.persist_bandwidth=100mbit"], r"ckpt\.persist_bandwidth"),
    ([*STORAGE, "ckpt.persist_dir=storage://../up"], r"ckpt\.persist_dir=storage://\.\./up: a path under"),
])
def test_a_persist_dir_on_the_storage_machine_is_refused_where_it_cannot_work(overrides, message):
    from ddlscale.trainer import ConfigError, check_config

    with pytest.raises(ConfigError, match=message):
        check_config(_config("ckpt=gemini", *overrides))


def test_a_persist_dir_on_the_storage_machine_is_accepted_where_it_works(tmp_path):
    from ddlscale.trainer import check_config

    check_config(_config("ckpt=gemini", *STORAGE))  # storage://gemini
    check_config(_config("ckpt=gemini", *STORAGE, "ckpt.persist_every=5", "ckpt.persist_dir=storage://run7/g"))
    # A local directory stays one, paced as before, storage machine or not.
    check_config(_config("ckpt=gemini", *STORAGE, f"ckpt.persist_dir={tmp_path}", "ckpt.persist_bandwidth=100mbit"))
    check_config(_config("ckpt=gemini", "ckpt.persist_every=5", "ckpt.persist_bandwidth=100mbit"))


def test_the_disk_tier_refuses_a_storage_path_out_of_the_stores_root_before_any_worker_starts():
    from ddlscale.trainer import ConfigError, check_config

    with pytest.raises(ConfigError, match=r"ckpt\.dir=storage://a/\.\./b: a path under"):
        check_config(_config("ckpt=disk", *STORAGE, "ckpt.dir=storage://a/../b"))


# -- the drain at the end of a launch ------------------------------------------------------------------------
class _Cluster(EmulatedCluster):
    """An emulated cluster that is never brought up: what its machine 0 is asked to run is recorded."""

    def __init__(self, endpoint):
        super().__init__(2)
        self.storage_endpoint = endpoint
        self.started = []

    def popen(self, machine, argv, env=None, **kwargs):
        self.started.append((machine, list(argv), dict(env or {})))
        return SimpleNamespace(communicate=lambda timeout: ("", None))


def test_the_drain_inside_machine_0_gets_the_storage_endpoint_as_the_workers_do(tmp_path):
    cluster = _Cluster(ENDPOINT)
    persist_emulated(cluster, "10.213.0.1:29400", "job", tmp_path / "secret", "storage://gemini")
    (machine, argv, env), = cluster.started
    assert machine == 0 and argv[argv.index("--dir") + 1] == "storage://gemini"
    assert env == {SECRET_ENV: str(tmp_path / "secret"), **ENDPOINT.env()}
    assert ENDPOINT.password not in " ".join(argv)  # never on a command line
    without = _Cluster(None)
    persist_emulated(without, "10.213.0.1:29400", "job", tmp_path / "secret", tmp_path / "checkpoints")
    (_, argv, env), = without.started
    assert argv[argv.index("--dir") + 1] == str(tmp_path / "checkpoints") and env == {SECRET_ENV: str(tmp_path / "secret")}


def _payload(rank, world, step, model, optimizer):
    """Rank ``rank``'s in-memory version as Gemini sends it (the rank-shared state on every rank)."""
    local = {"rank": rank, "world_size": world, "global_step": step, "rng": capture_rng(),
             "data": DataPosition(0, step, 10, step * 4 * world).to_dict(), "sync": {}}
    shared = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": step}
    return {"format": PAYLOAD_FORMAT, "local": local, "shared": shared}


class _Job:
    """What the drain reads of a job: its store (committed manifest, agents' addresses) and two holders'
    replicas, served by a stand-in for the agent client (the MAC check is the drain's own)."""

    def __init__(self, monkeypatch, step=6, world=2):
        model = nn.Linear(4, 3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        self.model, self.step = model, step
        self.auth = JobKeys(b"s" * 32, "job")
        self.keys = SimpleNamespace(incarnation="incarnation", alive="alive", agent=lambda m: f"agent{m}")
        self.payloads = [_payload(r, world, step, model, optimizer) for r in range(world)]
        data = [to_bytes(p) for p in self.payloads]
        shards = tuple(ShardRecord(r, f"memory:rank{r}", len(d), checksum(d, "hmac-sha256", self.auth.replica))
                       for r, d in enumerate(data))
        self._manifest = Manifest(step=step, world_size=world, shards=shards, batch=step, tier="memory",
                                  placement={"incarnation": 1, "machines": 2, "holders": {"0": [0, 1], "1": [1, 0]}})
        self.held = {(f"m{m}", r): bytearray(d) for m in range(2) for r, d in enumerate(data)}
        held = self.held

        class Client:
            def __init__(self, address, auth, incarnation, timeout_s):
                self.address = address

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def get(self, step, rank, max_bytes):
                return bytearray(held[(self.address, rank)])

        monkeypatch.setattr(drain, "AgentClient", Client)

    def manifest(self):
        return self._manifest

    def get(self, key, default=None):
        return {"incarnation": 1, "alive": [0, 1], "agent0": "m0", "agent1": "m1"}.get(key, default)


def test_the_drain_writes_a_verified_version_to_a_directory_given_as_a_string(tmp_path, monkeypatch):
    """As the launcher now hands it over (a path or a storage:// name, as a string); the replicas' MACs
    checked before writing: a corrupt copy is passed over for an intact one."""
    job = _Job(monkeypatch)
    forged = {**job.payloads[1], "local": {**job.payloads[1]["local"], "data": DataPosition(0, 5, 10, 40).to_dict()}}
    job.held[("m1", 1)] = bytearray(to_bytes(forged))  # rank 1's first holder: a well-formed copy, not the one sent
    assert len(job.held[("m1", 1)]) == job.manifest().shard(1).bytes  # only its MAC tells it apart
    drained = drain.persist_committed(job, str(tmp_path / "checkpoints"))
    assert drained.why == "" and drained.path == tmp_path / "checkpoints" / "step_000000006.manifest.json"
    for rank in range(2):
        loaded = load_version(drained.path, rank=rank)
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in job.model.state_dict().items())
        assert loaded[RANK_STATE_KEY]["rank"] == rank
        assert loaded[RANK_STATE_KEY]["data"] == job.payloads[rank]["local"]["data"]  # the MAC chose the copy
    again = drain.persist_committed(job, str(tmp_path / "checkpoints"))
    assert again.path == drained.path and "already holds step 6" in again.why


def test_the_drain_writes_nothing_when_a_rank_has_no_intact_replica(tmp_path, monkeypatch, capsys):
    job = _Job(monkeypatch)
    for machine in ("m0", "m1"):
        job.held[(machine, 1)][10] ^= 0x01  # rank 0's is fine: the version's directory is begun, then dropped
    drained = drain.drain_and_report(job, str(tmp_path / "checkpoints"))
    assert drained.path is None and "rank 1 has no intact replica of step 6" in drained.why
    assert "fails its MAC" in capsys.readouterr().out
    assert manifest_names(tmp_path / "checkpoints") == []  # nothing committed
    assert not list((tmp_path / "checkpoints").glob("step_*"))  # and nothing left of the attempt


# -- resume ---------------------------------------------------------------------------------------------------
def test_resume_reads_the_storage_machines_newest_version_by_its_storage_name(monkeypatch):
    """The directory and the version go to the disk tier's reader as storage:// names, unmangled."""
    checkpointer = GeminiCheckpointer(replicas=1, persist_every=3, persist_dir="storage://run/g")
    newest = "storage://run/g/step_000000009.manifest.json"
    asked = []
    monkeypatch.setattr(recovery, "find_resumable", lambda directory, world, set_aside: asked.append(directory) or newest)
    monkeypatch.setattr(recovery, "load_version", lambda path, rank, bps, world: {"from": path, "bps": bps})
    assert checkpointer._persistent_path(2) == newest and asked == ["storage://run/g"]
    assert checkpointer.load_path(newest) == {"from": newest, "bps": None}
    assert checkpointer.recovery["source"] == "persistent"


# -- end to end, on an emulated cluster with a storage machine ------------------------------------------------
REASON = cluster_unavailable() or storage.unavailable_reason()
CNN = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=192",
       "model.optimizer=sgd", "model.momentum=0.9", "cluster=emulated", "cluster.nodes=2", "cluster.dilation=1",
       "trainer.devices=1"]


@pytest.mark.e2e
@pytest.mark.slow  # three emulated-cluster runs, about a minute on 2 cores
@pytest.mark.skipif(REASON is not None, reason=f"storage machine unavailable: {REASON}")
def test_gemini_drains_persists_and_resumes_through_the_storage_machine(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from ckpt_runs import assert_continues, summary, train

    root = tmp_path / "store"
    on_store = ["ckpt=gemini", "ckpt.profile_steps=2", "cluster.storage.bandwidth=200mbit",
                f"cluster.storage.root={root}"]
    train(*CNN, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'straight'}")
    # No periodic versions: the launch's last committed one reaches the store through the drain on machine 0.
    first = train(*CNN, *on_store, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'first'}")
    assert "committed step 4 written to storage://gemini/step_000000004.manifest.json" in first.stdout, first.stdout
    assert summary(tmp_path / "first")["ckpt_persist_dir"] == "storage://gemini"
    drained = json.loads((root / "gemini" / "step_000000004.manifest.json").read_text())
    assert (drained["layout"], drained["world_size"]) == ("dcp", 2)
    assert all((root / "gemini" / s["file"]).stat().st_size == s["bytes"] for s in drained["shards"])
    # Another run directory on the same store: nothing committed in memory, so it resumes from the store's
    # version, and writes its periodic versions there (keeping 2: the drained one goes).
    second = train(*CNN, *on_store, "trainer.max_steps=8", "ckpt.persist_every=2", f"hydra.run.dir={tmp_path / 'resumed'}")
    resumed = summary(tmp_path / "resumed")
    assert resumed["ckpt_resumed_step"] == 4 and resumed["ckpt_recovery_sources"] == ["persistent", "persistent"]
    assert resumed["ckpt_persistent_count"] == 2 and resumed["storage_root"] == str(root)
    assert sorted(p.name for p in (root / "gemini").glob("*.manifest.json")) == [
        "step_000000006.manifest.json", "step_000000008.manifest.json"]
    assert "already holds step 8" in second.stdout, second.stdout
    assert_continues(tmp_path / "straight", tmp_path / "resumed", from_step=4)
    # The store's credentials stay in the processes' environment: nowhere in what the runs left or said.
    for run in ("first", "resumed"):
        for path in (tmp_path / run).rglob("*"):
            if path.is_file():
                assert PASSWORD_ENV not in path.read_text(errors="replace"), path
    assert "PASSWORD" not in first.stdout + first.stderr + second.stdout + second.stderr

