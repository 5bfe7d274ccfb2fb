"""`specmerge-bench speed` on tiny shapes: every figure present, iterative extrapolation as documented."""

import json

import pytest
import torch

from specmerge import all_methods
from specmerge_bench import speed
from specmerge_bench.cli import main as bench_main


def test_speed_benchmark_tiny_set(tmp_path, capsys):
    out = tmp_path / "speed.json"
    code = bench_main(["speed", "--sets", "tiny", "--repeats", "1", "--short-steps", "2", "4", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| **whole set** |" in table and "speed-up, whole set" in table
    result = json.loads(out.read_text())["results"][0]
    assert [r["layer"] for r in result["rows"]] == ["wide", "tall"]
    columns = speed.entries()
    for row in result["rows"]:
        assert set(row["seconds"]) == set(columns)
        assert all(s > 0 for s in row["seconds"].values())
        for label, entry in columns.items():
            notes = row["notes"][label]
            if not entry.iterative:
                assert "extrapolated_from" not in notes
                continue
            t_a, t_b = notes["seconds_at"]
            assert notes["extrapolated_from"] == [2, 4]
            assert row["seconds"][label] == pytest.approx(t_a + (entry.steps - 2) * max(t_b - t_a, 0) / 2)
        assert row["notes"]["swudi_a_psqrt"]["kept_rank"] >= 1
    wide, tall = result["rows"]
    for label in columns:
        assert result["total_seconds"][label] == pytest.approx(2 * wide["seconds"][label] + tall["seconds"][label])


def test_columns_come_from_the_registry():
    columns = speed.entries()
    assert next(iter(columns)) == speed.REFERENCE
    methods = all_methods()
    timed = {entry.method for entry in columns.values()}
    assert timed == {speed.REFERENCE} | {name for name, m in methods.items() if m.featured}
    for entry in columns.values():
        has_steps = any(p.name == "steps" for p in methods[entry.method].params)
        assert entry.iterative == has_steps  # extrapolated by capability, not by name
    assert columns["wudi_reference"].steps == 300
    assert dict(columns["swudi_a_gd"].params) == {"rule": "gavish_donoho"}  # one column per benchmark setting


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--short-steps", "4", "2"], "--short-steps A B needs 1 <= A < B"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--validate-extrapolation", "nope"], "set tiny has no layer 'nope'; its layers: wide, tall"),
        (["--json", "/no/such/folder/out.json"], "folder /no/such/folder does not exist"),
        (["--methods", "no_such_method"], "invalid choice: 'no_such_method'"),
    ],
)
def test_bad_options_are_one_line_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["speed", "--sets", "tiny", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specmerge-bench speed: error: ") and message in err and len(err.splitlines()) == 1


def test_synthetic_stack_is_low_rank_plus_noise():
    stack = speed.synthetic_stack(2, 64, 80, rank=4, noise=0.2)
    assert stack.shape == (2, 64, 80) and float(stack.std()) == pytest.approx(1e-3, rel=1e-3)
    s = torch.linalg.svdvals(stack[0])
    # 4 signal directions, then a noise tail carrying ~0.2^2 / (1 + 0.2^2) of the energy
    tail = float(s[4:].pow(2).sum() / s.pow(2).sum())
    assert float(s[3] / s[4]) > 3 and tail == pytest.approx(0.04 / 1.04, rel=0.25)


def test_peak_memory_is_measured_in_a_fresh_process():
    tiny = speed.SHAPE_SETS["tiny"]
    wide = tiny.layers[0]
    columns = speed.entries()
    reference = speed.peak_bytes(tiny, wide, columns["wudi_reference"], "cpu", steps=2)
    assert reference >= 0
    # a method that must hold a 4000 x 4000 float32 temporary (64 MB) is seen at least that large
    stack = speed.synthetic_stack(2, 4000, 4000)
    assert speed.peak_bytes_here(columns["task_arithmetic"], stack, None) >= 0.9 * 4000 * 4000 * 4
