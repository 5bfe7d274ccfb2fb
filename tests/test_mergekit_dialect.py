"""The mergekit dialect (issue 51): a mergekit config recognised by its keys, converted with mergekit's defaults and
meaning, refused in one line where specmerge cannot honour a key, and run by ``specmerge run``, ``specmerge convert``
and ``specmerge.merge(mergekit_config=...)``; and the recipe values it relies on (conditions, per-expert params,
per-override and varying weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

import specmerge
from specmerge.cli import main
from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.layered import NoCondition, evaluate
from specmerge.pipeline.recipe.mergekit import convert, is_mergekit_config
from specmerge.pipeline.recipe.mergekit.config import setting_of
from specmerge.pipeline.recipe.model import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from mergekit_inputs import build_inputs

TIES = {
    "merge_method": "ties",
    "base_model": "b",
    "models": [
        {"model": "x", "parameters": {"weight": 0.5, "density": 0.5}},
        {"model": "y", "parameters": {"weight": 0.5}},
    ],
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("mergekit-inputs"))


def test_a_config_is_recognised_by_its_keys():
    assert is_mergekit_config(TIES) and is_mergekit_config({"merge_method": "x", "slices": []})
    assert not is_mergekit_config({"merge_method": "ties", "method": "ties", "models": []})
    assert not is_mergekit_config({"base": "b", "experts": ["x"]}) and not is_mergekit_config(["merge_method"])


def test_omitted_keys_take_mergekits_defaults():
    recipe = convert(TIES).recipe
    assert recipe.method == "ties" and recipe.merge_embeddings is True
    # no chat_template: mergekit keeps the copied tokenizer's template (the base's), never the experts' silently
    assert recipe.chat_template == "base" and convert({**TIES, "tokenizer_source": "y"}).recipe.chat_template == "y"
    assert recipe.params["scale"] == 1.0 and recipe.params["normalize"] is True and recipe.params["rescale"] is False
    assert recipe.params["convention"] == "mergekit" and recipe.expert_params == [{"density": 0.5}, {"density": 1.0}]
    assert recipe.expert_weights == [0.5, 0.5]
    dare = convert({**TIES, "merge_method": "dare_ties"}).recipe
    assert dare.params["normalize"] is False and dare.params["rescale"] is True  # summed, L1-rescaled
    assert dare.expert_params == [{"drop_rate": 0.5}, {"drop_rate": 0.0}]
    ta = convert({**TIES, "merge_method": "task_arithmetic", "models": [{"model": "x", "parameters": {"weight": 1}}]})
    assert ta.recipe.method == "task_arithmetic" and ta.recipe.params == {"scale": 1.0}
    normalized = convert({**TIES, "merge_method": "task_arithmetic", "parameters": {"normalize": True}})
    assert normalized.recipe.method == "weight_average"
    assert any("density changes nothing in mergekit's task_arithmetic" in n for n in normalized.differences)


def test_lambda_gamma_and_gradients_go_where_specmerge_takes_them():
    config = {
        "merge_method": "breadcrumbs",
        "base_model": "b",
        "models": [{"model": "x", "parameters": {"weight": [0.2, 0.8], "gamma": 0.05, "density": 0.8}}],
        "parameters": {"lambda": 0.7, "density": [{"filter": "mlp", "value": 0.5}, {"value": 0.9}]},
    }
    recipe = convert(config).recipe
    assert recipe.params["scale"] == 0.7 and recipe.params["beta"] == 0.05 and recipe.params["density"] == 0.8
    assert recipe.expert_weights == [[0.2, 0.8]]
    two = {**config, "models": [*config["models"], {"model": "y", "parameters": {"weight": 1.0}}]}
    recipe = convert(two).recipe  # y takes the config's density (a condition list) and mergekit's gamma
    assert recipe.expert_params == [
        {"density": 0.8, "beta": 0.05},
        {"density": [{"filter": "mlp", "value": 0.5}, {"value": 0.9}], "beta": 0.01},
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"merge_methd": "ties"}, "unknown key of a mergekit config 'merge_methd'"),
        ({"merge_method": "passthrough"}, "passthrough of models copies exactly one model, without parameters"),
        ({"merge_method": "task_adapter"}, "not in specmerge's registry"),
        ({"merge_method": "sleep"}, "unknown mergekit merge_method 'sleep'"),
        ({"base_model": None}, "needs base_model"),
        ({"parameters": {"densty": 0.5}}, "unknown parameter of mergekit's ties 'densty'"),
        ({"parameters": {"t": 0.5}}, "unknown parameter of mergekit's ties 't'"),
        (
            {"models": [{"model": "x", "parameters": {"normalize": True}}]},
            "'normalize' is one value for the whole merge",
        ),
        ({"models": [{"model": "x"}]}, "model 'x' has no weight"),
        ({"models": ["x"]}, "mergekit writes each as {model: x}"),
        ({"models": [{"model": "x+lora", "parameters": {"weight": 1}}]}, "LoRA to 'x', which is not base_model"),
        ({"models": [{"model": "b+l+m", "parameters": {"weight": 1}}]}, "applies a LoRA to 'b'"),
        ({"base_model": "b+lora"}, "base_model 'b+lora' is a model with a LoRA applied"),
        ({"base_model": {"model": "b", "override_architecture": "X"}}, "override_architecture is not supported"),
        ({"base_model": {"path": "b"}}, "base_model: a model is its path or {model: M, lora: L}"),
        (
            {"models": [{"model": {"model": {"path": "x", "rev": "main"}}, "parameters": {"weight": 1}}]},
            "models.0.model.model: give a path, path@revision or {path: P, revision: R}",
        ),
        ({"models": [{"model": 3, "parameters": {"weight": 1}}]}, "'models.0.model' input should be a valid string"),
        ({"chat_template": "chatml"}, "one of mergekit's built-in templates"),
        ({"tokenizer": {"source": "union", "tokens": {}}}, "token surgery"),
        ({"tokenizer_source": "z"}, "tokenizer_source 'z' is not one of the models"),
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"parameters": {"normalize": [True, False]}}, "only numbers vary"),
        ({"slices": []}, "exactly one of models, slices and modules"),
    ],
)
def test_what_specmerge_cannot_honour_is_refused_in_one_line(change, message):
    config = {key: value for key, value in {**TIES, **change}.items() if value is not None}
    with pytest.raises(RecipeError) as caught:
        convert(config)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_lora_applied_to_the_base_is_that_adapter_as_an_expert():
    config = {**TIES, "models": [*TIES["models"], {"model": "b+adapter", "parameters": {"weight": 0.3}}]}
    recipe = convert(config).recipe
    assert recipe.base == "b" and recipe.experts == ["x", "y", "adapter"] and recipe.expert_weights == [0.5, 0.5, 0.3]


def test_mergekits_mapping_form_of_a_model_is_its_text_form(inputs):
    mapping = {"model": {"path": "b", "revision": "v1"}, "lora": "adapter@main"}
    config = {
        **TIES,
        "base_model": {"model": "b@v1"},
        "models": [*TIES["models"], {"model": mapping, "parameters": {"weight": 1}}],
    }
    recipe = convert(config).recipe
    assert recipe.base == "b@v1" and recipe.experts == ["x", "y", "adapter@main"]
    base, lora = str(inputs["base"]), str(inputs["lora0"])
    source = {"model": {"model": {"path": base}, "lora": {"path": lora}}, "parameters": {"weight": 1, "density": 1}}
    slices = {"merge_method": "ties", "base_model": base, "slices": [{"sources": [{**source, "layer_range": [0, 4]}]}]}
    assert convert(slices).recipe.experts == [lora]


def test_linear_lists_the_base_among_its_models():
    config = {"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": 0.2}},
                                                   {"model": "b", "parameters": {"weight": 0.8}}]}  # fmt: skip
    recipe = convert(config).recipe
    assert recipe.base == "a" and recipe.experts == ["b"] and recipe.params["base_weight"] == 0.2
    unnormalized = {**config, "parameters": {"normalize": False}}  # weights summing to 1: the same average
    assert convert(unnormalized).recipe.params["normalize"] is True
    with pytest.raises(RecipeError, match="not among them"):
        convert({**config, "base_model": "c"})


def test_conditions_and_gradients_evaluate_as_mergekits_settings():
    conditions = [{"filter": "self_attn", "value": [0.0, 1.0]}, {"pattern": "*.mlp.*", "value": 0.3}, {"value": 0.9}]
    assert evaluate(conditions, "model.layers.1.self_attn.q_proj.weight", 0.25) == 0.25
    assert evaluate(conditions, "model.layers.1.mlp.up_proj.weight", 0.25) == 0.3
    assert evaluate(conditions, "model.norm.weight", None) == 0.9
    with pytest.raises(NoCondition, match="no condition matches"):
        evaluate([{"filter": "mlp", "value": 1.0}], "model.norm.weight", None)
    assert evaluate([{"filter": "*", "value": 2.0}], None, None) == 2.0


def test_a_recipe_takes_per_expert_params_and_per_override_weights(inputs, tmp_path):
    base, experts = str(inputs["base"]), [str(inputs["e0"]), str(inputs["e1"])]
    with pytest.raises(RecipeError, match="method 'swudi_a' does not take it per expert"):
        Recipe(base=base, experts=[{"path": experts[0], "params": {"density": 0.5}}, experts[1]])
    with pytest.raises(RecipeError, match="override '\\*mlp\\*': expert_weights apply to merged or averaged"):
        Recipe(
            base=base,
            experts=experts,
            overrides=[{"pattern": "*mlp*", "action": "keep_base", "expert_weights": [1, 2]}],
        )
    recipe = {
        "method": "task_arithmetic",
        "params": {"scale": 1.0},
        "experts": [{"path": experts[0], "weight": [{"filter": "mlp", "value": 1.0}, {"value": 0.0}]}, experts[1]],
        "overrides": [{"pattern": "*self_attn*", "expert_weights": [0.0, 0.5]}],
    }
    specmerge.run_recipe(Recipe(base=base, **recipe), tmp_path / "out", progress=False)
    out, b = load_file(tmp_path / "out/model.safetensors"), load_file(inputs["base"] / "model.safetensors")
    e0, e1 = (load_file(inputs[k] / "model.safetensors") for k in ("e0", "e1"))
    name = "model.layers.1.mlp.up_proj.weight"  # e0 weight 1 (its filter), e1 weight 1
    assert (out[name] - (e0[name] + e1[name] - b[name])).abs().max() < 1e-6
    name = "model.layers.1.self_attn.q_proj.weight"  # the override's weights
    assert (out[name] - (b[name] + 0.5 * (e1[name] - b[name]))).abs().max() < 1e-6
    name = "model.norm.weight"  # e0's weight 0 (its last condition), e1's 1
    assert (out[name] - e1[name]).abs().max() < 1e-6


def test_specmerge_run_recognises_a_mergekit_config_and_says_the_differences(inputs, tmp_path, capsys):
    config = {
        "merge_method": "ties",
        "base_model": str(inputs["base"]),
        "models": [{"model": str(inputs["e0"]), "parameters": {"weight": 1, "density": 0.5}},
                   {"model": str(inputs["e1"]), "parameters": {"weight": 1}}],
        "parameters": {"int8_mask": True},
        "dtype": "bfloat16",
    }  # fmt: skip
    path = tmp_path / "mk.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "mergekit config: run with mergekit's meaning as specmerge's 'ties'" in err
    assert "int8_mask: True changes nothing" in err and "mergekit computes in dtype bfloat16" in err
    assert load_file(tmp_path / "out/model.safetensors")["model.norm.weight"].dtype.is_floating_point
    assert main(["convert", str(path)]) == 0
    printed = capsys.readouterr().out
    assert (
        printed.startswith("# specmerge recipe converted from the mergekit config")
        and "convention: mergekit" in printed
    )
    assert Recipe.from_dict(yaml.safe_load(printed)) == convert(config).recipe
    target = tmp_path / "recipe.yaml"
    assert main(["convert", str(path), "-o", str(target)]) == 0 and target.read_text() == printed
    assert main(["convert", str(path), "-o", str(target)]) == 2  # not overwritten unless asked
    assert "exists" in capsys.readouterr().err
    assert main(["run", str(target), "-o", str(tmp_path / "again"), "-q"]) == 0  # the printed recipe runs as such
    first, again = load_file(tmp_path / "out/model.safetensors"), load_file(tmp_path / "again/model.safetensors")
    assert all((first[k] == again[k]).all() for k in first)


def test_merge_takes_a_mergekit_config_alone(inputs, tmp_path):
    config = {"merge_method": "slerp", "base_model": str(inputs["base"]), "parameters": {"t": 0.3},
              "models": [{"model": str(inputs["base"])}, {"model": str(inputs["e0"])}]}  # fmt: skip
    with pytest.raises(RecipeError, match="give it alone"):
        specmerge.merge(inputs["base"], [inputs["e0"]], tmp_path / "o", mergekit_config=config)
    with pytest.raises(RecipeError, match="'dtype' is set by the mergekit config"):
        specmerge.merge(mergekit_config={**config, "dtype": "float32"}, output=tmp_path / "o", dtype="bfloat16")
    with pytest.raises(RecipeError, match="merge: give the output folder"):
        specmerge.merge(mergekit_config=config)
    report = specmerge.merge(mergekit_config=config, output=tmp_path / "o", progress=False, shard_size="1MB")
    assert (
        report["method"] == "slerp" and yaml.safe_load((tmp_path / "o/recipe.yaml").read_text())["shard_size"] == "1MB"
    )
    not_mergekit = tmp_path / "recipe.yaml"
    not_mergekit.write_text(yaml.safe_dump({"base": "b", "experts": ["x"]}))
    with pytest.raises(RecipeError, match="is not a mergekit config"):
        specmerge.merge(mergekit_config=not_mergekit, output=tmp_path / "p")


def test_a_file_that_cannot_be_read_is_one_line(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.yaml"), "-o", str(tmp_path / "out")]) == 2
    assert f"recipe file '{tmp_path / 'missing.yaml'}' does not exist" in capsys.readouterr().err
    assert main(["run", str(tmp_path), "-o", str(tmp_path / "out")]) == 2  # a folder
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="does not exist"):
        specmerge.merge(mergekit_config=tmp_path / "missing.yaml", output=tmp_path / "out")
    assert main(["convert", str(tmp_path / "missing.yaml")]) == 2


def test_settings_resolve_from_the_highest_precedence_down_as_mergekit_does():
    """A model's setting over its slice's over the config's over the default; a list of conditions that does not
    match a tensor hands it on to the next setting, as mergekit's resolver does."""
    mlp = {"filter": "mlp", "value": 0.3}
    assert setting_of(None, 0.5, 1.0) == 0.5 and setting_of(None, None) is None
    assert setting_of([0, 1], 0.5) == [0, 1]  # a gradient is a value for every tensor
    assert setting_of([mlp], 0.5) == [mlp, {"value": 0.5}]
    assert setting_of(mlp, [{"filter": "attn", "value": [0, 1]}], 1.0) == [
        mlp, {"filter": "attn", "value": [0, 1]}, {"value": 1.0}
    ]  # fmt: skip
    assert setting_of([mlp, {"value": 0.1}], 0.5) == [mlp, {"value": 0.1}]  # a catch-all: the rest never reached
    assert setting_of([mlp, {"filter": "*", "value": 0.2}, {"value": 0.1}], 0.5) == [mlp, {"filter": "*", "value": 0.2}]
    assert setting_of([], 0.5) == 0.5  # an empty list gives no value
    assert setting_of([mlp], None) == [mlp]  # nothing below: the plan refuses a tensor none matches
    for name, want in (("model.layers.0.mlp.up_proj.weight", 0.3), ("lm_head.weight", 0.5)):
        assert evaluate(setting_of([mlp], 0.5), name, 0.0) == want


