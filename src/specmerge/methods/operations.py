"""What merging one tensor costs, counted in operations: a method's declared cost (``register(..., cost=...)``).

A method's cost function gets the stack's shape as the method sees it, ``(N, d_out, d_in)`` for a matrix method
(any shape for an elementwise one), the element size of the compute dtype in bytes and the method's validated
params, and returns :class:`Operations`: flops of dense matrix products, the symmetric eigendecompositions, SVDs
and QR factorizations by size, bytes moved by elementwise passes, entries through an exact top-k selection or a
random draw, and the workspace the method allocates beyond its input stack. The pipeline's cost model
(:mod:`specmerge.pipeline.estimate.cost`) prices them with rates measured on the machine.

The counts follow the code in :mod:`specmerge.linalg` and the family modules (which products, in which order,
through C or M); where the work depends on the data (the rank a rule keeps, experts that are all zero) the
count assumes something and says what in ``assumed``. Counts are leading terms: O(d^2) bookkeeping is left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specmerge.linalg import eigensolver
from specmerge.linalg.projection import BLOCK_COLUMNS, product_pays, route_flops

Shape = tuple[int, ...]
CostFunction = Callable[[Shape, int, Mapping[str, Any]], "Operations"]  # (stack shape, itemsize, params)


@dataclass(frozen=True)
class Operations:
    """Operation counts of one merge step; ``+`` adds two counts (the workspace is the larger of the two)."""

    matmul: float = 0.0  # flops of dense matrix products (2 m n k per (m x k) @ (k x n))
    eigh: tuple[int, ...] = ()  # symmetric eigendecompositions with eigenvectors, by size d (d x d)
    partial_eigh: tuple[tuple[int, int], ...] = ()  # (d, k): reductions with the k leading eigenvectors
    svd: tuple[tuple[int, int, int], ...] = ()  # (count, m, n): SVDs with vectors of m x n matrices
    qr: tuple[tuple[int, int], ...] = ()  # (m, n), m >= n: Householder QR with the m x n Q formed
    memory: float = 0.0  # bytes read and written by elementwise passes over tensors
    select: float = 0.0  # entries through an exact top-k selection (radix select, :mod:`specmerge.linalg.topk`)
    random: float = 0.0  # random numbers drawn (DARE's masks)
    workspace: float = 0.0  # peak bytes allocated beyond the input stack
    assumed: tuple[str, ...] = ()  # what the count assumes about the data

    def __add__(self, other: Operations) -> Operations:
        return Operations(
            self.matmul + other.matmul,
            self.eigh + other.eigh,
            self.partial_eigh + other.partial_eigh,
            self.svd + other.svd,
            self.qr + other.qr,
            self.memory + other.memory,
            self.select + other.select,
            self.random + other.random,
            max(self.workspace, other.workspace),
            tuple(dict.fromkeys(self.assumed + other.assumed)),
        )

    def times(self, count: int) -> Operations:
        """``count`` repetitions (steps of an iterative method): the same workspace, reused."""
        return dataclasses.replace(
            self,
            matmul=self.matmul * count,
            eigh=self.eigh * count,
            partial_eigh=self.partial_eigh * count,
            svd=self.svd * count,
            qr=self.qr * count,
            memory=self.memory * count,
            select=self.select * count,
            random=self.random * count,
        )


def numel(shape: Shape) -> int:
    return math.prod(shape)


def passes(count: float, elements: float, itemsize: int) -> Operations:
    """``count`` elementwise passes (each reads or writes every element once) over ``elements`` entries."""
    return Operations(memory=count * elements * itemsize)


# ---------------------------------------------------------------------------------------------
# Building blocks of linalg, counted as the code runs them


def normal_equation_ops(n: int, d_out: int, d_in: int, e: int) -> Operations:
    """:func:`specmerge.linalg.quadratic.normal_equation`: the norms, then per expert (tau tau^T) tau / n_i when
    d_out < d_in, else A_i = tau^T tau / n_i (summed into C) and tau A_i."""
    x = d_out * d_in
    norms = passes(n, x, e)
    if d_out < d_in:  # the Gram tau tau^T by a symmetric update: half a product
        per = Operations(matmul=3.0 * d_out * d_out * d_in, memory=4.0 * x * e)
        return norms + per.times(n) + Operations(workspace=(x + d_out * d_out + x) * e)
    per = Operations(matmul=3.0 * d_out * d_in * d_in, memory=(5.0 * d_in * d_in + 3.0 * x) * e)
    return norms + per.times(n) + Operations(workspace=(x + 2 * d_in * d_in) * e)


def singular_pairs_ops(rows: int, cols: int, e: int) -> Operations:
    """:func:`specmerge.linalg.spectrum.decompose` through the SVD of M (rows x cols): M formed, a Householder QR of
    the wide M^T (or of M, tall), the SVD of the square R, and the right vectors (basis @ U)."""
    small, large = min(rows, cols), max(rows, cols)
    formed = passes(3, rows * cols, e)
    return formed + Operations(
        matmul=2.0 * large * small * small,
        svd=((1, small, small),),
        qr=((large, small),),
        workspace=(2 * rows * cols + 3 * small * small) * e,
    )


def decompose_ops(n: int, d_out: int, d_in: int, e: int, top_k: int | None = None, rule: bool = False) -> Operations:
    """The spectrum of C: eigh(C) when N d_out >= d_in (C formed first if :func:`normal_equation_ops` did not:
    d_out < d_in, by symmetric updates), else the SVD of M (:func:`singular_pairs_ops`). ``top_k``: the filter keeps
    that many leading directions (a rank rule's K when ``rule``): the partial route where it pays
    (:func:`specmerge.linalg.eigensolver.pays`), a reduction and the k vectors."""
    if n * d_out < d_in:
        return singular_pairs_ops(n * d_out, d_in, e)
    formed = Operations() if d_out >= d_in else Operations(matmul=1.0 * n * d_out * d_in * d_in)
    if top_k is not None and eigensolver.pays("rule" if rule else top_k, d_in):
        # C's copy for ?sytrd and the reflectors it leaves, then the k vectors (float64 in MRRR's work array)
        workspace = (d_in * d_in + d_in * top_k) * e + 8 * d_in * d_in
        return formed + Operations(partial_eigh=((d_in, top_k),), memory=2.0 * d_in * d_in * e, workspace=workspace)
    # C, eigh's vectors and its work arrays (1 + 6 d + 2 d^2), then the flipped copy of the vectors
    return formed + Operations(eigh=(d_in,), memory=2.0 * d_in * d_in * e, workspace=4 * d_in * d_in * e)


def filtered_solve_ops(n: int, d_out: int, d_in: int, kept: int, e: int, *, start: bool = True) -> Operations:
    """:func:`specmerge.linalg.solve.filtered_solve` keeping ``kept`` directions: D - tau_init C (through C when
    formed, else (X M^T) M), the projection on the kept eigenvectors and the update back, with the per-direction
    round-off level (:func:`~specmerge.linalg.solve._rounding_level`, float64, O(kept^2))."""
    x = d_out * d_in
    through_c = n * d_out >= d_in
    residual = Operations()
    if start:
        flops = 2.0 * d_out * d_in * d_in if through_c else 4.0 * n * d_out * d_out * d_in
        residual = Operations(matmul=flops, memory=3.0 * x * e)
    project = Operations(
        matmul=4.0 * d_out * d_in * kept,
        memory=(d_in * kept + 3 * d_out * kept + (3 * x if start else x)) * e + 12.0 * kept * kept * 8,
        workspace=(3 * x + d_in * kept + d_out * kept) * e,
    )
    return residual + project


def spectral_merge_ops(shape: Shape, e: int, kept: int | None, tau_init: str, assumed: str = "") -> Operations:
    """:func:`specmerge.linalg.solve.spectral_merge`: tau_init, the normal equation, the spectrum, the solve and
    the scale; ``kept`` leading directions inverted (None: every direction of the rank bound min(N d_out, d_in));
    a rank rule's K (``assumed`` said) takes the partial route wherever it pays."""
    n, d_out, d_in = shape
    x = d_out * d_in
    bound = min(n * d_out, d_in)
    k = bound if kept is None else max(0, min(kept, bound))
    start = tau_init != "zero"
    top_k = None if kept is None else k
    spectrum = decompose_ops(n, d_out, d_in, e, top_k, rule=bool(assumed))
    normal = normal_equation_ops(n, d_out, d_in, e)
    solve = filtered_solve_ops(n, d_out, d_in, k, e, start=start)
    if spectrum.partial_eigh and k:  # the columns B Q by the product route where it pays (linalg.projection)
        count = eigensolver.vectors_computed(k, d_in)
        if product_pays(n, d_out, d_in, count, start):
            if d_out < d_in:  # D never formed: the norms alone
                normal = passes(n, x, e)
            flops = route_flops(n, d_out, d_in, count, start)[0] + 2.0 * d_out * d_in * k
            memory = (d_in * k + 3 * d_out * k + (2 * x if start else 0) + n * x) * e + 12.0 * k * k * 8
            solve = Operations(matmul=flops, memory=memory, workspace=(x + (d_in + 2 * d_out) * BLOCK_COLUMNS) * e)
    ops = (passes(n + 1, x, e) if start else Operations()) + normal + spectrum + solve + passes(2, x, e)
    # alive together: tau_init and D throughout; C (or M) and the eigenvectors from the spectrum to the solve
    held = (2 if start else 1) * x * e
    kept_matrices = (2 * d_in * d_in if n * d_out >= d_in else 2 * n * d_out * d_in) * e
    workspace = held + max(normal.workspace, spectrum.workspace, kept_matrices + solve.workspace)
    return dataclasses.replace(ops, workspace=workspace, assumed=ops.assumed + ((assumed,) if assumed else ()))


def rank_rule_kept(shape: Shape) -> int:
    """The kept rank assumed for a rank rule (psqrt, Gavish-Donoho, participation), which depends on the data:
    half the rank bound (measured on the 1.1B Llama set: median 2742 of 5632, 1270 of 2048 with psqrt)."""
    n, d_out, d_in = shape
    return math.ceil(min(n * d_out, d_in) / 2)


RANK_RULE_ASSUMPTION = "a rank rule keeps half the rank bound min(N d_out, d_in) (data-dependent)"


def adam_step_ops(x: int, e: int, optimizer: str) -> Operations:
    """One torch optimizer step on a d_out x d_in parameter: Adam's moment updates (about 12 passes), SGD's 3."""
    return passes(12 if optimizer == "adam" else 3, x, e)


def gradient_ops(n: int, d_out: int, d_in: int, e: int, *, proxy_rank: int | None = None) -> Operations:
    """One gradient 2 (tau C - D) by :meth:`~specmerge.linalg.quadratic.NormalEquation.times_C`: through the small
    M of rank-k proxies, through M when 2 N d_out < d_in and C is not formed, else with C."""
    x = d_out * d_in
    if proxy_rank is not None:
        flops = 4.0 * n * proxy_rank * d_out * d_in
    elif d_out < d_in and 2 * n * d_out < d_in:
        flops = 4.0 * n * d_out * d_out * d_in
    else:
        flops = 2.0 * d_out * d_in * d_in
    return Operations(matmul=flops, memory=4.0 * x * e)


def svd_ops(count: int, m: int, n: int, e: int) -> Operations:
    """``count`` reduced SVDs of m x n matrices (U, S, Vh returned)."""
    k = min(m, n)
    return Operations(svd=((count, m, n),), workspace=count * (m * k + k * n + m * n) * e)
