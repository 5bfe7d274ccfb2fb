"""The method registry: schema from signatures, validation at the door, declared capabilities, the CLI listing."""

import math

import pytest
import torch

from specmerge import LayerResult, all_methods, get_method, register
from specmerge.cli import main
from specmerge.linalg.lowrank import LoraDelta
from specmerge.methods import Setting, candidate_settings, registry
from specmerge.methods.params import Positive
from tiny_models import expert_count

DISPLAY_ORDER = [
    "weight_average", "task_arithmetic", "linear", "passthrough", "model_sum", "slerp", "model_stock", "ties",
    "dare_task_arithmetic", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear",
    "tsv_m", "iso_c", "closed_form", "wudi", "wudi_reference", "optmerge", "optmerge_lora", "swudi", "swudi_a",
    "spectral_filter", "multislerp", "karcher", "nearswap", "sce", "nuslerp", "arcee_fusion", "ram", "ramplus_tl",
]  # fmt: skip
EXPECTED = set(DISPLAY_ORDER)

# The accuracy benchmark's rows before the methods declared them (specmerge_bench method_rows() at d8db22d), plus
# breadcrumbs: (label, title, method, params, grid), in display order.
R, T = (0.55, 0.65, 0.75, 0.85), (300.0, 800.0, 1300.0, 1800.0)
BENCH_ROWS = [
    ("weight_average", "Weight average", "weight_average", {}, {}),
    ("task_arithmetic", "Task arithmetic", "task_arithmetic", {}, {}),
    ("ties", "TIES (top 20 %)", "ties", {}, {}),
    ("dare_task_arithmetic", "DARE-TA (p = 0.5)", "dare_task_arithmetic", {}, {}),
    ("dare_ties", "DARE-TIES (p = 0.5)", "dare_ties", {}, {}),
    ("breadcrumbs", "Model Breadcrumbs", "breadcrumbs", {}, {}),
    ("tsv_m", "TSV-M", "tsv_m", {}, {}),
    ("iso_c", "Iso-C", "iso_c", {}, {}),
    ("closed_form", "D C⁺ (closed form)", "closed_form", {}, {}),
    ("wudi", "WUDI (Adam, 300 steps)", "wudi", {"steps": 300}, {}),
    ("optmerge", "OptMerge (300 steps)", "optmerge", {}, {}),
    ("swudi", "SWUDI (r, t on val)", "swudi", {}, {"rank_ratio": R, "t": T}),
    ("swudi_a_psqrt", "SWUDI-A (psqrt)", "swudi_a", {"rule": "psqrt"}, {}),
    ("swudi_a_gd", "SWUDI-A (Gavish–Donoho)", "swudi_a", {"rule": "gavish_donoho"}, {}),
    ("exponential", "Exponential filter, no truncation (t on val)", "spectral_filter", {"filter": "exponential"},
     {"t": T}),
]  # fmt: skip


def builtin_methods() -> dict:
    """The methods of specmerge's own family modules (other tests may register plugins in this process)."""
    return {name: m for name, m in all_methods().items() if m.fn.__module__.startswith("specmerge.methods.")}


@pytest.fixture
def scratch_registry():
    """Registrations in the test go to a copy of the registry, dropped afterwards."""
    with registry.registrations():
        yield


def test_every_method_is_registered_with_documented_parameters():
    registry = builtin_methods()
    assert set(registry) == EXPECTED
    for method in registry.values():
        assert method.summary and method.citation
        for p in method.params:
            assert p.help, f"{method.name}.{p.name} has no help"
            assert p.name not in ("tensor_name", "expert_keys")


def test_parameters_come_from_the_signature():
    swudi = get_method("swudi")
    assert [(p.name, p.default) for p in swudi.params] == [
        ("rank_ratio", 0.65),
        ("t", 1300.0),
        ("tau_init", "sum"),
        ("scale", 1.0),
    ]
    assert swudi.param("tau_init").type_name == "{sum,mean,zero}"
    assert "ceil(r * d_in)" in swudi.param("rank_ratio").help


def test_validation_coerces_cli_strings_and_fills_defaults():
    values = get_method("swudi").validate({"t": "300", "rank_ratio": "0.8"})
    assert values == {"rank_ratio": 0.8, "t": 300.0, "tau_init": "sum", "scale": 1.0}


def test_validation_errors_name_the_parameter_and_suggest():
    with pytest.raises(ValueError, match="method 'swudi' 'rank_ration': did you mean 'rank_ratio'"):
        get_method("swudi").validate({"rank_ration": 0.5})
    with pytest.raises(ValueError, match="parameter 't'"):
        get_method("swudi").validate({"t": "soon"})
    with pytest.raises(ValueError, match="parameter 'rank_ratio' input should be less than or equal to 1"):
        get_method("swudi").validate({"rank_ratio": 1.3})
    assert get_method("swudi").param("rank_ratio").type_name == "float >=0 <=1"
    with pytest.raises(ValueError, match="parameter 'rule'"):
        get_method("swudi_a").validate({"rule": "median"})
    with pytest.raises(ValueError, match="did you mean 'swudi_a'"):
        get_method("swudi-aa")  # "swudi-a" itself is swudi_a (names as typed)


