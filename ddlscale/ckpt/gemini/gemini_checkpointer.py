"""``ckpt=gemini``: checkpoint every iteration into peers' CPU memory; recover from it in seconds.

Per version v (the state after optimizer step v), on every rank:

1. **capture** (training thread, at the end of step v): the whole state as a :class:`Snapshot` —
   parameters and optimizer state referenced where they live, everything else copied;
2. **send** (sender thread, during iteration v+1): ``BEGIN`` at every holder's agent (own machine
   first, then its placement peers), chunks in the profiled idle spans, the rest at the deadline —
   the optimizer step of v+1, which the training thread enters only once every chunk of v is out;
   ``END`` with the stream's checksum, which each agent checks against what it holds;
3. **commit**: each rank writes a signed record of its version (size, MAC, the holders whose END
   check passed); rank 0 counts the verified replicas over all records and publishes the manifest
   (version, world size, placement, sizes, MACs) as one signed key only when there are world size x
   m of them: a version missing any one replica is never committed. The next version's BEGIN waits
   for that outcome, and each agent, reading the manifest itself, never overwrites the committed
   version's buffer, so a committed version is never lost.

Everything is authenticated with the job's secret (:mod:`ddlscale.ckpt.gemini.auth`): agent messages,
store records, the replicas' MACs. Recovery is :mod:`~ddlscale.ckpt.gemini.recovery`'s. When a launch
ends, its launcher writes the committed version to the persistent directory
(:mod:`~ddlscale.ckpt.gemini.drain`), so running the same command again in the same run directory
continues from there.
"""

from __future__ import annotations

import math
import os
import statistics
import warnings
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.ckpt.checkpointer import PROGRESS_FILE, Checkpointer
from ddlscale.ckpt.disk.disk_checkpointer import DiskCheckpointer, checkpoint_dir, write_rate
from ddlscale.ckpt.gemini.auth import JobKeys
from ddlscale.ckpt.gemini.env import STORE_ENV, machine_layout
from ddlscale.ckpt.gemini.gemini_config import PERSIST_EVERY, GeminiConfig
from ddlscale.ckpt.gemini.idle_gaps import TrainingWire
from ddlscale.ckpt.gemini.interleave import ReplicaSender, Transfer
from ddlscale.ckpt.gemini.kvstore import ETCD, JobStore, StoreWentBack, connect, consult_agents
from ddlscale.ckpt.gemini.placement import PlacementPlan
from ddlscale.ckpt.gemini.protocol import AgentClient, LocalAgentClient, ReplicaError, mib, shm_dir
from ddlscale.ckpt.gemini.recovery import GeminiRecovery
from ddlscale.ckpt.gemini.services import check_launch, launch_services
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.shard import PAYLOAD_FORMAT, capture_local, capture_shared, unchanged_until_step
from ddlscale.ckpt.state.snapshot import capture
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord
from ddlscale.cluster import stop
from ddlscale.cluster.context import Launch, Services, job_name

# Rank 0 starts a version's commit wait only once its own send is out, which may be after another rank
# began waiting for the outcome: that rank waits this much beyond commit_timeout_s.
OUTCOME_SLACK_S = 10.0
NO_SPACE_OUTCOME = "no_space"  # a version's outcome when some holder had no room for it
STORE_BEHIND_OUTCOME = "store_went_back"  # ... when the store's commit record went back: the run stops
PERSIST_ON_STORAGE = "gemini"  # ckpt.persist_dir's default on a storage machine: storage://gemini


def buffers_per_agent(replicas: int, ranks_per_machine: int) -> int:
    """Version-sized files an agent holds at once: 2 per rank of the ``replicas`` machines it holds (the
    committed version and the one coming), and one per rank of its own machine (what that trainer writes
    through shared memory, until END copies it in)."""
    return (2 * replicas + 1) * ranks_per_machine


