"""The alpha-beta cost model and the iteration timeline against hand-computed closed forms."""

import random

import numpy as np
import pytest

from ddlscale.comm import volume
from ddlscale.comm.network import PROJECTION_WORKERS, NetworkModel, project
from ddlscale.comm.timeline import Swaps, TensorTask, iteration_time, simulate
from ddlscale.sync.sparse.traffic import ONE_SEGMENT, RoundCosts, Sparsity
from ddlscale.sync.sparse.zen import ZenCost
from ddlscale.units import parse_bandwidth, parse_time

GBIT = 1e9
ALPHA = 50e-6


def gigabit(**kwargs) -> NetworkModel:
    """1 Gbit/s NICs, 50 us latency."""
    return NetworkModel(bandwidth_bps=GBIT, latency_s=ALPHA, **kwargs)


def wire_bytes(seconds: float, model: NetworkModel) -> float:
    """Bytes that take ``seconds`` on the NIC (the beta term, read back)."""
    return seconds * model.bandwidth_bps / 8


# -- units ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, bps", [
    ("1gbit", 1e9), ("100mbit", 1e8), ("500kbit", 5e5), ("25gbps", 25e9), ("1000", 1000.0),
    (" 2.5 Gbit ", 2.5e9), ("1kibit", 1024.0), ("3bit", 3.0), (1e6, 1e6), (".5mbit", 5e5),
])
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text, seconds", [
    ("50us", 50e-6), ("2ms", 2e-3), ("0.1s", 0.1), (3, 3.0), ("1e-3", 1e-3), ("7usec", 7e-6), ("4", 4.0),
])
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["fast", "10 furlongs", "-1gbit", "", "1gbit/s", True, float("inf")])
def test_parse_bandwidth_rejects_and_names_the_value(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["5 minutes", "abc", "-2ms", "nan"])
def test_parse_time_rejects_and_names_the_value(bad):
    with pytest.raises(ValueError, match=repr(bad)[1:-1]):
        parse_time(bad)


def test_network_model_of_parses_and_defaults():
    model = NetworkModel.of(bandwidth="10gbit", latency="20us", gpus_per_machine=4)
    assert model.bandwidth_bps == pytest.approx(1e10)
    assert model.latency_s == pytest.approx(20e-6)
    assert model.intra_bandwidth_bps == pytest.approx(1e12)  # 100x the NIC
    assert model.intra_latency_s == pytest.approx(5e-6)
    assert model.efficiency == {}
    assert NetworkModel.of() == NetworkModel(bandwidth_bps=1e9, latency_s=50e-6)


@pytest.mark.parametrize("kwargs, key", [
    ({"bandwidth": 0}, "cluster.bandwidth"),
    ({"bandwidth": "fast"}, "cluster.bandwidth"),
    ({"latency": "-1us"}, "cluster.latency"),
    ({"gpus_per_machine": 0}, "cluster.gpus_per_machine"),
    ({"intra_bandwidth": "0gbit"}, "cluster.intra_bandwidth"),
    ({"efficiency": {"allgahter": 2.0}}, "cluster.efficiency"),
    ({"efficiency": {"allgather": 0.0}}, "cluster.efficiency.allgather"),
])
def test_network_model_validation_names_the_config_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        NetworkModel.of(**kwargs)


# -- collectives against closed forms ------------------------------------------------------------
def test_ring_allreduce_closed_form():
    # 4 ranks, 4 MB: 2*3 steps of (50 us + 1 MB * 8 / 1 Gbit/s).
    assert gigabit().allreduce(4_000_000, 4) == pytest.approx(6 * (ALPHA + 8e-3))
    assert gigabit().allreduce(4_000_000, 1) == 0.0


