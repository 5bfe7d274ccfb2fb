"""The method registry: schema from signatures, validation at the door, the CLI listing."""

import pytest
import torch

from specmerge import LayerResult, all_methods, get_method, register
from specmerge.cli import main

EXPECTED = {
    "swudi", "swudi_a", "closed_form", "spectral_filter", "wudi", "wudi_reference", "optmerge",
    "optmerge_lora", "weight_average", "task_arithmetic", "ties", "dare_task_arithmetic", "dare_ties",
    "tsv_m", "iso_c",
}  # fmt: skip


def test_every_method_is_registered_with_documented_parameters():
    registry = all_methods()
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
        get_method("swudi-a")


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
    for name, method in all_methods().items():
        kwargs = {"steps": 3} if "steps" in {p.name for p in method.params} else {}
        result = method(tau, **kwargs)
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
