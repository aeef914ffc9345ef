"""experiments/README.md's claims table: every figure recomputed from its CSV, every verdict judged.

The table has the columns ``id, claim, target, measured, verdict, folder, run, command, check``.
``tests/experiments/test_results_claims.py`` runs the checks below on every row; ``harness.Results`` runs the same
judging at the end of each experiment and appends the outcome to the folder's ``runs.csv``.

**check**: how a row's figure follows from a CSV of its folder::

    FILE [where KEY=VALUE ...] [per KEY,KEY ...]: EXPRESSION

``where`` keeps the CSV rows matching every filter (``=``, ``!=``, ``>=``, ``<=``; numbers compare as
numbers). ``per`` splits the kept rows into groups and evaluates EXPRESSION once per group; without it
EXPRESSION is evaluated once. Either way it gives values: a number, a list of numbers, or figures (below);
an empty list: this group gives none (e.g. a calibration point left out of a model's validation).
The row's "measured" cell is the median of the values and, in parentheses, their smallest and largest;
a value given as a figure counts by its median. EXPRESSION is Python over these names, each taking a
column and optional ``column=value`` filters on the current rows:

- ``col(c, ...)``: the column's values; ``v(c, ...)``: its one value (exactly one row must match);
  ``med``, ``lo``, ``hi``: their median, minimum, maximum; ``text(c, ...)``: the values as strings;
- ``paired(c, key, a, b, by="rep", ...)``: ``c`` where ``key == a`` over ``c`` where ``key == b``, one
  ratio per value of ``by`` (a repetition's runs made side by side);
- ``figure(median, low, high)``: a value with a range of its own. Without ``per``, one figure is the
  row's whole figure (e.g. the fastest and slowest single run beside the median of per-case medians);
  with ``per``, one value per group whose range the verdict weighs;
- ``spread(values)``: ``figure(median(values), min(values), max(values))``: a group's repetitions;
- ``load(file)``: another CSV of the folder, with the same names as methods;
- ``median``, ``mean``, ``min``, ``max``, ``abs``, ``len``, ``set``, ``sum``, ``sorted``.

A printed figure matches when it equals the check's to the digits the table prints.

**target** opens with one code span holding a rule, then words saying what is compared::

    `median OP NUMBER`   or   `every OP NUMBER`        OP: <, <=, >, >=

``median``: the row's figure. MISSED when its median fails; "within noise" when the median passes
but its low or high end does not; met when low, median and high all pass. ``every``: each value. MISSED
when any value's median fails; "within noise" when every median passes but some value's range
(a ``figure`` or ``spread``) straddles the target; met otherwise. A plain number is its own range.

**verdict**: ``met``, ``within noise`` (optionally ``: words``), ``MISSED: cause`` or ``not counted:
reason``. A claim is not counted when the rules exclude it: a timed claim (its command has ``--reps N``)
needs N >= 4, else its only verdict is ``not counted: N repetitions (< 4)...``; other exclusions (a fault
in a baseline) say why. Causes quote no measured figures (no number with a unit x, ms, s, MB, MiB, KB
or %; configured densities such as ``~1%`` are fine): they name what was measured, results.md holds it.
Where the claim's verdict changed across its runs, the word is followed by ``(flipped: WORD on DATE)``,
the newest earlier run with another verdict, e.g. ``met (flipped: MISSED on 2026-12-03)``.

**runs.csv**: every folder under experiments/results keeps one, appended by every run and never
rewritten: ``date, commit, dilation, reps, claim, figure, verdict``, one row per claim id per run
(claim ``-`` where a run judged no claim). Its newest row per claim is what the table shows.
"""

from __future__ import annotations

import csv
import math
import operator
import re
import shlex
import statistics
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("id", "claim", "target", "measured", "verdict", "folder", "run", "command", "check")
RUNS_COLUMNS = ("date", "commit", "dilation", "reps", "claim", "figure", "verdict")
VERDICTS = ("met", "within noise", "MISSED", "not counted")
MIN_REPS = 4
RUNS_HEADING = "## Runs"


