"""Time dilation: the clock every figure uses, the CPU caps, and how cluster.dilation=auto picks k."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ddlscale import clock
from ddlscale.cluster import cpucap, dilation
from ddlscale.cluster.emulated import EmulatedCluster, list_namespaces, unavailable_reason
from ddlscale.paths import CONF_DIR
from ddlscale.trainer import app

ROOT = Path(__file__).resolve().parents[2]
REASON = unavailable_reason()
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")


# -- the clock ---------------------------------------------------------------------------------------
def test_the_clock_divides_measured_time_and_multiplies_waits(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "perf_counter", lambda: 100.0)
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    monkeypatch.setattr(time, "sleep", slept.append)
    with clock.dilated(4):
        assert clock.dilation() == 4
        assert clock.now() == 25.0 and clock.timestamp() == 250.0
        clock.sleep(0.5)
        assert clock.wall(3) == 12 and clock.wall_timeout(3).total_seconds() == 12
    assert slept == [2.0]
    with clock.dilated(1):
        assert clock.now() == 100.0


@pytest.mark.multiprocess
def test_the_clock_reads_its_factor_from_the_launcher(tmp_path):
    code = "from ddlscale import clock; print(clock.dilation())"
    env = {"PATH": "/usr/bin:/bin", clock.ENV: "2.5"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.stdout.strip() == "2.5", out.stderr
    env[clock.ENV] = "0.5"
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode != 0 and "DDLSCALE_DILATION" in bad.stderr


@pytest.mark.parametrize("value", [0.5, 0, -1, "fast", True, float("nan"), float("inf")])
def test_a_dilation_below_one_or_not_a_number_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match="cluster.dilation"):
        dilation.parse(value)


def test_dilation_accepts_auto_and_numbers():
    assert dilation.parse("auto") == dilation.parse(" AUTO ") == "auto"
    assert dilation.parse(4) == 4.0 and dilation.parse("2.5") == 2.5


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["cluster=emulated", *overrides])


def test_a_bad_dilation_is_refused_before_any_worker_starts():
    with pytest.raises(app.ConfigError, match="cluster.dilation"):
        app.check_config(_cfg("cluster.dilation=0.5"))
    assert _cfg().cluster.dilation == "auto"


# -- the search behind auto ---------------------------------------------------------------------------
TARGET = dilation.round_target(0.0)  # 50 us: links with no added delay


def _probe(ratios, rounds_us=None):
    asked = []

    def probe(k):
        asked.append(k)
        return {"sockets": ratios[k], "gloo": 1.5, "round_s": (rounds_us or {}).get(k, 20.0) * 1e-6}

    return probe, asked


def test_auto_stops_where_the_exchange_is_near_its_wire_time():
    probe, asked = _probe({1.0: 1.04})
    k, tried, why = dilation.search(probe, 0.7, TARGET)
    assert (k, asked) == (1.0, [1.0]) and "wire time" in why
    assert tried == [{"k": 1.0, "ratio": 1.04, "round_us": 20.0, "gloo_ratio": 1.5}]


def test_auto_stops_where_slowing_further_buys_nothing():
    # The CPU share starts it at 4; doubling to 8 does not help: the rest is the network's own.
    probe, asked = _probe({4.0: 1.21, 8.0: 1.27})
    assert dilation.search(probe, 4, TARGET)[0] == 4.0 and asked == [4.0, 8.0]
    # While doubling still helps, it goes on.
    probe, asked = _probe({4.0: 1.68, 8.0: 1.40, 16.0: 1.30})
    assert dilation.search(probe, 3.2, TARGET)[0] == 8.0 and asked == [4.0, 8.0, 16.0]


def test_auto_slows_further_while_a_round_costs_more_than_the_links_delay_allows():
    # Bytes are at their wire time from k = 4, but a round of small messages costs the host's 90 us
    # there: k doubles until the round is within the target (50 us here), or doubling stops helping.
    probe, asked = _probe({4.0: 1.1, 8.0: 1.1, 16.0: 1.1}, {4.0: 90, 8.0: 60, 16.0: 45})
    k, tried, why = dilation.search(probe, 4, TARGET)
    assert k == 16.0 and asked == [4.0, 8.0, 16.0] and "rounds within 50 us" in why
    probe, asked = _probe({4.0: 1.1, 8.0: 1.1, 16.0: 1.1}, {4.0: 90, 8.0: 85, 16.0: 80})
    assert dilation.search(probe, 4, TARGET)[0] == 4.0 and asked == [4.0, 8.0]
    assert dilation.round_target(100e-6) == pytest.approx(150e-6) and dilation.round_target(1e-3) == pytest.approx(1.25e-3)


def test_auto_never_exceeds_its_cap():
    probe, asked = _probe({k: 1 + 64 / k for k in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)})
    k, _, why = dilation.search(probe, 1, TARGET)
    assert k == dilation.MAX_DILATION and asked[-1] == dilation.MAX_DILATION and "largest" in why


def test_auto_probes_once_per_host_and_shape_then_reads_its_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(dilation.CACHE_ENV, str(tmp_path))
    probes = []

    def fake_probe(machines, ranks, bandwidth, latency, start, log):
        probes.append((machines, ranks, bandwidth))
        return 4.0, [{"k": 4.0, "ratio": 1.2}, {"k": 8.0, "ratio": 1.22}], "the network's own"

    monkeypatch.setattr(dilation, "probe_cluster", fake_probe)
    first = dilation.choose("auto", 8, 1, 1e9, 0.0, log=lambda _: None)
    again = dilation.choose("auto", 8, 1, 1e9, 0.0)
    other = dilation.choose("auto", 8, 1, 1e8, 0.0, log=lambda _: None)
    assert probes == [(8, 1, 1e9), (8, 1, 1e8)]
    assert first.k == again.k == 4.0 and first.cached is None and str(tmp_path) in again.cached
    assert other.k == 4.0
    assert "k=4" in again.describe() and "1.20x at k=4" in again.describe() and "the network's own" in again.describe()
    assert dilation.choose(2.0, 8, 1, 1e9, 0.0).how == "configured"
    assert dilation.choose("auto", 8, 1, 1e9, 0.0, fresh=True, log=lambda _: None).cached is None
    assert len(probes) == 3
    assert json.loads((tmp_path / "dilation.json").read_text())


def test_the_cpu_share_needs_a_core_per_rank():
    assert dilation.cpu_share(8, 1, 2) == 4 and dilation.cpu_share(2, 1, 2) == 1 and dilation.cpu_share(1, 1, 8) == 1


# -- CPU caps ---------------------------------------------------------------------------------------
def _fake_cgroups(tmp_path, version):
    root = tmp_path / "cg"
    root.mkdir()
    mounts = tmp_path / "mounts"
    if version == 1:
        mounts.write_text(f"cgroup {root} cgroup rw,relatime,cpu 0 0\n")
    else:
        (root / "cgroup.controllers").write_text("cpuset cpu io memory\n")
        (root / "cgroup.subtree_control").write_text("\n")
        (root / "ddlscale").mkdir()  # in a real cgroup2 tree the kernel makes a child's control files
        (root / "ddlscale" / "cgroup.subtree_control").write_text("")
        mounts.write_text(f"cgroup2 {root} cgroup2 rw 0 0\n")
    return root, mounts


@pytest.mark.parametrize("version", [1, 2])
def test_cpu_shares_weigh_each_machine_by_its_ranks_with_no_quota_in_either_cgroup_version(tmp_path, version, monkeypatch):
    root, mounts = _fake_cgroups(tmp_path, version)
    controller = cpucap.find_controller(mounts)
    assert controller.root == root and controller.version == version
    started = []
    monkeypatch.setattr(cpucap.CpuShares, "_start_reserve", lambda self: started.append(self.k))
    shares = cpucap.CpuShares(controller, "ddltest", 2, 2, 4, cores=2)
    group = root / "ddlscale" / "ddltest-m1"
    if version == 1:
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "-1"  # nothing is ever throttled
        assert (group / "cpu.shares").read_text().strip() == "2048"  # two ranks
    else:
        assert (group / "cpu.max").read_text().strip() == "max"
        assert (group / "cpu.weight").read_text().strip() == "200"
        assert "+cpu" in (root / "cgroup.subtree_control").read_text()
    # 4 ranks on 2 cores at k = 4: each core holds 2 ranks and a reserve of 2, so a busy rank gets 1/4.
    reserve = root / "ddlscale" / "ddltest-rsv" / ("cpu.shares" if version == 1 else "cpu.weight")
    assert started == [4]
    assert int(reserve.read_text()) == round(cpucap.reserve_units(4, 4, 2) * (1024 if version == 1 else 100))
    wrapped = shares.wrap(1, ["ip", "netns", "exec", "x", "true"])
    assert wrapped[:2] == ["sh", "-c"] and str(group / "cgroup.procs") in wrapped and wrapped[-5] == "ip"
    # The clusters' parent outweighs a stray process on the host; a service of the cluster weighs one rank.
    parent_weight = (root / "ddlscale" / ("cpu.shares" if version == 1 else "cpu.weight")).read_text()
    assert int(parent_weight) == cpucap.PARENT_RANKS * (1024 if version == 1 else 100)
    served = shares.wrap_service("st", ["nginx"])
    service = root / "ddlscale" / "ddltest-st"
    assert str(service / "cgroup.procs") in served and served[-1] == "nginx"
    assert int((service / ("cpu.shares" if version == 1 else "cpu.weight")).read_text()) == (1024 if version == 1 else 100)


def test_the_reserve_leaves_each_busy_rank_one_kth_of_a_core():
    for k, ranks, cores in ((4, 8, 2), (8, 8, 2), (4, 2, 2), (4, 1, 2), (2, 16, 2)):
        per_core = cpucap.reserve_units(k, ranks, cores) / cores
        if ranks > cores * k:  # k below the CPU share: no reserve, the host is oversubscribed
            assert per_core == 0
        else:
            assert 1 / (max(1, ranks / cores) + per_core) == pytest.approx(1 / k)
    assert cpucap.reserve_units(1, 2, 2) == 0  # k = 1: nothing held back


def test_quota_mode_keeps_cfs_bandwidth_limits(tmp_path):
    root, mounts = _fake_cgroups(tmp_path, 1)
    controller = cpucap.find_controller(mounts)
    cpucap.CpuShares(controller, "ddltest", 2, 1, 4, mode="quota")
    group = root / "ddlscale" / "ddltest-m0"
    assert (group / "cpu.cfs_quota_us").read_text().strip() == "2500"
    assert (group / "cpu.cfs_period_us").read_text().strip() == "10000"
    shares = cpucap.CpuShares(controller, "ddltest", 2, 1, 32, mode="quota")  # the smallest quota is 1 ms
    assert shares.reserve == []
    quota, period = ((group / f).read_text() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    assert int(quota) >= cpucap.MIN_QUOTA_US and int(quota) / int(period) == pytest.approx(1 / 32, rel=0.01)
    with pytest.raises(ValueError, match="cluster.cpu"):
        cpucap.CpuShares(controller, "ddltest", 2, 1, 4, mode="caps")


def test_no_cgroup_controller_means_no_caps(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\n")
    assert cpucap.find_controller(mounts) is None


def test_a_dilated_link_runs_k_times_slower_with_k_times_the_delay(monkeypatch):
    from ddlscale.cluster import emulated

    commands = []
    monkeypatch.setattr(emulated, "_sh", lambda *argv: commands.append(" ".join(argv)))
    EmulatedCluster(2, "1gbit", "1ms", dilation=4)._shape("ns", "eth0")
    assert "netem delay 2000us" in commands[0]  # half the one-way delay on each of the two links
    assert "tbf rate 250000000bit" in commands[1] and "latency 400ms" in commands[1]
    EmulatedCluster(2, "1gbit", dilation=1)._shape("ns", "eth0")
    # The burst is the same bytes at every k: TCP's 64 KiB segments pass whole, as on the real NIC.
    assert "burst 125000 " in commands[1] and "burst 125000 " in commands[2]


def test_a_dilated_cluster_stretches_the_rendezvous_timeouts_by_k(monkeypatch):
    """torchrun's agents run capped: their rendezvous must wait k times longer, or at k = 8 it never completes."""
    from ddlscale.cluster import emulated

    launched = []
    monkeypatch.setattr(EmulatedCluster, "popen", lambda self, machine, argv, **kw: launched.append(argv))
    for k in (1, 8):
        EmulatedCluster(8, "1gbit", dilation=k).torchrun(0, ["model=cnn"])
    confs = [dict(item.split("=") for item in next(a for a in argv if a.startswith("--rdzv-conf="))
                  .removeprefix("--rdzv-conf=").split(",")) for argv in launched]
    assert confs[0]["is_host"] == confs[1]["is_host"] == "false"
    for name, seconds in emulated.RENDEZVOUS_SECONDS.items():
        assert int(confs[0][name]) == seconds and int(confs[1][name]) == 8 * seconds


