"""experiments/README.md's claims table against the results it quotes.

Every row names a results folder, the command that wrote it and a ``check``: how its measured figure
follows from a CSV in that folder. The check reads

    FILE [where KEY=VALUE ...] [per KEY,KEY ...]: EXPRESSION

``where`` keeps the CSV rows matching every filter (``=``, ``!=``, ``>=``, ``<=``; numbers compare as
numbers). ``per`` splits the kept rows into groups and evaluates EXPRESSION once per group; without it
EXPRESSION is evaluated once and may give one number or a list. The row's "measured" cell is the median
of those numbers, and its "(min-max)" their smallest and largest. EXPRESSION is Python over these names,
each taking a column and optional ``column=value`` filters on the current rows:

- ``col(c, ...)``: the column's values; ``v(c, ...)``: its one value (exactly one row must match);
  ``med``, ``lo``, ``hi``: their median, minimum, maximum; ``text(c, ...)``: the values as strings;
- ``paired(c, key, a, b, by="rep", ...)``: ``c`` where ``key == a`` over ``c`` where ``key == b``, one
  ratio per value of ``by`` (a repetition's runs made side by side);
- ``figure(median, low, high)``: the three figures given apart, where the table's range is not the
  spread of its medians (e.g. the fastest and slowest single run beside the median of per-case medians);
- ``load(file)``: another CSV of the folder, with the same names as methods;
- ``median``, ``mean``, ``min``, ``max``, ``abs``, ``len``, ``set``, ``sum``, ``sorted``.

A figure matches when it equals the check's to the digits the table prints.
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "experiments" / "README.md"
RESULTS = ROOT / "experiments" / "results"
COLUMNS = ("claim", "target", "measured", "verdict", "folder", "run", "command", "check")


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
                    "len": len, "set": set, "sum": sum, "sorted": sorted, "figure": Figure}
        return {**own, **builtins}


class Figure(tuple):
    """A median with its own low and high, for a check whose range is not its medians' spread."""

    def __new__(cls, median: float, low: float, high: float):
        return super().__new__(cls, (median, low, high))


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


def evaluate(check: str, folder: Path) -> tuple[float, float, float]:
    """A check's median, min and max: over its groups with ``per``, else over the expression's value(s)."""
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
    table = read_csv(folder / filename)
    for key, op, want in filters:
        assert table.rows and key in table.rows[0], f"{filename} has no column {key}"
        table = Table([r for r in table.rows if _keep(r, key, op, want)], folder)
    assert table.rows, f"{check!r} keeps no rows"
    if per:
        groups: dict[tuple, list[dict[str, str]]] = {}
        for r in table.rows:
            groups.setdefault(tuple(r[k] for k in per), []).append(r)
        parts = [Table(rows, folder) for rows in groups.values()]
    else:
        parts = [table]
    out: list[float] = []
    for part in parts:
        value = eval(expression, {"__builtins__": {}, **part.names()})  # noqa: S307 - the README's own checks
        if isinstance(value, Figure):
            assert len(parts) == 1, "figure() gives the whole row's figures: no 'per'"
            return value
        out.extend(float(x) for x in (value if isinstance(value, list | tuple) else [value]))
    assert out and not any(math.isnan(x) for x in out), f"{check!r} gives {out}"
    return statistics.median(out), min(out), max(out)


_NUM, _UNIT = r"([-+]?\d+(?:\.\d+)?)", r"(?:x|%| s| ms)?"
_MEASURED = re.compile(rf"^{_NUM}{_UNIT}(?: \({_NUM}{_UNIT}(?:-| to ){_NUM}{_UNIT}\))?(.*)$")


def shown(cell: str) -> tuple[str, str | None, str | None]:
    """A "measured" cell's median and, where shown, its min and max, as printed: ``1.02x (0.96-1.17x)``,
    ``-2% (-17 to +12%)`` or ``1.30x``, a unit of x, %, s or ms, then any words after a space, : or ;."""
    match = _MEASURED.match(cell)
    assert match, f"a measured cell starts with its median: {cell!r}"
    rest = match.group(4)
    assert rest == "" or (rest[0] in " :;" and not rest.startswith(" (")), f"cannot read {cell!r}"
    return match.group(1), match.group(2), match.group(3)


def agrees(printed: str, value: float) -> bool:
    """``value`` rounds to ``printed`` (half a unit of its last digit, and a hair for float error)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9 * max(1.0, abs(value))


def claims() -> list[dict[str, str]]:
    """The rows of the README's claims table, by column name."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| claim |"))
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


def _code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected one `code` span, got {cell!r}"
    return match.group(1)


ROWS = claims()


def test_the_table_has_rows_and_every_verdict_is_met_or_missed():
    assert len(ROWS) >= 10
    for row in ROWS:
        assert row["verdict"] in ("met", "MISSED") or row["verdict"].startswith("MISSED:"), row["claim"]


@pytest.mark.parametrize("row", ROWS, ids=[r["claim"][:60] for r in ROWS])
def test_row_names_a_folder_and_a_command_that_wrote_it(row):
    folder = RESULTS / _code(row["folder"])
    assert folder.is_dir(), f"no folder {folder}"
    command = _code(row["command"])
    match = re.match(r"python -m experiments\.(\w+)", command)
    assert match, f"not an experiment command: {command}"
    assert (ROOT / "experiments" / f"{match.group(1)}.py").is_file(), f"no module for {command}"
    text = (folder / "results.md").read_text()
    assert f"`{command}`" in text, f"{folder.name}/results.md does not give the command {command}"
    date = re.search(r"^Machine: .*date (\d{4}-\d{2}-\d{2})", text, re.M)
    assert date and date.group(1) == row["run"], f"{folder.name} ran on {date and date.group(1)}, row says {row['run']}"


@pytest.mark.parametrize("row", ROWS, ids=[r["claim"][:60] for r in ROWS])
def test_row_figures_match_the_csv(row):
    median, smallest, largest = evaluate(_code(row["check"]), RESULTS / _code(row["folder"]))
    middle, low, high = shown(row["measured"])
    assert agrees(middle, median), f"median {median:.6g}, table {middle}"
    if low is not None:
        assert agrees(low, smallest), f"min {smallest:.6g}, table {low}"
        assert agrees(high, largest), f"max {largest:.6g}, table {high}"


def test_a_wrong_figure_fails(tmp_path):
    """The check is not vacuous: a figure off in its last digit, or a wrong range, is caught."""
    (tmp_path / "r.csv").write_text("method,rep,t\na,0,2.0\nb,0,1.0\na,1,3.0\nb,1,1.0\n")
    assert evaluate('r.csv: paired("t", "method", "a", "b")', tmp_path) == (2.5, 2.0, 3.0)
    middle, low, high = shown("2.5x (2.0-3.0)")
    assert agrees(middle, 2.5) and agrees(low, 2.0) and agrees(high, 3.0)
    assert not agrees(shown("2.6x (2.0-3.0)")[0], 2.5)
    assert not agrees(shown("2.5x (2.1-3.0)")[1], 2.0)
    assert not agrees("2.50", 2.506) and agrees("2.5", 2.506)
    assert evaluate("r.csv where method=a per rep: v('t')", tmp_path) == (2.5, 2.0, 3.0)
    assert evaluate("r.csv where t>=2: figure(med('t'), lo('t'), 9)", tmp_path) == (2.5, 2.0, 9)
    assert shown("-17% (-29 to +6%)") == ("-17", "-29", "+6")
    with pytest.raises(AssertionError):
        evaluate("r.csv where method=c: med('t')", tmp_path)
