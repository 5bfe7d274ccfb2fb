"""Spectral diagnostics: known answers on synthetic spectra, GD = Landweber, and `specmerge inspect` end to end."""

from __future__ import annotations

import csv
import json
import math

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import specmerge
from conftest import low_rank_plus_noise
from specmerge import get_method
from specmerge.cli import main
from specmerge.diagnostics import optimizer_filter
from specmerge.diagnostics import statistics as diagnostics
from specmerge.diagnostics.method_specs import default_methods, parse_method_spec
from specmerge.diagnostics.run import inspect_model
from specmerge.linalg.filters import Landweber, TopK
from specmerge.linalg.quadratic import initial_point, normal_equation
from specmerge.linalg.solve import filtered_solve
from specmerge.linalg.spectrum import Spectrum, decompose
from specmerge.methods import LayerResult, all_methods, registry
from tiny_models import build_family, llama_config


def spectrum_of(eigenvalues: list[float], n_rows: int, n_cols: int) -> Spectrum:
    """A Spectrum with given eigenvalues (eigenvectors unused by the rank rules)."""
    lam = torch.tensor(eigenvalues, dtype=torch.float64)
    rank = int((lam > 0).sum())
    return Spectrum(lam, torch.zeros(n_cols, rank, dtype=torch.float64), n_rows, n_cols, 0.0)


# ---------------------------------------------------------------------------------------------
# Statistics with known answers


def test_flat_spectrum_every_effective_rank_is_d():
    lam = torch.full((40,), 0.2, dtype=torch.float64)
    ranks = diagnostics.effective_ranks(lam)
    assert ranks == pytest.approx({"participation": 40, "psqrt": 40, "entropy": 40}, rel=1e-12)
    ratios = diagnostics.spectrum_ratios(lam, 40)
    assert ratios["max_over_median"] == pytest.approx(1.0) and ratios["l90_over_max"] == pytest.approx(1.0)


def test_planted_rank_k_effective_ranks_and_cuts():
    """K equal eigenvalues plus a small tail: effective ranks ~ K, psqrt = K + tail effect, GD = K exactly."""
    k, d = 6, 60
    lam = torch.cat([torch.full((k,), 1.0), torch.full((d - k,), 1e-6)]).double()
    ranks = diagnostics.effective_ranks(lam)
    assert ranks["participation"] == pytest.approx(k, rel=1e-3)
    head, tail = 1 / (k + (d - k) * 1e-3), 1e-3 / (k + (d - k) * 1e-3)  # sigma / sum sigma
    entropy = -k * head * math.log(head) - (d - k) * tail * math.log(tail)
    assert ranks["entropy"] == pytest.approx(math.exp(entropy), rel=1e-9)
    assert k < ranks["entropy"] < k + 0.5
    # psqrt on sigma: (k + 54e-3)^2 / (k + 54e-6) = 6.11, so K = 7: the tail of sigma counts, as in the paper
    expected_psqrt = (k + (d - k) * 1e-3) ** 2 / (k + (d - k) * 1e-6)
    assert ranks["psqrt"] == pytest.approx(expected_psqrt, rel=1e-9)
    cuts = diagnostics.kept_ranks(spectrum_of(lam.tolist(), 8 * d, d), rank_ratio=0.5)
    expected_participation = (k + (d - k) * 1e-6) ** 2 / (k + (d - k) * 1e-12)  # 6.0001: rounds up to 7
    assert cuts == {
        "fixed": 30,
        "psqrt": math.ceil(expected_psqrt),
        "gavish_donoho": k,  # the tail is the noise bulk: exactly the planted spikes
        "participation": math.ceil(expected_participation),
    }


def test_exact_rank_k_psqrt_is_k_and_structural_zeros_count_in_ratios():
    k, d = 5, 50
    lam = torch.tensor([2.0] * k + [0.0] * (d - k), dtype=torch.float64)
    assert diagnostics.kept_ranks(spectrum_of(lam.tolist(), 4 * d, d), 0.65)["psqrt"] == k
    ratios = diagnostics.spectrum_ratios(lam[:k], d)  # only the non-zero ones given: zeros appended to d_in
    assert ratios["lambda_median"] == 0 and ratios["max_over_median"] == math.inf
    assert ratios["l90_over_max"] == 0.0


