"""Keeping the accuracy benchmark's records, and reading them back: scores by weights, a stopped run's rows."""

import json
import os

import pytest

from specmerge_bench.accuracy import bench, compare, keep, rows
from specmerge_bench.accuracy.rows import Row
from specmerge_bench.accuracy.scores import ScoreCache, import_scores

TASKS = ["a", "b"]
KEY = "0123456789abcdef"
CODE = "abcdef012345"


def fake_rows():
    """Two main rows (one of two candidates, one of one) and no step sweep."""
    two = (bench.Candidate("x", "swudi", {"t": 1.0}), bench.Candidate("x", "swudi", {"t": 2.0}))
    return [Row("x", "X", two), Row("y", "Y", (bench.Candidate("y", "tsv_m", {}),))]


def fake_cache(root, seed=0, *, finished=True, lora=False):
    """A cache record of one seed: base and expert scores, row x's val grid and chosen test, row y's val only
    unless ``finished``. Val prefers x's t=2 candidate at s=0.5; test would prefer t=1 (never read)."""
    folder = root / ("lora-experts" if lora else "experts") / KEY / f"seed{seed}"
    for i, task in enumerate(TASKS):
        (folder / task).mkdir(parents=True)
        (folder / task / "scores.json").write_text(json.dumps({"val": {task: 0.9 + i / 100}, "test": {task: 0.8}}))
    cache = ScoreCache(root / "scores" / KEY / f"seed{seed}-{CODE}-float32-AVX2.json")
    cache.put("base|val", dict.fromkeys(TASKS, 0.5))
    cache.put("base|test", dict.fromkeys(TASKS, 0.4))
    (x1, x2), (y,) = fake_rows()[0].candidates, fake_rows()[1].candidates
    for s in bench.SCALES:
        cache.put(f"{x1.key}|{s}|val", dict.fromkeys(TASKS, 0.6))
        cache.put(f"{x2.key}|{s}|val", dict.fromkeys(TASKS, 0.7 if s == 0.5 else 0.6))
        cache.put(f"{x1.key}|{s}|test", dict.fromkeys(TASKS, 0.99))  # a trap: the best test is not chosen
        cache.put(f"{y.key}|{s}|val", dict.fromkeys(TASKS, 0.65))
    cache.put(f"{x2.key}|0.5|test", {"a": 0.7 + seed / 100, "b": 0.7})
    if finished:
        cache.put(f"{y.key}|0.1|test", dict.fromkeys(TASKS, 0.66))
    return cache.path


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(rows, "method_rows", fake_rows)
    monkeypatch.setattr(rows, "step_rows", lambda: [])


def test_keep_copies_the_small_records_only_and_never_through_links(tmp_path, monkeypatch):
    cache, out = tmp_path / "cache", tmp_path / "kept"
    (cache / "scores" / KEY).mkdir(parents=True)
    (cache / "scores" / KEY / "seed0-by.json").write_text("{}")
    (cache / "results" / "r").mkdir(parents=True)
    (cache / "results" / "r" / "results.md").write_text("| table |")
    (cache / "lora-experts").mkdir()
    (cache / "lora-experts" / "README.md").write_text("a model card")
    (cache / "merges").mkdir()
    (cache / "merges" / "m.safetensors").write_bytes(b"\0" * 16)
    (cache / "big.json").write_text("[" + "0," * 100 + "0]")
    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "x"}')
    os.symlink(secret, cache / "link.json")
    os.symlink(tmp_path, cache / "linked-folder")
    monkeypatch.setattr(keep, "KEPT_MAX_BYTES", 100)
    kept, large = keep.keep(cache, out)
    names = sorted(p.relative_to(out).as_posix() for p in kept)
    assert names == ["results/r/results.md", f"scores/{KEY}/seed0-by.json"]
    assert large == [cache.resolve() / "big.json"]
    assert (out / "results" / "r" / "results.md").read_text() == "| table |"
    assert not (out / "link.json").exists() and not (out / "linked-folder").exists()
    with pytest.raises(keep.KeepError, match="inside the cache"):
        keep.keep(cache, cache / "kept")
    with pytest.raises(keep.KeepError, match="not a folder"):
        keep.keep(tmp_path / "missing", out)


def test_only_scores_by_weights_are_imported_and_the_cache_s_own_win(tmp_path):
    kept, cache = tmp_path / "kept", tmp_path / "cache"
    (kept / "scores" / KEY).mkdir(parents=True)
    (kept / "scores" / KEY / "seed0-float32-AVX2-by-weights.json").write_text(
        json.dumps({"d1|val": {"a": 0.1}, "d2|val": {"a": 0.2}})
    )
    (kept / "scores" / KEY / f"seed0-{CODE}-float32-AVX2.json").write_text(json.dumps({"base|val": {"a": 0.3}}))
    mine = cache / "scores" / KEY / "seed0-float32-AVX2-by-weights.json"
    mine.parent.mkdir(parents=True)
    mine.write_text(json.dumps({"d1|val": {"a": 0.9}}))
    assert import_scores(kept, cache) == 1
    assert json.loads(mine.read_text()) == {"d1|val": {"a": 0.9}, "d2|val": {"a": 0.2}}
    assert not (cache / "scores" / KEY / f"seed0-{CODE}-float32-AVX2.json").exists()  # never by setting
    assert import_scores(kept, cache) == 0
    with pytest.raises(ValueError, match="no scores/ folder"):
        import_scores(tmp_path / "nothing", cache)