def test_other_collectives_closed_forms():
    model = gigabit()
    piece = 1_000_000
    beta = piece * 8 / GBIT
    assert model.allgather(piece, 4) == pytest.approx(3 * (ALPHA + beta))
    assert model.allgather(piece, 4, algorithm="recursive_doubling") == pytest.approx(2 * ALPHA + 3 * beta)
    assert model.reduce_scatter(4 * piece, 4) == pytest.approx(3 * (ALPHA + beta))
    assert model.broadcast(piece, 4) == pytest.approx(3 * (ALPHA + beta))
    assert model.broadcast(piece, 8, algorithm="tree") == pytest.approx(3 * (ALPHA + beta))
    assert model.allreduce(piece, 8, algorithm="tree") == pytest.approx(6 * (ALPHA + beta))
    assert model.allreduce(piece, 8, algorithm="recursive_doubling") == pytest.approx(3 * (ALPHA + beta))
    assert model.gather([10, 20, 30, 40], 4) == pytest.approx(3 * ALPHA + 90 * 8 / GBIT)
    assert model.send(piece) == pytest.approx(ALPHA + beta)
    # Uneven allgather pieces cost what padding them to the longest costs.
    assert model.allgather([1, piece, 5, 7], 4) == pytest.approx(model.allgather(piece, 4))
    # Balanced all-to-all: 100 bytes to each of 3 peers -> 300 bytes through each NIC.
    assert model.all_to_all([[100] * 4] * 4) == pytest.approx(3 * ALPHA + 300 * 8 / GBIT)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_beta_term_bytes_equal_volume_bytes(n):
    model = NetworkModel(bandwidth_bps=GBIT, latency_s=0.0)
    numel, elem = 840, 4  # 840 is divisible by 2, 3, 4 and 8: every rank moves the same bytes
    for rank in range(n):
        sent, recv = volume.ring_allreduce(numel, elem, n, rank)
        assert wire_bytes(model.allreduce(numel * elem, n), model) == pytest.approx(sent) == recv
        assert wire_bytes(model.allgather(numel * elem, n), model) == pytest.approx(
            volume.ring_allgather([numel * elem] * n, rank)[0])
        assert wire_bytes(model.reduce_scatter(numel * elem, n), model) == pytest.approx(
            volume.ring_reduce_scatter(numel * elem // n, n)[0])
    # An uneven split: the model's bytes are the mean over ranks of the accounted bytes.
    mean_sent = sum(volume.ring_allreduce(10, elem, n, r)[0] for r in range(n)) / n
    assert wire_bytes(model.allreduce(10 * elem, n), model) == pytest.approx(mean_sent)
    # Flat broadcast and gather: the root's bytes.
    assert wire_bytes(model.broadcast(1000, n), model) == pytest.approx(volume.flat_broadcast(1000, n, 0, 0)[0])
    pieces = [100 * (r + 1) for r in range(n)]
    assert wire_bytes(model.gather(pieces, n), model) == pytest.approx(volume.flat_gather(pieces, 0, 0)[1])
    # All-to-all: the busiest rank's larger direction.
    rng = random.Random(n)
    matrix = [[rng.randrange(1000) for _ in range(n)] for _ in range(n)]
    columns = [list(col) for col in zip(*matrix, strict=True)]
    busiest = max(max(volume.all_to_all(matrix[r], columns[r], r)) for r in range(n))
    assert wire_bytes(model.all_to_all(matrix), model) == pytest.approx(busiest)


def test_all_to_all_busiest_nic_decides():
    model = gigabit()
    balanced = [[0 if i == j else 100 for j in range(4)] for i in range(4)]
    skewed = [[400 if j == 0 and i != 0 else 0 for j in range(4)] for i in range(4)]  # all into rank 0
    assert sum(map(sum, balanced)) == sum(map(sum, skewed))
    assert model.all_to_all(skewed) == pytest.approx(3 * ALPHA + 1200 * 8 / GBIT)
    assert model.all_to_all(skewed) > model.all_to_all(balanced)


def test_all_to_all_inside_a_machine_uses_the_intra_link():
    model = gigabit(gpus_per_machine=2, intra_bandwidth_bps=10 * GBIT)
    # Ranks 0,1 on machine 0 and 2,3 on machine 1: only in-machine blocks.
    matrix = [[0, 1000, 0, 0], [1000, 0, 0, 0], [0, 0, 0, 1000], [0, 0, 1000, 0]]
    assert model.all_to_all(matrix) == pytest.approx(3 * ALPHA + 1000 * 8 / (10 * GBIT))
    # A uniform block size equals the uniform matrix: each machine's NIC carries 2 ranks x 6 blocks.
    uniform = [[0 if i == j else 10 for j in range(8)] for i in range(8)]
    assert model.all_to_all(10, 8) == pytest.approx(model.all_to_all(uniform))
    assert model.all_to_all(10, 8) == pytest.approx(7 * ALPHA + 2 * 6 * 10 * 8 / GBIT)


def test_direct_allgather_is_an_all_to_all_of_each_rank_piece():
    model = gigabit()
    pieces = [100, 300, 0, 200]
    matrix = [[p] * 4 for p in pieces]
    assert model.allgather(pieces, 4, algorithm="direct") == pytest.approx(model.all_to_all(matrix))
    # Every NIC sends its piece three times; the busiest sends 900 bytes, one round of alphas.
    assert model.allgather(pieces, 4, algorithm="direct") == pytest.approx(3 * ALPHA + 900 * 8 / GBIT)


def test_rings_and_exchanges_across_multi_gpu_machines():
    k, intra_bps = 4, 100 * GBIT
    model = gigabit(gpus_per_machine=k)
    nbytes, n = 8_000_000, 16  # 4 machines
    # Flat ring: one inter-machine edge per machine, each step bottlenecked by the NIC.
    assert model.allreduce(nbytes, n) == pytest.approx(2 * (n - 1) * (ALPHA + nbytes / n * 8 / GBIT))
    # Recursive doubling: distances 1, 2 stay inside a machine; 4, 8 put 4 ranks' data on each NIC.
    inside = 5e-6 + nbytes * 8 / intra_bps
    across = ALPHA + k * nbytes * 8 / GBIT
    assert model.allreduce(nbytes, n, "recursive_doubling") == pytest.approx(2 * inside + 2 * across)
    # Hierarchical: intra reduce-scatter + allgather, 4 concurrent rings over 4 machines sharing the NIC.
    hierarchical = 2 * 3 * (5e-6 + nbytes / k * 8 / intra_bps) + 2 * 3 * (ALPHA + nbytes / 4 * 8 / GBIT)
    assert model.allreduce(nbytes, n, "hierarchical") == pytest.approx(hierarchical)
    # All ranks on one machine: only intra links.
    assert model.allreduce(nbytes, 4) == pytest.approx(6 * (5e-6 + nbytes / 4 * 8 / intra_bps))


def test_hierarchical_beats_flat_ring_with_fast_intra_links():
    model = gigabit(gpus_per_machine=8)
    for nbytes in (1_000, 100_000_000):
        assert model.allreduce(nbytes, 64, "hierarchical") < model.allreduce(nbytes, 64, "ring")
    one_per_machine = gigabit()
    assert one_per_machine.allreduce(10**6, 8, "hierarchical") == pytest.approx(one_per_machine.allreduce(10**6, 8))


def test_bad_algorithm_and_sizes_are_rejected():
    model = gigabit(gpus_per_machine=4)
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        model.allreduce(10, 4, "butterfly")
    with pytest.raises(ValueError, match="power-of-two"):
        model.allreduce(10, 6, "recursive_doubling")
    with pytest.raises(ValueError, match="multiple of gpus_per_machine"):
        model.allreduce(10, 6, "hierarchical")
    with pytest.raises(ValueError, match="piece_bytes"):
        model.allgather([1, 2], 3)
    with pytest.raises(ValueError, match="nbytes"):
        model.allreduce(-1, 4)


def test_efficiency_scales_only_its_collective():
    plain = gigabit()
    calibrated = gigabit(efficiency={"allgather": 2.0})
    assert calibrated.allgather(10**6, 4) == pytest.approx(2 * plain.allgather(10**6, 4))
    assert calibrated.allreduce(10**6, 4) == pytest.approx(plain.allreduce(10**6, 4))


def test_an_array_of_sizes_prices_one_collective_per_element():
    """The fusion DP prices a row of groups at once: each element as the scalar call prices it."""
    rng = random.Random(0)
    for _ in range(100):
        net = NetworkModel(rng.choice([1e8, 1e9, 1e10]), rng.choice([5e-6, 5e-5]), rng.choice([1, 2, 4]),
                           efficiency={"allgather": 1.7, "gather": 1.1})
        n = rng.choice([1, 2, 4, 8, 16])
        sizes = np.array([rng.choice([0.0, rng.uniform(0, 1e7), 65536.0, 65537.0]) for _ in range(20)])
        for collective in (net.allreduce, net.allgather, net.all_to_all, net.reduce_scatter, net.gather, net.broadcast):
            together = np.broadcast_to(collective(sizes, n), sizes.shape)
            assert together == pytest.approx([collective(float(b), n) for b in sizes], rel=1e-12)
    with pytest.raises(ValueError, match="piece_bytes must be finite numbers >= 0, got -1.0"):
        net.allgather(np.array([1.0, -1.0]), 4)
    with pytest.raises(ValueError, match="ring only"):
        net.allgather(np.array([1.0]), 4, "direct")


def test_project_over_cluster_sizes():
    model = gigabit(gpus_per_machine=8)
    points = project(10**8, "allreduce", model=model)
    assert [n for n, _ in points] == list(PROJECTION_WORKERS) == [16, 32, 64, 128, 256, 512, 1024]
    assert all(seconds == pytest.approx(model.allreduce(10**8, n)) for n, seconds in points)
    assert [s for _, s in points] == sorted(s for _, s in points)  # more ranks, more latency steps
    hier = project(10**8, "allreduce", [16, 64], model=model, algorithm="hierarchical")
    assert hier[1][1] == pytest.approx(model.allreduce(10**8, 64, "hierarchical"))
    a2a = project(1600, "all_to_all", [16], model=model)
    assert a2a[0][1] == pytest.approx(model.all_to_all(100, 16))


# -- Zen's schemes: ZenCost, the one cost routing uses -------------------------------------------------
def t_bp(M, d, gamma_n, n, model, value_bytes=4):
    """T_bp = (n-1)/n * (gamma_n + 1) * 2 M d words / b + 2(n-1) alpha: ZenCost's COO pull on elements
    (width 1), every message in one segment (one message per peer and exchange)."""
    s = Sparsity(M, d, gamma_n, None, n, 1, value_bytes)
    return ZenCost(scheme="bp", pull="coo").traffics(s, ONE_SEGMENT)["bp-coo"].seconds(RoundCosts.textbook(model, n))


def t_hc(M, d, gammas, n, model, value_bytes=4):
    """T_hc = sum_{i=1..log2 n} gamma_{2^(i-1)} * 2 M d words / b + log2(n) alpha: ZenCost's HC, merges free."""
    s = Sparsity(M, d, gammas[-1], list(gammas), n, 1, value_bytes)
    return ZenCost(scheme="hc").traffics(s, ONE_SEGMENT)["hc"].seconds(RoundCosts.textbook(model, n))


def test_zen_formulas_by_hand():
    model = gigabit()
    M, d = 1_000_000, 0.01  # 2 M d = 20,000 words per worker
    # BP, n = 4, gamma_4 = 3: 3/4 * 4 * 20,000 words = 60,000 words = 240,000 bytes.
    bp = t_bp(M, d, 3.0, 4, model)
    assert bp == pytest.approx(6 * ALPHA + 240_000 * 8 / GBIT)
    # bf16 values: 30,000 non-zeros of (4-byte index + 2-byte value) = 180,000 bytes.
    assert t_bp(M, d, 3.0, 4, model, value_bytes=2) == pytest.approx(
        6 * ALPHA + 180_000 * 8 / GBIT)
    # HC, n = 4: (gamma_1 + gamma_2) * 20,000 words = 2.8 * 20,000 = 56,000 words.
    hc = t_hc(M, d, [1.0, 1.8], 4, model)
    assert hc == pytest.approx(2 * ALPHA + 224_000 * 8 / GBIT)
    # bf16 values: 28,000 non-zeros of (4-byte index + 2-byte value) = 168,000 bytes.
    assert t_hc(M, d, [1.0, 1.8], 4, model, value_bytes=2) == pytest.approx(
        2 * ALPHA + 168_000 * 8 / GBIT)
    # A trailing gamma_n is accepted and ignored.
    assert t_hc(M, d, [1.0, 1.8, 3.0], 4, model) == pytest.approx(hc)
    assert t_bp(M, d, 1.0, 1, model) == 0.0


def test_zen_scheme_ordering():
    model = gigabit()
    M, d = 10_000_000, 0.01
    # Full overlap (gamma_k = 1): BP's 2 (n-1)/n beats HC's log2 n.
    n = 16
    assert t_bp(M, d, 1.0, n, model) < t_hc(
        M, d, [1.0] * 4, n, model)
    # No overlap (gamma_k = k) on few workers: HC's n-1 beats BP's (n^2-1)/n.
    n = 4
    assert t_hc(M, d, [1.0, 2.0], n, model) < t_bp(
        M, d, 4.0, n, model)


def test_zen_rejects_bad_gammas():
    model = gigabit()
    with pytest.raises(ValueError, match="gamma_4"):
        t_bp(100, 0.1, 5.0, 4, model)
    with pytest.raises(ValueError, match="gammas"):
        t_hc(100, 0.1, [1.0], 8, model)
    with pytest.raises(ValueError, match="power-of-two"):
        t_hc(100, 0.1, [1.0, 2.0], 6, model)
    with pytest.raises(ValueError, match="gamma_2"):
        t_hc(100, 0.1, [1.0, 2.5], 4, model)


# -- timeline ------------------------------------------------------------------------------------
def test_no_overlap_is_the_sum():
    tasks = [TensorTask(f"t{i}", 1.0, 0.0, 0.25 * (i + 1), 0.0) for i in range(3)]
    timeline = simulate(tasks, backward_end_s=1.0, optimizer_s=0.1)
    assert timeline.iteration_s == pytest.approx(1.0 + 0.25 + 0.5 + 0.75 + 0.1)
    one = simulate([TensorTask("w", 1.0, 0.2, 0.3, 0.4)], backward_end_s=1.0, optimizer_s=0.1)
    assert one.iteration_s == pytest.approx(1.0 + 0.2 + 0.3 + 0.4 + 0.1)


def test_a_lagging_rank_delays_the_collective_not_this_ranks_compute():
    # Encode at ready (1.2 stolen from backward), the collective waits 0.5 for the slowest rank.
    one = simulate([TensorTask("w", 1.0, 0.2, 0.3, 0.4, True, lag_s=0.5)], backward_end_s=1.0)
    span = one.tensors[0]
    assert (span.encode_end, span.comm_start, span.comm_end) == pytest.approx((1.2, 1.7, 2.0))
    assert one.iteration_s == pytest.approx(2.4) and one.backward_end_s == pytest.approx(1.6)
    # Behind a busy communication stream a smaller lag costs nothing.
    busy = [TensorTask("a", 0.0, 0.0, 1.0, 0.0), TensorTask("b", 0.1, 0.0, 0.1, 0.0, lag_s=0.5)]
    assert simulate(busy, backward_end_s=0.1).iteration_s == pytest.approx(1.1)
    with pytest.raises(ValueError, match="lag_s"):
        simulate([TensorTask("x", 0.0, 0, 0, 0, lag_s=-1.0)], backward_end_s=1.0)


def test_full_overlap_hides_communication():
    tasks = [TensorTask(f"t{i}", 0.1 * (i + 1), 0.01, 0.05, 0.01) for i in range(9)]
    timeline = simulate(tasks, backward_end_s=1.0, optimizer_s=0.2)
    assert timeline.iteration_s == pytest.approx(1.2)
    last = timeline.tensors[-1]
    assert (last.encode_start, last.comm_start, last.comm_end, last.decode_end) == pytest.approx(
        (0.9, 0.91, 0.96, 0.97))


def test_compute_stream_encode_delays_later_gradients_and_backward():
    tasks = [
        TensorTask("a", 0.1, 0.05, 0.01, 0.02, encode_on_compute=True),
        TensorTask("b", 0.2, 0.0, 0.01, 0.0),
    ]
    timeline = simulate(tasks, backward_end_s=1.0)
    a, b = timeline.tensors
    assert a.ready == pytest.approx(0.1) and a.encode_end == pytest.approx(0.15)
    assert a.decode_end == pytest.approx(0.15 + 0.01 + 0.02)
    assert b.ready == pytest.approx(0.2 + 0.07)
    assert timeline.backward_end_s == pytest.approx(1.07) == timeline.iteration_s


def test_side_stream_serves_encodes_and_decodes_in_arrival_order():
    # b's gradient arrives before a's message does: b is encoded first, then both are decoded.
    early = simulate([TensorTask("a", 0.0, 1, 1, 1), TensorTask("b", 0.5, 1, 1, 1)], backward_end_s=1.0)
    assert [(t.encode_start, t.comm_start, t.decode_start, t.decode_end) for t in early.tensors] == [
        (0, 1, 2, 3), (1, 2, 3, 4)]
    assert early.iteration_s == 4
    # b's gradient arrives after a's message: a is decoded first and b's encode waits for it.
    late = simulate([TensorTask("a", 0.0, 1, 1, 1), TensorTask("b", 2.5, 1, 1, 1)], backward_end_s=2.5)
    assert [(t.encode_start, t.comm_start, t.decode_start, t.decode_end) for t in late.tensors] == [
        (0, 1, 2, 3), (3, 4, 5, 6)]


def flat(spans) -> list[float]:
    return [t for span in spans for t in span]


def test_idle_gaps_are_exact():
    tasks = [
        TensorTask("a", 0.1, 0.0, 0.1, 0.0),
        TensorTask("b", 0.2, 0.0, 0.1, 0.0),  # touches a: one busy span 0.1-0.3
        TensorTask("c", 0.5, 0.0, 0.1, 0.0),
    ]
    timeline = simulate(tasks, backward_end_s=0.8, optimizer_s=0.2)
    assert flat(timeline.comm_busy) == pytest.approx([0.1, 0.3, 0.5, 0.6])
    assert flat(timeline.idle_gaps()) == pytest.approx([0.0, 0.1, 0.3, 0.5, 0.6, 1.0])
    assert flat(timeline.idle_gaps(min_s=0.25)) == pytest.approx([0.6, 1.0])


def test_matches_espresso_recursion_and_never_ends_before_backward():
    rng = random.Random(0)
    for _ in range(200):
        backward_end = rng.uniform(0.1, 2.0)
        readies = sorted(rng.uniform(0, backward_end) for _ in range(rng.randrange(1, 12)))
        tasks = [TensorTask(f"t{i}", r, 0.0, rng.uniform(0, 0.3), 0.0) for i, r in enumerate(readies)]
        finish = 0.0
        for task in tasks:
            finish = max(finish, task.ready_s) + task.comm_s
        timeline = simulate(tasks, backward_end)
        assert timeline.tensors[-1].comm_end == pytest.approx(finish)
        assert timeline.iteration_s == pytest.approx(max(finish, backward_end))

        mixed = [TensorTask(t.name, t.ready_s, rng.uniform(0, 0.1), t.comm_s, rng.uniform(0, 0.1),
                            encode_on_compute=rng.random() < 0.5) for t in tasks]
        timeline = simulate(mixed, backward_end, optimizer_s=0.05)
        assert timeline.iteration_s >= timeline.backward_end_s + 0.05 >= backward_end + 0.05
        for span in timeline.tensors:
            assert span.ready <= span.encode_start <= span.encode_end <= span.comm_start
            assert span.comm_start <= span.comm_end <= span.decode_start <= span.decode_end
            assert span.decode_end <= timeline.iteration_s


def test_swaps_score_changed_plans_as_the_simulator_does():
    """A search's O(1) scoring of one- and two-task changes equals simulating the changed plan."""
    rng = random.Random(3)

    def task(name: str, ready: float) -> TensorTask:
        zero = rng.random() < 0.2  # free encodes and decodes, and messages that take no time
        return TensorTask(name, ready, 0.0 if zero else rng.uniform(0, 0.05), rng.choice([0.0, rng.uniform(0, 0.2)]),
                          0.0 if zero else rng.uniform(0, 0.05), True, rng.choice([0.0, rng.uniform(0, 0.02)]))

    for _ in range(300):
        backward_end = rng.uniform(0.1, 2.0)
        readies = sorted(rng.uniform(0, backward_end) for _ in range(rng.randrange(1, 15)))
        tasks = [task(f"t{i}", r) for i, r in enumerate(readies)]
        swaps = Swaps.of(tasks, backward_end, optimizer_s=0.03)
        timeline = simulate(tasks, backward_end, optimizer_s=0.03)  # what Property 1 reads off it
        assert [t for span in swaps.comm for t in span] == pytest.approx(
            [t for span in timeline.tensors for t in (span.comm_start, span.comm_end)], rel=1e-12)
        assert swaps.backward_end_s == pytest.approx(timeline.backward_end_s, rel=1e-12)
        assert swaps.last_decode_s == pytest.approx(max(span.decode_end for span in timeline.tensors), rel=1e-12)
        for _ in range(5):
            at = rng.sample(range(len(tasks)), min(len(tasks), rng.choice([1, 2, 3])))
            changes = {i: task(f"new{i}", tasks[i].ready_s) for i in at}
            changed = [changes.get(i, t) for i, t in enumerate(tasks)]
            assert swaps.time(changes) == pytest.approx(iteration_time(changed, backward_end, 0.03), rel=1e-12)
    with pytest.raises(ValueError, match="must keep ready time"):
        swaps.time({0: TensorTask("moved", tasks[0].ready_s + 1.0, 0, 0, 0, True)})
    side = TensorTask("side", 0.5, 0.1, 0.1, 0.1, encode_on_compute=False)
    assert Swaps.of([side], 1.0) is None  # a side stream queues its jobs: not a max-plus recursion
    assert Swaps.of([TensorTask("b", 0.6, 0, 1, 0), TensorTask("a", 0.5, 0, 1, 0)], 1.0) is None
    assert Swaps.of([TensorTask("free", 0.5, 0, 1, 0)], 1.0) is not None  # no encode or decode: any stream


def test_timeline_validation():
    with pytest.raises(ValueError, match="after backward_end_s"):
        simulate([TensorTask("late", 2.0, 0, 0, 0)], backward_end_s=1.0)
    with pytest.raises(ValueError, match="x.comm_s"):
        simulate([TensorTask("x", 0.0, 0, -1, 0)], backward_end_s=1.0)
    assert simulate([], backward_end_s=1.0, optimizer_s=0.5).iteration_s == 1.5
    assert simulate([], backward_end_s=1.0).idle_gaps() == [(0.0, 1.0)]


def test_zen_is_offered_to_sparsifiers_alone_and_priced_by_the_union():
    """Espresso's option space holds zen for a sparsifier (not for a quantizer), and its price follows
    the union's bytes: at top-k 1% on 8 ranks it moves less than allgather's n selections, and with
    fewer ranks' selections to merge (2 ranks) the advantage shrinks."""
    from ddlscale.compress import FP16, NoCompression, TopK
    from ddlscale.plan.planner import cost_model
    from ddlscale.plan.pricing import Option
    from ddlscale.plan.synthetic import random_profile

    profile = random_profile(random.Random(3), 4, world_size=8)
    net = NetworkModel.of("1gbit", "100us", 1)
    zen, allgather = Option("default", "zen"), Option("default", "allgather")
    model = cost_model(profile, {"none": NoCompression(), "default": TopK(0.01)}, 8, net)
    assert zen in model.options()
    assert Option("default", "zen") not in cost_model(profile, {"none": NoCompression(), "default": FP16()}, 8,
                                                      net).options()
    comm = {o.scheme: model.costs_of(1 << 22, "torch.float32", o, 0.01)[1] for o in (zen, allgather)}
    assert comm["zen"] < comm["allgather"], comm  # independent selections: the largest union
    pair = cost_model(profile, {"none": NoCompression(), "default": TopK(0.01)}, 2, net)
    two = {o.scheme: pair.costs_of(1 << 22, "torch.float32", o, 0.01)[1] for o in (zen, allgather)}
    assert two["zen"] / two["allgather"] > comm["zen"] / comm["allgather"], (two, comm)