def test_known_lambda_ratios():
    lam = torch.arange(100, 0, -1, dtype=torch.float64)  # 100, 99, ..., 1
    ratios = diagnostics.spectrum_ratios(lam, 100)
    assert ratios["lambda_median"] == pytest.approx(50.5)  # mean of the 50th and 51st
    assert ratios["max_over_median"] == pytest.approx(100 / 50.5)
    assert ratios["lambda_90"] == 11.0  # lambda_ceil(0.9 * 100) = lambda_90 = 11
    assert ratios["l90_over_max"] == pytest.approx(0.11)


def test_summary_over_layers_matches_hand_computation():
    rows = [
        {"n_nonzero": 2, "d_in": 10, "rel_norms": [0.01, 0.03], "r_eff_participation": 2.0, "max_over_median": 5.0,
         "condition_on_range": 9.0,
         "l90_over_max": 0.1, "lambda_max": 1.0, **{f"K_{r}": 4 for r in diagnostics.RULES},
         **{f"share_{r}": 0.9 for r in diagnostics.RULES}},
        {"n_nonzero": 2, "d_in": 20, "rel_norms": [0.02, 0.0], "r_eff_participation": 8.0, "max_over_median": 7.0,
         "condition_on_range": 11.0,
         "l90_over_max": 0.3, "lambda_max": 3.0, **{f"K_{r}": 10 for r in diagnostics.RULES},
         **{f"share_{r}": 1.0 for r in diagnostics.RULES}},
        {"n_nonzero": 0, "d_in": 5, "rel_norms": [0.0, 0.0]},  # no expert changes it: left out
    ]  # fmt: skip
    s = diagnostics.summarize_layers(rows)
    assert s["n_layers"] == 2
    assert s["mean_update_magnitude"] == pytest.approx(0.02)  # zero deltas are not updates
    assert s["effective_rank_ratio"] == pytest.approx((0.2 + 0.4) / 2)
    assert s["median_max_over_median"] == pytest.approx(6.0) and s["median_l90_over_max"] == pytest.approx(0.2)
    assert s["median_condition_on_range"] == pytest.approx(10.0)
    assert s["cv_lambda_max"] == pytest.approx(0.5)  # pstdev(1, 3) = 1, mean 2
    assert s["psqrt_mean_K_ratio"] == pytest.approx(0.45)
    assert (s["psqrt_K_min"], s["psqrt_K_median"], s["psqrt_K_max"]) == (4, 7, 10)


def test_layer_type_and_depth():
    assert diagnostics.layer_type("encoder.layer.3.attention.self.query.weight") == "attention.self.query"
    assert diagnostics.layer_type("model.layers.11.mlp.down_proj.weight") == "mlp.down_proj"
    assert diagnostics.layer_type("pooler.dense.weight") == "pooler.dense"
    assert diagnostics.layer_depth("model.layers.11.mlp.down_proj.weight") == 11
    assert diagnostics.layer_depth("pooler.dense.weight") is None


# ---------------------------------------------------------------------------------------------
# Proxy reduction shares


def test_cut_share_equals_direct_loss_reduction():
    """The share of the WUDI proxy reduction kept by a top-K cut, against the loss evaluated directly."""
    stack = low_rank_plus_noise(4, 12, 20, rank=3, noise=0.05)
    eq = normal_equation(stack)
    spectrum = decompose(eq)
    start = initial_point(stack, "sum")
    reductions = diagnostics.direction_reductions(eq, spectrum, start)
    full = filtered_solve(eq, spectrum, torch.ones_like(spectrum.eigenvalues), start)
    total = float(eq.loss(start) - eq.loss(full))
    assert float(reductions.sum()) == pytest.approx(total, rel=1e-9)
    for k in (0, 1, 3, 7, 20):
        cut = filtered_solve(eq, spectrum, TopK(k)(spectrum.eigenvalues), start)
        direct = float(eq.loss(start) - eq.loss(cut)) / total
        assert diagnostics.cut_share(reductions, k) == pytest.approx(direct, rel=1e-9, abs=1e-12)
    assert diagnostics.cut_share(reductions, 20) == pytest.approx(1.0)
    # a soft filter too: sum (2h - h^2) r_k
    gains = Landweber(0.1, 5)(spectrum.eigenvalues)
    soft = filtered_solve(eq, spectrum, gains, start)
    share = diagnostics.reduction_share(reductions, gains)
    assert share == pytest.approx(float(eq.loss(start) - eq.loss(soft)) / total, rel=1e-9)