def readme_of(root: Path = ROOT) -> Path:
    return root / "experiments" / "README.md"


def results_of(root: Path = ROOT) -> Path:
    return root / "experiments" / "results"


# ---- the check: a figure from a CSV ----

def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _matches(cell: str, want: object) -> bool:
    if cell == str(want):
        return True
    a, b = _number(cell), _number(str(want))
    return a is not None and b is not None and a == b


class Figure(tuple):
    """A median with its own low and high."""

    def __new__(cls, median: float, low: float, high: float):
        return super().__new__(cls, (float(median), float(low), float(high)))


def spread(values: Iterable[float]) -> Figure:
    """A group's repetitions as one value: their median, min and max."""
    values = list(values)
    return Figure(statistics.median(values), min(values), max(values))


class Table:
    """One CSV's rows, with the names a check's expression uses."""

    def __init__(self, rows: list[dict[str, str]], folder: Path):
        self.rows, self.folder = rows, folder

    def select(self, **eq: object) -> list[dict[str, str]]:
        return [r for r in self.rows if all(_matches(r[k], w) for k, w in eq.items())]

    def text(self, column: str, **eq: object) -> list[str]:
        return [r[column] for r in self.select(**eq)]

    def col(self, column: str, **eq: object) -> list[float]:
        values = [float(x) for x in self.text(column, **eq)]
        assert values, f"no rows with {column} where {eq}"
        return values

    def v(self, column: str, **eq: object) -> float:
        values = self.col(column, **eq)
        assert len(values) == 1, f"{len(values)} rows with {column} where {eq}, want one"
        return values[0]

    def med(self, column: str, **eq: object) -> float:
        return statistics.median(self.col(column, **eq))

    def lo(self, column: str, **eq: object) -> float:
        return min(self.col(column, **eq))

    def hi(self, column: str, **eq: object) -> float:
        return max(self.col(column, **eq))

    def paired(self, column: str, key: str, a: str, b: str, by: str = "rep", **eq: object) -> list[float]:
        tops = {r[by]: float(r[column]) for r in self.select(**{key: a, **eq})}
        bottoms = {r[by]: float(r[column]) for r in self.select(**{key: b, **eq})}
        assert tops and tops.keys() == bottoms.keys(), f"{key}={a} and {key}={b} not paired by {by}"
        return [tops[k] / bottoms[k] for k in sorted(tops)]

    def load(self, filename: str) -> Table:
        return read_csv(self.folder / filename)

    def names(self) -> dict[str, object]:
        own = {n: getattr(self, n) for n in ("col", "v", "med", "lo", "hi", "text", "paired", "load")}
        builtins = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max, "abs": abs,
                    "len": len, "set": set, "sum": sum, "sorted": sorted, "figure": Figure, "spread": spread}
        return {**own, **builtins}


def read_csv(path: Path) -> Table:
    with path.open(newline="") as f:
        return Table(list(csv.DictReader(f)), path.parent)


_FILTER = re.compile(r"^([\w.]+)(!=|>=|<=|=)(.+)$")


def _keep(row: dict[str, str], key: str, op: str, want: str) -> bool:
    if op == "=":
        return _matches(row[key], want)
    if op == "!=":
        return not _matches(row[key], want)
    a, b = float(row[key]), float(want)
    return a >= b if op == ">=" else a <= b


def _parse(check: str) -> tuple[str, list[tuple[str, str, str]], list[str], str]:
    """A check's file, filters, ``per`` keys and expression."""
    head, expression = check.split(":", 1)
    words = head.split()
    filename, words = words[0], words[1:]
    filters, per = [], []
    while words:
        word = words.pop(0)
        if word == "where":
            while words and words[0] != "per":
                match = _FILTER.match(words.pop(0))
                assert match, f"bad filter in {check!r}"
                filters.append(match.groups())
        elif word == "per":
            per = words.pop(0).split(",")
        else:
            raise AssertionError(f"unexpected {word!r} in {check!r}")
    return filename, filters, per, expression


