"""The persistent tier's stall on the training thread: DCP async_save (ddlscale's tier) vs synchronous writes.

    python -m experiments.dcp_async [--mib 192] [--reps 4] [--every 4] [--iter-s 0.25] [--dilation 1]

One process stands for a training rank: a state of ``--mib`` MiB (parameters and SGD momentum, half
each), iterations of ``--iter-s`` seconds of matrix products, an optimizer step that changes the
state in place, and a checkpoint every ``--every`` iterations (3 per repetition). Methods, on the same
state, alternating and rotating which goes first (BENCHMARKS.md):

* ``dcp.save`` — torch.distributed.checkpoint's synchronous save of the state, as a user calls it
  (stock FileSystemWriter, fsync): the strongest synchronous baseline;
* ``tier sync`` — ddlscale's tier with ``ckpt.async_save=false``: ``dcp.save`` plus its commit (sha256
  of the files, the manifest) on the training thread;
* ``dcp.async_save`` — DCP's asynchronous save with its default stager (the copy made on the
  training thread, the write in DCP's thread);
* ``tier async`` — ddlscale's tier (``ckpt=disk``, the default): ``dcp.async_save`` with the copy in
  a background thread, waited for before the next optimizer step, and the commit in a thread.

The stall is the time the training thread spends in checkpoint calls (the save call, the wait before
the optimizer step and, if the previous version is still being written, the wait for it). Whole
costs: the iteration time is reported too, since the background threads share the machine's cores.
Target: the tier's async stall <= 10% of the synchronous write's (``dcp.save``), on medians.

``--dilation k`` runs the whole measurement (the compute's calibration included) as one emulated machine
of one rank at time dilation k (:func:`ddlscale.cluster.dilation.dilated_here`): the process, the
training thread and every thread it starts (DCP's writer, the tier's copy and commit threads) capped
together at 1/k of a core of this host, one emulated core, and every span timed or waited for read on
:mod:`ddlscale.clock` (emulated seconds: wall / k; ``--iter-s`` is emulated seconds too). What that
changes here is the CPU the background threads get: they compete with the training thread for that one
core, as on a machine of one core per rank, instead of taking the host's other core (shared with
whatever else runs on it) as at k = 1; torch's intra-op threads are set to that one core too. What it
does not change is the disk: it is this host's, not dilated, so a write and its fsync take 1/k of their
host time in emulated seconds. At k > 1 the stand-in machine therefore has a disk k times faster than
this host's relative to its CPU: ``dcp.save``'s stall (mostly the write) shrinks with k while the stalls
made of CPU work (the copy made on the training thread, hashing) do not, so the ratios against it move
with k for that reason as well as for the CPU's (docs/emulation.md, "What dilation preserves, and what it
does not").
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ddlscale import clock
from ddlscale.ckpt.disk.writer import DcpWriter
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.cluster.dilation import dilated_here
from experiments.harness import Results, alternating, spread

NAME = "dcp_async"
METHODS = ("dcp.save", "tier sync", "dcp.async_save", "tier async")
TARGET = 0.10
CHECKPOINTS = 3


class Rank:
    """The state and the iteration of one stand-in training rank."""

    def __init__(self, mib: int, iter_s: float) -> None:
        n = mib * 2**20 // 8  # float32 elements per half
        generator = torch.Generator().manual_seed(0)
        self.params = {f"layer{i}.weight": torch.randn(n // 8, generator=generator) for i in range(8)}
        self.momentum = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.a = torch.randn(384, 384, generator=generator)
        self.iter_s = iter_s
        self.matmuls = self._calibrate()

    def _calibrate(self) -> int:
        # On the clock: under dilation the count is what one emulated core does in iter_s emulated seconds.
        start, count = clock.now(), 0
        while clock.now() - start < 0.5:
            self.a @ self.a
            count += 1
        return max(1, round(count * self.iter_s / 0.5))

    def compute(self) -> None:
        for _ in range(self.matmuls):
            self.a @ self.a

    def step(self) -> None:
        for k, p in self.params.items():  # what an optimizer step does to the state: in place
            self.momentum[k].mul_(0.9).add_(p, alpha=1e-6)
            p.sub_(self.momentum[k], alpha=1e-3)

    def payload(self) -> dict:
        return {"format": "ddlscale-training-state/1", "local": {"rank": 0},
                "shared": {"state_dict": self.params, "optimizer_states": [{"state": self.momentum}]}}

    def live(self) -> set[int]:
        return {t.data_ptr() for t in (*self.params.values(), *self.momentum.values())}


def run_method(method: str, rank: Rank, directory: Path, every: int) -> dict:
    """CHECKPOINTS checkpoints, ``every`` iterations apart; stall seconds per checkpoint, iteration times."""
    directory.mkdir(parents=True)
    writer = DcpWriter(directory, 0, 1, asynchronous=method == "tier async") if method.startswith("tier") else None
    stager = DefaultStager(StagingOptions(False, False, False, False)) if method == "dcp.async_save" else None
    pending = None
    stalls: list[float] = []
    iterations: list[float] = []
    for step in range(1, CHECKPOINTS * every + 1):
        begin = clock.now()
        rank.compute()
        waited = writer.staged() if writer is not None else 0.0  # before the optimizer step
        if stalls:
            stalls[-1] += waited
        rank.step()
        if step % every == 0:
            start = clock.now()
            version = f"step_{step:09d}.bench"
            if writer is not None:
                writer.save(step, version, rank.payload(), rank.live(), DataPosition(0, step, 10**6))
            else:
                state = {"model": rank.params, "optimizer": rank.momentum}
                if pending is not None:
                    pending.result()  # one save in flight, as with the tier
                if method == "dcp.save":
                    dcp.save(state, checkpoint_id=str(directory / version), no_dist=True)
                else:
                    pending = dcp.async_save(state, checkpoint_id=str(directory / version), async_stager=stager,
                                             no_dist=True)
            stalls.append(clock.now() - start)
        iterations.append(clock.now() - begin)
    tail = clock.now()
    if writer is not None:
        writer.close()
    if pending is not None:
        pending.result()
    if stager is not None:
        stager.close()
    return {"stalls": stalls, "iterations": iterations, "drain_s": clock.now() - tail}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192, help="state size in MiB (parameters + momentum)")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--every", type=int, default=4, help="iterations between checkpoints")
    parser.add_argument("--iter-s", type=float, default=0.25, help="compute seconds (emulated) per iteration")
    parser.add_argument("--dilation", type=clock.parse_factor, default=1.0,
                        help="time dilation k of the one emulated machine (1: none)")
    return parser.parse_args(argv)


def command_of(args: argparse.Namespace) -> str:
    """The command results.md and the claims table give: it reproduces the run, its dilation included."""
    return (f"python -m experiments.{NAME} --mib {args.mib} --reps {args.reps}"
            + (f" --dilation {args.dilation:g}" if args.dilation != 1 else ""))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    results = Results(NAME)
    results.dilation = args.dilation
    rows = []
    with dilated_here(args.dilation, 1) as cap:
        if args.dilation > 1:  # torch would take one intra-op thread on a machine of one core
            torch.set_num_threads(1)
        rank = Rank(args.mib, args.iter_s)  # calibrated here: its compute is the emulated core's
        scratch = Path(tempfile.mkdtemp(prefix="ddlscale-dcp-bench-"))
        try:
            plan = list(alternating(METHODS, args.reps))
            for done, (rep, method) in enumerate(plan, 1):
                measured = run_method(method, rank, scratch / f"{rep}-{method.replace(' ', '_')}", args.every)
                shutil.rmtree(scratch / f"{rep}-{method.replace(' ', '_')}")
                for i, stall in enumerate(measured["stalls"]):
                    rows.append({"rep": rep, "method": method, "checkpoint": i, "stall_s": stall,
                                 "iteration_s": statistics.median(measured["iterations"]),
                                 "drain_s": measured["drain_s"], "state_mib": args.mib, "dilation": args.dilation})
                results.progress(done, len(plan), f"{method}: stall {statistics.median(measured['stalls']):.3f} s")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    results.write_csv(rows)
    write_report(results, rows, args, cap)


def write_report(results: Results, rows: list[dict], args: argparse.Namespace, cap: str) -> None:
    per_rep = {(r["rep"], r["method"]): [] for r in rows}
    for r in rows:
        per_rep[(r["rep"], r["method"])].append(r)
    reps = sorted({r["rep"] for r in rows})

    def rep_stall(rep: int, method: str) -> float:
        return statistics.median(r["stall_s"] for r in per_rep[(rep, method)])

    table = []
    for method in METHODS:
        stalls = [rep_stall(rep, method) for rep in reps]
        ratios = [rep_stall(rep, method) / rep_stall(rep, "dcp.save") for rep in reps]
        iters = [per_rep[(rep, method)][0]["iteration_s"] for rep in reps]
        s, r, it = spread(stalls), spread(ratios), spread(iters)
        table.append([method, f"{s[0]:.4f} ({s[1]:.4f}-{s[2]:.4f})", f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})",
                      f"{it[0]:.3f} ({it[1]:.3f}-{it[2]:.3f})", ", ".join(f"{v:.4f}" for v in stalls)])
    ratio = statistics.median(rep_stall(rep, "tier async") / rep_stall(rep, "dcp.save") for rep in reps)
    notes = f"""