def test_filter_family_shapes():
    lam = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    family = diagnostics.filter_family(lam, t=1.0, rank_ratio=0.4, alpha=1.0, adaptive_rank=3)
    pinv, tik, exp, swudi, swudi_a = family.values()
    assert pinv.tolist() == [1, 1, 1, 1, 0]  # lambda = 0 is never inverted
    torch.testing.assert_close(tik, torch.tensor([0.8, 2 / 3, 0.5, 1 / 3, 0], dtype=torch.float64))
    torch.testing.assert_close(exp[:4], 1 - torch.exp(-lam[:4]))
    torch.testing.assert_close(swudi, torch.cat([exp[:2], torch.zeros(3, dtype=torch.float64)]))  # ceil(0.4 * 5) = 2
    assert swudi_a.tolist() == [1, 1, 1, 0, 0]


# ---------------------------------------------------------------------------------------------
# Optimizer as filter


@pytest.fixture
def problem():
    stack = low_rank_plus_noise(4, 10, 16, rank=3, noise=0.1)
    eq = normal_equation(stack)
    return optimizer_filter.dense_problem(eq, decompose(eq), initial_point(stack, "sum"))


def test_gradient_descent_filter_is_landweber(problem):
    lr = 0.25 / float(problem.eigenvalues[0])
    fits = optimizer_filter.optimizer_filter_trace(problem, optimizer="sgd", lr=lr, checkpoints=[1, 5, 20, 100])
    assert [f.step for f in fits] == [1, 5, 20, 100]
    lam = problem.eigenvalues[optimizer_filter.fit_directions(problem)]
    for fit in fits:
        torch.testing.assert_close(fit.h, Landweber(2 * lr, fit.step)(lam), rtol=0, atol=1e-10)
        assert fit.r2_landweber >= 0.9999 and fit.rmse_landweber < 1e-8
        assert fit.n_eff == pytest.approx(fit.step, rel=1e-6)
    assert fits[0].r2_exponential < 0.9999  # one discrete step is not gradient flow


def test_saturated_filter_has_no_r_squared():
    flat = torch.ones(20, dtype=torch.float64)
    assert math.isnan(optimizer_filter.r_squared(flat + 1e-9 * torch.randn(20, dtype=torch.float64), flat))
    assert optimizer_filter.rmse(flat, flat) == 0.0


def test_empirical_filter_recovers_a_planted_filter(problem):
    gains = torch.linspace(0.9, 0.1, problem.eigenvalues.numel(), dtype=torch.float64)
    tau = problem.tau_init + (problem.residual_projections() * (gains / problem.eigenvalues)) @ problem.Q.T
    torch.testing.assert_close(optimizer_filter.empirical_filter(problem, tau), gains)


def test_exponential_fit_recovers_t_and_adam_is_not_exactly_a_filter(problem):
    lam = problem.eigenvalues
    fit = optimizer_filter.fit_exponential(lam, 1 - torch.exp(-3.7 * lam))
    assert fit.value == pytest.approx(3.7, rel=1e-6) and fit.r2 == pytest.approx(1.0) and fit.rmse < 1e-8
    adam = optimizer_filter.optimizer_filter_trace(problem, optimizer="adam", lr=1e-2, checkpoints=[30])[0]
    assert adam.r2_exponential < 0.9999  # Adam's sign-like steps are not a spectral filter exactly


