"""The baselines people compare against: weight averaging, task arithmetic, TIES, DARE, TSV-M, Iso-C.

Each method takes the ``N x ...`` stack of expert deltas tau_i = W_i - W_0 for one tensor and returns
``scale * merged_delta``. The building blocks (TIES trim / sign election / disjoint mean, the DARE
mask, the TSV factors) are small public functions so they can be tested and reused on their own.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Annotated

import torch
from pydantic import Field

from specmerge.methods.registry import LayerResult, register
from specmerge.methods.spectral import nonzero_experts

Density = Annotated[float, Field(gt=0, le=1)]
DropRate = Annotated[float, Field(ge=0, lt=1)]

TA_CITATION = "Ilharco et al., Editing Models with Task Arithmetic, ICLR 2023"
TIES_CITATION = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models, NeurIPS 2023"
DARE_CITATION = "Yu et al., Language Models are Super Mario (DARE), ICML 2024"
TSV_CITATION = "Gargiulo et al., Task Singular Vectors: Reducing Task Interference in Model Merging, CVPR 2025"
ISO_C_CITATION = "Marczak et al., No Task Left Behind: Isotropic Model Merging (Iso-C), ICML 2025"


# ---------------------------------------------------------------------------------------------
# Weight average and task arithmetic


@register("weight_average", citation="Wortsman et al., Model Soups, ICML 2022", needs_matrix=False)
def weight_average(
    task_vectors: torch.Tensor, *, scale: float = 1.0, full_shape: tuple[int, int] | None = None
) -> LayerResult:
    """Weight averaging: the mean of the task vectors over all N experts.

    Linear, so it merges the small cores of LoRA experts exactly (``full_shape`` is accepted and unused).

    Args:
        scale: s in merged = W_0 + s * mean_i tau_i (1 gives the plain average of the experts).
    """
    return LayerResult(scale * task_vectors.mean(dim=0), {"n_experts": task_vectors.shape[0]})


@register("task_arithmetic", citation=TA_CITATION, needs_matrix=False)
def task_arithmetic(
    task_vectors: torch.Tensor, *, scale: float = 0.3, full_shape: tuple[int, int] | None = None
) -> LayerResult:
    """Task arithmetic: the sum of the task vectors, scaled by lambda.

    Linear, so it merges the small cores of LoRA experts exactly (``full_shape`` is accepted and unused).

    Args:
        scale: lambda in merged = W_0 + lambda * sum_i tau_i (0.3 as in Ilharco et al.).
    """
    return LayerResult(scale * task_vectors.sum(dim=0), {"n_experts": task_vectors.shape[0]})


# ---------------------------------------------------------------------------------------------
# TIES


def top_k_count(density: float, numel: int) -> int:
    """k = ceil(density * numel), with density read as the decimal it was written as."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    # Fraction(repr(.)) is exact: 0.14 * 100 is 14, not ceil(14.000000000000002) = 15.
    return min(numel, math.ceil(Fraction(repr(float(density))) * numel))


def top_k_rule(values: torch.Tensor, k: int) -> tuple[float, int]:
    """Which entries of a 1-D float tensor are its k largest in magnitude, exactly, in O(numel).

    Returns ``(threshold, last)``: entry j is kept iff ``|v_j| > threshold``, or ``|v_j| == threshold``
    and ``j <= last`` (equal magnitudes at the threshold go in storage order). A radix select on the bit
    patterns, which order like the magnitudes: one histogram of the top 16 bits of |v| finds the bucket
    holding the k-th largest, and a selection among that bucket's entries (about 1/128 of an octave's)
    finishes. 10-20x faster than ``torch.topk`` or ``torch.kthvalue`` on the CPU (BENCHMARKS.md, issue 6).
    """
    n = values.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if values.dtype == torch.float64:
        keys = (values.view(torch.int64) & 0x7FFF_FFFF_FFFF_FFFF).bitwise_right_shift_(48).to(torch.int32)
    else:
        values = values.float()  # exact for 16-bit floats
        keys = (values.view(torch.int32) & 0x7FFF_FFFF).bitwise_right_shift_(16)
    histogram = torch.bincount(keys, minlength=1 << 16)
    from_top = histogram.flip(0).cumsum(0)  # entries in the top j + 1 buckets
    j = int(torch.searchsorted(from_top, k))
    bucket = histogram.numel() - 1 - j
    above = int(from_top[j] - histogram[bucket])  # entries in higher buckets, all larger
    positions = torch.nonzero(keys == bucket).squeeze(1)  # ascending
    candidates = values[positions].abs()
    threshold = torch.kthvalue(candidates, candidates.numel() - (k - above) + 1).values
    missing = k - above - int(torch.count_nonzero(candidates > threshold))
    ties = positions[candidates == threshold]
    return float(threshold), int(ties[missing - 1]) if missing else -1


