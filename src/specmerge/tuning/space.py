"""The search space of ``specmerge tune``: values per method parameter, defaulting to the paper's grids.

A tune file is a recipe with a ``tune:`` section (or the same as keyword arguments of :func:`specmerge.tune`)::

    tune:
      space:                        # per parameter: a list, one value, or a range
        rank_ratio: [0.55, 0.65, 0.75, 0.85]
        t: {range: [300, 1800], num: 6}            # 6 values evenly spaced; log: true for a geometric range
        scale: [0.1, 0.2, 0.3, 0.5, 1.0]
      strategy: grid                # or halving (successive halving over the evaluation's budget)
      metric: accuracy              # the key to read when the evaluation prints a JSON object
      maximize: true

Without a space, the paper's protocol (its Sec. 5): s in {0.1, 0.2, 0.3, 0.5, 1.0} for every method, and for SWUDI
r in {0.55, 0.60, 0.65, 0.70, 0.75, 0.85} x t in {300, 500, 700, 1000, 1300, 1800}; a space given replaces the
defaults only for the parameters it names. A searched parameter's value in the recipe's ``params`` is replaced;
the others keep the recipe's values. Every value is
validated by the method when the space is read (one line naming the parameter and value).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specmerge.errors import RecipeError
from specmerge.methods import Method
from specmerge.pipeline.recipe.layered import validate_layered

PAPER_SCALES = (0.1, 0.2, 0.3, 0.5, 1.0)
PAPER_GRIDS: dict[str, dict[str, tuple[Any, ...]]] = {  # the paper's grids beyond s, by method (Sec. 5)
    "swudi": {"rank_ratio": (0.55, 0.60, 0.65, 0.70, 0.75, 0.85), "t": (300.0, 500.0, 700.0, 1000.0, 1300.0, 1800.0)},
}
STRATEGIES = ("grid", "halving")
MAX_VALUES = 1000  # values of one parameter
MAX_SETTINGS = 10_000  # settings in all: each one a merge and an evaluation
SECTION_KEYS = ("space", "strategy", "metric", "maximize", "eta", "min_budget")  # the keys of ``tune:``


@dataclass(frozen=True)
class Setting:
    """One point of the space: the parameters it sets (the recipe's other parameters are unchanged)."""

    params: Mapping[str, Any]

    @property
    def key(self) -> str:
        """A stable short id (the same setting has the same key in every run)."""
        text = json.dumps(dict(sorted(self.params.items())), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params.items())


@dataclass(frozen=True)
class SearchSpace:
    """Values per parameter, in the order given; :meth:`settings` is their product (first parameter slowest)."""

    values: Mapping[str, tuple[Any, ...]]

    def settings(self) -> list[Setting]:
        names = list(self.values)
        return [Setting(dict(zip(names, combo, strict=True))) for combo in itertools.product(*self.values.values())]

    def to_dict(self) -> dict[str, list[Any]]:
        return {name: list(values) for name, values in self.values.items()}


@dataclass(frozen=True)
class TuneOptions:
    """The ``tune:`` section: space, strategy, metric, direction and successive halving's eta and smallest budget."""

    space: SearchSpace
    strategy: str = "grid"
    metric: str | None = None
    maximize: bool = True
    eta: int = 3
    min_budget: float = 1 / 9


def default_space(method: Method) -> dict[str, tuple[Any, ...]]:
    """The paper's grid for ``method``: s for every method, plus its own grids (SWUDI's r x t)."""
    return {**PAPER_GRIDS.get(method.name, {}), "scale": PAPER_SCALES}


def parse_values(name: str, spec: Any) -> tuple[Any, ...]:
    """One parameter's values: a list, a single value, or ``{range: [lo, hi], num: n, log: false}``."""
    where = f"tune.space.{name}"
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"range", "num", "log"}
        if unknown or "range" not in spec:
            raise RecipeError(f"{where}: a range is {{range: [low, high], num: N, log: false}}, got {dict(spec)}")
        bounds, num, log = spec["range"], spec.get("num", 5), bool(spec.get("log", False))
        if not (isinstance(bounds, list | tuple) and len(bounds) == 2 and all(_is_number(b) for b in bounds)):
            raise RecipeError(f"{where}: range must be [low, high] with two numbers, got {bounds!r}")
        if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= MAX_VALUES:
            raise RecipeError(f"{where}: num must be a whole number from 1 to {MAX_VALUES}, got {num!r}")
        low, high = float(bounds[0]), float(bounds[1])
        if log and (low <= 0 or high <= 0):
            raise RecipeError(f"{where}: a log range needs positive bounds, got [{low}, {high}]")
        if num == 1:
            return (low,)
        if log:
            return tuple(math.exp(math.log(low) + (math.log(high) - math.log(low)) * i / (num - 1)) for i in range(num))
        return tuple(low + (high - low) * i / (num - 1) for i in range(num))
    values = tuple(spec) if isinstance(spec, list | tuple) else (spec,)
    if not values:
        raise RecipeError(f"{where}: give at least one value")
    if len(values) > MAX_VALUES:
        raise RecipeError(f"{where}: {len(values)} values; at most {MAX_VALUES} per parameter are searched")
    if len(set(map(repr, values))) != len(values):
        raise RecipeError(f"{where}: a value is repeated in {list(values)}")
    return values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_space(method: Method, spec: Mapping[str, Any] | None, fixed: Mapping[str, Any]) -> SearchSpace:
    """The search space for ``method``: the paper's grid, with the parameters ``spec`` names replaced. Each value is
    checked by the method with the recipe's other parameters ``fixed``."""
    if spec is not None and not isinstance(spec, Mapping):
        raise RecipeError(f"tune.space is a mapping of parameter names to values, got {type(spec).__name__}")
    values = dict(default_space(method))
    for name, given in (spec or {}).items():
        try:
            method.param(str(name))
        except ValueError as err:
            raise RecipeError(f"tune.space: {err}") from None
        values[str(name)] = parse_values(str(name), given)
    count = math.prod(len(options) for options in values.values())
    if count > MAX_SETTINGS:
        sizes = " x ".join(f"{len(options)} {name}" for name, options in values.items())
        raise RecipeError(
            f"tune.space has {count:,} settings ({sizes}); at most {MAX_SETTINGS:,} are searched, each a whole merge "
            "and an evaluation: narrow the space"
        )
    for name, options in values.items():
        for value in options:
            try:
                validate_layered(method, {**fixed, name: value})
            except ValueError as err:
                raise RecipeError(f"tune.space.{name}: {err}") from None
    return SearchSpace(values)


