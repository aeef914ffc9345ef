"""compression_schemes' tables from fake runs: every 4x2 method's figures, and Espresso's search priced
against its measured step (predicted / measured per repetition)."""

import csv
import json

import pytest

from experiments import compression_schemes, harness

STEP_MS = {"dense": 200.0, "espresso search": 180.0}  # every other method 250 ms


def fake_train(overrides, timeout, run_dir):
    run_dir.mkdir(parents=True)
    search = "sync=espresso" in overrides and "sync.trial_steps=0" in overrides
    method = "espresso search" if search else "dense" if "sync=dense" in overrides else "other"
    step_s = STEP_MS.get(method, 250.0) / 1e3
    with (run_dir / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step_time_s", "step_period_s", "sync_time_s", "encode_time_s",
                                               "decode_time_s", "bytes_sent", "sync_phase"])
        writer.writeheader()
        for _ in range(6):
            writer.writerow({"step_time_s": step_s, "step_period_s": step_s, "sync_time_s": step_s / 2,
                             "encode_time_s": 0.01, "decode_time_s": 0.01, "bytes_sent": 1000, "sync_phase": "plan"})
    plan = {"options": [{"compressor": "topk", "scheme": "allgather", "hierarchical": False}], "fusion": "",
            "system": "espresso", "context": {}, "iteration_s": 0.9 * step_s if search else step_s}
    (run_dir / "plan.json").write_text(json.dumps(plan))
    return {"final_loss": 1.0, "memory": "residual"}


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    monkeypatch.setattr(compression_schemes, "train", fake_train)
    monkeypatch.setattr(compression_schemes, "probe_rate", lambda nodes, bandwidth: [9e8] * nodes)
    return tmp_path


def test_the_4x2_table_prices_espresso_search_against_its_measured_step(fake_runs):
    compression_schemes.main(["--clusters", "4x2", "--workloads", "lstm", "--reps", "2", "--measure", "4",
                              "--name", "cs"])
    rows = {r["method"]: r for r in csv.DictReader((fake_runs / "cs" / "results.csv").open())}
    assert set(rows) == {*compression_schemes.UNIFORM, *compression_schemes.PLANNED}
    search = rows["espresso search"]
    assert float(search["predicted_over_measured"]) == pytest.approx(0.9)
    assert search["predicted_over_measured_per_rep"] == "0.900 0.900"
    assert rows["dense"]["predicted_over_measured"] == ""  # not planned: no prediction
    text = (fake_runs / "cs" / "results.md").read_text()
    assert "Espresso's search 0.900x the best uniform plan's step (dense" in text
    assert "predicted 0.900x its measured step" in text
    assert "| lstm | dense 200.0 | 180.0 | 0.900 | yes | 162.0 | 0.900 0.900 |" in text


def test_only_espresso_trial_runs_a_trial():
    """Both planners default to a trial; this experiment's Cupcake and search rows are their models' plans."""
    from argparse import Namespace

    args = Namespace(bandwidth="1gbit", measure=10, overrides="", compressor="topk", ratio=0.01)
    for method in compression_schemes.PLANNED:
        trial = [o for o in compression_schemes.overrides_of(method, "4x2", args) if o.startswith("sync.trial_steps=")]
        assert trial == [f"sync.trial_steps={compression_schemes.TRIAL_STEPS if method == 'espresso trial' else 0}"]
    # Espresso prices every family it may choose on its own calibration: the 8 schemes x layouts, allgather last
    search = compression_schemes.overrides_of("espresso search", "4x2", args)
    families = next(o for o in search if o.startswith("sync.calibrate_families=")).split("=", 1)[1]
    assert sorted([*families.strip("[]").split(","), "allgather"]) == sorted(
        f"{s}{layout}" for s in compression_schemes.SCHEMES for layout in ("", "/hier"))
