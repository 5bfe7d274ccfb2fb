"""mergekit's convention of the sparsifying task-arithmetic family (TIES, DARE, DELLA, Model Breadcrumbs).

mergekit implements TIES, DARE-TIES, DARE-linear, DELLA, DELLA-linear, Breadcrumbs and Breadcrumbs-TIES as one
"generalized task arithmetic": sparsify each task vector, weight it, optionally elect signs, sum, optionally
normalize, scale by lambda. Its arithmetic differs from the papers' (and specmerge's default ``convention:
paper``) in small ways that a mergekit config relies on; ``convention: mergekit`` on those methods computes this
module's definition, which is mergekit 0.1.5's (worked out from its documentation and outputs, and compared with
them on the corpus of ``tests/mergekit_corpus``):

- **magnitude trim** (TIES): k = max(1, floor(density * numel)) entries of largest |tau| are kept (the paper
  convention keeps ceil(density * numel)); density >= 1 keeps all, density <= 0 none;
- **random drop** (DARE): each entry kept with probability ``density``; ``rescale`` multiplies the kept entries so
  that the task vector's L1 norm is unchanged (mergekit's rescale; the paper divides by the keep probability);
- **DELLA's MagPrune**: keep probabilities density - epsilon + 2 epsilon u, u the entry's magnitude rank along the
  tensor's second axis (within a row of a matrix; a 1-D tensor is one row) over (length - 1); ``rescale`` as DARE's
  (L1), not 1 / p per entry; density -/+ epsilon must lie in (0, 1);
- **Breadcrumbs' band**: of the n entries ranked by magnitude, floor(density n) are kept just below the
  floor(gamma n) largest; when the two do not fit, fewer outliers are dropped (the paper drops all of them and
  keeps fewer); density >= 1 keeps every entry, outliers too;
- **weights before the election**: each sparsified tau_i is multiplied by its weight w_i, then the sign of each
  entry is elected from sum_i w_i tau_i, **+ where that sum is 0** (the paper convention elects none there);
  an expert agrees where the sign of w_i tau_i is the elected one;
- **normalize**: the sum of the (agreeing) weighted entries is divided by the sum of the (agreeing) weights, 1
  where that sum is 0 (or, without an election, below 1e-8 in magnitude); without normalize the sum is taken as it
  is (mergekit's dare_ties, breadcrumbs, DARE-linear and DELLA-linear default);
- **lambda** multiplies the result.

Random draws are specmerge's (:func:`specmerge.methods.draws.dare_mask`: a function of the seed, the tensor name
and the expert's task vector), so random methods agree with mergekit in distribution, not entry by entry (mergekit
draws from torch's global generator). Of equal magnitudes at a threshold, those first in storage order are kept
(mergekit leaves that to its sort); random task vectors have no such ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from specmerge.linalg.topk import KEEP_ALL, keep_mask, top_k_rule
from specmerge.methods.draws import mask_keys, uniform_draws

Convention = Literal["paper", "mergekit"]
Sparsifier = Literal["none", "magnitude", "random", "della", "band"]
L1_FLOOR = 1e-7  # norms below this are not rescaled (mergekit's tolerance)
DIVISOR_FLOOR = 1e-8  # a sum of weights below this divides as 1 (mergekit's, without an election)


@dataclass(frozen=True)
class Sparsify:
    """How each task vector is sparsified, with its per-expert values (one per expert)."""

    kind: Sparsifier
    density: tuple[float, ...]
    rescale: bool = False
    gamma: tuple[float, ...] = ()  # band: the outlier fraction
    epsilon: tuple[float, ...] = ()  # della: the half-width of the keep probabilities
    seed: int = 0
    tensor_name: str = ""
    keys: Sequence[str] = ()  # the experts' mask keys (random kinds)


def check_rescale(params: dict) -> None:
    """Refuse ``rescale`` (mergekit's L1 rescale of a trimmed task vector) in the paper convention, which has none."""
    if params.get("rescale") and params.get("convention") != "mergekit":
        raise ValueError(
            "rescale (each sparsified task vector scaled back to its L1 norm) is mergekit's: set convention: mergekit"
        )


def per_expert_values(value: float | Sequence[float], n: int) -> tuple[float, ...]:
    """A parameter's value for each of ``n`` experts: one value for all, or a value per expert."""
    return tuple(float(v) for v in value) if isinstance(value, tuple | list) else (float(value),) * n


def l1_rescaled(tau: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kept`` (tau with entries dropped) scaled to tau's L1 norm; as it is when either norm is below 1e-7."""
    before, after = tau.abs().sum(), kept.abs().sum()  # the ratio in the tensor's dtype, as mergekit's
    return kept if before < L1_FLOOR or after < L1_FLOOR else kept.mul_(before / after)


def kept_by(tau: torch.Tensor, keep: torch.Tensor, rescale: bool) -> torch.Tensor:
    kept = torch.where(keep, tau, tau.new_zeros(()))
    return l1_rescaled(tau, kept) if rescale else kept


def magnitude(tau: torch.Tensor, density: float, rescale: bool) -> torch.Tensor:
    """The max(1, floor(density n)) entries of largest magnitude (density >= 1: all; <= 0: none)."""
    if density >= 1:
        return tau.clone()
    if density <= 0 or tau.numel() == 0:
        return torch.zeros_like(tau)
    flat = tau.reshape(-1)
    k = max(1, int(density * flat.numel()))
    return kept_by(flat, keep_mask(flat, top_k_rule(flat, k)), rescale).reshape(tau.shape)


def band(tau: torch.Tensor, density: float, gamma: float, rescale: bool) -> torch.Tensor:
    """Breadcrumbs: floor(density n) entries kept just below the floor(gamma n) largest magnitudes (fewer outliers
    dropped when both do not fit); density >= 1 keeps all."""
    if density >= 1:
        return tau.clone()
    flat = tau.reshape(-1)
    n = flat.numel()
    target, top = int(density * n), int(gamma * n)
    above = n - max(0, n - target - top)  # entries ranked above the dropped small ones
    keep = keep_mask(flat, KEEP_ALL if above == n else top_k_rule(flat, above)) if above else flat.new_zeros(n).bool()
    if above - target > 0:
        keep &= ~keep_mask(flat, top_k_rule(flat, above - target))
    return kept_by(flat, keep, rescale).reshape(tau.shape)


def della_probabilities(tau: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """Keep probabilities density - epsilon + 2 epsilon u, u the magnitude rank along the second axis (a 1-D tensor
    is one row) over (length - 1), equal magnitudes in storage order; a length of 1 takes ``density``."""
    rows = tau.reshape(1, -1) if tau.dim() < 2 else tau
    length = rows.shape[1]
    if length < 2:
        return torch.full(tau.shape, density, dtype=torch.float32, device=tau.device)
    order = torch.argsort(rows.abs(), dim=1, stable=True)
    positions = torch.arange(length, device=tau.device).reshape(1, length, *([1] * (rows.dim() - 2)))
    ranks = torch.empty_like(order).scatter_(1, order, positions.expand_as(order))
    u = ranks.to(torch.float32).div_(length - 1)
    return u.mul_(2 * epsilon).add_(density - epsilon).reshape(tau.shape)


def sparsify(task_vectors: torch.Tensor, how: Sparsify) -> torch.Tensor:
    """Each tau_i sparsified as ``how`` says (a new stack)."""
    out = torch.empty_like(task_vectors)
    for i, tau in enumerate(task_vectors):
        density = how.density[i]
        if how.kind == "none":
            out[i] = tau
        elif how.kind == "magnitude":
            out[i] = magnitude(tau, density, how.rescale)
        elif how.kind == "band":
            out[i] = band(tau, density, how.gamma[i], how.rescale)
        elif density >= 1:
            out[i] = tau
        elif density <= 0:
            out[i] = 0
        else:
            draws = uniform_draws(tau.shape, how.seed, how.tensor_name, how.keys[i]).to(tau.device)
            if how.kind == "random":
                keep = draws >= 1 - density  # DARE's mask at drop rate 1 - density
            else:
                keep = draws < della_probabilities(tau, density, how.epsilon[i])
            out[i] = kept_by(tau, keep, how.rescale)
    return out


def combine(sparse: torch.Tensor, weights: Sequence[float], elect: bool, normalize: bool, scale: float) -> torch.Tensor:
    """lambda * sum_i w_i tau_i (over the experts agreeing with the elected sign when ``elect``), divided by the sum
    of their weights when ``normalize``."""
    total = torch.zeros_like(sparse[0])
    divisor = torch.zeros_like(sparse[0])
    if elect:
        positive = weighted_total(sparse, weights) >= 0  # the elected sign: + where the weighted sum is >= 0
        for tau, w in zip(sparse, weights, strict=True):
            weighted = tau * w
            agree = torch.where(positive, weighted > 0, weighted < 0)
            total += torch.where(agree, weighted, 0)
            divisor += agree * w
        divisor = torch.where(divisor == 0, 1, divisor)
    else:
        for tau, w in zip(sparse, weights, strict=True):
            total += tau * w  # rounded as the product, then the sum (not fused)
        weight_total = float(sum(weights))
        divisor = divisor.fill_(1 if abs(weight_total) < DIVISOR_FLOOR else weight_total)
    if normalize:
        total /= divisor
    return total.mul_(scale) if scale != 1 else total


def weighted_total(stack: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    total = torch.zeros_like(stack[0])
    for tau, w in zip(stack, weights, strict=True):
        total += tau * w  # as the election sees it: the sum of the weighted entries
    return total


def merge(
    task_vectors: torch.Tensor,
    how: Sparsify,
    *,
    weights: Sequence[float] | None,
    elect: bool,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    """mergekit's generalized task arithmetic of one stack: :func:`sparsify`, then :func:`combine`."""
    n = task_vectors.shape[0]
    w = (1.0,) * n if weights is None else tuple(float(x) for x in weights)
    return combine(sparsify(task_vectors, how), w, elect, normalize, scale)


def merge_drawn(
    task_vectors: torch.Tensor,
    how: Sparsify,
    expert_keys: Sequence[str] | None,
    *,
    weights: Sequence[float] | None,
    elect: bool,
    normalize: bool,
    scale: float,
) -> torch.Tensor:
    """:func:`merge` with random masks (DARE's, DELLA's) keyed by ``expert_keys`` (default: each task vector's
    content, :func:`specmerge.methods.draws.mask_keys`)."""
    keys = mask_keys(task_vectors, expert_keys, how.tensor_name)
    how = dataclasses.replace(how, keys=keys)
    return merge(task_vectors, how, weights=weights, elect=elect, normalize=normalize, scale=scale)