def test_factored_problem_equals_dense_problem():
    """A LoRA layer's filter problem built from cores (no d_in x d_in matrix) gives the dense problem's filter."""
    from specmerge.linalg.lowrank import LoraDelta, factor_cores

    g = torch.Generator().manual_seed(3)
    deltas = [LoraDelta(torch.randn(14, r, generator=g), torch.randn(r, 30, generator=g), 0.5) for r in (2, 3, 4)]
    P, R, cores = factor_cores(deltas, torch.float64)
    core_eq = normal_equation(cores)
    factored = optimizer_filter.factored_problem(
        P, R, core_eq, decompose(core_eq, (14, 30)), initial_point(cores, "sum")
    )
    dense_stack = torch.stack([d.dense() for d in deltas]).double()
    dense_eq = normal_equation(dense_stack)
    dense = optimizer_filter.dense_problem(dense_eq, decompose(dense_eq), initial_point(dense_stack, "sum"))
    torch.testing.assert_close(factored.eigenvalues, dense.eigenvalues[: factored.eigenvalues.numel()])
    X = torch.randn(14, 30, dtype=torch.float64, generator=g)
    torch.testing.assert_close(factored.times_C(X), dense.times_C(X))
    lr = 0.25 / float(dense.eigenvalues[0])
    a = optimizer_filter.optimizer_filter_trace(factored, optimizer="adam", lr=1e-2, checkpoints=[10])[0]
    b = optimizer_filter.optimizer_filter_trace(dense, optimizer="adam", lr=1e-2, checkpoints=[10])[0]
    torch.testing.assert_close(a.h, b.h[: a.h.numel()], rtol=1e-6, atol=1e-8)
    assert (
        optimizer_filter.optimizer_filter_trace(factored, optimizer="sgd", lr=lr, checkpoints=[7])[0].r2_landweber
        > 0.9999
    )


# ---------------------------------------------------------------------------------------------
# The command, end to end


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("inspect"), "bert", n_experts=3)


def read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_inspect_dense_report_files_rows_and_norms(bert, tmp_path):
    base, experts = bert
    out = tmp_path / "report"
    args = ["inspect", str(base), *map(str, experts), "--out", str(out), "-q", "--wudi-steps", "20"]
    assert main([*args, "-m", "swudi_a", "-m", "closed_form", "-m", "task_arithmetic:scale=0.5"]) == 0
    expected = ["report.md", "layers.csv", "layers.json", "summary.json", "optimizer_filter.csv", "filters.csv"]
    expected += ["spectra.png", "kept_ranks.png", "filter_shapes.png", "delta_norms.png", "optimizer_filter.png"]
    for name in expected:
        assert (out / name).stat().st_size > 0, name
    weights = load_file(base / "model.safetensors")
    linear = [n for n, w in weights.items() if w.dim() == 2 and "embeddings" not in n]
    rows = read_csv(out / "layers.csv")
    assert [r["name"] for r in rows] == linear  # one row per 2-D linear layer, model order
    experts_w = [load_file(e / "model.safetensors") for e in experts]
    for row in rows[:3]:
        stack = torch.stack([e[row["name"]] for e in experts_w]) - weights[row["name"]]
        for label, name, params in (("swudi_a", "swudi_a", {}), ("task_arithmetic:scale=0.5", "task_arithmetic",
                                                                  {"scale": 0.5})):  # fmt: skip
            direct = float(get_method(name)(stack, **params).delta.norm())
            assert float(row[f"norm[{label}]"]) == pytest.approx(direct, rel=1e-5)
        rel = float(stack[0].norm() / weights[row["name"]].norm())
        assert float(row[f"rel_norm[{experts[0].name}]"]) == pytest.approx(rel, rel=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["summary"]["n_layers"] == len(linear)
    sgd = [f for f in summary["optimizer_filter"] if f["optimizer"] == "sgd"]
    assert sgd and all(f["r2_landweber"] >= 0.9999 for f in sgd)
    report = (out / "report.md").read_text()
    assert "![" in report and "| # linear layers |" in report


def test_inspect_lora_experts_use_factored_route(tmp_path):
    config = llama_config()
    torch.manual_seed(0)
    base = tmp_path / "base"
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    adapters = []
    for i, (r, targets) in enumerate([(2, ["q_proj", "v_proj"]), (4, ["q_proj", "down_proj"]), (3, ["q_proj"])]):
        torch.manual_seed(10 + i)
        model = peft.get_peft_model(
            transformers.LlamaForCausalLM.from_pretrained(base),
            peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False),
        )
        model.save_pretrained(tmp_path / f"a{i}")
        adapters.append(tmp_path / f"a{i}")
    out = tmp_path / "report"
    assert (
        main(["inspect", str(base), *map(str, adapters), "-o", str(out), "-q", "--no-plots", "--wudi-steps", "5"]) == 0
    )
    rows = {r["name"]: r for r in read_csv(out / "layers.csv")}
    q = rows["model.layers.0.self_attn.q_proj.weight"]
    assert q["route"] == "factored" and int(q["numerical_rank"]) == 9  # 2 + 4 + 3
    assert float(q["max_over_median"]) == math.inf  # 9 non-zero eigenvalues of 32: the median is 0
    assert math.isfinite(float(q["condition_on_range"])) and float(q["condition_on_range"]) >= 1
    k = rows["model.layers.0.self_attn.k_proj.weight"]
    assert int(k["n_nonzero"]) == 0  # no adapter touches k_proj
    assert not (out / "spectra.png").exists()


