"""ckpt.store=etcd: the job's keys in etcd members on loopback (started here, data in a temporary
directory): signed values, unsigned and forged ones refused, compare-and-set, waits, a member lost
under a client, torchrun's rendezvous on every member, and the refusal when etcd is not installed."""

import datetime
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.agent import Agent
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.cluster.control_plane import EtcdAddress, EtcdKeyValue, EtcdMembers, Member, missing
from ddlscale.cluster.local import free_port
from ddlscale.paths import CONF_DIR

REASON = missing(server=True)
if REASON:
    print(f"\ntest_etcd_store skipped: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"etcd unavailable: {REASON}")
ROOT = str(Path(__file__).resolve().parents[3])


def _members(directory, n: int) -> EtcdMembers:
    members = [Member(f"m{i}", "127.0.0.1", free_port(), free_port()) for i in range(n)]
    return EtcdMembers(members, directory, lambda _, argv, **kw: __import__("subprocess").Popen(argv, **kw),
                       "test").start()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    members = _members(tmp_path_factory.mktemp("etcd"), 1)
    yield members
    members.stop()


@pytest.fixture
def store(etcd, request):
    job = request.node.name[:40]  # a job per test: no keys shared between tests
    return kvstore.JobStore(kvstore.connect(str(etcd.address)), job, JobKeys(b"s" * 32, job))


@pytest.mark.multiprocess
def test_signed_values_round_trip_and_are_stored_signed(store):
    store.set(store.keys.incarnation, 3)
    assert store.get(store.keys.incarnation) == 3
    raw = store.raw.get(store.keys.incarnation).decode()
    mac, _, value = raw.partition(".")
    assert value == "3" and len(mac) == 64  # what etcd holds: HMAC-SHA256 hex, then the JSON
    assert store.refused == 0


@pytest.mark.multiprocess
def test_unsigned_and_forged_values_read_as_absent_and_are_counted(store):
    store.raw.set(store.keys.manifest, '{"step": 99}')  # no signature at all
    other = kvstore.JobStore(store.raw, store.keys.prefix.split("/", 1)[1], JobKeys(b"x" * 32, "other"))
    other.set(store.keys.incarnation, 7)  # signed, with another job's key
    store.raw.set(store.keys.root, store.signed(store.keys.alive, 0))  # this job's key, another key's name
    with pytest.warns(UserWarning, match="not signed"):
        assert store.manifest() is None
        assert store.get(store.keys.incarnation, "absent") == "absent"
        assert store.get(store.keys.root) is None
    assert store.refused == 3


@pytest.mark.multiprocess
def test_compare_set_sets_only_over_the_expected_value(store):
    kv, key = store.raw, store.keys.root
    assert kv.compare_set(key, "", "a") == b"a"  # absent: set
    assert kv.compare_set(key, "", "b") == b"a"  # present: not created again
    assert kv.compare_set(key, "x", "b") == b"a"  # not the expected value: unchanged
    assert kv.compare_set(key, "a", "b") == b"b"
    assert kv.get(key) == b"b"
    assert kv.delete_key(key) and not kv.check([key]) and not kv.delete_key(key)


@pytest.mark.multiprocess
def test_wait_wakes_on_the_key_and_times_out_without_it(store):
    kv, key = store.raw, store.keys.outcome(1, 5)
    started = time.monotonic()  # before the timer: a busy host may run the timer before the next line
    threading.Timer(0.3, kv.set, args=(key, "late")).start()
    kv.wait([key], datetime.timedelta(seconds=10))
    assert kv.check([key])  # it returned because the key is there, not before
    assert 0.2 < time.monotonic() - started < 5
    assert store.wait_all([key], 1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        kv.wait([store.keys.outcome(1, 6)], datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 3


@pytest.mark.multiprocess
def test_an_agent_registers_heartbeats_and_takes_the_root_role_on_etcd(etcd, store):
    agent = Agent(0, 1, "127.0.0.1:0", str(etcd.address), store.keys.prefix.split("/", 1)[1], store.auth,
                  heartbeat_s=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while not agent.is_root and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.is_root
        assert store.get(store.keys.agent(0)) == agent.address
        assert store.get(store.keys.root) == 0 and store.get(store.keys.heartbeat(0)) >= 1
    finally:
        agent.stop()


@pytest.mark.multiprocess
@pytest.mark.slow  # about 11 s: three members, then an election when the killed one led
def test_a_lost_member_loses_nothing(tmp_path):
    members = _members(tmp_path, 3)
    try:
        kv = EtcdKeyValue(members.address, timeout_s=20)
        kv.set("k/a", "1")
        used = kv.client.base_uri  # the member this client talks to: kill that one
        i = next(i for i, m in enumerate(members.members) if m.client_url == used)
        members.processes[i].kill()
        members.processes[i].wait()
        kv.set("k/b", "2")
        assert kv.get("k/a") == b"1" and kv.get("k/b") == b"2"
        assert kv.compare_set("k/a", "1", "3") == b"3"
        assert kv.client.base_uri != used
    finally:
        members.stop()


def _leader(members, alive) -> int | None:
    """The member that says it leads (etcd's v2 self statistics), among ``alive``."""
    import json
    import urllib.request

    for i in alive:
        try:
            with urllib.request.urlopen(f"{members.members[i].client_url}/v2/stats/self", timeout=2) as reply:
                if json.load(reply).get("state") == "StateLeader":
                    return i
        except OSError:
            continue
    return None


@pytest.mark.slow  # an election follows: about 10 s
def test_killing_the_leader_on_purpose_loses_nothing(tmp_path):
    members = _members(tmp_path, 3)
    try:
        kv = EtcdKeyValue(members.address, timeout_s=20)
        kv.set("k/a", "1")
        leader = _leader(members, range(3))
        assert leader is not None
        members.processes[leader].kill()
        members.processes[leader].wait()
        kv.set("k/b", "2")  # needs a new leader: the two survivors elect one
        assert kv.get("k/a") == b"1" and kv.get("k/b") == b"2"
        assert kv.compare_set("k/a", "1", "3") == b"3"
        survivors = [i for i in range(3) if i != leader]
        deadline = time.monotonic() + 20
        while (new := _leader(members, survivors)) is None:
            assert time.monotonic() < deadline, "no new leader"
            time.sleep(0.2)
        assert new != leader
    finally:
        members.stop()


@pytest.mark.multiprocess
def test_torchrun_rendezvous_on_every_member_skips_one_that_is_down(etcd):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    live = etcd.address.rendezvous_endpoint
    params = RendezvousParameters("ddlscale-etcd", f"127.0.0.1:{free_port()},{live}", "rdzv-test", 1, 1,
                                  local_addr="127.0.0.1")
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    handler.shutdown()


def test_etcd_address_forms():
    address = EtcdAddress.parse("etcd+https://a:1,b:2?ca_cert=/ca&cert=/c&key=/k")
    assert address.endpoints == (("a", 1), ("b", 2)) and address.protocol == "https"
    assert EtcdAddress.parse(str(address)) == address
    for bad in ("etcd://a", "http://a:1", "etcd://a:1?user=x", "etcd://a:99999"):
        with pytest.raises(ValueError):
            EtcdAddress.parse(bad)


def _check(overrides):
    from ddlscale.trainer.app import check_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["ckpt=gemini", "trainer.devices=2", *overrides])
    check_config(cfg)


@pytest.mark.multiprocess
def test_without_etcd_the_run_is_refused_naming_the_key_and_the_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no etcd binary on it
    from ddlscale.trainer.app import ConfigError

    with pytest.raises(ConfigError, match=r"ckpt.store=etcd.*apt-get install -y etcd-server"):
        _check(["ckpt.store=etcd"])
    with pytest.raises(ConfigError, match="ckpt.store"):
        _check(["ckpt.store=etcd://nohost"])
