"""The product route of a partial spectrum (issue 23): B Q = D Q - tau_init (C Q) without forming B, nor D where
normal_equation does not form it (d_out < d_in), for the counts where it costs less.

Checked here: both routes give B Q within their float32 rounding bounds of the float64 value; a top-K merge on the
product route never forms D, B or a copy of the stack; the route is a function of the shape, start and count alone;
the norm estimate is close to ||D||_F; a spectral cache misses a count it did not anticipate instead of answering
wrongly. (That a cached setting equals a fresh merge bit for bit, product route included, is
tests/test_spectral_cache.py's grid.)
"""

from __future__ import annotations

import pytest
import torch

from specmerge.linalg import eigensolver
from specmerge.linalg.projection import RightHandSide, fresh_projection, product_pays, route_flops
from specmerge.linalg.quadratic import normal_equation
from specmerge.linalg.solve import FreshLayer, ProjectionMissing
from specmerge.linalg.spectrum import decompose
from specmerge.methods import get_method
from specmerge.tuning.spectral_cache import SpectralCache, entry_files


@pytest.fixture(autouse=True)
def partial_on_small_layers(monkeypatch):
    """The partial eigensolver's size floor lowered so that these small layers take it."""
    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 8)


def stack(n: int, d_out: int, d_in: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Low rank plus noise, like fine-tunes: a head of large eigenvalues and a noise bulk."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    low = [
        torch.randn(d_out, 6, generator=g, dtype=f64) @ torch.randn(6, d_in, generator=g, dtype=f64) for _ in range(n)
    ]
    noise = torch.randn(n, d_out, d_in, generator=g, dtype=torch.float64)
    return (0.05 * torch.stack(low) + 0.01 * noise).to(dtype)


def test_the_route_is_the_cheaper_one_by_flops():
    # a down_proj of 3072 x 8192, 4 experts: D by its Gram 9.3e11 flops, B 4.1e11; 285 columns by the product route
    # 2.2e11 (6 N d_out d_in each, plus C Q and tau_init (C Q))
    product, by_b = route_flops(4, 3072, 8192, 285, True)
    assert product < 0.2 * by_b and product_pays(4, 3072, 8192, 285, True)
    assert not product_pays(4, 3072, 8192, 4096, True)  # half the directions: forming D wins
    # fc2 of CLIP (768 x 3072, 8 experts): D by the small Gram is cheap, the product route pays only for few columns
    assert not product_pays(8, 768, 3072, 499, True) and product_pays(8, 768, 3072, 64, True)
    # d_out >= d_in: D comes with C anyway; only B's 2 d_out d_in^2 is saved, and with tau_init = 0 nothing is
    assert product_pays(4, 64, 32, 4, True) and not product_pays(4, 64, 32, 4, False)


