"""The partial symmetric eigensolver (issue 23): every eigenvalue, only the kept eigenvectors, and the merges on it.

The solver itself against eigh on spectra that are hard for it (a spike over a noise bulk, tight clusters, exactly
repeated eigenvalues, a rank-deficient C, d = 1 and 2), in float32 and float64, for K = 0, a few, past the MRRR
crossover (divide and conquer) and d; then the spectral merges that use it: the same K and the same merge as the
full eigh path to float32 rounding, the same bits on the same input, and the routes it must leave alone (the SVD of
M on wide layers, soft filters). The size floor is lowered so that these small layers take the partial route.
"""

from __future__ import annotations

import math

import pytest
import torch

from specmerge.linalg import eigensolver, rank_rules
from specmerge.linalg.projection import projection, shared_update
from specmerge.linalg.quadratic import normal_equation
from specmerge.linalg.solve import FreshLayer, shared_decompositions
from specmerge.linalg.spectrum import choose_rank, decompose
from specmerge.methods import get_method
from specmerge_bench.speed import synthetic_stack


@pytest.fixture(autouse=True)
def small_layers_take_the_partial_route(monkeypatch):
    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 8)


def orthogonal(d: int, g: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]


def matrix(kind: str, d: int, seed: int = 0) -> torch.Tensor:
    """A symmetric positive semi-definite d x d matrix, float64, with the named kind of spectrum."""
    g = torch.Generator().manual_seed(seed)
    if kind == "spiked":  # a few large eigenvalues over a Marchenko-Pastur bulk: the task-vector C
        X = torch.randn(d, 3 * d, generator=g, dtype=torch.float64) / math.sqrt(3 * d)
        U = torch.randn(d, 5, generator=g, dtype=torch.float64)
        return X @ X.T + 10 * U @ U.T / d
    Q = orthogonal(d, g)
    if kind == "clustered":  # groups of eigenvalues 1e-9 apart (relative)
        lam = torch.repeat_interleave(torch.logspace(0, -3, d // 4 + 1, dtype=torch.float64), 4)[:d]
        lam = lam * (1 + 1e-9 * torch.arange(d, dtype=torch.float64))
    elif kind == "repeated":  # exactly equal eigenvalues, three values
        lam = torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64).repeat_interleave(math.ceil(d / 3))[:d]
    elif kind == "deficient":  # rank d / 3: the rest is C's null space
        lam = torch.linspace(1, 0.1, d // 3, dtype=torch.float64)
        lam = torch.cat([lam, lam.new_zeros(d - d // 3)])
    else:
        raise ValueError(kind)
    return (Q * lam) @ Q.T


def quality(C: torch.Tensor, Q: torch.Tensor, lam: torch.Tensor) -> tuple[float, float]:
    """max_k ||C q_k - lambda_k q_k|| / ||C||_2 and max |Q^T Q - I|, in float64."""
    if Q.shape[1] == 0:
        return 0.0, 0.0
    Cd, Qd = C.double(), Q.double()
    scale = float(torch.linalg.eigvalsh(Cd).abs().max()) or 1.0
    residual = float((Cd @ Qd - Qd * lam.double()).norm(dim=0).max()) / scale
    return residual, float((Qd.T @ Qd - torch.eye(Q.shape[1], dtype=torch.float64)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["spiked", "clustered", "repeated", "deficient"])
def test_kept_eigenvectors_are_as_accurate_as_eighs(kind, dtype):
    """Residuals and orthogonality at most eigh's own on the same matrix, for K = 0, 1, a tenth, past the crossover
    and d, or within the solvers' own bound where eigh happens to do better: sqrt(d) eps in float32 (the vectors of
    T are computed in float64, so only the float32 reduction and back-transform count), d eps in float64 (MRRR's
    orthogonality is O(d eps), divide and conquer's, in eigh, O(sqrt(d) eps) in practice)."""
    d = 120
    C = matrix(kind, d).to(dtype)
    reduction = eigensolver.reduce(C)
    lam, Q = torch.linalg.eigh(C)
    lam, Q = lam.flip(0), Q.flip(1)
    eps = torch.finfo(dtype).eps
    truth = torch.linalg.eigvalsh(C.double()).flip(0)
    norm = float(truth.abs().max())
    # every eigenvalue, as eigh: backward stable in ||C||_2
    assert float((reduction.eigenvalues - truth).abs().max()) <= math.sqrt(d) * eps * norm
    assert float((lam.double() - truth).abs().max()) <= math.sqrt(d) * eps * norm  # eigh, for comparison
    crossing = math.floor(eigensolver.crossover(d) * d) + 1
    for k in (0, 1, d // 10, crossing, d):
        vectors = reduction.leading_vectors(k)
        assert vectors.shape == (d, k) and vectors.dtype == dtype
        assert torch.equal(vectors, reduction.leading_vectors(k))  # the same k, the same bits
        ours = quality(C, vectors, truth[:k])
        theirs = quality(C, Q[:, :k], truth[:k])
        floor = (math.sqrt(d) if dtype == torch.float32 else d) * eps
        assert ours[0] <= 2 * max(theirs[0], floor), (kind, k, ours, theirs)
        assert ours[1] <= 2 * max(theirs[1], floor), (kind, k, ours, theirs)


@pytest.mark.parametrize("d", [1, 2])
def test_the_smallest_matrices(d):
    C = torch.eye(d, dtype=torch.float64) * torch.arange(1, d + 1, dtype=torch.float64)
    reduction = eigensolver.reduce(C)
    assert reduction.eigenvalues.tolist() == list(range(d, 0, -1))
    top = reduction.leading_vectors(1)
    assert torch.allclose(top.abs(), torch.eye(d, dtype=torch.float64)[:, d - 1 :], atol=1e-15)


def test_what_the_solver_refuses_is_one_line():
    with pytest.raises(ValueError, match="square"):
        eigensolver.reduce(torch.zeros(3, 4))
    with pytest.raises(TypeError, match="float32 or float64 CPU"):
        eigensolver.reduce(torch.zeros(3, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="asked for 5 eigenvectors of a 4 x 4"):
        eigensolver.reduce(torch.eye(4)).leading_vectors(5)


def test_when_the_reduction_is_used(monkeypatch):
    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 1024)
    assert not eigensolver.pays(None, 4096)  # a soft filter inverts every direction: eigh
    assert not eigensolver.pays("rule", 1000) and eigensolver.pays("rule", 1024)
    assert eigensolver.crossover(1024) == 0.25 and eigensolver.crossover(2048) == pytest.approx(0.4)
    assert eigensolver.crossover(2**20) == 0.7
    assert eigensolver.pays(256, 1024) and not eigensolver.pays(257, 1024)  # past the crossover: eigh
    assert eigensolver.solves(torch.zeros(1024, 1024)) and not eigensolver.solves(torch.zeros(1023, 1023))
    assert not eigensolver.solves(torch.zeros(1024, 1024, dtype=torch.bfloat16))


def stack(n: int, d_out: int, d_in: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Task vectors like fine-tunes: a shared low-rank part, an own one per expert, and noise."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(d_out, 6, generator=g) @ torch.randn(6, d_in, generator=g)
    own = [torch.randn(d_out, 4, generator=g) @ torch.randn(4, d_in, generator=g) for _ in range(n)]
    noise = [0.05 * torch.randn(d_out, d_in, generator=g) for _ in range(n)]
    return (1e-3 * torch.stack([shared + o + e for o, e in zip(own, noise, strict=True)])).to(dtype)


SETTINGS = [
    ("swudi_a", {"rule": "psqrt"}),
    ("swudi_a", {"rule": "gavish_donoho"}),
    ("swudi_a", {"rule": "participation", "tau_init": "zero"}),
    ("swudi", {"rank_ratio": 0.1, "t": 300.0}),
    ("swudi", {"rank_ratio": 0.0}),  # K = 0: the start alone
    ("spectral_filter", {"filter": "tikhonov", "rank": "psqrt", "tau_init": "mean"}),
]


@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize(("name", "params"), SETTINGS)
def test_partial_merges_keep_the_k_and_the_merge_of_the_full_path(monkeypatch, name, params, n):
    """Float32 on the partial route: the K of float64, and the float64 merge to at most 3x the error of the full
    eigh path (which the partial route is meant to match to float32 rounding)."""
    tv = stack(n, 96, 64) if n == 6 else stack(1, 160, 64)  # C route: N d_out >= d_in
    method = get_method(name)
    reference = method(tv.double(), **params)
    partial = method(tv, **params)
    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 10**9)
    full = method(tv, **params)
    assert partial.diagnostics["kept_rank"] == full.diagnostics["kept_rank"] == reference.diagnostics["kept_rank"]
    scale = float(reference.delta.norm())
    error = {k: float((r.delta.double() - reference.delta).norm()) / scale for k, r in (("p", partial), ("f", full))}
    assert error["p"] <= 3 * max(error["f"], 64 * torch.finfo(torch.float32).eps), error


def test_the_partial_route_is_taken_where_asked_and_only_there():
    tv = stack(6, 96, 64)
    spectra = {}
    for kept in ("rule", None, lambda n_cols: n_cols):
        layer = FreshLayer(tv)
        spectra[str(kept)[:6]] = layer.projection("sum", partial=layer.wants_partial(kept)).spectrum
    assert spectra["rule"].partial  # a rank rule's leading K
    assert not spectra["None"].partial  # a soft filter: every direction, eigh
    assert not spectra["<funct"].partial  # K = d is past the crossover: eigh
    wide = FreshLayer(stack(2, 8, 64))  # N d_out < d_in: the SVD of M, which the partial route leaves alone
    assert not wide.projection("sum", partial=True).spectrum.partial
    method = get_method("swudi_a")
    assert torch.equal(method(stack(2, 8, 64)).delta, method(stack(2, 8, 64)).delta)


def test_a_sweep_gets_the_bits_of_separate_calls():
    tv = stack(6, 96, 64)
    settings = [("swudi_a", {}), ("swudi", {"rank_ratio": 0.1}), ("swudi", {}), ("spectral_filter", {}),
                ("swudi_a", {"rule": "gavish_donoho"}), ("swudi", {"rank_ratio": 0.2, "t": 800.0})]  # fmt: skip
    alone = [get_method(name)(tv, **params).delta for name, params in settings]
    with shared_decompositions():
        swept = [get_method(name)(tv, **params).delta for name, params in settings]
    assert all(torch.equal(a, b) for a, b in zip(alone, swept, strict=True))


def test_products_of_two_sets_of_eigenvectors_are_never_combined():
    """A partial spectrum computes vectors per K; sets for two K may rotate a cluster differently, so a solve that
    would build on the product of another set computes its own (and equals the plain product bit for bit)."""
    tv = stack(6, 96, 64)
    eq = normal_equation(tv)
    spectrum = decompose(eq, partial=True)
    assert spectrum.partial
    p = projection(eq, spectrum, tv.sum(0))
    p.shared = []
    gains = torch.linspace(2.0, 1.0, 12)
    small, large = torch.arange(8), torch.arange(12)
    shared_update(p, small, gains[:8], p.columns(small), spectrum.columns(small), spectrum.basis(8)[0])
    count = spectrum.basis(12)[0]
    Q, P = spectrum.columns(large), p.columns(large)
    assert count != spectrum.basis(8)[0]
    assert torch.equal(shared_update(p, large, gains, P, Q, count), (P * gains) @ Q.T)


def plain_swudi_a(tv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """SWUDI-A psqrt written plainly: eigh of C, psqrt on every computed eigenvalue (clipped at 0), the K leading
    directions inverted (paper Eq. 8 with tau_init = sum)."""
    eq = normal_equation(tv)
    lam, Q = torch.linalg.eigh(eq.C)
    lam, Q = lam.flip(0), Q.flip(1)
    k = rank_rules.psqrt_rank(lam.clamp(min=0))
    start = tv.sum(0)
    return start + (((eq.D - start @ eq.C) @ Q[:, :k]) / lam[:k]) @ Q[:, :k].T, k


@pytest.mark.parametrize("route", ["eigh", "partial"])
@pytest.mark.parametrize("noise", [0.005, 0.01])
def test_float32_keeps_float64s_k_where_a_noise_bulk_lies_below_the_floor(monkeypatch, route, noise):
    """Part of the noise bulk lies below the a-priori floor sqrt(d) eps lambda_1 but far above float32's round-off:
    the rank rule reads it (``rule_eigenvalues``) and chooses float64's K, where the floor-cut eigenvalues would not;
    the merge is then within 3x of a plain float32 implementation's error (it was 7.7 % off on fc2-shaped layers)."""
    if route == "eigh":
        monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 10**9)
    tv = synthetic_stack(8, 192, 768, rank=16, noise=noise)
    single, double = decompose(normal_equation(tv), partial=True), decompose(normal_equation(tv.double()))
    assert single.partial == (route == "partial")
    k64 = choose_rank("psqrt", double)
    assert rank_rules.psqrt_rank(single.eigenvalues) != k64  # the floor-cut view would miss it: the case is real
    assert choose_rank("psqrt", single) == k64
    method = get_method("swudi_a")
    reference, ours = method(tv.double()), method(tv)
    plain, k = plain_swudi_a(tv)
    assert ours.diagnostics["kept_rank"] == k == k64
    scale = float(reference.delta.norm())
    ours_error = float((ours.delta.double() - reference.delta).norm()) / scale
    plain_error = float((plain.double() - reference.delta).norm()) / scale
    assert ours_error <= 3 * plain_error, (ours_error, plain_error)


@pytest.mark.parametrize("rule", ["psqrt", "gavish_donoho", "participation"])
def test_float32_keeps_float64s_k_on_a_rank_deficient_c(rule):
    """C's null space comes out of float32 as eigenvalues of both signs at the round-off: the rules do not count
    it (the negative ones set rule_floor), so low-rank experts on the C route keep float64's K."""
    g = torch.Generator().manual_seed(3)
    tv = torch.stack([1e-3 * torch.randn(96, 8, generator=g) @ torch.randn(8, 80, generator=g) for _ in range(6)])
    single, double = decompose(normal_equation(tv), partial=True), decompose(normal_equation(tv.double()))
    assert single.partial and single.error > torch.finfo(torch.float32).eps * float(single.eigenvalues[0])
    assert choose_rank(rule, single) == choose_rank(rule, double)


def test_workers_reducing_at_once_get_serial_results_and_leave_the_blas_threads_as_they_were():
    """Parallel merges reduce in several threads: each gets eigenpairs as accurate as a serial call's (the bits may
    differ: BLAS may split the work otherwise under concurrent callers), and SciPy's BLAS thread count, limited to
    torch's for the calls, is the original one afterwards (the limit is process-wide)."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_info

    def blas() -> list[int]:
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    matrices = [matrix("spiked", 160, seed=s).float() for s in range(6)]
    eigensolver.reduce(matrices[0])  # SciPy's LAPACK loaded: its BLAS is among the libraries from here on
    before = blas()
    with ThreadPoolExecutor(3) as pool:
        parallel = list(pool.map(lambda C: eigensolver.reduce(C).leading_vectors(9), matrices))
    bound = 2 * math.sqrt(160) * torch.finfo(torch.float32).eps
    for C, vectors in zip(matrices, parallel, strict=True):
        truth = torch.linalg.eigvalsh(C.double()).flip(0)[:9]
        assert max(quality(C, vectors, truth)) <= bound
    assert blas() == before
