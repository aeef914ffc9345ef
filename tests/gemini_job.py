"""A Gemini job's pieces for tests: its secret, its store, agents, authenticated clients."""

import socket

import pytest

from ddlscale.ckpt.gemini import store as kvstore
from ddlscale.ckpt.gemini.agent import Agent
from ddlscale.ckpt.gemini.auth import SECRET_ENV, JobKeys, create_secret_file, read_secret
from ddlscale.ckpt.gemini.protocol import AgentClient
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord


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
