"""The CUDA paths, checked in one short run on a machine with a GPU (prints a comparison).

    PYTHONPATH=. python -m experiments.gpu_check [A] [B] [C] [D] [E] [--out=DIR]   (default: all five)

--out=DIR also writes the printed lines to DIR/results.md (experiments/results/gpu_check is where a
GPU run's comparison is committed). Without a GPU it says so and exits 0, having checked nothing.

A. DDLStrategy + dense sync on one GPU over NCCL vs stock Lightning DDP (deterministic kernels):
   the final parameters must be bit-identical.
B. DenseAllreduce on CUDA tensors across 2 processes sharing the GPU over gloo: the averages must
   equal an allreduce oracle exactly, with bytes accounted and completion timestamps set.
C. Zen's CUDA kernels (ddlscale/csrc/zen_cuda.cu), compiled here by NVRTC through cupy (the gpu extra; no
   nvcc), against the pure-PyTorch references bit for bit — server_of, partition, group_by_server,
   pack_bits, unpack_bits over server counts 1-8, 1000 and 5000, all float dtypes, NaN values, empty
   inputs, rows of 64 values — and the dispatch the syncs use (on a side stream too, and with cupy
   hidden: the references); then a table of the cases that matched and each kernel's speedup over
   the reference run on the GPU (median of 5).
E. Every sparse sync on CUDA gradients (an embedding table's sparse COO rows and a sparse dense
   vector) across 2 processes over gloo (messages staged through host memory): exact against an
   allreduce oracle, each gradient back in its own layout and on its own device.
D. CompressSync on CUDA tensors across 2 processes over gloo, every scheme: with no compression
   the averages must equal an allreduce oracle exactly; with top-k (allgather, alltoall, gather)
   they must be finite and the run must not mix devices.
Needs torch with CUDA, cupy (C) and pytorch-lightning (A); no Hydra.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def _dense_on_cuda(rank: int, world: int) -> dict:
    from ddlscale.sync import DenseAllreduce

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, device="cuda").float())
    sync = DenseAllreduce(bucket_mb=0.01, first_bucket_mb=0.01)
    named = list(model.named_parameters())
    sync.setup(named, device=torch.device("cuda"))
    for _, p in named:
        p.register_post_accumulate_grad_hook(sync.grad_ready)
    x = torch.randint(-2, 3, (8, 64), device="cuda").float() * (rank + 1)
    model(x).sum().backward()
    local = [p.grad.clone() for _, p in named]
    stats = sync.finish_step()
    exact = True
    for g, (_, p) in zip(local, named, strict=True):
        scaled = g * (1.0 / world)
        dist.all_reduce(scaled)
        exact &= torch.equal(scaled, p.grad)
    return {"exact": exact, "bytes": stats.bytes_sent, "collectives": len(stats.collectives),
            "stamped": all(r.end is not None for r in stats.collectives)}


def _compress_on(rank: int, world: int, device: str = "cuda") -> dict:
    from ddlscale.compress.none import NoCompression
    from ddlscale.compress.topk import TopK
    from ddlscale.sync.compressed import CompressSync

    out = {}
    for compressor, schemes in ((NoCompression(), ("allreduce", "allgather", "alltoall", "gather")),
                                (TopK(ratio=0.1), ("allgather", "alltoall", "gather"))):
        for comm in schemes:
            label = f"{compressor.name}/{comm}"
            try:
                named = [(f"w{k}", torch.nn.Parameter(torch.zeros(shape, device=device)))
                         for k, shape in enumerate([(37, 5), (101,), (8, 8)])]
                sync = CompressSync(compressor, comm=comm, memory="residual")
                sync.setup(named, device=torch.device(device))
                grads = [torch.randint(-8, 9, p.shape, device=device).float() * (rank + 1) for _, p in named]
                for g, (_, p) in zip(reversed(grads), reversed(named), strict=True):
                    p.grad = g.clone()
                    sync.grad_ready(p)
                sync.finish_step()
                oracle = [g * (1.0 / world) for g in grads]
                for t in oracle:
                    dist.all_reduce(t)
                exact = all(torch.equal(t, p.grad) for t, (_, p) in zip(oracle, named, strict=True))
                finite = all(bool(torch.isfinite(p.grad).all()) and p.grad.device.type == device for _, p in named)
                out[label] = exact if compressor.name == "none" else finite
            except Exception as error:  # report every scheme, not just the first failure
                out[label] = f"{type(error).__name__}: {error}"
    return out


def _sparse_on(rank: int, world: int, device: str = "cuda") -> dict:
    """E: every sparse sync on gradients of one device (an embedding table's sparse COO gradient and
    a dense vector's), against an allreduce oracle: exact on small integers, same layout back."""
    from ddlscale.sync.sparse import AGSparseSync, OmniReduceSync, SparCMLSync, SparsePSSync, ZenSync

    makers = {
        "zen-coo": lambda: ZenSync(scheme="bp", pull="coo", sparse_params=["t", "v"], profile_steps=1),
        "zen-bitmap": lambda: ZenSync(scheme="bp", pull="bitmap", sparse_params=["t", "v"], profile_steps=1),
        "zen-hc": lambda: ZenSync(scheme="hc", sparse_params=["t", "v"], profile_steps=1),
        "agsparse": lambda: AGSparseSync(sparse_params=["t", "v"], profile_steps=1),
        "sparse_ps": lambda: SparsePSSync(sparse_params=["t", "v"], profile_steps=1),
        "omnireduce": lambda: OmniReduceSync(sparse_params=["t", "v"], profile_steps=1),
        "sparcml": lambda: SparCMLSync(sparse_params=["t", "v"], profile_steps=1),
    }
    out = {}
    for name, make in makers.items():
        try:
            g = torch.Generator().manual_seed(rank)
            table = torch.nn.Parameter(torch.zeros(5000, 64, device=device))
            vector = torch.nn.Parameter(torch.zeros(10_000, device=device))
            sync = make()
            sync.setup([("t", table), ("v", vector)], device=torch.device(device))
            exact, layout = True, True
            for _ in range(3):
                ids = torch.randint(0, 5000, (200,), generator=g)
                local_t = torch.sparse_coo_tensor(ids[None], torch.randint(-3, 4, (200, 64), generator=g).float(),
                                                  (5000, 64)).coalesce().to(device)
                local_v = torch.zeros(10_000)
                local_v[torch.randint(0, 10_000, (300,), generator=g)] = 2.0
                local_v = local_v.to(device)
                table.grad, vector.grad = local_t.clone(), local_v.clone()
                sync.grad_ready(vector)
                sync.grad_ready(table)
                sync.finish_step()
                for p, local in ((table, local_t), (vector, local_v)):
                    oracle = local.to_dense().cpu() * (1.0 / world)
                    dist.all_reduce(oracle)
                    exact &= torch.equal(p.grad.to_dense().cpu(), oracle)
                    layout &= p.grad.is_sparse == local.is_sparse and p.grad.device.type == device
            out[name] = bool(exact and layout)
        except Exception as error:  # report every backend, not just the first failure
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _fit(strategy, make_model) -> str:
    import pytorch_lightning as pl

    from ddlscale.trainer.metrics import param_sha256

    pl.seed_everything(3, verbose=False)
    model = make_model()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model)
    return param_sha256(model)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous().reshape(-1), b.cpu().contiguous().reshape(-1)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _same(got, ref) -> bool:
    """(tensors..., counts) from a kernel equal the reference's, bit for bit."""
    if isinstance(got, torch.Tensor):
        return _same_bits(got, ref)
    *tensors, counts = got
    return counts.tolist() == ref[-1] and all(_same_bits(a, b) for a, b in zip(tensors, ref, strict=False))


