"""Factored LoRA merging equals the dense path on B A (DESIGN.md, "LoRA experts without densifying")."""

import pytest
import torch

from specmerge import get_method
from specmerge.lora import LoraDelta, factor_cores, merge_factored

SPECTRAL = [
    ("swudi", {}),
    ("swudi", {"rank_ratio": 0.02, "t": 50.0, "tau_init": "mean"}),
    ("swudi_a", {"rule": "psqrt"}),
    ("swudi_a", {"rule": "gavish_donoho"}),
    ("swudi_a", {"rule": "participation", "tau_init": "zero"}),
    ("closed_form", {}),
    ("closed_form", {"tau_init": "sum"}),
    ("spectral_filter", {"filter": "tikhonov", "alpha": 0.01, "rank": "psqrt"}),
    ("spectral_filter", {"filter": "landweber", "eta": 0.3, "steps": 20}),
]
# Baselines with an exact factored form: linear ones, and TSV-M / Iso-C through small SVDs.
FACTORED_BASELINES = [
    ("task_arithmetic", {}),
    ("weight_average", {"scale": 0.7}),
    ("tsv_m", {}),
    ("iso_c", {"scale": 1.2}),
]
CASES = [(3, 4, 40, 56, False), (5, 8, 96, 64, True), (2, 2, 30, 30, False), (4, 3, 20, 90, True)]


def adapters(n, r, d_out, d_in, rslora, dtype, seed=0, ranks=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ri = ranks[i] if ranks else r
        alpha = 16.0
        scale = alpha / (ri**0.5 if rslora else ri)
        out.append(
            LoraDelta(
                torch.randn(d_out, ri, generator=g, dtype=dtype) * 0.1,
                torch.randn(ri, d_in, generator=g, dtype=dtype) * 0.1,
                scale,
            )
        )
    return out


def relative(a, b):
    return float((a - b).norm() / b.norm())


def test_cores_reproduce_the_experts():
    experts = adapters(3, 4, 20, 30, False, torch.float64)
    P, R, cores = factor_cores(experts)
    for e, T in zip(experts, cores, strict=True):
        torch.testing.assert_close(P @ T @ R.T, e.dense())
    torch.testing.assert_close(P.T @ P, torch.eye(P.shape[1], dtype=torch.float64))


@pytest.mark.parametrize(("n", "r", "d_out", "d_in", "rslora"), CASES)
@pytest.mark.parametrize(("method", "params"), SPECTRAL)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_factored_equals_dense(n, r, d_out, d_in, rslora, method, params, dtype, tolerance):
    experts = adapters(n, r, d_out, d_in, rslora, dtype)
    dense_stack = torch.stack([e.dense() for e in experts])
    dense = get_method(method)(dense_stack, **params)
    factored = merge_factored(method, experts, **params)
    assert relative(factored.dense(), dense.delta) <= tolerance
    for key in ("kept_rank", "numerical_rank", "spectrum_size"):
        assert factored.diagnostics[key] == dense.diagnostics[key], key
    assert factored.diagnostics["lambda_max"] == pytest.approx(dense.diagnostics["lambda_max"], rel=tolerance)
    assert factored.left.shape[1] <= n * r


@pytest.mark.parametrize(("n", "r", "d_out", "d_in", "rslora"), CASES)
@pytest.mark.parametrize(("method", "params"), FACTORED_BASELINES)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_factored_baselines_equal_dense(n, r, d_out, d_in, rslora, method, params, dtype, tolerance):
    experts = adapters(n, r, d_out, d_in, rslora, dtype, seed=1)
    dense = get_method(method)(torch.stack([e.dense() for e in experts]), **params)
    factored = merge_factored(method, experts, **params)
    assert relative(factored.dense(), dense.delta) <= tolerance
    assert factored.diagnostics.get("kept_rank") == dense.diagnostics.get("kept_rank")
    assert factored.left.shape[1] <= n * r


def test_mixed_ranks_and_a_zero_adapter():
    experts = adapters(3, 0, 24, 40, False, torch.float64, ranks=[2, 6, 4])
    experts.append(LoraDelta(torch.zeros(24, 3, dtype=torch.float64), torch.zeros(3, 40, dtype=torch.float64), 2.0))
    dense = get_method("swudi_a")(torch.stack([e.dense() for e in experts]))
    factored = merge_factored("swudi_a", experts)
    assert relative(factored.dense(), dense.delta) <= 1e-8
    assert factored.diagnostics["n_experts"] == dense.diagnostics["n_experts"] == 3


def test_methods_without_a_factored_form_say_so():
    experts = adapters(2, 2, 8, 8, False, torch.float64)
    with pytest.raises(ValueError, match="cannot merge factored"):
        merge_factored("ties", experts)


@pytest.mark.parametrize(("n", "r", "d_out", "d_in", "rslora"), CASES)
def test_factored_spectrum_is_the_dense_spectrum(n, r, d_out, d_in, rslora):
    """Every eigenvalue of C (the non-zero ones and the count of zeros), in float64."""
    from specmerge.spectral import decompose, normal_equation

    experts = adapters(n, r, d_out, d_in, rslora, torch.float64, seed=2)
    dense = decompose(normal_equation(torch.stack([e.dense() for e in experts])))
    _, _, cores = factor_cores(experts)
    factored = decompose(normal_equation(cores), full_shape=(d_out, d_in))
    assert factored.eigenvalues.shape == dense.eigenvalues.shape
    assert factored.rank == dense.rank <= n * r
    torch.testing.assert_close(factored.eigenvalues, dense.eigenvalues, rtol=1e-9, atol=1e-12)
    assert (factored.n_rows, factored.n_cols) == (dense.n_rows, dense.n_cols)
