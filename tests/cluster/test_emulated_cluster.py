"""The emulated cluster: links are shaped, machines fail on demand, nothing is left behind."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ddlscale.cluster.emulated import EmulatedCluster, list_namespaces, unavailable_reason
from ddlscale.paths import CONF_DIR
from ddlscale.trainer import app

ROOT = Path(__file__).resolve().parents[2]
REASON = unavailable_reason()
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")


@pytest.mark.multiprocess
@needs_namespaces
def test_machines_talk_over_shaped_links_and_down_removes_everything():
    with EmulatedCluster(2, "100mbit") as cluster:
        assert set(cluster.namespaces) <= set(list_namespaces(cluster.name))
        for ns, dev in ((cluster.namespace(1), "eth0"), (cluster.switch, "v1")):  # upload and download
            shaping = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                     capture_output=True, text=True).stdout
            assert "rate 100Mbit" in shaping
        server = cluster.popen(0, [sys.executable, "-c", (
            "import socket\ns = socket.socket(); s.bind(('10.213.0.1', 5001)); s.listen()\n"
            "c, _ = s.accept(); n = 0\nwhile (b := c.recv(1 << 16)): n += len(b)\nprint(n)")],
            stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        client = cluster.popen(1, [sys.executable, "-c", (
            "import socket, time\ns = socket.socket()\n"
            "for _ in range(50):\n    try: s.connect(('10.213.0.1', 5001)); break\n"
            "    except OSError: time.sleep(0.1)\ns.sendall(b'x' * 2_000_000); s.close()")])
        assert client.wait(timeout=60) == 0
        assert server.communicate(timeout=60)[0].strip() == "2000000"
    assert list_namespaces(cluster.name) == []


@pytest.mark.multiprocess
@needs_namespaces
def test_latency_needs_netem_or_is_refused_clearly():
    cluster = EmulatedCluster(2, "1gbit", "1ms")
    try:
        cluster.up()
    except RuntimeError as exc:
        assert "cluster.latency" in str(exc) and "netem" in str(exc)
    else:
        shaping = subprocess.run(["ip", "netns", "exec", cluster.namespace(0), "tc", "qdisc", "show", "dev", "eth0"],
                                 capture_output=True, text=True).stdout
        assert "delay 1ms" in shaping
    finally:
        cluster.down()
    assert list_namespaces(cluster.name) == []


@needs_namespaces
def test_kill_machine_kills_only_that_machine():
    with EmulatedCluster(2, "1gbit") as cluster:
        sleepers = [cluster.popen(i, ["sleep", "60"]) for i in range(2)]
        time.sleep(0.3)
        cluster.kill_machine(1)
        assert sleepers[1].wait(timeout=10) == -signal.SIGKILL
        assert sleepers[0].poll() is None
    assert sleepers[0].wait(timeout=10) != 0  # down() killed the rest


_OWNER = """
import sys, time
from ddlscale.cluster.emulated import EmulatedCluster
cluster = EmulatedCluster(2, "1gbit").up()
print(cluster.name, flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("crash")
time.sleep(60)
"""


@pytest.mark.multiprocess
@needs_namespaces
@pytest.mark.parametrize("how", ["raise", "sigterm", pytest.param("sigint", marks=pytest.mark.slow)])  # sigint: as sigterm
def test_teardown_on_crash_sigterm_and_ctrl_c(how):
    # A background job inherits SIGINT ignored (as under CI); an interactive owner would not.
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    name = owner.stdout.readline().strip()
    assert name.startswith("ddl")
    if how != "raise":
        assert list_namespaces(name)
        owner.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
    owner.wait(timeout=120)  # the teardown's ip/tc/cgroup commands: tens of seconds on a busy host
    assert list_namespaces(name) == [], f"{how} left namespaces behind"


@pytest.mark.e2e
@needs_namespaces
def test_train_on_emulated_cluster(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "cluster=emulated", "cluster.nodes=2", "cluster.bandwidth=1gbit",
         "cluster.dilation=1", "trainer.devices=1", "trainer.max_steps=5", "trainer.enable_progress_bar=false", f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster"] == "emulated" and summary["world_size"] == 2 and summary["cluster_nodes"] == 2
    assert summary["dilation"] == 1 and "by weight" in summary["cpu_cap"] and "reserve" not in summary["cpu_cap"]
    load = summary["cpu_load"]  # what each machine received of its share, and what else ran on the host
    assert len(load["machines"]) == 2 and summary["starved"] == load["starved"]
    if load["accounted"]:
        assert all(m["cpu_s"] > 0 for m in load["machines"])
    payload_bps = 1e9 * 1448 / 1514  # TCP payload per Ethernet frame
    assert summary["wire_time_per_step_s"] == pytest.approx(summary["bytes_sent_per_step"] * 8 / payload_bps)
    projected = summary["projected_step_time_s"]
    assert list(projected) == ["16", "32", "64", "128", "256", "512", "1024"]
    assert all(a <= b for a, b in zip(list(projected.values())[:-1], list(projected.values())[1:], strict=True))
    assert "projected step time" in result.stdout
    assert "emulated cluster ddl" in result.stdout


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["cluster=emulated", *overrides])


def test_refusal_when_namespaces_are_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(app, "unavailable_reason", lambda: "network namespaces need root")
    with pytest.raises(app.ConfigError, match="need root"):
        app.run(_cfg("cluster.fallback=error"), tmp_path)


def test_loopback_fallback_is_announced_and_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr(app, "unavailable_reason", lambda: "network namespaces need root")
    cfg = _cfg("trainer.devices=1", "trainer.max_steps=2", "trainer.enable_progress_bar=false", "model=cnn")
    with pytest.warns(UserWarning, match="NO bandwidth limit"):
        summary = app.run(cfg, tmp_path, {"cluster": "emulated"})
    assert summary["world_size"] == 2  # nodes x devices workers on loopback
    assert summary["cluster"].startswith("emulated-fallback-loopback")
