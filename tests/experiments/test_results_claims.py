"""experiments/README.md's claims table against the results it quotes.

The checks live in ``experiments/claims.py`` (its docstring has the check, rule and verdict syntax), so
that the harness judges each run with the same code. Each check returns its problems; none must be found.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from experiments import claims as c

ROWS = c.claims()
IDS = [r["id"] for r in ROWS]
FOLDERS = sorted(p for p in c.results_of().iterdir() if p.is_dir())


def test_the_table_has_rows_with_unique_ids():
    assert len(ROWS) >= 10
    assert not c.table_problems(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_row_names_a_folder_and_a_command_that_wrote_it(row):
    assert not c.command_problems(row, c.ROOT)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_row_figures_match_the_csv(row):
    assert not c.figure_problems(row, c.ROOT)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_row_verdict_is_what_the_rules_give(row):
    assert not c.verdict_problems(row, c.ROOT)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_row_is_its_newest_run_in_runs_csv(row):
    assert not c.history_problems(row, c.ROOT)


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_folder_keeps_every_run_and_states_no_verdict_of_its_own(folder):
    assert not c.folder_problems(folder)


def test_a_wrong_figure_fails(tmp_path):
    """The check is not vacuous: a figure off in its last digit, or a wrong range, is caught."""
    (tmp_path / "r.csv").write_text("method,rep,t\na,0,2.0\nb,0,1.0\na,1,3.0\nb,1,1.0\n")
    assert c.evaluate('r.csv: paired("t", "method", "a", "b")', tmp_path) == (2.5, 2.0, 3.0)
    middle, low, high = c.shown("2.5x (2.0-3.0)")
    assert c.agrees(middle, 2.5) and c.agrees(low, 2.0) and c.agrees(high, 3.0)
    assert not c.agrees(c.shown("2.6x (2.0-3.0)")[0], 2.5)
    assert not c.agrees(c.shown("2.5x (2.1-3.0)")[1], 2.0)
    assert not c.agrees("2.50", 2.506) and c.agrees("2.5", 2.506)
    assert c.evaluate("r.csv where method=a per rep: v('t')", tmp_path) == (2.5, 2.0, 3.0)
    assert c.evaluate("r.csv where t>=2: figure(med('t'), lo('t'), 9)", tmp_path) == (2.5, 2.0, 9)
    assert c.shown("-17% (-29 to +6%)") == ("-17", "-29", "+6")
    with pytest.raises(AssertionError):
        c.evaluate("r.csv where method=c: med('t')", tmp_path)


def test_per_group_figures_and_spreads(tmp_path):
    """With ``per``, a group's figure or spread is one value: the row's figure spans their medians, the
    verdict weighs their ranges."""
    (tmp_path / "r.csv").write_text("g,t\na,1\na,2\na,9\nb,4\nb,5\nb,6\n")
    figure, values, reps, pooled = c.measure("r.csv per g: spread(col('t'))", tmp_path)
    assert figure == (3.5, 2.0, 5.0) and values == [(2.0, 1.0, 9.0), (5.0, 4.0, 6.0)]
    assert reps is None and not pooled  # no rep column: not repeated runs
    assert c.measure("r.csv per g: figure(med('t'), 0, 10)", tmp_path)[0] == (3.5, 2.0, 5.0)
    assert c.judge(("every", ">=", 1.5), figure, values) == "within noise"  # a's median passes, its low does not
    assert c.judge(("every", ">=", 3), figure, values) == "MISSED"
    assert c.judge(("every", "<", 10), figure, values) == "met"


def test_median_and_every_rules():
    plain = [c.Figure(x, x, x) for x in (0.9, 1.0, 1.2)]
    assert c.judge(("median", "<=", 1.05), c.Figure(1.0, 0.9, 1.2), plain) == "within noise"
    assert c.judge(("median", "<=", 1.05), c.Figure(1.1, 0.9, 1.2), plain) == "MISSED"
    assert c.judge(("median", "<=", 1.3), c.Figure(1.0, 0.9, 1.2), plain) == "met"
    assert c.judge(("every", ">=", 1), c.Figure(1.0, 0.9, 1.2), plain) == "MISSED"
    assert c.judge(("every", ">", 0.8), c.Figure(1.0, 0.9, 1.2), plain) == "met"
    # a tie is not a win: equal to the threshold passes >= and fails >
    assert c.judge(("every", ">=", 1), c.Figure(1, 1, 1), [c.Figure(1, 1, 1)]) == "met"
    assert c.judge(("every", ">", 1), c.Figure(1, 1, 1), [c.Figure(1, 1, 1)]) == "MISSED"
    assert c.rule("`median >= 1.5` words") == ("median", ">=", 1.5)
    for bad in ("median >= 1.5 words", "`median = 1` words", "`mean <= 2` words", "`every < 1`"):
        with pytest.raises(AssertionError):
            c.rule(bad)


def _reps_csv(folder: Path, reps: int) -> None:
    """A per-run CSV: methods a and b, side by side in each of ``reps`` repetitions, a slower in rep 0."""
    rows = [f"{m},{r},{t}" for r in range(reps) for m, t in (("a", 2.0 if r else 0.5), ("b", 1.0))]
    (folder / "r.csv").write_text("method,rep,t\n" + "\n".join(rows) + "\n")


def test_the_repetitions_are_counted_in_the_csv_not_read_off_the_command(tmp_path):
    target, three, four = "`median >= 1` a over b", tmp_path / "three", tmp_path / "four"
    for folder, reps in ((three, 3), (four, 4)):
        folder.mkdir()
        _reps_csv(folder, reps)
    measured = c.measure('r.csv: paired("t", "method", "a", "b")', three)
    assert measured.reps == 3 and c.verdict_of(target, measured) == "not counted"
    assert c.exclusion(measured, dirty=False) == "3 repetitions (< 4)"
    measured = c.measure('r.csv: paired("t", "method", "a", "b")', four)
    assert measured.reps == 4 and c.verdict_of(target, measured) == "within noise"  # rep 0's pair is under 1
    # the repetitions the check reads: a filter keeping three of four counts three
    assert c.measure('r.csv where rep<=2: paired("t", "method", "a", "b")', four).reps == 3
    # a table of medians says in its runs column how many runs each row pools
    (tmp_path / "m.csv").write_text("case,median_s,runs\nx,1.0,3\ny,2.0,5\n")
    assert c.measure("m.csv: med('median_s')", tmp_path).reps == 3
    # not repeated runs (bytes, a model): no repetition rule
    (tmp_path / "b.csv").write_text("n,bytes\n2,10\n4,20\n")
    assert c.measure("b.csv: med('bytes')", tmp_path).reps is None
    assert c.reps_of("python -m experiments.x --reps=4") == 4 and c.reps_of("python -m experiments.x") is None


def test_a_value_folded_from_several_repetitions_is_never_met(tmp_path):
    """A ratio of medians hides its spread: at most within noise. Per repetition, the same runs say more."""
    _reps_csv(tmp_path, 5)
    median_rule = ("median", ">=", 1)
    medians = c.measure('r.csv: med("t", method="a") / med("t", method="b")', tmp_path)
    assert medians.figure == (2.0, 2.0, 2.0) and medians.pooled
    assert c.judge(median_rule, *medians[:2], medians.pooled) == "within noise"
    paired = c.measure('r.csv: paired("t", "method", "a", "b")', tmp_path)
    assert paired.figure == (2.0, 0.5, 2.0) and not paired.pooled
    assert c.judge(median_rule, *paired[:2], paired.pooled) == "within noise"  # rep 0 is under 1
    assert c.judge(("median", ">", 0.4), *paired[:2], paired.pooled) == "met"
    # one value per repetition (per rep, one row each side) or a spread keeps the repetitions apart
    for check in ('r.csv per rep: v("t", method="a") / v("t", method="b")', 'r.csv: spread(col("t", method="a"))'):
        assert not c.measure(check, tmp_path).pooled, check
    assert c.measure('r.csv: [med("t", method="a"), 1]', tmp_path).pooled
    # a MISSED stays MISSED
    assert c.judge(("median", ">=", 3), *medians[:2], medians.pooled) == "MISSED"
    # a row of a table of medians pools its runs
    (tmp_path / "m.csv").write_text("case,median_s,runs\nx,1.0,4\n")
    assert c.measure("m.csv: v('median_s')", tmp_path).pooled


def test_pairs_take_one_run_per_repetition_and_each_side_its_own_filters(tmp_path):
    (tmp_path / "r.csv").write_text("method,route,rep,t\ntorch,auto,0,4\nzen,auto,0,2\nzen,sparse,0,1\n"
                                    "torch,auto,1,6\nzen,auto,1,3\nzen,sparse,1,2\n")
    assert c.evaluate('r.csv: pair("t", {"method": "torch"}, {"method": "zen", "route": "sparse"})',
                      tmp_path) == (3.5, 3.0, 4.0)
    with pytest.raises(AssertionError, match="several rows per rep"):  # zen has two rows per rep
        c.evaluate('r.csv: paired("t", "method", "torch", "zen")', tmp_path)
    assert c.evaluate('r.csv: paired("t", "method", "torch", "zen", route="auto")', tmp_path) == (2.0, 2.0, 2.0)
    best = 'lowest("t", {"method": "torch"}, {"method": "zen", "route": "auto"})'
    assert c.evaluate(f'r.csv: pair("t", {best}, {{"method": "zen", "route": "sparse"}})', tmp_path) == (
        1.75, 1.5, 2.0)
    (tmp_path / "p.csv").write_text("plan,rep,t\nnone/allreducex1,0,5\ndefault/zenx1 none/allreducex1,1,7\n")
    assert c.evaluate("p.csv where plan~default/: col('t')", tmp_path)[0] == 7
    assert c.evaluate("p.csv where plan!~default/: col('t')", tmp_path)[0] == 5


def test_a_run_on_a_dirty_tree_is_not_counted():
    met = c.Measurement(c.Figure(1, 1, 1), [c.Figure(1, 1, 1)], 4, False)
    assert c.verdict_of("`median <= 2` x", met) == "met"
    assert c.verdict_of("`median <= 2` x", met, dirty=True) == "not counted"
    assert c.exclusion(met, dirty=True) == c.DIRTY_REASON
    assert c.is_dirty("78850a5+dirty") and not c.is_dirty("78850a5")


def test_verdict_cells_and_their_causes():
    assert c.verdict_parts("met") == ("met", None, None)
    assert c.verdict_parts("within noise (flipped: met on 2026-12-03): words") == (
        "within noise", ("met", "2026-12-03"), "words")
    assert c.verdict_parts("MISSED: cause") == ("MISSED", None, "cause")
    for bad in ("Met", "MISSED cause", "met (flipped: MISSED)", "missed: x"):
        with pytest.raises(AssertionError):
            c.verdict_parts(bad)
    quoted = "1.32x, 29.6 ms, 3.05 MB, 15%, 1 s and 64 MiB"
    assert c.quoted_figures(quoted) == ["1.32x", "29.6 ms", "3.05 MB", "15%", "1 s", "64 MiB"]
    assert not c.quoted_figures("~1% and ~4% of rows, 2 x 1 Gbit/s, 8x1, fp16, 3 of 12 cells, 12 steps")


def test_a_figure_is_reprinted_as_its_row_prints_it():
    assert c.reprint("1.21x (1.06-1.87x)", c.Figure(1.3, 1.0, 2.04)) == "1.30x (1.00-2.04x)"
    assert c.reprint("-3% (-17 to +10%)", c.Figure(1.2, -4, 3)) == "+1% (-4 to +3%)"
    assert c.reprint("0.38 s (0.23-0.54 s)", c.Figure(0.5, 0.25, 1)) == "0.50 s (0.25-1.00 s)"
    assert c.reprint("4.42x", c.Figure(4.0, 3, 5)) == "4.00x"
    assert c.figure_text("11.7x (1.16-407x); partition's 407x") == "11.7x (1.16-407x)"


SUMMARY = {"Compared": "t", "Emulation": "none", "Bound by": "n/a", "Repetitions": "4", "Answer": "t is 1.5"}


def test_each_run_is_judged_kept_in_runs_csv_and_listed(tmp_path, monkeypatch):
    """harness.Results judges the README's rows naming its folder on the CSVs it just wrote, appends them to
    runs.csv with their target, chained (never rewriting a row), and lists every run at the end of results.md;
    a run on a dirty tree is not counted."""
    from experiments import harness

    readme = tmp_path / "README.md"
    target = "`median <= 2` t"
    readme.write_text("| " + " | ".join(c.COLUMNS) + " |\n|" + "---|" * len(c.COLUMNS) + "\n"
                      f"| fast | t is fast | {target} | 1.5 (1.0-2.0) | met | `demo` | 2026-01-02 | "
                      "`python -m experiments.demo --reps 4` | `results.csv: col(\"t\")` |\n")
    monkeypatch.setattr(harness, "README", readme)
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(harness, "DILATIONS", set())
    monkeypatch.setattr(harness, "machine", lambda: {"cpu": "x86_64", "date": "2026-01-02 03:04"})
    monkeypatch.setattr(harness, "git_commit", lambda: "abc1234")
    command = "python -m experiments.demo --reps 4"

    demo = harness.Results("demo")
    demo.write_csv([{"t": 1.0}, {"t": 3.0}, {"t": 1.5}])
    demo.write_markdown("demo", ["a"], [[1]], command=command, summary=SUMMARY)
    first = c.read_runs(demo.dir)
    assert first == [{"date": "2026-01-02 03:04", "commit": "abc1234", "dilation": "1", "reps": "-", "claim": "fast",
                      "target": target, "figure": "1.5 (1.0-3.0)", "verdict": "within noise",
                      "run": "2026-01-02 03:04", "prev_sha256": c.GENESIS}]
    text = (demo.dir / "results.md").read_text()
    assert "date 2026-01-02 03:04, commit abc1234; the run took" in text
    assert "- **Dilation:** 1 " in text and f"`{c.row_hash(first[0])}`" in text
    assert not c.folder_problems(demo.dir)

    # the next run appends, chained to the first: its dilation is what its train.py runs reported
    harness.DILATIONS.update({4.0, 1})
    demo.write_csv([{"t": 1.0}, {"t": 1.2}])
    demo.write_markdown("demo", ["a"], [[1]], command=command, summary=SUMMARY)
    second = c.read_runs(demo.dir)
    assert second[0] == first[0] and len(second) == 2 and second[1]["prev_sha256"] == c.row_hash(first[0])
    assert (second[1]["dilation"], second[1]["figure"], second[1]["verdict"]) == ("1, 4", "1.1 (1.0-1.2)", "met")
    assert not c.folder_problems(demo.dir)

    # a run from a dirty tree: its figure is kept, its verdict not counted
    monkeypatch.setattr(harness, "git_commit", lambda: "abc1234+dirty")
    dirty = harness.Results("demo")
    dirty.write_csv([{"t": 1.0}, {"t": 1.2}])
    dirty.write_markdown("demo", ["a"], [[1]], command=command, summary=SUMMARY)
    assert [(r["commit"], r["figure"], r["verdict"]) for r in c.read_runs(demo.dir)][-1] == (
        "abc1234+dirty", "1.1 (1.0-1.2)", "not counted")
    assert not c.folder_problems(demo.dir)

    # an experiment that sets its dilation, in a folder no claim names: the run is kept all the same
    other = harness.Results("other")
    other.dilation = "4 (8 machines), 1 (2 machines)"
    other.write_csv([{"t": 1.0}])
    other.write_markdown("other", ["a"], [[1]], command="python -m experiments.other --reps 3")
    assert [(r["claim"], r["reps"], r["dilation"], r["target"]) for r in c.read_runs(other.dir)] == [
        ("-", "3", "4 (8 machines), 1 (2 machines)", "-")]
    assert ", dilation 4 (8 machines), 1 (2 machines); the run took" in (other.dir / "results.md").read_text()


def test_a_resumed_experiment_reports_the_dilation_of_the_runs_it_reads_back(tmp_path, monkeypatch):
    """A resumed experiment trains only part of its runs: the ones it reads back count in its dilation,
    and rows kept from an older results.csv without a newer column are written and read back whole."""
    from experiments import harness, zen_speed

    monkeypatch.setattr(harness, "DILATIONS", set())
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"dilation": 2.0, "steps": 3}')
    assert harness.read_summary(run)["steps"] == 3 and harness.DILATIONS == {2.0}
    assert harness.Results("demo").dilation_text() == "2"

    demo = harness.Results("demo")
    kept = {"bandwidth": "1gbit", "model": "lstm", "sync": "dense", "route": "-", "rep": 0, "rerun": True,
            "step_time_s": 0.5, "sparse": ""}
    path = demo.write_csv([kept, {**kept, "rep": 1, "dilation": 4.0}])
    rows = zen_speed.read_rows(path)
    assert rows == [kept, {**kept, "rep": 1, "dilation": 4.0}]


def test_make_experiments_reads_the_commands_from_the_table():
    from experiments import harness

    commands = harness.claimed_commands()
    assert (c.code(ROWS[0]["folder"]), c.code(ROWS[0]["command"])) == commands[0]
    assert len(commands) == len({c.code(r["command"]) for r in ROWS})


# ---- the judging is not vacuous: a copy of the README and the results, mutated, fails ----

def _copy(where: Path) -> Path:
    """A tree with the README, the results and the experiment modules (their commands name them)."""
    root = where / "repo"
    (root / "experiments").mkdir(parents=True)
    for module in (c.ROOT / "experiments").glob("*.py"):
        shutil.copy(module, root / "experiments")
    shutil.copy(c.readme_of(), c.readme_of(root))
    shutil.copytree(c.results_of(), c.results_of(root))
    return root


def _set_cell(root: Path, claim: str, column: str, value: str) -> None:
    readme = c.readme_of(root)
    lines = readme.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"| {claim} |"))
    cells = [x.strip() for x in lines[i].strip().strip("|").split("|")]
    cells[c.COLUMNS.index(column)] = value
    lines[i] = "| " + " | ".join(cells) + " |"
    readme.write_text("\n".join(lines) + "\n")


def _slow_one_rep(root: Path) -> None:
    """overhead's first lstm ddlscale step, doubled: overhead-lstm's check reads it."""
    path = c.results_of(root) / "overhead" / "results.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    row = next(r for r in rows if (r["workload"], r["strategy"]) == ("lstm", "ddlscale"))
    row["step_time_s"] = str(2 * float(row["step_time_s"]))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _write_runs(folder: Path, rows: list[dict[str, str]]) -> None:
    with (folder / "runs.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(c.RUNS_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)


def _edit_history(root: Path, folder: str, edit) -> None:
    """runs.csv's rows edited by ``edit(rows)`` as a hand would: in runs.csv and in results.md's Runs table
    together, the cells changed and the hashes left as they were."""
    where = c.results_of(root) / folder
    rows = c.read_runs(where)
    edited = edit([dict(r) for r in rows])
    _write_runs(where, edited)
    section = c.runs_section(edited).replace(c.chain_head(edited), c.chain_head(rows))  # the old hash line stays
    results_md = where / "results.md"
    results_md.write_text(results_md.read_text().replace(c.runs_section(rows), section))


def _missed_to_met(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """compression_hooks' first MISSED run, a history row (not the newest), turned met."""
    i = next(i for i, r in enumerate(rows) if r["verdict"] == "MISSED")
    assert i < len(rows) - 1
    rows[i]["verdict"] = "met"
    return rows


