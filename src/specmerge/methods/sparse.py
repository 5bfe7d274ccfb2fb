"""Sparsifying merges: TIES, DARE (+ task arithmetic or + TIES) and Model Breadcrumbs.

Each drops entries of every task vector (by magnitude or at random) before combining them; all are
elementwise (any tensor shape). The building blocks (TIES sign election and disjoint mean, the DARE
mask) are small public functions so they can be tested and reused on their own; the top-k selection
is :mod:`specmerge.linalg.topk`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field

from specmerge.linalg.topk import KEEP_ALL, fraction_count, keep_mask, top_k_count, top_k_rule
from specmerge.methods.linear import weighted_sum
from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.registry import LayerResult, Setting, register, register_variant

Density = Annotated[float, Field(gt=0, le=1)]
DropRate = Annotated[float, Field(ge=0, lt=1)]

TIES_CITATION = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models, NeurIPS 2023"
DARE_CITATION = "Yu et al., Language Models are Super Mario (DARE), ICML 2024"
BREADCRUMBS_CITATION = (
    "Davari & Belilovsky, Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks, ECCV 2024"
)

TIES_CHUNK = 2**16  # entries per expert per chunk: the N x chunk working set of a TIES merge stays in cache


# ---------------------------------------------------------------------------------------------
# Costs (:mod:`specmerge.methods.operations`): passes over the N x numel stack, counted from the code below


def ties_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert a top-k selection (keys formed: 6 passes) and, chunk by chunk, the trim, election and disjoint
    mean (about 21 passes); the merged tensor."""
    n, x = shape[0], numel(shape[1:])
    return passes(27 * n + 6, x, itemsize) + Operations(select=n * x, workspace=x * (itemsize + 4))


def dare_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert a random mask (drawn in float32, compared) and the rescaled copy into a second stack; then the
    sum, or the election and disjoint mean (``combine``)."""
    n, x = shape[0], numel(shape[1:])
    combine = 2 * n + 2 if params.get("combine") == "sum" else 15 * n + 6
    ops = passes(2 * n + combine, x, itemsize) + Operations(workspace=n * x * itemsize)
    if params.get("drop_rate"):
        ops = ops + passes(10 * n, x, itemsize) + Operations(random=n * x, workspace=n * x * itemsize + 5 * x)
    return ops


def breadcrumbs_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert two top-k selections and the band's masks (about 16 passes), the masked stack and its sum."""
    n, x = shape[0], numel(shape[1:])
    return passes(16 * n + n + 2, x, itemsize) + Operations(select=2 * n * x, workspace=n * x * (itemsize + 1))


# ---------------------------------------------------------------------------------------------
# TIES


