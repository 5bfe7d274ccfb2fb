"""The recipe is validated at the door: every mistake is one line that names the key, the value and a fix."""

import os

import pytest
import yaml

from specmerge.pipeline.recipe.model import Recipe, RecipeError, default_expert_keys, load_recipe, parse_size


def recipe(**fields):
    return Recipe.from_dict({"base": "base", "experts": ["a", "b"], **fields})


def error(**fields) -> str:
    with pytest.raises(RecipeError) as err:
        recipe(**fields)
    return str(err.value)


def test_yaml_recipe_with_relative_paths(tmp_path):
    folder = tmp_path / "recipes"
    folder.mkdir()
    path = folder / "merge.yaml"
    path.write_text(
        "base: ../models/base\n"
        "experts: [../models/math, /abs/code]\n"
        "method: ties\n"
        "params: {density: 0.1}\n"
        "overrides:\n"
        "  - pattern: '*.mlp.*'\n"
        "    action: average\n"
        "shard_size: 2GB\n"
    )
    r = load_recipe(path)
    assert r.base == os.path.normpath(tmp_path / "models" / "base")
    assert r.experts == [os.path.normpath(tmp_path / "models" / "math"), "/abs/code"]
    assert r.expert_keys == ["math", "code"]
    assert r.params == {"density": 0.1, "scale": 1.0, "normalize": True, "rescale": False, "convention": "paper"}
    assert r.overrides[0].action == "average"
    assert r.shard_bytes == 2 * 10**9
    assert (r.device, r.dtype, r.compute_dtype, r.non_matrix) == ("cpu", "auto", "float32", "average")


def test_params_are_completed_with_defaults():
    assert recipe().params == {"rule": "psqrt", "tau_init": "sum", "scale": 1.0}  # swudi_a, the default method
    assert recipe(method="swudi", params={"t": "300"}).params == {
        "rank_ratio": 0.65,
        "t": 300.0,
        "tau_init": "sum",
        "scale": 1.0,
    }
    assert recipe(params=None).params["rule"] == "psqrt"  # an empty `params:` in YAML


def test_override_params_refine_the_recipe_params_or_start_from_their_method():
    r = recipe(
        method="task_arithmetic",
        params={"scale": 0.5},
        overrides=[
            {"pattern": "*.mlp.*", "params": {}},
            {"pattern": "*.attn.*", "method": "ties", "params": {"density": 0.5}},
            {"pattern": "*norm*", "action": "keep_base"},
        ],
    )
    assert r.overrides[0].params == {"scale": 0.5}  # recipe's method: the recipe's params
    ties_defaults = {"scale": 1.0, "normalize": True, "rescale": False, "convention": "paper"}
    assert r.overrides[1].params == {"density": 0.5, **ties_defaults}  # own method: its defaults
    assert r.overrides[2].params == {} and r.overrides[2].method is None


def test_unknown_keys_get_a_did_you_mean():
    assert error(metod="ties").startswith("unknown recipe key 'metod': did you mean 'method'?")
    assert "did you mean 'merge_embeddings'?" in error(merge_embedding=True)
    message = error(scale=0.3)
    assert "method parameters go under 'params:'" in message
    message = error(overrides=[{"pattern": "*.mlp.*", "metod": "ties"}])
    assert message.startswith("override '*.mlp.*': unknown override key 'metod': did you mean 'method'?")


def test_unknown_method_and_parameters():
    assert error(method="swudy").startswith("unknown method 'swudy': did you mean 'swudi'?")
    message = error(method="ties", params={"densty": 0.1})
    assert "'densty': did you mean 'density'?" in message
    message = error(method="ties", params={"density": 2})
    assert "method 'ties'" in message and "'density'" in message and "less than or equal to 1" in message
    assert "got 2" in message
    message = error(overrides=[{"pattern": "*.mlp.*", "method": "ties", "params": {"densty": 1}}])
    assert message.startswith("override '*.mlp.*': unknown parameter") and "did you mean 'density'?" in message
    message = error(overrides=[{"pattern": "*.mlp.*", "method": "tie"}])
    assert message.startswith("override '*.mlp.*': unknown method 'tie': did you mean 'ties'?")
    message = error(overrides=[{"pattern": "lm_head.weight", "params": {"rule": "median"}}])  # against swudi_a
    assert message.startswith("override 'lm_head.weight': method 'swudi_a': parameter 'rule'") and "median" in message
    message = error(overrides=[{"pattern": "x", "action": "average", "method": "ties"}])
    assert "apply only to action 'merge'" in message