State {args.mib} MiB (parameters + momentum, float32), a checkpoint every {args.every} iterations of
~{args.iter_s} s of compute, {CHECKPOINTS} checkpoints per repetition, {len(reps)} repetitions alternating the
methods. Stall: training-thread seconds per checkpoint (median over a repetition's checkpoints; table:
median over repetitions, min-max). Ratio: paired per repetition against `dcp.save`. Iteration: median
iteration time (compute + checkpoint calls), the whole cost on the training thread including the
background threads' competition for the cores. Local disk with fsync; CPU only (no device-to-host copy).
{emulation(args, cap)}

Target: the tier's async stall <= {TARGET:.0%} of the synchronous write's (`dcp.save`): median ratio
{ratio:.3f} (each repetition's in the table).
"""
    results.write_markdown("Persistent tier: stall on the training thread, async vs sync (DCP)",
                           ["method", "stall s, median (min-max)", "x dcp.save", "iteration s", "per rep"],
                           table, notes, command=command_of(args),
                           summary={"Compared": "the training thread's stall per checkpoint of " + ", ".join(METHODS)
                                                + f", same {args.mib} MiB state.",
                                    "Emulation": f"one process, local disk with fsync, ~{args.iter_s} s of compute "
                                                 f"per iteration, CPU only; {emulation(args, cap)}",
                                    "Bound by": "not measured: local disk, no network in this experiment.",
                                    "Repetitions": f"{len(reps)}, alternating, {CHECKPOINTS} checkpoints each.",
                                    "Answer": f"the tier's async save stalls training {ratio:.3f}x as long as "
                                              f"`dcp.save` (median of paired reps; target <= {TARGET:.2f})."})
    plot(results, reps, rep_stall)


def emulation(args: argparse.Namespace, cap: str) -> str:
    """What the dilation made of the process, in the report's words."""
    if args.dilation == 1:
        return ("no time dilation: the training thread and the checkpoint's threads share this host's cores with "
                "whatever else runs on it.")
    return (f"time dilation k = {args.dilation:g}, one emulated machine of one rank ({cap}): the training thread and "
            "the checkpoint's threads share one emulated core, every time in emulated seconds (wall / k). The disk "
            "is this host's, not dilated: a write and its fsync take 1/k of their host time in emulated seconds.")


def plot(results: Results, reps: list[int], rep_stall) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, method in enumerate(METHODS):
        values = [rep_stall(rep, method) for rep in reps]
        ax.bar(i, statistics.median(values), color="tab:blue" if method.startswith("tier") else "tab:gray")
        ax.plot([i] * len(values), values, "k.", ms=4)
    ax.set_xticks(range(len(METHODS)), METHODS)
    ax.set_yscale("log")
    ax.set_ylabel("training-thread stall per checkpoint (s)")
    fig.tight_layout()
    fig.savefig(results.figure_path())


if __name__ == "__main__":
    main()
