"""Per-expert weights and per-layer values in recipes and on the command line (issue 16), validated up front."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from specmerge.cli import main
from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.layered import at_position, interpolate, layer_positions
from specmerge.pipeline.recipe.model import Recipe, load_recipe

LAYERS = 3
NAMES = [f"model.layers.{i}.mlp.weight" for i in range(LAYERS)] + ["model.embed_tokens.weight", "model.norm.weight"]


def close_to(merged: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Equal up to float32 rounding of a few operations on values of this size: 8 eps (max |expected| + 1)."""
    atol = 8 * torch.finfo(torch.float32).eps * (float(expected.abs().max()) + 1)
    torch.testing.assert_close(merged, expected.to(merged.dtype), rtol=0, atol=atol, msg=msg)


def write_models(tmp_path, n_experts=2):
    """Base and experts as single safetensors files: three numbered layers, an embedding and a norm."""
    g = torch.Generator().manual_seed(0)
    shapes = {name: (4, 3) if "norm" not in name else (3,) for name in NAMES}
    base = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    save_file(base, tmp_path / "base.safetensors")
    experts = []
    for i in range(n_experts):
        weights = {name: t + 0.1 * torch.randn(t.shape, generator=g) for name, t in base.items()}
        save_file(weights, tmp_path / f"e{i}.safetensors")
        experts.append(weights)
    return base, experts


def test_layer_positions_and_interpolation():
    names = [*NAMES, "vision.encoder.layers.0.w", "vision.encoder.layers.1.w", "h.0.attn.weight"]
    positions = layer_positions(names)
    assert [positions[f"model.layers.{i}.mlp.weight"] for i in range(3)] == [0.0, 0.5, 1.0]
    assert positions["model.embed_tokens.weight"] is None and positions["model.norm.weight"] is None
    assert positions["vision.encoder.layers.1.w"] == 1.0  # its own stack of two
    assert positions["h.0.attn.weight"] == 1.0  # a stack of one layer: t = 1, as mergekit
    values = [0.2, 0.5, 0.8]
    assert [interpolate(values, t) for t in (0.0, 0.25, 0.5, 1.0, None)] == [0.2, pytest.approx(0.35), 0.5, 0.8, 0.2]
    assert interpolate([1.0, 3.0], 0.25) == 1.5
    assert at_position({"density": [0.2, 1.0], "scale": 1.0}, 0.5) == {"density": 0.6, "scale": 1.0}


def test_expert_entries_with_weights_and_names():
    recipe = Recipe(base="b", experts=[{"path": "x", "weight": 0.7, "name": "math"}, {"path": "y", "name": "code"}],
                    method="linear")  # fmt: skip
    assert (
        recipe.experts == ["x", "y"] and recipe.expert_weights == [0.7, 1.0] and recipe.expert_keys == ["math", "code"]
    )
    again = Recipe.from_dict(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe
    plain = Recipe(base="b", experts=[{"path": "x", "weight": 1}, "y"], method="swudi_a")  # weights 1: none
    assert plain.expert_weights is None and plain.expert_keys == ["x", "y"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"experts": [{"path": "x", "weight": 0.5}, "y"], "method": "swudi_a"},
         "method 'swudi_a' does not define per-expert weights"),
        ({"experts": ["x", "y"], "expert_weights": [1.0, -1.0], "method": "ties"},
         "method 'ties': expert weights must be finite and > 0"),
        ({"experts": ["x", "y"], "expert_weights": [1.0], "method": "linear"}, "expert_weights has 1 values but"),
        ({"experts": ["x", "y"], "expert_weights": [1.0, float("inf")], "method": "linear"}, "must be a finite"),
        ({"experts": [{"path": "x", "wieght": 2}], "method": "linear"}, "did you mean 'weight'"),
        ({"experts": [{"weight": 2}], "method": "linear"}, "experts\\[0\\] has no 'path'"),
        ({"experts": [{"path": "x", "weight": 2}], "expert_weights": [2.0], "method": "linear"}, "not both"),
        ({"experts": ["x", "y"], "expert_weights": [2.0, 1.0], "method": "linear",
          "overrides": [{"pattern": "*", "method": "tsv_m"}]}, "method 'tsv_m' does not define"),
        ({"experts": ["x"], "method": "ties", "params": {"density": []}}, "'density' is an empty list"),
        ({"experts": ["x"], "method": "ties", "params": {"density": [0.5, 1.5]}}, "value 1 of the list for 'density'"),
        ({"experts": ["x"], "method": "dare_ties", "params": {"seed": [1, 2]}}, "only float parameters take a list"),
        ({"experts": ["x", "y"], "method": "slerp"}, "the base and one expert, but 2 experts"),
        ({"experts": ["x"], "method": "model_stock"}, "at least two experts"),
        ({"experts": ["x", "y"], "expert_weights": [1.0, -1.0], "method": "linear"}, "sum to 0, and the mean"),
        ({"experts": ["x", "y"], "expert_weights": [1.0, -1.0], "method": "weight_average"}, "sum to 0"),
        ({"experts": ["x", "y"], "expert_weights": [1.0, -1.0], "method": "dare_linear",
          "params": {"normalize": True}}, "normalize: true divides .* sum to 0"),
        ({"experts": ["x", "y"], "expert_weights": [0.5, -0.5], "method": "breadcrumbs",
          "params": {"normalize": True}}, "normalize: true divides .* sum to 0"),
        ({"experts": ["x"], "method": "della", "params": {"density": [0.3, 0.9], "epsilon": 0.2}},
         "value 1 of the list for 'density'"),
    ],
)  # fmt: skip
def test_bad_weights_and_lists_are_one_line_before_anything_is_read(data, message):
    with pytest.raises(RecipeError, match=message) as caught:
        Recipe(base="b", **data)
    assert "\n" not in str(caught.value)


