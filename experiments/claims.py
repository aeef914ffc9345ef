"""experiments/README.md's claims table: every figure recomputed from its CSV, every verdict judged.

The table has the columns ``id, claim, target, measured, verdict, folder, run, command, check``.
``tests/experiments/test_results_claims.py`` runs the checks below on every row; ``harness.Results`` runs the same
judging at the end of each experiment and appends the outcome to the folder's ``runs.csv``.

**check**: how a row's figure follows from a CSV of its folder::

    FILE [where KEY=VALUE ...] [per KEY,KEY ...]: EXPRESSION

``where`` keeps the CSV rows matching every filter (``=``, ``!=``, ``>=``, ``<=``; numbers compare as
numbers; ``~`` and ``!~``: the cell does or does not contain a match of a regular expression). ``per`` splits
the kept rows into groups and evaluates EXPRESSION once per group; without it EXPRESSION is evaluated once.
Either way it gives values: a number, a list of numbers, or figures (below); an empty list: this group
gives none (e.g. a calibration point left out of a model's validation). The row's "measured" cell is the
median of the values and, in parentheses, their smallest and largest; a value given as a figure counts by
its median. EXPRESSION is Python over these names, each taking a column and optional ``column=value``
filters on the current rows:

- ``col(c, ...)``: the column's values; ``v(c, ...)``: its one value (exactly one row must match);
  ``med``, ``lo``, ``hi``: their median, minimum, maximum; ``text(c, ...)``: the values as strings;
- ``paired(c, key, a, b, by="rep", ...)``: ``c`` where ``key == a`` over ``c`` where ``key == b``, one
  ratio per value of ``by`` (a repetition's runs made side by side; each side one row per repetition);
  ``pair(c, top, bottom, by="rep", ...)``: the same with a dict of filters per side, e.g.
  ``pair("sync_s", {"method": "torch"}, {"method": "zen", "route": "sparse"})``;
- ``lowest(c, side, side, ...)``: of the sides (dicts of filters), the one whose rows have the lowest
  median of ``c`` (e.g. the fastest other method, to pair with repetition by repetition);
- ``figure(median, low, high)``: a value with a range of its own. Without ``per``, one figure is the
  row's whole figure (e.g. the fastest and slowest single run beside the median of per-case medians);
  with ``per``, one value per group whose range the verdict weighs;
- ``spread(values)``: ``figure(median(values), min(values), max(values))``: a group's repetitions;
- ``load(file)``: another CSV of the folder, with the same names as methods;
- ``median``, ``mean``, ``min``, ``max``, ``abs``, ``len``, ``set``, ``sum``, ``sorted``, ``zip``.

A printed figure matches when it equals the check's to the digits the table prints.

**Per repetition.** Where runs pair (a CSV with a ``rep`` column: the runs of one repetition were made side
by side), a ratio is taken per repetition (``paired``, ``pair``, ``per ... rep``) and the values keep their
range (``spread``). A value that folds several repetitions into one number (``med``, ``lo``, ``hi``,
``col`` or ``v`` over rows of more than one repetition, or a row of a CSV of medians whose ``runs`` column
says it pools several runs) and is not a figure hides its spread: the verdict it gives is at most "within
noise", never met. Claims read the per-run CSV (one row per run), not a table of medians, wherever the
experiment keeps one.

**target** opens with one code span holding a rule, then words saying what is compared::

    `median OP NUMBER`   or   `every OP NUMBER`        OP: <, <=, >, >=

``median``: the row's figure. MISSED when its median fails; "within noise" when the median passes
but its low or high end does not; met when low, median and high all pass. ``every``: each value. MISSED
when any value's median fails; "within noise" when every median passes but some value's range
(a ``figure`` or ``spread``) straddles the target; met otherwise. A plain number is its own range.

**verdict**: ``met``, ``within noise`` (optionally ``: words``), ``MISSED: cause`` or ``not counted:
reason``. A claim is not counted when the rules exclude it:

- its run's tree was dirty (the run's commit ends ``+dirty``: the code it ran is not recorded): the only
  verdict is ``not counted: ran on a dirty tree...``;
- a timed claim (the rows its check reads have a ``rep`` column, or a ``runs`` column in a CSV of medians)
  needs MIN_REPS repetitions, counted in those rows (distinct ``rep`` values, or the fewest ``runs``), not
  read off the command: with fewer its only verdict is ``not counted: N repetitions (< 4)...``;
- other exclusions (a fault in a baseline) say why.

Causes quote no measured figures (no number with a unit x, ms, s, MB, MiB, KB or %; configured densities
such as ``~1%`` are fine): they name what was measured, results.md holds it. Where the claim's verdict
changed across its runs.csv rows, the word is followed by ``(flipped: WORD on DATE)``, the newest earlier
row with another verdict, e.g. ``met (flipped: MISSED on 2026-12-03)``.

**Starved runs**: a CSV row whose ``starved`` column is true (its emulated machines got less CPU than
their share, :mod:`ddlscale.cluster.cpuload`) stays in the CSV and is left out of every check.

**runs.csv**: every folder under experiments/results keeps one, appended to and never rewritten, with
the columns RUNS_COLUMNS: ``date, commit, dilation, reps, claim, target, figure, verdict, run,
prev_sha256``. Each run appends one row per claim id (claim ``-`` where a run judged no claim), its
``run`` its own date; re-judging a claim on the CSVs the folder holds (``python -m experiments.claims
--rejudge ID ...``, on a clean tree: a changed rule or check) appends a row with its own date and commit
whose ``run`` names the run it judged. ``reps``: the repetitions the claim's check counted (a claim ``-``
row: the command's ``--reps``); ``target``: the target the row was judged against. ``prev_sha256`` is the
sha256 of the row before it (``row_text``: its cells as one CSV line, its own ``prev_sha256`` included;
the first row's is GENESIS), and results.md's Runs section ends with the hash of the last row, so
rewriting or deleting a row breaks the chain and fails the claims test. The newest row per claim is what
the table shows, its target included. Rows written before runs.csv held targets and hashes (up to
2026-12-07) were migrated: their cells kept (their ``reps`` the command's ``--reps``), their target the
one README.md gave that claim at commit 7641419 (a target reworded since then is in the re-judged rows),
their ``run`` their own date, the chain computed over the migrated rows.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import math
import operator
import re
import shlex
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("id", "claim", "target", "measured", "verdict", "folder", "run", "command", "check")
RUNS_COLUMNS = ("date", "commit", "dilation", "reps", "claim", "target", "figure", "verdict", "run", "prev_sha256")
RUNS_SHOWN = ("date", "commit", "dilation", "reps", "claim", "figure", "verdict", "run")  # results.md's Runs table
GENESIS = "0" * 64  # the prev_sha256 of a runs.csv's first row
VERDICTS = ("met", "within noise", "MISSED", "not counted")
MIN_REPS = 4
REP, RUNS = "rep", "runs"  # a per-run CSV's repetition column; a CSV of medians' count of runs per row
DIRTY = "+dirty"  # harness.git_commit's mark of a tree whose tracked files differ from its commit
DIRTY_REASON = "ran on a dirty tree"
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


def repetitions(rows: list[dict[str, str]]) -> int | None:
    """How many repetitions ``rows`` hold: their distinct ``rep`` values, else the fewest ``runs`` a row of
    medians pools; None where the rows have neither column (not repeated runs: bytes, a model, a loss)."""
    reps = {r[REP] for r in rows if REP in r}
    if reps:
        return len(reps)
    runs = [int(float(r[RUNS])) for r in rows if r.get(RUNS)]
    return min(runs) if runs else None


class Reads:
    """The rows one evaluation of a check read, and whether a read folded several repetitions into one
    number (a median, a minimum, a value of a row of medians)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []
        self.folded = False

    def note(self, rows: list[dict[str, str]], folds: bool) -> None:
        self.rows += rows
        self.folded |= folds and (repetitions(rows) or 1) > 1


