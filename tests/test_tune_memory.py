"""Tuning with the candidates in memory (issue 50 item 5): each setting's merged tensors handed to the evaluation as
a state dict (or loaded into its module) instead of a folder, and only the winner written; the spectral cache kept
in memory across the grid when the budget allows it, the settings' merges planned with the rest of the budget.

The acceptance test: a tune without writing candidates finds the same winner, with the same scores, as the tune that
writes every candidate, and writes the same best model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.model import load_recipe
from specmerge.pipeline.run.api import merge_recipe, run_recipe
from specmerge.tuning import candidates
from specmerge.tuning.batch import NotBatchable, merge_in_memory
from specmerge.tuning.cache_build import cached_layers
from specmerge.tuning.tune import tune

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_family
from tune_eval import perplexity

SPACE = {"rank_ratio": [0.55, 0.85], "t": [300.0, 1800.0], "scale": [1.0]}
QUIET = {"progress": False, "log": lambda line: None}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("family"), "llama", 3)


def hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_in_memory_candidates_hold_the_tensors_the_folders_hold(tmp_path, family, caplog):
    base, experts = family
    params = ({"t": 300.0}, {"rank_ratio": 0.85}, {"scale": 0.5})
    recipes = [merge_recipe(base, experts, method="swudi", params=p) for p in params]
    layers = cached_layers(recipes[0], tmp_path / "cache", ["sum"], progress=False, log=lambda line: None)
    caplog.set_level(logging.INFO, logger="specmerge.output")
    together = merge_in_memory(recipes, layers=layers, threads=1)  # one pass, three settings
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not merged with swudi")]
    assert len(said) == 1 and "averaged (embedding" in said[0]  # the settings' one line, said once
    alone = merge_in_memory(recipes[1:2], threads=1)  # one setting, from the inputs (no cache)
    for k, recipe in enumerate(recipes):
        run_recipe(recipe, tmp_path / f"folder{k}", progress=False, threads=1)
        written = load_file(tmp_path / f"folder{k}/model.safetensors")
        assert list(together[k]) == list(written)  # the same names, in the plan's order
        assert all(
            torch.equal(together[k][n], written[n]) and together[k][n].dtype == written[n].dtype for n in written
        )
    assert all(torch.equal(alone[0][n], together[1][n]) for n in alone[0])
    with pytest.raises(NotBatchable):
        merge_in_memory([recipes[0], merge_recipe(base, experts, method="ties")])
    quantized = merge_recipe(base, experts, method="swudi", quantize="fp8-block")
    with pytest.raises(RecipeError, match="quantized"):
        merge_in_memory([quantized])


def test_tune_without_writing_candidates_finds_the_same_winner(tmp_path, family):
    base, experts = family
    module = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base)).eval()
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "swudi", "dtype": "float32"}
    seen: dict[str, list] = {"disk": [], "memory": []}

    def evaluation(kind: str, folder: Path):
        def evaluate(model: torch.nn.Module) -> dict:
            # what the tune folder holds while a candidate is scored: no model but the cache, in memory
            seen[kind].append(sorted(p.name for p in folder.iterdir()))
            return {"perplexity": perplexity(model)["perplexity"]}

        return evaluate

    results = {}
    for kind in ("disk", "memory"):
        folder = tmp_path / kind
        lines: list[str] = []
        results[kind] = tune(recipe, folder, evaluate=evaluation(kind, folder), module=module, space=SPACE,
                             metric="perplexity", maximize=False, candidates=kind, threads=1, batch=2,
                             progress=False, log=lines.append)  # fmt: skip
        assert any(
            line.startswith("candidates " + ("merged in memory" if kind == "memory" else "written")) for line in lines
        )
    disk, memory = results["disk"], results["memory"]
    assert [(e.key, e.score) for e in memory.scores] == [(e.key, e.score) for e in disk.scores]  # the same numbers
    assert len({e.score for e in disk.scores}) == 4  # a score that tells the settings apart
    assert memory.best.key == disk.best.key
    assert all("work" in names for names in seen["disk"])  # the folders were written for the disk tune ...
    assert all(set(names) <= {"cache", "tune.json", "results.jsonl"} for names in seen["memory"])  # ... not here
    written, expected = hashes(memory.best_model), hashes(disk.best_model)
    assert written.pop("report.json") and expected.pop("report.json")  # its seconds differ
    assert written == expected  # the same model files, bit for bit
    for result in (disk, memory):  # best/recipe.yaml names the inputs from best/ (not from work/<key> it came from)
        again = load_recipe(result.best_model / "recipe.yaml")
        assert Path(again.base).resolve() == base.resolve()
        assert [Path(e).resolve() for e in again.experts] == [e.resolve() for e in experts]
    assert json.loads((tmp_path / "memory/best.json").read_text())["key"] == disk.best.key
    assert not (tmp_path / "memory/work").exists()


def test_a_python_evaluation_without_a_module_gets_the_state_dict(tmp_path, family):
    base, experts = family
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "task_arithmetic"}
    got: list = []

    def evaluate(state) -> float:
        got.append(state)
        return float(state["model.layers.0.mlp.up_proj.weight"].double().norm())

    result = tune(recipe, tmp_path / "t", evaluate=evaluate, space={"scale": [0.2, 0.6]}, candidates="memory", **QUIET)
    assert all(isinstance(s, dict) for s in got) and len(got) == 2
    best = load_file(result.best_model / "model.safetensors")
    winner = got[[e.key for e in result.scores].index(result.best.key)]
    assert list(winner) == list(best) and all(torch.equal(winner[n], best[n]) for n in best)
    assert result.best.params == {"scale": 0.6}  # the larger task vector has the larger norm


def test_candidates_in_memory_are_refused_where_they_cannot_be(tmp_path, family):
    base, experts = family
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "task_arithmetic"}
    space = {"scale": [0.2, 0.6]}
    with pytest.raises(ValueError, match="needs a Python evaluation"):
        tune(recipe, tmp_path / "a", command="echo 1 {model}", space=space, candidates="memory", **QUIET)
    with pytest.raises(ValueError, match="candidates must be auto, memory or disk"):
        tune(recipe, tmp_path / "b", evaluate=lambda m: 1.0, space=space, candidates="ram", **QUIET)
    with pytest.raises(ValueError, match="quantized weights"):
        tune({**recipe, "quantize": "fp8-block"}, tmp_path / "c", evaluate=lambda m: 1.0, space=space,
             candidates="memory", **QUIET)  # fmt: skip
    assert not any((tmp_path / name / "work").exists() for name in "abc")


def test_the_cache_stays_in_memory_and_the_settings_plan_with_the_rest_of_the_budget(tmp_path, family, monkeypatch):
    base, experts = family
    recipe = merge_recipe(base, experts, method="swudi", device="cpu", gpu_memory="1GiB")
    lines: list[str] = []
    layers = cached_layers(recipe, tmp_path / "cache", ["sum"], progress=False, log=lines.append)
    stored = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert layers.resident_bytes == stored > 0 and "kept in cpu memory" in lines[-1]  # a few MB, GBs available
    first = next(iter(layers.values()))
    first.projection("sum")
    assert first.held == 1
    assert candidates.beside_cache(recipe, layers) is recipe  # on the CPU the budget is not the device's
    monkeypatch.setattr(candidates, "resolve_device", lambda name: torch.device("cuda"))
    assert candidates.beside_cache(recipe, layers).gpu_memory == 2**30 - stored  # the cache's share taken off
    layers.release()
    assert layers.resident_bytes == 0 and not first.held
    assert candidates.beside_cache(recipe, layers) is recipe


def test_the_cache_build_sends_the_layers_the_device_plan_cannot_fit_to_the_cpu(tmp_path, family, caplog):
    from contextlib import ExitStack

    from specmerge.pipeline.plan.prepare import prepare_merge
    from specmerge.pipeline.run.jobs import ComputeOptions
    from specmerge.tuning.cache_build import cpu_layers

    base, experts = family
    spectral = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    for budget, expect_all in (("1KiB", True), ("80GiB", False)):  # a budget nothing fits in, one everything does
        recipe = merge_recipe(base, experts, method="swudi", gpu_memory=budget)
        with ExitStack() as stack:
            prepared = prepare_merge(stack, recipe, None)
            caplog.clear()
            names = cpu_layers(prepared, ComputeOptions.for_recipe(recipe), None)  # planned for a GPU not here
        assert (spectral <= names) if expect_all else not names
        assert len([r for r in caplog.records if "computed on the CPU" in r.getMessage()]) == len(names)


def test_device_and_budget_given_to_tune_replace_the_recipes(tmp_path, family):
    import subprocess

    base, experts = family
    recipe = {"base": str(base), "experts": [str(e) for e in experts], "method": "task_arithmetic", "device": "auto"}
    tune(recipe, tmp_path / "t", evaluate=lambda m: 1.0, space={"scale": [0.2]}, device="cpu", gpu_memory="1GiB",
         **QUIET)  # fmt: skip
    written = json.loads((tmp_path / "t/tune.json").read_text())["recipe"]
    assert written["device"] == "cpu" and written["gpu_memory"] in ("1GiB", 2**30)
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    args = ["tune", str(path), "--eval", "echo 1 {model}", "-o", str(tmp_path / "cli"), "--device", "gpu", "-q"]
    done = subprocess.run([sys.executable, "-m", "specmerge", *args], capture_output=True, text=True)
    assert done.returncode == 2 and "device 'gpu' is not one of" in done.stderr and done.stderr.count("\n") == 1
