"""Baselines: hand-computed golden values and the identities each method must satisfy."""

from __future__ import annotations

import pytest
import torch

import specmerge
from specmerge.linalg.topk import keep_mask, top_k_count, top_k_rule
from specmerge.methods import sparse
from specmerge.methods.draws import content_key, dare_mask
from specmerge.methods.linear import task_arithmetic, weight_average
from specmerge.methods.sparse import (
    dare,
    dare_task_arithmetic,
    dare_ties,
    disjoint_mean,
    elect_sign,
    ties,
)
from specmerge.methods.svd import iso_c, polar_factor, tsv_factors, tsv_m

D64 = torch.float64

# TIES worked example: 3 experts, 6 entries, density 0.5 -> k = 3 entries kept per expert.
TIES_TAU = torch.tensor(
    [
        [4.0, -1.0, 2.0, -3.0, 3.5, 0.5],
        [2.5, 4.0, -2.0, 1.9, -5.0, 0.1],
        [-1.0, -4.0, 3.0, 1.9, -6.0, 0.2],
    ],
    dtype=D64,
)
# Trim: expert 1 keeps |4|, |3.5|, |-3|; expert 2 keeps |-5|, |4|, |2.5|; expert 3 keeps |-6|, |-4|, |3|.
TIES_TRIMMED = torch.tensor(
    [
        [4.0, 0.0, 0.0, -3.0, 3.5, 0.0],
        [2.5, 4.0, 0.0, 0.0, -5.0, 0.0],
        [0.0, -4.0, 3.0, 0.0, -6.0, 0.0],
    ],
    dtype=D64,
)
# Column sums 6.5, 0, 3, -3, -7.5, 0: entry 1 is a tie (+4 and -4), entry 5 was trimmed everywhere.
# Entry 3 shows the trim matters: untrimmed it sums to -3 + 1.9 + 1.9 = +0.8.
TIES_SIGN = torch.tensor([1.0, 0.0, 1.0, -1.0, -1.0, 0.0], dtype=D64)
# Disjoint mean: (4 + 2.5) / 2, tie -> 0, 3 / 1, -3 / 1, (-5 - 6) / 2 (the +3.5 disagrees), none -> 0.
TIES_MERGED = torch.tensor([3.25, 0.0, 3.0, -3.0, -5.5, 0.0], dtype=D64)
# Without the trim (density 1): sums 5.5, -1, 3, 0.8, -7.5, 0.8.
TIES_UNTRIMMED = torch.tensor([3.25, -2.5, 2.5, 1.9, -5.5, 0.8 / 3], dtype=D64)

ELEMENTWISE = ["weight_average", "task_arithmetic", "ties", "dare_task_arithmetic", "dare_ties", "breadcrumbs"]
MATRIX = ["tsv_m", "iso_c"]