class Table:
    """One CSV's rows, with the names a check's expression uses; what they read is noted in ``reads``."""

    def __init__(self, rows: list[dict[str, str]], folder: Path, reads: Reads | None = None):
        self.rows, self.folder = rows, folder
        self.reads = reads if reads is not None else Reads()

    def select(self, **eq: object) -> list[dict[str, str]]:
        return [r for r in self.rows if all(_matches(r[k], w) for k, w in eq.items())]

    def _read(self, folds: bool, **eq: object) -> list[dict[str, str]]:
        rows = self.select(**eq)
        self.reads.note(rows, folds)
        return rows

    def text(self, column: str, **eq: object) -> list[str]:
        return [r[column] for r in self._read(False, **eq)]

    def col(self, column: str, **eq: object) -> list[float]:
        values = [float(r[column]) for r in self._read(True, **eq)]
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

    def _by(self, column: str, by: str, eq: dict[str, object]) -> dict[str, float]:
        rows = self._read(False, **eq)
        keys = [r[by] for r in rows]
        assert len(set(keys)) == len(keys), f"several rows per {by} where {eq}: a pair takes one run each"
        return {r[by]: float(r[column]) for r in rows}

    def pair(self, column: str, top: dict[str, object], bottom: dict[str, object], by: str = REP,
             **eq: object) -> list[float]:
        tops, bottoms = self._by(column, by, {**eq, **top}), self._by(column, by, {**eq, **bottom})
        assert tops and tops.keys() == bottoms.keys(), f"{top} and {bottom} not paired by {by}"
        return [tops[k] / bottoms[k] for k in sorted(tops)]

    def paired(self, column: str, key: str, a: str, b: str, by: str = REP, **eq: object) -> list[float]:
        return self.pair(column, {key: a}, {key: b}, by, **eq)

    def lowest(self, column: str, *sides: dict[str, object]) -> dict[str, object]:
        """The side whose rows have the lowest median of ``column``: a choice, not a value."""
        return min(sides, key=lambda side: statistics.median(float(r[column]) for r in self._read(False, **side)))

    def load(self, filename: str) -> Table:
        return read_csv(self.folder / filename, self.reads)

    def names(self) -> dict[str, object]:
        own = {n: getattr(self, n) for n in ("col", "v", "med", "lo", "hi", "text", "pair", "paired", "lowest",
                                             "load")}
        builtins = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max, "abs": abs,
                    "len": len, "set": set, "sum": sum, "sorted": sorted, "zip": zip, "figure": Figure,
                    "spread": spread}
        return {**own, **builtins}