def parse_options(method: Method, section: Any, fixed: Mapping[str, Any]) -> TuneOptions:
    """The ``tune:`` section of a tune file (None: every default), validated (one line per mistake)."""
    section = {} if section is None else section
    if not isinstance(section, Mapping):
        raise RecipeError(f"tune: is a mapping ({', '.join(SECTION_KEYS)}), got {section!r}")
    unknown = set(section) - set(SECTION_KEYS)
    if unknown:
        raise RecipeError(f"tune: unknown key(s) {sorted(unknown)}; known: {', '.join(SECTION_KEYS)}")
    strategy = section.get("strategy", "grid")
    if strategy not in STRATEGIES:
        raise RecipeError(f"tune.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    eta, low = section.get("eta", 3), section.get("min_budget", 1 / 9)
    if not isinstance(eta, int) or isinstance(eta, bool) or eta < 2:
        raise RecipeError(f"tune.eta must be a whole number >= 2 (keep 1/eta of the settings per round), got {eta!r}")
    if not _is_number(low) or not 0 < low <= 1:
        raise RecipeError(f"tune.min_budget must be in (0, 1] (the first round's share of the evaluation), got {low!r}")
    metric = section.get("metric")
    if metric is not None and not isinstance(metric, str):
        raise RecipeError(f"tune.metric is the name of a key in the evaluation's JSON output, got {metric!r}")
    maximize = section.get("maximize", True)
    if not isinstance(maximize, bool):
        raise RecipeError(f"tune.maximize must be true or false, got {maximize!r}")
    space = parse_space(method, section.get("space"), fixed)
    return TuneOptions(space, strategy, metric, maximize, eta, float(low))
