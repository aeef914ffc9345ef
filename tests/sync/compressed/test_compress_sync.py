"""sync=compress: every scheme against dense allreduce, lossy sums, error feedback, plans, bytes."""

import warnings
import zlib

import pytest
import torch
import torch.distributed as dist

from ddlscale.cluster import run_workers
from ddlscale.compress import build_compressor, packing
from ddlscale.compress.none import NoCompression
from ddlscale.compress.powersgd import PowerSGD
from ddlscale.compress.randomk import RandomK
from ddlscale.compress.sparse import SparseCompressor
from ddlscale.compress.topk import TopK
from ddlscale.sync.compressed import Choices, CompressSync, TensorChoice
from ddlscale.sync.compressed.regroup import _unchunk

SHAPES = {"a": (37, 5), "b": (101,), "c": (8, 8)}


def _params():
    return [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]


def _grads(rank, step=0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {name: torch.randint(-8, 9, shape, generator=g).float() for name, shape in SHAPES.items()}


def _sync_once(sync, params, grads):
    for name, p in reversed(params):  # backward order: last parameter first
        p.grad = grads[name].clone()
        sync.grad_ready(p)
    stats = sync.finish_step()
    return {name: p.grad.clone() for name, p in params}, stats


def _identity(rank, world, comm, hierarchical, fusion):
    params = _params()
    sync = CompressSync(NoCompression(), comm=comm, memory="residual", hierarchical=hierarchical, local_size=2,
                        fusion=fusion, bucket_mb=0.0001, first_bucket_mb=0.0001)
    sync.setup(params)
    out = []
    for step in range(2):
        grads = _grads(rank, step)
        got, _ = _sync_once(sync, params, grads)
        oracle = {}
        for name, g in grads.items():
            oracle[name] = g * (1.0 / world)
            dist.all_reduce(oracle[name])
        out.append((got, oracle))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("comm", ["allreduce", "allgather", "alltoall", "gather"])
def test_identity_through_every_scheme_equals_dense_allreduce(comm, world):
    for steps in run_workers(_identity, world, comm, False, "tensor"):
        for got, oracle in steps:
            for name in SHAPES:
                if world == 3:  # x/3 is inexact: summation order may differ from the ring's
                    torch.testing.assert_close(got[name], oracle[name], rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(got[name], oracle[name]), (comm, world, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("comm", ["allreduce", "allgather", "alltoall", "gather"])
def test_hierarchical_and_bucketed_identity_equal_dense(comm):
    for fusion in ("tensor", "bucket"):
        for steps in run_workers(_identity, 4, comm, True, fusion):
            for got, oracle in steps:
                for name in SHAPES:
                    assert torch.equal(got[name], oracle[name]), (comm, fusion, name)


def _dense_path(rank, world):
    params = _params()
    plan = Choices(default=TensorChoice("none", "allreduce"), tensors={"b": TensorChoice("default", "allgather")})
    sync = CompressSync(TopK(ratio=0.5), choices=plan, memory="residual")
    sync.setup(params)
    grads = _grads(rank)
    got, stats = _sync_once(sync, params, grads)
    oracle = {name: g * (1.0 / world) for name, g in grads.items()}
    for t in oracle.values():
        dist.all_reduce(t)
    buffers = {sync.names[i]: b.buffer for b in sync.buckets for i in b.members}
    in_place = {name: p.grad.untyped_storage().data_ptr() == buffers[name].untyped_storage().data_ptr()
                for name, p in params}
    return got, oracle, {name: sync.memory.residual(name) is not None for name in SHAPES}, in_place


@pytest.mark.multiprocess
def test_uncompressed_allreduce_groups_take_dense_allreduces_own_path():
    """No copies and no residual of zeros for a lossless flat allreduce group; the compressed group
    keeps its error feedback. Results equal dense allreduce bit for bit."""
    for got, oracle, has_residual, in_place in run_workers(_dense_path, 2):
        for name in ("a", "c"):
            assert torch.equal(got[name], oracle[name]), name
        assert has_residual == {"a": False, "b": True, "c": False}
        assert in_place == {"a": True, "b": True, "c": True}  # every gradient is a view of its bucket


def _lossy_allgather(rank, world):
    params = _params()
    sync = CompressSync(TopK(ratio=0.1), comm="allgather", memory="none")
    sync.setup(params)
    grads = _grads(rank)
    got, stats = _sync_once(sync, params, grads)
    # Oracle: every rank's own top-k of its scaled gradient, decompressed, summed.
    mine = {}
    reference = TopK(ratio=0.1)
    for name, g in grads.items():
        mine[name] = reference.decompress(reference.compress(g * (1.0 / world), name))
        dist.all_reduce(mine[name])
    messages = [r for r in stats.collectives if r.op == "allgather_uneven"]
    return got, mine, [(m.bytes_sent, m.bytes_recv) for m in messages]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_lossy_allgather_is_the_sum_of_each_rank_decompressed(world):
    topk = TopK(ratio=0.1)
    for got, oracle, messages in run_workers(_lossy_allgather, world):
        for name in SHAPES:
            torch.testing.assert_close(got[name], oracle[name], rtol=1e-6, atol=1e-6)
        # Each message: the top-k payload plus the packing header, sent to every other rank.
        expected = []
        for name in reversed(list(SHAPES)):
            payload = topk.payload_bytes(SHAPES[name], torch.float32)
            header = 8 * (1 + 2 * (2 + 1))  # count, then (dtype, ndim, length) for values and indices
            expected.append(((world - 1) * (payload + header), (world - 1) * (payload + header)))
        assert messages == expected


def _error_feedback(rank, world, comm):
    params = _params()
    sync = CompressSync(TopK(ratio=0.05), comm=comm, memory="residual")
    sync.setup(params)
    total_sync = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    total_grad = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    for step in range(20):
        grads = _grads(rank, step)
        got, _ = _sync_once(sync, params, grads)
        for name in SHAPES:
            total_sync[name] += got[name].double().float()
            total_grad[name] += grads[name] * (1.0 / world)
    residual = {name: sync.memory.residual(name).reshape(SHAPES[name]).clone() for name in SHAPES}
    for name in SHAPES:
        dist.all_reduce(total_grad[name])
        dist.all_reduce(residual[name])
    return total_sync, total_grad, residual


@pytest.mark.multiprocess
def test_error_feedback_telescopes_across_ranks():
    """sum_t average_t + mean over ranks of e_T = sum_t mean over ranks of g_t (allgather sums exactly)."""
    for total_sync, total_grad, residual in run_workers(_error_feedback, 2, "allgather"):
        for name in SHAPES:
            torch.testing.assert_close(total_sync[name] + residual[name], total_grad[name], rtol=1e-5, atol=1e-4)


def _powersgd(rank, world):
    torch.manual_seed(0)
    u, v = torch.randn(8, 2), torch.randn(2, 8)
    params = [("c", torch.nn.Parameter(torch.zeros(8, 8)))]
    sync = CompressSync(PowerSGD(rank=2), comm="allreduce", memory="residual")
    sync.setup(params)
    grad = (u @ v) * (rank + 1)  # rank-2 on every rank, same column space: the average is rank 2
    got, stats = _sync_once(sync, params, {"c": grad})
    residual = sync.memory.residual("c")
    return got["c"], (u @ v) * sum(range(1, world + 1)) / world, [r.op for r in stats.collectives], residual


@pytest.mark.multiprocess
def test_powersgd_allreduce_path_is_exact_on_low_rank():
    for got, expected, ops, residual in run_workers(_powersgd, 2):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert ops == ["allreduce", "allreduce"]  # P, then Q
        # Error feedback keeps M - P Q_local^T, this rank's own loss: nothing for a rank-2 matrix.
        assert float(residual.abs().max()) < 1e-4


def _plan(rank, world):
    params = _params()
    plan = Choices(default=TensorChoice("none", "allreduce"),
                tensors={"a": TensorChoice("default", "allgather"), "c": TensorChoice("default", "allgather")},
                groups=[["a", "c"], ["b"]])
    sync = CompressSync(TopK(ratio=1.0), choices=plan, memory="none")
    sync.setup(params)
    grads = _grads(rank)
    got, stats = _sync_once(sync, params, grads)
    oracle = {}
    for name, g in grads.items():
        oracle[name] = g * (1.0 / world)
        dist.all_reduce(oracle[name])
    return got, oracle, [r.op for r in stats.collectives]


@pytest.mark.multiprocess
def test_plan_fuses_groups_and_picks_per_tensor_choices():
    for got, oracle, ops in run_workers(_plan, 2):
        for name in SHAPES:
            assert torch.equal(got[name], oracle[name]), name
        # b alone through allreduce; a and c fused into one top-k allgather (sizes, then data).
        assert ops.count("allreduce") == 1 and ops.count("allgather_uneven") == 1


SCALES = {"a": 1e-3, "b": 1.0, "c": 10.0}  # a small layer beside large ones: one scale per group would flatten it


def _replayed(name):
    """``name``'s compressor whose uniform draws depend only on (rank, tensor, step): a fused group
    ``a+b+c`` draws its members' end to end, so a stochastic quantizer fused can equal it alone."""
    compressor = build_compressor(name)

    def uniform(key, like):
        step, rank = compressor.state_dict()["steps"].get(key, 0), dist.get_rank()
        group, _, stage = key.partition("/")  # an owner's second compression: "a+b+c/sum"
        draws = [torch.rand(torch.Size(SHAPES[member]).numel(),
                            generator=torch.Generator().manual_seed(zlib.crc32(f"{rank}/{member}/{stage}/{step}".encode())))
                 for member in group.split("+")]
        return torch.cat(draws).to(like.dtype).reshape(like.shape)

    compressor.uniform = uniform
    return compressor


def _fused_per_member(rank, world, comm, compressor, memory):
    params = _params()
    plan = Choices(default=TensorChoice("default", comm), groups=[["a", "b", "c"]])
    fused = CompressSync(compressor(), choices=plan, memory=memory)
    alone = CompressSync(compressor(), comm=comm, memory=memory)
    alone_params = _params()
    fused.setup(params)
    alone.setup(alone_params)
    out = []
    for step in range(3):
        grads = {name: g * SCALES[name] for name, g in _grads(rank, step).items()}
        out.append((_sync_once(fused, params, grads)[0], _sync_once(alone, alone_params, grads)[0]))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("comm", ["allgather", "gather"])
@pytest.mark.parametrize("compressor", ["efsignsgd", "onebit", "int8", "qsgd", "terngrad", "signsgd"])
def test_a_fused_group_of_a_per_member_compressor_equals_layer_wise(comm, compressor):
    """Cupcake's fused group, one compression and one message, gives what compressing each tensor
    alone gives, bit for bit, error feedback included (3 steps), its members 1e-3 to 10 apart: each
    keeps its own scale (TernGrad's shared across the ranks member by member), buckets, columns or
    zero rows; QSGD and TernGrad draw the same uniforms fused and alone."""
    if comm == "gather" and compressor == "signsgd":
        pytest.skip("a vote is refused where an owner re-encodes it")
    for steps in run_workers(_fused_per_member, 2, comm, lambda: _replayed(compressor), None):
        for fused, alone in steps:
            for name in SHAPES:
                assert torch.equal(fused[name], alone[name]), (comm, name)


def test_wire_round_trip_keeps_dtypes_and_shapes():
    payload = [torch.randn(3, 4), torch.arange(5, dtype=torch.int32), torch.tensor(2.5, dtype=torch.bfloat16),
               torch.zeros(0, dtype=torch.uint8), torch.tensor([True, False])]
    back = packing.unpack(packing.pack(payload))
    assert [t.dtype for t in back] == [t.dtype for t in payload]
    assert all(torch.equal(a, b) for a, b in zip(back, payload, strict=True))


def test_error_feedback_on_a_compressor_that_is_no_contraction_warns():
    with pytest.warns(UserWarning, match="compressor.unbiased=false or memory=none"):
        CompressSync(RandomK(ratio=0.1), memory="residual")
    with pytest.warns(UserWarning, match="unscaled signs"):
        CompressSync(build_compressor("signsgd", vote=False), memory="residual")
    for name, kwargs in (("signum", {}), ("signsgd", {"scaled": True})):  # a vote: refused, not warned
        with pytest.raises(ValueError, match="memory=residual with compressor=.* compressor.vote=true"):
            CompressSync(build_compressor(name, **kwargs), memory="residual")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompressSync(RandomK(ratio=0.1, unbiased=False), memory="residual")  # contractive: fine
        CompressSync(RandomK(ratio=0.1))  # unbiased: no error feedback by default
        CompressSync(build_compressor("signsgd"))


def test_memory_defaults_to_the_compressors_own():
    assert CompressSync(TopK()).memory.name == "residual" and CompressSync(TopK()).memory_default
    assert CompressSync(build_compressor("qsgd")).memory.name == "none"
    explicit = CompressSync(TopK(), memory="none")
    assert explicit.summary_fields() == {"memory": "none", "memory_default": False}


def test_bad_input_names_the_key():
    with pytest.raises(ValueError, match="sync.comm"):
        CompressSync(TopK(ratio=0.1), comm="allreduce")  # top-k payloads cannot be summed
    with pytest.raises(ValueError, match="sync.comm"):
        CompressSync(comm="ring")
    with pytest.raises(ValueError, match="sync.memory"):
        CompressSync(memory="forever")
    with pytest.raises(ValueError, match="sync.fusion"):
        CompressSync(fusion="layers")
    with pytest.raises(ValueError, match="plan"):
        CompressSync(TopK(ratio=0.1), choices=Choices(tensors={"a": TensorChoice("default", "allreduce")}))
    with pytest.raises(ValueError, match="sync.comm: scheme alltoall cuts each group into flat partitions"):
        CompressSync(PowerSGD(), comm="alltoall")
    for comm in ("allgather", "gather"):  # PowerSGD is its shared-Q algorithm or nothing
        with pytest.raises(ValueError, match="Vogels et al.'s algorithm under allreduce only"):
            CompressSync(PowerSGD(), comm=comm)
    for comm in ("alltoall", "gather"):  # a vote's tie (0) does not fit a re-encoded 1-bit code
        with pytest.raises(ValueError, match="majority vote"):
            CompressSync(build_compressor("signsgd"), comm=comm)


def _resume(rank, world):
    """A backend restored from state_dict continues exactly like the one that kept running."""
    def fresh():
        sync = CompressSync(PowerSGD(rank=1), comm="allreduce", memory="residual", fusion="bucket")
        params = _params()
        sync.setup(params)
        return sync, params

    running, params = fresh()
    for step in range(3):
        _sync_once(running, params, _grads(rank, step))
    restored, params2 = fresh()
    restored.load_state_dict(running.state_dict())
    a, _ = _sync_once(running, params, _grads(rank, 3))
    b, _ = _sync_once(restored, params2, _grads(rank, 3))
    return all(torch.equal(a[name], b[name]) for name in SHAPES)


@pytest.mark.multiprocess
def test_state_dict_restores_residuals_and_factors_exactly():
    assert all(run_workers(_resume, 2))


def _regrouped(rank, world, compressor, memory):
    """Three plans in turn, each regrouping the tensors: hierarchical c; a+b fused and hierarchical,
    c flat; every tensor alone and flat, b sent uncompressed."""
    params = _params()
    plans = [Choices(default=TensorChoice("default", "allgather"), tensors={"c": TensorChoice("default", "allgather", True)}),
             Choices(default=TensorChoice("default", "allgather"), tensors={"a": TensorChoice("default", "allgather", True),
                                                                         "b": TensorChoice("default", "allgather", True)},
                  groups=[["a", "b"], ["c"]]),
             Choices(default=TensorChoice("default", "allgather"), tensors={"b": TensorChoice("none", "allreduce")})]
    sync = CompressSync(compressor, memory=memory, local_size=2, choices=plans[0])
    sync.setup(params)
    total_sync = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    total_grad = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    for step in range(9):
        if step in (3, 6):
            sync.choices = plans[step // 3]
            sync.on_setup()
        grads = _grads(rank, step)
        got, _ = _sync_once(sync, params, grads)
        for name in SHAPES:
            total_sync[name] += got[name]
            total_grad[name] += grads[name] * (1.0 / world)
    held = sync.memory
    residual = {name: (held.residual(name) if held.residual(name) is not None else torch.zeros(shape)).reshape(shape)
                for name, shape in SHAPES.items()}
    for name in SHAPES:
        dist.all_reduce(total_grad[name])
        dist.all_reduce(residual[name])
    return total_sync, total_grad, residual, sorted(k for state in held.group_states() for k in state)


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressor,memory", [(TopK(ratio=0.05), "residual"),
                                               (build_compressor("efsignsgd"), "residual")])
def test_error_feedback_survives_regrouping(compressor, memory):
    """Residuals move with their tensors when a plan fuses, splits or makes groups hierarchical: the
    telescoping identity holds across the plan changes, nothing stays under an old group's name, and
    the tensor sent uncompressed carries no residual (so it is on dense allreduce's path again)."""
    for total_sync, total_grad, residual, keys in run_workers(_regrouped, 4, compressor, memory):
        for name in SHAPES:
            torch.testing.assert_close(total_sync[name] + residual[name], total_grad[name], rtol=1e-5, atol=1e-4)
        assert keys == ["a", "c"]


# -- exact error feedback in every scheme ------------------------------------------------------------
# Every compressor whose ranks' tensors aggregate to their sum (the vote signs are checked below),
# configured so that it drops something on these small tensors.
IDENTITY = {"none": {}, "fp16": {}, "bf16": {}, "int8": {}, "topk": {"ratio": 0.2}, "dgc": {"ratio": 0.2, "clip_norm": None},
            "randomk": {"ratio": 0.3, "unbiased": False}, "randomk-shared": {"ratio": 0.3, "seed": 1},
            "threshold": {"threshold": 2.5}, "efsignsgd": {}, "onebit": {}, "qsgd": {"levels": 2, "bucket_size": 16},
            "terngrad": {}, "powersgd": {"rank": 1}}
LOSSLESS = {"none", "fp16", "bf16"}  # on these small integers


def _build(name):
    return build_compressor(name.split("-")[0], **IDENTITY[name])


def _identity_cases(rank, world, scheme):
    """For ``scheme``, flat and hierarchical (2 ranks per machine), every compressor it can carry:
    4 steps of float64 gradients of small integers (every sum is exact), then the sum over steps of
    what the ranks received, the residuals summed over ranks (chunks placed where they lie), and the
    true sum of the averaged gradients."""
    base = CompressSync(NoCompression(), comm="allgather", hierarchical=True, local_size=2)
    base.setup(_params())  # builds the machine groups once; every case below reuses them
    out = {}
    for hierarchical in (False, True):
        for name in IDENTITY:
            compressor = _build(name)
            if scheme == "allreduce" and not (compressor.summable or hasattr(compressor, "reduce")):
                continue
            if scheme == "alltoall" and compressor.needs_matrices:
                continue
            if scheme == "zen" and not isinstance(compressor, SparseCompressor):
                continue
            if scheme != "allreduce" and hasattr(compressor, "reduce"):  # PowerSGD: allreduce only
                continue
            sync = CompressSync(compressor, comm=scheme, memory="residual", hierarchical=hierarchical, local_size=2)
            sync.intra, sync.inter = base.intra, base.inter
            params = [(n, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))) for n, shape in SHAPES.items()]
            sync.setup(params)
            received = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in SHAPES.items()}
            true = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in SHAPES.items()}
            for step in range(4):
                grads = {n: g.double() for n, g in _grads(rank, step).items()}
                got, _ = _sync_once(sync, params, grads)
                for n in SHAPES:
                    received[n] += got[n]
                    true[n] += grads[n] / world
            layouts = sync._layouts()
            residual = {}
            for key, layout in layouts.items():
                kept = sync.memory.residual(key)
                flat = torch.zeros(layout.numel, dtype=torch.float64) if kept is None else _unchunk(kept, layout)
                residual[layout.members[0][0]] = flat.reshape(SHAPES[layout.members[0][0]])
            for n in SHAPES:
                dist.all_reduce(true[n])
                dist.all_reduce(residual[n])
            out[(name, hierarchical)] = (received, residual, true)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheme", ["allreduce", "allgather", "alltoall", "gather", "zen"])