STARVED = "starved"  # a run whose machines got less CPU than their share (ddlscale.cluster.cpuload)


def counted(row: dict[str, str]) -> bool:
    """Whether a run counts: one whose emulated machines were starved of CPU stays in its CSV, uncounted."""
    return str(row.get(STARVED, "")).strip().lower() not in ("true", "1")


def read_csv(path: Path, reads: Reads | None = None) -> Table:
    with path.open(newline="") as f:
        return Table([row for row in csv.DictReader(f) if counted(row)], path.parent, reads)


_FILTER = re.compile(r"^([\w.]+)(!~|!=|>=|<=|=|~)(.+)$")


def _keep(row: dict[str, str], key: str, op: str, want: str) -> bool:
    if op == "=":
        return _matches(row[key], want)
    if op == "!=":
        return not _matches(row[key], want)
    if op in ("~", "!~"):
        return bool(re.search(want, row[key])) == (op == "~")
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


class Measurement(NamedTuple):
    """What a check gives: the row's figure, the values it is taken over (each with its own range), the
    repetitions in the rows it read (None: not repeated runs) and whether a value folded several
    repetitions into one number (then it is never met)."""

    figure: Figure
    values: list[Figure]
    reps: int | None
    pooled: bool


def _flat(value: object) -> list:
    return list(value) if isinstance(value, list | tuple) and not isinstance(value, Figure) else [value]


def measure(check: str, folder: Path) -> Measurement:
    """The row's figure (median, min, max), its values, their repetitions and whether one was pooled."""
    tables, split, expression = _groups(check, folder)
    values: list[Figure] = []
    read: list[dict[str, str]] = []
    pooled = False
    for table in tables:
        value = eval(expression, {"__builtins__": {}, **table.names()})  # noqa: S307 - the README's own checks
        read += table.reads.rows
        if isinstance(value, Figure) and not split:
            return Measurement(value, [value], repetitions(read), False)  # the row's whole figure, given apart
        for x in _flat(value):
            pooled |= table.reads.folded and not isinstance(x, Figure)  # a figure shows its own range
            values.append(x if isinstance(x, Figure) else Figure(x, x, x))
    medians = [v[0] for v in values]
    assert medians and not any(math.isnan(x) for x in medians), f"{check!r} gives {medians}"
    return Measurement(Figure(statistics.median(medians), min(medians), max(medians)), values,
                       repetitions(read), pooled)


def evaluate(check: str, folder: Path) -> Figure:
    """A check's median, min and max: over its groups with ``per``, else over the expression's value(s)."""
    return measure(check, folder).figure


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