def kth_largest(values: torch.Tensor, k: int) -> float:
    """The k-th largest magnitude of a 1-D float tensor (see :func:`top_k_rule`)."""
    return top_k_rule(values, k)[0]


def _kept(values: torch.Tensor, rule: tuple[float, int], start: int = 0) -> torch.Tensor:
    """The keep-mask of ``values`` = entries ``start, start + 1, ...`` of the tensor ``rule`` was made for."""
    threshold, last = rule
    magnitudes = values.abs()
    keep = magnitudes > threshold
    if last >= start:
        head = slice(0, last + 1 - start)
        keep[head] |= magnitudes[head] == threshold
    return keep


def top_k_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k entries of largest magnitude of a 1-D tensor; ties at the threshold go by index."""
    if k >= values.numel():
        return torch.ones_like(values, dtype=torch.bool)
    return _kept(values, top_k_rule(values, k))


TIES_CHUNK = 2**16  # entries per expert per chunk: the N x chunk working set of a TIES merge stays in cache


def trim_by_magnitude(task_vectors: torch.Tensor, density: float) -> torch.Tensor:
    """Per expert, keep the k = ceil(density * numel) entries of largest |tau_i| and zero the rest.

    The scope is one tensor of one expert. Of equal magnitudes at the threshold, those first in storage
    order are kept, so the trim is the same on every machine.
    """
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    k = top_k_count(density, flat.shape[1])
    if k == flat.shape[1]:
        return task_vectors.clone()
    zero = flat.new_zeros(())
    trimmed = torch.empty_like(flat)
    for i, tau_i in enumerate(flat):
        torch.where(_kept(tau_i, top_k_rule(tau_i, k)), tau_i, zero, out=trimmed[i])
    return trimmed.reshape(task_vectors.shape)


def elect_sign(task_vectors: torch.Tensor) -> torch.Tensor:
    """The elected sign per entry: sign of the sum over experts (0 where the sum is exactly 0)."""
    return torch.sign(task_vectors.sum(dim=0))


def disjoint_mean(task_vectors: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """Per entry, the mean over the experts whose entry is non-zero with the elected sign; 0 where none."""
    total = torch.zeros_like(sign)
    count = torch.zeros_like(sign)
    zero = sign.new_zeros(())
    for tau_i in task_vectors:  # one expert at a time: no N x tensor temporaries
        agree = (tau_i * sign) > 0  # the same non-zero sign (sign is -1, 0 or +1)
        total.add_(torch.where(agree, tau_i, zero))
        count.add_(agree)
    return total.div_(count.clamp_(min=1))


def _sign_diagnostics(sign: torch.Tensor) -> dict:
    return {"sign_tie_fraction": float((sign == 0).double().mean())} if sign.numel() else {}


@register("ties", citation=TIES_CITATION, needs_matrix=False)
def ties(task_vectors: torch.Tensor, *, density: Density = 0.2, scale: float = 1.0) -> LayerResult:
    """TIES-Merging: trim each task vector to its largest entries, elect a sign per entry, average the agreeing.

    The trim is per expert and per tensor (the public code also offers a whole-model trim; per tensor
    is what streaming allows). The merge is the disjoint mean, not the sum. Where the trimmed values
    sum to exactly zero no sign is elected and the entry stays at W_0 (the original code breaks such
    ties with the model-wide majority sign, mergekit with +).

    Args:
        density: fraction of entries kept per expert and tensor, k = ceil(density * numel), in (0, 1].
        scale: lambda in merged = W_0 + lambda * disjoint_mean (1.0 as in Yadav et al.).
    """
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    k = top_k_count(density, flat.shape[1])
    rules = [top_k_rule(tau_i, k) if k < flat.shape[1] else (-math.inf, -1) for tau_i in flat]
    merged = torch.empty(flat.shape[1], dtype=flat.dtype, device=flat.device)
    chunk = max(1, TIES_CHUNK if flat.device.type == "cpu" else flat.shape[1])  # GPUs: one chunk, no syncs
    trimmed = torch.empty((flat.shape[0], min(chunk, flat.shape[1])), dtype=flat.dtype, device=flat.device)
    zero, ties_at_zero = flat.new_zeros(()), torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[1], chunk):  # the trim, the election and the mean, chunk by chunk
        stop = min(start + chunk, flat.shape[1])
        block = trimmed[:, : stop - start]
        for i, rule in enumerate(rules):
            tau = flat[i, start:stop]
            torch.where(_kept(tau, rule, start), tau, zero, out=block[i])
        sign = elect_sign(block)
        ties_at_zero += torch.count_nonzero(sign == 0)
        merged[start:stop] = disjoint_mean(block, sign)
    diagnostics = {"n_experts": task_vectors.shape[0]}
    if merged.numel():
        diagnostics["sign_tie_fraction"] = int(ties_at_zero) / merged.numel()
    return LayerResult(merged.mul_(scale).reshape(task_vectors.shape[1:]), diagnostics)


# ---------------------------------------------------------------------------------------------
# DARE


def _check_drop_rate(drop_rate: float) -> None:
    if not 0 <= drop_rate < 1:
        raise ValueError(f"DARE drop_rate must be in [0, 1), got {drop_rate}")


def dare_seed(seed: int, tensor_name: str, expert_key: str) -> int:
    """A 64-bit generator seed that depends on (seed, tensor name, expert key) only."""
    digest = hashlib.blake2b(f"{seed}\0{tensor_name}\0{expert_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def dare_mask(
    shape: Sequence[int] | torch.Size,
    drop_rate: float,
    seed: int,
    tensor_name: str,
    expert_key: str,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean keep-mask, each entry kept with probability 1 - drop_rate.

    The mask is a function of (shape, drop_rate, seed, tensor_name, expert_key) only: it is drawn on
    the CPU from its own generator, so it is the same on every device, in every processing order,
    and it leaves the global random state untouched.
    """
    _check_drop_rate(drop_rate)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(dare_seed(seed, tensor_name, expert_key))
    keep = torch.rand(tuple(shape), generator=generator, dtype=torch.float32) >= drop_rate
    return keep if device is None else keep.to(device)


