"""Names as mergekit users type them (issue 16): method names in any case with - or _, dtype spellings such as
bf16, errors of command-line values naming the flag, and ``specmerge --version``."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from specmerge.cli import main
from specmerge.errors import RecipeError
from specmerge.methods import get_method
from specmerge.pipeline.recipe.model import Recipe, load_recipe
from specmerge.version import __version__
from tiny_models import build_family


@pytest.mark.parametrize(
    ("typed", "name"),
    [("SWUDI-A", "swudi_a"), ("swudi-a", "swudi_a"), ("TIES", "ties"), ("dare-ties", "dare_ties"),
     ("Task-Arithmetic", "task_arithmetic"), (" tsv_m ", "tsv_m"), ("swudi_a", "swudi_a")],
)  # fmt: skip
def test_method_names_as_typed(typed, name):
    assert get_method(typed).name == name
    recipe = Recipe(base="b", experts=["e"], method=typed, overrides=[{"pattern": "x*", "method": typed}])
    assert (recipe.method, recipe.overrides[0].method) == (name, name)  # held as registered


def test_unknown_upper_case_names_get_a_did_you_mean():
    with pytest.raises(ValueError, match=r"unknown method 'TIESS': did you mean 'ties'\?"):
        get_method("TIESS")
    with pytest.raises(RecipeError, match=r"unknown method 'SWUDI-AA': did you mean 'swudi_a'\?"):
        Recipe(base="b", experts=["e"], method="SWUDI-AA")


@pytest.mark.parametrize(
    ("typed", "name"),
    [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("f32", "float32"),
     ("torch.float32", "float32"), ("float16", "float16"), ("auto", "auto")],
)  # fmt: skip
def test_dtype_spellings(typed, name):
    assert Recipe(base="b", experts=["e"], dtype=typed).dtype == name


def test_compute_dtype_spellings():
    assert Recipe(base="b", experts=["e"], compute_dtype="fp64").compute_dtype == "float64"
    with pytest.raises(RecipeError, match="recipe key 'compute_dtype'"):
        Recipe(base="b", experts=["e"], compute_dtype="bf16")  # a spelling of a dtype the arithmetic does not use


def test_command_line_errors_name_the_flag_and_recipe_files_the_key(tmp_path, capsys):
    argv = ["merge", str(tmp_path / "b"), str(tmp_path / "e"), "-o", str(tmp_path / "out"), "--dtype", "bf61"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("specmerge: error: option --dtype (recipe key 'dtype'): input should be") and "'bf61'" in err
    assert len(err.splitlines()) == 1
    (tmp_path / "r.yaml").write_text("base: b\nexperts: [e]\ndtype: bf61\n")
    with pytest.raises(RecipeError, match=r"r.yaml:3: recipe key 'dtype'"):
        load_recipe(tmp_path / "r.yaml")


def test_a_merge_typed_the_mergekit_way_is_the_same_merge(tmp_path, capsys):
    base, experts = build_family(tmp_path, "llama", n_experts=2)
    common = [str(base), *map(str, experts), "--threads", "1", "-q"]
    assert main(["merge", *common, "-o", str(tmp_path / "a"), "-m", "TIES", "--dtype", "bf16"]) == 0
    assert main(["merge", *common, "-o", str(tmp_path / "b"), "-m", "ties", "--dtype", "bfloat16"]) == 0
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert "method: ties\n" in (tmp_path / "a" / "recipe.yaml").read_text()


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"specmerge {__version__}"


def test_overrides_on_the_command_line(tmp_path, capsys):
    """``--override PATTERN=RULE``: keep_base, average, merge (the recipe's method) or a method with parameters."""
    from specmerge.pipeline.recipe.values import parse_override

    assert parse_override("*.mlp.*=keep_base") == {"pattern": "*.mlp.*", "action": "keep_base"}
    assert parse_override("*=merge:scale=0.5") == {"pattern": "*", "action": "merge", "params": {"scale": 0.5}}
    assert parse_override("a.*=TIES:density=0.3,scale=[1, 2]") == {
        "pattern": "a.*", "action": "merge", "method": "TIES", "params": {"density": 0.3, "scale": [1, 2]},
    }  # fmt: skip
    recipe = Recipe(base="b", experts=["e"], method="swudi_a", overrides=["*.mlp.*=ties:density=0.3", "*norm*=average"])
    assert (recipe.overrides[0].method, recipe.overrides[0].params["density"]) == ("ties", 0.3)
    for bad, said in [
        ("*.mlp.*", "expected PATTERN=RULE"), ("=ties", "expected PATTERN=RULE"),
        ("*.mlp.*=average:scale=2", "average takes no parameters"), ("*=ties:density", "expects key=value"),
    ]:  # fmt: skip
        argv = ["merge", str(tmp_path / "b"), str(tmp_path / "e"), "-o", str(tmp_path / "o"), "--override", bad]
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


def test_an_override_typed_is_the_override_of_a_recipe(tmp_path):
    base, experts = build_family(tmp_path, "llama", n_experts=2)
    common = [str(base), *map(str, experts), "--threads", "1", "-q", "-m", "swudi_a"]
    assert main(["merge", *common, "-o", str(tmp_path / "a"), "--override", "*.mlp.*=ties:density=0.3"]) == 0
    (tmp_path / "r.yaml").write_text(
        f"base: {base}\nexperts: [{experts[0]}, {experts[1]}]\nmethod: swudi_a\n"
        "overrides:\n- pattern: '*.mlp.*'\n  method: ties\n  params: {density: 0.3}\n"
    )
    assert main(["run", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "b"), "--threads", "1", "-q"]) == 0
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