def _cuda_timing(fn, reps: int = 5) -> float:
    import statistics
    import time

    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cuda_speedups(ops, size: int) -> dict[str, float]:
    """Reference time / kernel time, both on the GPU, per op (8 servers, sorted indices at density 0.1)."""
    from ddlscale.sync.sparse.kernels import (
        pack_bits_reference,
        partition_reference,
        server_of_reference,
        split_by_server_reference,
        unpack_bits_reference,
    )

    idx = torch.randperm(10 * size, device="cuda")[:size].sort().values
    val = torch.randn(size, device="cuda")
    server = server_of_reference(idx, 7, 8)
    mask = torch.rand(size, device="cuda") < 0.5
    bitmap = pack_bits_reference(mask)
    pairs = {
        "server_of": (lambda: server_of_reference(idx, 7, 8), lambda: ops.server_of(idx, 7, 8)),
        "partition": (lambda: partition_reference(idx, val, 7, 8), lambda: ops.partition(idx, val, 7, 8)),
        "group_by_server": (lambda: split_by_server_reference(server, idx, val, 8),
                            lambda: ops.group_by_server(server, idx, val, 8)),
        "pack_bits": (lambda: pack_bits_reference(mask), lambda: ops.pack_bits(mask)),
        "unpack_bits": (lambda: unpack_bits_reference(bitmap, size), lambda: ops.unpack_bits(bitmap, size)),
    }
    return {name: round(_cuda_timing(ref) / _cuda_timing(fast), 2) for name, (ref, fast) in pairs.items()}