def test_wrong_types_name_the_field_and_value():
    assert error(experts="a") == "recipe key 'experts': input should be a valid list (got 'a')"
    assert error(experts=[]).startswith("experts: give at least one expert fine-tuned from the base")
    assert error(merge_embeddings="maybe").startswith("recipe key 'merge_embeddings': input should be a valid boolean")
    message = error(dtype="fp61")
    assert message.startswith("recipe key 'dtype': input should be 'auto', 'float32', 'float16' or 'bfloat16'")
    assert "(got 'fp61')" in message
    message = error(overrides=[{"pattern": "*.mlp.*", "action": "merg"}])
    assert message.startswith("override '*.mlp.*' key 'action': input should be 'merge', 'average' or 'keep_base'")
    assert error(overrides=[{"action": "average"}]) == "overrides[0] key 'pattern' is required"
    with pytest.raises(RecipeError, match="recipe key 'base' is required"):
        Recipe.from_dict({"experts": ["a"]})
    with pytest.raises(RecipeError, match="a recipe is a mapping"):
        Recipe.from_dict(["a"])
    assert "and 1 more problem" in error(dtype="fp61", device="gpu")


def test_experts_devices_and_keys_are_checked():
    assert error(experts=["a", "./a"]) == "expert './a' is listed twice (experts[0] and experts[1])"
    message = error(expert_keys=["x"])
    assert message.startswith("expert_keys has 1 names but there are 2 experts")
    assert "'x' twice" in error(expert_keys=["x", "x"])
    assert error(device="gpu").startswith("device 'gpu' is not one of cpu, cuda, cuda:N")
    for device in ("cpu", "cuda", "cuda:1", "auto"):
        assert recipe(device=device).device == device


def test_shard_sizes():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("64kib") == 65536
    assert parse_size(123456) == 123456
    assert parse_size("123456") == 123456
    assert recipe().shard_bytes == 5 * 10**9
    assert recipe(shard_size=123456).shard_bytes == 123456
    assert error(shard_size="12XB").startswith("shard_size '12XB' is not a size")
    assert error(shard_size=0) == "shard_size must be at least 1 byte, got 0"
    assert "got True" in error(shard_size=True)


def test_expert_keys_default_to_unique_folder_names():
    r = recipe(experts=["/ckpt/math/model", "/ckpt/code/model", "/ckpt/chat"])
    assert r.expert_keys == ["math/model", "code/model", "chat"]
    assert default_expert_keys(["x/a.safetensors", "y/b.safetensors"]) == ["a.safetensors", "b.safetensors"]
    assert default_expert_keys(["runs/model/", "other/model"]) == ["runs/model", "other/model"]
    assert recipe(expert_keys=["m", "c"]).expert_keys == ["m", "c"]


def test_to_yaml_round_trips():
    r = recipe(
        method="dare_ties",
        params={"drop_rate": 0.3, "seed": 7},
        overrides=[{"pattern": "*.mlp.*", "method": "ties"}, {"pattern": "*norm*", "action": "keep_base"}],
        dtype="bfloat16",
        shard_size="1.5GiB",
        merge_embeddings=True,
    )
    again = Recipe.from_dict(yaml.safe_load(r.to_yaml()))
    assert again == r
    assert again.shard_bytes == r.shard_bytes


def test_recipe_is_not_changed_after_validation_and_input_is_not_mutated():
    data = {"base": "b", "experts": ["a"], "params": {}}
    r = Recipe.from_dict(data)
    assert data == {"base": "b", "experts": ["a"], "params": {}}
    with pytest.raises(ValueError):
        r.method = "ties"


def test_yaml_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base: b\nexperts: [a, b\nmethod: ties\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml:\d+:\d+: invalid YAML"):
        load_recipe(path)
    path.write_text("base: b\nexperts: [a]\nmetod: ties\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == (
        f"{path}:3: unknown recipe key 'metod': did you mean 'method'? known: address, base, chat_template, "
        "compute_dtype, config_source, device, dtype, executor, expert_keys, expert_params, expert_weights, experts, "
        "gpu_memory, layers, max_rank, merge_embeddings, method, modules, non_matrix, output_format, overrides, "
        "params, quantize, scale_non_matrix, shard_size, tokenizer_source"
    )
    path.write_text("base: b\nexperts: [a]\noverrides:\n  - pattern: x\n  - pattern: '*.mlp.*'\n    action: merg\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml:6: override '\*\.mlp\.\*' key 'action'"):
        load_recipe(path)
    path.write_text("")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