def elect_sign(task_vectors: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """The elected sign per entry: sign of the (weighted: sum_i w_i tau_i) sum over experts (0 where it is 0)."""
    return torch.sign(task_vectors.sum(dim=0) if weights is None else weighted_sum(task_vectors, weights))


def disjoint_mean(
    task_vectors: torch.Tensor, sign: torch.Tensor, weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Per entry, the mean over the experts whose entry is non-zero with the elected sign; 0 where none.

    With positive ``weights`` the weighted mean over the same experts: sum_i w_i tau_i / sum_i w_i, both over the
    agreeing experts (what TIES computes on weighted task vectors w_i tau_i, normalized by their weights).
    """
    total = torch.zeros_like(sign)
    count = torch.zeros_like(sign)
    zero = sign.new_zeros(())
    for i, tau_i in enumerate(task_vectors):  # one expert at a time: no N x tensor temporaries
        agree = (tau_i * sign) > 0  # the same non-zero sign (sign is -1, 0 or +1)
        w_i = 1.0 if weights is None else weights[i]  # alpha 1 adds exactly as without it
        total.add_(torch.where(agree, tau_i, zero), alpha=w_i)
        count.add_(agree, alpha=w_i)
    return total.div_(torch.where(count > 0, count, 1))  # no agreeing expert: 0 / 1


@register(
    "ties",
    citation=TIES_CITATION,
    title="TIES",
    needs_matrix=False,
    settings=[Setting("ties", "TIES (top 20 %)")],
    cost=ties_cost,
    weights="positive",
)
def ties(
    task_vectors: torch.Tensor, *, density: Density = 0.2, scale: float = 1.0, weights: Sequence[float] | None = None
) -> LayerResult:
    """TIES-Merging: trim each task vector to its largest entries, elect a sign per entry, average the agreeing.

    The trim is per expert and per tensor (the public code also offers a whole-model trim; per tensor
    is what streaming allows); of equal magnitudes at the threshold, those first in storage order are
    kept, so the trim is the same on every machine. The merge is the disjoint mean, not the sum. Where
    the trimmed values sum to exactly zero no sign is elected and the entry stays at W_0 (the original
    code breaks such ties with the model-wide majority sign, mergekit with +). With expert weights w_i the
    sign is elected from sum_i w_i trim(tau_i) and the mean is weighted (:func:`disjoint_mean`), as mergekit does.

    Args:
        density: fraction of entries kept per expert and tensor, k = ceil(density * numel), in (0, 1].
        scale: lambda in merged = W_0 + lambda * disjoint_mean (1.0 as in Yadav et al.).
    """
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    k = top_k_count(density, flat.shape[1])
    rules = [top_k_rule(tau_i, k) if k < flat.shape[1] else KEEP_ALL for tau_i in flat]
    merged = torch.empty(flat.shape[1], dtype=flat.dtype, device=flat.device)
    chunk = max(1, TIES_CHUNK if flat.device.type == "cpu" else flat.shape[1])  # GPUs: one chunk, no syncs
    trimmed = torch.empty((flat.shape[0], min(chunk, flat.shape[1])), dtype=flat.dtype, device=flat.device)
    zero, ties_at_zero = flat.new_zeros(()), torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[1], chunk):  # the trim, the election and the mean, chunk by chunk
        stop = min(start + chunk, flat.shape[1])
        block = trimmed[:, : stop - start]
        for i, rule in enumerate(rules):
            tau = flat[i, start:stop]
            torch.where(keep_mask(tau, rule, start), tau, zero, out=block[i])
        sign = elect_sign(block, weights)
        ties_at_zero += torch.count_nonzero(sign == 0)
        merged[start:stop] = disjoint_mean(block, sign, weights)
    diagnostics = {"n_experts": task_vectors.shape[0]}
    if merged.numel():
        diagnostics["sign_tie_fraction"] = int(ties_at_zero) / merged.numel()
    return LayerResult(merged.mul_(scale).reshape(task_vectors.shape[1:]), diagnostics)


# ---------------------------------------------------------------------------------------------
# DARE


CONTENT_SAMPLE = 65536  # entries of a task vector (evenly strided) that identify it for its random mask


def content_key(task_vector: torch.Tensor) -> str:
    """What names an expert's task vector of one tensor for its random mask when no key is given: a digest of up
    to :data:`CONTENT_SAMPLE` of its entries (evenly strided, as float32), so that the mask is a function of the
    expert's weights, never of its folder name or its place in the list."""
    flat = task_vector.reshape(-1)
    step = max(1, flat.numel() // CONTENT_SAMPLE)
    sample = flat[::step][:CONTENT_SAMPLE].to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.blake2b(sample.numpy().tobytes(), digest_size=8).hexdigest()


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
    """Boolean keep-mask, each entry kept with probability 1 - drop_rate (in [0, 1)).

    The mask is a function of (shape, drop_rate, seed, tensor_name, expert_key) only: it is drawn on
    the CPU from its own generator, so it is the same on every device, in every processing order,
    and it leaves the global random state untouched.
    """
    keep = uniform_draws(shape, seed, tensor_name, expert_key) >= drop_rate
    return keep if device is None else keep.to(device)


def uniform_draws(shape: Sequence[int] | torch.Size, seed: int, tensor_name: str, expert_key: str) -> torch.Tensor:
    """float32 uniforms in [0, 1) on the CPU from a generator of their own, seeded by :func:`dare_seed`: the same
    draws on every device and in every order, and the global random state untouched (DARE's and DELLA's masks)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(dare_seed(seed, tensor_name, expert_key))
    return torch.rand(tuple(shape), generator=generator, dtype=torch.float32)


def mask_keys(task_vectors: torch.Tensor, expert_keys: Sequence[str] | None, tensor_name: str) -> list[str]:
    """The key of each expert's random mask, in stack order: ``expert_keys``, or by default each task vector's own
    :func:`content_key`; one per expert."""
    n = task_vectors.shape[0]
    keys = [content_key(task_vectors[i]) for i in range(n)] if expert_keys is None else list(expert_keys)
    if len(keys) != n:
        raise ValueError(
            f"tensor '{tensor_name or '?'}': got {len(keys)} expert keys for a stack of {n} experts; "
            "pass one key per expert, in stack order"
        )
    return keys


def dare(
    task_vectors: torch.Tensor,
    drop_rate: float,
    seed: int,
    tensor_name: str,
    expert_keys: Sequence[str] | None = None,
) -> torch.Tensor:
    """Drop each entry of each tau_i with probability drop_rate in [0, 1), rescale the kept ones by 1 / (1 - drop_rate).

    ``expert_keys`` names the experts in stack order; by default each expert's task vector names itself
    (:func:`content_key`). Either way the mask of an expert depends on its key, not on its position in the stack,
    so a merge is a function of the weights, the recipe and ``seed`` (copies of the experts in renamed folders
    give the same masks).
    """
    keys = mask_keys(task_vectors, expert_keys, tensor_name)
    if drop_rate == 0:
        return task_vectors.clone()
    rescale = 1.0 / (1.0 - drop_rate)
    out = torch.zeros_like(task_vectors)
    for i, key in enumerate(keys):
        keep = dare_mask(task_vectors.shape[1:], drop_rate, seed, tensor_name, key, task_vectors.device)
        out[i] = torch.where(keep, task_vectors[i] * rescale, out[i])
    return out


@register(
    "dare_task_arithmetic",
    citation=DARE_CITATION,
    title="DARE-TA",
    needs_matrix=False,
    seeded=True,
    fixed={"combine": "sum"},
    settings=[Setting("dare_task_arithmetic", "DARE-TA (p = 0.5)")],
    cost=dare_cost,
    weights="any",
)
def dare_task_arithmetic(
    task_vectors: torch.Tensor,
    *,
    combine: Literal["sum", "disjoint_mean"],
    drop_rate: DropRate = 0.5,
    seed: int = 0,
    scale: float = 0.3,
    tensor_name: str = "",
    expert_keys: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """DARE + task arithmetic: randomly drop and rescale each task vector, then sum (weighted: sum_i w_i DARE(tau_i)).

    ``combine`` is the declared difference of the variant DARE-TIES: ``disjoint_mean`` elects signs and
    takes TIES's disjoint mean of the dropped task vectors instead of their sum (the random drop replaces
    the TIES magnitude trim, as in mergekit's dare_ties). The random mask is a function of (seed, tensor
    name, expert key), so a merge is reproducible whatever the order in which tensors are processed.

    Args:
        drop_rate: probability p of dropping an entry, in [0, 1); kept entries are divided by 1 - p.
        seed: seed of the random masks; the same seed gives the same merge.
        scale: lambda in merged = W_0 + lambda * sum_i DARE(tau_i) (DARE-TIES: lambda * disjoint_mean).
    """
    dropped = dare(task_vectors, drop_rate, seed, tensor_name, expert_keys)
    return combine_dropped(dropped, combine, scale, weights, {"drop_rate": drop_rate})


def combine_dropped(
    dropped: torch.Tensor, combine: str, scale: float, weights: Sequence[float] | None, diagnostics: dict
) -> LayerResult:
    """lambda * the (weighted) sum of sparsified task vectors, or (``disjoint_mean``) lambda * their (weighted)
    disjoint mean under the elected signs."""
    diagnostics = {"n_experts": dropped.shape[0], **diagnostics}
    if combine == "sum":
        total = dropped.sum(dim=0) if weights is None else weighted_sum(dropped, weights)
        return LayerResult(scale * total, diagnostics)
    sign = elect_sign(dropped, weights)
    merged = disjoint_mean(dropped, sign, weights)
    if sign.numel():
        diagnostics["sign_tie_fraction"] = float((sign == 0).double().mean())
    return LayerResult(scale * merged, diagnostics)


dare_linear = register_variant(
    "dare_linear",
    dare_task_arithmetic,
    title="DARE-linear",
    summary="DARE + task arithmetic under mergekit's name (dare_linear): the sum of the dropped, rescaled task "
    "vectors, lambda 1 by default.",
    defaults={"scale": 1.0},
    featured=False,
    settings=(),
)

dare_ties = register_variant(
    "dare_ties",
    dare_task_arithmetic,
    title="DARE-TIES",
    summary="DARE + TIES: randomly drop and rescale each task vector, then elect signs and take the disjoint mean.",
    fixed={"combine": "disjoint_mean"},
    defaults={"scale": 1.0},
    settings=[Setting("dare_ties", "DARE-TIES (p = 0.5)")],
    weights="positive",
)


# ---------------------------------------------------------------------------------------------
# Model Breadcrumbs


@register(
    "breadcrumbs",
    citation=BREADCRUMBS_CITATION,
    title="Model Breadcrumbs",
    needs_matrix=False,
    cost=breadcrumbs_cost,
    weights="any",
)
def breadcrumbs(
    task_vectors: torch.Tensor,
    *,
    density: Density = 0.9,
    beta: DropRate = 0.01,
    scale: float = 0.3,
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """Model Breadcrumbs: keep a band of each task vector's magnitudes (no outliers, no small entries), then sum.

    Per expert and tensor, the m = floor(beta * numel) entries of largest |tau_i| are dropped, the
    next k = ceil(density * numel) are kept (at most numel - m), and the smallest rest is dropped; the
    masked task vectors are summed (weighted: sum_i w_i band(tau_i)) and scaled, as in task arithmetic. Of
    equal magnitudes at either edge of the band, those first in storage order rank higher, so the band is the
    same on every machine.

    Args:
        density: fraction of entries kept per expert and tensor, k = ceil(density * numel), in (0, 1].
        beta: fraction of largest-magnitude entries dropped first, m = floor(beta * numel), in [0, 1).
        scale: lambda in merged = W_0 + lambda * sum_i band(tau_i) (0.3 as for task arithmetic).
    """
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    numel = flat.shape[1]
    top = fraction_count(beta, numel, round_up=False)
    kept = min(top_k_count(density, numel), numel - top)
    band = torch.empty(flat.shape, dtype=torch.bool, device=flat.device)
    for i, tau_i in enumerate(flat):
        band[i] = keep_mask(tau_i, KEEP_ALL if top + kept == numel else top_k_rule(tau_i, top + kept))
        if top:
            band[i] &= ~keep_mask(tau_i, top_k_rule(tau_i, top))
    masked = torch.where(band, flat, flat.new_zeros(())).reshape(task_vectors.shape)
    diagnostics = {"n_experts": task_vectors.shape[0], "kept_per_expert": kept, "dropped_largest": top}
    total = masked.sum(dim=0) if weights is None else weighted_sum(masked, weights)
    return LayerResult(scale * total, diagnostics)
