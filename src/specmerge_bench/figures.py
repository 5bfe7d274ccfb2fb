"""Every accuracy figure of the documentation computed from a committed record.

A table of accuracy figures in README.md, BENCHMARKS.md or a page under docs/ carries, on the line above it, the
command that computes it from records kept in the repository::

    <!-- record: python bench/accuracy_settings.py --tables --setting "8 tasks, full=bench/results/accuracy/..." -->
    | method | avg acc | ... |

:func:`check` runs each such command (only ``python bench/<script>.py ...``, without a shell, from the repository's
root; each distinct command once) and compares the table under it with the table of the same header in the
command's output: every row of the documented table must be there under its label, and every cell equal, column by
column name (a table may show fewer rows or columns than the command prints). It reports:

- a table whose header names an accuracy column (``acc``, ``accuracy``, ``normalised``, ``gap closed``) without a
  ``record`` line above it;
- a cell that differs from the record's, or a row or column the record has not;
- outside recorded tables, a figure that neither a recorded table of the same file nor the output of a
  ``<!-- figures: python bench/... -->`` line right above its paragraph holds: every decimal number of a paragraph,
  list item or table that speaks of the benchmark's accuracy (test / val / average accuracy, gap closed, points),
  and every ``mean ± std`` figure elsewhere.

Run it as ``python bench/check_figures.py`` (the tests run it on the repository's own documents).
``--update`` rewrites each recorded table from its command's output first (after a record line gained a run, say):
the table's rows, with every column of the output's table (a "seed 2" added, a header renamed); the figures in the
text are left to the writer, and the check that follows names those no record holds.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

RECORD = re.compile(r"^\s*<!--\s*record:\s*(?P<command>.+?)\s*-->\s*$")
ACCURACY_HEADER = re.compile(r"\bacc\b|accuracy|normalised|gap closed", re.IGNORECASE)
FIGURE = re.compile(r"[+-]?\d+(?:\.\d+)?\s*±\s*\d+(?:\.\d+)?")
FENCE = re.compile(r"^\s*(```|~~~)")
FIGURES = re.compile(r"^\s*<!--\s*figures:\s*(?P<command>.+?)\s*-->\s*$")
ACCURACY_WORDS = re.compile(  # a paragraph that speaks of the accuracy benchmark's figures (not numerical accuracy)
    r"\b(?:test|val|validation|average|avg|mean|merged|experts?'?) acc(?:uracy)?\b|gap closed|normalised|\bpoints\b",
    re.IGNORECASE,
)
NUMBER = re.compile(r"(?<![\w.])[+\-\u2212]?\d+\.\d+(?!\w|\.\d)")


@dataclass
class Table:
    """A Markdown table: the line it starts on (1-based), its header cells and its rows of cells."""

    line: int
    header: list[str]
    rows: list[list[str]]
    record: str | None = None  # the command of the ``record`` line above it
    rule: list[str] | None = None  # the cells of the line under the header (``---:``: right-aligned)

    @property
    def about_accuracy(self) -> bool:
        """Whether the header names an accuracy column."""
        return any(ACCURACY_HEADER.search(cell) for cell in self.header)


class FigureError(ValueError):
    """A record command that cannot be run (one line)."""


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _is_rule(line: str) -> bool:
    return bool(re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", line.strip()))


def tables(text: str) -> list[Table]:
    """The Markdown tables of ``text`` outside fenced code blocks, each with the record command above it."""
    found: list[Table] = []
    lines = text.splitlines()
    fenced, i = False, 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            fenced = not fenced
        if fenced or not lines[i].lstrip().startswith("|") or i + 1 >= len(lines) or not _is_rule(lines[i + 1]):
            i += 1
            continue
        start, header = i, _cells(lines[i])
        i += 2
        rows = []
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            rows.append(_cells(lines[i]))
            i += 1
        above = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        match = RECORD.match(above)
        found.append(Table(start + 1, header, rows, match["command"] if match else None, _cells(lines[start + 1])))
    return found


def _table_lines(found: Iterable[Table]) -> set[int]:
    return {t.line + k for t in found for k in range(len(t.rows) + 2)}


def run_record(command: str, root: Path) -> str:
    """The output of a record command (``python bench/<script>.py ...``, run from ``root``)."""
    try:
        args = shlex.split(command)
    except ValueError as err:
        raise FigureError(f"record command {command!r} does not parse: {err}") from None
    if (len(args) < 2 or args[0] != "python" or not args[1].startswith("bench/") or not args[1].endswith(".py")
            or not (root / args[1]).is_file()):  # fmt: skip
        raise FigureError(f"record command {command!r}: only `python bench/<script>.py ...` of this repository runs")
    done = subprocess.run([sys.executable, *args[1:]], cwd=root, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise FigureError(f"record command {command!r} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def _output(command: str, root: Path, outputs: dict[str, str | None], problems: list[str], where: str) -> str | None:
    """A record command's output, run once per document set (``outputs``); None for a command that cannot run,
    which is a problem at ``where``."""
    if command not in outputs:
        try:
            outputs[command] = run_record(command, root)
        except (FigureError, subprocess.TimeoutExpired) as err:
            problems.append(f"{where}: {err}")
            outputs[command] = None
    return outputs[command]


def _compare(where: str, table: Table, output: str) -> list[str]:
    candidates = [t for t in tables(output) if t.header[1:] and set(table.header) <= set(t.header)
                  and t.header[0] == table.header[0]]  # fmt: skip
    if not candidates:
        return [f"{where}: the record's output has no table with the columns {' | '.join(table.header)}"]
    best: list[str] | None = None
    for made in candidates:  # the first of the record's tables that holds every row of this one
        columns = {name: made.header.index(name) for name in table.header}
        by_label = {row[0]: row for row in made.rows}
        mismatches = []
        for row in table.rows:
            label = row[0]
            if label not in by_label:
                mismatches.append(f"{where}: row '{label}' is not in the record")
                continue
            for name, cell in zip(table.header[1:], row[1:], strict=False):
                recorded = by_label[label][columns[name]]
                if cell != recorded:
                    mismatches.append(f"{where}: row '{label}', column '{name}': '{cell}' here, '{recorded}' in "
                                      "the record")  # fmt: skip
        if not mismatches:
            return []
        if best is None or len(mismatches) < len(best):
            best = mismatches
    return best or []


def check_text(text: str, name: str, root: Path, outputs: dict[str, str | None] | None = None) -> list[str]:
    """The problems of one document (``name`` for messages); ``outputs`` caches record commands' outputs."""
    outputs = {} if outputs is None else outputs
    problems: list[str] = []
    recorded_cells: set[str] = set()
    found = tables(text)
    for table in found:
        where = f"{name}:{table.line}"
        if table.record is None:
            if table.about_accuracy:
                problems.append(f"{where}: an accuracy table with no record: put `<!-- record: python bench/... -->` "
                                "(the command computing it from committed records) on the line above it")  # fmt: skip
            continue
        output = _output(table.record, root, outputs, problems, where)
        if output is None:
            continue
        mismatches = _compare(where, table, output)
        problems += mismatches
        if not mismatches:
            recorded_cells.update(cell for row in table.rows for cell in row)
    recorded = {_number(n) for cell in recorded_cells for n in NUMBER.findall(cell)}
    for unit in _units(text, found):
        allowed = set(recorded)
        for command in unit.figures:
            output = _output(command, root, outputs, problems, f"{name}:{unit.lines[0][0]}")
            allowed |= {_number(n) for n in NUMBER.findall(output or "")}
        about_accuracy = unit.accuracy
        if about_accuracy is None:
            about_accuracy = any(ACCURACY_WORDS.search(line) for _, line in unit.lines)
        for number, line in unit.lines:
            figures = NUMBER.findall(line) if about_accuracy else [n for f in FIGURE.findall(line)
                                                                   for n in NUMBER.findall(f)]  # fmt: skip
            for figure in figures:
                if _number(figure) not in allowed:
                    problems.append(f"{name}:{number}: the accuracy figure '{figure}' is in no record: quote it from a "
                                    "recorded table of this file or from the output of the `<!-- figures: python "
                                    "bench/... -->` line above its paragraph")  # fmt: skip
    return problems