def _groups(check: str, folder: Path) -> tuple[list[Table], bool, str]:
    """The tables the expression runs on (one per group), whether ``per`` split them, the expression."""
    filename, filters, per, expression = _parse(check)
    table = read_csv(folder / filename)
    for key, op, want in filters:
        assert table.rows and key in table.rows[0], f"{filename} has no column {key}"
        table = Table([r for r in table.rows if _keep(r, key, op, want)], folder)
    assert table.rows, f"{check!r} keeps no rows"
    if not per:
        return [table], False, expression
    groups: dict[tuple, list[dict[str, str]]] = {}
    for r in table.rows:
        groups.setdefault(tuple(r[k] for k in per), []).append(r)
    return [Table(rows, folder) for rows in groups.values()], True, expression


def measure(check: str, folder: Path) -> tuple[Figure, list[Figure]]:
    """The row's figure (median, min, max) and the values it is taken over, each with its own range."""
    tables, split, expression = _groups(check, folder)
    values: list[Figure] = []
    for table in tables:
        value = eval(expression, {"__builtins__": {}, **table.names()})  # noqa: S307 - the README's own checks
        if isinstance(value, Figure) and not split:
            return value, [value]  # the row's whole figure, given apart
        for x in value if isinstance(value, list | tuple) and not isinstance(value, Figure) else [value]:
            values.append(x if isinstance(x, Figure) else Figure(x, x, x))
    medians = [v[0] for v in values]
    assert medians and not any(math.isnan(x) for x in medians), f"{check!r} gives {medians}"
    return Figure(statistics.median(medians), min(medians), max(medians)), values


def evaluate(check: str, folder: Path) -> Figure:
    """A check's median, min and max: over its groups with ``per``, else over the expression's value(s)."""
    return measure(check, folder)[0]


# ---- the measured cell: how the table prints a figure ----

_NUM, _UNIT = r"([-+]?\d+(?:\.\d+)?)", r"(x|%| s| ms)?"
_MEASURED = re.compile(rf"^{_NUM}{_UNIT}(?: \({_NUM}{_UNIT}(-| to ){_NUM}{_UNIT}\))?(.*)$")


def _measured(cell: str) -> re.Match:
    match = _MEASURED.match(cell)
    assert match, f"a measured cell starts with its median: {cell!r}"
    rest = match.group(8)
    assert rest == "" or (rest[0] in " :;" and not rest.startswith(" (")), f"cannot read {cell!r}"
    return match


def shown(cell: str) -> tuple[str, str | None, str | None]:
    """A "measured" cell's median and, where shown, its min and max, as printed: ``1.02x (0.96-1.17x)``,
    ``-2% (-17 to +12%)`` or ``1.30x``, a unit of x, %, s or ms, then any words after a space, : or ;."""
    match = _measured(cell)
    return match.group(1), match.group(3), match.group(6)


def figure_text(cell: str) -> str:
    """The figure of a measured cell without the words after it: what runs.csv records."""
    match = _measured(cell)
    return cell[:match.start(8)]


def _like(value: float, printed: str, signed: bool) -> str:
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:{'+' if signed else ''}.{decimals}f}"


def reprint(template: str, figure: Figure) -> str:
    """``figure`` printed as ``template`` (a measured cell) prints its own: digits, units, range style."""
    match = _MEASURED.match(template)
    if not match:
        return f"{figure[0]:.3g} ({figure[1]:.3g}-{figure[2]:.3g})"
    signed = match.group(5) == " to "
    text = _like(figure[0], match.group(1), signed) + (match.group(2) or "")
    if match.group(3) is None:
        return text
    low = _like(figure[1], match.group(3), signed) + (match.group(4) or "")
    high = _like(figure[2], match.group(6), signed) + (match.group(7) or "")
    return f"{text} ({low}{match.group(5)}{high})"


