"""A Gemini job's pieces for tests: its secret, its store, agents, authenticated clients."""

import socket

import pytest
import torch

from ddlscale.ckpt.gemini import kvstore
from ddlscale.ckpt.gemini.agent import Agent
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, create_secret_file, read_secret
from ddlscale.ckpt.gemini.protocol import AgentClient
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.rng import capture_rng
from ddlscale.ckpt.state.shard import PAYLOAD_FORMAT
from ddlscale.ckpt.state.snapshot import to_bytes
from ddlscale.ckpt.version.checksum import checksum
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord


def payload(rank: int, world: int, step: int) -> dict:
    """Rank ``rank``'s state after ``step`` as Gemini sends it (a model, its optimizer, RNG, data position):
    what the drain writes to disk and a restart restores."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    local = {"rank": rank, "world_size": world, "global_step": step, "rng": capture_rng(),
             "data": DataPosition(0, step, 1000, step * 4 * world).to_dict(), "sync": {}}
    shared = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": step}
    return {"format": PAYLOAD_FORMAT, "local": local, "shared": shared}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Job:
    """A secret, a TCPStore holding the job's signed keys, and the agents started on it."""

    def __init__(self, directory, name: str = "test") -> None:
        self.name = name
        self.secret = create_secret_file(directory)
        self.auth = JobKeys(read_secret(self.secret), name)
        self.address = f"127.0.0.1:{free_port()}"
        self.server = kvstore.serve(self.address)
        self.store = kvstore.JobStore(kvstore.connect(self.address), name, self.auth)
        self.keys = self.store.keys
        self.agents: list[Agent] = []

    def agent(self, machine: int = 0, machines: int = 1, **kwargs) -> Agent:
        started = Agent(machine, machines, "127.0.0.1:0", self.address, self.name, self.auth, **kwargs).start()
        self.agents.append(started)
        return started

    @property
    def incarnation(self) -> int:
        return int(self.store.get(self.keys.incarnation, 0))

    def client(self, agent: Agent, incarnation: int | None = None, cls=AgentClient) -> AgentClient:
        return cls(agent.address, self.auth, self.incarnation if incarnation is None else incarnation)

    def decide(self, version: int, outcome: str = "failed", incarnation: int | None = None) -> None:
        inc = self.incarnation if incarnation is None else incarnation
        self.store.set(self.keys.outcome(inc, version), outcome)

    def commit(self, version: int, nbytes: int = 1, world: int = 1) -> None:
        """Publish a manifest of ``version`` (as rank 0 would once every replica is verified)."""
        shards = tuple(ShardRecord(r, f"memory:rank{r}", nbytes, "hmac-sha256:0") for r in range(world))
        self.store.publish(Manifest(step=version, world_size=world, shards=shards, tier="memory",
                                    placement={"incarnation": self.incarnation, "machines": 1, "holders": {}}))
        self.decide(version, "committed")

    def put_version(self, step: int, holders: list[list[Agent]]) -> tuple[Manifest, list[bytes]]:
        """Rank r's state (:func:`payload`) of ``step`` to each agent of ``holders[r]`` as its trainer sends
        it (BEGIN, DATA, END), then the manifest published and the version decided, as rank 0 does."""
        world = len(holders)
        streams = [to_bytes(payload(rank, world, step)) for rank in range(world)]
        for rank, data in enumerate(streams):
            for agent in holders[rank]:
                with self.client(agent) as client:
                    client.begin(step, rank, len(data))
                    client.data(step, rank, 0, [memoryview(data)])
                    client.end(step, rank, checksum(data, "hmac-sha256", self.auth.replica))
        shards = tuple(ShardRecord(r, f"memory:rank{r}", len(d), checksum(d, "hmac-sha256", self.auth.replica))
                       for r, d in enumerate(streams))
        manifest = Manifest(step=step, world_size=world, shards=shards, batch=step, tier="memory",
                            placement={"incarnation": self.incarnation, "machines": len(self.agents),
                                       "holders": {str(r): [a.machine for a in h] for r, h in enumerate(holders)}})
        self.store.publish(manifest)
        self.decide(step, "committed")
        return manifest, streams

    def close(self) -> None:
        for agent in self.agents:
            if not agent.stopped.is_set():
                agent.stop()


@pytest.fixture
def job(tmp_path, monkeypatch):
    (tmp_path / "job").mkdir(mode=0o700)
    running = Job(tmp_path / "job")
    monkeypatch.setenv(SECRET_ENV, str(running.secret))
    yield running
    running.close()


@pytest.fixture
def agent(job):
    return job.agent()
