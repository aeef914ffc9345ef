"""DDLStrategy: a Lightning strategy that owns gradient synchronization.

Lightning's DDPStrategy hands gradients to DDP's C++ reducer, which hides per-tensor readiness and
(on CPU) ignores communication hooks. DDLStrategy keeps DDP's process-group set-up, launchers and
samplers but replaces the DDP wrapper with a :class:`~ddlscale.sync.GradSync` backend fed by
per-parameter post-accumulate-grad hooks:

* set-up: parameters and buffers are broadcast from rank 0, the backend gets the parameters and the
  world process group;
* backward: each ready gradient goes to the backend, which may launch collectives at once;
* ``post_backward`` (before clipping and the optimizer step): the backend finishes, leaving the
  global average in every ``p.grad``;
* gradient accumulation: Lightning's ``block_backward_sync`` pauses the hooks on micro-batches
  that do not step, so only the accumulated gradient is synchronized;
* buffers (BatchNorm statistics) follow rank 0 before every training step, as in DDP; those that
  never change (DeepFM's field offsets) are sent once, not every step
  (:class:`~ddlscale.sync.buffers.BufferBroadcast`).

Collectives give up after ``timeout_s`` (a rank waiting for a peer that never comes raises instead
of hanging for torch's default 30 minutes), and ``debug_collectives`` makes a rank-mismatched
collective an error that names both sides.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.distributed import _destroy_dist_connection
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from ddlscale import clock
from ddlscale.ckpt.state.shard import SYNC_STATE_KEY
from ddlscale.cluster import pgstore
from ddlscale.cluster.elastic import store_per_round
from ddlscale.schema import Schema, boolean, choice, number
from ddlscale.sync import DenseAllreduce, GradSync
from ddlscale.sync.buffers import BufferBroadcast

_log = logging.getLogger("lightning_fabric.utilities.distributed")  # the logger Lightning's set-up line uses

START_METHODS = ("spawn", "popen", "fork", "forkserver")


@dataclass
class StrategyConfig(Schema):
    """``strategy.*`` of :class:`DDLStrategy` (the keys it takes from a config), checked in one place."""

    group = "strategy"
    start_method: str = "spawn"
    device_time_s: float = 0.0
    timeout: Any = None  # a datetime.timedelta (from Python; a config sets timeout_s)
    timeout_s: Any = None  # seconds, or None: ``timeout``
    debug_collectives: bool = False
    broadcast_buffers: bool = True
    process_group_backend: Any = None

    def check(self) -> None:
        choice(self.key("start_method"), self.start_method, START_METHODS)
        number(self.key("device_time_s"), self.device_time_s, least=0)
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise ValueError(f"{self.key('timeout')} must be a datetime.timedelta, got {self.timeout!r}; "
                             "from a config, set strategy.timeout_s (seconds)")
        if self.timeout_s is not None:
            number(self.key("timeout_s"), self.timeout_s, above=0, what="a number of seconds")
        boolean(self.key("debug_collectives"), self.debug_collectives)


class DDLStrategy(DDPStrategy):
    """Data-parallel training whose gradient synchronization is a pluggable :class:`GradSync`.

    Args:
        sync: the backend; dense bucketed allreduce when omitted.
        broadcast_buffers: make every rank use rank 0's buffers before each training step (DDP's
            default), sending only those that change (:class:`~ddlscale.sync.buffers.BufferBroadcast`);
            turn off for models whose buffers need not agree.
        start_method: how Lightning starts local workers. ``"spawn"`` (default) starts fresh
            interpreters without re-running the command line, so Hydra sweeps work; ``"popen"`` is
            Lightning's script re-execution. Under torchrun or SLURM nothing is started here.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default gloo on CPU and nccl on CUDA.
        device_time_s: seconds each training step idles before its forward pass, emulating an
            accelerator computing while the host CPU is free (0: off). For CPU-only emulations of
            GPU clusters, where otherwise every byte of host work competes with the training compute.
        timeout_s: seconds a collective may wait for the other ranks before it raises (the config's
            way to set Lightning's ``timeout``; torch's default is 30 minutes).
        debug_collectives: check before every collective that all ranks issue the same one (kind
            and shapes), through torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` process-group wrapper:
            a mismatch raises naming both sides instead of hanging. Costs an extra exchange per
            collective: for debugging only.
    """

    strategy_name = "ddlscale"
    schema = StrategyConfig  # its keys and their checks

    def __init__(
        self,
        sync: GradSync | None = None,
        broadcast_buffers: bool = True,
        start_method: str = "spawn",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        device_time_s: float = 0.0,
        timeout_s: float | None = None,
        debug_collectives: bool = False,
    ) -> None:
        StrategyConfig(start_method=start_method, device_time_s=device_time_s, timeout=timeout, timeout_s=timeout_s,
                       debug_collectives=debug_collectives)  # refuses what no run can use
        if timeout_s is not None:  # the config's spelling; it wins over ``timeout``
            timeout = timedelta(seconds=timeout_s)
        if timeout is not None:  # in emulated seconds: a dilated cluster's collectives take k times longer
            timeout = clock.wall_timeout(timeout.total_seconds())
        if sync is not None and not isinstance(sync, GradSync):
            raise TypeError(f"sync must be a ddlscale.sync.GradSync, got {type(sync).__name__}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.sync = sync if sync is not None else DenseAllreduce()
        self.broadcast_buffers = broadcast_buffers
        self.device_time_s = float(device_time_s)
        self.debug_collectives = debug_collectives
        self._sync_paused = False
        self._hook_handles: list[Any] = []
        self._pending_sync_load: Callable[[], None] | None = None  # a restore that waits for the backend's set-up

    # -- launching -----------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            # torchrun / SLURM started every process already: never spawn more.
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        elif self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _WorkerLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        if self.debug_collectives:
            # Read when a process group is made: every group from here on is wrapped in the checker.
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        # Under torchrun, a process-group store of this restart round's own: the store torchrun shares
        # across rounds still holds the last round's peer addresses (ddlscale/cluster/elastic.py).
        self.set_world_ranks()
        with store_per_round(self.global_rank, self.world_size, self._timeout):
            if not dist.is_initialized():
                # Lightning's own set-up would let torch's TCPStore listen on every interface: the group
                # is made here, its store on MASTER_ADDR alone (ddlscale/cluster/pgstore.py); Lightning's
                # set-up below then finds it made and keeps it.
                os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
                os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
                backend = self._get_process_group_backend()
                device_id = self.root_device if self.root_device.type != "cpu" else None
                # The line Lightning's own set-up prints, which users (and train.log's readers) look for.
                _log.info(f"Initializing distributed: GLOBAL_RANK: {self.global_rank}, "
                          f"MEMBER: {self.global_rank + 1}/{self.world_size}")
                pgstore.init_process_group(backend, self.global_rank, self.world_size,
                                           self._timeout or default_pg_timeout, device_id=device_id)
                if backend == "nccl":  # as Lightning's set-up does: torch warns about a group left undestroyed
                    atexit.register(_destroy_dist_connection)
            super().setup_distributed()

    # -- set-up: replaces wrapping the model in DistributedDataParallel ------------------------
    def configure_ddp(self) -> None:
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise RuntimeError(
                "DDLStrategy supports automatic optimization only: the LightningModule sets "
                "automatic_optimization = False. Use Lightning's DDPStrategy for manual optimization."
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            _sync_module_states(module)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.sync.setup(named, group=None, device=self.root_device, sparse_grads=sparse_gradient_names(module))
        self._buffer_broadcast = BufferBroadcast(module, self.sync.comm)
        if self._pending_sync_load is not None:  # Lightning restores before set-up: apply now
            self._pending_sync_load()
            self._pending_sync_load = None
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named]

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync_paused:
            self.sync.grad_ready(param)

    # -- per step ------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.device_time_s:
            clock.sleep(self.device_time_s)
        if self.broadcast_buffers and self.sync.world_size > 1:
            self._broadcast_buffers()
        return super().training_step(*args, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if not self._sync_paused:
            self.sync.finish_step()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate locally: Lightning enters this on micro-batches that do not step."""
        self._sync_paused = True
        try:
            yield None
        finally:
            self._sync_paused = False

    def _broadcast_buffers(self) -> None:
        self._buffer_broadcast.before_step()

    # -- checkpoints carry the backend's state (per rank: error feedback differs between ranks) --
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Also every rank's backend state, where this process's backend ran as a rank. After a spawned
        fit the launching process holds the copy of the backend the workers were started with, never
        set up (the ranks' states ended with them): its checkpoint (``trainer.save_checkpoint`` after
        ``fit``, as Lightning's own holds the weights rank 0 sent back and no optimizer state) has no
        backend state, and a run resumed from it starts the backend afresh."""
        if self.sync.is_set_up:
            states = [self.sync.state_dict()]
            if dist.is_initialized() and self.world_size > 1:  # every rank calls this; rank 0 writes
                states = [None] * self.world_size
                dist.all_gather_object(states, self.sync.state_dict())
            checkpoint[SYNC_STATE_KEY] = {"world_size": self.world_size, "ranks": states}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get(SYNC_STATE_KEY)
        if saved is None:
            return
        if saved["world_size"] != self.world_size:  # saved at another world size: the backend merges the ranks' states
            if any(state is None for state in saved["ranks"]):
                raise RuntimeError(f"checkpoint of {saved['world_size']} ranks lacks some rank's sync state: "
                                   f"it cannot be resumed on {self.world_size}")
            ranks, rank, world = saved["ranks"], self.global_rank, self.world_size

            def load() -> None:
                self.sync.load_resharded(ranks, rank, world)
        else:
            state = saved["ranks"][self.global_rank]

            def load() -> None:
                self.sync.load_state_dict(state)
        if self.sync.is_set_up:
            load()
        else:
            self._pending_sync_load = load

    def teardown(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        super().teardown()
        ends_after_fit = isinstance(self._launcher, _MultiProcessingLauncher) or (
            self.cluster_environment is not None and self.cluster_environment.creates_processes_externally)
        if ends_after_fit and dist.is_initialized():
            # This worker process (spawned, or started by torchrun/SLURM) ends right after fit: end
            # every process group here, gloo's threads joined while Python runs. ddlscale holds none
            # strongly (ddlscale.comm.groups); one left to interpreter shutdown can abort the process.
            dist.destroy_process_group()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "ddlscale", cls, description="ddlscale: data parallel with a pluggable gradient-sync backend"
        )
        strategy_registry.register(
            "ddlscale_popen", cls, description="ddlscale, workers started by re-running the script",
            start_method="popen",
        )


class _WorkerLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, whose workers handle an exception the way Lightning does where it
    starts no processes (torchrun): the callbacks' ``on_exception`` (a stopped run's summary), the
    strategy's, loggers finalized as failed. Lightning's own does that in the launching process
    only, which holds none of the run's state."""

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        # A spawned worker first sets its parent's default start method. In a job of a joblib sweep
        # (hydra/launcher=joblib) that parent is one of loky's workers, whose default is loky's own
        # method, unknown to a fresh interpreter: every worker died on it before running any code.
        if multiprocessing.get_start_method(allow_none=True) not in multiprocessing.get_all_start_methods():
            multiprocessing.set_start_method(self._start_method, force=True)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, process_idx: int, trainer: pl.Trainer | None, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        except BaseException as exc:
            if trainer is not None:
                _report_exception(trainer, exc)
            raise


def _report_exception(trainer: pl.Trainer, exc: BaseException) -> None:
    hooks = [partial(c.on_exception, trainer, trainer.lightning_module, exc) for c in trainer.callbacks]
    hooks.append(partial(trainer.strategy.on_exception, exc))
    hooks += [partial(logger.finalize, "failed") for logger in trainer.loggers]
    hooks.append(trainer.strategy.teardown)  # gloo's threads end in order (see DDLStrategy.teardown)
    for hook in hooks:
        with contextlib.suppress(Exception):  # one failing hook must not hide the error or skip the rest
            hook()


if "ddlscale" not in StrategyRegistry:
    DDLStrategy.register_strategies(StrategyRegistry)


def sparse_gradient_names(module: torch.nn.Module) -> set[str]:
    """Parameters whose gradients torch produces sparse: the weights of embeddings built with
    ``sparse=True`` (the only modules in torch that do)."""
    return {f"{prefix}.weight" if prefix else "weight" for prefix, m in module.named_modules()
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse}