def judge(target_rule: tuple[str, str, float], figure: Figure, values: list[Figure], pooled: bool = False) -> str:
    """met, within noise or MISSED: ``median`` weighs the row's figure, ``every`` each value; a figure with
    a value pooled from several repetitions is never met (its spread is not known), at most within noise."""
    kind, op, threshold = target_rule

    def passes(x: float) -> bool:
        return _OPS[op](x, threshold)

    cases = [figure] if kind == "median" else values
    if not all(passes(c[0]) for c in cases):
        return "MISSED"
    if pooled or not all(passes(c[1]) and passes(c[2]) for c in cases):
        return "within noise"
    return "met"


def reps_of(command: str) -> int | None:
    """The command's ``--reps N``, or None where it has none: what runs.csv records for a run no claim
    judged (the rules count the repetitions in the CSV, ``Measurement.reps``)."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--reps" and i + 1 < len(words):
            return int(words[i + 1])
        if word.startswith("--reps="):
            return int(word.split("=", 1)[1])
    return None


def is_dirty(commit: str) -> bool:
    return commit.endswith(DIRTY)


def exclusion(measured: Measurement, dirty: bool) -> str | None:
    """Why the rules do not count a figure (the start of its 'not counted' reason), or None: its run's tree
    was dirty, or the rows it read hold fewer than MIN_REPS repetitions."""
    if dirty:
        return DIRTY_REASON
    if measured.reps is not None and measured.reps < MIN_REPS:
        return f"{measured.reps} repetitions (< {MIN_REPS})"
    return None


def verdict_of(target: str, measured: Measurement, dirty: bool = False) -> str:
    """The verdict word the rules give: not counted where excluded, else the target rule's."""
    if exclusion(measured, dirty):
        return "not counted"
    return judge(rule(target), measured.figure, measured.values, measured.pooled)


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


def row_text(row: dict[str, str]) -> str:
    """A runs.csv row's canonical text: its cells in RUNS_COLUMNS order as one CSV line, its prev_sha256 too."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow([row[c] for c in RUNS_COLUMNS])
    return out.getvalue()


def row_hash(row: dict[str, str]) -> str:
    return hashlib.sha256(row_text(row).encode()).hexdigest()


def chain_head(rows: list[dict[str, str]]) -> str:
    """The hash the next row chains from: the last row's, or GENESIS before the first."""
    return row_hash(rows[-1]) if rows else GENESIS


def chained(rows: list[dict[str, str]], after: list[dict[str, str]]) -> list[dict[str, str]]:
    """``rows`` (without prev_sha256) as they follow ``after``: each with the hash of the row before it."""
    out: list[dict[str, str]] = []
    for row in rows:
        out.append({**row, "prev_sha256": chain_head([*after, *out])})
    return out


def append_runs(folder: Path, rows: list[dict[str, str]]) -> None:
    """Add rows at the end of runs.csv (written with its header when new), each chained to the row before it;
    earlier rows stay as they are."""
    path = folder / "runs.csv"
    rows = chained(rows, read_runs(folder))
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(RUNS_COLUMNS))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def runs_section(rows: list[dict[str, str]]) -> str:
    """results.md's closing section: every row of runs.csv, oldest first, and the hash of the last."""
    lines = [RUNS_HEADING, "",
             "Every run of this experiment and every re-judging of its claims (runs.csv: rows are appended, none "
             "is rewritten; claim `-`: a run no claim judged; run: the run whose CSVs the row judged; runs.csv "
             "also holds each row's target and the sha256 of the row before it):", "",
             "| " + " | ".join(RUNS_SHOWN) + " |", "|" + "---|" * len(RUNS_SHOWN)]
    lines += ["| " + " | ".join(r[c] for c in RUNS_SHOWN) + " |" for r in rows]
    lines += ["", f"sha256 of runs.csv's last row: `{chain_head(rows)}`"]
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


def with_runs(text: str, rows: list[dict[str, str]]) -> str:
    """results.md with its Runs section (at its end, where each run writes it) listing ``rows``."""
    return without_runs(text).rstrip("\n") + "\n\n" + runs_section(rows)


