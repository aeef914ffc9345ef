"""BufferBroadcast: rank 0's buffers on every rank before each step, as DDP's broadcast leaves them,
with the buffers that never change sent once."""

import warnings

import pytest
import torch

from ddlscale.cluster import run_workers
from ddlscale.comm import Communicator
from ddlscale.sync.buffers import BufferBroadcast

STEPS = 5


class _Buffers(torch.nn.Module):
    """A constant buffer (DeepFM's field offsets), running statistics that every rank moves its own
    way (BatchNorm's), an integer counter, one that stays put for two steps and then moves on one rank
    only, and an empty one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offsets", torch.arange(0, 40, 8))
        self.register_buffer("running_mean", torch.zeros(6))
        self.register_buffer("tracked", torch.zeros((), dtype=torch.long))
        self.register_buffer("late", torch.ones(3), persistent=False)
        self.register_buffer("empty", torch.empty(0))

    def train_step(self, rank, step):
        """What a forward in training mode does to the buffers on this rank."""
        self.running_mean.mul_(0.9).add_(torch.arange(6.0) * (rank + 1) + step)
        self.tracked += 1
        if step == 2 and rank == 1:
            self.late += 1


def _buffers(rank, world):
    ours, ddp = _Buffers(), _Buffers()
    ours.running_mean.fill_(float(rank))  # ranks start out of agreement: the first step must fix it
    ddp.running_mean.fill_(float(rank))
    comm = Communicator()
    sync = BufferBroadcast(ours, comm)
    steps = []
    for step in range(STEPS):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sync.before_step()
        records = comm.ledger.drain()
        # DDP: every (non-empty) buffer from rank 0, every step.
        comm.broadcast_coalesced([b for b in ddp.buffers() if b.numel()], src=0)
        comm.ledger.drain()
        same = all(torch.equal(a, b) for a, b in zip(ours.buffers(), ddp.buffers(), strict=True))
        steps.append(([(r.op, r.bytes_recv) for r in records], same,
                      {name: b.clone() for name, b in ours.named_buffers()}, [str(w.message) for w in caught]))
        ours.train_step(rank, step)
        ddp.train_step(rank, step)
    return steps, sync.changing


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_constant_buffers_are_sent_once_and_changing_ones_as_ddp_sends_them(world):
    results = run_workers(_buffers, world)
    everything = 5 * 8 + 6 * 4 + 8 + 3 * 4  # offsets (int64), running_mean, tracked, late
    changing = 6 * 4 + 8
    for rank, (steps, agreed) in enumerate(results):
        assert agreed == ["running_mean", "tracked"], "measured on every rank alike, in one collective"
        for step, (ops, same, buffers, warned) in enumerate(steps):
            expected = everything if step == 0 else changing
            assert ops == [("broadcast_coalesced", 0 if rank == 0 else expected)], (rank, step, ops)
            if step < 3 or rank != 1:  # rank 1's own change to "late" is the one thing DDP would undo
                assert same, f"rank {rank} step {step}: buffers differ from DDP's broadcast"
            for name, value in buffers.items():
                if name != "late":
                    assert torch.equal(value, results[0][0][step][2][name]), (rank, step, name)
            # A buffer that stayed put in the first step and moved later is named, once, where it moved.
            assert warned == (["buffer 'late' did not change in the first training step but had by step 4: it "
                               "is no longer sent from rank 0 each step, so ranks may disagree on it"]
                              if step == 3 and rank == 1 else []), (rank, step, warned)


def _constant_only(rank, world):
    module = torch.nn.Module()
    module.register_buffer("offsets", torch.arange(4) * (rank + 1))  # rank 0's must win, once
    comm = Communicator()
    sync = BufferBroadcast(module, comm)
    ops = []
    for _ in range(4):
        sync.before_step()
        ops.append([r.op for r in comm.ledger.drain()])
    return ops, module.offsets


@pytest.mark.multiprocess
def test_a_model_whose_buffers_never_change_broadcasts_nothing_after_the_first_step():
    for ops, offsets in run_workers(_constant_only, 2):
        assert ops == [["broadcast_coalesced"], [], [], []]
        assert offsets.tolist() == [0, 1, 2, 3]
