"""The figures checker (issue 49, item 9): every accuracy figure of the documents is computed from a committed
record; a planted figure that is not is found."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specmerge_bench.figures import check, check_text, run_record, tables, update_text

ROOT = Path(__file__).resolve().parents[1]
RUN = "bench/results/accuracy/results/b9c95668d42a795d+8d3e2fa82c99d5fc-fc65a48fcb32-float32-AVX2-seeds-0"
RECORD = f'python bench/accuracy_settings.py --setting "16 tasks, full={RUN}"'


@pytest.fixture(scope="module")
def output() -> str:
    return run_record(RECORD, ROOT)


def documented(output: str, rows: int = 4) -> str:
    """A document quoting the first rows of the record's first table, with its record line."""
    first = tables(output)[0]
    lines = ["| " + " | ".join(first.header) + " |", "|---|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in first.rows[:rows]]
    return f"Text.\n\n<!-- record: {RECORD} -->\n" + "\n".join(lines) + "\n"


def test_a_table_quoted_from_its_record_passes(output):
    text = documented(output)
    assert check_text(text, "doc.md", ROOT, {RECORD: output}) == []
    cell = tables(output)[0].rows[2][1]  # a figure quoted in the text from the table is fine too
    assert check_text(text + f"\nTask arithmetic reaches {cell}.\n", "doc.md", ROOT, {RECORD: output}) == []


def test_a_planted_cell_is_found(output):
    first = tables(output)[0]
    label, cell = first.rows[3][0], first.rows[3][1]
    planted = documented(output).replace(f"| {label} | {cell} |", f"| {label} | 99.9 ± 0.0 |")
    assert planted != documented(output)
    problems = check_text(planted, "doc.md", ROOT, {RECORD: output})
    assert len(problems) == 1 and f"row '{label}'" in problems[0] and "'99.9 ± 0.0' here" in problems[0]


def test_a_planted_row_the_record_lacks_is_found(output):
    text = documented(output).rstrip("\n") + "\n| A method never run | 80.0 ± 0.1 |\n"
    problems = check_text(text, "doc.md", ROOT, {RECORD: output})
    assert problems == ["doc.md:4: row 'A method never run' is not in the record"]


def test_update_prints_a_table_afresh_from_its_record(output):
    first = tables(output)[0]
    label, cell, column = first.rows[3][0], first.rows[3][1], first.header[1]
    stale = documented(output).replace(f"| {label} | {cell} |", f"| {label} | 99.9 ± 0.0 |")
    stale = stale.replace(f"| {column} |", "| an older run (2 seeds) |")  # the record gained a run since
    updated, problems = update_text(stale + "\nAfter.\n", "doc.md", ROOT, {RECORD: output})
    assert problems == [] and updated == documented(output) + "\nAfter.\n"
    assert check_text(updated, "doc.md", ROOT, {RECORD: output}) == []
    fewer = documented(output).replace(f"| {label} | {cell} |\n", "")  # a table quoting some rows keeps to them
    assert update_text(fewer, "doc.md", ROOT, {RECORD: output}) == (fewer, [])
    planted = documented(output).rstrip("\n") + "\n| A method never run | 80.0 ± 0.1 |\n"
    assert update_text(planted, "doc.md", ROOT, {RECORD: output}) == (
        documented(output),
        ["doc.md:4: row 'A method never run' is not in the record's output: left out"],
    )
    other = fewer.replace("| method |", "| task |")
    assert update_text(other, "doc.md", ROOT, {RECORD: output})[1] == [
        "doc.md:4: the record's output has no table with the first column 'task'"
    ]


MESSAGE = ("is in no record: quote it from a recorded table of this file or from the output of the `<!-- figures: "
           "python bench/... -->` line above its paragraph")  # fmt: skip


def test_an_accuracy_table_without_a_record_is_found():
    text = "Intro.\n\n| method | avg acc |\n|---|---:|\n| SWUDI-A | 76.1 ± 0.1 |\n"
    problems = check_text(text, "doc.md", ROOT)
    assert problems[0].startswith("doc.md:3: an accuracy table with no record")
    assert problems[1:] == [f"doc.md:5: the accuracy figure '{n}' {MESSAGE}" for n in ("76.1", "0.1")]


@pytest.mark.parametrize("sentence", ["SWUDI-A reaches 80.3 % average accuracy.", "SWUDI-A: 80.3 ± 9.9 here."])
def test_a_planted_figure_in_the_text_is_found(output, sentence):
    text = documented(output) + f"\n{sentence}\n"
    problems = check_text(text, "doc.md", ROOT, {RECORD: output})
    assert problems[0] == f"doc.md:11: the accuracy figure '80.3' {MESSAGE}"
    assert problems[1:] == ([f"doc.md:11: the accuracy figure '9.9' {MESSAGE}"] if "±" in sentence else [])


def test_a_paragraph_quotes_figures_from_the_command_above_it(output):
    first = tables(output)[0]
    label, mean = next((r[0], r[1].split(" ± ")[0]) for r in first.rows if not re.search(r"\d", r[0]))
    assert "97.31" not in output
    text = f"<!-- figures: {RECORD} -->\n{label} reaches {mean} % test accuracy\n- and a list item {mean} points\n"
    assert check_text(text, "doc.md", ROOT, {RECORD: output}) == []
    planted = text + "- and 97.31 points\n"
    assert check_text(planted, "doc.md", ROOT, {RECORD: output}) == [f"doc.md:4: the accuracy figure '97.31' {MESSAGE}"]
    # without the figures line it is unrecorded; the line covers its block, not the next paragraph
    assert check_text(f"{label} reaches {mean} % test accuracy.\n", "doc.md", ROOT) == [
        f"doc.md:1: the accuracy figure '{mean}' {MESSAGE}"
    ]
    text = f"<!-- figures: {RECORD} -->\n{label}: {mean} test accuracy.\n\nThen {mean} test accuracy.\n"
    assert check_text(text, "doc.md", ROOT, {RECORD: output}) == [f"doc.md:4: the accuracy figure '{mean}' {MESSAGE}"]


def test_figures_in_code_blocks_are_skipped_and_other_tables_judged_by_their_header():
    text = ("```\n| method | avg acc |\n|---|---:|\n| x | 1.0 ± 0.1 |\n```\n\n"
            "| stage | s |\n|---|---:|\n| a | 2.5 ± 1.5 |\n| b | 3.25 |\n")  # fmt: skip
    assert check_text(text, "doc.md", ROOT) == [f"doc.md:9: the accuracy figure '2.5' {MESSAGE}",
                                                f"doc.md:9: the accuracy figure '1.5' {MESSAGE}"]  # fmt: skip


@pytest.mark.parametrize("command", ["ls bench", "python -c 'print(1)'", "python /tmp/x.py", "python bench/nope.py"])
def test_only_the_repositorys_bench_scripts_run_as_records(command):
    text = f"<!-- record: {command} -->\n| method | avg acc |\n|---|---:|\n| x | 1 |\n"
    (problem,) = check_text(text, "doc.md", ROOT)
    assert "only `python bench/<script>.py ...` of this repository runs" in problem


def test_a_failing_record_command_is_named():
    record = 'python bench/accuracy_settings.py --setting "x=bench/results/none"'
    text = f"<!-- record: {record} -->\n| method | acc |\n|---|---:|\n"
    (problem,) = check_text(text, "doc.md", ROOT)
    assert problem.startswith("doc.md:2: record command") and "failed" in problem and "does not exist" in problem


def test_the_repositorys_documents_quote_only_recorded_figures():
    problems = check(ROOT)
    assert problems == [], "\n".join(problems[:20])


def test_the_command_line_exits_1_on_a_problem(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("| method | avg acc |\n|---|---:|\n| x | 1.0 |\n")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "check_figures.py"), str(doc)], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 1 and "an accuracy table with no record" in done.stdout
    assert "1 documents, 2 problems" in done.stderr  # the table, its figure


def test_the_command_line_updates_a_stale_table(tmp_path, output):
    doc = tmp_path / "doc.md"
    first = tables(output)[0]
    doc.write_text(documented(output).replace(f"| {first.rows[0][1]} |", "| 1.0 ± 0.0 |"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "check_figures.py"), "--update", str(doc)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "1 documents, 0 problems" in done.stderr, done.stdout
    assert doc.read_text() == documented(output)
