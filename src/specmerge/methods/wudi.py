"""Merges that minimise WUDI's loss (paper Sec. 3): its exact minimiser D C^+ and gradient descent on it.

``closed_form`` solves the normal equation tau C = D exactly (paper Eq. 6). The iterative methods run
one loop, :func:`~specmerge.linalg.optimize.descend`, and differ only in how the gradient is obtained:
``wudi`` uses the precomputed 2 (tau C - D) (paper Prop. 1); its declared variant ``wudi_reference``
differentiates the explicit per-expert loss with autograd at every step, as the published WUDI code
does; ``optmerge`` and its variant ``optmerge_lora`` use 2 (tau C_P - D_P) of the loss with a rank-k
proxy P_i in place of tau_i. Plain SGD with step a is exactly the Landweber iteration with eta = 2a:
``wudi(optimizer="sgd", lr=a, steps=n)`` equals the Landweber filter (eta 2a, n steps).

Note on OptMerge: this module follows the paper's description (the centred, truncated P_i replaces
the proxy tau_i^T; the target tau_i is unchanged). Public ports of the OptMerge code for full
fine-tuning instead truncate the uncentred tau_i for the proxy and use mean + rank-k(tau_i - mean)
as the target. For the LoRA variant both readings give the same loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Literal

import torch
from pydantic import Field

from specmerge.linalg.filters import PseudoInverse
from specmerge.linalg.optimize import (
    Gradient,
    Optimizer,
    autograd_enabled,
    autograd_gradient,
    descend,
    quadratic_gradient,
)
from specmerge.linalg.quadratic import (
    TauInit,
    initial_point,
    nonzero_experts,
    normal_equation,
    proxy_equation,
    proxy_loss,
    proxy_rank,
)
from specmerge.linalg.solve import spectral_merge
from specmerge.methods.operations import (
    Operations,
    Shape,
    adam_step_ops,
    gradient_ops,
    normal_equation_ops,
    passes,
    spectral_merge_ops,
    svd_ops,
)
from specmerge.methods.params import Count, NonNegative, Positive
from specmerge.methods.registry import LayerResult, Setting, register, register_variant

ProxyRank = Annotated[int, Field(ge=1)]

WUDI_CITATION = "Cheng et al., Whoever Started the Interference Should End It (WUDI), ICML 2025"
PAPER_CITATION = (
    "Wei et al., Closed-Form Spectral Regularization for Multi-Task Model Merging (SWUDI / SWUDI-A), Sec. 4"
)
OPTMERGE_CITATION = "Wei et al., OptMerge: low-rank denoised WUDI for (multimodal) LLM merging, 2026"


def closed_form_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """One spectral merge inverting every direction (:func:`~specmerge.methods.operations.spectral_merge_ops`)."""
    assumed = "C resolved by eigh (else a second decomposition, through the SVD of M)"
    return spectral_merge_ops(shape, itemsize, None, params["tau_init"], assumed)


def wudi_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The normal equation (C formed where the gradient uses it), ``steps`` gradients and optimizer steps, and
    the loss at both ends; ``gradient="autograd"`` (wudi_reference) instead runs the explicit per-expert loss
    forward and backward at every step (about three products N x d_out x d_in x d_out)."""
    n, d_out, d_in = shape
    x, e, steps = d_out * d_in, itemsize, params["steps"]
    loss = Operations(matmul=2.0 * n * d_out * d_out * d_in, memory=(3.0 * n * x + 2.0 * n * d_out * d_out) * e)
    step = adam_step_ops(x, e, params["optimizer"])
    if params["gradient"] == "autograd":
        per_step = loss.times(3) + step + Operations(workspace=(3 * n * x + 2 * n * d_out * d_out) * e)
        return passes(3 * n + 2, x, e) + per_step.times(steps) + loss.times(2)
    ops = normal_equation_ops(n, d_out, d_in, e)
    if d_out < d_in <= 2 * n * d_out:  # C formed on the first product with it, by symmetric updates
        ops = ops + Operations(matmul=1.0 * n * d_out * d_in * d_in, workspace=d_in * d_in * e)
    per_step = gradient_ops(n, d_out, d_in, e) + step
    return ops + passes(n + 1, x, e) + per_step.times(steps) + loss.times(2) + Operations(workspace=4 * x * e)


