"""Where a rank is in its data, and how to resume a train loader exactly there.

Lightning restores its loop counters mid-epoch but restarts a plain DataLoader from the epoch's first
batch (it warns that this is unreliable). A checkpoint therefore records the position itself, and on
restore the loader's batch sampler skips the batches already trained on. Skipping happens on
indices, so no skipped sample is loaded.

Exact when the epoch's order is a function of the sampler's epoch (SequentialSampler, the
DistributedSampler Lightning injects under DDP, any ``set_epoch`` sampler): the sampler is set to
the saved epoch before the resumed iterator draws its order. A sampler that draws its order from the
global RNG (a RandomSampler without a generator) is exact only when resuming at an epoch boundary.

At another world size a batch index means other samples, so a position also records ``samples``: how
many samples of the epoch's order all ranks together have consumed. A DistributedSampler deals the
epoch's order out round-robin (rank r takes positions r, r + N, ...), so after ``b`` batches of ``B``
on every one of N ranks exactly the first ``b * B * N`` samples of the order are done, whatever N is.
:func:`position_loader_at_sample` resumes M ranks there: the rest of the epoch's order dealt out over
the M ranks (:class:`ResumedDistributedSampler`), and the next epoch as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler


@dataclass(frozen=True)
class DataPosition:
    """The next batch to train on: ``batch`` batches of epoch ``epoch`` are done (``num_batches`` per epoch)."""

    epoch: int
    batch: int
    num_batches: int | float
    samples: int | None = None  # samples of the epoch's order consumed over all ranks (None: unknown)

    @classmethod
    def after_batch(cls, epoch: int, batch_idx: int, num_batches: int | float, loader: Any = None,
                    world_size: int = 1) -> DataPosition:
        """The position once batch ``batch_idx`` of ``epoch`` is trained; an epoch's end is the next's start.
        With the train ``loader`` (and the job's ``world_size``) it counts the samples consumed too."""
        done = batch_idx + 1
        if done >= num_batches:
            return cls(epoch + 1, 0, num_batches, 0)
        return cls(epoch, done, num_batches, consumed_samples(loader, done, world_size))

    @property
    def at_epoch_start(self) -> bool:
        return self.batch == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> DataPosition:
        samples = state.get("samples")
        return cls(int(state["epoch"]), int(state["batch"]), state["num_batches"],
                   None if samples is None else int(samples))


def consumed_samples(loader: Any, batches_done: int, world_size: int) -> int | None:
    """Samples of the current epoch's order consumed over all ranks after ``batches_done`` batches."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    size = getattr(batch_sampler, "batch_size", None)
    if not isinstance(size, int):
        return None
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, ResumedDistributedSampler) and sampler.active:
        return sampler.start + (batches_done - sampler.start_batch) * size * sampler.num_replicas
    return batches_done * size * world_size


class ResumedDistributedSampler:
    """A DistributedSampler whose epoch ``epoch`` continues at sample ``start`` of that epoch's order:
    the rest of the order dealt out over this sampler's ranks as DistributedSampler deals a whole
    epoch (padded to a multiple of the ranks, or cut with ``drop_last``). Other epochs are the wrapped
    sampler's own. ``start_batch``: the batches of the epoch counted as done when it resumed."""

    def __init__(self, inner: DistributedSampler, epoch: int, start: int) -> None:
        self.inner, self.epoch_resumed, self.start = inner, epoch, start
        self.start_batch = 0

    @property
    def active(self) -> bool:
        return self.inner.epoch == self.epoch_resumed

    def _rest(self) -> list[int]:
        inner = self.inner
        n = len(inner.dataset)
        if inner.shuffle:  # DistributedSampler's order of the epoch
            generator = torch.Generator()
            generator.manual_seed(inner.seed + inner.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        rest, ranks = order[self.start:], inner.num_replicas
        if inner.drop_last:
            rest = rest[: len(rest) // ranks * ranks]
        elif rest and len(rest) % ranks:
            pad = ranks - len(rest) % ranks
            rest += (rest * (pad // len(rest) + 1))[:pad]
        return rest[inner.rank::ranks]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rest()) if self.active else iter(self.inner)

    def __len__(self) -> int:
        return len(self._rest()) if self.active else len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class ResumingBatchSampler:
    """Wraps a loader's batch sampler; its next iteration starts ``skip`` batches in, later ones at 0.

    Attributes the loader or Lightning look up (``sampler``, ``batch_size``, ``set_epoch``...) pass
    through to the wrapped sampler.
    """

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        iterator = iter(self.inner)
        for _ in range(skip):
            if next(iterator, None) is None:
                return
        yield from iterator

    def __len__(self) -> int:
        return len(self.inner)  # the epoch's length: Lightning counts the skipped batches as done

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def position_loader(loader: Any, position: DataPosition) -> None:
    """Make ``loader``'s next iteration yield epoch ``position.epoch`` from batch ``position.batch`` on.

    The loader must not be iterated between this call and the resumed iteration.
    """
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in {id(o): o for o in (sampler, batch_sampler) if o is not None}.values():
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(position.epoch)
    if position.batch == 0:
        return
    if batch_sampler is None:
        raise RuntimeError(
            "cannot resume mid-epoch: the train loader has no batch sampler to skip batches with "
            "(an iterable-style dataset); checkpoint at epoch ends instead"
        )
    if isinstance(batch_sampler, ResumingBatchSampler):
        batch_sampler.skip = position.batch
    else:
        # DataLoader forbids re-assigning batch_sampler after construction because a live iterator
        # would not notice; the loader is re-iterated right after this, so it is safe here.
        object.__setattr__(loader, "batch_sampler", ResumingBatchSampler(batch_sampler, position.batch))


def position_loader_at_sample(loader: Any, epoch: int, samples: int) -> int:
    """Make ``loader``'s next iteration continue epoch ``epoch`` at sample ``samples`` of its order (the
    position saved at another world size); the batches of the epoch this rank should count as done,
    so that they and the batches left add up to ``len(loader)``, Lightning's batches per epoch."""
    position_loader(loader, DataPosition(epoch, 0, len(loader)))  # sets the epoch
    if samples == 0:
        return 0
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        raise RuntimeError(
            "cannot resume mid-epoch at another world size: the train loader's sampler is "
            f"{type(sampler).__name__}, not the DistributedSampler that deals samples to ranks; resume at an epoch end"
        )
    sampler.set_epoch(epoch)
    full = len(batch_sampler)
    resumed = ResumedDistributedSampler(sampler, epoch, samples)
    batch_sampler.sampler = resumed
    resumed.start_batch = full - len(batch_sampler)
    return resumed.start_batch
