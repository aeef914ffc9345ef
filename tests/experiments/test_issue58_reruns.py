"""dcp_async's and planned_convergence's dilation options, espresso_planning's per-run rows: their arguments,
the commands their reports write (what the claims table gives) and the rows the claims read, without running
an experiment."""

import csv
import json
import shlex
import statistics

import pytest

from experiments import claims, dcp_async, espresso_planning, planned_convergence

TRIALS_CHECKS = {
    "espresso-planning-300": 'trials.csv where tensors=300 method=espresso_full: figure(median([med("seconds", '
                             'instance=i, seed=s) for i in set(text("instance")) for s in set(text("seed"))]), '
                             'lo("seconds"), hi("seconds"))',
    "espresso-planning-resnet101": 'trials.csv where tensors=314 method=espresso_full: spread(col("seconds"))',
}


def readme_commands(folder: str) -> list[str]:
    return sorted({claims.code(r["command"]) for r in claims.claims() if claims.code(r["folder"]) == folder})


def argv_of(command: str) -> list[str]:
    return shlex.split(command)[3:]  # after "python -m experiments.NAME"


def test_dcp_async_dilation_is_in_its_command():
    assert dcp_async.parse_args([]).dilation == 1
    assert "--dilation" not in dcp_async.command_of(dcp_async.parse_args([]))
    assert dcp_async.command_of(dcp_async.parse_args(["--dilation", "2"])).endswith(" --dilation 2")
    with pytest.raises(SystemExit):  # a factor below 1 is no dilation
        dcp_async.parse_args(["--dilation", "0.5"])
    # the claims table's command is the one the report writes for it: it reproduces the run
    for command in readme_commands("dcp_async"):
        assert dcp_async.command_of(dcp_async.parse_args(argv_of(command))) == command


def test_planned_convergence_runs_on_the_emulated_cluster_only_when_asked():
    default = planned_convergence.build_parser().parse_args([])
    assert default.dilation is None and planned_convergence.cluster_of(None, "100mbit") == []
    assert "sync.network_bandwidth=100mbit" in planned_convergence.overrides_of("cupcake", "dgc", "100mbit")
    dilated = planned_convergence.build_parser().parse_args(["--dilation", "2"])
    cluster = planned_convergence.cluster_of(dilated.dilation, dilated.bandwidth)
    assert cluster == ["cluster=emulated", "cluster.nodes=2", "trainer.devices=1", "cluster.bandwidth=100mbit",
                       "cluster.dilation=2", "cluster.fallback=error"]
    told = [o for o in planned_convergence.overrides_of("espresso", "dgc", "100mbit", emulated=True)
            if o.startswith("sync.network_bandwidth=")]
    assert told == [f"sync.network_bandwidth={int(100e6 * 1448 / 1514)}"]  # the NICs' TCP payload rate
    assert planned_convergence.overrides_of("layerwise", "dgc", "100mbit", emulated=True) == \
        planned_convergence.overrides_of("layerwise", "dgc", "100mbit")  # told nothing: it plans nothing
    for command in readme_commands("planned_convergence"):
        args = planned_convergence.build_parser().parse_args(argv_of(command))
        seeds = [int(s) for s in args.seeds.split(",")]
        assert planned_convergence.command_of(args, seeds) == command


def test_planned_convergence_rows_keep_each_runs_dilation_and_starvation():
    curve = [4.0] * 90 + [2.0] * 10
    emulated = planned_convergence.row_of(1, "cnn", "cupcake", "dgc", curve, {"dilation": 2.0, "starved": True}, "p")
    assert emulated == {"seed": 1, "workload": "cnn", "method": "cupcake", "compressor": "dgc", "final_loss": 2.0,
                        "steps": 100, "plan": "p", "dilation": 2.0, "starved": True}
    local = planned_convergence.row_of(0, "cnn", "dense", None, curve, {"dilation": 1.0}, "")
    assert local["compressor"] == "none" and local["starved"] is None  # no emulated cluster, no CPU accounting
    rows = [emulated, local]
    assert "seed 1 cnn cupcake dgc" in planned_convergence.starved_note(rows, emulated=True)
    assert planned_convergence.starved_note(rows, emulated=False) == ""


