"""bench/accuracy_settings.py and specmerge_bench.accuracy.compare: settings side by side from results files."""

import json
import runpy
import sys
from pathlib import Path

import pytest

from specmerge_bench.accuracy import compare, report

TASKS = ["a", "b"]
LABELS = ["tsv_m", "iso_c", "closed_form", "wudi", "optmerge", "swudi", "swudi_a_psqrt", "wudi_100", "wudi_5000"]


def seed(offset: float, drop: tuple[str, ...] = ()) -> dict:
    """One seed's results: row i scores 0.5 + 0.01 i + offset on task a and 0.6 + 0.01 i + offset on task b."""
    rows = {label: {"title": label.upper(), "choice": label, "scale": 1.0,
                    "test": {"a": 0.5 + 0.01 * i + offset, "b": 0.6 + 0.01 * i + offset}}
            for i, label in enumerate(LABELS) if label not in drop}  # fmt: skip
    return {"tasks": TASKS, "base": {"test": {"a": 0.4, "b": 0.5}},
            "experts": {t: {"test": {"a": 0.9, "b": 0.95}[t]} for t in TASKS}, "rows": rows}  # fmt: skip


def write(folder: Path, per_seed: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"summary": report.summarize(per_seed), "per_seed": per_seed}))
    return folder


def test_paired_differences_table_and_plots(tmp_path):
    full = compare.load_results(write(tmp_path / "full", [seed(0.0), seed(0.02)]))
    lora = compare.load_results(write(tmp_path / "lora", [seed(0.0, drop=("optmerge",))]))
    # swudi_a_psqrt is row 6, closed_form row 2: 0.04 higher in every seed, so the paired std is 0 while each row's
    # own seed std is that of (x, x + 0.02)
    diff = compare.paired(full, "swudi_a_psqrt", "closed_form")
    assert diff["mean"] == pytest.approx(0.04, abs=1e-12) and diff["std"] == pytest.approx(0.0, abs=1e-12)
    assert compare.paired(lora, "swudi", "optmerge") is None
    # wudi_5000 (row 8) averages 0.63 + offset: 0.64 over the two seeds, above wudi_100 (row 7)
    assert compare.sweep_peak(full) == (5000, pytest.approx(0.64), 5000, pytest.approx(0.64))
    text = compare.markdown({"full": full, "LoRA": lora})
    assert "| method | full (2 seeds) | LoRA (1 seed) |" in text
    assert "| OPTMERGE | 60.0 ± 1.4 | – |" in text  # row 4 averages 0.59 + offset; offsets 0 and 0.02: std 0.014
    # one seed: the mean alone, no std (a std over one seed says nothing)
    assert "| SWUDI_A_PSQRT − CLOSED_FORM | +4.00 ± 0.00 (1.4/1.4) | +4.00 |" in text
    assert "| TSV_M | 56.0 ± 1.4 | 55.0 |" in text  # row 0: 0.55 + offset
    assert "| SWUDI − OPTMERGE | +1.00 ± 0.00 (1.4/1.4) | – |" in text
    assert "| best step count (its avg acc) | 5000 (64.0) | 5000 (63.0) |" in text
    assert "| longest run scored (its avg acc) | 5000 (64.0) | 5000 (63.0) |" in text
    names = [p.name for p in compare.plots({"full": full, "LoRA": lora}, tmp_path / "img")]
    assert names == ["accuracy-settings.png", "wudi-steps-settings.png"]
    assert all((tmp_path / "img" / name).stat().st_size > 0 for name in names)


def test_plots_take_every_settings_rows_and_a_setting_with_none_yet(tmp_path, monkeypatch):
    """A stopped run's first seed may have only the base and the experts; the panels still list every row."""
    stopped = compare.load_results(write(tmp_path / "stopped", [seed(0.0, drop=tuple(LABELS))]))
    full = compare.load_results(write(tmp_path / "full", [seed(0.0)]))
    assert stopped["summary"]["rows"] == {}
    titles = []
    import matplotlib.axes

    barh = matplotlib.axes.Axes.barh
    monkeypatch.setattr(
        matplotlib.axes.Axes, "barh", lambda ax, y, *a, **k: titles.append(list(y)) or barh(ax, y, *a, **k)
    )
    compare.plots({"stopped": stopped, "full": full}, tmp_path / "img")
    expected = [label.upper() for label in LABELS if not label.startswith("wudi_")]
    assert titles == [expected, expected]


def test_the_command_refuses_bad_settings_in_one_line(tmp_path, capsys):
    good = write(tmp_path / "good", [seed(0.0)])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text('{"summary": {}}')
    script = Path(__file__).resolve().parents[1] / "bench" / "accuracy_settings.py"
    for args, message in [
        (["--setting", "no-equals"], "expected NAME=PATH[,PATH...]"),
        (["--setting", f"x={good}", "--setting", f"x={good}"], "'x' is given twice"),
        (["--setting", f"x={tmp_path / 'none'}"], "none does not exist"),
        (["--setting", f"x={good},{good / 'results.json'}"], "is not a score file"),
        (["--setting", f"x={tmp_path / 'bad'}"], "is not a results file of specmerge-bench accuracy"),
    ]:
        argv, sys.argv = sys.argv, [str(script), *args]
        try:
            with pytest.raises(SystemExit) as exit_:
                runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = argv
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1, (args, err)


def test_the_smaller_settings_tasks_merged_alone_and_within_the_larger(tmp_path):
    """Seeds 0 and 1 of both settings; within three tasks every row loses 0.01 + 0.01 k on a and b in seed k."""
    small = [{**seed(0.01 * k), "seed": k} for k in (0, 1)]
    large = []
    for k in (0, 1):
        one = {**seed(0.01 * k), "seed": k, "tasks": [*TASKS, "c"]}
        one["experts"] = {**one["experts"], "c": {"test": 0.8}}
        one["base"] = {"test": {**one["base"]["test"], "c": 0.6}}
        one["rows"] = {label: {**row, "test": {"a": row["test"]["a"] - 0.01 - 0.01 * k,
                                               "b": row["test"]["b"] - 0.01 - 0.01 * k, "c": 0.7}}
                       for label, row in one["rows"].items()}  # fmt: skip
        large.append(one)
    small, large = (compare.load_results(write(tmp_path / n, s)) for n, s in (("8", small), ("16", large)))
    table = compare.shared_tasks(small, large)
    assert compare.shared_tasks(large, small) is None and compare.shared_tasks(small, small) is None
    assert table["experts"]["diff"] == {"mean": 0.0, "std": 0.0}
    # row 2 (closed_form): 0.57 + offset on average over a and b alone; within, 0.015 and 0.02 lower
    assert table["closed_form"]["small"]["mean"] == pytest.approx(0.575)
    assert table["closed_form"]["diff"]["mean"] == pytest.approx(-0.015)
    assert table["closed_form"]["diff"]["std"] == pytest.approx(0.01 / 2**0.5)
    text = compare.markdown({"8": small, "16": large})
    assert (
        "On the 2 tasks of 8, merged alone and within 16 (average test accuracy over those 2 tasks, seeds 0, 1;" in text
    )
    assert "| CLOSED_FORM | 57.5 ± 0.7 | 56.0 ± 0.0 | -1.50 ± 0.71 |" in text
    assert "| Individual experts | 92.5 ± 0.0 | 92.5 ± 0.0 | +0.00 ± 0.00 |" in text
