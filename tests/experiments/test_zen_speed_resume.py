"""zen_speed --resume: whole cells are kept from a stopped invocation's CSV, a part-done cell runs again."""

import csv

from experiments import zen_speed

METHODS = [("dense", "-"), ("zen", "auto")]
LABELS = ["dense", "zen/auto"]
CELLS = [("1gbit", "lstm"), ("100mbit", "lstm")]


def _row(bandwidth, sync, route, rep):
    return {"bandwidth": bandwidth, "model": "lstm", "sync": sync, "route": route, "rep": rep, "rerun": True,
            "step_time_s": 0.1 + rep, "param_sha256": "ab", "sparse": "emb", "forced": "emb"}


def test_resume_keeps_complete_cells_typed_and_reruns_a_partial_one(tmp_path):
    rows = [_row("1gbit", s, r, rep) for rep in range(2) for s, r in METHODS]
    rows.append(_row("100mbit", "dense", "-", 0))  # the invocation stopped here
    path = tmp_path / "results.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    read = zen_speed.read_rows(path)
    assert read == rows  # typed back: rep int, rerun bool, times float, text kept
    kept = zen_speed.kept_cells(read, CELLS, LABELS, METHODS, reps=2)
    assert list(kept) == [("1gbit", "lstm")] and len(kept["1gbit", "lstm"]) == 4
    # one repetition short of what was asked: nothing is kept
    assert zen_speed.kept_cells(read, CELLS, LABELS, METHODS, reps=3) == {}
    assert zen_speed.read_rows(tmp_path / "absent.csv") == []


def test_the_time_estimate_says_when_a_folder_holds_a_resumed_run(tmp_path, monkeypatch, capsys):
    from experiments import harness

    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    machine = "Machine: cpu x86_64, cores 2; the run took 15.2 min\n"
    for name, notes in (("whole", ""), ("resumed", "Resumed (--resume): 1gbit lstm kept ...\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.md").write_text("# t\n\n" + machine + notes)
    assert harness.took_minutes("whole") == (15.2, "results.md")
    minutes, source = harness.took_minutes("resumed")
    assert minutes == 15.2 and "resumed" in source
    assert harness.took_minutes("absent") == (None, "not recorded")
    # the printed total is a lower bound while any folder is resumed or unrecorded, else an estimate
    for names, expected in ((["whole"], "Full run: about 0.3 h."),
                            (["whole", "resumed"], "Full run: at least 0.5 h."),
                            (["whole", "absent"], "Full run: at least 0.3 h, plus absent, whose time is not recorded.")):
        monkeypatch.setattr(harness, "claimed_commands", lambda names=names: [(n, f"python -m x.{n}") for n in names])
        harness.run_all(["--dry-run"])
        assert expected in capsys.readouterr().out
