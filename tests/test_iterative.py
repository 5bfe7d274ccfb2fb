"""Iterative references: fast vs reference WUDI, SGD = Landweber, OptMerge proxies and gradients."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import specmerge
from specmerge.linalg.filters import Landweber
from specmerge.linalg.optimize import autograd_gradient, descend, quadratic_gradient
from specmerge.linalg.quadratic import (
    initial_point,
    nonzero_experts,
    normal_equation,
    proxy_equation,
    proxy_loss,
    proxy_rank,
)
from specmerge.linalg.solve import filtered_solve
from specmerge.linalg.spectrum import decompose
from specmerge.methods.wudi import optmerge, optmerge_lora, wudi, wudi_reference

METHODS = ["wudi", "wudi_reference", "optmerge", "optmerge_lora"]
FULL_RANK = (3, 12, 16)  # N d_out = 36 >= d_in: C is 16 x 16 of full rank
RANK_DEFICIENT = (2, 3, 10)  # N d_out = 6 < d_in: C has rank 6


def random_stack(shape: tuple[int, int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def explicit_wudi_loss(tau: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
    """Paper Eq. 2, one expert at a time."""
    total = tau.new_zeros(())
    for tau_i in stack:
        total = total + ((tau - tau_i) @ tau_i.T).pow(2).sum() / tau_i.pow(2).sum()
    return total


def truncated(x: torch.Tensor, k: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(x, full_matrices=False)
    return U[:, :k] @ torch.diag(S[:k]) @ Vh[:k]


def explicit_proxies(stack: torch.Tensor, k: int, centre: bool) -> torch.Tensor:
    source = stack - stack.mean(dim=0) if centre else stack
    return torch.stack([truncated(x, k) for x in source])


def explicit_proxy_loss(tau: torch.Tensor, stack: torch.Tensor, proxies: torch.Tensor) -> torch.Tensor:
    total = tau.new_zeros(())
    for tau_i, p_i in zip(stack, proxies, strict=True):
        total = total + ((tau - tau_i) @ p_i.T).pow(2).sum() / tau_i.pow(2).sum()
    return total


def autograd_of(loss, tau: torch.Tensor) -> torch.Tensor:
    x = tau.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(x), x)
    return grad


# --- WUDI: fast and reference routes -------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [dict(optimizer="adam", lr=1e-3), dict(optimizer="sgd", lr=1e-2, momentum=0.9)],
    ids=["adam", "sgd-momentum"],
)
def test_fast_wudi_equals_reference_step_for_step(schedule):
    stack = random_stack(FULL_RANK)
    start = stack.sum(dim=0)
    steps = 25
    experts, norms_sq = nonzero_experts(stack)
    fast = quadratic_gradient(normal_equation(stack))
    reference = autograd_gradient(functools.partial(proxy_loss, targets=experts, proxies=experts, norms_sq=norms_sq))

    trajectories: dict[str, list[torch.Tensor]] = {"fast": [], "reference": []}
    for name, gradient in [("fast", fast), ("reference", reference)]:
        descend(start, gradient, steps=steps, **schedule, callback=lambda _, tau, n=name: trajectories[n].append(tau))

    assert len(trajectories["fast"]) == len(trajectories["reference"]) == steps
    for a, b in zip(trajectories["fast"], trajectories["reference"], strict=True):
        # relative to the distance travelled, which is far stricter than relative to ||tau||
        assert torch.linalg.vector_norm(a - b) <= 1e-10 * torch.linalg.vector_norm(b - start)
    # the registered methods run exactly these two gradients
    assert torch.equal(wudi(stack, steps=steps, **schedule).delta, trajectories["fast"][-1])
    assert torch.equal(wudi_reference(stack, steps=steps, **schedule).delta, trajectories["reference"][-1])


@pytest.mark.parametrize("shape", [FULL_RANK, RANK_DEFICIENT], ids=["C-route", "M-route"])
def test_analytic_gradient_equals_autograd_of_explicit_loss(shape):
    stack = random_stack(shape)
    tau = random_stack(shape[1:], seed=1)
    analytic = quadratic_gradient(normal_equation(stack))(tau)
    assert relative_error(analytic, autograd_of(lambda x: explicit_wudi_loss(x, stack), tau)) < 1e-12


@pytest.mark.parametrize("shape", [FULL_RANK, RANK_DEFICIENT], ids=["full-rank", "rank-deficient"])
@pytest.mark.parametrize("tau_init", ["sum", "mean", "zero"])
def test_plain_sgd_is_the_landweber_filter_with_eta_twice_the_lr(shape, tau_init):
    stack = random_stack(shape)
    lr, steps = 0.1, 40  # eta = 0.2; lambda_max <= N = 3, so eta * lambda < 2
    merged = wudi(stack, optimizer="sgd", lr=lr, steps=steps, tau_init=tau_init).delta

    eq = normal_equation(stack)
    spectrum = decompose(eq)
    gains = Landweber(eta=2 * lr, steps=steps)(spectrum.eigenvalues)
    closed = filtered_solve(eq, spectrum, gains, initial_point(stack, tau_init))
    assert relative_error(merged, closed) < 1e-10


def test_wudi_adam_is_the_published_adam():
    """Adam with betas (0.9, 0.999) and eps 1e-8, written out, on the explicit loss."""
    stack = random_stack(FULL_RANK)
    lr, steps, (beta1, beta2), eps = 1e-3, 10, (0.9, 0.999), 1e-8
    tau = start = stack.sum(dim=0)
    m, v = torch.zeros_like(tau), torch.zeros_like(tau)
    for t in range(1, steps + 1):
        g = autograd_of(lambda x: explicit_wudi_loss(x, stack), tau)
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        tau = tau - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)

    merged = wudi(stack, steps=steps, lr=lr).delta
    assert relative_error(merged - start, tau - start) < 1e-10


def test_wudi_defaults_decrease_the_loss_smoke():
    """Smoke test: with the published defaults (Adam, lr 1e-5, 300 steps) the loss goes down at every step."""
    stack = random_stack(FULL_RANK).float()
    eq = normal_equation(stack)
    losses = [float(eq.loss(stack.sum(dim=0)))]
    descend(
        stack.sum(dim=0),
        quadratic_gradient(eq),
        steps=300,
        lr=1e-5,
        callback=lambda _, tau: losses.append(float(eq.loss(tau))),
    )
    assert all(b <= a * (1 + 1e-6) for a, b in itertools.pairwise(losses))
    result = wudi(stack)
    assert result.delta.dtype == torch.float32
    assert result.diagnostics["loss_end"] < result.diagnostics["loss_start"]
    assert result.diagnostics["loss_start"] == pytest.approx(losses[0], rel=1e-6)
    assert result.diagnostics["loss_end"] == pytest.approx(losses[-1], rel=1e-6)


def test_many_sgd_steps_reach_the_pseudoinverse_on_the_range_of_c():
    stack = random_stack(RANK_DEFICIENT)
    eq = normal_equation(stack)
    C_pinv = torch.linalg.pinv(eq.C, hermitian=True)
    on_range = eq.C @ C_pinv
    null = torch.eye(eq.d_in, dtype=stack.dtype) - on_range
    lr = 0.5 / float(torch.linalg.eigvalsh(eq.C)[-1])

    # sum, mean and zero all lie in the row space of the tau_i, so the limit is D C^+ itself
    merged = wudi(stack, optimizer="sgd", lr=lr, steps=2000).delta
    assert relative_error(merged, eq.D @ C_pinv) < 1e-9

    # from a start with a null-space part, that part receives no gradient and stays
    start = random_stack(RANK_DEFICIENT[1:], seed=1)
    assert torch.linalg.vector_norm(start @ null) > 1
    tau = descend(start, quadratic_gradient(eq), steps=2000, lr=lr, optimizer="sgd")
    assert relative_error(tau @ on_range, eq.D @ C_pinv) < 1e-9
    assert relative_error(tau @ null, start @ null) < 1e-9


def test_steps_zero_returns_the_scaled_start_and_inputs_are_untouched():
    stack = random_stack(FULL_RANK)
    before = stack.clone()
    for name in METHODS:
        result = specmerge.get_method(name)(stack, steps=0, tau_init="sum", scale=0.5)
        assert torch.equal(result.delta, 0.5 * stack.sum(dim=0))
        assert result.diagnostics["loss_start"] == result.diagnostics["loss_end"]
        specmerge.get_method(name)(stack, steps=3)
    assert torch.equal(stack, before)


# --- OptMerge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("centre", [True, False], ids=["centred", "uncentred"])
def test_optmerge_gradient_equals_autograd_of_proxy_loss(centre):
    stack = random_stack(FULL_RANK)
    k = proxy_rank(12, 16, 3)
    proxies = explicit_proxies(stack, k, centre)
    tau = random_stack(FULL_RANK[1:], seed=1)
    eq = proxy_equation(stack, centre=centre)

    explicit = autograd_of(lambda x: explicit_proxy_loss(x, stack, proxies), tau)
    assert relative_error(quadratic_gradient(eq)(tau), explicit) < 1e-12
    assert float(eq.loss(tau)) == pytest.approx(float(explicit_proxy_loss(tau, stack, proxies)), rel=1e-12)
    # C_P and D_P as written in their definitions
    C_P = sum(p.T @ p / t.pow(2).sum() for t, p in zip(stack, proxies, strict=True))
    D_P = sum(t @ p.T @ p / t.pow(2).sum() for t, p in zip(stack, proxies, strict=True))
    assert relative_error(eq.C, C_P) < 1e-12
    assert relative_error(eq.D, D_P) < 1e-12


def test_optmerge_proxies_have_rank_k_and_only_optmerge_centres():
    stack = random_stack(FULL_RANK)
    k = 4  # max(1, min(12, 16) // 3)
    for centre in (True, False):
        eq = proxy_equation(stack, centre=centre)
        assert eq.proxy_rank == k
        assert [int(torch.linalg.matrix_rank(f)) for f in eq.proxies] == [k, k, k]
        grams = eq.proxies.transpose(1, 2) @ eq.proxies  # P_i^T P_i
        for want_centre in (True, False):
            p = explicit_proxies(stack, k, want_centre)
            matches = torch.allclose(grams, p.transpose(1, 2) @ p, rtol=1e-10, atol=1e-10)
            assert matches == (want_centre == centre)

    start = stack.mean(dim=0)
    for method, centre in [(optmerge, True), (optmerge_lora, False)]:
        result = method(stack, steps=1)
        assert result.diagnostics["centred"] is centre
        assert result.diagnostics["rank"] == k
        expected = explicit_proxy_loss(start, stack, explicit_proxies(stack, k, centre))
        assert result.diagnostics["loss_start"] == pytest.approx(float(expected), rel=1e-12)


def test_proxy_rank_default_formula():
    assert proxy_rank(12, 16, 3) == 4
    assert proxy_rank(64, 32, 4) == 8
    assert proxy_rank(5, 16, 8) == 1  # never zero
    assert proxy_rank(12, 16, 3, rank=2) == 2
    assert proxy_rank(12, 16, 3, rank=100) == 12  # capped at full rank
    with pytest.raises(ValueError, match="at least 1"):
        proxy_rank(12, 16, 3, rank=0)
    assert optmerge(random_stack((2, 9, 7)), steps=1).diagnostics["rank"] == 3


def test_optmerge_lora_default_sgd_is_heavy_ball():
    stack = random_stack(FULL_RANK)
    proxies = explicit_proxies(stack, 4, centre=False)
    lr, momentum, steps = 1e-4, 0.9, 5
    tau = stack.mean(dim=0)
    velocity = torch.zeros_like(tau)
    for _ in range(steps):
        velocity = momentum * velocity + autograd_of(lambda x: explicit_proxy_loss(x, stack, proxies), tau)
        tau = tau - lr * velocity

    merged = optmerge_lora(stack, steps=steps).delta
    start = stack.mean(dim=0)
    assert relative_error(merged - start, tau - start) < 1e-9


def test_zero_expert_is_left_out_of_the_loss():
    stack = random_stack(FULL_RANK)
    padded = torch.cat([stack, torch.zeros_like(stack[:1])])
    # sum init, and the uncentred proxy at a fixed rank, do not see the zero expert at all
    for name, params in [
        ("wudi", dict(steps=20, lr=1e-3)),
        ("wudi_reference", dict(steps=20, lr=1e-3)),
        ("optmerge_lora", dict(steps=20, rank=4, tau_init="sum")),
    ]:
        method = specmerge.get_method(name)
        with_zero, without = method(padded, **params), method(stack, **params)
        assert with_zero.diagnostics["n_experts"] == 3
        assert relative_error(with_zero.delta, without.delta) < 1e-12
    # centring uses the mean over all N, so only check the zero expert causes no division by zero
    result = optmerge(padded, steps=20)
    assert result.diagnostics["n_experts"] == 3
    assert torch.isfinite(result.delta).all()


@pytest.mark.parametrize("name", METHODS)
def test_all_zero_stack_gives_zeros(name):
    result = specmerge.get_method(name)(torch.zeros(3, 4, 5))
    assert torch.equal(result.delta, torch.zeros(4, 5))
    assert result.diagnostics["n_experts"] == 0


# --- through the registry ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", METHODS)
def test_half_inputs_compute_in_float32(name, dtype):
    stack = random_stack(FULL_RANK).to(dtype)
    result = specmerge.get_method(name)(stack, steps=5)
    assert result.delta.dtype == torch.float32
    assert torch.isfinite(result.delta).all()
    assert stack.dtype == dtype


@pytest.mark.parametrize("name", METHODS)
def test_runs_under_inference_mode(name):
    """Executors may merge under inference_mode / no_grad: the optimizer and autograd still work."""
    stack = random_stack(FULL_RANK)
    expected = specmerge.get_method(name)(stack, steps=5, lr=1e-3).delta
    with torch.inference_mode():
        inside = specmerge.get_method(name)(stack.clone(), steps=5, lr=1e-3).delta
    with torch.no_grad():
        assert torch.equal(specmerge.get_method(name)(stack, steps=5, lr=1e-3).delta, expected)
    assert torch.equal(inside, expected)


def test_bad_schedule_is_rejected():
    stack = random_stack(FULL_RANK)
    with pytest.raises(ValueError, match="optimizer"):
        specmerge.get_method("wudi")(stack, optimizer="rmsprop")
    with pytest.raises(ValueError, match="steps"):
        wudi(stack, steps=-1)
    with pytest.raises(ValueError, match="lr"):
        descend(stack[0], lambda tau: tau, steps=1, lr=0.0)