def test_linear_divides_by_its_weights_with_the_bases():
    """mergekit's linear with the base among its models: expert weights summing to 0 are fine, the base's counts."""
    recipe = Recipe(
        base="b", experts=["x", "y"], expert_weights=[1.0, -1.0], method="linear", params={"base_weight": 1.0}
    )
    assert recipe.expert_weights == [1.0, -1.0]


def test_weights_and_a_per_layer_list_from_a_recipe_file(tmp_path):
    base, experts = write_models(tmp_path)
    recipe = {
        "base": "base.safetensors",
        "experts": [{"path": "e0.safetensors", "weight": 3.0}, {"path": "e1.safetensors", "weight": 1.0}],
        "method": "task_arithmetic",
        "params": {"scale": [0.0, 1.0]},  # layer 0: 0, layer 1: 0.5, layer 2: 1; outside the layers: 0
        "merge_embeddings": True,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert load_recipe(tmp_path / "recipe.yaml").expert_weights == [3.0, 1.0]
    assert main(["run", str(tmp_path / "recipe.yaml"), "-o", str(tmp_path / "out"), "-q"]) == 0
    merged = load_file(tmp_path / "out" / "model.safetensors")
    scales = {"model.layers.0.mlp.weight": 0.0, "model.layers.1.mlp.weight": 0.5, "model.layers.2.mlp.weight": 1.0,
              "model.embed_tokens.weight": 0.0, "model.norm.weight": 0.0}  # fmt: skip
    for name, scale in scales.items():
        tau = [e[name] - base[name] for e in experts]
        expected = base[name] + scale * (3.0 * tau[0] + 1.0 * tau[1])
        close_to(merged[name], expected, name)


def test_weights_on_the_command_line_and_the_weighted_average_of_other_tensors(tmp_path):
    base, experts = write_models(tmp_path)
    out = tmp_path / "out"
    argv = ["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "e0.safetensors"),
            str(tmp_path / "e1.safetensors"), "-o", str(out), "-m", "ties", "-p", "density=1",
            "--weight", "0.25", "--weight", "0.75", "--no-merge-embeddings", "-q"]  # fmt: skip
    assert main(argv) == 0
    merged = load_file(out / "model.safetensors")
    name = "model.embed_tokens.weight"  # averaged (non_matrix): the weighted mean
    expected = base[name] + 0.25 * (experts[0][name] - base[name]) + 0.75 * (experts[1][name] - base[name])
    close_to(merged[name], expected)
    name = "model.layers.1.mlp.weight"  # weighted TIES without trim: same signs -> weighted mean
    tau = torch.stack([e[name] - base[name] for e in experts])
    w = torch.tensor([0.25, 0.75]).view(2, 1, 1)
    sign = torch.sign((w * tau).sum(0))
    agree = (tau * sign) > 0
    expected = base[name] + (w * tau * agree).sum(0) / (w * agree).sum(0).clamp(min=1e-30)
    expected = torch.where(agree.any(0), expected, base[name])
    close_to(merged[name], expected)
    report = (out / "recipe.yaml").read_text()
    assert "expert_weights:\n- 0.25\n- 0.75" in report


def test_slerp_with_a_per_layer_t_on_the_command_line(tmp_path):
    base, experts = write_models(tmp_path)
    out = tmp_path / "out"
    argv = ["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "e0.safetensors"), "-o", str(out),
            "-m", "SLERP", "-p", "t=[0, 1]", "--non-matrix", "keep_base", "-q"]  # fmt: skip
    assert main(argv) == 0
    merged = load_file(out / "model.safetensors")
    torch.testing.assert_close(merged["model.layers.0.mlp.weight"], base["model.layers.0.mlp.weight"])  # t = 0
    torch.testing.assert_close(merged["model.layers.2.mlp.weight"], experts[0]["model.layers.2.mlp.weight"])  # t 1
    w0, w1 = base["model.layers.1.mlp.weight"].double(), experts[0]["model.layers.1.mlp.weight"].double()
    theta = torch.acos((w0 * w1).sum() / (w0.norm() * w1.norm()))
    expected = (torch.sin(theta / 2) * (w0 + w1) / torch.sin(theta)).float()  # t = 1/2
    close_to(merged["model.layers.1.mlp.weight"], expected)


def test_weights_summing_to_zero_refuse_averaged_tensors_in_the_plan(tmp_path, capsys):
    write_models(tmp_path)
    argv = ["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "e0.safetensors"),
            str(tmp_path / "e1.safetensors"), "-o", str(tmp_path / "out"), "-m", "task_arithmetic",
            "--weight", "1", "--weight", "-1", "--no-merge-embeddings", "-q"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "tensor 'model.embed_tokens.weight' is averaged" in err and "sum, which is 0" in err
    assert not (tmp_path / "out").exists()
    assert main([*argv[:-1], "--non-matrix", "keep_base", "-q"]) == 0  # task negation with the rest kept


def test_the_json_schema_takes_expert_entries_and_lists_of_float_values():
    import jsonschema

    from specmerge.pipeline.recipe.schema import recipe_schema

    schema = recipe_schema()
    good = {"base": "b", "experts": [{"path": "x", "weight": 0.7}, "y"], "method": "ties",
            "params": {"density": [0.2, 0.5, 0.8]}}  # fmt: skip
    jsonschema.validate(good, schema)
    Recipe(**good)  # and the recipe agrees
    for bad in (
        {**good, "experts": [{"path": "x", "wieght": 1}]},
        {**good, "params": {"density": [0.2, 1.5]}},
        {**good, "params": {"density": []}},
        {**good, "method": "dare_ties", "params": {"seed": [1, 2]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(RecipeError):
            Recipe(**bad)


def test_the_dry_run_names_the_weights_and_the_values_across_layers(tmp_path, capsys):
    write_models(tmp_path)
    argv = ["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "e0.safetensors"),
            str(tmp_path / "e1.safetensors"), "-o", str(tmp_path / "out"), "-m", "ties", "-p", "density=[0.2, 0.8]",
            "--weight", "0.6", "--weight", "0.4", "--dry-run"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "expert weights: 0.6, 0.4 (in expert order)" in out
    assert "density across layers: 0.2 -> 0.8 (outside the layers 0.2)" in out
    assert not (tmp_path / "out").exists()


def test_a_scale_across_layers_also_scales_averaged_tensors_with_scale_non_matrix(tmp_path):
    base, experts = write_models(tmp_path)
    argv = ["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "e0.safetensors"),
            str(tmp_path / "e1.safetensors"), "-o", str(tmp_path / "out"), "-m", "swudi_a", "-p", "scale=[0.5, 1]",
            "--scale-non-matrix", "--weight", "1", "--weight", "3", "-q"]  # fmt: skip
    assert main(argv) == 2  # swudi_a takes no weights: refused before anything is read
    argv = [a for a in argv if a not in ("--weight", "1", "3")]
    assert main(argv) == 0
    merged = load_file(tmp_path / "out" / "model.safetensors")
    name = "model.norm.weight"  # 1-D, averaged, outside the layers: the first scale, 0.5
    expected = base[name] + 0.5 * ((experts[0][name] - base[name]) + (experts[1][name] - base[name])) / 2
    close_to(merged[name], expected)
