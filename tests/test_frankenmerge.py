"""Frankenmerges (issue 51): a recipe's ``layers`` stack ranges of models' layers into one model, renumbered, as
mergekit's ``slices`` with ``passthrough`` do; ``passthrough`` of one model copies it. What cannot be stacked is
refused in one line, before anything is written."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

import specmerge
from specmerge.cli import main
from specmerge.errors import RecipeError, SpecmergeError
from specmerge.io.formats.protocol import SourceError, TensorInfo
from specmerge.io.views.stacked import layer_of, stack_layers
from specmerge.pipeline.recipe.mergekit import convert
from specmerge.pipeline.recipe.model import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from mergekit_inputs import build_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("frankenmerge-inputs"))


def infos(names: list[str]) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, (2, 2), torch.float32) for n in names}


def llama(layers: int) -> dict[str, TensorInfo]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [
        f"model.layers.{i}.{part}" for i in range(layers) for part in ("mlp.up_proj.weight", "input_layernorm.weight")
    ]
    return infos(names)


def test_layers_are_stacked_renumbered_between_the_first_models_embeddings_and_the_last_models_head():
    names = stack_layers({"a": llama(4), "b": llama(3)}, [("a", 2, 4), ("b", 0, 3), ("a", 0, 1)])
    assert next(iter(names)) == "model.embed_tokens.weight" and names["model.embed_tokens.weight"] == (
        "a",
        "model.embed_tokens.weight",
    )
    assert names["model.layers.0.mlp.up_proj.weight"] == ("a", "model.layers.2.mlp.up_proj.weight")
    assert names["model.layers.4.input_layernorm.weight"] == ("b", "model.layers.2.input_layernorm.weight")
    assert names["model.layers.5.mlp.up_proj.weight"] == ("a", "model.layers.0.mlp.up_proj.weight")
    assert names["lm_head.weight"] == ("a", "lm_head.weight") and names["model.norm.weight"] == (
        "a",
        "model.norm.weight",
    )
    assert len(names) == 3 + 2 * 6
    assert layer_of("model.layers.12.mlp.up_proj.weight") == ("model.layers", 12, "mlp.up_proj.weight")


@pytest.mark.parametrize(
    ("models", "slices", "message"),
    [
        ({"a": llama(4)}, [("a", 2, 5)], "layer_range [2, 5] is outside its 4 layers"),
        ({"a": {**llama(2), **infos(["vision.layers.0.w"])}}, [("a", 0, 2)], "has 2 (model.layers, vision.layers)"),
        ({"a": llama(2), "b": infos(["transformer.h.0.w"])}, [("a", 0, 2), ("b", 0, 1)], "under different names"),
    ],
)
def test_what_cannot_be_stacked_is_refused(models, slices, message):
    with pytest.raises(
        SourceError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        stack_layers(models, slices)


def test_a_recipe_with_layers_has_passthrough_and_no_experts():
    good = {"base": "a", "experts": [], "method": "passthrough", "layers": [{"model": "a", "range": [0, 2]}]}
    assert Recipe(**good).layers[0].range == (0, 2)
    for change, message in [
        ({"experts": ["b"]}, "passthrough copies the base as it is and takes no experts (got 1)"),
        ({"method": "ties"}, "method passthrough, no experts"),
        ({"layers": []}, "layers is empty"),
        ({"layers": [{"model": "a", "range": [2, 1]}]}, "two whole numbers first < end"),
        ({"layers": [{"model": "a", "range": [0, True]}]}, "a layer range is [first, end]"),
        ({"layers": [{"model": "a", "range": [0, 2], "step": 1}]}, "step"),
        ({"overrides": [{"pattern": "*", "action": "average"}]}, "overrides have nothing to change"),
    ]:
        with pytest.raises(RecipeError) as caught:
            Recipe(**{**good, **change})
        assert message in str(caught.value), (change, str(caught.value))
    with pytest.raises(RecipeError, match="give at least one expert"):
        Recipe(base="a", experts=[])


def test_a_frankenmerge_runs_from_a_recipe_and_loads(inputs, tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "frank.yaml"
    recipe.write_text(yaml.safe_dump({
        "base": str(inputs["e0"]), "experts": [], "method": "passthrough", "dtype": "bfloat16",
        "layers": [{"model": str(inputs["e0"]), "range": [0, 2]}, {"model": str(inputs["e1"]), "range": [1, 4]},
                   {"model": str(inputs["e0"]), "range": [3, 4]}],
    }))  # fmt: skip
    assert main(["run", str(recipe), "-o", str(tmp_path / "out"), "-q"]) == 0
    out = load_file(tmp_path / "out/model.safetensors")
    e0, e1 = (load_file(inputs[k] / "model.safetensors") for k in ("e0", "e1"))
    assert torch.equal(out["model.layers.2.mlp.up_proj.weight"], e1["model.layers.1.mlp.up_proj.weight"].bfloat16())
    assert torch.equal(
        out["model.layers.5.self_attn.q_proj.weight"], e0["model.layers.3.self_attn.q_proj.weight"].bfloat16()
    )
    assert torch.equal(out["lm_head.weight"], e0["lm_head.weight"].bfloat16())  # the last range's model: e0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["num_hidden_layers"] == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert len(model.model.layers) == 6
    report = json.loads((tmp_path / "out/report.json").read_text())
    assert report["method"] == "passthrough" and report["summary"]["by_action"]["keep_base"]["tensors"] == len(out)
    # the written recipe names the layers' models as it names the base: by their path relative to the output, so
    # it runs the same from anywhere; the card lists the layers
    written = yaml.safe_load((tmp_path / "out/recipe.yaml").read_text())
    assert [r["model"] for r in written["layers"]] == [os.path.relpath(inputs[k], tmp_path / "out") for k in
                                                       ("e0", "e1", "e0")]  # fmt: skip
    card = (tmp_path / "out/README.md").read_text()
    assert f"- layers 1 to 3 of `{written['layers'][1]['model']}`" in card and "Experts:" not in card
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["run", "../out/recipe.yaml", "-o", "again", "-q"]) == 0
    assert (tmp_path / "elsewhere/again/model.safetensors").read_bytes() == (
        tmp_path / "out/model.safetensors"
    ).read_bytes()


def test_passthrough_of_one_model_copies_it_and_slices_that_merge_are_refused(inputs, tmp_path):
    one = {"merge_method": "passthrough", "models": [{"model": str(inputs["e2"])}], "dtype": "float32"}
    specmerge.merge(mergekit_config=one, output=tmp_path / "copy", progress=False)
    copied, e2 = load_file(tmp_path / "copy/model.safetensors"), load_file(inputs["e2"] / "model.safetensors")
    assert sorted(copied) == sorted(e2) and all(torch.equal(copied[k], e2[k]) for k in e2)
    two = {**one, "models": [{"model": str(inputs["e2"])}, {"model": str(inputs["e1"])}]}
    with pytest.raises(RecipeError, match="copies exactly one model"):
        convert(two)
    two_slices = {
        "merge_method": "slerp", "base_model": str(inputs["base"]), "parameters": {"t": 0.5},
        "slices": [{"sources": [{"model": str(inputs["base"]), "layer_range": [0, 2]},
                                {"model": str(inputs["e0"]), "layer_range": [0, 2]}]},
                   {"sources": [{"model": str(inputs["base"]), "layer_range": [2, 4]},
                                {"model": str(inputs["e0"]), "layer_range": [2, 4]}]}],
    }  # fmt: skip
    # two slices of the same models over consecutive ranges: one merge, each layer's values from its slice
    patterns = [o.pattern for o in convert(two_slices).recipe.overrides]
    assert patterns == [f"model.layers.{i}.*" for i in range(4)]
    shifted = copy.deepcopy(two_slices)
    shifted["slices"][1]["sources"][1]["layer_range"] = [1, 3]  # e0's layers 1-2 on the base's 2-3
    with pytest.raises(RecipeError, match=r"slices\[1\]: slices merging different layers of their models"):
        convert(shifted)
    other = copy.deepcopy(two_slices)
    other["slices"][1]["sources"][1]["model"] = str(inputs["e1"])
    with pytest.raises(RecipeError, match="or other models than the first slice's"):
        convert(other)
    part = {**two_slices, "slices": two_slices["slices"][:1]}  # layers 0-1 of 4: a smaller model
    with pytest.raises(RecipeError, match=r"layer ranges \[0, 2\] must follow each other .* \(4 layers\)"):
        convert(part)
    gap = {**two_slices, "slices": [two_slices["slices"][1], two_slices["slices"][0]]}  # out of order
    with pytest.raises(RecipeError, match=r"layer ranges \[2, 4\], \[0, 2\] must follow each other"):
        convert(gap)

    def ties_slice(first, end, density):  # e0 with its own density, e1 with the default: a per-model parameter
        e0 = {"model": str(inputs["e0"]), "layer_range": [first, end], "parameters": {"weight": 1, "density": density}}
        e1 = {"model": str(inputs["e1"]), "layer_range": [first, end], "parameters": {"weight": 1}}
        return {"sources": [{"model": str(inputs["base"]), "layer_range": [first, end]}, e0, e1]}

    own = {"merge_method": "ties", "base_model": str(inputs["base"]), "slices": [ties_slice(0, 2, 0.5),
                                                                                  ties_slice(2, 4, 0.7)]}  # fmt: skip
    with pytest.raises(RecipeError, match="a parameter given per model that differs between the slices"):
        convert(own)
    whole = {**two_slices, "slices": [{"sources": [{"model": str(inputs["base"]), "layer_range": [0, 4]},
                                                   {"model": str(inputs["e0"]), "layer_range": [0, 4]}]}]}  # fmt: skip
    assert convert(whole).recipe == convert({**two_slices, "slices": None} | {"models": [
        {"model": str(inputs["base"])}, {"model": str(inputs["e0"])}]}).recipe  # fmt: skip
    with pytest.raises(RecipeError, match="a source is"):
        convert({"merge_method": "passthrough", "slices": [{"sources": [{"model": "x"}]}]})


def test_a_model_whose_config_lists_values_per_layer_is_not_stacked(inputs, tmp_path):
    model = tmp_path / "typed"
    model.mkdir()
    for file in inputs["e0"].iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    recipe = Recipe(base=str(model), experts=[], method="passthrough", layers=[{"model": str(model), "range": [0, 2]}])
    with pytest.raises(SpecmergeError, match="lists a value per layer \\('layer_types'\\)"):
        specmerge.run_recipe(recipe, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_frankenmerge_of_hub_models_pins_them_and_lists_them_in_the_card(inputs, tmp_path, monkeypatch):
    """Layers taken from hub ids (read from the cache, offline) are written pinned to the commit read, and the card's
    base_model names each repository once; a local layer model is named by its path only in the text."""
    from hub_cache import add_commit, folder_files

    root = tmp_path / "hub"
    commits = {k: add_commit(root, f"org/{k}", folder_files(inputs[k])) for k in ("e0", "e1")}
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)
    recipe = Recipe(
        base="org/e0", experts=[], method="passthrough",
        layers=[{"model": "org/e0", "range": [0, 2]}, {"model": "org/e1", "range": [2, 3]},
                {"model": str(inputs["e1"]), "range": [3, 4]}],
    )  # fmt: skip
    specmerge.run_recipe(recipe, "out", progress=False)
    written = yaml.safe_load(Path("out/recipe.yaml").read_text())
    assert [r["model"] for r in written["layers"]] == [
        f"org/e0@{commits['e0']}",
        f"org/e1@{commits['e1']}",
        os.path.relpath(inputs["e1"], "out"),
    ]
    front = yaml.safe_load(Path("out/README.md").read_text().split("---")[1])
    assert front["base_model"] == ["org/e0", "org/e1"]
