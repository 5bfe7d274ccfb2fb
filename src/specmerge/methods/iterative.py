"""Iterative references: WUDI and OptMerge by gradient descent on their quadratic losses (paper Sec. 3.1).

Every method here runs the same loop, :func:`descend`, and differs only in how the gradient is
obtained: ``wudi`` uses the precomputed 2 (tau C - D) of the WUDI normal equation (paper Prop. 1),
``wudi_reference`` differentiates the explicit per-expert loss with autograd at every step, as the
published WUDI code does, and ``optmerge`` / ``optmerge_lora`` use 2 (tau C_P - D_P) of the loss
with a rank-k proxy P_i in place of tau_i. Plain SGD with step a is exactly the Landweber iteration
with eta = 2a: ``wudi(optimizer="sgd", lr=a, steps=n)`` equals the Landweber filter (eta 2a, n steps).

Note on OptMerge: this module follows the paper's description (the centred, truncated P_i replaces
the proxy tau_i^T; the target tau_i is unchanged). Public ports of the OptMerge code for full
fine-tuning instead truncate the uncentred tau_i for the proxy and use mean + rank-k(tau_i - mean)
as the target. For the LoRA variant both readings give the same loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol

import torch
from pydantic import Field

from specmerge.methods.registry import Count, LayerResult, NonNegative, Positive, register
from specmerge.methods.spectral import (
    WUDI_CITATION,
    TauInit,
    expert_norms_sq,
    initial_point,
    nonzero_experts,
    normal_equation,
    proxy_loss,
)

Optimizer = Literal["adam", "sgd"]
Gradient = Callable[[torch.Tensor], torch.Tensor]
ProxyRank = Annotated[int, Field(ge=1)]

OPTMERGE_CITATION = "Wei et al., OptMerge: low-rank denoised WUDI for (multimodal) LLM merging, 2026"


class Quadratic(Protocol):
    """What :func:`quadratic_gradient` needs: the right-hand side D and products X C."""

    D: torch.Tensor

    def times_C(self, X: torch.Tensor) -> torch.Tensor: ...


def descend(
    tau0: torch.Tensor,
    gradient: Gradient,
    *,
    steps: int,
    lr: float,
    optimizer: Optimizer = "adam",
    momentum: float = 0.0,
    callback: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Run ``steps`` steps of torch Adam (default betas, eps 1e-8) or SGD from ``tau0``; return tau.

    Each step sets ``.grad`` to ``gradient(tau)``; ``momentum`` is used by SGD only.
    ``callback(step, tau)`` is called after every step with a copy of tau (step counts from 1).
    ``tau0`` is not modified.
    """
    _check_schedule(steps, lr, optimizer, momentum)
    with _autograd_enabled():
        tau = tau0.detach().clone().requires_grad_(True)
        if optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam([tau], lr=lr, eps=1e-8)
        else:
            opt = torch.optim.SGD([tau], lr=lr, momentum=momentum)
        for step in range(1, steps + 1):
            tau.grad = gradient(tau.detach())
            opt.step()
            if callback is not None:
                callback(step, tau.detach().clone())
    return tau.detach()


def quadratic_gradient(eq: Quadratic) -> Gradient:
    """tau -> 2 (tau C - D): the gradient of a WUDI-type loss from its normal equation (paper Eq. 5)."""
    return lambda tau: 2 * (eq.times_C(tau) - eq.D)


def autograd_gradient(loss: Callable[[torch.Tensor], torch.Tensor]) -> Gradient:
    """tau -> d loss / d tau, by autograd of the loss evaluated from scratch at tau."""

    def gradient(tau: torch.Tensor) -> torch.Tensor:
        with _autograd_enabled():
            x = tau.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(loss(x), x)
        return grad

    return gradient


@dataclass(frozen=True)
class ProxyEquation:
    """C_P = sum P_i^T P_i / n_i and D_P = sum tau_i P_i^T P_i / n_i for rank-k proxies P_i.

    With P_i = U_k S_k V_k^T only ``factors`` R_i = S_k V_k^T (k x d_in) are kept: P_i^T P_i = R_i^T R_i
    and ||X P_i^T||_F = ||X R_i^T||_F since U_k has orthonormal columns. ``M`` stacks R_i / sqrt(n_i),
    so C_P = M^T M with only N k <= min(d_out, d_in) rows.
    """

    tau: torch.Tensor  # (N_kept, d_out, d_in), the targets tau_i
    norms_sq: torch.Tensor  # (N_kept,), n_i = ||tau_i||_F^2
    factors: torch.Tensor  # (N_kept, k, d_in)
    D: torch.Tensor  # (d_out, d_in)

    @property
    def n_experts(self) -> int:
        return self.tau.shape[0]

    @property
    def rank(self) -> int:
        return self.factors.shape[1]

    @functools.cached_property
    def M(self) -> torch.Tensor:
        return (self.factors / self.norms_sq.sqrt()[:, None, None]).reshape(-1, self.tau.shape[2])

    @functools.cached_property
    def C(self) -> torch.Tensor:
        return self.M.T @ self.M

    def times_C(self, X: torch.Tensor) -> torch.Tensor:
        """X C_P through the factor M."""
        return (X @ self.M.T) @ self.M

    def loss(self, tau: torch.Tensor) -> torch.Tensor:
        """sum_i ||(tau - tau_i) P_i^T||_F^2 / n_i, written directly."""
        return proxy_loss(tau, self.tau, self.factors, self.norms_sq)


