"""Gradient descent on a merge loss: the loop every iterative method runs (paper Sec. 3.1).

:func:`descend` runs torch Adam or SGD from a starting point; the gradient is a function of tau, either
2 (tau C - D) from a normal equation (:func:`quadratic_gradient`, paper Prop. 1) or autograd of a loss
written out explicitly (:func:`autograd_gradient`). Plain SGD with step a is exactly the Landweber
iteration with eta = 2a.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal, Protocol

import torch

Optimizer = Literal["adam", "sgd"]
Gradient = Callable[[torch.Tensor], torch.Tensor]


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
    check_schedule(steps, lr, optimizer, momentum)
    with autograd_enabled():
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
        with autograd_enabled():
            x = tau.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(loss(x), x)
        return grad

    return gradient


def check_schedule(steps: int, lr: float, optimizer: str, momentum: float) -> None:
    """Refuse an optimizer schedule :func:`descend` cannot run (one line naming the bad value)."""
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if momentum < 0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")


@contextlib.contextmanager
def autograd_enabled() -> Iterator[None]:
    """Allow autograd and optimizer steps even when the caller merges under no_grad or inference_mode."""
    with torch.inference_mode(False), torch.enable_grad():
        yield