@pytest.mark.multiprocess
@needs_namespaces
def test_a_dilated_cluster_shapes_its_links_slower_and_shares_its_machines_cpu():
    with EmulatedCluster(2, "100mbit", dilation=4) as cluster:
        for ns, dev in ((cluster.namespace(1), "eth0"), (cluster.switch, "v1")):
            shaping = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                     capture_output=True, text=True).stdout
            assert "rate 25Mbit" in shaping
        code = ("import os; from ddlscale import clock; print(clock.dilation(), open('/proc/self/cgroup').read()); "
                "x = sum(range(3_000_000))")
        ledger = cluster.cpu_ledger()
        ledger.start()
        shown = cluster.popen(1, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        out = shown.communicate(timeout=60)[0]
        load = ledger.finish()
        assert out.startswith("4.0")
        if cluster.cpu_shares is not None:
            assert f"{cluster.name}-m1" in out and "weight" in cluster.cpu_cap()
            assert len(cluster.cpu_shares.reserve) == os.cpu_count()  # k = 4 leaves the host spare cores
            groups = list(cluster.cpu_shares.groups)
            reserve = [p.pid for p in cluster.cpu_shares.reserve]
            if load["accounted"]:  # machine 1 computed, machine 0 did nothing
                assert load["machines"][1]["cpu_s"] > 0.05 and load["machines"][0]["cpu_s"] < 0.05
        else:
            assert "not slowed" in cluster.cpu_cap()
            groups, reserve = [], []
    assert list_namespaces(cluster.name) == [] and not any(g.exists() for g in groups)
    assert not any(Path(f"/proc/{pid}").exists() for pid in reserve)


@pytest.mark.slow  # ~35 s: a whole dilated training run
@pytest.mark.e2e
@needs_namespaces
def test_train_on_a_dilated_cluster_reports_emulated_time(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "cluster=emulated", "cluster.nodes=2", "cluster.dilation=2",
         "trainer.devices=1", "trainer.max_steps=4", "trainer.enable_progress_bar=false", "model=cnn",
         f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dilation"] == 2 and summary["dilation_choice"]["how"] == "configured"
    assert "time dilation k=2 (configured)" in result.stdout and "wall time / 2" in result.stdout
    assert summary["cpu_cap"]


@pytest.mark.slow
@needs_namespaces
def test_the_probe_times_a_many_to_many_exchange_on_the_cluster():
    k, tried, why = dilation.probe_cluster(2, 1, 1e8, 0.0, 1.0, log=lambda _: None)
    assert k >= 1 and tried[0]["k"] == 1 and tried[0]["ratio"] > 0.9 and tried[0]["gloo_ratio"] > 0.9 and why


def _cpu_cgroup() -> str:
    return next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":cpu:" in line
                 or line.startswith("0::")), "")


@pytest.mark.slow  # ~25 s
@pytest.mark.multiprocess
@pytest.mark.skipif(cpucap.find_controller() is None, reason="no writable cgroup CPU controller")
def test_one_machine_dilated_in_place_caps_this_process_and_its_children_then_lets_go():
    before = _cpu_cgroup()
    with dilation.dilated_here(4, 1) as cap:
        assert "1/4 core" in cap and clock.dilation() == 4
        child = subprocess.run([sys.executable, "-c", "from ddlscale import clock; print(clock.dilation())"],
                               capture_output=True, text=True, cwd=ROOT)
        assert child.stdout.strip() == "4.0"
        inside = _cpu_cgroup()
        assert inside != before and inside.startswith("/ddlscale/ddlh")
    assert _cpu_cgroup() == before and clock.dilation() == 1 and clock.ENV not in __import__("os").environ
    assert not (cpucap.find_controller().root / inside.lstrip("/")).exists()