def dare(
    task_vectors: torch.Tensor,
    drop_rate: float,
    seed: int,
    tensor_name: str,
    expert_keys: Sequence[str] | None = None,
) -> torch.Tensor:
    """Drop each entry of each tau_i with probability drop_rate and rescale the kept ones by 1 / (1 - drop_rate).

    ``expert_keys`` names the experts in stack order (default ``"0", "1", ...``); the mask of an
    expert depends on its key, not on its position in the stack.
    """
    _check_drop_rate(drop_rate)
    n = task_vectors.shape[0]
    keys = [str(i) for i in range(n)] if expert_keys is None else list(expert_keys)
    if len(keys) != n:
        raise ValueError(
            f"tensor '{tensor_name or '?'}': got {len(keys)} expert keys for a stack of {n} experts; "
            "pass one key per expert, in stack order"
        )
    if drop_rate == 0:
        return task_vectors.clone()
    rescale = 1.0 / (1.0 - drop_rate)
    out = torch.zeros_like(task_vectors)
    for i, key in enumerate(keys):
        keep = dare_mask(task_vectors.shape[1:], drop_rate, seed, tensor_name, key, task_vectors.device)
        out[i] = torch.where(keep, task_vectors[i] * rescale, out[i])
    return out


@register("dare_task_arithmetic", citation=DARE_CITATION, needs_matrix=False)
def dare_task_arithmetic(
    task_vectors: torch.Tensor,
    *,
    drop_rate: DropRate = 0.5,
    seed: int = 0,
    scale: float = 0.3,
    tensor_name: str = "",
    expert_keys: Sequence[str] | None = None,
) -> LayerResult:
    """DARE + task arithmetic: randomly drop and rescale each task vector, then sum.

    The random mask is a function of (seed, tensor name, expert key), so a merge is reproducible
    whatever the order in which tensors are processed.

    Args:
        drop_rate: probability p of dropping an entry, in [0, 1); kept entries are divided by 1 - p.
        seed: seed of the random masks; the same seed gives the same merge.
        scale: lambda in merged = W_0 + lambda * sum_i DARE(tau_i).
    """
    dropped = dare(task_vectors, drop_rate, seed, tensor_name, expert_keys)
    return LayerResult(scale * dropped.sum(dim=0), {"n_experts": task_vectors.shape[0], "drop_rate": drop_rate})