def _c_cases(ops, g: torch.Generator, record) -> None:
    """Every CUDA kernel against its reference on the CPU: sizes 0 to 3e5, every float dtype with NaNs,
    1-8 servers, 1000 and 5000 (past the shared-memory counters), rows of 64 values, bitmaps 0-100003."""
    from ddlscale.sync.sparse.kernels import (
        pack_bits_reference,
        partition_reference,
        server_of_reference,
        split_by_server_reference,
        unpack_bits_reference,
    )

    for size in (0, 1, 1000, 300_000):
        idx = torch.randint(0, 10**7, (size,), generator=g, dtype=torch.int64)
        if size:
            idx[0], idx[-1] = 0, 10**7 - 1
        for k, dtype in enumerate((torch.float32, torch.float64, torch.bfloat16, torch.float16)):
            val = torch.randn(size, generator=g).to(dtype)
            val[: min(2, size)] = float("nan")
            for n in (*range(1, 9), 1000, 5000):
                seed, case = 0x5EED + k, f"size={size} {dtype} n={n}"
                server = server_of_reference(idx, seed, n)
                record("server_of", _same(ops.server_of(idx.cuda(), seed, n), server), case)
                record("partition", _same(ops.partition(idx.cuda(), val.cuda(), seed, n),
                                          partition_reference(idx, val, seed, n)), case)
                record("group_by_server", _same(ops.group_by_server(server.cuda(), idx.cuda(), val.cuda(), n),
                                                split_by_server_reference(server, idx, val, n)), case)
    rows, row_ids = torch.randn(3000, 64, generator=g), torch.randperm(10**6, generator=g)[:3000]
    record("partition", _same(ops.partition(row_ids.cuda(), rows.cuda(), 7, 8),
                              partition_reference(row_ids, rows, 7, 8)), "rows of 64 floats")
    for length in (*range(0, 70), 100_003):
        mask = torch.rand(length, generator=g) < 0.4
        bitmap = pack_bits_reference(mask)
        record("pack_bits", _same(ops.pack_bits(mask.cuda()), bitmap), f"length={length}")
        record("unpack_bits", _same(ops.unpack_bits(bitmap.cuda(), length + 3),
                                    unpack_bits_reference(bitmap, length + 3)), f"length={length}")


def _c_dispatch(ops, g: torch.Generator, record) -> None:
    """What the sparse syncs call, on CUDA tensors: with cupy, on a side stream, and with cupy hidden."""
    from ddlscale.sync.sparse import kernels, native
    from ddlscale.sync.sparse.kernels import merge_rows_reference, partition_reference

    rows, row_ids = torch.randn(3000, 64, generator=g), torch.randperm(10**6, generator=g)[:3000].sort().values
    other_rows, other_ids = torch.randn(2000, 64, generator=g), torch.randperm(10**6, generator=g)[:2000].sort().values
    expected = partition_reference(row_ids, rows, 7, 8)
    record("dispatch", isinstance(native.cuda_ops(), type(ops)), "native.cuda_ops() gives the cupy kernels")
    record("dispatch", _same(kernels.partition(row_ids.cuda(), rows.cuda(), 7, 8), expected), "partition")
    merged = kernels.merge_rows(row_ids.cuda(), rows.cuda(), other_ids.cuda(), other_rows.cuda())
    reference = merge_rows_reference(row_ids, rows, other_ids, other_rows)
    record("dispatch", _same_bits(merged[0], reference[0]) and _same_bits(merged[1], reference[1]), "merge_rows")
    side, ids_gpu, rows_gpu = torch.cuda.Stream(), row_ids.cuda(), rows.cuda()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # inputs written late on a busy side stream: the kernels must queue behind
        torch.cuda._sleep(100_000_000)
        got = kernels.partition(ids_gpu * 1, rows_gpu * 1, 7, 8)
    torch.cuda.current_stream().wait_stream(side)
    record("dispatch", _same(got, expected), "on a side stream")
    saved_loaded, saved_module = native._loaded, sys.modules.get("cupy")
    try:  # the gpu extra absent: the references, silently
        native._loaded, sys.modules["cupy"] = {}, None
        hidden = kernels.partition(row_ids.cuda(), rows.cuda(), 7, 8)
        record("dispatch", native.cuda_ops() is None and _same(hidden, expected), "cupy hidden: references")
    finally:
        native._loaded = saved_loaded
        if saved_module is not None:
            sys.modules["cupy"] = saved_module