def estimate_version_bytes(pl_module: pl.LightningModule) -> int:
    """A version's size before the optimizer has state: parameters and buffers, plus the optimizer's
    state per parameter (SGD: a momentum buffer when it has momentum; anything else: two, as Adam's)."""
    params = sum(p.numel() * p.element_size() for p in pl_module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in pl_module.buffers())
    slots_per_param = 2
    try:
        configured = pl_module.configure_optimizers()
    except Exception:  # an optimizer that needs the trainer: assume the larger state
        configured = None
    if isinstance(configured, dict):
        configured = configured.get("optimizer")
    if isinstance(configured, (list, tuple)) and configured:
        configured = configured[0]
        configured = configured[0] if isinstance(configured, (list, tuple)) and configured else configured
    if isinstance(configured, torch.optim.SGD):
        slots_per_param = 1 if any(g.get("momentum", 0) for g in configured.param_groups) else 0
    return params * (1 + slots_per_param) + buffers


class GeminiCheckpointer(GeminiRecovery, Checkpointer):
    """In-memory checkpoints replicated to peers' agents, with a rare persistent tier behind them.

    Args:
        every: optimizer steps between in-memory checkpoints (1: every iteration).
        replicas: m, copies of each machine's checkpoint (its own included).
        placement: ``mixed`` (Gemini's: groups, the last one a ring), ``group`` or ``ring``.
        mode: ``gemini`` (interleaved, pipelined), ``unpipelined`` (interleaved, one sub-buffer) or
            ``blocking`` (sent whole at the end of the step, for comparison).
        chunk_kib, subbuffers: staging buffer of ``subbuffers`` chunks of ``chunk_kib`` KiB.
        mu: fraction of each idle span the chunks may fill, 0 < mu < 1.
        checksum: the replicas' MAC, ``hmac-sha256`` or ``blake2b`` (keyed with the job's secret), computed
            by the sender and checked by every holder at END and by every reader.
        profile_steps: iterations profiled before interleaving starts (sent at the deadline until then).
        persist_every: steps between persistent checkpoints (100: a lost replica group costs at most that
            many steps again; null: none — a lost group is then fatal).
        persist_dir, persist_bandwidth: the persistent tier's directory, also where a launch's last committed
            version is written when it ends: a path, or ``storage://<path>`` on the emulated cluster's storage
            machine (default ``<run dir>/checkpoints``, ``storage://gemini`` where a storage machine serves the
            run); and write-rate emulation for a local directory (refused on the storage machine, whose
            link sets the rate).
        store: ``HOST:PORT`` of the job's TCPStore; null: ``$DDLSCALE_STORE`` (set by the launchers).
        commit_timeout_s: how long rank 0 waits for a version's replicas before giving it up.
        on_no_space: a version an agent's shared memory cannot hold: ``stop`` (the run ends, saying so) or
            ``persist`` (from then on every step goes to the persistent tier, ``persist_every`` required).
        drain_deadline_s: how long the drain of a launch's last committed version may take (and the agents
            keep their replicas for it on a stop); null: from the version's size and the persistent tier's
            rate (:func:`~ddlscale.ckpt.gemini.stopping.deadline_for`).
        resume: ``auto`` (the newest committed version, else the newest persistent one) or null.
    """

    schema = GeminiConfig  # its keys and their checks

    def __init__(self, every: int = 1, replicas: int = 2, placement: str = "mixed", mode: str = "gemini",
                 chunk_kib: int = 1024, subbuffers: int = 4, mu: float = 0.8, checksum: str = "hmac-sha256",
                 profile_steps: int = 20,
                 persist_every: int | None = PERSIST_EVERY, persist_dir: str | None = None,
                 persist_bandwidth: str | float | None = None, store: str | None = None,
                 commit_timeout_s: float = 30.0, resume: str | None = "auto", run_dir: str | None = None,
                 on_no_space: str = "stop", drain_deadline_s: float | None = None) -> None:
        GeminiConfig(every=every, replicas=replicas, placement=placement, mode=mode, chunk_kib=chunk_kib,
                     subbuffers=subbuffers, mu=mu, checksum=checksum, profile_steps=profile_steps,
                     persist_every=persist_every, persist_dir=persist_dir, persist_bandwidth=persist_bandwidth,
                     store=store, commit_timeout_s=commit_timeout_s, resume=resume,
                     on_no_space=on_no_space, drain_deadline_s=drain_deadline_s)  # refuses what no run can use
        super().__init__(every=every, resume=resume)
        self.replicas = replicas
        self.placement, self.mode = placement, mode
        self.chunk_bytes = chunk_kib * 1024
        self.subbuffers = subbuffers
        self.mu = float(mu)
        self.checksum = checksum
        self.profile_steps = profile_steps
        self.store_address = store
        self.commit_timeout_s = float(commit_timeout_s)
        self.run_dir = run_dir
        self.on_no_space = on_no_space
        self.drain_deadline_s = drain_deadline_s
        self.persistent: DiskCheckpointer | None = None
        self.persist_given = persist_dir  # as configured: the launcher resolves it for its launch (persist_target)
        self.persist_dir = self.persist_target()  # a Path, or a storage:// string (on the storage machine)
        # Parsed here so that a bad value is reported under this key, not the disk tier's ckpt.bandwidth.
        self.persist_bps = write_rate(persist_bandwidth, "ckpt.persist_bandwidth")
        # Without a directory (no run directory and no persist_dir: Python without run_dir) there is none.
        if persist_every is not None and self.persist_dir is not None:
            self.persistent = DiskCheckpointer(every=persist_every, keep=2, bandwidth=self.persist_bps,
                                               dir=str(self.persist_dir), resume=None)
        # Set in setup (workers).
        self.store: JobStore | None = None
        self.auth: JobKeys | None = None
        self.sender: ReplicaSender | None = None
        self.plan: PlacementPlan | None = None
        self.rank = 0
        self.machine = 0  # this rank's machine (placement id)
        self.machine_of: list[int] = []
        self.device = torch.device("cpu")  # the strategy's root device: recovery's collective runs on it
        self.incarnation = 0
        self.previous: Transfer | None = None
        self.transfers: list[Transfer] = []
        self.stalls: list[float] = []  # training-thread seconds per checkpoint: capture + deadline wait
        self.committed: list[int] = []
        self._no_space_seen: set[int] = set()
        self.space_refusal: str | None = None
        self.store_behind: str | None = None  # why rank 0 decided STORE_BEHIND_OUTCOME
        if run_dir is not None:
            self.progress_path = Path(run_dir) / PROGRESS_FILE
        self.wire = TrainingWire(None, self.profile_steps, self.mu)  # the sync backend is known in setup
        self._iteration_start: float | None = None

    # -- the launching process: before and around the workers --------------------------------------
    def persist_target(self, storage: bool | None = None) -> Path | str | None:
        """``ckpt.persist_dir`` resolved as the disk tier resolves ``ckpt.dir``, ``storage://gemini`` by
        default on a storage machine. ``storage``: whether the launch has one (the launching process must
        say: only its workers are handed the endpoint); None asks this process's environment."""
        return checkpoint_dir(self.persist_given, self.run_dir, PERSIST_ON_STORAGE, storage)

    def validate_launch(self, launch: Launch) -> None:
        check_launch(self, launch)

    def services(self, launch: Launch) -> AbstractContextManager[Services]:
        return launch_services(self, launch)

    # -- where things are ---------------------------------------------------------------------------
    def _store_address(self) -> str:
        # ckpt.store=etcd: the launcher started the members and exported their address.
        given = self.store_address if self.store_address != ETCD else None
        address = given or os.environ.get(STORE_ENV)
        if not address:
            raise ValueError(
                "ckpt=gemini needs the job's key-value store: set ckpt.store=HOST:PORT, etcd://HOST:PORT,... or "
                "$DDLSCALE_STORE (cluster=local and cluster=emulated start one for you, ckpt.store=etcd an etcd cluster)"
            )
        return address

    def _connect(self) -> JobStore:
        """A new store connection (one per process: a connection inherited through fork is shared)."""
        job = job_name(self.run_dir)
        self.auth = JobKeys.from_env(job)
        return JobStore(connect(self._store_address()), job, self.auth)

    def __getstate__(self) -> dict[str, Any]:
        # Lightning's spawn launcher pickles callbacks into the workers: connections stay behind.
        state = dict(self.__dict__)
        state.update(store=None, sender=None, auth=None)  # each worker derives its keys from the secret again
        return state

    def _agent(self, machine: int, timeout_s: float = 30.0, local: bool = False) -> AgentClient:
        key = self.store.keys.agent(machine)
        deadline = clock.now() + timeout_s
        while (address := self.store.get(key)) is None:
            if clock.now() > deadline:
                raise ReplicaError(f"no replica agent registered (signed with this job's secret) for machine "
                                   f"{machine} after {timeout_s:g} s")
            clock.sleep(0.05)
        return (LocalAgentClient if local else AgentClient)(address, self.auth, self.incarnation)

    def committed_manifest(self, store: JobStore | None = None) -> Manifest | None:
        manifest = (store if store is not None else self.store).manifest()
        return manifest if isinstance(manifest, Manifest) else None

    # -- set-up in the workers ----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.persistent is not None:
            self.persistent.setup(trainer, pl_module, stage)
        self.store = self._connect()
        self.device = trainer.strategy.root_device
        world, rank = trainer.world_size, trainer.global_rank
        self.rank = rank
        machine, machines = machine_layout(rank, world, trainer.node_rank, trainer.num_nodes)
        self.machine = machine
        self.plan = PlacementPlan(machines, self.replicas, self.placement)
        self.machine_of = [machine]
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, machine)
            self.machine_of = [int(m) for m in gathered]
        if rank == 0:  # a new incarnation: the agents refuse whatever the previous one's trainers still send
            # Above any the store or an agent has seen: the store's keys may have been set back, the
            # agents' memory cannot be (store.py, "the commit record").
            seen = consult_agents(self.store, machines)
            manifest = self.committed_manifest()  # the newest record the store or an agent holds
            newest = self.store.newest_order or (0, 0)
            self.incarnation = 1 + max(int(self.store.get(self.store.keys.incarnation, 0)), seen, newest[0])
            self.store.set(self.store.keys.incarnation, self.incarnation)
            if manifest is not None and manifest.world_size != world:
                # Its replicas are per rank of another world size: never restorable here (resume_path went
                # to the persistent tier), and the agents would keep its buffers for nothing.
                self.store.clear_manifest(f"the job runs on {world} ranks now; step {manifest.step} was "
                                          f"committed on {manifest.world_size}", self.incarnation)
            elif self.store.behind is not None:  # the agents refuse BEGIN until the newest is back
                print(f"ckpt=gemini: {self.store.behind}; writing the newest again, as the agents saw it", flush=True)
                self.store.restore(self.incarnation)
        self.incarnation = int(trainer.strategy.broadcast(self.incarnation, src=0))
        self.wire.sync = getattr(trainer.strategy, "sync", None)
        holders = list(self.plan.holders_of(machine))
        destinations = [self._agent(h, local=h == machine) for h in holders]  # own machine's: shared memory
        self._check_shared_memory(pl_module, world, machines)
        self.sender = ReplicaSender(rank, destinations, holders, self.chunk_bytes, self.subbuffers, self.mode,
                                    self.checksum, self.auth.replica, before_begin=self._before_begin,
                                    on_done=self._on_sent, wire=self.wire.now, device=trainer.strategy.root_device)

    # -- checkpointing ------------------------------------------------------------------------------
    def save(self, trainer: pl.Trainer, batch_idx: int) -> None:
        start = clock.now()
        payload = {"format": PAYLOAD_FORMAT, "local": capture_local(trainer, batch_idx),
                   "shared": capture_shared(trainer)}
        position = DataPosition.after_batch(trainer.current_epoch, batch_idx, trainer.num_training_batches)
        transfer = Transfer(trainer.global_step, capture(payload, unchanged_until_step(trainer)), position=position)
        self.transfers.append(transfer)
        self.sender.submit(transfer)  # blocking mode: sent and checked before this returns
        self.stalls.append(clock.now() - start)
        if self.persistent is not None and self.persistent.due(trainer.global_step):
            self.persistent.save(trainer, batch_idx)

    def _before_begin(self, transfer: Transfer) -> None:
        """Wait for the previous version's outcome, so the agents see it when they choose a buffer."""
        previous, self.previous = self.previous, transfer
        if previous is not None:
            # The client's default timeout (connect's) would give up before a long commit_timeout_s.
            key = self.store.keys.outcome(self.incarnation, previous.version)
            self.store.wait(key, self.commit_timeout_s + OUTCOME_SLACK_S)
            previous.outcome = self.store.get(key)

    def _on_sent(self, transfer: Transfer) -> None:
        """Record this rank's version and the holders that verified it; rank 0 then decides the commit."""
        rank = self.sender.owner if self.sender is not None else self.rank
        # On a stop the agents refuse new versions (they keep what the drain reads): no warning then.
        if transfer.error is not None and stop.received() is None:
            warnings.warn(f"gemini: version {transfer.version} of rank {rank} not replicated: {transfer.error}",
                          stacklevel=2)
        self.store.set(self.store.keys.shard(self.incarnation, transfer.version, rank),
                       {"bytes": transfer.nbytes, "checksum": transfer.checksum, "verified": transfer.verified,
                        "no_space": transfer.space_error, "store_behind": transfer.store_behind})
        if rank == 0:
            self._commit(transfer)

    def _commit(self, transfer: Transfer) -> None:
        """Publish the manifest of ``transfer.version`` if every replica of every rank was verified."""
        version, world = transfer.version, len(self.machine_of)
        expected = world * self.replicas
        keys = [self.store.keys.shard(self.incarnation, version, r) for r in range(world)]
        outcome = "failed"
        try:
            records = [self.store.get(k) for k in keys] if self.store.wait_all(keys, self.commit_timeout_s) else []
            verified = self.plan.verified([r and r.get("verified") for r in records], self.machine_of)
            if verified >= expected:
                shards = tuple(ShardRecord(r, f"memory:rank{r}", int(rec["bytes"]), str(rec["checksum"]))
                               for r, rec in enumerate(records))
                position = transfer.position
                holders = {str(r): list(self.plan.holders_of(m)) for r, m in enumerate(self.machine_of)}
                manifest = Manifest(step=version, world_size=world, shards=shards, epoch=position.epoch,
                                    batch=position.batch, tier="memory",
                                    placement={"kind": self.placement, "machines": self.plan.machines,
                                               "replicas": self.replicas, "machine_of": self.machine_of,
                                               "holders": holders, "incarnation": self.incarnation})
                try:
                    self.store.publish(manifest)  # one signed key: the version now exists
                    self.committed.append(version)
                    outcome = "committed"
                except StoreWentBack as exc:  # never numbered from a record written back: the run stops
                    outcome, self.store_behind = STORE_BEHIND_OUTCOME, str(exc)
            elif any(r and r.get("store_behind") for r in records):  # some agent refused BEGIN: likewise
                outcome = STORE_BEHIND_OUTCOME
                self.store_behind = next(r["store_behind"] for r in records if r and r.get("store_behind"))
            elif any(r and r.get("no_space") for r in records):  # every rank acts on it at the same step
                outcome = NO_SPACE_OUTCOME
                self.space_refusal = next(r["no_space"] for r in records if r and r.get("no_space"))
            elif stop.received() is None:  # on a stop, a version cut short is expected (see _on_sent)
                warnings.warn(f"gemini: version {version} not committed ({verified} of {expected} replicas verified)",
                              stacklevel=2)
        finally:  # every rank's next version waits for this key: a commit that raised says "failed"
            self.store.set(self.store.keys.outcome(self.incarnation, version), outcome)

    def _check_shared_memory(self, pl_module: pl.LightningModule, world: int, machines: int) -> None:
        """At start-up: refuse, with the numbers, when a shared memory cannot hold every buffer the agents
        using it will keep: 2 per rank held, for the ranks of ``ckpt.replicas`` machines, and the file each of
        its own machine's ranks writes a version into (copied into a buffer at END), each of a version's
        size (parameters, buffers and optimizer state, estimated before the optimizer has any), times the
        agents that share it (all of them on one host: cluster=local). Rank 0 asks every agent; all ranks
        raise alike."""
        problem: list[str | None] = [None]
        if self.rank == 0:
            version = estimate_version_bytes(pl_module)
            per_machine = math.ceil(world / machines)
            per_agent = buffers_per_agent(self.replicas, per_machine) * version
            stats = []
            for machine in range(machines):
                with self._agent(machine) as client:
                    stats.append(client.stat()["shm"])
            mine = stats[self.machine]
            sharing = [m for m, st in enumerate(stats) if (st.get("host"), st.get("device")) ==
                       (mine.get("host"), mine.get("device"))]
            need = per_agent * len(sharing)
            free = min(int(stats[m]["free"]) for m in sharing)
            if need > free:
                problem[0] = (
                    f"ckpt=gemini: {mib(free)} free in {mine['dir']} on {mine.get('host')}, which the agents of "
                    f"{len(sharing)} machine(s) share; each keeps 2 buffers for each of the {per_machine} rank(s) of "
                    f"the ckpt.replicas={self.replicas} machines whose replicas it holds, and one its own machine's "
                    f"{per_machine} rank(s) write into, of about {mib(version)} each (parameters, buffers, optimizer "
                    f"state): {mib(need)} ({need} bytes) in all. Enlarge it (docker run "
                    "--shm-size=...), lower ckpt.replicas or use fewer ranks per host")
        if dist.is_initialized() and world > 1:
            dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise RuntimeError(problem[0])

    def _space_message(self, refusal: str, version_bytes: int, world: int, machines: int) -> str:
        per_machine = math.ceil(world / machines)
        need = buffers_per_agent(self.replicas, per_machine) * version_bytes
        return (f"ckpt=gemini: {refusal}. Each machine keeps 2 buffers for each rank of the ckpt.replicas="
                f"{self.replicas} machines whose replicas it holds ({per_machine} rank(s) each), and one for each "
                f"of its own ranks to write into: versions of {mib(version_bytes)} need about {mib(need)} of "
                f"{shm_dir()} per machine. Enlarge it (docker run --shm-size=...) or lower ckpt.replicas")

    # -- interleaving: profile the idle spans, hold the optimizer step until the version is out ------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._iteration_start is None:
            self._iteration_start = clock.now()
            self.wire.iteration_started()
            if self.sender is not None:
                self.sender.iteration_started()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        persist_wait = self.persistent.before_optimizer_step() if self.persistent is not None else 0.0
        if persist_wait and self.stalls:
            self.stalls[-1] += persist_wait
        start, self._iteration_start = self._iteration_start, None
        if self.sender is None:
            return
        if start is not None and self.mode != "blocking" and self.sender.plan is None:
            plan = self.wire.record(start, self.sender.chunk_seconds())
            if plan is not None:
                self.sender.plan = plan
        waited = self.sender.deadline()
        if waited and self.stalls:
            self.stalls[-1] += waited
        # The version before the one just sent: its outcome is known to every rank by now (the last one's
        # BEGIN waited for it), so all ranks act at the same step.
        decided = self.transfers[-2] if len(self.transfers) >= 2 else None
        if decided is not None and decided.outcome == STORE_BEHIND_OUTCOME:
            why = self.store_behind or decided.store_behind or "an agent refused to begin a version"
            raise RuntimeError(
                f"ckpt=gemini: the job's store went back: {why}. Someone who reaches the store wrote an old commit "
                f"record back or deleted it; stopping at step {trainer.global_step} rather than training on "
                "unprotected. The newest committed version is still in the agents' memory: a restart "
                "(cluster.max_restarts) resumes from it, and so does the launch's drain to ckpt.persist_dir")
        if decided is not None and decided.outcome == NO_SPACE_OUTCOME and decided.version not in self._no_space_seen:
            self._no_space_seen.add(decided.version)
            refusal = decided.space_error or f"an agent could not store version {decided.version}"
            message = self._space_message(refusal, decided.nbytes, trainer.world_size, self.plan.machines)
            if self.on_no_space == "stop":  # never train on unprotected: say so and end the run
                # The option first: the launcher's one-line error keeps a message's first 500 characters.
                raise RuntimeError(f"ckpt.on_no_space=stop (=persist writes every step to disk instead): {message}")
            if self.persistent.interval != 1:  # persist: protection moves to the persistent tier, every step
                print(f"{message}; ckpt.on_no_space=persist: every step goes to {self.persistent.dir} from "
                      f"step {trainer.global_step} on", flush=True)
                self.persistent.interval, self.persistent.anchor = 1, trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sender is not None:
            self.sender.settle()  # the last version goes out, and is committed, before the summary
        if self.persistent is not None:
            self.persistent.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.sender is not None:  # before teardown, which would wait for the version in flight
            self.sender.abandon()
            self.sender = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.persistent is not None:
            self.persistent.teardown(trainer, pl_module, stage)

    # -- figures -----------------------------------------------------------------------------------
    def figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        sources: list[Any] = [self.recovery.get("source")]
        if dist.is_initialized() and trainer.world_size > 1:
            sources = [None] * trainer.world_size
            dist.all_gather_object(sources, self.recovery.get("source"))
        figures = self.local_figures(trainer)
        figures["ckpt_recovery_sources"] = sources if any(sources) else None  # per rank: local, peer:<m>, persistent
        if trainer.is_global_zero and self.store is not None:
            figures["ckpt_agent_refused"] = self._agent_refusals()
        return figures

    def local_figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        complete = [t.finished - t.captured for t in self.transfers if t.finished is not None]
        figures = {
            "ckpt_mode": self.mode,
            "ckpt_replicas": self.replicas,
            "ckpt_bytes": self.transfers[-1].nbytes if self.transfers else None,
            "ckpt_stall_s": statistics.median(self.stalls[1:] or self.stalls) if self.stalls else None,
            "ckpt_complete_s": statistics.median(complete) if complete else None,
            "ckpt_committed": len(self.committed) if trainer.is_global_zero else None,
            "ckpt_last_committed": self.committed[-1] if self.committed else None,
            "ckpt_recovery": self.recovery or None,  # rank 0's
        }
        figures.update({f"ckpt_interleave_{k}": v for k, v in self.wire.summary.items()})
        if self.persistent is not None:
            figures["ckpt_persistent_count"] = len(self.persistent.bytes_written)
        figures["ckpt_persist_dir"] = str(self.persist_dir) if self.persist_dir is not None else None
        if trainer.is_global_zero and self.store is not None:
            figures["ckpt_store_refused"] = self.store.refused  # values that failed their signature, read here
        return figures

    def persisted_dir(self) -> Path | None:
        return self.persist_dir  # where the launch's end wrote the committed version (ddlscale.ckpt.gemini.drain)

    def _agent_refusals(self) -> dict[str, int] | None:
        """Requests every agent refused, by reason, summed (None when some agent could not be asked)."""
        total: dict[str, int] = {}
        try:
            for machine in range(self.plan.machines):
                with self._agent(machine, timeout_s=1.0) as client:
                    for reason, n in client.stat()["refused"].items():
                        total[reason] = total.get(reason, 0) + int(n)
        except (ReplicaError, OSError):
            return None
        return total