@register("dare_ties", citation=DARE_CITATION, needs_matrix=False)
def dare_ties(
    task_vectors: torch.Tensor,
    *,
    drop_rate: DropRate = 0.5,
    seed: int = 0,
    scale: float = 1.0,
    tensor_name: str = "",
    expert_keys: Sequence[str] | None = None,
) -> LayerResult:
    """DARE + TIES: randomly drop and rescale each task vector, then elect signs and take the disjoint mean.

    The random drop replaces the TIES magnitude trim (as in mergekit's dare_ties). The random mask is
    a function of (seed, tensor name, expert key), whatever the processing order.

    Args:
        drop_rate: probability p of dropping an entry, in [0, 1); kept entries are divided by 1 - p.
        seed: seed of the random masks; the same seed gives the same merge.
        scale: lambda in merged = W_0 + lambda * disjoint_mean.
    """
    dropped = dare(task_vectors, drop_rate, seed, tensor_name, expert_keys)
    sign = elect_sign(dropped)
    merged = disjoint_mean(dropped, sign)
    diagnostics = {"n_experts": task_vectors.shape[0], "drop_rate": drop_rate, **_sign_diagnostics(sign)}
    return LayerResult(scale * merged, diagnostics)


# ---------------------------------------------------------------------------------------------
# TSV-M and Iso-C


def _check_matrix_stack(task_vectors: torch.Tensor, method: str) -> None:
    if task_vectors.dim() != 3:
        raise ValueError(f"{method} needs a stack N x d_out x d_in, got shape {tuple(task_vectors.shape)}")


def singular_value_floor(S: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The numerical-rank tolerance max(d_out, d_in) * eps * sigma_1 (per matrix, for batched ``S``).

    Singular values at or below it are structural zeros (a rank-deficient delta, e.g. a LoRA
    expert); their singular vectors are arbitrary, so TSV-M and Iso-C leave them out.
    """
    return max(shape) * torch.finfo(S.dtype).eps * S[..., :1]


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
    :func:`singular_value_floor` (a rank-r task keeps min(k, r)); they are concatenated across tasks
    and U and V are replaced by their polar factors. ``full_shape`` is the layer's real shape when
    ``task_vectors`` are the cores of LoRA experts (it sets k and the tolerance; the polar factor of
    P X is P times that of X, so cores give exactly the dense result).
    """
    _check_matrix_stack(task_vectors, "TSV-M")
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


@register("tsv_m", citation=TSV_CITATION, needs_matrix=True)
def tsv_m(task_vectors: torch.Tensor, *, scale: float = 1.0, full_shape: tuple[int, int] | None = None) -> LayerResult:
    """TSV-M: low-rank task singular vectors of every expert, decorrelated by orthogonalising U and V.

    Each non-zero expert keeps its k = max(1, floor(min(d_out, d_in) / N')) leading singular
    triplets (N' the number of non-zero experts), except zero singular values (a rank-r expert, such
    as a LoRA adapter, keeps min(k, r): the vectors of a zero singular value are arbitrary);
    all-zero experts are left out. Exact on LoRA cores.

    Args:
        scale: alpha in merged = W_0 + alpha * U_orth diag(S) V_orth^T (1.0 as in Gargiulo et al.).
    """
    _check_matrix_stack(task_vectors, "TSV-M")
    tau, _ = nonzero_experts(task_vectors)
    n = tau.shape[0]
    if n == 0:
        return LayerResult(torch.zeros_like(task_vectors[0]), {"n_experts": 0, "rank_per_task": 0, "kept_rank": 0})
    U, S, V = tsv_factors(tau, full_shape)
    merged = (U * S) @ V.T
    rank_per_task = tsv_rank(*(full_shape or tau.shape[1:]), n)
    return LayerResult(scale * merged, {"n_experts": n, "rank_per_task": rank_per_task, "kept_rank": S.numel()})


@register("iso_c", citation=ISO_C_CITATION, needs_matrix=True)
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
    _check_matrix_stack(task_vectors, "Iso-C")
    U, S, Vh = torch.linalg.svd(task_vectors.sum(dim=0), full_matrices=False)
    keep = singular_value_floor(S, full_shape or tuple(task_vectors.shape[1:])) < S
    if not bool(keep.any()):
        return LayerResult(torch.zeros_like(task_vectors[0]), {"mean_singular_value": 0.0, "kept_rank": 0})
    mean_sv = S[keep].mean()
    merged = mean_sv * (U[:, keep] @ Vh[keep])
    return LayerResult(scale * merged, {"mean_singular_value": float(mean_sv), "kept_rank": int(keep.sum())})
