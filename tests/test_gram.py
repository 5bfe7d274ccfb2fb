"""Gram sums: the sum alpha X^T X within the rounding bound; by symmetric rank-k updates, exactly symmetric."""

from __future__ import annotations

import pytest
import torch

from specmerge.linalg import gram
from specmerge.linalg.gram import gram_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("syrk_from", [0, 10**9])  # through SciPy's syrk, and torch's product
def test_gram_sum_within_the_rounding_bound(dtype, syrk_from, monkeypatch):
    monkeypatch.setattr(gram, "SYRK_MIN_SIZE", syrk_from)
    g = torch.Generator().manual_seed(0)
    d = 700  # more than one SYMMETRIZE_BLOCK, not a multiple of it
    parts = [(torch.randn(300, d, generator=g, dtype=dtype), 0.5),  # contiguous X
             (torch.randn(d, 90, generator=g, dtype=dtype).T, 2.0),  # a transposed view (tau^T for tau tau^T)
             (torch.randn(1, d, generator=g, dtype=dtype), 1.0)]  # fmt: skip
    C = gram_sum(parts, d, parts[0][0])
    exact = sum(alpha * X.double().T @ X.double() for X, alpha in parts)
    # |fl(sum) - sum| <= gamma_k sum alpha |X|^T |X| elementwise, k the terms in each entry's sum (Higham, 3.5)
    k = sum(X.shape[0] for X, _ in parts) + len(parts)
    unit = torch.finfo(dtype).eps / 2
    bound = k * unit / (1 - k * unit) * sum(alpha * X.double().abs().T @ X.double().abs() for X, alpha in parts)
    assert C.dtype == dtype and C.shape == (d, d)
    assert bool(((C.double() - exact).abs() <= bound).all())
    if syrk_from == 0:  # one triangle formed, the other copied from it (a product need not be exactly symmetric)
        assert torch.equal(C, C.T)


def test_small_gram_sums_use_torch_products(monkeypatch):
    """Below SYRK_MIN_SIZE no SciPy BLAS call is made (its thread pool would spin against torch's)."""
    import scipy.linalg.blas

    def refuse(*args, **kwargs):
        raise AssertionError("syrk called below SYRK_MIN_SIZE")

    monkeypatch.setattr(scipy.linalg.blas, "ssyrk", refuse)
    X = torch.randn(50, gram.SYRK_MIN_SIZE - 1)
    torch.testing.assert_close(gram_sum([(X, 1.0)], X.shape[1], X), X.T @ X)
