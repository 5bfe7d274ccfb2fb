"""A layer's right-hand sides B Q for the filter step (:func:`specmerge.linalg.solve.solve`), formed in fixed blocks.

:class:`Projection` is what the filter step needs of one layer for one start besides the filter itself, formed
fresh from the normal equation (:func:`projection`) or held as stored by a spectral cache; :func:`shared_update`
lets settings that keep nested sets of directions share their products.
"""

from __future__ import annotations

import torch

from specmerge.linalg.quadratic import NormalEquation
from specmerge.linalg.spectrum import Spectrum, prefix

BLOCK_COLUMNS = 512  # B Q is formed in blocks of this many columns, each the same product wherever it is asked for


class Projection:
    """The right-hand side of every direction of one layer for one start: B Q with B = D - tau_init C.

    What :func:`solve` needs besides the filter: the spectrum, the start tau_init (None for zero), ||D||_F and
    ||tau_init||_F (for the rounding test) and the columns B q_k. Fresh (``residual`` = B), the columns are formed
    in fixed blocks of BLOCK_COLUMNS when first asked for, each block one product ``B @ Q[:, block]``; held (from a
    spectral cache), all of them come as stored. Block k is the same product whether one merge asks for it or a
    cache stores every block, so a setting re-synthesized from a cache gets the same bits as a fresh merge. Of a
    partial spectrum, Q is the set of eigenvectors ``spectrum.basis`` computes for the directions asked for, and a
    spectral cache keeps B itself (the residual) rather than B Q: the blocks are then the same products there too.
    """

    def __init__(
        self,
        spectrum: Spectrum,
        start: torch.Tensor | None,
        d_norm: float,
        start_norm: float,
        *,
        residual: torch.Tensor | None = None,
        held: torch.Tensor | None = None,
    ) -> None:
        if (residual is None) == (held is None):
            raise ValueError("a Projection holds either the residual B or all columns B Q")
        self.spectrum, self.start, self.d_norm, self.start_norm = spectrum, start, d_norm, start_norm
        self.residual, self.held = residual, held
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}
        # products of earlier solves, for settings that keep a superset of their directions at the same gains
        # (SWUDI at a larger r); None: every solve is one whole product, the same bits as any other merge
        # (and, for a partial spectrum, from the same set of eigenvectors: see shared_update)
        self.shared: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] | None = None

    @property
    def rows(self) -> torch.Tensor:
        """A tensor with B's rows, dtype and device (the residual or the held columns)."""
        return self.residual if self.residual is not None else self.held

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """B q_k for the directions ``index`` (ascending), q_k from ``spectrum.columns(index)``."""
        if self.held is not None:
            return self.held[:, index]
        count, _ = self.spectrum.basis(prefix(index))
        needed = sorted({int(b) for b in (index // BLOCK_COLUMNS).tolist()})
        offsets = torch.zeros(-(-count // BLOCK_COLUMNS), dtype=torch.long)
        for position, block in enumerate(needed):
            offsets[block] = position * BLOCK_COLUMNS
        gathered = torch.cat([self._block(count, block) for block in needed], dim=1)
        cpu_index = index.cpu()
        return gathered[:, (offsets[cpu_index // BLOCK_COLUMNS] + cpu_index % BLOCK_COLUMNS).to(index.device)]

    def all_columns(self) -> torch.Tensor:
        """B Q for every direction with an eigenvector (what a spectral cache stores of a full spectrum)."""
        if self.held is not None:
            return self.held
        count, _ = self.spectrum.basis(self.spectrum.n_vectors)
        return torch.cat([self._block(count, block) for block in range(-(-count // BLOCK_COLUMNS))], dim=1)

    def _block(self, count: int, block: int) -> torch.Tensor:
        """B Q[:, block] for the ``count`` eigenvectors of ``spectrum.basis``; a partial spectrum's blocks are kept
        for the sets of vectors it keeps."""
        if (count, block) not in self._blocks:
            Q = self.spectrum.basis(count)[1]
            self._blocks[count, block] = self.residual @ Q[:, block * BLOCK_COLUMNS : (block + 1) * BLOCK_COLUMNS]
            if self.spectrum.partial:
                kept = set(self.spectrum.kept_bases())
                for old in [key for key in self._blocks if key[0] not in kept]:
                    del self._blocks[old]
        return self._blocks[count, block]


def projection(eq: NormalEquation, spectrum: Spectrum, tau_init: torch.Tensor | None) -> Projection:
    """The fresh :class:`Projection` of a layer's normal equation for the start ``tau_init`` (None: zero).

    B = D - tau_init C with C itself, not (tau_init Q) diag(lambda): the computed q_k are eigenvectors only up to a
    residual of eps lambda_1, which D q_k carries and lambda_k tau_init q_k does not; on float32 layers with steep
    spectra the difference, amplified by SWUDI's gain t, made the result 2-3x less accurate.
    """
    residual = eq.D if tau_init is None else eq.D - eq.times_C_once(tau_init)
    start_norm = 0.0 if tau_init is None else float(tau_init.norm())
    return Projection(spectrum, tau_init, float(eq.D.norm()), start_norm, residual=residual)


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
