"""The search itself: which settings are scored on which share of the evaluation, and which one is best.

One code path for ``specmerge tune`` (scores from merging and running the user's evaluation) and the accuracy
benchmark (scores from its cached validation accuracies): both give :func:`search` the settings and a function
``score(setting, budget) -> float``, which may answer from a cache (that is how a tune resumes). Strategies:

- ``grid``: every setting on the full evaluation (budget 1);
- ``halving`` (successive halving): every setting on the smallest share ``min_budget``, then the best
  ceil(n / eta) of them on eta times more, and so on up to the full evaluation.

The best is the setting with the highest (``maximize``) or lowest full-evaluation score; on a tie, the one met
first, as a loop over the settings in order that keeps only strictly better ones would choose.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from specmerge.tuning.space import Setting

Score = Callable[[Setting, float], float]  # (setting, budget in (0, 1]) -> score


@dataclass(frozen=True)
class Strategy:
    """How settings are scored: ``grid`` or ``halving`` (with eta and the first round's budget), and the direction."""

    name: str = "grid"
    eta: int = 3
    min_budget: float = 1 / 9
    maximize: bool = True

    def budgets(self) -> list[float]:
        """The share of the evaluation each round runs: [1.0] for grid; successive halving's, smallest first."""
        if self.name == "grid":
            return [1.0]
        rounds = max(0, round(math.log(1 / self.min_budget) / math.log(self.eta)))
        return [round(self.eta ** -(rounds - k), 12) for k in range(rounds + 1)]

    def round_sizes(self, n: int) -> list[int]:
        sizes = []
        for _ in self.budgets():
            sizes.append(n)
            n = self.kept(n)
        return sizes

    def kept(self, n: int) -> int:
        """How many of a round's ``n`` settings go on to the next round: the best ceil(n / eta)."""
        return max(1, math.ceil(n / self.eta))

    def better(self, score: float, than: float) -> bool:
        return score > than if self.maximize else score < than


def search(
    settings: Sequence[Setting],
    score: Score,
    strategy: Strategy = Strategy(),
    *,
    after: Callable[[Setting, float, float, bool], None] | None = None,
    before_round: Callable[[list[Setting], float], None] | None = None,
    progress: bool = False,
) -> tuple[Setting, float]:
    """The best setting and its full-evaluation score. ``before_round(settings, budget)`` is called as each round
    starts (a tune merges several of them in one pass); ``after(setting, budget, score, is_new_best)`` once each
    setting of a round is scored (a tune keeps or removes that setting's model there)."""
    if not settings:
        raise ValueError("the search space is empty: give at least one value per parameter")
    best: tuple[Setting, float] | None = None
    survivors = list(settings)
    with tqdm(total=sum(strategy.round_sizes(len(settings))), desc="tuning", disable=not progress) as bar:
        for budget in strategy.budgets():
            if before_round is not None:
                before_round(list(survivors), budget)
            scores = []
            for setting in survivors:
                value = score(setting, budget)
                scores.append(value)
                new_best = budget == 1.0 and (best is None or strategy.better(value, best[1]))
                if new_best:
                    best = (setting, value)
                if after is not None:
                    after(setting, budget, value, new_best)
                bar.update(1)
                if best is not None:
                    bar.set_postfix_str(f"best {best[1]:.6g}", refresh=False)
            if budget < 1.0:
                order = sorted(range(len(survivors)), key=lambda i: -scores[i] if strategy.maximize else scores[i])
                survivors = [survivors[i] for i in sorted(order[: strategy.kept(len(survivors))])]
    assert best is not None
    return best
