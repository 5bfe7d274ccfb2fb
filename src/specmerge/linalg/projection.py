"""A layer's right-hand sides B Q for the filter step (:func:`specmerge.linalg.solve.solve`), formed in fixed blocks.

:class:`Projection` is what the filter step needs of one layer for one start besides the filter itself, formed
fresh from the normal equation (:func:`projection`, :class:`RightHandSide`) or held as stored by a spectral cache;
:func:`shared_update` lets settings that keep nested sets of directions share their products.

Two routes to the columns B q_k of the k leading eigenvectors (issue 23). The B route forms B = D - tau_init C
once (D itself: 3 N d_out^2 d_in flops when d_out < d_in, and B 2 d_out d_in^2 more), then B Q. The product route
never forms B: B Q = D Q - tau_init (C Q), with D Q = sum_i tau_i (tau_i^T (tau_i Q)) / n_i where D is not formed
anyway (d_out < d_in), at 6 N d_out d_in flops per column. A top-K filter of a partial spectrum takes the product
route for the counts where it costs less (:func:`product_pays`): a function of the shape, the start and the count
alone, so a setting gets the same bits from a fresh merge and from a spectral cache, whatever else was asked first.
"""

from __future__ import annotations

import functools
import math

import torch

from specmerge.linalg.quadratic import NormalEquation
from specmerge.linalg.spectrum import Spectrum, prefix

BLOCK_COLUMNS = 512  # B Q is formed in blocks of this many columns, each the same product wherever it is asked for
NORM_PROBES = 16  # random columns of the estimate of ||D||_F where D is not formed (product route)


class ProjectionMissing(LookupError):
    """Stored projections lack what a setting asks for (another start, the SVD spectrum, products for another count):
    merge from the stack."""


def route_flops(n: int, d_out: int, d_in: int, count: int, start: bool) -> tuple[float, float]:
    """Flops of ``count`` columns B Q by the product route and by the B route, D included where only that route
    forms it (d_out < d_in: :func:`~specmerge.linalg.quadratic.normal_equation` forms D with C otherwise)."""
    formed = d_out >= d_in
    per_column = (2 if formed else 6 * n) * d_out * d_in + (2 * d_in * d_in + 2 * d_out * d_in if start else 0)
    setup = (0 if formed else 3 * n * d_out * d_out * d_in) + (2 * d_out * d_in * d_in if start else 0)
    return float(count * per_column), float(setup + count * 2 * d_out * d_in)


def product_pays(n: int, d_out: int, d_in: int, count: int, start: bool) -> bool:
    """Whether ``count`` columns B Q cost fewer flops by the product route than by forming B (see the module)."""
    product, by_b = route_flops(n, d_out, d_in, count, start)
    return product < by_b


