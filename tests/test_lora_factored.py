"""Factored LoRA merging equals the dense path on B A (DESIGN.md, "LoRA experts without densifying").

The factored path solves in float64 whatever the dtype, so in float32 the difference is the dense
path's own float32 error. Tolerances come from the problem: :func:`float32_sweep.first_order_error`
(its eigengaps around a hard cut, the gains, eps of the dtype) for the spectral methods, the inner
dimensions and the conditioning of the polar factors for the SVD baselines, each times
``BACKWARD_ERROR`` (the constant that first-order estimates with unit constants leave out: the
eigensolver's and the products' backward errors, measured at 0.2-4 eps times the norm on these shapes).
In float64 both paths round, so their errors add (twice the allowance).
"""

import math

import pytest
import torch

from float32_sweep import BACKWARD_ERROR, first_order_error
from specmerge import get_method
from specmerge.linalg.lowrank import LoraDelta, factor_cores, singular_value_floor
from specmerge.methods.svd import tsv_rank

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
DTYPES = [torch.float64, torch.float32]


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


def exact_stack(experts):
    """The experts' deltas computed in float64 from their factors."""
    return torch.stack([e.scale * (e.B.double() @ e.A.double()) for e in experts])


def paths(dtype) -> int:
    """How many of the two compared paths round in ``dtype`` (the factored one always solves in float64)."""
    return 2 if dtype == torch.float64 else 1


def polar_condition(stack: torch.Tensor, method: str) -> float:
    """sigma_max / sigma_min of what TSV-M (concatenated U and V) or Iso-C (sum tau_i) take the polar factor
    of: the polar factor's relative condition number."""

    def cond(X):
        S = torch.linalg.svdvals(X)
        S = S[singular_value_floor(S, tuple(X.shape)) < S]
        return float(S[0] / S[-1])

    if method == "iso_c":
        return cond(stack.sum(0))
    if method == "tsv_m":
        k = tsv_rank(*stack.shape[1:], stack.shape[0])
        U, S, Vh = torch.linalg.svd(stack, full_matrices=False)
        keep = (S[:, :k] > singular_value_floor(S, tuple(stack.shape[1:]))).reshape(-1)
        U_cat = U[:, :, :k].permute(1, 0, 2).reshape(stack.shape[1], -1)[:, keep]
        V_cat = Vh[:, :k, :].reshape(-1, stack.shape[2]).T[:, keep]
        return max(cond(U_cat), cond(V_cat))
    return 1.0  # task arithmetic, weight average: linear


def test_cores_reproduce_the_experts():
    experts = adapters(3, 4, 20, 30, False, torch.float64)
    P, R, cores = factor_cores(experts)
    for e, T in zip(experts, cores, strict=True):
        torch.testing.assert_close(P @ T @ R.T, e.dense())
    torch.testing.assert_close(P.T @ P, torch.eye(P.shape[1], dtype=torch.float64))


@pytest.fixture(params=["eigh", "partial"])
def route(request, monkeypatch):
    """The top-K settings on eigh as on these small layers, or on the partial eigensolver (issue 23; its size floor
    lowered), on the dense stack and on the cores alike."""
    if request.param == "partial":
        from specmerge.linalg import eigensolver

        monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 8)
    return request.param


@pytest.mark.parametrize(("n", "r", "d_out", "d_in", "rslora"), CASES)
@pytest.mark.parametrize(("method", "params"), SPECTRAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_factored_equals_dense(n, r, d_out, d_in, rslora, method, params, dtype, route):
    experts = adapters(n, r, d_out, d_in, rslora, dtype)
    dense_stack = torch.stack([e.dense() for e in experts])
    dense = get_method(method)(dense_stack, **params)
    factored = get_method(method).merge_factored(experts, **params)
    eps = torch.finfo(dtype).eps
    # e.g. swudi_a participation on (4, 3, 20, 90): K = 10 cuts between lambda = 0.14933 and 0.149234, an
    # eigengap of 6e-4 relative; the float32 result is 1.6e-4 from the exact one, and no float32 code does better
    tolerance = paths(dtype) * BACKWARD_ERROR * first_order_error(exact_stack(experts), method, params, eps=eps)
    assert relative(factored.dense(), dense.delta) <= tolerance
    for key in ("kept_rank", "numerical_rank", "spectrum_size"):
        assert factored.diagnostics[key] == dense.diagnostics[key], key
    # lambda_1 comes from a product or a QR over the N d_out rows of M: relative error of a few eps sqrt(N d_out)
    rel = paths(dtype) * BACKWARD_ERROR * math.sqrt(n * d_out) * eps
    assert factored.diagnostics["lambda_max"] == pytest.approx(dense.diagnostics["lambda_max"], rel=rel)
    assert factored.left.shape[1] <= n * r


@pytest.mark.parametrize(("n", "r", "d_out", "d_in", "rslora"), CASES)
@pytest.mark.parametrize(("method", "params"), FACTORED_BASELINES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_factored_baselines_equal_dense(n, r, d_out, d_in, rslora, method, params, dtype):
    experts = adapters(n, r, d_out, d_in, rslora, dtype, seed=1)
    dense = get_method(method)(torch.stack([e.dense() for e in experts]), **params)
    factored = get_method(method).merge_factored(experts, **params)
    # B A rounds over r terms, the merge over n experts; the SVD baselines' polar factors amplify by their condition
    eps = torch.finfo(dtype).eps
    tolerance = paths(dtype) * BACKWARD_ERROR * (r + n) * eps * polar_condition(exact_stack(experts), method)
    assert relative(factored.dense(), dense.delta) <= tolerance
    assert factored.diagnostics.get("kept_rank") == dense.diagnostics.get("kept_rank")
    assert factored.left.shape[1] <= n * r


def test_mixed_ranks_and_a_zero_adapter():
    experts = adapters(3, 0, 24, 40, False, torch.float64, ranks=[2, 6, 4])
    experts.append(LoraDelta(torch.zeros(24, 3, dtype=torch.float64), torch.zeros(3, 40, dtype=torch.float64), 2.0))
    dense = get_method("swudi_a")(torch.stack([e.dense() for e in experts]))
    factored = get_method("swudi_a").merge_factored(experts)
    assert relative(factored.dense(), dense.delta) <= 1e-8
    assert factored.diagnostics["n_experts"] == dense.diagnostics["n_experts"] == 3


def test_methods_without_a_factored_form_say_so():
    experts = adapters(2, 2, 8, 8, False, torch.float64)
    with pytest.raises(ValueError, match="cannot merge factored"):
        get_method("ties").merge_factored(experts)


@pytest.mark.parametrize(("n", "r", "d_out", "d_in", "rslora"), CASES)
def test_factored_spectrum_is_the_dense_spectrum(n, r, d_out, d_in, rslora):
    """Every eigenvalue of C (the non-zero ones and the count of zeros), in float64."""
    from specmerge.linalg.quadratic import normal_equation
    from specmerge.linalg.spectrum import decompose

    experts = adapters(n, r, d_out, d_in, rslora, torch.float64, seed=2)
    dense = decompose(normal_equation(torch.stack([e.dense() for e in experts])))
    _, _, cores = factor_cores(experts)
    factored = decompose(normal_equation(cores), full_shape=(d_out, d_in))
    assert factored.eigenvalues.shape == dense.eigenvalues.shape
    assert factored.rank == dense.rank <= n * r
    torch.testing.assert_close(factored.eigenvalues, dense.eigenvalues, rtol=1e-9, atol=1e-12)
    assert (factored.n_rows, factored.n_cols) == (dense.n_rows, dense.n_cols)