def test_slices_of_hub_models_are_read_from_the_cache(inputs, tmp_path, monkeypatch):
    """The form most published slerp configs take: slices of hub ids. Their layers are counted (and, for several
    slices, named) from the cache's snapshot, offline, and the merge equals the same config on the local folders."""
    from hub_cache import add_commit, folder_files

    root = tmp_path / "hub"
    for name in ("base", "e0"):
        add_commit(root, f"org/{name}", folder_files(inputs[name]))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))

    def two_slices(base: str, expert: str) -> dict:
        ranges = ([0, 2], [2, 4])
        return {
            "merge_method": "slerp", "base_model": base, "parameters": {"t": [0, 1]}, "dtype": "float32",
            "slices": [{"sources": [{"model": base, "layer_range": r}, {"model": expert, "layer_range": r}]}
                       for r in ranges],
        }  # fmt: skip

    hub, local = two_slices("org/base", "org/e0"), two_slices(str(inputs["base"]), str(inputs["e0"]))
    specmerge.merge(mergekit_config=hub, output=tmp_path / "hub-out", progress=False)
    specmerge.merge(mergekit_config=local, output=tmp_path / "local-out", progress=False)
    merged = [load_file(tmp_path / f"{o}/model.safetensors") for o in ("hub-out", "local-out")]
    assert merged[0].keys() == merged[1].keys() and all(merged[0][k].equal(merged[1][k]) for k in merged[0])
    one = {**hub, "slices": [{"sources": [{"model": m, "layer_range": [0, 4]} for m in ("org/base", "org/e0")]}]}
    assert convert(one).recipe.experts == ["org/e0"]  # one slice over every layer: the merge of the models
    with pytest.raises(specmerge.errors.SpecmergeError, match="org/missing"):  # not cached, offline: said
        convert({**one, "base_model": "org/missing"})