def random_stack(*shape: int, seed: int = 0, dtype: torch.dtype = D64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def reference_trim(tau: torch.Tensor, density: float) -> torch.Tensor:
    """The TIES trim written plainly: per expert the k = ceil(density * numel) largest |tau_i| by a stable sort
    (equal magnitudes: first in storage order first), the rest zero. Independent of the radix select TIES uses."""
    flat = tau.reshape(tau.shape[0], -1)
    k = top_k_count(density, flat.shape[1])
    order = torch.sort(flat.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(flat).scatter_(1, order, flat.gather(1, order)).reshape(tau.shape)


# --- weight average and task arithmetic ----------------------------------------------------------


def test_weight_average_and_task_arithmetic_golden():
    tau = torch.tensor([[1.0, -2.0, 3.0], [3.0, 4.0, -1.0]], dtype=D64)
    torch.testing.assert_close(weight_average(tau).delta, torch.tensor([2.0, 1.0, 1.0], dtype=D64))
    torch.testing.assert_close(weight_average(tau, scale=0.5).delta, torch.tensor([1.0, 0.5, 0.5], dtype=D64))
    torch.testing.assert_close(task_arithmetic(tau).delta, torch.tensor([1.2, 0.6, 0.6], dtype=D64))
    torch.testing.assert_close(task_arithmetic(tau, scale=1.0).delta, torch.tensor([4.0, 2.0, 2.0], dtype=D64))


def test_defaults():
    defaults = {name: {p.name: p.default for p in specmerge.get_method(name).params} for name in ELEMENTWISE + MATRIX}
    assert defaults["weight_average"] == {"scale": 1.0}
    assert defaults["task_arithmetic"] == {"scale": 0.3}
    paper = {"convention": "paper"}
    assert defaults["ties"] == {"density": 0.2, "scale": 1.0, "normalize": True, "rescale": False, **paper}
    dare = {"drop_rate": 0.5, "seed": 0, "rescale": True, **paper}
    assert defaults["dare_task_arithmetic"] == {**dare, "scale": 0.3, "normalize": False}
    assert defaults["dare_ties"] == {**dare, "scale": 1.0, "normalize": True}
    assert defaults["tsv_m"] == {"scale": 1.0}
    assert defaults["iso_c"] == {"scale": 1.0}
    for name in ELEMENTWISE + MATRIX:
        method = specmerge.get_method(name)
        assert method.citation
        assert method.needs_matrix == (name in MATRIX)


# --- TIES -----------------------------------------------------------------------------------------


def test_ties_steps_golden():
    trimmed = reference_trim(TIES_TAU, 0.5)
    torch.testing.assert_close(trimmed, TIES_TRIMMED, rtol=0, atol=0)
    sign = elect_sign(trimmed)
    torch.testing.assert_close(sign, TIES_SIGN, rtol=0, atol=0)
    torch.testing.assert_close(disjoint_mean(trimmed, sign), TIES_MERGED, rtol=0, atol=0)


def test_ties_golden_and_scale():
    torch.testing.assert_close(ties(TIES_TAU, density=0.5).delta, TIES_MERGED, rtol=0, atol=0)
    torch.testing.assert_close(ties(TIES_TAU, density=0.5, scale=2.0).delta, 2 * TIES_MERGED, rtol=0, atol=0)
    # k = ceil(0.4 * 6) = 3, not floor or round (both 2).
    torch.testing.assert_close(ties(TIES_TAU, density=0.4).delta, TIES_MERGED, rtol=0, atol=0)
    torch.testing.assert_close(ties(TIES_TAU, density=1.0).delta, TIES_UNTRIMMED)


def test_ties_trim_is_per_expert_and_per_tensor_whatever_the_shape():
    tau = TIES_TAU.reshape(3, 2, 3)
    torch.testing.assert_close(ties(tau, density=0.5).delta, TIES_MERGED.reshape(2, 3), rtol=0, atol=0)
    # Scaling one expert by 100 must not change which of its own entries survive.
    scaled = TIES_TAU.clone()
    scaled[0] *= 100
    torch.testing.assert_close(reference_trim(scaled, 0.5)[1:], TIES_TRIMMED[1:], rtol=0, atol=0)
    for i in range(3):  # one expert alone: its sign is elected everywhere, so TIES returns its trim
        torch.testing.assert_close(ties(scaled[i : i + 1], density=0.5).delta, reference_trim(scaled, 0.5)[i])


def test_top_k_count():
    assert top_k_count(0.14, 100) == 14  # 0.14 * 100 = 14.000000000000002 in floating point
    assert top_k_count(0.2, 11) == 3
    assert top_k_count(1.0, 5) == 5
    assert top_k_count(1e-9, 5) == 1
    for bad in (0.0, -0.1, 1.5):  # the bound is the parameter's annotation, checked when the method is called
        with pytest.raises(ValueError, match="parameter 'density'"):
            ties(TIES_TAU, density=bad)


def test_ties_does_not_mutate_input():
    tau = TIES_TAU.clone()
    ties(tau, density=0.5)
    ties(tau, density=1.0)
    torch.testing.assert_close(tau, TIES_TAU, rtol=0, atol=0)


# --- DARE -----------------------------------------------------------------------------------------


def test_dare_rescales_kept_entries_and_zeroes_dropped():
    tau = random_stack(2, 50, 40, seed=1)
    p = 0.3
    out = dare(tau, p, seed=7, tensor_name="w", expert_keys=["a", "b"])
    for i, key in enumerate(["a", "b"]):
        keep = dare_mask((50, 40), p, 7, "w", key)
        assert keep.dtype == torch.bool
        torch.testing.assert_close(out[i][keep], tau[i][keep] / (1 - p))
        assert torch.all(out[i][~keep] == 0)
        assert 0 < int(keep.sum()) < keep.numel()


def test_dare_keep_fraction():
    for p in (0.1, 0.5, 0.9):
        keep = dare_mask((400_000,), p, seed=0, tensor_name="big", expert_key="x")
        assert abs(float(keep.double().mean()) - (1 - p)) < 0.005


def test_dare_mask_is_deterministic_and_order_independent():
    first = dare_mask((64, 32), 0.5, 3, "layer.0.weight", "b")
    for other in ("layer.1.weight", "layer.2.weight", "lm_head.weight"):  # other tensors in between
        dare_mask((128, 16), 0.5, 3, other, "a")
        dare_mask((128, 16), 0.5, 3, other, "b")
    assert torch.equal(dare_mask((64, 32), 0.5, 3, "layer.0.weight", "b"), first)
    # The global random state is neither used nor advanced.
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    dare_mask((64, 32), 0.5, 3, "layer.0.weight", "b")
    assert torch.equal(torch.rand(4), expected)


def test_dare_mask_depends_on_tensor_name_seed_and_expert():
    base = dare_mask((64, 32), 0.5, 3, "w", "a")
    assert not torch.equal(base, dare_mask((64, 32), 0.5, 3, "v", "a"))
    assert not torch.equal(base, dare_mask((64, 32), 0.5, 4, "w", "a"))
    assert not torch.equal(base, dare_mask((64, 32), 0.5, 3, "w", "b"))
    # Separators matter: ("w", "a0") and ("wa", "0") are different tensors/experts.
    assert not torch.equal(dare_mask((64, 32), 0.5, 3, "w", "a0"), dare_mask((64, 32), 0.5, 3, "wa", "0"))


def test_dare_same_mask_whatever_the_expert_order():
    tau_a, tau_b = random_stack(2, 30, 20, seed=2)
    ab = dare(torch.stack([tau_a, tau_b]), 0.5, 11, "w", ["a", "b"])
    ba = dare(torch.stack([tau_b, tau_a]), 0.5, 11, "w", ["b", "a"])
    assert torch.equal(ab[1], ba[0])
    assert torch.equal(ab[0], ba[1])
    assert not torch.equal(ab[0] != 0, ab[1] != 0)
    # Through the registered methods, the merge does not depend on the order either.
    for fn in (dare_task_arithmetic, dare_ties):
        merged_ab = fn(torch.stack([tau_a, tau_b]), seed=11, tensor_name="w", expert_keys=["a", "b"]).delta
        merged_ba = fn(torch.stack([tau_b, tau_a]), seed=11, tensor_name="w", expert_keys=["b", "a"]).delta
        torch.testing.assert_close(merged_ab, merged_ba)


def test_dare_default_keys_and_mask_independent_of_dtype():
    tau = random_stack(3, 10, 10, seed=3)
    out64 = dare(tau, 0.5, 0, "w")
    out32 = dare(tau.float(), 0.5, 0, "w")
    assert torch.equal(out64 != 0, out32 != 0)
    assert torch.equal(out64, dare(tau, 0.5, 0, "w", [content_key(t) for t in tau]))  # keys from the weights
    assert torch.equal(dare(tau.flip(0), 0.5, 0, "w"), out64.flip(0))  # an expert's mask follows it, not its place
    assert not torch.equal(out64 != 0, dare(tau, 0.5, 0, "w", ["0", "1", "2"]) != 0)  # explicit keys seed too


def test_dare_with_no_drop_is_task_arithmetic_and_untrimmed_ties():
    tau = random_stack(3, 8, 5, seed=4)
    torch.testing.assert_close(dare_task_arithmetic(tau, drop_rate=0.0).delta, task_arithmetic(tau).delta)
    torch.testing.assert_close(dare_ties(TIES_TAU, drop_rate=0.0).delta, TIES_UNTRIMMED)
    torch.testing.assert_close(dare_ties(tau, drop_rate=0.0).delta, ties(tau, density=1.0).delta)


def test_dare_methods_use_the_dare_stack():
    tau = random_stack(3, 40, seed=5)
    dropped = dare(tau, 0.5, 9, "w")
    torch.testing.assert_close(dare_task_arithmetic(tau, seed=9, tensor_name="w").delta, 0.3 * dropped.sum(0))
    expected = disjoint_mean(dropped, elect_sign(dropped))
    torch.testing.assert_close(dare_ties(tau, seed=9, tensor_name="w").delta, expected)


def test_dare_validates_inputs():
    tau = random_stack(2, 5, seed=6)
    for bad in (-0.1, 1.0, 1.5):  # the bound is the parameter's annotation, checked when the method is called
        for method in (dare_task_arithmetic, dare_ties):
            with pytest.raises(ValueError, match="parameter 'drop_rate'"):
                method(tau, drop_rate=bad)
    with pytest.raises(ValueError, match="expert keys"):
        dare(tau, 0.5, 0, "w", ["only_one"])


def test_dare_does_not_mutate_input():
    tau = random_stack(2, 20, seed=7)
    copy = tau.clone()
    dare_task_arithmetic(tau)
    dare_ties(tau)
    assert torch.equal(tau, copy)


# --- TSV-M ----------------------------------------------------------------------------------------


def assert_orthonormal_columns(X: torch.Tensor) -> None:
    torch.testing.assert_close(X.T @ X, torch.eye(X.shape[1], dtype=X.dtype), atol=1e-10, rtol=0)


def inverse_sqrt(G: torch.Tensor) -> torch.Tensor:
    lam, Q = torch.linalg.eigh(G)
    return (Q / lam.sqrt()) @ Q.T


def test_polar_factor_matches_inverse_square_root_formula():
    X = random_stack(7, 4, seed=8)
    P = polar_factor(X)
    torch.testing.assert_close(P, X @ inverse_sqrt(X.T @ X))
    assert_orthonormal_columns(P)


def test_tsv_factors_orthonormal():
    tau = random_stack(3, 9, 7, seed=9)  # k = floor(7 / 3) = 2
    U, S, V = tsv_factors(tau)
    assert U.shape == (9, 6) and S.shape == (6,) and V.shape == (7, 6)
    assert_orthonormal_columns(U)
    assert_orthonormal_columns(V)
    # S holds each task's two leading singular values.
    expected = torch.linalg.svdvals(tau)[:, :2].reshape(-1)
    torch.testing.assert_close(S, expected)


def test_tsv_m_golden_rank_one_tasks():
    # Two rank-1 tasks with non-orthogonal singular vectors; k = floor(3 / 2) = 1.
    u1, u2 = torch.tensor([1.0, 0.0, 0.0], dtype=D64), torch.tensor([0.6, 0.8, 0.0], dtype=D64)
    v1, v2 = torch.tensor([0.0, 1.0, 0.0], dtype=D64), torch.tensor([0.0, 0.8, 0.6], dtype=D64)
    tau = torch.stack([3 * torch.outer(u1, v1), 2 * torch.outer(u2, v2)])
    U, V = torch.stack([u1, u2], dim=1), torch.stack([v1, v2], dim=1)
    U_orth, V_orth = U @ inverse_sqrt(U.T @ U), V @ inverse_sqrt(V.T @ V)
    expected = U_orth @ torch.diag(torch.tensor([3.0, 2.0], dtype=D64)) @ V_orth.T
    result = tsv_m(tau)
    torch.testing.assert_close(result.delta, expected)
    assert result.diagnostics["rank_per_task"] == 1
    assert result.diagnostics["n_experts"] == 2
    # Orthogonal singular vectors are left alone: diag(3, 0, 0) and diag(0, 2, 0) merge to diag(3, 2, 0).
    diag = torch.stack([torch.diag(torch.tensor(d, dtype=D64)) for d in ([3.0, 0, 0], [0, 2.0, 0])])
    torch.testing.assert_close(tsv_m(diag).delta, torch.diag(torch.tensor([3.0, 2.0, 0.0], dtype=D64)))


def test_tsv_m_single_expert_returns_it():
    tau = random_stack(1, 6, 4, seed=10)
    result = tsv_m(tau)
    torch.testing.assert_close(result.delta, tau[0])
    assert result.diagnostics["rank_per_task"] == 4
    torch.testing.assert_close(tsv_m(tau, scale=0.5).delta, 0.5 * tau[0])


def test_tsv_m_rank_is_at_most_n_k():
    tau = random_stack(3, 8, 7, seed=11)  # k = 2, N k = 6 < 7
    result = tsv_m(tau)
    assert result.diagnostics["rank_per_task"] == 2
    assert int(torch.linalg.matrix_rank(result.delta)) == 6


def test_tsv_m_ignores_zero_experts():
    tau = random_stack(2, 8, 6, seed=12)  # k = 3 for the two real experts; 2 if the zero one counted
    with_zero = torch.cat([tau[:1], torch.zeros(1, 8, 6, dtype=D64), tau[1:]])
    result = tsv_m(with_zero)
    torch.testing.assert_close(result.delta, tsv_m(tau).delta)
    assert result.diagnostics["n_experts"] == 2
    assert result.diagnostics["rank_per_task"] == 3
    all_zero = tsv_m(torch.zeros(3, 4, 5, dtype=D64))
    assert torch.equal(all_zero.delta, torch.zeros(4, 5, dtype=D64))
    assert all_zero.diagnostics["n_experts"] == 0


def test_tsv_m_more_experts_than_min_dim():
    tau = random_stack(5, 3, 2, seed=13)  # k = max(1, 0) = 1, N k = 5 > 2
    result = tsv_m(tau)
    assert result.delta.shape == (3, 2)
    assert result.diagnostics["rank_per_task"] == 1
    assert torch.isfinite(result.delta).all()


# --- Iso-C ----------------------------------------------------------------------------------------


def test_iso_c_golden():
    # Sum diag(3, 1): mean singular value 2, so diag(2, 2).
    tau = torch.stack(
        [torch.diag(torch.tensor([2.0, 1.0], dtype=D64)), torch.diag(torch.tensor([1.0, 0.0], dtype=D64))]
    )
    result = iso_c(tau)
    torch.testing.assert_close(result.delta, 2 * torch.eye(2, dtype=D64))
    assert result.diagnostics["mean_singular_value"] == pytest.approx(2.0)
    torch.testing.assert_close(iso_c(tau, scale=1.5).delta, 3 * torch.eye(2, dtype=D64))


def test_iso_c_flat_spectrum_on_the_singular_vectors_of_the_sum():
    tau = random_stack(3, 7, 4, seed=14)
    total = tau.sum(0)
    mean_sv = torch.linalg.svdvals(total).mean()
    merged = iso_c(tau).delta
    torch.testing.assert_close(torch.linalg.svdvals(merged), mean_sv.expand(4))
    # Same singular subspaces: merged = mean * polar(sum), and it lies in the column space of the sum.
    torch.testing.assert_close(merged, mean_sv * total @ inverse_sqrt(total.T @ total))
    U = torch.linalg.svd(total, full_matrices=False).U
    torch.testing.assert_close(U @ (U.T @ merged), merged)


# --- through the registry -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ELEMENTWISE + MATRIX)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_registry_dtypes(name, dtype):
    stack = random_stack(3, 6, 5, seed=15).to(dtype)
    method = specmerge.get_method(name)
    result = method(stack, tensor_name="w", expert_keys=["a", "b", "c"])
    assert result.delta.shape == (6, 5)
    assert result.delta.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # Same values in float64 give the same merge up to float32 rounding.
    reference = method(stack.double(), tensor_name="w", expert_keys=["a", "b", "c"]).delta
    torch.testing.assert_close(result.delta.double(), reference, atol=1e-5, rtol=1e-5)
    assert result.diagnostics["delta_norm"] >= 0


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_registry_one_dimensional_stacks(name):
    stack = TIES_TAU.clone()
    result = specmerge.get_method(name)(stack, tensor_name="bias")
    assert result.delta.shape == (6,)
    assert torch.equal(stack, TIES_TAU)


def test_registry_golden_values_and_matrix_methods_reject_vectors():
    torch.testing.assert_close(specmerge.get_method("ties")(TIES_TAU, density="0.5").delta, TIES_MERGED)
    for name in MATRIX:
        with pytest.raises(ValueError, match="2-D"):
            specmerge.get_method(name)(TIES_TAU)


# --- rank-deficient deltas (LoRA experts): zero singular values are structural, not directions ------


def test_iso_c_flattens_within_the_span_of_a_rank_deficient_sum():
    g = torch.Generator().manual_seed(15)
    tau = torch.stack([torch.randn(6, 1, generator=g, dtype=D64) @ torch.randn(1, 5, generator=g, dtype=D64)
                       for _ in range(2)])  # fmt: skip
    U, S, Vh = torch.linalg.svd(tau.sum(0), full_matrices=False)
    result = iso_c(tau)
    mean_sv = S[:2].mean()  # the two non-zero singular values, not all five
    torch.testing.assert_close(result.delta, mean_sv * U[:, :2] @ Vh[:2])
    assert result.diagnostics["kept_rank"] == 2
    assert int(torch.linalg.matrix_rank(result.delta)) == 2
    assert torch.equal(iso_c(torch.zeros(2, 3, 4, dtype=D64)).delta, torch.zeros(3, 4, dtype=D64))


def test_tsv_m_keeps_at_most_the_rank_of_each_task():
    g = torch.Generator().manual_seed(16)
    low = torch.randn(8, 1, generator=g, dtype=D64) @ torch.randn(1, 8, generator=g, dtype=D64)
    full = torch.randn(8, 8, generator=g, dtype=D64)
    result = tsv_m(torch.stack([low, full]))  # k = 4 per task; the rank-1 task has one triplet
    assert result.diagnostics["rank_per_task"] == 4
    assert result.diagnostics["kept_rank"] == 5
    U, S, V = tsv_factors(torch.stack([low, full]))
    assert U.shape == (8, 5) and S.shape == (5,) and V.shape == (8, 5)
    torch.testing.assert_close(S[0], torch.linalg.svdvals(low)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_top_k_is_exact_with_many_ties(dtype):
    g = torch.Generator().manual_seed(0)
    # 16-bit task vectors: few distinct magnitudes, so the threshold sits inside a run of equal values
    values = (1e-3 * torch.randn(20_000, generator=g)).to(torch.float16).to(dtype).abs()
    values[:7] = 0.0
    values[7] = float("inf")
    for k in (1, 2, 137, 4000, 19_993, 20_000):
        expected = values.double().sort(descending=True).values[k - 1]
        rule = top_k_rule(values, k)
        assert rule[0] == float(expected), k
        keep = keep_mask(values, rule)
        assert int(keep.sum()) == k
        assert bool((values[keep] >= expected.to(dtype)).all()) and bool((values[~keep] <= expected.to(dtype)).all())
        # the real method path: TIES on one expert returns exactly its trim
        computed = values.float() if values.element_size() == 2 else values  # the method computes 16-bit in float32
        density = k / values.numel()
        assert torch.equal(ties(values[None], density=density).delta, reference_trim(computed[None], density)[0])
    with pytest.raises(ValueError, match="k must be in"):
        top_k_rule(values, 0)


def test_ties_trim_breaks_ties_in_storage_order():
    values = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.5, 2.0, 2.0])
    assert keep_mask(values, top_k_rule(values, 3)).tolist() == [False, True, True, True, False, False, False]
    assert ties(values[None], density=3 / 7).delta.tolist() == [0.0, 3.0, 2.0, 2.0, 0.0, 0.0, 0.0]
    assert torch.equal(ties(values[None], density=1.0).delta, values)


def test_disjoint_mean_matches_its_definition():
    g = torch.Generator().manual_seed(1)
    tau = torch.randn(5, 300, generator=g).round()  # many zeros and equal values
    sign = elect_sign(tau)
    agree = (torch.sign(tau) == sign) & (sign != 0)
    expected = torch.where(agree, tau, 0.0).sum(0) / agree.sum(0).clamp(min=1)
    torch.testing.assert_close(disjoint_mean(tau, sign), expected, rtol=0, atol=0)


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_chunked_ties_equals_the_whole_tensor_steps(density, monkeypatch):
    monkeypatch.setattr(sparse, "TIES_CHUNK", 100)  # many chunks, a ragged last one, ties across chunks
    g = torch.Generator().manual_seed(2)
    tau = torch.randint(-3, 4, (4, 37, 29), generator=g).float()  # the threshold's ties span several chunks
    trimmed = reference_trim(tau, density)
    expected = disjoint_mean(trimmed.reshape(4, -1), elect_sign(trimmed.reshape(4, -1))).reshape(37, 29)
    result = ties(tau, density=density, scale=0.5)
    torch.testing.assert_close(result.delta, 0.5 * expected, rtol=0, atol=0)
    sign = elect_sign(trimmed)
    assert result.diagnostics["sign_tie_fraction"] == pytest.approx(float((sign == 0).double().mean()))