def judge_run(row: dict[str, str], folder: Path, dirty: bool) -> tuple[str, str, str]:
    """A row's figure as the table prints it, the verdict the rules give and the repetitions counted, on
    ``folder``'s CSVs as they are now, for a run on a dirty tree or not."""
    measured = measure(code(row["check"]), folder)
    reps = "-" if measured.reps is None else str(measured.reps)
    return reprint(row["measured"], measured.figure), verdict_of(row["target"], measured, dirty), reps


def newest_run(runs: list[dict[str, str]]) -> dict[str, str]:
    """The newest row a run wrote (not a re-judging): its CSVs are the folder's."""
    return [r for r in runs if r["run"] == r["date"]][-1]


def run_of(runs: list[dict[str, str]], row: dict[str, str]) -> dict[str, str]:
    """A row written by the run whose CSVs ``row`` judged: ``row`` itself, or the run a re-judging names."""
    return next(r for r in runs if r["date"] == row["run"] == r["run"])


def rejudge(claim_ids: list[str], commit: str, date: str, root: Path = ROOT) -> list[dict[str, str]]:
    """Judge the claims again on their folders' CSVs as they are, under the table's target, check and rules
    now; append a row each to runs.csv (``run``: the folder's newest run) and relist results.md's Runs."""
    assert not is_dirty(commit), "re-judge from a clean tree: the row's commit names the code that judged"
    table = {r["id"]: r for r in claims(readme_of(root))}
    written = []
    for claim_id in claim_ids:
        row = table[claim_id]
        folder = results_of(root) / code(row["folder"])
        run = newest_run(read_runs(folder))
        figure, verdict, reps = judge_run(row, folder, is_dirty(run["commit"]))
        written.append({"date": date, "commit": commit, "dilation": run["dilation"], "reps": reps,
                        "claim": claim_id, "target": row["target"], "figure": figure, "verdict": verdict,
                        "run": run["date"]})
        append_runs(folder, written[-1:])
        results_md = folder / "results.md"
        results_md.write_text(with_runs(results_md.read_text(), read_runs(folder)))
    return written


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


def per_run_csvs(folder: Path) -> list[str]:
    """The folder's CSVs with a ``rep`` column: one row per run."""
    out = []
    for path in sorted(folder.glob("*.csv")):
        with path.open(newline="") as f:
            if REP in next(csv.reader(f), []):
                out.append(path.name)
    return out


def figure_problems(row: dict[str, str], root: Path) -> list[str]:
    """The measured cell prints what the check computes from the CSV, a per-run CSV where the folder keeps one."""
    folder = results_of(root) / code(row["folder"])
    measured = measure(code(row["check"]), folder)
    (median, smallest, largest), (middle, low, high) = measured.figure, shown(row["measured"])
    out = [] if agrees(middle, median) else [f"median {median:.6g}, table {middle}"]
    if low is not None and not agrees(low, smallest):
        out.append(f"min {smallest:.6g}, table {low}")
    if high is not None and not agrees(high, largest):
        out.append(f"max {largest:.6g}, table {high}")
    if measured.reps is None and per_run_csvs(folder):
        out.append(f"the check reads no repetitions where the folder keeps per-run rows ({', '.join(per_run_csvs(folder))})")
    return out


def ran_dirty(row: dict[str, str], root: Path) -> bool:
    """Whether the run behind the claim's newest runs.csv row ran on a dirty tree."""
    runs = read_runs(results_of(root) / code(row["folder"]))
    mine = [r for r in runs if r["claim"] == row["id"]]
    return bool(mine) and is_dirty(run_of(runs, mine[-1])["commit"])


def verdict_problems(row: dict[str, str], root: Path) -> list[str]:
    """The verdict is the one the rules give the figure, its cause quotes no measured figure."""
    measured = measure(code(row["check"]), results_of(root) / code(row["folder"]))
    why = exclusion(measured, ran_dirty(row, root))
    word, _, cause = verdict_parts(row["verdict"])
    out = []
    if why:
        if word != "not counted" or not (cause or "").startswith(why):
            out.append(f"the only verdict is 'not counted: {why}...', not {row['verdict'][:40]!r}")
    elif word == "not counted":
        if not cause:
            out.append("'not counted' without the reason the rules exclude it")
    elif word != (want := verdict_of(row["target"], measured)):
        pooled = " (a value pooled from several repetitions: at most within noise)" if measured.pooled else ""
        out.append(f"the figure {row['measured']!r} is {want!r}{pooled} under {row['target'].split('`')[1]!r}, "
                   f"the row says {word!r}")
    if word in ("MISSED", "not counted") and not cause:
        out.append(f"'{word}' without its cause")
    if word == "met" and cause:
        out.append("'met' takes no cause")
    if cause and quoted_figures(cause):
        out.append(f"the cause quotes measured figures {quoted_figures(cause)}: point at results.md instead")
    return out


