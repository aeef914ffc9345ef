"""ddlscale's fp16 and PowerSGD paths vs PyTorch's own DDP comm hooks, on the same model, side by side.

    python -m experiments.compression_hooks [--workloads cnn,lstm] [--workers 2] [--steps 30] [--reps 3]
                                            [--powersgd-bucket-mb 25] [--dilation 2]

Each variant trains the same workload for the same steps on the same data in a plain PyTorch loop
over gloo (Lightning drops DDP comm hooks on CPU, so both sides run outside it):

- ``torch fp16``: DDP + ``fp16_compress_hook`` (cast each bucket to fp16, allreduce, cast back);
- ``ddlscale fp16``: ``CompressSync(FP16, comm=allreduce, fusion=bucket)``, DDP's bucket sizes;
- ``torch powersgd``: DDP + ``powerSGD_hook`` (rank 1, error feedback, warm start, compression
  from the third step, its earliest);
- ``ddlscale powersgd``: ``CompressSync(PowerSGD(rank=1), comm=allreduce, memory=residual,
  fusion=bucket)``: DDP's buckets, each tensor its own matrix, a bucket's factors in shared allreduces.

Both PowerSGD variants use buckets of ``--powersgd-bucket-mb`` (default DDP's 25). torch's
``powerSGD_hook`` over gloo aborts the process when DDP holds more than one such bucket (gpt at
25 MB: "Received data size doesn't match expected size", 1536 vs 1408 bytes: two buckets' hook
collectives interleave differently on the two ranks); with one bucket it runs, so the claims'
command sets it large for both sides alike.

Reported: median step time per variant and the ratio ddlscale / torch per rep (target <= 1).

``--dilation k`` runs the workers as one time-dilated machine (:func:`ddlscale.cluster.dilation.dilated_here`):
capped at workers / k cores, times in emulated seconds, so each worker has one core of its own and the
host's rest takes the kernel and the driver.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.cluster import run_workers
from ddlscale.cluster.dilation import dilated_here
from experiments.harness import Results, alternating, spread

VARIANTS = ("torch fp16", "ddlscale fp16", "torch powersgd", "ddlscale powersgd")
DDP_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb, and CompressSync's bucket_mb


def _train(rank: int, world: int, workload: str, variant: str, steps: int, powersgd_bucket_mb: float = DDP_BUCKET_MB
           ) -> list[float]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    from ddlscale.compress.cast import FP16
    from ddlscale.compress.powersgd import PowerSGD
    from ddlscale.sync.compressed import CompressSync
    from ddlscale.tools.sparsity import compose_model, worker_loaders

    model = compose_model(workload, 0)
    model.train()
    batches = iter(worker_loaders(model, world)[rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step_model, sync = _Loss(model), None
    if variant.startswith("torch"):
        step_model = DistributedDataParallel(
            step_model, bucket_cap_mb=powersgd_bucket_mb if variant == "torch powersgd" else DDP_BUCKET_MB)
        if variant == "torch fp16":
            step_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                           use_error_feedback=True, warm_start=True)
            step_model.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        if variant == "ddlscale fp16":
            sync = CompressSync(FP16(), comm="allreduce", memory="none", fusion="bucket")
        else:
            sync = CompressSync(PowerSGD(rank=1), comm="allreduce", memory="residual", fusion="bucket",
                                bucket_mb=powersgd_bucket_mb)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for _, p in named:
            dist.broadcast(p.data, 0)
        sync.setup(named)
        for _, p in named:
            p.register_post_accumulate_grad_hook(sync.grad_ready)
    times = []
    for _ in range(steps):
        batch = next(batches)
        start = clock.now()
        optimizer.zero_grad(set_to_none=True)
        step_model(batch).backward()
        if sync is not None:
            sync.finish_step()
        optimizer.step()
        times.append(clock.now() - start)
    return times


class _Loss(torch.nn.Module):
    """The workload's loss as a module's forward, so DDP sees the forward pass it hooks into."""

    def __init__(self, workload: torch.nn.Module):
        super().__init__()
        self.workload = workload

    def forward(self, batch):
        return self.workload.loss(batch)


def _step_time(workers: int, workload: str, variant: str, steps: int, powersgd_bucket_mb: float) -> float:
    """Median step time of one run; a step lasts as long as its slowest rank; 3 warm-up steps dropped."""
    per_rank = run_workers(_train, workers, workload, variant, steps, powersgd_bucket_mb,
                           timeout_s=clock.wall(60))
    return statistics.median(max(ts) for ts in list(zip(*per_rank, strict=True))[3:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cnn,lstm")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--powersgd-bucket-mb", type=float, default=DDP_BUCKET_MB,
                        help="bucket size of both PowerSGD variants (torch's hook needs one bucket on gloo)")
    parser.add_argument("--dilation", type=float, default=1.0, help="time dilation k of the one machine (1: none)")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results("compression_hooks")
    rows, medians, failures = [], defaultdict(list), {}
    total, done = len(workloads) * args.reps * len(VARIANTS), 0
    with dilated_here(args.dilation, args.workers) as cap:
        results.dilation = args.dilation
        for workload in workloads:
            for rep, variant in alternating(VARIANTS, args.reps):
                step = float("nan")
                if (workload, variant) not in failures:  # a failure is deterministic: do not wait for it twice
                    try:
                        step = _step_time(args.workers, workload, variant, args.steps, args.powersgd_bucket_mb)
                    except Exception as err:  # reported, not hidden: PyTorch's PowerSGD hook can abort in gloo
                        failures[(workload, variant)] = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
                medians[(workload, variant)].append(step)
                rows.append({"workload": workload, "variant": variant, "rep": rep, "step_time_s": step})
                done += 1
                results.progress(done, total, f"{workload} {variant} rep {rep}: {step * 1e3:.1f} ms/step"
                                 + (" (failed)" if step != step else ""))
    results.write_csv(rows)
    table = []
    for workload in workloads:
        for kind in ("fp16", "powersgd"):
            ours, theirs = medians[(workload, f"ddlscale {kind}")], medians[(workload, f"torch {kind}")]
            ratio, lo, hi = spread([a / b for a, b in zip(ours, theirs, strict=True)])
            table.append([workload, kind, spread(ours)[0] * 1e3, spread(theirs)[0] * 1e3, ratio, lo, hi,
                          "yes" if ratio <= 1.0 else "no"])
    results.write_markdown(
        "ddlscale's compression paths vs PyTorch's DDP comm hooks",
        ["workload", "compressor", "ddlscale ms/step", "torch hook ms/step", "ratio (median)", "min", "max",
         "no slower"],
        table,
        notes=f"{args.workers} gloo workers on this host, {args.steps} steps (first 3 excluded), {args.reps} "
              "alternating repetitions; plain PyTorch loops (Lightning drops comm hooks on CPU). "
              f"PowerSGD's buckets (both sides): {args.powersgd_bucket_mb:g} MB; fp16's: {DDP_BUCKET_MB:g} MB."
              + "".join(f"\n\nFailed: {w} / {v}: {msg}" for (w, v), msg in failures.items()),
        summary={"Compared": "ddlscale's fp16 and PowerSGD compression paths against PyTorch's DDP comm hooks "
                             f"(fp16_compress_hook, powerSGD_hook), same model and loop, {args.workloads}.",
                 "Emulation": f"one machine: {args.workers} gloo workers over loopback, no device time; "
                              + (f"time dilation k={args.dilation:g}, the workers capped at {cap} (each worker one "
                                 "emulated core)" if args.dilation > 1 else "no dilation: the workers share this host's "
                                 "cores with the driver and the kernel") + ".",
                 "Bound by": "CPU: unshaped loopback sets no network limit, so each step is compute and copies.",
                 "Repetitions": f"{args.reps}, alternating, {args.steps} steps each (first 3 excluded).",
                 "Answer": "ddlscale / hook, median of paired reps: " + ", ".join(
                     f"{r[0]} {r[1]} " + ("not measured (the hook failed)" if r[4] != r[4] else f"{r[4]:.3f}")
                     for r in table) + "."},
        command=f"python -m experiments.compression_hooks --workloads {args.workloads} --workers {args.workers} "
                f"--steps {args.steps} --reps {args.reps} --powersgd-bucket-mb {args.powersgd_bucket_mb:g}"
                + (f" --dilation {args.dilation:g}" if args.dilation != 1 else ""),
    )
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{w}\n{v}" for w in workloads for v in VARIANTS]
    ax.bar(range(len(labels)), [spread(medians[(w, v)])[0] * 1e3 for w in workloads for v in VARIANTS])
    ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
    ax.set_ylabel("ms per step (median)")
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