def optmerge_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The centred (or plain) stack, its N SVDs for the rank-k proxies, D_P, then ``steps`` gradients through the
    N k x d_in proxy factors and optimizer steps, and the loss at both ends."""
    n, d_out, d_in = shape
    x, e, steps = d_out * d_in, itemsize, params["steps"]
    k = proxy_rank(d_out, d_in, n, params["rank"])
    ops = passes(4 * n + 2, x, e) + svd_ops(n, d_out, d_in, e)
    ops = ops + Operations(matmul=2.0 * n * d_out * d_in * k + 2.0 * d_out * n * k * d_in)
    per_step = gradient_ops(n, d_out, d_in, e, proxy_rank=k) + adam_step_ops(x, e, params["optimizer"])
    loss = Operations(matmul=2.0 * n * d_out * d_in * k, memory=3.0 * n * x * e)
    return ops + passes(n + 1, x, e) + per_step.times(steps) + loss.times(2) + Operations(workspace=4 * x * e)


@register(
    "closed_form",
    citation=PAPER_CITATION,
    title="D C⁺ (closed form)",
    factored=True,
    settings=[Setting("closed_form", "D C⁺ (closed form)")],
    cost=closed_form_cost,
    spectral=True,
)
def closed_form(
    task_vectors: torch.Tensor,
    *,
    tau_init: TauInit = "zero",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """Exact minimiser of the WUDI loss: D C^+ (paper Eq. 6), or tau_init + (D - tau_init C) C^+.

    Args:
        tau_init: zero gives the minimum-norm solution D C^+; sum or mean keep that start on the null space of C.
        scale: s in merged = W_0 + s * tau_hat.
    """
    return LayerResult(*spectral_merge(task_vectors, lambda s: (PseudoInverse(), None), tau_init, scale, full_shape))


@register(
    "wudi",
    citation=WUDI_CITATION,
    title="WUDI",
    fixed={"gradient": "normal_equation"},
    settings=[Setting("wudi", "WUDI (Adam, 300 steps)", {"steps": 300})],
    cost=wudi_cost,
)
def wudi(
    task_vectors: torch.Tensor,
    *,
    gradient: Literal["normal_equation", "autograd"],
    steps: Count = 300,
    lr: Positive = 1e-5,
    optimizer: Optimizer = "adam",
    momentum: NonNegative = 0.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
) -> LayerResult:
    """WUDI-Merging: descent on sum_i ||(tau - tau_i) tau_i^T||^2 / ||tau_i||^2 via the precomputed 2 (tau C - D).

    ``gradient`` is the declared difference of the variant ``wudi_reference``: ``autograd`` differentiates
    the explicit per-expert loss at every step, with no C or D, as the published code does (slow).

    Args:
        steps: number of optimizer steps (WUDI: 300).
        lr: learning rate (WUDI: 1e-5 with Adam).
        optimizer: adam (torch defaults, eps 1e-8) or sgd; plain sgd with lr a is Landweber with eta = 2a.
        momentum: heavy-ball momentum of sgd; ignored by adam.
        tau_init: starting point: sum (WUDI) or mean of the task vectors, or zero.
        scale: s in merged = W_0 + s * tau (the original WUDI has no scale: 1.0).
    """
    schedule = {"steps": steps, "lr": lr, "optimizer": optimizer, "momentum": momentum}
    if gradient == "normal_equation":
        eq = normal_equation(task_vectors)
        return _iterate(task_vectors, eq.n_experts, eq.loss, quadratic_gradient(eq), **schedule, tau_init=tau_init,
                        scale=scale)  # fmt: skip
    with autograd_enabled():  # the experts are saved for backward: copies, never inference tensors
        experts, norms_sq = (t.clone() for t in nonzero_experts(task_vectors))
    loss = functools.partial(proxy_loss, targets=experts, proxies=experts, norms_sq=norms_sq)
    return _iterate(task_vectors, experts.shape[0], loss, autograd_gradient(loss), **schedule, tau_init=tau_init,
                    scale=scale)  # fmt: skip


wudi_reference = register_variant(
    "wudi_reference",
    wudi,
    title="WUDI (reference)",
    summary="WUDI-Merging as published: autograd of the explicit per-expert loss at every step, no C or D (slow).",
    fixed={"gradient": "autograd"},
    featured=False,  # the same merge as wudi, slower: a reference for tests and the speed benchmark
    settings=(),
)


@register(
    "optmerge",
    citation=OPTMERGE_CITATION,
    title="OptMerge",
    fixed={"centre": True},
    settings=[Setting("optmerge", "OptMerge (300 steps)")],
    cost=optmerge_cost,
)
def optmerge(
    task_vectors: torch.Tensor,
    *,
    centre: bool,
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
    ``centre`` is the declared difference of the variant ``optmerge_lora``, whose proxies are truncated
    SVDs of tau_i itself (and whose defaults are OptMerge's for LoRA: SGD, lr 1e-4, momentum 0.9).

    Args:
        rank: k of the proxies; None for max(1, min(d_out, d_in) // N).
        steps: number of optimizer steps (OptMerge: 300).
        lr: learning rate (OptMerge: 1e-5 with Adam for full fine-tuning, 1e-4 with SGD for LoRA).
        optimizer: adam (torch defaults, eps 1e-8) or sgd (OptMerge LoRA, momentum 0.9).
        momentum: heavy-ball momentum of sgd; ignored by adam.
        tau_init: starting point: mean (OptMerge) or sum of the task vectors, or zero.
        scale: s in merged = W_0 + s * tau.
    """
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
    result.diagnostics.update(rank=eq.proxy_rank, centred=centre)
    return result


optmerge_lora = register_variant(
    "optmerge_lora",
    optmerge,
    title="OptMerge (LoRA)",
    summary="OptMerge for LoRA experts: WUDI with the proxy tau_i^T replaced by a rank-k SVD of tau_i (no centring).",
    fixed={"centre": False},
    defaults={"lr": 1e-4, "optimizer": "sgd", "momentum": 0.9},
    featured=False,  # optmerge with the LoRA paper's defaults: listed, not shown again in demo / speed / inspect
    settings=(),
)


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
