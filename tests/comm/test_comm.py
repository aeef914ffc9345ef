"""Accounted collectives: results equal torch.distributed's, bytes equal the closed forms."""

import time

import pytest
import torch

from ddlscale.cluster import run_workers
from ddlscale.comm import Communicator, volume


def test_even_split_sums_and_balances():
    for total in (0, 1, 7, 10, 1001):
        for parts in (1, 2, 3, 4):
            sizes = volume.even_split(total, parts)
            assert sum(sizes) == total and max(sizes) - min(sizes) <= 1


def test_ring_allreduce_volume_is_two_n_minus_one_over_n():
    # 1200 elements of 4 bytes on 4 ranks: each rank moves 2 * 3/4 * 4800 bytes each way.
    assert volume.ring_allreduce(1200, 4, 4, 2) == (7200, 7200)
    assert volume.ring_allreduce(1200, 4, 1, 0) == (0, 0)
    # Uneven: 10 elements on 3 ranks -> chunks 4,3,3.
    assert volume.ring_allreduce(10, 4, 3, 0) == (48, 48)
    assert volume.ring_allreduce(10, 4, 3, 1) == (56, 56)


def _exercise(rank, world):
    comm = Communicator()
    out = {}
    t = torch.arange(10, dtype=torch.float32) * (rank + 1)
    comm.allreduce(t).wait()
    out["allreduce"] = t
    out["allgather"] = torch.stack(comm.allgather(torch.full((3,), float(rank))).wait())
    piece = torch.arange(rank + 1, dtype=torch.int32)  # lengths 1..n
    out["allgather_uneven"] = [x.clone() for x in comm.allgather_uneven(piece).wait()]
    big = torch.full(((rank + 1) * 20_000,), rank, dtype=torch.int32)  # past SMALL_BYTES: no padding
    out["allgather_big"] = [x.clone() for x in comm.allgather_uneven(big, [(r + 1) * 20_000 for r in range(world)]).wait()]
    # all-to-all: rank r sends (j + 1) copies of value 10r + j to rank j.
    in_splits = [j + 1 for j in range(world)]
    send = torch.cat([torch.full((j + 1,), float(10 * rank + j)) for j in range(world)])
    out_splits = [rank + 1] * world
    recv = torch.empty(sum(out_splits))
    comm.all_to_all(recv, send, out_splits, in_splits).wait()
    out["all_to_all"] = recv
    chunk = torch.empty(2)
    comm.reduce_scatter(chunk, torch.arange(2 * world, dtype=torch.float32)).wait()
    out["reduce_scatter"] = chunk
    b = torch.full((5,), float(rank))
    comm.broadcast(b, src=world - 1).wait()
    out["broadcast"] = b
    gathered = comm.gather(torch.tensor([float(rank)]), dst=0).wait()
    out["gather"] = None if gathered is None else torch.cat(gathered)
    if world > 1:
        if rank == 0:
            comm.send(torch.ones(6), dst=1).wait()
        elif rank == 1:
            out["recv"] = comm.recv(torch.zeros(6), src=0).wait()
    peer = rank ^ 1  # swap with a neighbour, sizes past one gloo segment and different each way
    if peer < world:
        mine = torch.full(((rank + 1) * 70_000,), rank, dtype=torch.int32)
        out["sendrecv"] = comm.sendrecv(mine, torch.empty((peer + 1) * 70_000, dtype=torch.int32), peer).wait()
    out["records"] = [(r.op, r.bytes_sent, r.bytes_recv, r.end is not None and r.end >= r.start)
                      for r in comm.ledger.records]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_results_and_bytes(world):
    results = run_workers(_exercise, world)
    n = world
    for rank, out in enumerate(results):
        expected_sum = torch.arange(10, dtype=torch.float32) * sum(range(1, n + 1))
        assert torch.equal(out["allreduce"], expected_sum)
        assert torch.equal(out["allgather"], torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3))
        assert [x.tolist() for x in out["allgather_uneven"]] == [list(range(k + 1)) for k in range(n)]
        assert out["all_to_all"].tolist() == [float(10 * src + rank) for src in range(n) for _ in range(rank + 1)]
        assert torch.equal(out["reduce_scatter"], n * torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32))
        assert torch.equal(out["broadcast"], torch.full((5,), float(n - 1)))
        if rank == 0:
            assert out["gather"].tolist() == [float(r) for r in range(n)]
        if rank == 1:
            assert torch.equal(out["recv"], torch.ones(6))

        records = {}
        for op, sent, recv, _ in out["records"]:
            records.setdefault(op, (sent, recv))
        assert all(done for *_, done in out["records"]), "every collective got a completion time"
        chunks = volume.even_split(10, n)
        assert records["allreduce"] == (2 * (10 - chunks[rank]) * 4,) * 2
        assert records["allgather"] == ((n - 1) * 12, (n - 1) * 12)
        # Small uneven pieces go through one padded native allgather (padding charged)...
        assert records["allgather_uneven"] == ((n - 1) * n * 4, (n - 1) * n * 4)
        # ...large ones straight to each peer, unpadded: rank r's piece has (r + 1) * 20000 int32s.
        assert [x.unique().tolist() for x in out["allgather_big"]] == [[r] for r in range(n)]
        uneven = [op for op in out["records"] if op[0] == "allgather_uneven"][1]
        assert uneven[1:3] == ((n - 1) * (rank + 1) * 80_000, (sum(range(1, n + 1)) - rank - 1) * 80_000)
        sent_a2a = sum((j + 1) * 4 for j in range(n) if j != rank)
        exchanges = [op[1:3] for op in out["records"] if op[0] == "all_to_all"]
        assert exchanges[0] == ((n - 1) * 8, (n - 1) * 8)  # the uneven allgather's sizes: one int64 to each peer
        assert exchanges[1:] == [(sent_a2a, (n - 1) * (rank + 1) * 4)]
        assert records["reduce_scatter"] == ((n - 1) * 8, (n - 1) * 8)
        assert records["broadcast"] == (((n - 1) * 20, 0) if rank == n - 1 else (0, 20))
        assert records["gather"] == ((0, (n - 1) * 4) if rank == 0 else (4, 0))
        if rank == 0:
            assert records["send"] == (24, 0)
        if rank == 1:
            assert records["recv"] == (0, 24)
        if rank ^ 1 < n:
            assert torch.equal(out["sendrecv"], torch.full((((rank ^ 1) + 1) * 70_000,), rank ^ 1, dtype=torch.int32))
            assert records["sendrecv"] == ((rank + 1) * 280_000, ((rank ^ 1) + 1) * 280_000)