def test_what_was_sent_plus_the_residuals_is_the_true_sum(scheme):
    """Error feedback loses nothing in any scheme, flat or hierarchical, for any compressor it
    carries: sum over steps of the result + sum over ranks of the residuals = sum over steps and
    ranks of the averaged gradients. Where an owner compresses a partition's sum a second time
    (alltoall, gather), that compression's error is in the owner's residual. 4 ranks, 2 per machine."""
    for cases in run_workers(_identity_cases, 4, scheme):
        assert len(cases) == {"allreduce": 10, "alltoall": 26, "allgather": 26, "gather": 26, "zen": 10}[scheme]
        for (name, hierarchical), (received, residual, true) in cases.items():
            for n in SHAPES:
                where = f"{scheme} {name} hierarchical={hierarchical} {n}"
                torch.testing.assert_close(received[n] + residual[n], true[n], rtol=0, atol=1e-9,
                                           msg=lambda m, where=where: f"{where}: {m}")
            if name not in LOSSLESS:
                assert any((received[n] - true[n]).abs().max() > 1e-3 for n in SHAPES), (name, "dropped nothing")


def _votes(rank, world, scheme, hierarchical, name):
    compressor = build_compressor(name, momentum=0.5) if name == "signum" else build_compressor(name)
    sync = CompressSync(compressor, comm=scheme, hierarchical=hierarchical, local_size=2)
    params = _params()
    sync.setup(params)
    out = []
    momentum = {n: torch.zeros(shape) for n, shape in SHAPES.items()}
    for step in range(2):
        grads = _grads(rank, step)
        got, _ = _sync_once(sync, params, grads)
        want = {}
        for n, g in grads.items():
            momentum[n] = 0.5 * momentum[n] + 0.5 * g if name == "signum" else g
            signs = torch.where(momentum[n] >= 0, 1.0, -1.0)  # a zero is sent as +1
            if hierarchical:  # the vote is over machines, of the sign of each machine's sum
                machine = momentum[n].clone()
                pair = dist.new_group([0, 1]), dist.new_group([2, 3])
                dist.all_reduce(machine, group=pair[rank // 2])
                signs = torch.where(machine >= 0, 1.0, -1.0) / 2  # each machine's two ranks count once
            dist.all_reduce(signs)
            want[n] = torch.sign(signs)  # a tie is 0
        ties = sum(int((w == 0).sum()) for w in want.values())
        out.append((got, want, ties))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("scheme,hierarchical,name", [("allgather", False, "signsgd"), ("allgather", False, "signum"),
                                                      ("allgather", True, "signsgd")])
def test_sign_compressors_take_the_majority_vote_in_every_scheme(scheme, hierarchical, name):
    """signSGD and Signum: every element of the result is the sign of the sum of the ranks' signs,
    0 where they tie (4 ranks, or 2 machines, tie often); hierarchical: of the machines' signs.
    Schemes that re-encode the vote (alltoall, gather) refuse it (test_bad_input_names_the_key)."""
    for steps in run_workers(_votes, 4, scheme, hierarchical, name):
        assert sum(ties for _, _, ties in steps) > 0  # the tie rule was exercised
        for got, want, _ in steps:
            for n in SHAPES:
                assert torch.equal(got[n], want[n]), (scheme, name, n)


def _powersgd_hierarchical(rank, world, comm):
    torch.manual_seed(0)
    u = torch.randn(64, 2)
    params = [("w", torch.nn.Parameter(torch.zeros(64, 48))), ("b", torch.nn.Parameter(torch.zeros(48)))]
    sync = CompressSync(PowerSGD(rank=2), comm=comm, memory="residual", hierarchical=True, local_size=2,
                        fusion="bucket")  # one group: w a matrix, b a vector
    sync.setup(params)
    torch.manual_seed(1 + rank)
    grads = {"w": u @ torch.randn(2, 48), "b": torch.randn(48)}  # every rank's w in one column space
    got, stats = _sync_once(sync, params, grads)
    want = {n: g / world for n, g in grads.items()}
    for t in want.values():
        dist.all_reduce(t)
    return got, want, [(r.op, r.bytes_sent) for r in stats.collectives]


@pytest.mark.multiprocess
@pytest.mark.parametrize("comm", ["allreduce"])
def test_hierarchical_powersgd_sends_factors_not_the_matrix(comm):
    """The machine's ranks allreduce the group, the leader runs PowerSGD across machines on the whole
    matrices (two factor allreduces) and broadcasts the result: no path sends the matrix across
    machines. (Under allgather or gather each rank would run its own power iteration: refused.)"""
    for rank, (got, want, records) in enumerate(run_workers(_powersgd_hierarchical, 4, comm)):
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-4)
        ops = [op for op, _ in records]
        inside = [("allreduce", (64 * 48 + 48) * 4), ("broadcast", (64 * 48 + 48) * 4 if rank % 2 == 0 else 0)]
        if rank % 2:  # not a leader: the machine's sum in, the result back
            assert records == inside, records
            continue
        across = records[1:-1]
        if comm == "allreduce":  # the vector in one allreduce, then P (64 x 2), then Q (48 x 2)
            assert across == [("allreduce", 48 * 4), ("allreduce", 64 * 2 * 4), ("allreduce", 48 * 2 * 4)]
        else:
            assert ops[1:-1] == ["allgather_uneven"] and across[0][1] < 64 * 48 * 4 / 8
        assert [records[0], records[-1]] == inside


def test_every_scheme_is_executed_and_priced_by_one_object_and_refuses_alike():
    """A scheme's executing class subclasses its Aggregation (rules and price written once, under one
    name); the planners offer a compressor under a scheme exactly where the scheme would carry it."""
    from ddlscale.compress import COMPRESSORS
    from ddlscale.plan.aggregation import AGGREGATIONS
    from ddlscale.sync.compressed.schemes import SCHEMES, scheme

    assert list(SCHEMES) == list(AGGREGATIONS)
    for key, executing in SCHEMES.items():
        assert issubclass(executing, type(AGGREGATIONS[key])) and executing.name == key
        assert executing.price is type(AGGREGATIONS[key]).price and executing.refusal is type(AGGREGATIONS[key]).refusal
    for name in COMPRESSORS:
        compressor = build_compressor(name)
        for key in SCHEMES:
            try:
                scheme(key).check(compressor, "sync.comm")
                carried = True
            except ValueError as refused:
                carried = False
                assert str(refused).startswith("sync.comm: ") and compressor.name in str(refused)
            assert carried == AGGREGATIONS[key].carries(compressor), (name, key)


# -- Zen as an aggregation scheme for sparsifiers -----------------------------------------------------
def _zen_against_allgather(rank, world, name, kwargs, overlap):
    """One 4096-element tensor (and the small ones) through allgather and zen, 2 steps: the results
    and the bytes each scheme's collectives received. ``overlap``: every rank's largest entries lie
    at the same positions (top-k of correlated gradients), else they are independent."""
    params = [("big", torch.nn.Parameter(torch.zeros(64, 64))), *_params()]
    out = {}
    for comm in ("allgather", "zen"):
        sync = CompressSync(build_compressor(name, **kwargs), comm=comm, memory="none")
        sync.setup(params)
        got, received = [], 0
        for step in range(2):
            grads = {n: g.float() for n, g in _grads(rank, step).items()}
            noise = torch.randn(64, 64, generator=torch.Generator().manual_seed(7 * rank + step))
            shared = torch.zeros(64, 64)
            shared.view(-1)[torch.arange(0, 4096, 97)] = 50.0  # 43 positions, above any noise
            grads["big"] = noise + (shared if overlap else 0)
            result, stats = _sync_once(sync, params, grads)
            got.append(result)
            received += sum(r.bytes_recv for r in stats.collectives)
        out[comm] = (got, received)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,kwargs", [("topk", {"ratio": 0.01}), ("dgc", {"ratio": 0.01}),
                                         ("randomk", {"ratio": 0.05, "seed": None}), ("threshold", {"threshold": 2.0})])