def test_registration_requires_defaults_and_help():
    def no_help(task_vectors, *, x: float = 1.0) -> LayerResult:
        """Summary."""

    with pytest.raises(TypeError, match="no help text"):
        register("test_no_help", citation="none")(no_help)
    assert "test_no_help" not in all_methods()


def test_matrix_methods_reject_non_matrix_stacks():
    with pytest.raises(ValueError, match=r"needs 2-D weights.*'layer\.bias'"):
        get_method("swudi")(torch.randn(3, 8), tensor_name="layer.bias")


def test_results_carry_diagnostics_from_the_same_call():
    tau = torch.randn(4, 10, 12)
    for name, method in builtin_methods().items():
        kwargs = {"steps": 3} if "steps" in {p.name for p in method.params} else {}
        if method.needs_base:  # slerp, karcher: whole weights
            kwargs["base"] = torch.randn(10, 12)
        result = method(tau[: expert_count(method, len(tau))], **kwargs)
        assert result.delta.shape == (10, 12), name
        assert result.diagnostics["delta_norm"] == pytest.approx(float(result.delta.norm()), rel=1e-6), name
    spectral = get_method("swudi_a")(tau).diagnostics
    assert {"kept_rank", "lambda_max", "lambda_sum", "energy_kept", "numerical_rank"} <= set(spectral)