def agrees(printed: str, value: float) -> bool:
    """``value`` rounds to ``printed`` (half a unit of its last digit, and a hair for float error)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9 * max(1.0, abs(value))


# ---- the target's rule and the verdict ----

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_RULE = re.compile(r"^`(median|every) (<=|>=|<|>) ([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)` \S")


def rule(target: str) -> tuple[str, str, float]:
    """The rule a target cell opens with: (``median`` or ``every``, OP, NUMBER)."""
    match = _RULE.match(target)
    assert match, f"a target opens with `median OP NUMBER` or `every OP NUMBER`, then words: {target!r}"
    return match.group(1), match.group(2), float(match.group(3))


def judge(target_rule: tuple[str, str, float], figure: Figure, values: list[Figure]) -> str:
    """met, within noise or MISSED: ``median`` weighs the row's figure, ``every`` each value."""
    kind, op, threshold = target_rule

    def passes(x: float) -> bool:
        return _OPS[op](x, threshold)

    cases = [figure] if kind == "median" else values
    if not all(passes(c[0]) for c in cases):
        return "MISSED"
    if not all(passes(c[1]) and passes(c[2]) for c in cases):
        return "within noise"
    return "met"


def reps_of(command: str) -> int | None:
    """The command's ``--reps N``, or None where it has none (not timed by repetitions)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--reps" and i + 1 < len(words):
            return int(words[i + 1])
        if word.startswith("--reps="):
            return int(word.split("=", 1)[1])
    return None


def verdict_of(target: str, command: str, figure: Figure, values: list[Figure]) -> str:
    """The verdict word the rules give: not counted under MIN_REPS repetitions, else the rule's."""
    reps = reps_of(command)
    if reps is not None and reps < MIN_REPS:
        return "not counted"
    return judge(rule(target), figure, values)


_WORD = "|".join(VERDICTS)
_VERDICT = re.compile(rf"^({_WORD})(?: \(flipped: ({_WORD}) on (\d{{4}}-\d{{2}}-\d{{2}})\))?(?:: (.+))?$")


def verdict_parts(cell: str) -> tuple[str, tuple[str, str] | None, str | None]:
    """A verdict cell's word, its ``(flipped: WORD on DATE)`` if any, and its cause (None: none)."""
    match = _VERDICT.match(cell)
    assert match, f"a verdict is {', '.join(VERDICTS)}, optionally (flipped: WORD on DATE), then ': words'"
    flipped = (match.group(2), match.group(3)) if match.group(2) else None
    return match.group(1), flipped, match.group(4)


# a measured figure in words: a number with a unit, but not a configured density such as ~1%
_QUOTED = re.compile(r"(?<![~\w.])[-+]?\d+(?:\.\d+)?(?:x(?!\w)|\s?(?:ms|s|MB|MiB|KB)(?!\w)|\s?%)")


def quoted_figures(cause: str) -> list[str]:
    """The measured figures a cause quotes (it should quote none: results.md holds them)."""
    return _QUOTED.findall(cause)


# ---- the table ----

def claims(readme: Path | None = None) -> list[dict[str, str]]:
    """The rows of the README's claims table, by column name."""
    lines = (readme or readme_of()).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| id |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    assert tuple(header) == COLUMNS, f"claims table columns {header}, want {COLUMNS}"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"row with {len(cells)} cells: {line[:80]}"
        rows.append(dict(zip(COLUMNS, cells, strict=True)))
    return rows