def bound(tv: torch.Tensor, start: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Elementwise float32 rounding bound of a computed (D - start C) Q, both routes: gamma_m times the products of
    absolute values, m = 3 d_in + d_out + N the longest chain of sums (Higham, Thm 3.5), u = eps / 2."""
    a, s, q = tv.double().abs(), start.double().abs(), Q.double().abs()
    norms = tv.double().flatten(1).pow(2).sum(1)
    D_abs = sum(t @ (t.T @ (t @ q)) / n for t, n in zip(a, norms, strict=True))
    C_abs = sum(t.T @ (t @ q) / n for t, n in zip(a, norms, strict=True))
    m = 3 * tv.shape[2] + tv.shape[1] + tv.shape[0]
    u = torch.finfo(torch.float32).eps / 2
    return (m * u / (1 - m * u)) * (D_abs + s @ C_abs)


def test_both_routes_are_within_their_rounding_bound_of_the_float64_value():
    tv = stack(4, 16, 48, seed=1)  # d_out < d_in <= N d_out: the eigh(C) route, D not formed by normal_equation
    eq = normal_equation(tv)
    spectrum = decompose(eq, partial=True)
    count = 6
    Q = spectrum.basis(count)[1]
    start = tv.sum(0)
    rhs = RightHandSide(eq, start)
    by_product, by_b = rhs.product(Q), rhs.B @ Q
    exact_eq = normal_equation(tv.double())
    exact = (exact_eq.D - start.double() @ exact_eq.C) @ Q.double()
    limit = bound(tv, start, Q)
    assert bool(((by_product.double() - exact).abs() <= limit).all())
    assert bool(((by_b.double() - exact).abs() <= limit).all())


def test_a_top_k_merge_on_the_product_route_forms_neither_d_nor_b():
    tv = stack(4, 16, 48, seed=2)
    layer = FreshLayer(tv)
    swudi, params = get_method("swudi"), {"rank_ratio": 0.08}  # K = ceil(0.08 x 48) = 4
    result = swudi(tv, **params)
    merged = swudi.fn(layer, **swudi.validate(params, 4), **swudi.fixed)
    k = merged.diagnostics["kept_rank"]
    assert k == 4 and product_pays(4, 16, 48, k, True)
    p = layer.projection("sum", partial=True)
    assert p.spectrum.partial and p.uses_product(k)
    eq = layer._equation
    assert not eq.has_D and "B" not in p.fresh.__dict__  # neither formed: D Q came expert by expert
    assert torch.equal(merged.delta, result.delta)


def test_the_norm_estimate_is_close_to_the_norm_of_d():
    for seed in range(4):
        tv = stack(4, 16, 48, seed=10 + seed)
        eq = normal_equation(tv)
        estimate = RightHandSide(eq, None).d_norm_estimate
        assert not eq.has_D
        exact = float(normal_equation(tv.double()).D.norm())
        # s = 16 Gaussian probes: ||D G||_F^2 / s has a relative spread of at most sqrt(2 / s) = 0.35 (chi-square)
        assert 0.5 * exact < estimate < 1.5 * exact, (seed, estimate, exact)


def test_a_cache_misses_a_count_it_did_not_anticipate(tmp_path):
    from specmerge.methods.spectral import kept_directions

    tv = stack(4, 16, 48, seed=3)
    cache = SpectralCache(tmp_path / "cache")
    layer = FreshLayer(tv)
    swudi, params = get_method("swudi"), {"rank_ratio": 0.08}  # K = 4, on the product route
    kept = [kept_directions("swudi", swudi.validate(params, 4))]
    cache.write("ab" * 32, *entry_files(layer, ["sum"]))
    cache.write("ab" * 32, *entry_files(layer, ["sum"], partial=True, kept=kept))
    cached = cache.layer("ab" * 32, torch.device("cpu"))
    fresh, again = swudi(tv, **params), swudi.fn(cached, **swudi.validate(params, 4), **swudi.fixed)
    assert torch.equal(fresh.delta, again.delta)
    p = cached.projection("sum", partial=True)
    assert sorted(p.counted) == [4] and p.residual is None  # the one count anticipated; B not needed, not stored
    for other in (3, 40):  # another count on the product route, one on the B route: both missing, not wrong
        assert p.uses_product(other) == (other == 3)
        with pytest.raises(ProjectionMissing):
            p.columns(torch.arange(other), other)
    with pytest.raises(ProjectionMissing):
        swudi.fn(cached, **swudi.validate({"rank_ratio": 0.06}, 4), **swudi.fixed)


def test_the_route_does_not_depend_on_what_was_asked_before():
    """The same count gives the same bits whether or not another count (on the B route) formed D first."""
    tv = stack(4, 16, 48, seed=4)
    eq = normal_equation(tv)
    spectrum = decompose(eq, partial=True)
    first = fresh_projection(RightHandSide(eq, tv.sum(0)), spectrum)
    small = first.all_columns(4)
    assert first.uses_product(4) and not eq.has_D
    large = 40
    assert not first.uses_product(large)
    # the rounding test reads the estimate of ||D||_F on the product route only; the B route forms D anyway
    assert first.estimates_d_norm(4) and not first.estimates_d_norm(large)
    assert first.norm_of_D(4) == first.fresh.d_norm_estimate and not eq.has_D
    first.all_columns(large)  # the B route: forms D and B
    assert eq.has_D
    again = fresh_projection(RightHandSide(eq, tv.sum(0)), spectrum)
    assert torch.equal(again.all_columns(4), small)


def test_the_cost_model_counts_the_route_the_merge_takes(monkeypatch):
    """The dry run's flops (methods.operations) follow the product route where the merge takes it: on the down_proj
    above with K = 285, D and B are not counted, the 285 columns' chains are."""
    from specmerge.methods import operations

    shape = (4, 3072, 8192)
    on = operations.spectral_merge_ops(shape, 4, 285, "sum", "assumed")
    monkeypatch.setattr(operations, "product_pays", lambda *args: False)
    off = operations.spectral_merge_ops(shape, 4, 285, "sum", "assumed")
    product, by_b = route_flops(4, 3072, 8192, 285, True)
    assert on.partial_eigh == off.partial_eigh == ((8192, 285),)
    assert off.matmul - on.matmul == pytest.approx(by_b - product, rel=0.05)
