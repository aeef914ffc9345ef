"""Where a rank is in its data, and how to resume a train loader exactly there.

Lightning restores its loop counters mid-epoch but restarts a plain DataLoader from the epoch's first
batch (it warns that this is unreliable). A checkpoint therefore records the position itself, and on
restore the loader's batch sampler skips the batches already trained on. Skipping happens on
indices, so no skipped sample is loaded.

Exact when the epoch's order is a function of the sampler's epoch (SequentialSampler, the
DistributedSampler Lightning injects under DDP, any ``set_epoch`` sampler): the sampler is set to
the saved epoch before the resumed iterator draws its order. A sampler that draws its order from the
global RNG (a RandomSampler without a generator) is exact only when resuming at an epoch boundary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DataPosition:
    """The next batch to train on: ``batch`` batches of epoch ``epoch`` are done (``num_batches`` per epoch)."""

    epoch: int
    batch: int
    num_batches: int | float

    @classmethod
    def after_batch(cls, epoch: int, batch_idx: int, num_batches: int | float) -> DataPosition:
        """The position once batch ``batch_idx`` of ``epoch`` is trained; an epoch's end is the next's start."""
        done = batch_idx + 1
        if done >= num_batches:
            return cls(epoch + 1, 0, num_batches)
        return cls(epoch, done, num_batches)

    @property
    def at_epoch_start(self) -> bool:
        return self.batch == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> DataPosition:
        return cls(int(state["epoch"]), int(state["batch"]), state["num_batches"])


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
