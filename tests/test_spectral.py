"""The unified spectral filtering estimator against independent computations (paper Sec. 3-4, App. B)."""

import math

import numpy as np
import pytest
import torch

from conftest import low_rank_plus_noise
from specmerge import get_method
from specmerge.linalg.filters import Exponential, Landweber, PseudoInverse, Tikhonov, TopK
from specmerge.linalg.quadratic import initial_point, normal_equation
from specmerge.linalg.solve import filtered_solve, inverse_gains, shared_decompositions
from specmerge.linalg.spectrum import Spectrum, choose_rank, decompose

# (N, d_out, d_in): full-rank C, and rank-deficient C with N d_out < d_in (the M M^T route)
SHAPES = [(4, 12, 9), (3, 5, 11), (2, 3, 17)]
INITS = ["sum", "mean", "zero"]


def stack(shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def solve(tau, filt, tau_init="sum"):
    eq = normal_equation(tau)
    spectrum = decompose(eq)
    return filtered_solve(eq, spectrum, filt(spectrum.eigenvalues), initial_point(tau, tau_init)), eq


def test_normal_equation_matches_definition():
    tau = stack((3, 5, 7))
    eq = normal_equation(tau)
    A = [t.T @ t / t.pow(2).sum() for t in tau]
    torch.testing.assert_close(eq.C, sum(A))
    torch.testing.assert_close(eq.D, sum(t @ a for t, a in zip(tau, A, strict=True)))
    assert eq.C.trace().item() == pytest.approx(3.0)  # trace(C) = number of non-zero experts
    # the quadratic form of Prop. 1: L(tau) = tr(tau C tau^T) - 2 tr(tau D^T) + const
    x, y = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    quad = lambda t: (t @ eq.C * t).sum() - 2 * (t * eq.D).sum()  # noqa: E731
    torch.testing.assert_close(eq.loss(x) - eq.loss(y), quad(x) - quad(y))


@pytest.mark.parametrize("shape", SHAPES)
def test_pseudoinverse_is_minimum_norm_least_squares(shape):
    tau = stack(shape)
    result, eq = solve(tau, PseudoInverse(), "zero")
    # independent route: minimum-norm least squares of C X = D^T (C symmetric), SVD-based driver
    reference = torch.linalg.lstsq(eq.C, eq.D.T, driver="gelsd").solution.T
    torch.testing.assert_close(result, reference, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(result, torch.from_numpy(eq.D.numpy() @ np.linalg.pinv(eq.C.numpy())))
    # it minimises the WUDI loss: the gradient 2 (tau C - D) vanishes, also by autograd of the explicit loss
    x = result.clone().requires_grad_(True)
    eq.loss(x).backward()
    assert x.grad.abs().max() < 1e-9 * eq.D.abs().max()
    torch.testing.assert_close(result @ eq.C, eq.D)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tau_init", INITS)
@pytest.mark.parametrize("t", [0.7, 6.0, 40.0])
def test_exponential_filter_is_gradient_flow(shape, tau_init, t):
    tau = stack(shape)
    result, eq = solve(tau, Exponential(t), tau_init)
    # Solve d tau/dt = D - tau C exactly with one matrix exponential of the augmented system
    # d/dt [tau, I] = [tau, I] @ [[-C, 0], [D, 0]], independent of any eigendecomposition.
    d_out, d_in = eq.D.shape
    gen = torch.zeros(d_in + d_out, d_in + d_out, dtype=torch.float64)
    gen[:d_in, :d_in] = -eq.C
    gen[d_in:, :d_in] = eq.D
    start = initial_point(tau, tau_init)
    start = torch.zeros(d_out, d_in, dtype=torch.float64) if start is None else start
    flow = torch.cat([start, torch.eye(d_out, dtype=torch.float64)], dim=1) @ torch.linalg.matrix_exp(t * gen)
    torch.testing.assert_close(result, flow[:, :d_in], rtol=1e-9, atol=1e-9)


def test_exponential_filter_is_fine_step_integration():
    tau = stack((3, 6, 8))
    result, eq = solve(tau, Exponential(2.0), "mean")
    x, dt = tau.mean(0), 1e-3
    for _ in range(2000):  # classical RK4 on d tau/dt = D - tau C
        f = lambda y: eq.D - y @ eq.C  # noqa: E731
        k1 = f(x)
        k2 = f(x + dt / 2 * k1)
        k3 = f(x + dt / 2 * k2)
        k4 = f(x + dt * k3)
        x = x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    torch.testing.assert_close(result, x, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tau_init", INITS)
def test_landweber_filter_is_n_gradient_steps(shape, tau_init):
    tau = stack(shape)
    eq = normal_equation(tau)
    eta = 1.5 / float(torch.linalg.eigvalsh(eq.C)[-1])
    result, _ = solve(tau, Landweber(eta, 37), tau_init)
    x = initial_point(tau, tau_init)
    x = torch.zeros_like(eq.D) if x is None else x
    for _ in range(37):
        x = x + eta * (eq.D - x @ eq.C)
    torch.testing.assert_close(result, x, rtol=1e-10, atol=1e-10)


def test_landweber_in_float32_matches_to_float_tolerance():
    tau = stack((4, 16, 24), torch.float32)
    eq = normal_equation(tau)
    eta = 1.0 / float(torch.linalg.eigvalsh(eq.C)[-1])
    result, _ = solve(tau, Landweber(eta, 20), "sum")
    x = tau.sum(0)
    for _ in range(20):
        x = x + eta * (eq.D - x @ eq.C)
    torch.testing.assert_close(result, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


@pytest.mark.parametrize("shape", SHAPES)
def test_swudi_full_rank_infinite_time_is_closed_form_on_range(shape):
    tau = stack(shape)
    eq = normal_equation(tau)
    swudi = get_method("swudi")
    closed = torch.linalg.pinv(eq.C)
    on_range = eq.C @ closed  # orthogonal projector onto Range(C)
    dc_plus = eq.D @ closed
    result = swudi(tau, rank_ratio=1.0, t=float("inf"), tau_init="sum").delta
    torch.testing.assert_close(result @ on_range, dc_plus, rtol=1e-9, atol=1e-9)
    # off the range the sum start is kept unchanged
    torch.testing.assert_close(result - result @ on_range, tau.sum(0) - tau.sum(0) @ on_range, rtol=1e-9, atol=1e-9)
    # tau_init = zero is the direct filtered inverse D C^+ itself
    torch.testing.assert_close(swudi(tau, rank_ratio=1.0, t=float("inf"), tau_init="zero").delta, dc_plus)


def test_swudi_zero_init_is_direct_filtered_inverse():
    tau = stack((5, 10, 14))
    eq = normal_equation(tau)
    lam, Q = np.linalg.eigh(eq.C.numpy())
    lam, Q = lam[::-1], Q[:, ::-1]
    k = int(np.ceil(0.6 * 14))  # 9
    h = (np.arange(14) < k) * (1 - np.exp(-3.0 * lam))
    expected = eq.D.numpy() @ Q @ np.diag(h / lam) @ Q.T
    result = get_method("swudi")(tau, rank_ratio=0.6, t=3.0, tau_init="zero")
    np.testing.assert_allclose(result.delta.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert result.diagnostics["kept_rank"] == 9


def test_top_k_keeps_tau_init_off_the_kept_directions():
    tau = stack((4, 10, 8))
    result, eq = solve(tau, TopK(3), "sum")
    Q = decompose(eq).eigenvectors
    kept, dropped = Q[:, :3], Q[:, 3:]
    torch.testing.assert_close(result @ dropped, tau.sum(0) @ dropped)
    torch.testing.assert_close(result @ kept, eq.D @ kept @ torch.diag(1 / decompose(eq).eigenvalues[:3]))


def test_tikhonov_is_ridge_solution():
    tau = stack((3, 6, 9))
    result, eq = solve(tau, Tikhonov(0.05), "zero")
    # (D C^+) C (C + alpha I)^-1 restricted to the range; with D in the range this is D (C + alpha I)^-1
    expected = eq.D @ torch.linalg.inv(eq.C + 0.05 * torch.eye(9, dtype=torch.float64))
    torch.testing.assert_close(result, expected, rtol=1e-9, atol=1e-9)


def test_filter_product_multiplies_gains():
    lam = torch.tensor([3.0, 1.0, 0.5, 0.1, 0.0], dtype=torch.float64)
    swudi_filter = TopK(3) * Exponential(2.0) * Tikhonov(0.1)
    expected = torch.tensor([1, 1, 1, 0, 0.0], dtype=torch.float64) * (1 - torch.exp(-2 * lam)) * lam / (lam + 0.1)
    torch.testing.assert_close(swudi_filter(lam), expected)
    torch.testing.assert_close(Landweber(0.3, 4)(lam), 1 - (1 - 0.3 * lam) ** 4)


def test_both_eigen_routes_agree():
    # same C reached through d_in x d_in eigh and through the (N d_out)^2 Gram of M
    tau = stack((2, 4, 30))
    eq = normal_equation(tau)
    spectrum = decompose(eq)  # n_rows = 8 < 30: the SVD of M through QR
    assert spectrum.eigenvalues.numel() == 8 and spectrum.rank == 8
    lam_c = torch.linalg.eigvalsh(eq.C).flip(0)[:8]
    torch.testing.assert_close(spectrum.eigenvalues, lam_c)
    Q = spectrum.eigenvectors
    torch.testing.assert_close(Q.T @ Q, torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(eq.C @ Q, Q * spectrum.eigenvalues)


def test_zero_experts_are_left_out_and_all_zero_gives_zero():
    tau = stack((3, 6, 5))
    with_zero = torch.cat([tau[:1], torch.zeros(1, 6, 5, dtype=torch.float64), tau[1:]])
    for name in ["swudi", "swudi_a", "closed_form", "spectral_filter"]:
        method = get_method(name)
        a, b = method(tau).delta, method(with_zero).delta
        torch.testing.assert_close(a, b)
        assert method(with_zero).diagnostics["n_experts"] == 3
        zero = method(torch.zeros(3, 6, 5))
        assert torch.equal(zero.delta, torch.zeros(6, 5)) and zero.diagnostics["n_experts"] == 0


def test_identical_experts_and_single_expert_return_the_expert():
    tau = torch.randn(6, 9, dtype=torch.float64)
    for experts in (tau[None], tau.expand(4, 6, 9)):
        for init in INITS:
            torch.testing.assert_close(get_method("closed_form")(experts, tau_init=init).delta, tau)
        torch.testing.assert_close(get_method("swudi")(experts, rank_ratio=1.0, t=float("inf")).delta, tau)


def test_rank_deficient_c_keeps_start_on_null_space():
    tau = stack((2, 3, 20))  # rank(C) <= 6 < 20
    result = get_method("swudi_a")(tau, rule="psqrt", tau_init="mean")
    null = torch.linalg.svd(normal_equation(tau).M, full_matrices=True).Vh[6:].T
    torch.testing.assert_close(result.delta @ null, tau.mean(0) @ null)
    assert result.diagnostics["spectrum_size"] == 6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_compute_in_float32(dtype):
    tau = low_rank_plus_noise(4, 32, 24, rank=6, noise=0.05, dtype=torch.float32).to(dtype)
    for name in ["swudi", "swudi_a", "closed_form"]:
        half = get_method(name)(tau)
        assert half.delta.dtype == torch.float32
        reference = get_method(name)(tau.float()).delta
        torch.testing.assert_close(half.delta, reference)
        double = get_method(name)(tau, dtype=torch.float64).delta
        assert double.dtype == torch.float64
        # float32 vs float64 differ only by rounding amplified by h/lambda on the small kept eigenvalues
        assert float((double.float() - reference).norm() / reference.norm()) < 2e-2


def test_scale_multiplies_the_delta():
    tau = stack((3, 5, 6))
    base = get_method("swudi_a")(tau).delta
    torch.testing.assert_close(get_method("swudi_a")(tau, scale=0.3).delta, 0.3 * base)


def test_swudi_a_zero_rank_keeps_tau_init_and_reports_it():
    torch.manual_seed(3)
    noise = torch.randn(6, 40, 30, dtype=torch.float64)  # pure i.i.d. noise: no spike above the bulk
    result = get_method("swudi_a")(noise, rule="gavish_donoho")
    assert result.diagnostics["kept_rank"] == 0
    assert result.diagnostics["energy_kept"] == 0.0
    torch.testing.assert_close(result.delta, noise.sum(0))


def test_swudi_a_gavish_donoho_recovers_planted_rank_through_the_stack():
    tau = low_rank_plus_noise(6, 40, 60, rank=5, noise=0.02)
    result = get_method("swudi_a")(tau, rule="gavish_donoho")
    assert result.diagnostics["kept_rank"] == 5


def test_generic_spectral_filter_method_is_the_same_code_path():
    tau = stack((4, 10, 12))
    method = get_method("spectral_filter")
    eq = normal_equation(tau)
    eta = 0.5 / float(torch.linalg.eigvalsh(eq.C)[-1])
    landweber, _ = solve(tau, Landweber(eta, 9), "mean")
    torch.testing.assert_close(method(tau, filter="landweber", eta=eta, steps=9, tau_init="mean").delta, landweber)
    tikhonov, _ = solve(tau, Tikhonov(0.02), "zero")
    torch.testing.assert_close(method(tau, filter="tikhonov", alpha=0.02, tau_init="zero").delta, tikhonov)
    # pinv x psqrt mask is SWUDI-A; exponential x ratio mask is SWUDI
    torch.testing.assert_close(method(tau, filter="pinv", rank="psqrt").delta, get_method("swudi_a")(tau).delta)
    torch.testing.assert_close(
        method(tau, filter="exponential", t=50.0, rank="ratio", rank_ratio=0.5).delta,
        get_method("swudi")(tau, t=50.0, rank_ratio=0.5).delta,
    )
    assert method(tau, filter="pinv", rank="ratio", rank_ratio=0.5).diagnostics["kept_rank"] == 6


def test_shared_decompositions_reuse_one_eigh_and_change_nothing(monkeypatch):
    g = torch.Generator().manual_seed(3)
    tau = torch.randn(4, 12, 10, generator=g, dtype=torch.float64)
    configs = [
        ("swudi", {"rank_ratio": 0.5, "t": 100.0}),
        ("swudi", {"rank_ratio": 0.8, "t": 1e4, "scale": 0.3}),
        ("swudi_a", {"rule": "gavish_donoho"}),
        ("closed_form", {}),
        ("spectral_filter", {"filter": "tikhonov", "alpha": 0.1}),
    ]
    separate = [get_method(m)(tau, **p).delta for m, p in configs]
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda x: calls.append(1) or eigh(x))
    with shared_decompositions():
        shared = [get_method(m)(tau, **p).delta for m, p in configs]
        tau.mul_(2)  # an in-place edit: the next call decomposes again
        edited = get_method("closed_form")(tau).delta
    assert len(calls) == 2
    for a, b in zip(shared, separate, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(edited, 2 * separate[3])


def test_rank_rules_choose_the_same_rank_in_float32_and_float64():
    """The rank rules see eigenvalues down to the eigensolver's accuracy, sqrt(n_cols) eps lambda_1: in float32
    the usual numerical-rank cut n_cols eps lambda_1 (here 1.2e-4 lambda_1) would drop real tail eigenvalues."""
    from specmerge_bench.speed import synthetic_stack

    tau = synthetic_stack(4, 192, 1024, rank=8, noise=0.2)  # float32 with the solve cut: psqrt 99, float64 102
    chosen = {}
    for dtype in (torch.float32, torch.float64):
        spectrum = decompose(normal_equation(tau.to(dtype)))
        chosen[dtype] = {rule: choose_rank(rule, spectrum) for rule in ("psqrt", "gavish_donoho")}
        if dtype == torch.float32:  # the case guarded: the old cut d_in eps lambda_1 drops eigenvalues float64 keeps
            old_cut = spectrum.n_cols * torch.finfo(dtype).eps * float(spectrum.eigenvalues[0])
            assert int((spectrum.eigenvalues > old_cut).sum()) < spectrum.rank
    assert chosen[torch.float32] == chosen[torch.float64]


def test_unresolved_directions_are_inverted_only_with_a_bounded_gain():
    """Issue 13, item 19: an eigenvalue at or below the floor is known only to lie in [0, floor]; the direction
    is still inverted when the filter's gain h / lambda barely depends on where (SWUDI: at most t)."""
    floor = 1e-6
    resolved = torch.tensor([2.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    computed = torch.tensor([2.0, 1.0, 1e-9, 0.0], dtype=torch.float64)
    spectrum = Spectrum(resolved, torch.eye(4, dtype=torch.float64), 8, 4, floor, computed)
    head = torch.tensor([2.0, 1.0], dtype=torch.float64)

    def gains(filt):
        return inverse_gains(spectrum, filt)

    exp = gains(Exponential(10.0))  # t floor = 1e-5: bounded, kept, at the computed eigenvalue (limit t at 0)
    torch.testing.assert_close(exp[:2], -torch.expm1(-10 * head) / head)
    torch.testing.assert_close(exp[2:], torch.tensor([-math.expm1(-1e-8) / 1e-9, 10.0], dtype=torch.float64))
    assert gains(Exponential(1e7))[2:].tolist() == [0, 0]  # t floor = 10: the gain is not resolved there
    assert gains(PseudoInverse()).tolist() == [0.5, 1.0, 0.0, 0.0]  # unbounded: Moore-Penrose
    assert gains(TopK(3) * Exponential(10.0))[2:].tolist() == pytest.approx([10.0, 0.0], rel=1e-7)
    assert gains(TopK(3) * PseudoInverse()).tolist() == [0.5, 1.0, 0.0, 0.0]
    torch.testing.assert_close(gains(Tikhonov(1e-3)), 1 / (computed + 1e-3))  # alpha >= floor: bounded by 1 / alpha
    assert gains(Tikhonov(1e-8))[2:].tolist() == [0, 0]  # alpha < floor: not resolved
    landweber = gains(Landweber(0.1, 20))
    assert landweber[3] == pytest.approx(2.0) and landweber[2] == pytest.approx(2.0, rel=1e-6)  # n eta


def test_filter_gains_have_their_limits_at_zero():
    zero = torch.zeros(3, dtype=torch.float64)
    assert Exponential(7.0).inverse_gain(zero).tolist() == [7.0] * 3
    assert Landweber(0.2, 30).inverse_gain(zero).tolist() == pytest.approx([6.0] * 3)
    assert Tikhonov(0.5).inverse_gain(zero).tolist() == [2.0] * 3
    assert PseudoInverse().inverse_gain(zero).isinf().all()
    assert (TopK(2) * Exponential(3.0)).inverse_gain(zero).tolist() == [3.0, 3.0, 0.0]
    assert (Exponential(3.0) * Tikhonov(0.5)).inverse_gain(zero).tolist() == [0.0] * 3
    # and away from 0 they are h / lambda, the Landweber filter accurate for tiny eta lambda (the power form is not)
    lam = torch.tensor([1e-12, 1e-3, 0.5], dtype=torch.float64)
    for filt in (Exponential(3.0), Landweber(0.2, 30), Tikhonov(0.5), TopK(2) * Exponential(3.0)):
        torch.testing.assert_close(filt.inverse_gain(lam), filt(lam) / lam, rtol=1e-12, atol=0)
    assert Landweber(0.2, 30)(lam)[0] == pytest.approx(6e-12, rel=1e-9)


@pytest.mark.parametrize(("n", "r", "d_out", "d_in"), [(4, 4, 64, 48), (3, 4, 20, 90), (8, 8, 128, 128)])
def test_null_space_of_c_changes_nothing_in_float32(n, r, d_out, d_in):
    """Dense LoRA-like experts (C of rank n r < d_in): SWUDI's top K reaching into C's null space gives the
    null directions gain ~t, but their right-hand side (D - tau_init C) q is round-off: they are skipped,
    and the result equals the one whose K stops at the rank, up to rounding."""
    g = torch.Generator().manual_seed(3)
    tau = torch.stack([torch.randn(d_out, r, generator=g) @ torch.randn(r, d_in, generator=g) for _ in range(n)])
    swudi = get_method("swudi")
    beyond = swudi(tau, rank_ratio=0.9)
    assert beyond.diagnostics["kept_rank"] > n * r
    at_rank = swudi(tau, rank_ratio=n * r / d_in).delta
    assert float((beyond.delta - at_rank).norm() / at_rank.norm()) <= 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize(("n", "d_out", "d_in"), [(2, 24, 256), (2, 64, 1024), (4, 64, 1024)])
def test_eigenvectors_stay_orthonormal_on_wide_layers(n, d_out, d_in):
    """Issue 13, item 20: with N d_out < d_in the eigenvectors come from the QR of M^T and an SVD, orthonormal to
    Householder's O(sqrt(m n)) eps; built as M^T u / sigma they were 1e-2 from orthonormal in float32."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, d_in, generator=g)  # a shared rank-8 row space plus 1 % noise: a few spikes over a bulk
    tau = torch.randn(n, d_out, 8, generator=g) @ rows + 0.01 * torch.randn(n, d_out, d_in, generator=g)
    Q = decompose(normal_equation(tau)).vectors.double()
    assert Q.shape == (d_in, n * d_out)
    error = float((Q.T @ Q - torch.eye(n * d_out, dtype=torch.float64)).abs().max())
    assert error <= math.sqrt(n * d_out * d_in) * torch.finfo(torch.float32).eps