def test_zen_sums_the_selections_as_allgather_does(name, kwargs):
    """sync.comm=zen: each rank's selection pushed to the owners its indices hash to, summed there and
    pulled back, equals the allgather of every rank's selection summed (the same exact sum)."""
    for by_scheme in run_workers(_zen_against_allgather, 3, name, kwargs, False):
        for want, got in zip(by_scheme["allgather"][0], by_scheme["zen"][0], strict=True):
            for n in want:
                torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{name} {n}: {m}")


@pytest.mark.multiprocess
def test_zen_receives_the_union_not_every_selection():
    """With overlapping selections (4 ranks, top-k 1% at the same positions) a rank receives about
    2 (n-1)/n of one selection through zen (push, then the union's pull) against n-1 selections
    through allgather."""
    for by_scheme in run_workers(_zen_against_allgather, 4, "topk", {"ratio": 0.01}, True):
        allgather, zen = by_scheme["allgather"][1], by_scheme["zen"][1]
        assert zen < 0.75 * allgather, (zen, allgather)


def _zen_rounds(rank, world):
    """The collectives of one zen step over several groups, and the number of groups."""
    params = [("big", torch.nn.Parameter(torch.zeros(64, 64))), *_params()]
    sync = CompressSync(build_compressor("topk", ratio=0.05), comm="zen", memory="none")
    sync.setup(params)
    grads = {n: g.float() for n, g in _grads(rank, 0).items()}
    grads["big"] = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank))
    _, stats = _sync_once(sync, params, grads)
    return [r.op for r in stats.collectives], len(sync.buckets)


@pytest.mark.multiprocess
def test_zen_pushes_and_pulls_every_group_in_one_round_each():
    """However many groups use zen, a step has one push and one pull: the groups share one index
    space (the sums are those of the per-group exchanges: test_zen_sums_the_selections_as_allgather_does)."""
    for ops, groups in run_workers(_zen_rounds, 3):
        assert groups >= 3
        assert sorted(ops) == ["pull", "push"], ops


def test_zen_refuses_what_is_not_a_sparsifier():
    with pytest.raises(ValueError, match="sync.comm: scheme zen .* qsgd is not a sparsifier"):
        CompressSync(build_compressor("qsgd"), comm="zen").setup(_params())
