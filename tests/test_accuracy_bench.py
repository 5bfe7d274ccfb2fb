"""The whole accuracy benchmark, end to end, on a tiny BERT and two keyword tasks (no apt, no MiniLM)."""

import json
import math
import random

import torch

from specmerge_bench.accuracy import bench, precision, rows
from specmerge_bench.accuracy import model as accuracy_model
from test_accuracy_model import tiny_model_dir, world  # noqa: F401  (fixtures)


def test_benchmark_end_to_end_and_rescoring_from_the_cache(world, tiny_model_dir, monkeypatch):  # noqa: F811
    small = rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0, 1300.0)},
                                    "exponential": {"t": (300.0, 1300.0)}})  # fmt: skip
    monkeypatch.setattr(bench, "method_rows", lambda: small)
    monkeypatch.setattr(rows, "WUDI_STEPS", (2, 300))
    monkeypatch.setattr(bench, "SCALES", (0.3, 1.0))
    run = {"model_dir": tiny_model_dir, "manifest": world["manifest"], "steps": 5, "progress": False,
           "adamerging": rows.AdaMergingSettings(steps=2)}  # fmt: skip
    lines = []
    summary, folder = bench.run_benchmark(world["cache"], (0, 1), log=lines.append, **run)
    for seed in (0, 1):  # a line per merge call and per row, with its choice and test accuracy
        said = [line for line in lines if line.startswith(f"seed {seed}: ")]
        assert sum(" candidates, WUDI snapshots " in line for line in said) == 2  # the main table, then the sweep
        for row in bench.method_rows() + rows.step_rows():
            assert any(line.startswith(f"seed {seed}: {row.title}: ") and " test " in line for line in said)
    assert {p.name for p in folder.iterdir()} >= {"results.json", "results.md", "accuracy.png", "wudi_steps.png"}
    assert f"-{precision.resolve('auto')}-{torch.backends.cpu.get_cpu_capability()}-" in folder.name
    assert json.loads((folder / "timings.json").read_text())[-1]["precision"].startswith(precision.resolve("auto"))
    assert summary["seeds"] == 2 and set(summary["tasks"]) == {"colour", "shape"}
    table = (folder / "results.md").read_text()
    for row in bench.method_rows():
        assert f"| {row.title} |" in table
        figures = summary["rows"][row.label]
        assert 0 <= figures["average"]["mean"] <= 1 and len(figures["choices"]) == 2
    labels = list(summary["rows"])
    for ada in rows.ADAMERGING_ROWS:  # each AdaMerging row right after its anchor, in both tables
        assert labels.index(ada.label) == labels.index(ada.anchor) + 1
        assert f"| {ada.title} |" in table and math.isfinite(summary["rows"][ada.label]["change"]["mean"])
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
    lines.clear()
    again, _ = bench.run_benchmark(world["cache"], (0, 1), log=lines.append, **run)
    assert not any(" candidates, WUDI snapshots " in line for line in lines)
    assert calls == [] and again["rows"]["tsv_m"]["average"] == summary["rows"]["tsv_m"]["average"]
    assert merged == []  # nothing is merged again when every score is cached

    # a lost val score: that candidate's merge is read from disk (or, its file lost too, merged again), and its
    # weights' score is found by their digest; lost from both score files, it is scored again, with the same result
    folder = next((world["cache"] / "scores").iterdir())
    (by_setting,) = folder.glob(f"seed0-{bench.code_key()}-*.json")
    (by_weights,) = folder.glob("seed0-*-by-weights.json")
    scores = json.loads(by_setting.read_text())
    lost = [k for k in scores if k.startswith("tsv_m-") and k.endswith("|0.3|val")]
    assert len(lost) == 1
    digest = scores.pop(lost[0] + "|weights")["digest"]
    del scores[lost[0]]
    by_setting.write_text(json.dumps(scores))
    merged.clear()
    third, _ = bench.run_benchmark(world["cache"], (0, 1), log=lambda line: None, **run)
    assert merged == [] and calls == []  # the merge from disk, the score by digest
    (stored,) = (world["cache"] / "merges").glob(f"*/seed0-{bench.code_key()}-*/{lost[0].split('|')[0]}.safetensors")
    stored.unlink()
    scores = json.loads(by_setting.read_text())
    scores.pop(lost[0]), scores.pop(lost[0] + "|weights")
    by_setting.write_text(json.dumps(scores))
    third, _ = bench.run_benchmark(world["cache"], (0, 1), log=lambda line: None, **run)
    assert merged == [(["tsv_m"], [])] and calls == []  # merged again: the same bits, so the score by digest
    assert third["rows"]["tsv_m"]["average"] == summary["rows"]["tsv_m"]["average"]
    assert json.loads(by_setting.read_text())[lost[0] + "|weights"]["digest"] == digest

    for file in (by_setting, by_weights):
        scores = json.loads(file.read_text())
        scores = {k: v for k, v in scores.items() if not (k.startswith(lost[0]) or k.startswith(f"{digest}|val"))}
        file.write_text(json.dumps(scores))
    merged.clear()
    fourth, _ = bench.run_benchmark(world["cache"], (0, 1), log=lambda line: None, **run)
    assert merged == [] and len(calls) == 1
    assert fourth["rows"]["tsv_m"]["average"] == summary["rows"]["tsv_m"]["average"]


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


def test_the_choice_is_the_first_best_mean_val_accuracy_of_the_grid(tmp_path, monkeypatch):
    """On a fake cache with many ties, each row's choice equals a plain argmax loop (first maximum in grid order),
    and it is made by the search that ``specmerge tune`` runs."""
    monkeypatch.setattr(bench, "SCALES", (0.1, 0.3, 1.0))
    searches = []
    search = bench.search
    monkeypatch.setattr(bench, "search", lambda *a, **k: searches.append(a[2]) or search(*a, **k))
    rng = random.Random(0)
    cache = bench.ScoreCache(tmp_path / "scores.json")
    grid = [bench.Candidate("x", "swudi", {"rank_ratio": r, "t": t}) for r in (0.5, 0.7) for t in (300.0, 800.0)]
    grid_rows = [
        bench.Row("x", "X", tuple(grid)),
        bench.Row("y", "Y", tuple(reversed(grid))),
        bench.Row("z", "Z", grid[:1]),
    ]
    for trial in range(20):
        for c in grid:
            for s in bench.SCALES:
                tasks = ["a", "b", "c"]
                rng.shuffle(tasks)  # the order a score lists its tasks in must not matter
                cache.scores[f"{c.key}|{s}|val"] = {t: rng.randrange(3) / 4 for t in tasks}
                cache.scores[f"{c.key}|{s}|test"] = {t: rng.random() for t in tasks}
        for row in grid_rows:
            settings = [(c, s) for c in row.candidates for s in bench.SCALES]
            means = [sum(sorted(cache.scores[f"{c.key}|{s}|val"].values())) / 3 for c, s in settings]
            first = max(range(len(settings)), key=lambda i: (means[i], -i))
            chosen = bench.choose(row, {}, None, None, cache)  # every score is cached: no merge, no scoring
            assert (chosen["choice"], chosen["scale"]) == (settings[first][0].describe(), settings[first][1]), trial
            assert (
                chosen["val_mean"] == means[first]
                and chosen["test"] == cache.scores[f"{settings[first][0].key}|{settings[first][1]}|test"]
            )
    assert len(searches) == 60 and {(s.name, s.maximize) for s in searches} == {("grid", True)}
