"""Spectral filters h(lambda) for the unified estimator (paper Eq. 8, App. B.4).

A filter maps the eigenvalues of C, sorted in descending order, to gains h_k in [0, 1]; the
estimator inverts direction k with gain h_k / lambda_k (:meth:`Filter.inverse_gain`, which also knows
its limit at lambda = 0). Filters compose by multiplication: ``TopK(500) * Exponential(1300.0)`` is
the SWUDI filter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _divide(h: torch.Tensor, eigenvalues: torch.Tensor, at_zero: torch.Tensor | float) -> torch.Tensor:
    """h / lambda where lambda != 0, ``at_zero`` (the limit) where lambda == 0."""
    zero = eigenvalues == 0
    ratio = h / torch.where(zero, torch.ones_like(eigenvalues), eigenvalues)
    return torch.where(zero, torch.as_tensor(at_zero, dtype=ratio.dtype, device=ratio.device), ratio)


class Filter:
    """Base class: ``filter(eigenvalues) -> gains``; ``a * b`` is the product filter."""

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def inverse_gain(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        """g(lambda) = h(lambda) / lambda, the gain the estimator applies to direction k, with its limit at 0.

        inf where it is unbounded (the pseudoinverse at lambda = 0). This default does not know the limit
        at lambda = 0 and answers inf there (unbounded, so never applied to an unresolved direction);
        the filters below override it with their limits.
        """
        return _divide(self(eigenvalues), eigenvalues, math.inf)

    def __mul__(self, other: Filter) -> Filter:
        return Product((self, other))


@dataclass(frozen=True)
class PseudoInverse(Filter):
    """h = 1: the minimum-norm solution D C^+ (paper Eq. 6)."""

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(eigenvalues)


@dataclass(frozen=True)
class Exponential(Filter):
    """h = 1 - exp(-t lambda): gradient flow stopped at time t (paper Prop. 2, Eq. 10); h / lambda -> t at 0."""

    t: float

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        if math.isinf(self.t):
            return torch.ones_like(eigenvalues)
        return -torch.expm1(-self.t * eigenvalues)

    def inverse_gain(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return _divide(self(eigenvalues), eigenvalues, self.t)


@dataclass(frozen=True)
class Landweber(Filter):
    """h = 1 - (1 - eta lambda)^n: exactly n gradient steps tau += eta (D - tau C); stable for eta < 2/lambda_1.

    Evaluated as -expm1(n log1p(-eta lambda)) where eta lambda < 1, which keeps h accurate to a few eps
    relative for small eta lambda (the power form loses all digits once eta lambda < eps / n);
    h / lambda -> n eta at 0.
    """

    eta: float
    steps: int

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        x = self.eta * eigenvalues
        below = x < 1
        stable = -torch.expm1(self.steps * torch.log1p(-torch.where(below, x, torch.zeros_like(x))))
        return torch.where(below, stable, 1 - (1 - x) ** self.steps)

    def inverse_gain(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return _divide(self(eigenvalues), eigenvalues, self.steps * self.eta)


@dataclass(frozen=True)
class Tikhonov(Filter):
    """h = lambda / (lambda + alpha): ridge regularisation of the normal equation; h / lambda = 1 / (lambda + alpha)."""

    alpha: float

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return eigenvalues / (eigenvalues + self.alpha)

    def inverse_gain(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return 1 / (eigenvalues + self.alpha)


@dataclass(frozen=True)
class TopK(Filter):
    """h = 1[k <= K]: keep the K leading eigendirections."""

    k: int

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        index = torch.arange(eigenvalues.numel(), device=eigenvalues.device)
        return (index < self.k).to(eigenvalues.dtype)

    def inverse_gain(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        kept = self(eigenvalues)
        return torch.where(kept > 0, _divide(kept, eigenvalues, math.inf), torch.zeros_like(kept))


@dataclass(frozen=True)
class Product(Filter):
    """The product of several filters."""

    factors: tuple[Filter, ...]

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        gains = torch.ones_like(eigenvalues)
        for f in self.factors:
            gains = gains * f(eigenvalues)
        return gains

    def inverse_gain(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        # (prod h_j) / lambda = g_j * prod_{i != j} h_i for every j; at lambda = 0 the finite ones are the
        # limit (e.g. TopK x Exponential -> t on kept directions, 0 on cut ones), inf * 0 is not.
        h = [f(eigenvalues) for f in self.factors]
        candidates = []
        for j, f in enumerate(self.factors):
            value = f.inverse_gain(eigenvalues)
            for i, hi in enumerate(h):
                if i != j:
                    value = value * hi
            candidates.append(torch.where(value.isnan(), math.inf, value))
        at_zero = torch.stack(candidates).amin(dim=0)
        return torch.where(eigenvalues == 0, at_zero, _divide(self(eigenvalues), eigenvalues, 0.0))

    def __mul__(self, other: Filter) -> Filter:
        return Product((*self.factors, other))