def test_cli_lists_methods_and_parameters(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED:
        assert f"\n{name}" in f"\n{out}"
    assert "rank_ratio: float >=0 <=1 = 0.65" in out
    assert main(["methods", "swudi_a"]) == 0
    assert "gavish_donoho" in capsys.readouterr().out


def test_cli_unknown_method_is_a_one_line_error(capsys):
    assert main(["methods", "swudy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'swudi'" in err


def test_display_order_is_the_catalog_order():
    assert list(all_methods())[: len(DISPLAY_ORDER)] == DISPLAY_ORDER


def test_capabilities_are_declared():
    methods = builtin_methods()
    assert {name for name, m in methods.items() if m.linear} == {"weight_average", "task_arithmetic", "linear"}
    assert {name for name, m in methods.items() if m.seeded} == {
        "dare_task_arithmetic", "dare_linear", "dare_ties", "della", "della_linear"
    }  # fmt: skip
    assert {name for name, m in methods.items() if m.factored} == {
        "weight_average", "task_arithmetic", "linear", "tsv_m", "iso_c", "closed_form", "swudi", "swudi_a",
        "spectral_filter",
    }  # fmt: skip
    assert {name for name, m in methods.items() if m.weighting == "any"} == {
        "weight_average", "task_arithmetic", "linear", "breadcrumbs", "dare_task_arithmetic", "dare_linear",
        "della_linear", "multislerp", "nuslerp", "model_sum",
    }  # fmt: skip
    assert {name for name, m in methods.items() if m.weighting == "positive"} == {
        "ties",
        "dare_ties",
        "della",
        "breadcrumbs_ties",
    }
    needs_base = {"slerp", "karcher", "arcee_fusion", "multislerp", "nuslerp", "model_sum"}
    assert {name for name, m in methods.items() if m.needs_base} == needs_base
    assert {name for name, m in methods.items() if not m.featured} == {
        "wudi_reference", "optmerge_lora", "spectral_filter", "dare_linear", "slerp", "linear", "multislerp",
        "karcher", "nearswap", "sce", "nuslerp", "arcee_fusion", "breadcrumbs_ties", "ram", "ramplus_tl",
        "passthrough", "model_sum",
    }  # fmt: skip
    assert {name: m.variant_of for name, m in methods.items() if m.variant_of} == {
        "dare_ties": "dare_task_arithmetic", "dare_linear": "dare_task_arithmetic", "wudi_reference": "wudi",
        "optmerge_lora": "optmerge", "della_linear": "della", "breadcrumbs_ties": "breadcrumbs",
    }  # fmt: skip
    for name, m in methods.items():
        assert m.title, name
        if m.variant_of:  # a variant shares its implementation, with declared differences only
            of = methods[m.variant_of]
            defaults = {p.name: p.default for p in m.params} != {p.name: p.default for p in of.params}
            assert m.fn is of.fn and (m.fixed != of.fixed or defaults)


def test_linear_coefficient():
    assert get_method("weight_average").linear_coefficient({}, 4) == (0.25,) * 4
    assert get_method("weight_average").linear_coefficient({"scale": "0.5"}, 4) == (0.125,) * 4  # validated, coerced
    assert get_method("task_arithmetic").linear_coefficient({}, 4) == (0.3,) * 4
    assert get_method("task_arithmetic").linear_coefficient({}, 0) is None
    assert get_method("ties").linear_coefficient({}, 4) is None
    # with weights 1, 3: hand-computed
    assert get_method("weight_average").linear_coefficient({"scale": 2.0}, 2, [1.0, 3.0]) == (0.5, 1.5)
    assert get_method("task_arithmetic").linear_coefficient({"scale": 0.5}, 2, [1.0, 3.0]) == (0.5, 1.5)
    assert get_method("linear").linear_coefficient({}, 2, [1.0, 3.0]) == (0.25, 0.75)
    assert get_method("linear").linear_coefficient({"normalize": False}, 2, [1.0, 3.0]) == (1.0, 3.0)
    tau = torch.randn(3, 5, 4, dtype=torch.float64)
    for name, params in (("weight_average", {"scale": 0.7}), ("task_arithmetic", {"scale": 0.7}), ("linear", {})):
        for weights in (None, [0.5, 2.0, -1.0]):
            c = get_method(name).linear_coefficient(params, 3, weights)
            expected = sum(c_i * tau_i for c_i, tau_i in zip(c, tau, strict=True))
            torch.testing.assert_close(get_method(name)(tau, weights=weights, **params).delta, expected)


def test_merge_factored_is_only_for_factored_methods():
    deltas = [LoraDelta(torch.randn(6, 2), torch.randn(2, 5)) for _ in range(3)]
    for name, method in builtin_methods().items():
        if not method.factored:
            with pytest.raises(ValueError, match=f"method '{name}' cannot merge factored"):
                method.merge_factored(deltas)
    result = get_method("task_arithmetic").merge_factored(deltas, scale=1.0)
    torch.testing.assert_close(result.dense(), sum(d.dense() for d in deltas))


def test_settings_reproduce_the_benchmark_rows():
    builtin = [(m, s) for m, s in candidate_settings() if m.name in builtin_methods()]
    rows = [(s.label, s.title, m.name, dict(s.params), dict(s.grid)) for m, s in builtin]
    assert rows == BENCH_ROWS
    assert len({label for label, *_ in rows}) == len(rows)
    swudi = next(s for m, s in builtin if s.label == "swudi")
    assert swudi.candidates()[:2] == ({"rank_ratio": 0.55, "t": 300.0}, {"rank_ratio": 0.55, "t": 800.0})
    for method, setting in builtin:
        assert len(setting.candidates()) == math.prod(len(values) for values in setting.grid.values())
        for params in setting.candidates():
            method.validate(params)


def test_register_returns_the_validating_method(scratch_registry):
    @register("test_scaled_sum", citation="test only", needs_matrix=False, settings=[Setting("scaled", "Scaled")])
    def scaled_sum(task_vectors, *, scale: Positive = 1.0) -> LayerResult:
        """Scaled sum, for the test.

        Args:
            scale: s > 0.
        """
        return LayerResult(scale * task_vectors.sum(dim=0))

    assert scaled_sum is get_method("test_scaled_sum")
    assert torch.equal(scaled_sum(torch.ones(2, 3), scale="2").delta, torch.full((3,), 4.0))
    with pytest.raises(ValueError, match="parameter 'scale' input should be greater than 0"):
        scaled_sum(torch.ones(2, 3), scale=0)
    assert list(all_methods())[-1] == "test_scaled_sum"  # a plugin is listed after the built-ins
    assert candidate_settings()[-1] == (scaled_sum, Setting("scaled", "Scaled"))
    assert scaled_sum.featured and not scaled_sum.linear and not scaled_sum.factored and not scaled_sum.seeded


def test_capabilities_must_agree_with_the_signature(scratch_registry):
    def seeded(task_vectors, *, tensor_name: str = "", expert_keys=None) -> LayerResult:
        """Uses the tensor name."""

    with pytest.raises(TypeError, match="declare seeded=True"):
        register("test_undeclared_seed", citation="none")(seeded)
    with pytest.raises(TypeError, match="declared seeded"):
        register("test_missing_seed", citation="none", seeded=True)(lambda task_vectors: None)

    def cores(task_vectors, *, full_shape=None) -> LayerResult:
        """Uses the full shape."""

    with pytest.raises(TypeError, match="declare factored=True"):
        register("test_undeclared_factored", citation="none")(cores)
    with pytest.raises(TypeError, match="setting 'bad' sets unknown"):
        register("test_bad_setting", citation="none", factored=True, settings=[Setting("bad", "Bad", {"t": 1})])(cores)
    assert not {"test_undeclared_seed", "test_missing_seed", "test_undeclared_factored"} & set(all_methods())


def test_methods_pickle_by_name():
    import pickle

    for method in builtin_methods().values():
        assert pickle.loads(pickle.dumps(method)) is method
