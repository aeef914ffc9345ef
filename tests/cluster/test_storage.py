"""The emulated cluster's storage machine: shaped, authenticated, gone with the cluster; the persistent
tier writes through it and restores bit-identically, and a tampered object fails verification."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddlscale.cluster import storage
from ddlscale.cluster.emulated import EmulatedCluster, list_namespaces, unavailable_reason
from ddlscale.cluster.storage_client import StorageEndpoint
from ddlscale.paths import CONF_DIR

ROOT = Path(__file__).resolve().parents[2]
REASON = unavailable_reason() or storage.unavailable_reason()
needs_storage = pytest.mark.skipif(REASON is not None, reason=f"storage machine unavailable: {REASON}")


def _on_machine(cluster, code, env=None, timeout=120):
    """Run ``code`` on machine 0 (its NIC, the storage link); its last stdout line as JSON."""
    env = {**cluster.storage_endpoint.env(), **(env or {})}
    proc = cluster.popen(0, [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _qdisc(ns, dev):
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], capture_output=True,
                          text=True).stdout


@pytest.mark.multiprocess
@needs_storage
def test_storage_machine_is_shaped_at_bandwidth_over_k_and_goes_with_the_cluster(tmp_path):
    with EmulatedCluster(2, "1gbit", dilation=2, cap_cpus=False, storage_bandwidth="100mbit",
                         storage_root=tmp_path) as cluster:
        st = cluster.storage
        assert {st.namespace, cluster.switch} <= set(list_namespaces(cluster.name))
        assert "rate 50Mbit" in _qdisc(st.namespace, "eth0") and "rate 50Mbit" in _qdisc(cluster.switch, "vst")
        assert "rate 500Mbit" in _qdisc(cluster.namespace(0), "eth0")  # the machines keep their own NICs
        assert st.server.poll() is None and (st.config_dir / "htpasswd").exists()
        assert list(_pids_with(str(st.config_dir)))  # the server, found by its config
        assert cluster.storage_endpoint.password not in (st.config_dir / "htpasswd").read_text()
        assert "password=<hidden>" in repr(cluster.storage_endpoint)
        cluster.set_dilation(4)
        assert "rate 25Mbit" in _qdisc(st.namespace, "eth0")
        server, config = st.server, st.config_dir
    assert list_namespaces(cluster.name) == []
    assert server.poll() is not None and not config.exists()
    assert not [pid for pid in _pids_with(str(config))], "a storage server process outlived its cluster"


def _pids_with(text):
    """Processes whose command line mentions ``text`` (nginx's master and worker name their config)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                yield int(entry.name)
        except OSError:
            continue


_CREDENTIALS = """
import json, os
from ddlscale.cluster.storage_client import PutStream, StorageEndpoint, as_oserror
good = StorageEndpoint.from_env()
outcome = {}
for label, endpoint in (("wrong", StorageEndpoint(good.url, good.user, "not-" + good.password)),
                        ("none", StorageEndpoint(good.url, "", "")), ("right", good)):
    fs = endpoint.filesystem()
    try:
        with PutStream(fs, label) as stream:
            stream.write(b"x" * 100000)
        with as_oserror(label):
            fs.ls("", detail=False)
        outcome[label] = "ok"
    except PermissionError as exc:
        outcome[label] = "refused: " + str(exc)
fs = good.filesystem()
stream = PutStream(fs, "half")  # an object is seen whole or not at all: never while it is being sent
stream.write(b"y" * 3_000_000)
outcome["seen_mid_put"] = fs.exists("half")
stream.close()
outcome["seen_after"] = fs.exists("half") and fs.cat_file("half") == b"y" * 3_000_000
try:
    with PutStream(fs, "aborted") as stream:
        stream.write(b"z" * 3_000_000)
        raise RuntimeError("the writer failed")
except RuntimeError:
    pass
outcome["aborted_kept"] = fs.exists("aborted")
print(json.dumps(outcome))
"""


@pytest.mark.multiprocess
@needs_storage
def test_wrong_credentials_are_refused_and_objects_appear_whole_or_not_at_all(tmp_path):
    with EmulatedCluster(1, "1gbit", storage_bandwidth="1gbit", storage_root=tmp_path) as cluster:
        outcome = _on_machine(cluster, _CREDENTIALS)
        assert outcome["right"] == "ok" and (tmp_path / "right").read_bytes() == b"x" * 100000
        assert not outcome["seen_mid_put"] and outcome["seen_after"] and not outcome["aborted_kept"]
        for label in ("wrong", "none"):
            assert outcome[label].startswith("refused") and "401" in outcome[label]
            assert not (tmp_path / label).exists()
        other = EmulatedCluster(1, "1gbit", storage_bandwidth="1gbit", storage_root=tmp_path / "other")
        with other:  # a second cluster draws its own credentials
            assert other.storage_endpoint.password != cluster.storage_endpoint.password


_TRAIN = """
import json, sys
sys.path[:0] = ["tests", "tests/ckpt/disk"]
import pytorch_lightning as pl, torch
from test_ckpt_dcp import Regression  # the tier's own restore tests' model
from ddlscale.ckpt import DiskCheckpointer, load_version
from ddlscale.ckpt.version.manifest import list_manifests

pl.seed_everything(3, verbose=False)
model = Regression()
checkpointer = DiskCheckpointer(every=2, keep=1, dir="storage://run/ckpt")
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                     callbacks=[checkpointer], enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model)
(manifest,) = list_manifests(checkpointer._directory())
loaded = load_version(manifest, rank=0)
state = model.state_dict()
optimizer = trainer.optimizers[0].state_dict()["state"]
print(json.dumps({"manifest": manifest,
                  "model": all(torch.equal(loaded["state_dict"][k], v) for k, v in state.items()),
                  "optimizer": all(torch.equal(loaded["optimizer_states"][0]["state"][i][k], v)
                                   for i in optimizer for k, v in optimizer[i].items())}))
"""

_LOAD = """
import json, sys
from ddlscale.ckpt import DiskCheckpointer, load_version
from ddlscale.ckpt.version.manifest import ManifestError
try:
    load_version(sys.argv[1], rank=0)
    print(json.dumps({"loaded": True}))
except ManifestError as exc:
    print(json.dumps({"loaded": False, "error": str(exc),
                      "resume": DiskCheckpointer(dir="storage://run/ckpt", resume="auto").resume_path(1)}))
"""


@pytest.mark.multiprocess
@needs_storage
def test_a_checkpoint_through_the_storage_machine_restores_bit_identically_and_tampering_fails(tmp_path):
    with EmulatedCluster(1, "1gbit", storage_bandwidth="200mbit", storage_root=tmp_path) as cluster:
        written = _on_machine(cluster, _TRAIN)
        assert written["model"] and written["optimizer"], written
        manifest = written["manifest"]
        assert manifest == "storage://run/ckpt/step_000000004.manifest.json"
        on_host = tmp_path / "run" / "ckpt"  # what the server keeps: one version (keep=1), its manifest last
        assert sorted(p.name for p in on_host.iterdir()) == sorted(
            ["step_000000004.manifest.json", next(p.name for p in on_host.iterdir() if p.is_dir())])
        record = json.loads((on_host / "step_000000004.manifest.json").read_text())
        shard = on_host / record["shards"][0]["file"]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01  # one bit flipped on the store
        shard.write_bytes(bytes(data))
        code = _LOAD.replace("sys.argv[1]", repr(manifest))
        tampered = _on_machine(cluster, code)
        assert not tampered["loaded"] and "checksum mismatch" in tampered["error"]
        assert tampered["resume"] is None  # the only version fails: set aside, a fresh start
        assert (on_host / "step_000000004.manifest.json.rejected").exists()


def test_storage_config_is_checked_naming_the_key():
    assert storage.check_config(None) == (None, None)
    assert storage.check_config({"bandwidth": None, "root": None}) == (None, None)
    assert storage.check_config({"bandwidth": "2gbit", "root": "/x"}) == ("2gbit", "/x")
    for bad, key in (({"bandwidth": "fast"}, "cluster.storage.bandwidth"), ({"bandwidth": "0mbit"}, "bandwidth"),
                     ({"bandwith": "1gbit"}, "cluster.storage.bandwith"), ({"root": 3}, "cluster.storage.root"),
                     ("1gbit", "cluster.storage")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            storage.check_config(bad)


def test_endpoint_comes_from_the_environment_only_when_handed():
    assert StorageEndpoint.from_env({}) is None
    endpoint = StorageEndpoint("http://10.213.0.254:8080/", "u", "secret")
    assert StorageEndpoint.from_env(endpoint.env()) == endpoint and "secret" not in repr(endpoint)


CNN = ["model=cnn", "model.width=4", "model.num_blocks=2", "model.image_size=8", "model.num_samples=192",
       "model.optimizer=sgd", "model.momentum=0.9", "cluster=emulated", "cluster.nodes=2", "cluster.dilation=1",
       "trainer.devices=1"]


@pytest.mark.e2e
@pytest.mark.slow  # three emulated-cluster runs, ~1 min on 2 cores
@needs_storage
def test_train_py_checkpoints_to_the_storage_machine_and_resumes_bit_identically(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from ckpt_runs import assert_continues, summary, train

    root = tmp_path / "store"
    train(*CNN, "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'straight'}")
    stopped = train(*CNN, "trainer.max_steps=4", "ckpt=disk", "ckpt.every=2", "cluster.storage.bandwidth=200mbit",
                    f"cluster.storage.root={root}", f"hydra.run.dir={tmp_path / 'stopped'}")
    first = summary(tmp_path / "stopped")
    assert first["ckpt_dir"] == "storage://checkpoints" and first["ckpt_count"] == 2
    assert first["storage_bandwidth_bps"] == 200e6 and first["storage_root"] == str(root)
    assert sorted(p.name for p in (root / "checkpoints").glob("*.manifest.json")) == [
        "step_000000002.manifest.json", "step_000000004.manifest.json"]
    train(*CNN, "trainer.max_steps=8", "ckpt=disk", "ckpt.every=2", "ckpt.resume=auto",
          "cluster.storage.bandwidth=200mbit", f"cluster.storage.root={root}", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert_continues(tmp_path / "straight", tmp_path / "resumed", from_step=4, columns=("train_loss", "bytes_sent"))
    assert summary(tmp_path / "resumed")["ckpt_resumed_step"] == 4
    # Credentials stay in the workers' environment: nowhere in what the runs left.
    for run in ("stopped", "resumed"):
        for path in (tmp_path / run).rglob("*"):
            if path.is_file():
                assert "DDLSCALE_STORAGE_PASSWORD" not in path.read_text(errors="replace"), path
    assert "PASSWORD" not in stopped.stdout + stopped.stderr


def test_ckpt_dir_on_the_storage_machine_needs_one_and_no_bandwidth_pacing():
    from hydra import compose, initialize_config_dir

    from ddlscale.trainer import ConfigError, check_config

    def cfg(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=["ckpt=disk", *overrides])

    with pytest.raises(ConfigError, match=r"ckpt\.dir=storage://x.*cluster\.storage\.bandwidth"):
        check_config(cfg("ckpt.dir=storage://x"))
    with pytest.raises(ConfigError, match=r"ckpt\.bandwidth"):
        check_config(cfg("cluster=emulated", "cluster.storage.bandwidth=1gbit", "ckpt.bandwidth=100mbit"))
    with pytest.raises(ConfigError, match=r"cluster\.storage\.bandwidth"):
        check_config(cfg("cluster=emulated", "cluster.storage.bandwidth=fast"))
    check_config(cfg("cluster=emulated", "cluster.storage.bandwidth=1gbit"))
    check_config(cfg("cluster=emulated", "cluster.storage.bandwidth=1gbit", "ckpt.dir=storage://run7/ckpt"))