def _skewed_all_to_all(rank, world):
    """Uneven all-to-alls whose bytes cross SMALL_BYTES on some ranks only."""
    comm = Communicator()
    # Rank 0 sends 2 x 53.6 KB (past the threshold), the others send nothing and receive 53.6 KB
    # (below it): a choice from each rank's own bytes sent them down different paths and hung.
    big = 13_400  # float32s
    in_splits = [0] + [big] * (world - 1) if rank == 0 else [0] * world
    out_splits = [big if rank > 0 and src == 0 else 0 for src in range(world)]
    private = torch.empty(sum(out_splits))
    comm.all_to_all(private, torch.full((sum(in_splits),), 7.0), out_splits, in_splits).wait()
    # The same skewed splits on every rank: rank 0 receives 2 x 40 KB, every rank sends 40 KB + 40 B.
    splits = [10_000, 10, 10]
    send = torch.cat([torch.full((s,), float(10 * rank + j)) for j, s in enumerate(splits)])
    shared = torch.empty(world * splits[rank])
    comm.all_to_all(shared, send, [splits[rank]] * world, splits, same_splits=True).wait()
    return private, shared


@pytest.mark.multiprocess
def test_skewed_all_to_all_takes_one_path_on_every_rank():
    world = 3
    for rank, (private, shared) in enumerate(run_workers(_skewed_all_to_all, world, timeout_s=20)):
        assert torch.equal(private, torch.full((13_400 if rank else 0,), 7.0))
        splits = [10_000, 10, 10]
        expected = torch.cat([torch.full((splits[rank],), float(10 * src + rank)) for src in range(world)])
        assert torch.equal(shared, expected)


