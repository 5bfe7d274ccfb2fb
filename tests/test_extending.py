"""Adding a merge method is one function in one file (CONTRIBUTING.md): everything else finds it by itself.

The method below is registered the way a built-in is (the same ``register`` decorator, no other file touched),
and the test checks every place that lists methods: ``specmerge methods``, the recipe and its JSON Schema, the
command line end to end, the demo, the speed benchmark's columns and the accuracy benchmark's candidates.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from safetensors.torch import load_file

from specmerge import LayerResult, get_method, register
from specmerge.cli import main
from specmerge.methods import Setting, all_methods, candidate_settings, registry
from specmerge.methods.params import UnitInterval
from specmerge.pipeline.recipe.model import Recipe, RecipeError
from specmerge.pipeline.recipe.schema import recipe_schema
from tiny_models import build_family

NAME = "magnitude_band_test"


def _register():
    @register(NAME, citation="a test of the registry", title="Magnitude band (test)", needs_matrix=False)
    def magnitude_band(task_vectors: torch.Tensor, *, low: UnitInterval = 0.25, scale: float = 1.0) -> LayerResult:
        """Keep each task vector's entries above the ``low`` quantile of its magnitudes, then sum.

        Args:
            low: quantile of |tau_i| below which entries are dropped, per expert and tensor.
            scale: lambda in merged = W_0 + lambda * sum_i band(tau_i).
        """
        flat = task_vectors.reshape(task_vectors.shape[0], -1).abs()
        cut = torch.quantile(flat, low, dim=1, keepdim=True).reshape(-1, *[1] * (task_vectors.dim() - 1))
        return LayerResult(scale * torch.where(task_vectors.abs() >= cut, task_vectors, 0).sum(dim=0))

    return magnitude_band


@pytest.fixture
def plugin():
    """The method, registered for this test only (the registry's table is restored afterwards)."""
    with registry.registrations():
        yield _register()


def test_register_returns_the_validating_method(plugin):
    assert plugin is get_method(NAME)
    stack = torch.randn(3, 5, 4)
    assert torch.equal(plugin(stack, low=0.0).delta, stack.sum(dim=0))
    with pytest.raises(ValueError, match="low"):
        plugin(stack, low=1.5)  # the bound declared in the annotation


def test_the_new_method_is_listed_by_specmerge_methods(plugin, capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert NAME in out and "quantile of |tau_i|" in out
    assert main(["methods", NAME]) == 0
    assert "low: float >=0 <=1 = 0.25" in capsys.readouterr().out


def test_the_new_method_is_in_the_recipe_and_its_schema(plugin, capsys):
    recipe = Recipe.from_dict({"base": "/b", "experts": ["/e1"], "method": NAME, "params": {"low": 0.5}})
    assert recipe.params == {"low": 0.5, "scale": 1.0}
    with pytest.raises(RecipeError, match="low"):
        Recipe.from_dict({"base": "/b", "experts": ["/e1"], "method": NAME, "params": {"low": 2}})
    schema = recipe_schema()
    assert NAME in schema["properties"]["method"]["enum"]
    good = {"base": "/b", "experts": ["/e1"], "method": NAME, "params": {"low": 0.5}}
    jsonschema.validate(good, schema)
    for bad_params in ({"low": 2}, {"width": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "params": bad_params}, schema)
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert NAME in printed["properties"]["method"]["enum"]


def test_the_new_method_merges_from_the_command_line(plugin, tmp_path, capsys):
    base, experts = build_family(tmp_path, "llama", n_experts=2)
    out = tmp_path / "merged"
    code = main(["merge", str(base), *map(str, experts), "-o", str(out), "-m", NAME, "-p", "low=0.5", "-q"])
    assert code == 0, capsys.readouterr().err
    merged, base_w = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    ws = [load_file(e / "model.safetensors") for e in experts]
    name = "model.layers.0.mlp.down_proj.weight"
    expected = base_w[name] + plugin(torch.stack([w[name] for w in ws]) - base_w[name], low=0.5).delta
    assert torch.equal(merged[name], expected)


def test_the_new_method_is_in_the_demo_and_the_benchmarks(plugin):
    from specmerge.demo import demo_methods
    from specmerge_bench import speed
    from specmerge_bench.accuracy.rows import method_rows

    assert list(all_methods())[-1] == NAME  # plugins come after the built-ins
    assert NAME in demo_methods()
    assert NAME in speed.entries()
    rows = {row.label: row for row in method_rows()}
    assert [c.method for c in rows[NAME].candidates] == [NAME]
    assert (plugin, Setting(NAME, "Magnitude band (test)")) in candidate_settings()