def write_trials(tmp_path, reps: int) -> dict:
    """A fake run's samples at 300 and 314 tensors, written as espresso_planning writes trials.csv."""
    samples = {}
    cases = [(f"random, {layout}", 300, seed) for layout in ("1 rank/machine", "4 ranks/machine") for seed in range(4)]
    cases.append(("resnet101 (64 GPUs, 25 Gbit/s)", 314, 0))
    for n, (kind, count, seed) in enumerate(cases):
        for rep, method in espresso_planning.alternating(espresso_planning.METHODS, reps):
            run = {"rep": rep, "seconds": 0.1 * (n + 1) + 0.01 * rep, "predicted_s": 0.2, "options": 5,
                   "simulations": 40 if method == "espresso_search" else None,
                   "dense_s": 0.5 if method == "espresso_full" else None,
                   "layer_wise_s": 0.4 if method == "espresso_full" else None}
            samples.setdefault((kind, count, seed, method), []).append(run)
    rows = espresso_planning.trial_rows(samples)
    with (tmp_path / "trials.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return samples


def test_espresso_planning_keeps_every_repetition_and_its_claims_count_them(tmp_path):
    assert espresso_planning.build_parser().parse_args([]).reps == 4
    samples = write_trials(tmp_path, reps=4)
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert len(rows) == sum(len(runs) for runs in samples.values())  # one row per timed run
    assert {r["rep"] for r in rows} == {"0", "1", "2", "3"}
    checks = {r["id"]: claims.code(r["check"]) for r in claims.claims() if r["id"] in TRIALS_CHECKS}
    assert checks == TRIALS_CHECKS  # the rows judge the 4-repetition run on its per-run rows
    at_300 = [[run["seconds"] for run in runs] for (_, count, _, method), runs in samples.items()
              if count == 300 and method == "espresso_full"]
    wide = claims.measure(checks["espresso-planning-300"], tmp_path)
    # the median of the 8 cases' medians over repetitions; the fastest and slowest single run
    assert wide.figure == pytest.approx((statistics.median(statistics.median(c) for c in at_300),
                                         min(map(min, at_300)), max(map(max, at_300))))
    resnet = [run["seconds"] for (_, count, _, method), runs in samples.items() for run in runs
              if count == 314 and method == "espresso_full"]
    deep = claims.measure(checks["espresso-planning-resnet101"], tmp_path)
    assert deep.figure == pytest.approx((statistics.median(resnet), min(resnet), max(resnet)))
    for measured in (wide, deep):  # counted in the CSV, and never pooled: each is a figure with its range
        assert measured.reps == 4 and not measured.pooled
    assert claims.measure(checks["espresso-planning-300"], _rewritten(tmp_path, reps=3)).reps == 3
    for command in readme_commands("espresso_planning"):  # the command the rows give reproduces itself
        assert espresso_planning.command_of(espresso_planning.build_parser().parse_args(argv_of(command))) in (
            command, command + " --counts 50,100,200,300 --seeds 4 --reps 4")


def _rewritten(tmp_path, reps: int):
    folder = tmp_path / f"reps{reps}"
    folder.mkdir()
    write_trials(folder, reps)
    return folder


def test_planned_convergence_resumes_from_the_runs_it_kept(tmp_path, monkeypatch):
    """--keep DIR --reuse reads the runs finished in DIR and trains only the others (the dilated grid
    takes hours: it runs in parts)."""
    from experiments import harness

    def finish(run_dir, losses, status="finished"):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps({"dilation": 1.0, "status": status}))
        (run_dir / "metrics.csv").write_text("step,train_loss_step\n" + "".join(f"{i},{v}\n" for i, v in enumerate(losses)))
        (run_dir / "plan.json").write_text(json.dumps({"units": [{"numel": 4}], "options": [{"compressor": "default"}]}))

    trained = []

    def fake_train(overrides, run_dir=None, timeout=None):
        assert not run_dir.exists()  # train.py refuses a folder that holds a run
        trained.append(run_dir.name)
        finish(run_dir, [2.0, 1.0, 0.5])
        return {"dilation": 1.0, "status": "finished"}

    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(planned_convergence, "train", fake_train)
    keep = tmp_path / "kept"
    finish(keep / "cnn-dense-None-0", [3.0, 2.0, 1.5])  # finished in an earlier part
    finish(keep / "cnn-layerwise-dgc-0", [3.0], status="stopped")  # stopped when that part ended: runs again
    argv = ["--workloads", "cnn", "--compressors", "dgc", "--steps", "3", "--seeds", "0", "--keep", str(keep)]
    planned_convergence.main([*argv, "--reuse"])
    assert "cnn-dense-None-0" not in trained and len(trained) == len(planned_convergence.METHODS)
    assert "cnn-layerwise-dgc-0" in trained
    stopped = keep / "cnn-layerwise-dgc-0.stopped-1"  # the stopped run is set aside, not lost
    assert json.loads((stopped / "summary.json").read_text())["status"] == "stopped"
    rows = list(csv.DictReader((tmp_path / "results" / "planned_convergence" / "results.csv").open()))
    assert {r["method"]: float(r["final_loss"]) for r in rows}["dense"] == 1.5  # read back, not trained
    with pytest.raises(SystemExit):
        planned_convergence.main([a for a in argv if a not in ("--keep", str(keep))] + ["--reuse"])