def test_a_stopped_run_gives_its_finished_rows_chosen_on_val(tmp_path, small):
    path = fake_cache(tmp_path, finished=False, lora=True)
    seed = keep.seed_from_scores(path)
    assert seed["seed"] == 0 and seed["track"] == "lora" and seed["tasks"] == TASKS
    assert list(seed["rows"]) == ["x"]  # row y's chosen test is not scored yet
    row = seed["rows"]["x"]
    assert (row["choice"], row["scale"], row["test"]) == ("swudi(t=2.0)", 0.5, {"a": 0.7, "b": 0.7})
    assert seed["experts"] == {"a": {"val": 0.9, "test": 0.8}, "b": {"val": 0.91, "test": 0.8}}
    with pytest.raises(keep.KeepError, match="not a score file"):
        keep.seed_from_scores(tmp_path / "scores" / KEY / "seed0-float32-AVX2-by-weights.json")


def test_a_setting_pools_seeds_of_several_runs_on_their_common_rows(tmp_path, small):
    finished = fake_cache(tmp_path / "one", 0)
    stopped = fake_cache(tmp_path / "two", 1, finished=False)
    alone = compare.load_setting([finished])
    assert set(alone["summary"]["rows"]) == {"x", "y"} and alone["summary"]["seeds"] == 1
    both = compare.load_setting([finished, stopped])
    assert both["summary"]["seeds"] == 2 and set(both["summary"]["rows"]) == {"x"}
    assert both["summary"]["rows"]["x"]["average"]["mean"] == pytest.approx(0.7025)
    with pytest.raises(compare.ResultsError, match="seed 0 is given twice"):
        compare.load_setting([finished, finished])
    lora = fake_cache(tmp_path / "three", 2, lora=True)
    with pytest.raises(compare.ResultsError, match="full and LoRA"):
        compare.load_setting([finished, lora])
    assert "| X |" in compare.markdown({"pooled": both})


def test_a_rerun_s_cached_flags_and_times_do_not_overwrite_the_kept_provenance(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "kept"
    summary = cache / "experts" / KEY / "summary-seeds-0.json"
    summary.parent.mkdir(parents=True)
    trained = {"experts": {"0": {"a": {"seconds": {"train": 12.5}, "val": {"a": 0.9}, "cached": False}}}}
    summary.write_text(json.dumps(trained))
    keep.keep(cache, out)
    read_back = json.loads(json.dumps(trained).replace("false", "true"))
    summary.write_text(json.dumps(read_back))  # a rerun read the expert back from the cache
    keep.keep(cache, out)
    assert json.loads((out / "experts" / KEY / "summary-seeds-0.json").read_text()) == trained
    retrained = {"experts": {"0": {"a": {"seconds": {"train": 13.0}, "val": {"a": 0.9}, "cached": False}}}}
    summary.write_text(json.dumps(retrained))  # retrained elsewhere to the same scores: the kept times stay
    keep.keep(cache, out)
    assert json.loads((out / "experts" / KEY / "summary-seeds-0.json").read_text()) == trained
    reordered = {"experts": {"0": {"a": {"val": {"a": 0.9}, "cached": True, "seconds": {"train": 1.0}}}}}
    summary.write_text(json.dumps(reordered))  # a rerun writes the same scores in another key order
    keep.keep(cache, out)
    assert (out / "experts" / KEY / "summary-seeds-0.json").read_text() == json.dumps(trained)
    changed = {"experts": {"0": {"a": {"seconds": {"train": 13.0}, "val": {"a": 0.8}, "cached": False}}}}
    summary.write_text(json.dumps(changed))  # anything else that changed is copied, times and all
    keep.keep(cache, out)
    assert json.loads((out / "experts" / KEY / "summary-seeds-0.json").read_text()) == changed


def test_code_keys_name_the_code_the_process_runs_though_a_source_file_changes(tmp_path, monkeypatch):
    """A merge code key is read from the files once per process: an edit of a source file while a run goes on
    (the checkout is being worked on) leaves the running process's key alone; a new process sees the edit."""
    import shutil

    import specmerge
    from specmerge_bench.accuracy import scores

    core = tmp_path / "specmerge"
    shutil.copytree(os.path.dirname(specmerge.__file__), core, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(specmerge, "__file__", str(core / "__init__.py"))
    scores.code_key.cache_clear()  # and again at the end, so that no other test sees this copy's key
    try:
        first = scores.code_key()
        with open(core / "linalg" / "solve.py", "a", encoding="utf-8") as f:
            f.write("# an edit while the run goes on\n")
        assert scores.code_key() == first
        scores.code_key.cache_clear()  # what a new process does
        assert scores.code_key() != first
    finally:
        scores.code_key.cache_clear()
