"""SVD-based merges: TSV-M and Iso-C reshape the singular spectrum of the task vectors.

Both need 2-D weights and are exact on the cores of LoRA experts (``factored``): an orthonormal change of
basis on either side leaves their singular values and polar factors unchanged.
"""

from __future__ import annotations

import torch

from specmerge.linalg.lowrank import singular_value_floor
from specmerge.linalg.quadratic import nonzero_experts
from specmerge.methods.operations import Operations, Shape, passes, svd_ops
from specmerge.methods.registry import LayerResult, register

TSV_CITATION = "Gargiulo et al., Task Singular Vectors: Reducing Task Interference in Model Merging, CVPR 2025"
ISO_C_CITATION = "Marczak et al., No Task Left Behind: Isotropic Model Merging (Iso-C), ICML 2025"


def polar_factor(X: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor P Q^T of X = P Sigma Q^T (the nearest matrix with orthonormal columns or rows)."""
    P, _, Qh = torch.linalg.svd(X, full_matrices=False)
    return P @ Qh


def tsv_rank(d_out: int, d_in: int, n_experts: int) -> int:
    """Singular triplets kept per task by TSV-M: k = max(1, floor(min(d_out, d_in) / N))."""
    return max(1, min(d_out, d_in) // max(1, n_experts))


def tsv_factors(
    task_vectors: torch.Tensor, full_shape: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TSV-M's U_orth (d_out x m), S (m) and V_orth (d_in x m) for a stack of non-zero task vectors.

    Per task the k = :func:`tsv_rank` leading singular triplets are kept, less those at or below
    :func:`~specmerge.linalg.lowrank.singular_value_floor` (a rank-r task keeps min(k, r)); they are
    concatenated across tasks and U and V are replaced by their polar factors. ``full_shape`` is the
    layer's real shape when ``task_vectors`` are the cores of LoRA experts (it sets k and the tolerance;
    the polar factor of P X is P times that of X, so cores give exactly the dense result).
    """
    if task_vectors.dim() != 3:
        raise ValueError(f"TSV-M needs a stack N x d_out x d_in, got shape {tuple(task_vectors.shape)}")
    n, d_out, d_in = task_vectors.shape
    shape = full_shape or (d_out, d_in)
    k = tsv_rank(*shape, n)
    U, S, Vh = torch.linalg.svd(task_vectors, full_matrices=False)  # batched over the N tasks
    k = min(k, S.shape[1])
    keep = (S[:, :k] > singular_value_floor(S, shape)).reshape(-1)
    U_cat = U[:, :, :k].permute(1, 0, 2).reshape(d_out, n * k)[:, keep]
    S_cat = S[:, :k].reshape(n * k)[keep]
    V_cat = Vh[:, :k, :].reshape(n * k, d_in).T[:, keep]
    return polar_factor(U_cat), S_cat, polar_factor(V_cat)


def tsv_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The N SVDs of the experts, the polar factors of the concatenated U (d_out x N k) and V (d_in x N k), and
    the product back; every expert assumed non-zero."""
    n, d_out, d_in = shape
    m = n * tsv_rank(d_out, d_in, n)
    ops = passes(n, d_out * d_in, itemsize) + svd_ops(n, d_out, d_in, itemsize)
    ops = ops + svd_ops(1, d_out, m, itemsize) + svd_ops(1, d_in, m, itemsize)
    return ops + Operations(matmul=2.0 * (d_out + d_in) * m * m + 2.0 * d_out * m * d_in)


def iso_c_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The sum of the stack, its SVD, and the flattened spectrum multiplied back (every direction kept)."""
    n, d_out, d_in = shape
    ops = passes(n + 1, d_out * d_in, itemsize) + svd_ops(1, d_out, d_in, itemsize)
    return ops + Operations(matmul=2.0 * d_out * d_in * min(d_out, d_in))


@register("tsv_m", citation=TSV_CITATION, title="TSV-M", factored=True, cost=tsv_cost)
def tsv_m(task_vectors: torch.Tensor, *, scale: float = 1.0, full_shape: tuple[int, int] | None = None) -> LayerResult:
    """TSV-M: low-rank task singular vectors of every expert, decorrelated by orthogonalising U and V.

    Each non-zero expert keeps its k = max(1, floor(min(d_out, d_in) / N')) leading singular
    triplets (N' the number of non-zero experts), except zero singular values (a rank-r expert, such
    as a LoRA adapter, keeps min(k, r): the vectors of a zero singular value are arbitrary);
    all-zero experts are left out. Exact on LoRA cores.

    Args:
        scale: alpha in merged = W_0 + alpha * U_orth diag(S) V_orth^T (1.0 as in Gargiulo et al.).
    """
    tau, _ = nonzero_experts(task_vectors)
    n = tau.shape[0]
    if n == 0:
        return LayerResult(torch.zeros_like(task_vectors[0]), {"n_experts": 0, "rank_per_task": 0, "kept_rank": 0})
    U, S, V = tsv_factors(tau, full_shape)
    merged = (U * S) @ V.T
    rank_per_task = tsv_rank(*(full_shape or tau.shape[1:]), n)
    return LayerResult(scale * merged, {"n_experts": n, "rank_per_task": rank_per_task, "kept_rank": S.numel()})


@register("iso_c", citation=ISO_C_CITATION, title="Iso-C", factored=True, cost=iso_c_cost)
def iso_c(task_vectors: torch.Tensor, *, scale: float = 1.0, full_shape: tuple[int, int] | None = None) -> LayerResult:
    """Iso-C: the sum of the task vectors with its spectrum flattened to the mean singular value.

    The mean is over the non-zero singular values of sum_i tau_i (above max(d_out, d_in) * eps *
    sigma_1), and only their directions are kept: on full-rank deltas this is the reference code's
    mean over all min(d_out, d_in) values; on a rank-deficient sum (LoRA experts) the directions of
    zero singular values are arbitrary, so the spectrum is flattened within the span of the task
    vectors instead. Exact on LoRA cores.

    Args:
        scale: alpha in merged = W_0 + alpha * mean(S) U V^T (paper tunes 1.0 to 1.5).
    """
    U, S, Vh = torch.linalg.svd(task_vectors.sum(dim=0), full_matrices=False)
    keep = singular_value_floor(S, full_shape or tuple(task_vectors.shape[1:])) < S
    if not bool(keep.any()):
        return LayerResult(torch.zeros_like(task_vectors[0]), {"mean_singular_value": 0.0, "kept_rank": 0})
    mean_sv = S[keep].mean()
    merged = mean_sv * (U[:, keep] @ Vh[keep])
    return LayerResult(scale * merged, {"mean_singular_value": float(mean_sv), "kept_rank": int(keep.sum())})