def _exchange(rank, world, framed):
    """Messages of sizes the receivers do not know: empty, small, and past the first segment."""
    from ddlscale.comm.collectives import HEADER_BYTES, Message

    comm = Communicator()
    comm.piece_bytes = 4096 if framed else None  # None: sizes first, as on NCCL (gloo runs both)
    peers = [p for p in range(world) if p != rank]
    sizes = {p: (0, 17, 4096 - HEADER_BYTES, 5 * 4096 + 3)[(rank + p) % 4] for p in peers}
    messages = {p: Message.of(torch.full((sizes[p],), rank * 16 + p, dtype=torch.uint8)) for p in peers}
    got = comm.exchange(messages, peers)
    # Sizes depend on rank + peer: what p sends this rank is as long as what this rank sends p.
    ok = all(torch.equal(got[p], torch.full((sizes[p],), p * 16 + rank, dtype=torch.uint8)) for p in peers)
    same = Message.of(torch.arange(10_000, dtype=torch.int32))  # one message to everyone: an allgather
    gathered = comm.exchange(dict.fromkeys(peers, same), peers)
    ok &= all(torch.equal(gathered[p].view(torch.int32), torch.arange(10_000, dtype=torch.int32)) for p in peers)
    record = comm.ledger.records[0]
    return ok, record.bytes_sent, record.bytes_recv, sizes


@pytest.mark.multiprocess
@pytest.mark.parametrize("framed", [True, False])
def test_exchange_of_unknown_sizes(framed):
    world = 4
    results = run_workers(_exchange, world, framed)
    for rank, (ok, sent, recv, sizes) in enumerate(results):
        assert ok, rank
        assert sent == sum(8 + size for size in sizes.values())  # every length travels and is charged
        assert recv == sum(8 + results[p][3][rank] for p in sizes)


def _one_rank_hangs(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


@pytest.mark.multiprocess
def test_run_workers_names_a_rank_that_never_reports_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] reported nothing within 6 s"):
        run_workers(_one_rank_hangs, 2, timeout_s=3)
    assert time.monotonic() - start < 20


def _probe_exchange(rank, world):
    from ddlscale.comm.probe import probe_exchange

    return probe_exchange(None, world, totals=(1 << 20, 8 << 20), calls=3)


@pytest.mark.multiprocess
def test_exchange_probe_fits_a_rate_and_a_fixed_cost_from_two_sizes():
    """The line through the two medians passes through both. Which exchange is slower is not asserted:
    on a busy host the larger can be timed no slower, and the probe then keeps a tiny positive slope."""
    for probe in run_workers(_probe_exchange, 2, timeout_s=60):
        small, large = probe["times_s"]
        assert small > 0 and large > 0
        assert 0 < probe["bandwidth_bps"] < float("inf") and probe["fixed_s"] >= 0
        per_bit = 1 / probe["bandwidth_bps"]
        carried = [(2 - 1) * total // 2 * 8 for total in probe["totals"]]  # bits each NIC carries each way
        # The slope is the two medians' difference over the two sizes' (at least the probe's floor) ...
        rise = max(large - small, 1e-9)
        assert rise == pytest.approx((carried[1] - carried[0]) * per_bit, rel=1e-6)
        # ... and the intercept puts the line through both, unless it came out negative (the small
        # exchange faster than the rate says: a noisy host) and was clamped at 0.
        if probe["fixed_s"] > 0:
            assert small == pytest.approx(probe["fixed_s"] + carried[0] * per_bit, rel=1e-6)
        else:
            assert small <= carried[0] * per_bit
