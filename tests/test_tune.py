"""``specmerge tune`` / ``specmerge.tuning.tune.tune`` (issue 17): the search, resuming, strategies, evaluations.

The evaluation of the end-to-end tests is a real computation: the perplexity of the merged tiny Llama on fixed
held-out token sequences (tests/tune_eval.py), run as a shell command the way a user's would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

import specmerge
from specmerge.errors import RecipeError
from specmerge.methods import get_method
from specmerge.tuning.evaluation import EvaluationError
from specmerge.tuning.results import ResultsLog, Scored
from specmerge.tuning.search import Strategy, search
from specmerge.tuning.space import Setting, parse_options, parse_values
from specmerge.tuning.tune import tune

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_family
from tune_eval import perplexity

HERE = Path(__file__).parent
SPACE = {"rank_ratio": [0.55, 0.85], "t": [300.0, 1800.0], "scale": [0.3, 1.0]}
SMALL = {"rank_ratio": [0.55, 0.85], "t": [300.0, 1800.0], "scale": [0.3]}  # for the tests that start processes
EVAL = f"{sys.executable} {HERE / 'tune_eval.py'} {{model}}"
BIGRAM = f"{sys.executable} {HERE / 'tune_eval.py'} --bigram {{model}}"  # no transformers: a faster real score


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("family"), "llama", 3)


def tune_file(folder: Path, family, **tune_section) -> Path:
    base, experts = family
    data = {"base": str(base), "experts": [str(e) for e in experts], "method": "swudi", "dtype": "float32",
            "tune": {"space": SMALL, "metric": "perplexity", "maximize": False, **tune_section}}  # fmt: skip
    path = folder / "tune.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "specmerge", *args], capture_output=True, text=True, env=environment)


def test_tune_finds_the_setting_an_exhaustive_loop_over_merges_finds(tmp_path, family):
    base, experts = family
    done = cli("tune", str(tune_file(tmp_path, family)), "--eval", EVAL, "-o", str(tmp_path / "t"), "--threads", "1")
    assert done.returncode == 0, done.stderr
    exhaustive = {}
    torch.set_num_threads(1)
    for setting in parse_options(get_method("swudi"), {"space": SMALL}, {}).space.settings():
        out = tmp_path / "loop" / setting.key
        specmerge.merge(base, experts, out, method="swudi", params=dict(setting.params), dtype="float32",
                        progress=False, threads=1)  # fmt: skip
        exhaustive[setting.key] = (perplexity(transformers.LlamaForCausalLM.from_pretrained(out).eval())["perplexity"],
                                   setting)  # fmt: skip
    best_key = min(exhaustive, key=lambda k: exhaustive[k][0])
    scores = [json.loads(line) for line in (tmp_path / "t/results.jsonl").read_text().splitlines()]
    assert len(scores) == 4 and all(s["score"] == pytest.approx(exhaustive[s["key"]][0], rel=1e-6) for s in scores)
    chosen = json.loads((tmp_path / "t/best.json").read_text())
    assert chosen["key"] == best_key and chosen["params"] == dict(exhaustive[best_key][1].params)
    merged, looped = (
        load_file(tmp_path / "t/best/model.safetensors"),
        load_file(tmp_path / "loop" / best_key / "model.safetensors"),
    )
    assert all(torch.equal(merged[k], looped[k]) for k in looped)  # the best model is the merge of that setting
    assert (
        yaml.safe_load((tmp_path / "t/best/recipe.yaml").read_text())["params"]["rank_ratio"]
        == chosen["params"]["rank_ratio"]
    )
    table = (tmp_path / "t/results.md").read_text().splitlines()
    assert len(table) == 2 + 4 and best_key in table[2]
    assert (tmp_path / "t/results.csv").read_text().count("\n") == 5
    assert {p.name for p in (tmp_path / "t/plots").iterdir()} == {"score_rank_ratio.png", "score_t.png"}
    assert not (tmp_path / "t/work").exists()  # every setting's model removed once scored
    merge_seconds = [s["merge_seconds"] for s in scores]
    assert len(set(merge_seconds[1:])) == 1  # the first setting alone, then the other three in one pass
    assert "best of 4 settings" in done.stdout


def test_an_interrupted_tune_skips_the_settings_already_scored(tmp_path, family):
    path, out, log = tune_file(tmp_path, family, metric="nll"), tmp_path / "t", tmp_path / "evaluated.txt"
    first = cli("tune", str(path), "--eval", BIGRAM, "-o", str(out), "-q",
                env={"TUNE_EVAL_LOG": str(log), "TUNE_EVAL_FAIL_AT": "3"})  # fmt: skip
    assert first.returncode != 0 and "exited with 3" in first.stderr and first.stderr.count("\n") == 1
    scored = [json.loads(line)["key"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(scored) == 2
    again = cli("tune", str(path), "--eval", BIGRAM, "-o", str(out), "-q", env={"TUNE_EVAL_LOG": str(log)})
    assert again.returncode == 0, again.stderr
    calls = log.read_text().split()
    assert len(calls) == 3 + 2  # 2 scored + the interrupted one, then the other 2 only
    assert not set(calls[3:]) & set(scored)
    scores = [json.loads(line)["score"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(scores) == 4 and len(set(scores)) == 4  # a score that tells the settings apart
    assert (out / "best/model.safetensors").is_file()
    assert (
        cli("tune", str(path), "--eval", BIGRAM, "-o", str(out), "-q", env={"TUNE_EVAL_LOG": str(log)}).returncode == 0
    )
    assert len(log.read_text().split()) == 5  # all scored: nothing evaluated again


def test_halving_with_a_python_evaluation_given_a_module(tmp_path, family):
    base, experts = family
    module = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base)).eval()
    calls: list[float] = []

    def evaluate(model: torch.nn.Module, budget: float) -> dict:
        calls.append(budget)
        return {"perplexity": perplexity(model)["perplexity"] * (1 + 0 * budget)}

    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "swudi"}
    result = tune(recipe, tmp_path / "t", evaluate=evaluate, module=module, space=SPACE, strategy="halving",
                  metric="perplexity", maximize=False, progress=False, log=lambda line: None)  # fmt: skip
    assert calls == pytest.approx([1 / 9] * 8 + [1 / 3] * 3 + [1.0])
    third = [e for e in result.scores if e.budget == round(1 / 3, 12)]
    assert result.best.key == min(third, key=lambda e: e.score).key  # the same model is scored at each budget


def test_non_spectral_methods_tune_without_a_cache(tmp_path, family):
    base, experts = family
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "task_arithmetic"}
    result = tune(recipe, tmp_path / "t", evaluate=lambda folder: float(len(str(folder))), progress=False,
                  space={"scale": [0.2, 0.4]}, log=lambda line: None)  # fmt: skip
    assert len(result.scores) == 2 and not (tmp_path / "t/cache").exists()


def test_search_and_its_tie_rule():
    settings = [Setting({"x": x}) for x in (1, 2, 3, 4)]
    assert search(settings, lambda s, b: [5, 7, 7, 1][s.params["x"] - 1])[0].params == {"x": 2}  # first best
    assert search(settings, lambda s, b: s.params["x"], Strategy(maximize=False))[0].params == {"x": 1}
    seen = []
    search(
        settings,
        lambda s, b: seen.append((s.params["x"], b)) or s.params["x"],
        Strategy("halving", eta=2, min_budget=0.25),
    )
    assert seen == [(1, 0.25), (2, 0.25), (3, 0.25), (4, 0.25), (3, 0.5), (4, 0.5), (4, 1.0)]


def test_spaces_default_to_the_papers_grids_and_parse_ranges():
    swudi = parse_options(get_method("swudi"), None, {})
    assert len(swudi.space.settings()) == 6 * 6 * 5
    assert list(parse_options(get_method("ties"), {}, {}).space.values) == ["scale"]
    assert parse_values("t", {"range": [300, 1800], "num": 4}) == (300.0, 800.0, 1300.0, 1800.0)
    assert parse_values("alpha", {"range": [1e-4, 1e-2], "num": 3, "log": True}) == pytest.approx((1e-4, 1e-3, 1e-2))
    assert parse_values("scale", 0.5) == (0.5,)
    layered = parse_options(get_method("ties"), {"space": {"scale": [0.5, 1.0]}}, {"density": [0.2, 0.5]})
    assert layered.space.to_dict() == {"scale": [0.5, 1.0]}  # the recipe's per-layer list stays the recipe's


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"space": {"rank_ratio": [1.5]}}, "tune.space.rank_ratio"),
        ({"space": {"rank": [0.5]}}, "parameter of method 'swudi'"),
        ({"space": {"t": {"range": [1, 2], "num": 0}}}, "num must be"),
        ({"space": {"t": []}}, "at least one value"),
        ({"strategy": "bayes"}, "tune.strategy"),
        ({"eta": 1}, "tune.eta"),
        ({"min_budget": 0}, "tune.min_budget"),
        ({"budget": 3}, "unknown key"),
    ],
)
def test_bad_tune_sections_are_one_line_errors(section, message):
    with pytest.raises(RecipeError, match=message) as err:
        parse_options(get_method("swudi"), section, {})
    assert "\n" not in str(err.value)


def test_bad_evaluations_and_folders_are_refused(tmp_path, family):
    path = tune_file(tmp_path, family)
    for k, (args, message) in enumerate(
        [
            (["--eval", "echo 1"], "must contain {model}"),
            (["--eval", BIGRAM, "--strategy", "halving"], "put {budget} in --eval"),
            (["--eval", "test -d {model} && echo not-a-number"], "last line is not a number"),
            (["--eval", 'test -d {model} && echo \'{"a": 1, "b": 2}\'', "--metric", "c"], "no number named 'c'"),
            (["--eval", "test ! -d {model}"], "exited with 1"),
        ]
    ):
        done = cli("tune", str(path), *args, "-o", str(tmp_path / f"o{k}"), "-q")
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full/notes.txt").write_text("mine")
    done = cli("tune", str(path), "--eval", BIGRAM, "-o", str(tmp_path / "full"), "-q")
    assert done.returncode == 2 and "not empty" in done.stderr
    assert (tmp_path / "full/notes.txt").read_text() == "mine"
    run = cli("run", str(path), "-o", str(tmp_path / "merged"))
    assert run.returncode == 2 and "'tune:' is a search space" in run.stderr


def test_another_recipe_in_the_same_folder_is_refused_unless_restarted(tmp_path, family):
    base, experts = family
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "task_arithmetic"}
    quiet = {"progress": False, "log": lambda line: None}
    tune(recipe, tmp_path / "t", evaluate=lambda folder: 1.0, space={"scale": [0.5]}, **quiet)
    with pytest.raises(RecipeError, match="another space"):
        tune(recipe, tmp_path / "t", evaluate=lambda folder: 1.0, space={"scale": [0.25]}, **quiet)
    again = tune(recipe, tmp_path / "t", evaluate=lambda folder: 2.0, space={"scale": [0.25]}, restart=True, **quiet)
    assert [e.params for e in again.scores] == [{"scale": 0.25}]


def test_a_results_line_cut_short_is_dropped_and_scored_again(tmp_path):
    path = tmp_path / "results.jsonl"
    log = ResultsLog(path)
    log.add(Scored("a", {"x": 1}, 1.0, 0.5))
    with path.open("a") as f:
        f.write('{"key": "b", "par')
    again = ResultsLog(path)
    assert [e.key for e in again.entries] == ["a"] and path.read_text().count("\n") == 1
    again.add(Scored("b", {"x": 2}, 1.0, 0.7))
    assert [e.key for e in ResultsLog(path).entries] == ["a", "b"]


def test_a_python_evaluation_must_give_a_number():
    from specmerge.tuning.evaluation import callable_evaluator

    with pytest.raises(EvaluationError, match="return a number"):
        callable_evaluator(lambda folder: "high")(Path("."), 1.0)
    with pytest.raises(EvaluationError, match="finite"):
        callable_evaluator(lambda folder: float("nan"))(Path("."), 1.0)
    with pytest.raises(EvaluationError, match="name the score with --metric"):
        callable_evaluator(lambda folder: {"a": 1, "b": 2})(Path("."), 1.0)
    assert callable_evaluator(lambda folder: {"acc": 0.5, "note": "x"})(Path("."), 1.0) == {"score": 0.5, "acc": 0.5}


def test_settings_merged_in_one_pass_are_the_models_of_separate_merges(tmp_path, family):
    from specmerge.pipeline.run.api import merge_recipe, run_recipe
    from specmerge.tuning.batch import NotBatchable, run_settings
    from specmerge.tuning.cache_build import cached_layers

    base, experts = family
    recipes = [merge_recipe(base, experts, method="swudi", params=p) for p in ({"t": 300.0}, {"rank_ratio": 0.85},
                                                                                {"scale": 0.5})]  # fmt: skip
    layers = cached_layers(recipes[0], tmp_path / "cache", ["sum"], progress=False, log=lambda line: None)
    reports = run_settings(recipes, [tmp_path / f"one{k}" for k in range(3)], layers=layers, threads=1)
    for k, recipe in enumerate(recipes):
        run_recipe(recipe, tmp_path / f"alone{k}", progress=False, threads=1)
        a, b = (load_file(tmp_path / f"{kind}{k}/model.safetensors") for kind in ("one", "alone"))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        assert sorted(p.name for p in (tmp_path / f"one{k}").iterdir()) == sorted(
            p.name for p in (tmp_path / f"alone{k}").iterdir()
        )
        assert reports[k]["params"] == recipe.params
    with pytest.raises(NotBatchable):
        run_settings([recipes[0], merge_recipe(base, experts, method="ties")], [tmp_path / "x", tmp_path / "y"])
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