class RightHandSide:
    """B = D - tau_init C of one layer's equation and one start, for fresh merges: B formed when a B-route block first
    asks for it, the product route's blocks D X - tau_init (C X) from the equation (:meth:`product`)."""

    def __init__(self, eq: NormalEquation, start: torch.Tensor | None) -> None:
        self.eq, self.start = eq, start
        self.start_norm = 0.0 if start is None else float(start.norm())

    @functools.cached_property
    def B(self) -> torch.Tensor:
        # C itself, not (tau_init Q) diag(lambda): the computed q_k are eigenvectors only up to a residual of
        # eps lambda_1, which D q_k carries and lambda_k tau_init q_k does not; on float32 layers with steep spectra
        # the difference, amplified by SWUDI's gain t, made the result 2-3x less accurate
        eq = self.eq
        return eq.D if self.start is None else eq.D - eq.times_C_once(self.start)

    def product(self, X: torch.Tensor) -> torch.Tensor:
        """B X without B: D X - tau_init (C X) (C as above: C X, not X's eigenvalues)."""
        DX = self.eq.D_times(X)
        return DX if self.start is None else DX - self.start @ (self.eq.C @ X)

    @functools.cached_property
    def d_norm(self) -> float:
        """||D||_F (D formed if it was not)."""
        return float(self.eq.D.norm())

    @functools.cached_property
    def d_norm_estimate(self) -> float:
        """||D||_F without forming D: a fixed-seed estimate ||D G||_F / sqrt(s) from s = NORM_PROBES Gaussian
        columns (relative spread at most sqrt(2 / s) on ||D||_F^2), enough for a round-off level."""
        eq = self.eq
        probes = torch.randn(eq.d_in, NORM_PROBES, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        DG = eq.D_times(probes.to(device=eq.tau.device, dtype=eq.tau.dtype))
        return float(DG.double().norm()) / math.sqrt(NORM_PROBES)


class Projection:
    """The right-hand side of every direction of one layer for one start: B Q with B = D - tau_init C.

    What :func:`solve` needs besides the filter: the spectrum, the start tau_init (None for zero), ||D||_F (or its
    estimate: :meth:`norm_of_D`) and ||tau_init||_F for the rounding test, and the columns B q_k. Fresh (``fresh``),
    the columns are formed in fixed blocks of BLOCK_COLUMNS when first asked for, each block one product
    ``B @ Q[:, block]`` (or, on the product route, ``fresh.product(Q[:, block])``); held (from a spectral cache), all
    of them come as stored. Block k is the same product whether one merge asks for it or a cache stores every block,
    so a setting re-synthesized from a cache gets the same bits as a fresh merge. Of a partial spectrum, Q is the set
    of eigenvectors ``spectrum.basis`` computes for the ``count`` leading directions asked for; a spectral cache keeps
    B itself (``residual``) for the counts on the B route and the columns of each count it anticipated on the
    product route (``counted``).
    """

    def __init__(
        self,
        spectrum: Spectrum,
        start: torch.Tensor | None,
        d_norm: float | None,
        start_norm: float,
        *,
        d_norm_estimate: float | None = None,
        n_experts: int,
        n_rows: int,
        fresh: RightHandSide | None = None,
        residual: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
        counted: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.spectrum, self.start, self.d_norm, self.start_norm = spectrum, start, d_norm, start_norm
        self.d_norm_estimate = d_norm_estimate
        self.n_experts, self.n_rows = n_experts, n_rows
        self.fresh, self.residual, self.held, self.counted = fresh, residual, held, dict(counted or {})
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}
        # products of earlier solves, for settings that keep a superset of their directions at the same gains
        # (SWUDI at a larger r); None: every solve is one whole product, the same bits as any other merge
        # (and, for a partial spectrum, from the same set of eigenvectors: see shared_update)
        self.shared: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] | None = None

    def sharing(self) -> Projection:
        """The same projection with its own blocks and an empty list of shared products (see ``shared``)."""
        copy = Projection(
            self.spectrum, self.start, self.d_norm, self.start_norm, d_norm_estimate=self.d_norm_estimate,
            n_experts=self.n_experts, n_rows=self.n_rows, fresh=self.fresh, residual=self.residual, held=self.held,
            counted=self.counted,
        )  # fmt: skip
        copy.shared = []
        return copy

    def zeros(self) -> torch.Tensor:
        """A zero update: n_rows x the eigenvector length, in the spectrum's dtype and device."""
        return self.spectrum.eigenvalues.new_zeros(self.n_rows, self.spectrum.vector_length)

    def uses_product(self, count: int) -> bool:
        """Whether the columns of the ``count`` leading eigenvectors come by the product route (partial spectra, and
        the leading vectors refined by Rayleigh-Ritz)."""
        d_in = self.spectrum.vector_length
        few = self.spectrum.partial or self.spectrum.refined
        return few and product_pays(self.n_experts, self.n_rows, d_in, count, self.start is not None)

    def estimates_d_norm(self, count: int) -> bool:
        """Whether the rounding test of a solve from the ``count`` leading eigenvectors reads the estimate of
        ||D||_F: on the product route where D is not formed (d_out < d_in); else ||D||_F itself."""
        return self.n_rows < self.spectrum.vector_length and self.uses_product(count)

    def norm_of_D(self, count: int) -> float:
        """||D||_F for the rounding test of a solve from the ``count`` leading eigenvectors (see estimates_d_norm)."""
        estimate = self.estimates_d_norm(count)
        if self.fresh is not None:
            return self.fresh.d_norm_estimate if estimate else self.fresh.d_norm
        value = self.d_norm_estimate if estimate else self.d_norm
        if value is None:
            raise ProjectionMissing(f"no stored norm of D for the {count} leading eigenvectors")
        return value

    def columns(self, index: torch.Tensor, leading: int | None = None) -> torch.Tensor:
        """B q_k for the directions ``index`` (ascending), q_k from ``spectrum.columns(index, leading)``."""
        if self.held is not None:
            return self.held[:, index]
        count, _ = self.spectrum.basis(prefix(index) if leading is None else leading)
        needed = sorted({int(b) for b in (index // BLOCK_COLUMNS).tolist()})
        offsets = torch.zeros(-(-count // BLOCK_COLUMNS), dtype=torch.long)
        for position, block in enumerate(needed):
            offsets[block] = position * BLOCK_COLUMNS
        gathered = torch.cat([self._block(count, block) for block in needed], dim=1)
        cpu_index = index.cpu()
        return gathered[:, (offsets[cpu_index // BLOCK_COLUMNS] + cpu_index % BLOCK_COLUMNS).to(index.device)]

    def all_columns(self, count: int | None = None) -> torch.Tensor:
        """B Q for the eigenvectors of ``spectrum.basis(count)`` (default: every direction with an eigenvector):
        what a spectral cache stores."""
        if self.held is not None:
            return self.held
        count, _ = self.spectrum.basis(self.spectrum.n_vectors if count is None else count)
        return torch.cat([self._block(count, block) for block in range(-(-count // BLOCK_COLUMNS))], dim=1)

    def _block(self, count: int, block: int) -> torch.Tensor:
        """B Q[:, block] for the ``count`` eigenvectors of ``spectrum.basis``; a partial spectrum's blocks are kept
        for the sets of vectors it keeps."""
        if (count, block) not in self._blocks:
            self._blocks[count, block] = self._form(count, block)
            if self.spectrum.partial:
                kept = set(self.spectrum.kept_bases())
                for old in [key for key in self._blocks if key[0] not in kept]:
                    del self._blocks[old]
        return self._blocks[count, block]

    def _form(self, count: int, block: int) -> torch.Tensor:
        columns = slice(block * BLOCK_COLUMNS, (block + 1) * BLOCK_COLUMNS)
        if self.uses_product(count):
            if count in self.counted:
                return self.counted[count][:, columns]
            if self.fresh is None:
                raise ProjectionMissing(f"no stored products for the {count} leading eigenvectors")
            return self.fresh.product(self.spectrum.basis(count)[1][:, columns])
        B = self.fresh.B if self.fresh is not None else self.residual
        if B is None:
            raise ProjectionMissing(f"no stored residual for the {count} leading eigenvectors")
        return B @ self.spectrum.basis(count)[1][:, columns]


def projection(eq: NormalEquation, spectrum: Spectrum, tau_init: torch.Tensor | None) -> Projection:
    """The fresh :class:`Projection` of a layer's normal equation for the start ``tau_init`` (None: zero)."""
    return fresh_projection(RightHandSide(eq, tau_init), spectrum)


def fresh_projection(rhs: RightHandSide, spectrum: Spectrum) -> Projection:
    """The :class:`Projection` of ``spectrum`` on a start's right-hand side (shared by the spectra of one layer)."""
    eq = rhs.eq
    return Projection(spectrum, rhs.start, None, rhs.start_norm, n_experts=eq.n_experts, n_rows=eq.d_out, fresh=rhs)


SHARED_KEPT = 6  # earlier products a Projection keeps for reuse


def shared_update(
    p: Projection, index: torch.Tensor, inverse: torch.Tensor, projected: torch.Tensor, Q: torch.Tensor, basis: int
) -> torch.Tensor:
    """(projected * inverse) @ Q.T, from the largest earlier product whose directions are a subset of these, kept at
    the same gains, plus the product of the directions it lacks. Another order of the same sum: equal to the whole
    product to float32 rounding (a few eps relative), not bit for bit.

    ``basis``: the count of the set of eigenvectors Q comes from (``spectrum.basis``). Only products of the same set
    are combined: two sets of a partial spectrum (computed for two K) may rotate the vectors of a cluster of
    eigenvalues differently, and a sum over both would count part of the cluster twice."""
    m = p.spectrum.n_vectors
    mask = torch.zeros(m, dtype=torch.bool, device=index.device)
    mask[index] = True
    full = torch.zeros(m, dtype=inverse.dtype, device=inverse.device)
    full[index] = inverse
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for old_mask, old_gains, old_update, old_basis in p.shared or ():
        if old_basis != basis or bool((old_mask & ~mask).any()) or not torch.equal(old_gains[old_mask], full[old_mask]):
            continue
        if best is None or int(old_mask.sum()) > int(best[0].sum()):
            best = (old_mask, old_gains, old_update)
    if best is None:
        update = (projected * inverse) @ Q.T
    else:
        pick = (mask & ~best[0])[index]  # this solve's directions the earlier product lacks
        update = best[2] + (projected[:, pick] * inverse[pick]) @ Q[:, pick].T
    p.shared.append((mask, full, update, basis))
    del p.shared[:-SHARED_KEPT]
    return update