def _ran_dirty(root: Path, folder: str) -> None:
    """The folder's newest run marked as run on a dirty tree, chained and listed as the harness would have."""
    where = c.results_of(root) / folder
    rows = c.read_runs(where)
    run = c.newest_run(rows)["date"]
    rows = [{**r, "commit": r["commit"] + c.DIRTY if r["date"] == run else r["commit"]} for r in rows]
    _write_runs(where, c.chained([{k: r[k] for k in c.RUNS_COLUMNS[:-1]} for r in rows], []))
    results_md = where / "results.md"
    results_md.write_text(c.with_runs(results_md.read_text(), c.read_runs(where)))


def _drop_rep(root: Path, folder: str, rep: str) -> None:
    """One repetition's rows taken out of the folder's results.csv."""
    path = c.results_of(root) / folder / "results.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if r["rep"] != rep)


MUTATIONS = {
    "met-to-missed": (lambda root: _set_cell(root, "zen-vs-allgather-gpt", "verdict", "MISSED: by hand"),
                      "zen-vs-allgather-gpt"),
    "missed-to-met": (lambda root: _set_cell(root, "zen-vs-allgather-lstm", "verdict", "met"), "zen-vs-allgather-lstm"),
    "target-raised": (lambda root: _set_cell(root, "zen-vs-allgather-gpt", "target",
                                             "`median >= 5` allgather's median sync / Zen's"), "zen-vs-allgather-gpt"),
    "target-reworded": (lambda root: _set_cell(root, "zen-vs-allgather-gpt", "target",
                                               "`median >= 1.5` allgather's sync / Zen's, by hand"),
                        "zen-vs-allgather-gpt: runs.csv's newest target"),
    "csv-value": (_slow_one_rep, "overhead-lstm"),
    "runs-csv-deleted": (lambda root: (c.results_of(root) / "zen_volume" / "runs.csv").unlink(), "zen_volume"),
    "history-row-rewritten": (lambda root: _edit_history(root, "compression_hooks", _missed_to_met),
                              "compression_hooks/runs.csv line"),
    "history-row-deleted": (lambda root: _edit_history(root, "overhead", lambda rows: rows[:3] + rows[4:]),
                            "overhead/runs.csv line"),
    "newest-row-deleted": (lambda root: _edit_history(root, "zen_volume", lambda rows: rows[:-1]),
                           "zen_volume/results.md's Runs section"),
    "ran-dirty": (lambda root: _ran_dirty(root, "compression_schemes"),
                  "zen-vs-allgather-gpt: the only verdict is 'not counted: ran on a dirty tree"),
    "three-reps-in-the-csv": (lambda root: _drop_rep(root, "dcp_async", "3"),
                              "dcp-async-stall: the only verdict is 'not counted: 3 repetitions"),
}


def test_the_copy_as_it_is_passes(tmp_path):
    assert c.all_problems(_copy(tmp_path)) == []


@pytest.mark.parametrize("name", MUTATIONS)
def test_judging_a_mutated_copy_fails(tmp_path, name):
    mutate, where = MUTATIONS[name]
    root = _copy(tmp_path)
    mutate(root)
    problems = c.all_problems(root)
    assert any(where in p for p in problems), f"{name} not caught: {problems}"


def test_a_starved_run_stays_in_its_csv_but_no_check_counts_it(tmp_path):
    from experiments import claims

    path = tmp_path / "results.csv"
    path.write_text("method,rep,step_s,starved\nzen,0,1.0,False\nzen,1,9.0,True\nzen,2,3.0,\n")
    kept = claims.read_csv(path)
    assert [r["rep"] for r in kept.rows] == ["0", "2"] and "9.0" in path.read_text()
