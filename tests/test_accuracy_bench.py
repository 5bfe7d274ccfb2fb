"""The whole accuracy benchmark, end to end, on a tiny BERT and two keyword tasks (no apt, no MiniLM)."""

import json

from specmerge_bench.accuracy import bench, rows
from specmerge_bench.accuracy import model as accuracy_model
from test_accuracy_model import tiny_model_dir, world  # noqa: F401  (fixtures)


def test_benchmark_end_to_end_and_rescoring_from_the_cache(world, tiny_model_dir, monkeypatch):  # noqa: F811
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0, 1300.0)},
                                    "exponential": {"t": (300.0, 1300.0)}})  # fmt: skip
    monkeypatch.setattr(bench, "method_rows", lambda: small)
    monkeypatch.setattr(rows, "WUDI_STEPS", (2, 300))
    monkeypatch.setattr(bench, "SCALES", (0.3, 1.0))
    run = {"model_dir": tiny_model_dir, "manifest": world["manifest"], "steps": 5, "progress": False}
    summary, folder = bench.run_benchmark(world["cache"], (0, 1), log=lambda line: None, **run)
    assert {p.name for p in folder.iterdir()} >= {"results.json", "results.md", "accuracy.png", "wudi_steps.png"}
    assert summary["seeds"] == 2 and set(summary["tasks"]) == {"colour", "shape"}
    table = (folder / "results.md").read_text()
    for row in bench.method_rows():
        assert f"| {row.title} |" in table
        figures = summary["rows"][row.label]
        assert 0 <= figures["average"]["mean"] <= 1 and len(figures["choices"]) == 2
    per_seed = json.loads((folder / "results.json").read_text())["per_seed"]
    chosen = per_seed[0]["rows"]["swudi"]["choice"]
    assert "rank_ratio=0.5" in chosen and ("t=300.0" in chosen or "t=1300.0" in chosen)

    calls, merged = [], []
    evaluate, merge = accuracy_model.evaluate, bench.merge_candidates
    monkeypatch.setattr(accuracy_model, "evaluate", lambda *a, **k: calls.append(1) or evaluate(*a, **k))

    def recording_merge(base, experts, candidates, **kwargs):
        merged.append(([c.method for c in candidates], list(kwargs["wudi_steps"])))
        return merge(base, experts, candidates, **kwargs)

    monkeypatch.setattr(bench, "merge_candidates", recording_merge)
    again, _ = bench.run_benchmark(world["cache"], (0, 1), log=lambda line: None, **run)
    assert calls == [] and again["rows"]["tsv_m"]["average"] == summary["rows"]["tsv_m"]["average"]
    assert merged == [([], []), ([], [])]  # nothing is merged again when every score is cached

    # a lost val score: only that candidate is merged and scored again, with the same result
    score_file = next((world["cache"] / "scores").glob("*/seed0-*.json"))
    scores = json.loads(score_file.read_text())
    lost = [k for k in scores if k.startswith("tsv_m-") and k.endswith("|0.3|val")]
    assert len(lost) == 1
    del scores[lost[0]]
    score_file.write_text(json.dumps(scores))
    merged.clear()
    third, _ = bench.run_benchmark(world["cache"], (0, 1), log=lambda line: None, **run)
    assert merged == [(["tsv_m"], []), ([], [])] and len(calls) == 1
    assert third["rows"]["tsv_m"]["average"] == summary["rows"]["tsv_m"]["average"]


def test_equal_validation_scores_tie_exactly_whatever_the_task_order(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "SCALES", (1.0,))
    first, second = bench.Candidate("x", "swudi", {"t": 1.0}), bench.Candidate("x", "swudi", {"t": 2.0})
    cache = bench.ScoreCache(tmp_path / "scores.json")
    # the same accuracies, listed in two orders (a fresh score vs one read back from the sorted JSON);
    # summed left to right they differ in the last bit: 1.0 vs 0.9999999999999999
    cache.put(f"{first.key}|1.0|val", {"a": 0.1, "b": 0.2, "c": 0.7})
    cache.put(f"{second.key}|1.0|val", {"c": 0.7, "b": 0.2, "a": 0.1})
    for order in ([first, second], [second, first]):
        _, best, _ = bench.best_on_val(bench.Row("x", "x", tuple(order)), cache)
        assert best == order[0]  # an exact tie: the first setting of the grid wins
