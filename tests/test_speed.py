"""`specmerge bench speed` on tiny shapes: every figure present, iterative extrapolation as documented."""

import json

import pytest

from specmerge.cli import main as cli_main
from specmerge_bench import speed


def test_speed_benchmark_tiny_set_with_memory(tmp_path, capsys):
    out = tmp_path / "speed.json"
    code = cli_main(
        ["bench", "speed", "--sets", "tiny", "--repeats", "1", "--short-steps", "2", "4", "--json", str(out)]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| **whole set** |" in table and "speed-up, whole set" in table
    result = json.loads(out.read_text())["results"][0]
    assert [r["layer"] for r in result["rows"]] == ["wide", "tall"]
    for row in result["rows"]:
        assert set(row["seconds"]) == set(speed.METHODS)
        assert all(s > 0 for s in row["seconds"].values())
        notes = row["notes"]["wudi_reference"]
        t_a, t_b = notes["seconds_at"]
        assert notes["extrapolated_from"] == [2, 4]
        assert row["seconds"]["wudi_reference"] == pytest.approx(t_a + 298 * max(t_b - t_a, 0) / 2)
        assert row["notes"]["swudi_a_psqrt"]["kept_rank"] >= 1
    wide, tall = result["rows"]
    for label in speed.METHODS:
        assert result["total_seconds"][label] == pytest.approx(2 * wide["seconds"][label] + tall["seconds"][label])


def test_synthetic_stack_is_low_rank_plus_noise():
    stack = speed.synthetic_stack(2, 64, 80, rank=4, noise=0.2)
    assert stack.shape == (2, 64, 80) and float(stack.std()) == pytest.approx(1e-3, rel=1e-3)
    s = __import__("torch").linalg.svdvals(stack[0])
    # 4 signal directions, then a noise tail carrying ~0.2^2 / (1 + 0.2^2) of the energy
    tail = float(s[4:].pow(2).sum() / s.pow(2).sum())
    assert float(s[3] / s[4]) > 3 and tail == pytest.approx(0.04 / 1.04, rel=0.25)


def test_peak_memory_is_measured_in_a_fresh_process():
    tiny = speed.SHAPE_SETS["tiny"]
    wide = tiny.layers[0]
    reference = speed.peak_bytes(tiny, wide, speed.METHODS["wudi_reference"], "cpu", steps=2)
    assert reference >= 0
    # a method that must hold a 4000 x 4000 float32 temporary (64 MB) is seen at least that large
    stack = speed.synthetic_stack(2, 4000, 4000)
    assert speed.peak_bytes_here(speed.METHODS["task_arithmetic"], stack, None) >= 0.9 * 4000 * 4000 * 4
