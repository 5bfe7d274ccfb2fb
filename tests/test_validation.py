"""Hostile and messy inputs refused before anything is written (issue 13, items 7-10, 12-14).

Each test builds its small checkpoints, adapters or recipes in tmp_path: NaN and Inf in experts, bases and
LoRA factors (item 7), non-finite parameters (8), command-line values against the same values in a recipe
(9), experts that change a tensor's kind of number (10), adapter configs that contradict their factors (12),
overrides that earlier patterns shadow (13), and that the command line answers each with one line (14).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specmerge.cli import main
from specmerge.diagnostics.options import InspectOptions
from specmerge.diagnostics.run import inspect_model
from specmerge.errors import NonFiniteError, SpecmergeError
from specmerge.io.formats.peft import AdapterConfigWarning, AdapterError, open_adapter
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.views import experts as experts_module
from specmerge.io.views.task_vectors import Dense, LowRank
from specmerge.linalg.lowrank import LoraDelta
from specmerge.methods import all_methods, get_method
from specmerge.pipeline.plan.rules import PlanError, TensorPlan, make_plan

sys.path.insert(0, str(Path(__file__).parent))
from specmerge.pipeline.recipe.model import Recipe, RecipeError, load_recipe
from specmerge.pipeline.run import api, work
from specmerge.pipeline.run.compute import merged_delta
from specmerge.pipeline.run.finite import NonFiniteInput
from tiny_models import expert_count

WEIGHT = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"
SHAPES = {EMBED: (16, 6), WEIGHT: (5, 6), NORM: (6,)}


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def family(root: Path, n: int = 3, poison: dict | None = None, dtype=torch.float32) -> tuple[Path, list[Path]]:
    """A base and ``n`` experts (folders with model.safetensors); ``poison`` maps (who, tensor) to {index: value},
    ``who`` being "base" or an expert number."""
    g = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    folders = {"base": base}
    for i in range(n):
        folders[i] = {name: w + 0.1 * torch.randn(w.shape, generator=g) for name, w in base.items()}
    for (who, name), entries in (poison or {}).items():
        flat = folders[who][name].view(-1)
        for index, value in entries.items():
            flat[index] = value
    base_path = _save(root / "base", {k: v.to(dtype) for k, v in base.items()})
    experts = [_save(root / f"e{i}", {k: v.to(dtype) for k, v in folders[i].items()}) for i in range(n)]
    return base_path, experts


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit 2 with one line ``specmerge: error: ...`` on stderr and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specmerge: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------------------
# Item 7: NaN and Inf in inputs


QUICK = {"wudi": {"steps": 3}, "wudi_reference": {"steps": 3}, "optmerge": {"steps": 3}, "optmerge_lora": {"steps": 3}}


@pytest.mark.parametrize("method", sorted(set(all_methods()) - {"passthrough"}))  # passthrough: no experts to read
def test_nonfinite_expert_is_refused_by_every_method(tmp_path, method):
    nan_inf = {7: float("nan"), 20: float("inf")}
    base, experts = family(tmp_path, poison={(1, WEIGHT): nan_inf})
    n = expert_count(get_method(method), len(experts))
    given = experts[:n] if n > 1 else experts[1:2]  # the poisoned expert (index 1) among them
    with pytest.raises(NonFiniteError) as caught:
        api.merge(base, given, tmp_path / "out", method=method, params=QUICK.get(method), progress=False)
    message = str(caught.value)
    assert f"'{WEIGHT}'" in message and f"expert '{experts[1]}'" in message and "2 of 30 entries" in message
    assert str(experts[0]) not in message and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["task_arithmetic", "weight_average"])
def test_nonfinite_is_detected_at_scale_zero(tmp_path, method):
    base, experts = family(tmp_path, poison={(2, NORM): {3: float("-inf")}})
    with pytest.raises(NonFiniteError, match=rf"1 of 6 entries in expert '{experts[2]}'"):
        api.merge(base, experts, tmp_path / "out", method=method, params={"scale": 0.0}, progress=False)


@pytest.mark.parametrize(
    ("tensor", "overrides", "method"),
    [
        (WEIGHT, [], "swudi_a"),  # merge: the stack route
        (WEIGHT, [], "task_arithmetic"),  # merge: the chunked linear route
        (EMBED, [], "swudi_a"),  # average of an embedding
        (NORM, [{"pattern": "*layernorm*", "action": "keep_base"}], "swudi_a"),  # keep_base reads the base only
        (EMBED, [{"pattern": "*embed*", "action": "keep_base"}], "task_arithmetic"),  # keep_base, row blocks
    ],
)
def test_nonfinite_base_is_refused_for_every_action(tmp_path, tensor, overrides, method):
    base, experts = family(tmp_path, poison={("base", tensor): {0: float("nan")}})
    with pytest.raises(NonFiniteError, match=rf"'{tensor}' holds NaN or Inf: 1 of \d+ entries in the base '{base}'"):
        api.merge(base, experts, tmp_path / "out", method=method, overrides=overrides, progress=False)


def test_nonfinite_in_row_blocks_is_counted_over_the_whole_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(work, "BLOCK_BYTES", 2 * 6 * 4)  # two rows of the 16 x 6 embedding per block
    monkeypatch.setattr(experts_module, "NONFINITE_BLOCK_BYTES", 2 * 6 * 4)  # and counted in blocks too
    poison = {(0, EMBED): {95: float("inf")}, (2, EMBED): {1: float("nan"), 50: float("nan"), 94: float("nan")}}
    base, experts = family(tmp_path, poison=poison)
    with pytest.raises(NonFiniteError) as caught:
        api.merge(base, experts, tmp_path / "out", method="task_arithmetic", progress=False)
    message = str(caught.value)
    assert f"1 of 96 entries in expert '{experts[0]}'" in message
    assert f"3 of 96 entries in expert '{experts[2]}'" in message


def test_overflowing_squares_of_finite_inputs_are_not_blamed_on_them(tmp_path):
    base, experts = family(tmp_path, n=2, poison={(0, NORM): {2: 1e20}})  # delta^2 = 1e40: beyond float32
    report = api.merge(base, experts, tmp_path / "out", method="task_arithmetic", progress=False)
    norm = next(t for t in report["tensors"] if t["name"] == NORM)["diagnostics"]["delta_norm"]
    assert math.isfinite(norm) and norm == pytest.approx(0.3 * 1e20, rel=1e-6)


def test_finite_inputs_that_overflow_the_compute_dtype_are_refused(tmp_path):
    base, experts = family(tmp_path, n=2, poison={(0, NORM): {2: 3e38}, (1, NORM): {2: 3e38}})
    with pytest.raises(NonFiniteError, match=f"'{NORM}': its inputs are finite but the merge overflows"):
        api.merge(base, experts, tmp_path / "out", method="task_arithmetic", params={"scale": 1.0}, progress=False)
    api.merge(base, experts, tmp_path / "ok", method="task_arithmetic", compute_dtype="float64", progress=False)


def test_device_routes_check_their_inputs():
    """The stack and running-sum routes (GPUs, adapters among full experts) check what they read."""
    base = torch.zeros(4, 3)
    items = [Dense(torch.ones(4, 3)), Dense(torch.ones(4, 3))]
    items[1].weight[2, 1] = float("nan")
    for entry in (_entry("merge", "task_arithmetic", {"scale": 0.3}), _entry("average", None, {"scale": 1.0})):
        with pytest.raises(NonFiniteInput) as caught:
            merged_delta(entry, base, items, device=torch.device("cpu"), compute_dtype=torch.float32)
        assert caught.value.counts == {1: 1}
    lora = LowRank(LoraDelta(torch.full((4, 1), float("inf")), torch.ones(1, 3)))
    with pytest.raises(NonFiniteInput) as caught:
        merged_delta(
            _entry("average", None, {"scale": 1.0}),
            base,
            [items[0], lora],
            device=torch.device("cpu"),
            compute_dtype=torch.float32,
        )
    assert caught.value.counts == {1: 4}


def _entry(action, method, params):
    return TensorPlan("w", (4, 3), torch.float32, action, method, params, "test")


# LoRA adapters written by hand: base q_proj is 5 x 6.


COMPLETE = {"use_rslora": False, "fan_in_fan_out": False}  # no notice about PEFT defaults


def write_adapter(folder: Path, rank: int = 2, seed: int = 0, config: object = None, poison: float | None = None):
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    A, B = torch.randn(rank, 6, generator=g), torch.randn(5, rank, generator=g)
    if poison is not None:
        B[1, 0] = poison
    folder.mkdir(parents=True)
    save_file({f"{prefix}.lora_A.weight": A, f"{prefix}.lora_B.weight": B}, str(folder / "adapter_model.safetensors"))
    if config is None:
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 4, "target_modules": ["q_proj"], **COMPLETE}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("route", ["model", "lora", "inspect", "cli", "cli-inspect"])
def test_nonfinite_lora_factors_are_refused_before_any_svd(tmp_path, capsys, route):
    base, _ = family(tmp_path, n=0)
    adapters = [write_adapter(tmp_path / "a0"), write_adapter(tmp_path / "a1", seed=1, poison=float("nan"))]
    out = tmp_path / "out"
    expected = rf"'{WEIGHT}' holds NaN or Inf: 1 of the 22 entries of the LoRA factors of expert '{adapters[1]}'"
    if route.startswith("cli"):
        command = ["inspect", "--no-plots", "--no-wudi"] if route == "cli-inspect" else ["merge"]
        err = one_line_error(capsys, [*command, str(base), *map(str, adapters), "-o", str(out), "-q"])
        assert "NaN or Inf" in err and str(adapters[1]) in err
    elif route == "inspect":
        with pytest.raises(NonFiniteError, match=expected):
            inspect_model(base, adapters, out, progress=False, plots=False, wudi=False)
    else:
        with pytest.raises(NonFiniteError, match=expected):
            lora = {"output_format": "lora", "max_rank": 2} if route == "lora" else {}
            api.merge(base, adapters, out, method="swudi_a", progress=False, **lora)
    assert not out.exists()


def test_inspect_refuses_nonfinite_dense_experts(tmp_path):
    base, experts = family(tmp_path, poison={(2, WEIGHT): {0: float("inf")}})
    with pytest.raises(NonFiniteError, match=rf"1 of 30 entries in expert '{experts[2]}'"):
        inspect_model(base, experts, tmp_path / "out", progress=False, plots=False, wudi=False)


# ---------------------------------------------------------------------------------------------------------
# Item 8: non-finite parameters


def test_non_finite_float_parameters_are_refused_by_every_method():
    for method in all_methods().values():
        for param in method.params:
            if param.type_name.split()[0] != "float":
                continue
            for value in (float("nan"), "nan", "NaN", float("-inf"), "-inf"):
                with pytest.raises(ValueError, match=f"'{param.name}'"):
                    method.validate({param.name: value})
            allows_inf = (method.name, param.name) == ("swudi", "t")  # "inf for none", documented
            for value in (float("inf"), "inf", "1e400"):
                if allows_inf:
                    assert method.validate({param.name: value})[param.name] == math.inf
                else:
                    with pytest.raises(ValueError, match=f"parameter '{param.name}'"):
                        method.validate({param.name: value})


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "1e400"])
def test_non_finite_scale_is_refused_in_recipes_and_overrides(tmp_path, value):
    text = f"base: b\nexperts: [e]\nmethod: task_arithmetic\nparams:\n  scale: {value}\n"
    with pytest.raises(RecipeError, match="scale"):
        load_recipe(_write(tmp_path / "r.yaml", text))
    text = f"base: b\nexperts: [e]\noverrides:\n- pattern: '*'\n  method: ties\n  params: {{scale: {value}}}\n"
    with pytest.raises(RecipeError, match="override '\\*': method 'ties': parameter 'scale'"):
        load_recipe(_write(tmp_path / "o.yaml", text))


def test_swudi_t_accepts_inf_as_no_filter_but_not_nan():
    assert Recipe(base="b", experts=["e"], method="swudi", params={"t": "inf"}).params["t"] == math.inf
    assert Recipe(base="b", experts=["e"], method="swudi", params={"t": float("inf")}).params["t"] == math.inf
    with pytest.raises(RecipeError, match="'t'"):
        Recipe(base="b", experts=["e"], method="swudi", params={"t": float("nan")})
    assert InspectOptions(t=math.inf).t == math.inf
    with pytest.raises(RecipeError, match="inspect option 't'"):
        InspectOptions(t=float("nan"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------------
# Item 9: the command line accepts exactly what a recipe accepts

CLI_TABLE = [
    ("--max-rank", "max_rank", ["0", "1", "4", "-1", "1.0", "1.5", "", "null", "abc", "true", ".inf", ".nan", "0x10"]),
    ("--shard-size", "shard_size", ["", "0", "1", "5GB", "1.5GiB", "-1MB", "nan GB", "inf", ".inf", "5e9", "5.0e9"]),
    ("--shard-size", "shard_size", ["100", "1 kb", "true", "[1", "null", "5.5"]),
    ("--dtype", "dtype", ["", "auto", "float16", "bfloat16", "int8", "null", "0"]),
    ("--device", "device", ["", "cpu", "cuda:0", "cuda:x", "tpu", "auto", "0", "null"]),
    ("--output-format", "output_format", ["", "model", "lora", "x", "null"]),
    ("-p", "params", ["scale=0.5", "scale=nan", "scale=.nan", "scale=.inf", "scale=1e400", "scale=", "scale=[1"]),
    ("-p", "params", ["scale=true", "scale=null", "scale='0.5'", "scale=1/2", "density=0.5"]),
]


@pytest.mark.parametrize(("flag", "key", "values"), CLI_TABLE)
def test_cli_and_recipe_accept_the_same_values(tmp_path, monkeypatch, capsys, flag, key, values):
    seen = []

    def fake_run_recipe(recipe, output, **kwargs):
        seen.append(recipe)
        return {"tensors": [], "method": recipe.method, "seconds": 0.0}

    monkeypatch.setattr(api, "run_recipe", fake_run_recipe)
    lora = ["--output-format", "lora"] if key == "max_rank" else []
    for value in values:
        seen.clear()
        argv = ["merge", "b", "e", "-o", str(tmp_path / "out"), "-m", "task_arithmetic", *lora, f"{flag}={value}"]
        cli_ok = main(argv) == 0
        capsys.readouterr()
        lines = ["base: b", "experts: [e]", "method: task_arithmetic"] + (["output_format: lora"] if lora else [])
        if key == "params":
            name, _, text = value.partition("=")
            lines += ["params:", f"  {name}: {text or chr(39) * 2}"]
        else:
            lines.append(f"{key}: {value or chr(39) * 2}")
        try:
            recipe = load_recipe(_write(tmp_path / "r.yaml", "\n".join(lines) + "\n"))
        except RecipeError:
            recipe = None
        assert cli_ok == (recipe is not None), (flag, value, cli_ok)
        if recipe is not None:
            assert getattr(seen[0], key) == getattr(recipe, key), (flag, value)


def test_falsy_cli_values_are_not_dropped(tmp_path, capsys):
    argv = ["merge", "b", "e", "-o", str(tmp_path / "out"), "--output-format", "lora", "--max-rank", "0"]
    assert "max_rank" in one_line_error(capsys, argv)
    assert "shard_size ''" in one_line_error(capsys, ["merge", "b", "e", "-o", str(tmp_path / "o"), "--shard-size="])
    err = one_line_error(capsys, ["merge", "b", "e", "-o", str(tmp_path / "o"), "-p", "scale=[1"])
    assert "--param scale= '[1': not a valid value" in err


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (["--rank-ratio", "nan"], "inspect option 'rank_ratio' (--rank-ratio): input should be a finite number"),
        (["--rank-ratio", "2"], "inspect option 'rank_ratio' (--rank-ratio): input should be less than or equal"),
        (["--wudi-steps", "0"], "inspect option 'wudi_steps' (--wudi-steps)"),
        (["--adam-lr", "inf"], "inspect option 'adam_lr' (--adam-lr): input should be a finite number"),
        (["--device", "tpu"], "device 'tpu' is not one of cpu"),
        (["--device", ""], "device '' is not one of cpu"),
        (["--layers", "("], "--layers '(' is not a regular expression"),
        (["-m", "swudi:t=[1"], "method 'swudi:t=[1': t= '[1': not a valid value"),
        (["-m", "swudi:t=nan"], "parameter 't' must be a number, not NaN"),
    ],
)
def test_inspect_option_errors_are_one_line(tmp_path, capsys, option, expected):
    err = one_line_error(capsys, ["inspect", "b", "e", "-o", str(tmp_path / "out"), *option])
    assert expected in err


def test_unknown_inspect_option_from_python_is_one_line(tmp_path):
    with pytest.raises(RecipeError, match="unknown inspect option 'rank_ration': did you mean 'rank_ratio'"):
        inspect_model("b", ["e"], tmp_path / "out", rank_ration=0.5)


# ---------------------------------------------------------------------------------------------------------
# Item 10: experts may change precision, not the kind of number


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_expert_changing_the_kind_of_number_is_refused(tmp_path, dtype):
    """An integer weight in the widths quantized codes use is refused as such when opened (issue 48); others
    by the plan."""
    base, experts = family(tmp_path, n=2)
    tensors = {name: torch.ones(shape) for name, shape in SHAPES.items()}
    tensors[WEIGHT] = tensors[WEIGHT].to(dtype)
    _save(tmp_path / "bad", tensors)
    if dtype in (torch.int32, torch.uint8):
        expected = rf"tensor '{WEIGHT}' is an integer \({dtype}\) weight, but no quantization_config says"
    else:
        expected = rf"tensor '{WEIGHT}' is {dtype} \(\w+\) in expert '.*bad' but torch.float32"
    with pytest.raises(SpecmergeError, match=expected):
        api.merge(base, [experts[0], tmp_path / "bad"], tmp_path / "out", method="task_arithmetic", progress=False)
    assert not (tmp_path / "out").exists()


def test_expert_changing_precision_is_accepted(tmp_path):
    base, experts = family(tmp_path, n=2)
    family(tmp_path / "half", n=2, dtype=torch.bfloat16)
    mixed = [experts[0], tmp_path / "half" / "e1"]
    report = api.merge(base, mixed, tmp_path / "out", method="task_arithmetic", progress=False)
    assert len(report["tensors"]) == len(SHAPES)


def test_kind_of_number_is_checked_where_the_expert_is_read():
    infos = {"w.weight": TensorInfo("w.weight", (2, 2), torch.float32), "ids": TensorInfo("ids", (4,), torch.int64)}
    expert = {"w.weight": TensorInfo("w.weight", (2, 2), torch.float16), "ids": TensorInfo("ids", (4,), torch.float32)}
    plan = make_plan(Recipe(base="b", experts=["e"]), infos, [expert], ["e"])  # ids: kept, not read from experts
    assert {e.name: e.action for e in plan} == {"w.weight": "merge", "ids": "keep_base"}
    expert["w.weight"] = TensorInfo("w.weight", (2, 2), torch.complex64)  # safetensors cannot even store it
    with pytest.raises(PlanError, match=r"torch\.complex64 \(complex\) in expert 'e'"):
        make_plan(Recipe(base="b", experts=["e"]), infos, [expert], ["e"])


# ---------------------------------------------------------------------------------------------------------
# Item 12: adapter configs that contradict their factors


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"r": 16}, r"module 'model.layers.0.self_attn.q_proj' has rank-4 factors .* but 'r' says rank 16"),
        ({"r": 0}, r"'r' must be a whole number >= 1 .* got 0"),
        ({"r": 4.0}, r"'r' must be a whole number"),
        ({"r": True}, r"'r' must be a whole number"),
        ({"rank_pattern": {"q_proj": 2}}, r"has rank-4 factors .* but its rank_pattern entry says rank 2"),
        ({"rank_pattern": {"(": 4}}, r"rank_pattern key '\(' is not a regular expression"),
        ({"rank_pattern": [4]}, r"'rank_pattern' must map module-name patterns to values"),
        ({"lora_alpha": 0}, r"'lora_alpha' must be a positive finite number"),
        ({"lora_alpha": -8}, r"'lora_alpha' must be a positive finite number"),
        ({"lora_alpha": float("nan")}, r"'lora_alpha' must be a positive finite number"),
        ({"lora_alpha": float("inf")}, r"'lora_alpha' must be a positive finite number"),
        ({"lora_alpha": "8"}, r"'lora_alpha' must be a positive finite number"),
        ({"lora_alpha": 10**400}, r"'lora_alpha' must be a positive finite number"),
        ({"rank_pattern": []}, r"'rank_pattern' must map module-name patterns to values"),
        ({"alpha_pattern": {"q_proj": 0}}, r"alpha_pattern\['q_proj'\] must be a positive finite number"),
        ({"use_rslora": "yes"}, r"'use_rslora' must be true or false"),
        ({"fan_in_fan_out": 1}, r"'fan_in_fan_out' must be true or false"),
        ({"target_modules": ["v_proj"]}, r"module 'model.layers.0.self_attn.q_proj', which target_modules"),
        ({"target_modules": 3}, r"'target_modules' must be a list of module names or a pattern"),
    ],
)
def test_adapter_config_contradicting_its_factors_is_refused(tmp_path, change, expected):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **COMPLETE, **change}
    write_adapter(tmp_path / "a", rank=4, config=config)
    with pytest.raises(AdapterError, match=expected) as caught:
        open_adapter(tmp_path / "a")
    assert "\n" not in str(caught.value) and "adapter_config.json" in str(caught.value)


def test_adapter_config_missing_keys_get_peft_defaults_with_a_notice(tmp_path):
    write_adapter(tmp_path / "a", rank=8, config={"peft_type": "LORA", "target_modules": ["q_proj"]})
    with pytest.warns(AdapterConfigWarning, match=r"has no r, lora_alpha, use_rslora, fan_in_fan_out: using PEFT"):
        adapter = open_adapter(tmp_path / "a")
    with adapter:
        (module,) = adapter.modules().values()
        assert (module.rank, module.alpha, module.scale, module.transposed) == (8, 8.0, 1.0, False)
    write_adapter(tmp_path / "b", rank=4, config={"peft_type": "LORA", "lora_alpha": 8})
    with (
        pytest.raises(AdapterError, match=r"but 'r' \(missing: PEFT's default\) says rank 8"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", AdapterConfigWarning)
        open_adapter(tmp_path / "b")


def test_adapter_without_lora_alpha_merges_with_a_one_line_notice(tmp_path, capsys):
    base, _ = family(tmp_path, n=0)
    config = {"peft_type": "LORA", "r": 2, "use_rslora": False, "fan_in_fan_out": False}
    adapters = [write_adapter(tmp_path / f"a{i}", seed=i, config=config) for i in range(2)]
    argv = ["merge", str(base), *map(str, adapters), "-o", str(tmp_path / "out"), "-q", "-m", "task_arithmetic"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    notices = [line for line in err if line.startswith("specmerge: warning:")]
    assert len(notices) == 2 and all("has no lora_alpha: using PEFT's default lora_alpha = 8" in n for n in notices)


@pytest.mark.parametrize("text", ['[{"peft_type": "LORA"}]', '"LORA"', "3", "null"])
def test_adapter_config_that_is_not_an_object_is_one_line(tmp_path, capsys, text):
    base, _ = family(tmp_path, n=0)
    adapter = write_adapter(tmp_path / "a")
    (adapter / "adapter_config.json").write_text(text)
    err = one_line_error(capsys, ["merge", str(base), str(adapter), "-o", str(tmp_path / "out")])
    assert "a PEFT adapter config is a JSON object" in err


def test_adapter_factors_that_are_not_floating_point_are_refused(tmp_path):
    folder = write_adapter(tmp_path / "a")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    factors = {
        f"{prefix}.lora_A.weight": torch.ones(2, 6, dtype=torch.int32),
        f"{prefix}.lora_B.weight": torch.ones(5, 2),
    }
    save_file(factors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"lora_A\.weight' is torch\.int32, not floating point"):
        open_adapter(folder)


# ---------------------------------------------------------------------------------------------------------
# Item 13: overrides that are never applied


def _infos():
    names = {"a.mlp.up.weight": torch.float32, "a.mlp.down.weight": torch.float32, "a.ids": torch.int64}
    return {name: TensorInfo(name, (4,) if dtype == torch.int64 else (3, 3), dtype) for name, dtype in names.items()}


def _plan(overrides):
    recipe = Recipe(base="b", experts=["e"], method="task_arithmetic", overrides=overrides)
    infos = _infos()
    return make_plan(recipe, infos, [infos], ["e"])


def test_override_shadowed_by_earlier_patterns_is_refused():
    shadowed = [{"pattern": "*.mlp.*", "action": "average"}, {"pattern": "*.up.weight", "action": "keep_base"}]
    with pytest.raises(
        PlanError, match=r"override '\*\.up\.weight' is never applied: .* earlier override '\*\.mlp\.\*'"
    ):
        _plan(shadowed)
    several = [
        {"pattern": "*.up.*", "action": "average"},
        {"pattern": "*.down.*", "action": "keep_base"},
        {"pattern": "*.weight", "method": "ties"},  # every tensor it matches is taken by one of the two above
    ]
    with pytest.raises(PlanError, match=r"override '\*\.weight' is never applied"):
        _plan(several)
    partly = [{"pattern": "*.up.*", "action": "average"}, {"pattern": "*.weight", "method": "ties"}]
    plan = {e.name: e for e in _plan(partly)}
    assert plan["a.mlp.down.weight"].method == "ties" and plan["a.mlp.up.weight"].action == "average"


def test_override_matching_only_integer_tensors():
    assert _plan([{"pattern": "*.ids", "action": "keep_base"}])[2].action == "keep_base"  # harmless: it happens
    with pytest.raises(PlanError, match=r"override '\*\.ids' matches only tensors that are not floating point"):
        _plan([{"pattern": "*.ids", "action": "average"}])


def test_every_error_here_is_a_specmerge_error():
    for error in (NonFiniteError, PlanError, RecipeError, AdapterError):
        assert issubclass(error, SpecmergeError)
    assert get_method("swudi").param("t").type_name == "float >=0 or inf"