def proxy_rank(d_out: int, d_in: int, n_experts: int, rank: int | None = None) -> int:
    """OptMerge's truncation rank: ``rank`` capped at min(d_out, d_in), or max(1, min(d_out, d_in) // N)."""
    if rank is None:
        return max(1, min(d_out, d_in) // max(n_experts, 1))
    if rank < 1:
        raise ValueError(f"proxy rank must be at least 1, got {rank}")
    return min(rank, d_out, d_in)


def proxy_equation(task_vectors: torch.Tensor, rank: int | None = None, *, centre: bool) -> ProxyEquation:
    """C_P and D_P with P_i the rank-k truncated SVD of tau_i - mean_j tau_j (``centre``) or of tau_i.

    The mean runs over all N experts; experts with an all-zero delta are then left out of the loss.
    """
    if task_vectors.dim() != 3:
        raise ValueError(f"expected a stack N x d_out x d_in, got shape {tuple(task_vectors.shape)}")
    n, d_out, d_in = task_vectors.shape
    k = proxy_rank(d_out, d_in, n, rank)
    source = task_vectors - task_vectors.mean(dim=0) if centre else task_vectors
    norms = expert_norms_sq(task_vectors)
    keep = norms > 0
    tau, norms_sq = task_vectors[keep], norms[keep]
    _, S, Vh = torch.linalg.svd(source[keep], full_matrices=False)
    factors = S[:, :k, None] * Vh[:, :k]
    scaled = factors / norms_sq.sqrt()[:, None, None]
    # D_P = sum_i (tau_i R_i^T / sqrt(n_i)) (R_i / sqrt(n_i)): one (d_out x N k) by (N k x d_in) product
    left = tau @ scaled.transpose(1, 2)
    D = left.permute(1, 0, 2).reshape(d_out, -1) @ scaled.reshape(-1, d_in)
    return ProxyEquation(tau, norms_sq, factors, D)


@register("wudi", citation=WUDI_CITATION)
def wudi(
    task_vectors: torch.Tensor,
    *,
    steps: Count = 300,
    lr: Positive = 1e-5,
    optimizer: Optimizer = "adam",
    momentum: NonNegative = 0.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
) -> LayerResult:
    """WUDI-Merging: descent on sum_i ||(tau - tau_i) tau_i^T||^2 / ||tau_i||^2 via the precomputed 2 (tau C - D).

    Args:
        steps: number of optimizer steps (WUDI: 300).
        lr: learning rate (WUDI: 1e-5 with Adam).
        optimizer: adam (torch defaults, eps 1e-8) or sgd; plain sgd with lr a is Landweber with eta = 2a.
        momentum: heavy-ball momentum of sgd; ignored by adam.
        tau_init: starting point: sum (WUDI) or mean of the task vectors, or zero.
        scale: s in merged = W_0 + s * tau (the original WUDI has no scale: 1.0).
    """
    eq = normal_equation(task_vectors)
    return _iterate(
        task_vectors,
        eq.n_experts,
        eq.loss,
        quadratic_gradient(eq),
        steps=steps,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        tau_init=tau_init,
        scale=scale,
    )


@register("wudi_reference", citation=WUDI_CITATION)
def wudi_reference(
    task_vectors: torch.Tensor,
    *,
    steps: Count = 300,
    lr: Positive = 1e-5,
    optimizer: Optimizer = "adam",
    momentum: NonNegative = 0.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
) -> LayerResult:
    """WUDI-Merging as published: autograd of the explicit per-expert loss at every step, no C or D (slow).

    Args:
        steps: number of optimizer steps (WUDI: 300).
        lr: learning rate (WUDI: 1e-5 with Adam).
        optimizer: adam (torch defaults, eps 1e-8) or sgd.
        momentum: heavy-ball momentum of sgd; ignored by adam.
        tau_init: starting point: sum (WUDI) or mean of the task vectors, or zero.
        scale: s in merged = W_0 + s * tau (the original WUDI has no scale: 1.0).
    """
    with _autograd_enabled():  # the experts are saved for backward: copies, never inference tensors
        experts, norms_sq = (t.clone() for t in nonzero_experts(task_vectors))
    loss = functools.partial(proxy_loss, targets=experts, proxies=experts, norms_sq=norms_sq)
    return _iterate(
        task_vectors,
        experts.shape[0],
        loss,
        autograd_gradient(loss),
        steps=steps,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        tau_init=tau_init,
        scale=scale,
    )


@register("optmerge", citation=OPTMERGE_CITATION)
def optmerge(
    task_vectors: torch.Tensor,
    *,
    rank: ProxyRank | None = None,
    steps: Count = 300,
    lr: Positive = 1e-5,
    optimizer: Optimizer = "adam",
    momentum: NonNegative = 0.0,
    tau_init: TauInit = "mean",
    scale: float = 1.0,
) -> LayerResult:
    """OptMerge for full fine-tuning: WUDI with the proxy tau_i^T replaced by a rank-k SVD of tau_i - mean.

    The loss is sum_i ||(tau - tau_i) P_i^T||^2 / n_i: only the proxy is replaced, the target tau_i
    and the normalisation n_i = ||tau_i||^2 stay; descent uses the precomputed 2 (tau C_P - D_P).

    Args:
        rank: k of the proxies; None for max(1, min(d_out, d_in) // N).
        steps: number of optimizer steps (OptMerge: 300).
        lr: learning rate (OptMerge full fine-tuning: 1e-5 with Adam).
        optimizer: adam (torch defaults, eps 1e-8) or sgd.
        momentum: heavy-ball momentum of sgd; ignored by adam.
        tau_init: starting point: mean (OptMerge) or sum of the task vectors, or zero.
        scale: s in merged = W_0 + s * tau.
    """
    return _optmerge(task_vectors, rank, True, steps, lr, optimizer, momentum, tau_init, scale)


@register("optmerge_lora", citation=OPTMERGE_CITATION)
def optmerge_lora(
    task_vectors: torch.Tensor,
    *,
    rank: ProxyRank | None = None,
    steps: Count = 300,
    lr: Positive = 1e-4,
    optimizer: Optimizer = "sgd",
    momentum: NonNegative = 0.9,
    tau_init: TauInit = "mean",
    scale: float = 1.0,
) -> LayerResult:
    """OptMerge for LoRA experts: WUDI with the proxy tau_i^T replaced by a rank-k SVD of tau_i (no centring).

    The loss is sum_i ||(tau - tau_i) P_i^T||^2 / n_i: only the proxy is replaced, the target tau_i
    and the normalisation n_i = ||tau_i||^2 stay; descent uses the precomputed 2 (tau C_P - D_P).

    Args:
        rank: k of the proxies; None for max(1, min(d_out, d_in) // N).
        steps: number of optimizer steps (OptMerge: 300).
        lr: learning rate (OptMerge LoRA: 1e-4 with SGD).
        optimizer: sgd (OptMerge LoRA, momentum 0.9) or adam (torch defaults, eps 1e-8).
        momentum: heavy-ball momentum of sgd; ignored by adam.
        tau_init: starting point: mean (OptMerge) or sum of the task vectors, or zero.
        scale: s in merged = W_0 + s * tau.
    """
    return _optmerge(task_vectors, rank, False, steps, lr, optimizer, momentum, tau_init, scale)


def _optmerge(
    task_vectors: torch.Tensor,
    rank: int | None,
    centre: bool,
    steps: int,
    lr: float,
    optimizer: Optimizer,
    momentum: float,
    tau_init: TauInit,
    scale: float,
) -> LayerResult:
    eq = proxy_equation(task_vectors, rank, centre=centre)
    result = _iterate(
        task_vectors,
        eq.n_experts,
        eq.loss,
        quadratic_gradient(eq),
        steps=steps,
        lr=lr,
        optimizer=optimizer,
        momentum=momentum,
        tau_init=tau_init,
        scale=scale,
    )
    result.diagnostics.update(rank=eq.rank, centred=centre)
    return result


def _iterate(
    task_vectors: torch.Tensor,
    n_experts: int,
    loss: Callable[[torch.Tensor], torch.Tensor],
    gradient: Gradient,
    *,
    steps: int,
    lr: float,
    optimizer: Optimizer,
    momentum: float,
    tau_init: TauInit,
    scale: float,
) -> LayerResult:
    """The one code path of the iterative methods: start, descend, report the loss at both ends."""
    _check_schedule(steps, lr, optimizer, momentum)
    start = initial_point(task_vectors, tau_init)
    if start is None:
        start = torch.zeros_like(task_vectors[0])
    diagnostics = {"n_experts": n_experts, "steps": steps, "optimizer": optimizer, "lr": lr, "tau_init": tau_init}
    if optimizer == "sgd":
        diagnostics["momentum"] = momentum
    if n_experts == 0:
        return LayerResult(torch.zeros_like(start), {**diagnostics, "loss_start": 0.0, "loss_end": 0.0})
    tau = descend(start, gradient, steps=steps, lr=lr, optimizer=optimizer, momentum=momentum)
    with torch.no_grad():
        diagnostics.update(loss_start=float(loss(start)), loss_end=float(loss(tau)))
    return LayerResult(scale * tau, diagnostics)


def _check_schedule(steps: int, lr: float, optimizer: str, momentum: float) -> None:
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if momentum < 0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")


@contextlib.contextmanager
def _autograd_enabled() -> Iterator[None]:
    """Allow autograd and optimizer steps even when the caller merges under no_grad or inference_mode."""
    with torch.inference_mode(False), torch.enable_grad():
        yield