def history_problems(row: dict[str, str], root: Path) -> list[str]:
    """runs.csv's newest row of the claim is the table's (figure, verdict, target, run), and a verdict that
    changed across rows says so."""
    mine = [r for r in read_runs(results_of(root) / code(row["folder"])) if r["claim"] == row["id"]]
    if not mine:
        return [f"runs.csv has no run of {row['id']}"]
    newest, (word, flipped, cause) = mine[-1], verdict_parts(row["verdict"])
    out = []
    if newest["figure"] != figure_text(row["measured"]):
        out.append(f"runs.csv's newest figure {newest['figure']!r}, the table {figure_text(row['measured'])!r}")
    if newest["verdict"] != word and not (word == "not counted" and cause):
        out.append(f"runs.csv's newest verdict {newest['verdict']!r}, the table {word!r}")
    if newest["target"] != row["target"]:
        out.append(f"runs.csv's newest target {newest['target']!r}, the table {row['target']!r}: a changed "
                   "target is judged again (python -m experiments.claims --rejudge ID)")
    if not newest["run"].startswith(row["run"]):
        out.append(f"runs.csv's newest row judged the run of {newest['run']}, the table {row['run']}")
    other = [r for r in mine[:-1] if r["verdict"] in VERDICTS and r["verdict"] != word]
    want = (other[-1]["verdict"], other[-1]["date"][:10]) if other else None
    if flipped != want:
        out.append(f"the verdict should say (flipped: {want[0]} on {want[1]})" if want
                   else "no earlier run had another verdict: drop (flipped: ...)")
    return out


def chain_problems(runs: list[dict[str, str]]) -> list[str]:
    """Each row's prev_sha256 is the hash of the row before it (GENESIS for the first): a row rewritten or
    deleted breaks the chain at the row after it."""
    out, prev = [], GENESIS
    for line, row in enumerate(runs, start=2):
        if row["prev_sha256"] != prev:
            out.append(f"runs.csv line {line}: prev_sha256 is not the hash of the row before it (a row above was "
                       "rewritten or deleted)")
        prev = row_hash(row)
    return out


def folder_problems(folder: Path) -> list[str]:
    """runs.csv is there, whole and chained; results.md names its commit, lists every row with the hash of
    the last and states no verdict outside its Runs section (the table's verdicts are the README's and
    runs.csv's)."""
    if not (folder / "runs.csv").exists():
        return [f"{folder.name}: no runs.csv"]
    with (folder / "runs.csv").open(newline="") as f:
        header = next(csv.reader(f), [])
    if tuple(header) != RUNS_COLUMNS:
        return [f"{folder.name}/runs.csv columns {header}, want {list(RUNS_COLUMNS)}"]
    runs = read_runs(folder)
    text = (folder / "results.md").read_text()
    out = [f"{folder.name}/{p}" for p in chain_problems(runs)]
    if not runs:
        out.append(f"{folder.name}/runs.csv lists no run")
    if not _MACHINE.search(text):
        out.append(f"{folder.name}/results.md names no commit on its Machine line")
    words = sorted(set(_VERDICT_WORDS.findall(without_runs(text))))
    if words:
        out.append(f"{folder.name}/results.md states verdicts {words} outside its Runs section")
    if runs_section(runs) not in text:
        out.append(f"{folder.name}/results.md's Runs section does not list runs.csv as it is, with its last "
                   "row's hash")
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


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.claims [--rejudge ID ...]``: list every problem the claims test finds, or
    judge claims again on their folders' CSVs (after a rule, check or target changed) and append the rows."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--rejudge", nargs="+", metavar="ID", default=[])
    args = parser.parse_args(argv)
    if args.rejudge:
        from experiments.harness import git_commit

        for row in rejudge(args.rejudge, git_commit(), time.strftime("%Y-%m-%d %H:%M")):
            print(f"{row['claim']}: {row['figure']} {row['verdict']} (run of {row['run']}, {row['reps']} reps)")
        print("now set each row's measured and verdict cells in experiments/README.md to match")
        return 0
    problems = all_problems()
    print("\n".join(problems) or "no problems")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
