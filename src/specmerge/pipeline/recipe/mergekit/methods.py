"""mergekit's methods as specmerge computes them: for each, the registered method, mergekit's parameters (one for the
merge, or one per model) with mergekit 0.1.5's defaults, and where each goes in a specmerge recipe.

A mergekit parameter goes to a parameter of the specmerge method (``lambda`` is ``scale``, ``gamma`` is ``beta``,
DARE's ``density`` is ``1 - drop_rate``), to the expert weights (``weight``), or nowhere when it has no effect in
mergekit either (``int8_mask`` only changes the dtype of a mask; the sparsity parameters of plain task arithmetic):
such a parameter is accepted and said. Every method of the task-arithmetic family runs with ``convention:
mergekit`` (:mod:`specmerge.methods.gta`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

REQUIRED = object()  # a parameter mergekit requires (no default)
# free: the method merges the models listed (and base_model), the first standing as the base when none is named;
# optional: without base_model the models' own weights are the points (base_free), the first standing as the base
BasePolicy = Literal["required", "optional", "free"]


@dataclass(frozen=True)
class Target:
    """Where a mergekit parameter goes: a specmerge parameter (``param``), the expert weights (``weights``), the
    base's weight in a linear average (``base_weight``) or nowhere (``none``, with the reason), each value mapped by
    ``value`` (DARE's density to a drop rate)."""

    kind: Literal["param", "weights", "none"]
    name: str = ""
    default: Any = None
    value: Callable[[float], float] | None = None
    why: str = ""  # for kind none: why it changes nothing


@dataclass(frozen=True)
class Dialect:
    """A mergekit method: the specmerge method that computes it and its mergekit parameters."""

    method: str
    shared: Mapping[str, Target]  # one value for the merge (mergekit's global parameters)
    per_model: Mapping[str, Target] = field(default_factory=dict)  # one value per model (or one for all)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # specmerge params always set
    base: BasePolicy = "required"
    models: tuple[int, int | None] = (1, None)  # how many models besides the base, at least and at most


def _param(name: str, default: Any, value: Callable[[float], float] | None = None) -> Target:
    return Target("param", name, default, value)


INT8_MASK = Target("none", default=False, why="it only changes the dtype of mergekit's sign masks")
WEIGHT = Target("weights", default=REQUIRED)


def _task_arithmetic_family(
    method: str, normalize: bool, rescale: bool, sparsify: Literal["none", "magnitude", "random", "band", "della"]
) -> Dialect:
    """mergekit's generalized task arithmetic: lambda, normalize, rescale, int8_mask for the merge; weight, density
    (gamma, epsilon) per model."""
    shared = {
        "lambda": _param("scale", 1.0),
        "normalize": _param("normalize", normalize),
        "int8_mask": INT8_MASK,
    }
    per_model: dict[str, Target] = {"weight": WEIGHT}
    if sparsify == "none":
        unused = "plain task arithmetic drops nothing in mergekit"
        shared["rescale"] = Target("none", default=False, why=unused)
        per_model["density"] = Target("none", default=1.0, why=unused)
    else:
        shared["rescale"] = _param("rescale", rescale)
        if sparsify == "random":
            per_model["density"] = _param("drop_rate", 1.0, lambda density: 1.0 - density)
        else:
            per_model["density"] = _param("density", 1.0)
    if sparsify == "band":
        per_model["gamma"] = _param("beta", 0.01)
    if sparsify == "della":
        per_model["epsilon"] = _param("epsilon", 0.15)
    fixed = {} if sparsify == "none" else {"convention": "mergekit"}
    return Dialect(method, shared, per_model, fixed)


DIALECTS: dict[str, Dialect] = {
    "linear": Dialect("linear", {"normalize": _param("normalize", True)}, {"weight": WEIGHT}, base="free"),
    "task_arithmetic": _task_arithmetic_family("task_arithmetic", False, False, "none"),
    "ties": _task_arithmetic_family("ties", True, False, "magnitude"),
    "dare_ties": _task_arithmetic_family("dare_ties", False, True, "random"),
    "dare_linear": _task_arithmetic_family("dare_linear", False, True, "random"),
    "breadcrumbs": _task_arithmetic_family("breadcrumbs", False, False, "band"),
    "breadcrumbs_ties": _task_arithmetic_family("breadcrumbs_ties", False, False, "band"),
    "della": _task_arithmetic_family("della", True, True, "della"),
    "della_linear": _task_arithmetic_family("della_linear", False, True, "della"),
    "slerp": Dialect("slerp", {"t": _param("t", REQUIRED)}, models=(1, 1)),
    "nearswap": Dialect("nearswap", {"t": _param("t", REQUIRED)}, models=(1, 1)),
    "arcee_fusion": Dialect("arcee_fusion", {}, models=(1, 1)),
    "model_stock": Dialect("model_stock", {"filter_wise": _param("filter_wise", False)}, models=(2, None)),
    "sce": Dialect("sce", {"select_topk": _param("select_topk", 1.0), "int8_mask": INT8_MASK}),
    "karcher": Dialect(  # every model listed is a point, and base_model too when named
        "karcher",
        {"max_iter": _param("max_iter", 10), "tol": _param("tol", 1e-5)},
        fixed={"include_base": True},
        base="free",
    ),
    "nuslerp": Dialect(
        "nuslerp",
        {"nuslerp_row_wise": _param("row_wise", False), "nuslerp_flatten": _param("flatten", True)},
        {"weight": WEIGHT},
        base="optional",
        models=(1, 2),
    ),
    "multislerp": Dialect(
        "multislerp",
        {"normalize_weights": _param("normalize_weights", True), "eps": _param("eps", 1e-8)},
        {"weight": WEIGHT},
        base="optional",
    ),
    "ram": Dialect("ram", {"epsilon": _param("epsilon", 1e-5)}),
    "ramplus_tl": Dialect(
        "ramplus_tl", {"r": _param("r", 0.1), "alpha": _param("alpha", 0.2), "epsilon": _param("epsilon", 1e-5)}
    ),
}

# mergekit methods specmerge does not run yet, with what stands in the way
NOT_YET: dict[str, str] = {
    "passthrough": "passthrough copies one model: give slices (a frankenmerge), or merge_method with models",
    "task_adapter": "mergekit's task_adapter is not in specmerge's registry",
}