def code(cell: str) -> str:
    """The text of a cell that is one `code` span."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected one `code` span, got {cell!r}"
    return match.group(1)


# ---- runs.csv and results.md's Runs section ----

def read_runs(folder: Path) -> list[dict[str, str]]:
    path = folder / "runs.csv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_runs(folder: Path, rows: list[dict[str, str]]) -> None:
    """Add rows at the end of runs.csv (written with its header when new); earlier rows stay as they are."""
    path = folder / "runs.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(RUNS_COLUMNS))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def runs_section(rows: list[dict[str, str]]) -> str:
    """results.md's closing section: every run in runs.csv, oldest first."""
    lines = [RUNS_HEADING, "",
             "Every run of this experiment (runs.csv: each run appends its rows, none is rewritten; claim `-`: "
             "a run no claim judged):", "",
             "| " + " | ".join(RUNS_COLUMNS) + " |", "|" + "---|" * len(RUNS_COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in RUNS_COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def without_runs(text: str) -> str:
    """results.md without its Runs section: from the heading to the next heading or the end."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith("#"):
            skipping = line.strip() == RUNS_HEADING
        if not skipping:
            out.append(line)
    return "\n".join(out)


def judge_run(row: dict[str, str], folder: Path, command: str) -> tuple[str, str]:
    """A row's figure as the table prints it and the verdict the rules give, on ``folder``'s CSVs as they are
    now, for a run made with ``command``."""
    figure, values = measure(code(row["check"]), folder)
    return reprint(row["measured"], figure), verdict_of(row["target"], command, figure, values)


# ---- what the claims test asserts, for a tree rooted at ``root`` (the repository, or a copy of it) ----

_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_MACHINE = re.compile(r"^Machine: .*date (\d{4}-\d{2}-\d{2}) \d{2}:\d{2}, commit ([0-9a-f]{7,40}(?:\+dirty)?)\b", re.M)
_VERDICT_WORDS = re.compile(r"\b(met|MISSED|within noise|not counted)\b")


def _problems(check, *args) -> list[str]:
    """``check``'s problems, an exception counting as one (a check that cannot run does not pass)."""
    try:
        return check(*args)
    except Exception as e:  # any failure to judge is a problem to report
        return [f"{check.__name__}: {type(e).__name__}: {e}"]


def table_problems(rows: list[dict[str, str]]) -> list[str]:
    ids = [r["id"] for r in rows]
    out = [f"bad id {i!r}" for i in ids if not _ID.match(i)]
    out += [f"id {i!r} twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    return out


def command_problems(row: dict[str, str], root: Path) -> list[str]:
    """The row names a results folder and the command that wrote it, run on the date it gives."""
    folder = results_of(root) / code(row["folder"])
    if not folder.is_dir():
        return [f"no folder {folder}"]
    command = code(row["command"])
    match = re.match(r"python -m experiments\.(\w+)", command)
    if not match or not (root / "experiments" / f"{match.group(1)}.py").is_file():
        return [f"not an experiment command: {command}"]
    text = (folder / "results.md").read_text()
    out = [] if f"`{command}`" in text else [f"{folder.name}/results.md does not give the command {command}"]
    machine = _MACHINE.search(text)
    if not machine:
        out.append(f"{folder.name}/results.md has no 'Machine: ... date YYYY-MM-DD HH:MM, commit HASH' line")
    elif machine.group(1) != row["run"]:
        out.append(f"{folder.name} ran on {machine.group(1)}, row says {row['run']}")
    return out


def figure_problems(row: dict[str, str], root: Path) -> list[str]:
    """The measured cell prints what the check computes from the CSV."""
    median, smallest, largest = evaluate(code(row["check"]), results_of(root) / code(row["folder"]))
    middle, low, high = shown(row["measured"])
    out = [] if agrees(middle, median) else [f"median {median:.6g}, table {middle}"]
    if low is not None and not agrees(low, smallest):
        out.append(f"min {smallest:.6g}, table {low}")
    if high is not None and not agrees(high, largest):
        out.append(f"max {largest:.6g}, table {high}")
    return out


def verdict_problems(row: dict[str, str], root: Path) -> list[str]:
    """The verdict is the one the rules give the figure, its cause quotes no measured figure."""
    command = code(row["command"])
    figure, values = measure(code(row["check"]), results_of(root) / code(row["folder"]))
    want = verdict_of(row["target"], command, figure, values)
    word, _, cause = verdict_parts(row["verdict"])
    reps = reps_of(command)
    out = []
    if want == "not counted":
        prefix = f"{reps} repetitions (< {MIN_REPS})"
        if word != "not counted" or not (cause or "").startswith(prefix):
            out.append(f"{reps} repetitions: the only verdict is 'not counted: {prefix}...', not {word!r}")
    elif word == "not counted":
        if not cause:
            out.append("'not counted' without the reason the rules exclude it")
    elif word != want:
        out.append(f"the figure {row['measured']!r} is {want!r} under {row['target'].split('`')[1]!r}, "
                   f"the row says {word!r}")
    if word in ("MISSED", "not counted") and not cause:
        out.append(f"'{word}' without its cause")
    if word == "met" and cause:
        out.append("'met' takes no cause")
    if cause and quoted_figures(cause):
        out.append(f"the cause quotes measured figures {quoted_figures(cause)}: point at results.md instead")
    return out


def history_problems(row: dict[str, str], root: Path) -> list[str]:
    """runs.csv's newest run of the claim is the row's, and a verdict that changed across runs says so."""
    mine = [r for r in read_runs(results_of(root) / code(row["folder"])) if r["claim"] == row["id"]]
    if not mine:
        return [f"runs.csv has no run of {row['id']}"]
    newest, (word, flipped, cause) = mine[-1], verdict_parts(row["verdict"])
    out = []
    if newest["figure"] != figure_text(row["measured"]):
        out.append(f"runs.csv's newest figure {newest['figure']!r}, the table {figure_text(row['measured'])!r}")
    if newest["verdict"] != word and not (word == "not counted" and cause):
        out.append(f"runs.csv's newest verdict {newest['verdict']!r}, the table {word!r}")
    if not newest["date"].startswith(row["run"]):
        out.append(f"runs.csv's newest run on {newest['date']}, the table {row['run']}")
    other = [r for r in mine[:-1] if r["verdict"] in VERDICTS and r["verdict"] != word]
    want = (other[-1]["verdict"], other[-1]["date"][:10]) if other else None
    if flipped != want:
        out.append(f"the verdict should say (flipped: {want[0]} on {want[1]})" if want
                   else "no earlier run had another verdict: drop (flipped: ...)")
    return out


def folder_problems(folder: Path) -> list[str]:
    """runs.csv is there and whole, results.md names its commit, lists every run and states no verdict
    outside its Runs section (the table's verdicts are the README's and runs.csv's)."""
    if not (folder / "runs.csv").exists():
        return [f"{folder.name}: no runs.csv"]
    with (folder / "runs.csv").open(newline="") as f:
        header = next(csv.reader(f), [])
    if tuple(header) != RUNS_COLUMNS:
        return [f"{folder.name}/runs.csv columns {header}, want {list(RUNS_COLUMNS)}"]
    runs = read_runs(folder)
    text = (folder / "results.md").read_text()
    out = [] if runs else [f"{folder.name}/runs.csv lists no run"]
    if not _MACHINE.search(text):
        out.append(f"{folder.name}/results.md names no commit on its Machine line")
    words = sorted(set(_VERDICT_WORDS.findall(without_runs(text))))
    if words:
        out.append(f"{folder.name}/results.md states verdicts {words} outside its Runs section")
    if runs_section(runs) not in text:
        out.append(f"{folder.name}/results.md's Runs section does not list runs.csv as it is")
    return out


def all_problems(root: Path = ROOT) -> list[str]:
    """Every problem the claims test finds in the tree at ``root``."""
    rows = claims(readme_of(root))
    out = table_problems(rows)
    for row in rows:
        for check in (command_problems, figure_problems, verdict_problems, history_problems):
            out += [f"{row['id']}: {p}" for p in _problems(check, row, root)]
    for folder in sorted(p for p in results_of(root).iterdir() if p.is_dir()):
        out += _problems(folder_problems, folder)
    return out
