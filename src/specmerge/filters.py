"""Spectral filters h(lambda) for the unified estimator (paper Eq. 8, App. B.4).

A filter maps the eigenvalues of C, sorted in descending order, to gains h_k in [0, 1]; the
estimator inverts direction k with gain h_k / lambda_k. Filters compose by multiplication:
``TopK(500) * Exponential(1300.0)`` is the SWUDI filter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class Filter:
    """Base class: ``filter(eigenvalues) -> gains``; ``a * b`` is the product filter."""

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __mul__(self, other: Filter) -> Filter:
        return Product((self, other))


@dataclass(frozen=True)
class PseudoInverse(Filter):
    """h = 1: the minimum-norm solution D C^+ (paper Eq. 6)."""

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(eigenvalues)


@dataclass(frozen=True)
class Exponential(Filter):
    """h = 1 - exp(-t lambda): gradient flow stopped at time t (paper Prop. 2, Eq. 10)."""

    t: float

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        if math.isinf(self.t):
            return torch.ones_like(eigenvalues)
        return -torch.expm1(-self.t * eigenvalues)


@dataclass(frozen=True)
class Landweber(Filter):
    """h = 1 - (1 - eta lambda)^n: exactly n gradient steps tau += eta (D - tau C); stable for eta < 2/lambda_1."""

    eta: float
    steps: int

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return 1 - (1 - self.eta * eigenvalues) ** self.steps


@dataclass(frozen=True)
class Tikhonov(Filter):
    """h = lambda / (lambda + alpha): ridge regularisation of the normal equation."""

    alpha: float

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        return eigenvalues / (eigenvalues + self.alpha)


@dataclass(frozen=True)
class TopK(Filter):
    """h = 1[k <= K]: keep the K leading eigendirections."""

    k: int

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        index = torch.arange(eigenvalues.numel(), device=eigenvalues.device)
        return (index < self.k).to(eigenvalues.dtype)


@dataclass(frozen=True)
class Product(Filter):
    """The product of several filters."""

    factors: tuple[Filter, ...]

    def __call__(self, eigenvalues: torch.Tensor) -> torch.Tensor:
        gains = torch.ones_like(eigenvalues)
        for f in self.factors:
            gains = gains * f(eigenvalues)
        return gains

    def __mul__(self, other: Filter) -> Filter:
        return Product((*self.factors, other))