def _best(table: Table, made: Sequence[Table]) -> Table | None:
    """The output table that ``table`` quotes: the same first column, most of its columns and row labels."""
    labels = {row[0] for row in table.rows}
    scored = [(len(set(table.header) & set(t.header)) + len(labels & {row[0] for row in t.rows}), -i, t)
              for i, t in enumerate(made) if t.header[1:] and t.header[0] == table.header[0]]  # fmt: skip
    return max(scored, key=lambda item: item[:2])[2] if scored else None


def _table_text(table: Table, made: Table) -> list[str]:
    """``table``'s lines printed afresh from ``made``: ``made``'s columns, ``table``'s rows (those ``made`` has)."""
    by_label = {row[0]: row for row in made.rows}
    rows = [by_label[row[0]] for row in table.rows if row[0] in by_label]
    rule = "|" + "|".join(made.rule or ["---"] * len(made.header)) + "|"
    return [_row(made.header), rule, *(_row(row) for row in rows)]


def _row(cells: Sequence[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def update_text(
    text: str, name: str, root: Path, outputs: dict[str, str | None] | None = None
) -> tuple[str, list[str]]:
    """``text`` with each recorded table printed afresh from its command's output, and the problems met (a command
    that does not run, a table with no counterpart in the output, a row the output no longer has)."""
    outputs = {} if outputs is None else outputs
    problems: list[str] = []
    lines = text.splitlines()
    for table in reversed(tables(text)):  # from the end, so that earlier tables keep their line numbers
        if table.record is None:
            continue
        where = f"{name}:{table.line}"
        output = _output(table.record, root, outputs, problems, where)
        made = None if output is None else _best(table, tables(output))
        if output is not None and made is None:
            problems.append(f"{where}: the record's output has no table with the first column {table.header[0]!r}")
        if made is not None:
            lines[table.line - 1 : table.line + 1 + len(table.rows)] = _table_text(table, made)
            have = {row[0] for row in made.rows}
            gone = [row[0] for row in table.rows if row[0] not in have]
            problems += [f"{where}: row '{label}' is not in the record's output: left out" for label in gone]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else ""), problems


@dataclass
class Unit:
    """A paragraph or list item of text: its numbered lines and the ``figures`` commands above its block."""

    lines: list[tuple[int, str]]
    figures: list[str]
    accuracy: bool | None = None  # a table's rows: whether its header names accuracy; text: by its words


def _units(text: str, found: Sequence[Table]) -> list[Unit]:
    """The text's paragraphs, list items and tables without a record line (``found``: the text's tables), outside
    code blocks; the ``figures`` lines right above a block (no blank line between) apply to each of its units."""
    recorded = _table_lines(t for t in found if t.record)
    table_at = {t.line: t for t in found if not t.record}
    units: list[Unit] = []
    fenced, markers, block, current, skip = False, [], None, None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if number < skip:
            current.lines.append((number, line))
            continue
        fence = FENCE.match(line)
        if fence:
            fenced = not fenced
        match = FIGURES.match(line)
        if fenced or fence or number in recorded or not line.strip() or RECORD.match(line) or match:
            block = current = None
            if match:
                markers.append(match["command"])
            elif not fenced and not line.strip():
                markers = []
            continue
        if block is None:
            block, markers = markers, []
        if number in table_at:  # an unrecorded table: one unit, about accuracy if its header says so
            table = table_at[number]
            current = Unit([(number, line)], list(block), table.about_accuracy)
            units.append(current)
            skip = number + len(table.rows) + 2
            continue
        if current is None or current.accuracy is not None or _list_item(line) or line.lstrip().startswith("#"):
            current = Unit([], list(block))
            units.append(current)
        current.lines.append((number, line))
    return units


def _list_item(line: str) -> bool:
    return bool(re.match(r"\s*(?:[-*+]|\d+\.)\s", line))


def _number(figure: str) -> str:
    return figure.lstrip("+-−")


HISTORY = "docs/benchmarks-history.md"  # measurements as they were made, dated: not current figures


def documents(root: Path) -> list[Path]:
    """The documents checked: README.md, BENCHMARKS.md and every page under docs/ but the dated history."""
    found = [root / "README.md", root / "BENCHMARKS.md"]
    found += sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    return [path for path in found if path.is_file() and path != root / HISTORY]


def check(root: Path, paths: Iterable[Path] | None = None, outputs: dict[str, str | None] | None = None) -> list[str]:
    """Every problem of the documents (default :func:`documents`), one line each; ``outputs`` caches record
    commands' outputs (shared with an update just made)."""
    outputs = {} if outputs is None else outputs
    problems: list[str] = []
    for path in documents(root) if paths is None else paths:
        name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        problems += check_text(path.read_text(encoding="utf-8"), name, root, outputs)
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    from specmerge_bench.inputs import Parser

    parser = Parser(prog="check_figures.py", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="documents (default: README.md, BENCHMARKS.md, docs/)")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: this folder)")
    parser.add_argument("--update", action="store_true", help="print each recorded table afresh from its record first")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    paths = [p.resolve() for p in args.paths] or None
    for path in paths or []:
        if not path.is_file():
            parser.error(f"{path} is not a file (give Markdown documents)")
    outputs: dict[str, str | None] = {}  # each record command runs once, for the update and the check
    if args.update:
        for path in paths or documents(root):
            text = path.read_text(encoding="utf-8")
            new, problems = update_text(text, str(path), root, outputs)
            for problem in problems:
                print(problem)
            if new != text:
                path.write_text(new, encoding="utf-8")
                print(f"updated {path}", file=sys.stderr)
    problems = check(root, paths, outputs)
    for problem in problems:
        print(problem)
    checked = len(documents(root)) if paths is None else len(paths)
    print(f"{checked} documents, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0