def test_inspect_bad_inputs_exit_with_one_line(bert, tmp_path, capsys):
    base, experts = bert
    out = tmp_path / "report"
    args = ["inspect", str(base), *map(str, experts), "-o", str(out), "-q", "--no-plots", "--no-wudi"]
    assert main([args[0], args[1], str(tmp_path / "missing"), *args[3:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing" in err and "does not exist" in err
    assert not out.exists()

    other = tmp_path / "other"  # a base of another shape: a 2-D layer with one more row
    other.mkdir()
    weights = load_file(base / "model.safetensors")
    name = "encoder.layer.0.attention.self.query.weight"
    weights[name] = torch.cat([weights[name], weights[name][:1]])
    save_file(weights, str(other / "model.safetensors"))
    assert main([args[0], str(other), *args[2:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and "shape" in err
    assert not out.exists()

    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2  # the report exists
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err
    assert main([*args, "--overwrite"]) == 0
    assert main([*args, "--overwrite", "--wudi-layer", "nope"]) == 2
    assert "--wudi-layer 'nope'" in capsys.readouterr().err
    assert not list(tmp_path.glob(".report.specmerge-tmp-*"))  # nothing half-written left behind


def test_method_specs_are_validated_before_reading():
    assert parse_method_spec("swudi:t=300,rank_ratio=0.5").params == {"t": 300, "rank_ratio": 0.5}
    with pytest.raises(ValueError, match="unknown method"):
        parse_method_spec("swudy")
    with pytest.raises(ValueError, match="rank_ratio"):
        parse_method_spec("swudi:rank_ratio=2")


# ---------------------------------------------------------------------------------------------
# The default method list comes from the registry


def _half_sum(task_vectors: torch.Tensor, *, scale: float = 0.5) -> LayerResult:
    """A plugin for the tests: scale times the sum of the task vectors.

    Args:
        scale: factor on the sum.
    """
    return LayerResult(scale * task_vectors.sum(dim=0), {})


@pytest.fixture
def plugins():
    """Two methods registered the way a plugin would be (one featured and exact on cores, one not featured),
    removed from the registry after the test."""
    with registry.registrations():
        featured = specmerge.register("half_sum", citation="test", needs_matrix=False, factored=True)(_half_sum)
        hidden = specmerge.register(
            "half_sum_hidden", citation="test", needs_matrix=False, factored=True, featured=False
        )(_half_sum)
        yield featured, hidden


def test_default_methods_are_the_featured_closed_form_merges():
    featured = [name for name, m in all_methods().items() if m.featured and m.factored]
    assert default_methods() == tuple(featured)
    assert {"closed_form", "swudi", "swudi_a", "tsv_m", "iso_c", "task_arithmetic", "weight_average"} <= set(featured)
    assert not {"wudi_reference", "wudi", "ties"} & set(default_methods())  # a reference; no factored form


def test_a_registered_method_is_inspected_by_default(plugins, bert, tmp_path):
    assert default_methods()[-1] == "half_sum" and "half_sum_hidden" not in default_methods()
    base, experts = bert
    summary = inspect_model(base, experts, tmp_path / "r", progress=False, plots=False, wudi=False, threads=1)
    assert tuple(summary["options"]["methods"]) == default_methods()
    rows = read_csv(tmp_path / "r" / "layers.csv")
    weights, first = load_file(base / "model.safetensors"), rows[0]["name"]
    stack = torch.stack([load_file(e / "model.safetensors")[first] for e in experts]) - weights[first]
    assert float(rows[0]["norm[half_sum]"]) == pytest.approx(float((0.5 * stack.sum(dim=0)).norm()), rel=1e-5)
    assert "norm[half_sum_hidden]" not in rows[0]