def _native_cuda() -> bool:
    """C: Zen's CUDA kernels (ddlscale/csrc/zen_cuda.cu, compiled by NVRTC through cupy) against the pure-PyTorch
    references bit for bit, the dispatch around them, then their speed against the references on the GPU."""
    from ddlscale.sync.sparse import native

    try:
        ops = native.build("cuda")
    except native.NativeUnavailable as error:
        _say(f"C CUDA kernels unavailable: {error}")
        return False
    table: dict[str, list[int]] = {}
    failures: list[str] = []

    def record(op: str, ok: bool, case: str) -> None:
        table.setdefault(op, [0, 0])[0] += bool(ok)
        table[op][1] += 1
        if not ok:
            failures.append(f"{op} {case}")

    g = torch.Generator().manual_seed(0)
    _c_cases(ops, g, record)
    _c_dispatch(ops, g, record)
    speedups = {size: _cuda_speedups(ops, size) for size in (10**5, 10**6, 10**7)}
    _say("C CUDA kernels through cupy vs the pure-PyTorch references (8 servers for the speedups):")
    _say("| op | identical | speedup at 1e5 | 1e6 | 1e7 |")
    _say("|---|---|---|---|---|")
    for op, (same, total) in table.items():
        ups = [f"{speedups[size].get(op, '-')}" for size in sorted(speedups)]
        _say(f"| {op} | {same}/{total} | " + " | ".join(ups) + " |")
    if failures:
        _say(f"C differences ({len(failures)}): " + "; ".join(failures[:10]))
    return not failures


_LINES: list[str] = []


def _say(line: str) -> None:
    """Print a result line and keep it for results.md."""
    print(line, flush=True)
    _LINES.append(line)


def _write(out: str, ok: bool) -> None:
    import datetime
    import pathlib

    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = "not installed"
    path = pathlib.Path(out) / "results.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = [f"# GPU check: {'PASSED' if ok else 'FAILED'}", "",
            f"Regenerate: `python -m experiments.gpu_check {' '.join(sys.argv[1:])}`", "",
            f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"cupy {cupy_version}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", ""]
    path.write_text("\n".join(head + _LINES) + "\n")
    print("wrote", path)


def _check_a() -> bool:
    from pytorch_lightning.strategies import DDPStrategy

    from ddlscale.strategy import DDLStrategy
    from ddlscale.workloads import LSTMLanguageModel, ResNetCNN

    ok = True
    for name, make in {"cnn": ResNetCNN, "lstm": LSTMLanguageModel}.items():
        ours = _fit(DDLStrategy(start_method="popen"), make)
        ddp = _fit(DDPStrategy(), make)
        ok &= ours == ddp
        _say(f"A {name} on 1 GPU, NCCL: ddlscale {ours[:12]} ddp {ddp[:12]} identical={ours == ddp}")
    return ok


def _across_two_ranks(section: str, worker, what: str, passed) -> bool:
    from ddlscale.cluster import run_workers

    results = run_workers(worker, 2, start_method="spawn")
    _say(f"{section} {what}, 2 ranks over gloo: {results}")
    return all(passed(r) for r in results)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    outs = [a.split("=", 1)[1] for a in args if a.startswith("--out=")]
    sections = {a for a in args if not a.startswith("--out=")} or {"A", "B", "C", "D", "E"}
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False), so nothing was checked. "
              "Run it on a machine with an NVIDIA GPU after pip install -e '.[gpu]'.")
        return 0
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ok = True
    if "C" in sections:
        ok &= _native_cuda()
    if "B" in sections:
        ok &= _across_two_ranks("B", _dense_on_cuda, "dense sync on CUDA tensors",
                                lambda r: r["exact"] and r["stamped"])
    if "D" in sections:
        ok &= _across_two_ranks("D", _compress_on, "compressed sync on CUDA tensors",
                                lambda r: all(v is True for v in r.values()))
    if "E" in sections:
        ok &= _across_two_ranks("E", _sparse_on, "sparse syncs on CUDA gradients",
                                lambda r: all(v is True for v in r.values()))
    if "A" in sections:
        ok &= _check_a()
    _say(f"GPU CHECK {'PASSED' if ok else 'FAILED'} {torch.cuda.get_device_name(0)}")
    for out in outs:
        _write(out, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
