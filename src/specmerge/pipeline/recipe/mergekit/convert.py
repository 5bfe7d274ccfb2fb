"""A mergekit config as a specmerge recipe with mergekit's meaning (``specmerge convert``, ``specmerge run``).

The conversion gives every parameter mergekit's default when the config omits it (lambda 1, density 1, ...), puts
each one where specmerge takes it (:mod:`.methods`), keeps gradients and ``filter`` conditions as they are (a
recipe's values mean the same, :mod:`specmerge.pipeline.recipe.layered`), merges embeddings and ``lm_head`` with the
method (mergekit merges every tensor) and runs the task-arithmetic family in mergekit's convention. What it cannot
honour it refuses in one line; what it honours with a small difference (the arithmetic's precision, random draws)
it lists in :attr:`Conversion.differences`, which ``specmerge run`` prints and ``specmerge convert`` writes as
comments.

Model references are folders or hub ids, as mergekit reads them: a relative folder is taken from the current
directory, as mergekit-yaml does (not from the config's folder).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.pipeline.recipe.errors import parse_yaml
from specmerge.pipeline.recipe.expert_entries import default_expert_keys
from specmerge.pipeline.recipe.layered import validate_value, varies
from specmerge.pipeline.recipe.mergekit.config import (
    MergekitConfig,
    ModelEntry,
    is_mergekit_config,
    parse_config,
    setting_of,
)
from specmerge.pipeline.recipe.mergekit.methods import DIALECTS, NOT_YET, REQUIRED, Dialect, Target
from specmerge.pipeline.recipe.mergekit.models import split_models
from specmerge.pipeline.recipe.mergekit.ranges import several_slices
from specmerge.pipeline.recipe.mergekit.slices import passthrough_data, slice_merges
from specmerge.pipeline.recipe.model import Recipe

DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}  # fmt: skip
TEMPLATE_NAMES = ("chatml", "llama3", "alpaca", "mistral", "exaone")  # mergekit's built-in chat templates


@dataclass
class Conversion:
    """A mergekit config as a specmerge recipe: ``data`` (what ``specmerge convert`` prints), the validated
    ``recipe``, and what the console says of it: every place where the meaning differs from mergekit's, and every
    parameter given that changes nothing (as in mergekit)."""

    data: dict[str, Any]
    recipe: Recipe
    differences: list[str] = field(default_factory=list)

    def to_yaml(self, source: str = "") -> str:
        """The recipe as YAML, with the differences as comments above it."""
        lines = [f"# specmerge recipe converted from the mergekit config {source}".rstrip()]
        lines += [f"# {note}" for note in self.differences]
        return "\n".join(lines) + "\n" + yaml.safe_dump(self.data, sort_keys=False, default_flow_style=None)


def convert(data: Mapping[str, Any]) -> Conversion:
    """The specmerge recipe of the mergekit config ``data`` (a parsed YAML document); a one-line RecipeError for what
    cannot be run with mergekit's meaning."""
    config = parse_config(data)
    name = config.merge_method
    if config.modules is not None:
        raise RecipeError("'modules': mergekit's per-module merges are not supported", ("modules",))
    if name == "passthrough":
        return _finish(config, passthrough_data(config), [])
    if config.slices is not None and len(config.slices) == 1:
        return convert(slice_merges(config)[1][0][2])  # one slice over every layer: the same merge of models
    if config.slices is not None:
        data, differences = several_slices(config, convert)
        return _validated(data, differences)
    if name in NOT_YET:
        raise RecipeError(f"merge_method '{name}': {NOT_YET[name]}", ("merge_method",))
    if name not in DIALECTS:
        known = [*DIALECTS, "passthrough"]
        raise RecipeError(unknown_name_message("mergekit merge_method", name, known), ("merge_method",))
    dialect = DIALECTS[name]
    base, experts, base_entry = split_models(config, dialect)
    differences: list[str] = []
    given = dict(config.parameters or {})
    params, shared_weights = _shared(dialect, given, name, differences)
    weights, own, common = _per_model(dialect, experts, given, differences)
    params.update(common)
    out: dict[str, Any] = {"base": base, "experts": [], "method": dialect.method}
    keys = default_expert_keys([e.model for e in experts])
    for i, entry in enumerate(experts):
        expert: dict[str, Any] = {"path": entry.model}
        if weights is not None:
            expert["weight"] = weights[i]
        if own[i]:
            expert["params"] = own[i]
        out["experts"].append(expert if len(expert) > 1 else entry.model)
    if dialect.method == "linear":
        _linear_base(base_entry, given, params, weights, shared_weights)
        out["method"] = params.pop("method", out["method"])
    elif dialect.base == "optional" and config.base_model is None:  # the models' own weights are the points
        params["base_free"] = True
        assert base_entry is not None  # the first model stands as the base
        params["base_weight"] = _base_weight(base_entry, shared_weights, dialect.method)
    elif base_entry is not None and base_entry.parameters:
        differences.append(
            f"the base's own parameters ({', '.join(base_entry.parameters)}) are not used by {name}, as in mergekit"
        )
    if name == "task_arithmetic" and params.pop("normalize", False):
        out["method"] = "weight_average"  # lambda * sum_i w_i tau_i / sum_i w_i
    out["params"] = params
    out["merge_embeddings"] = True  # mergekit merges every tensor
    _outputs(config, out, keys, [e.model for e in experts], base, differences)
    return _validated(out, differences)


def load_mergekit(path: str | os.PathLike) -> Conversion | None:
    """The conversion of the mergekit config in the YAML file ``path``, or None when the file is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"recipe file '{path}' cannot be read: {err}") from None
    data = parse_yaml(text, Path(path))
    if not is_mergekit_config(data):
        return None
    try:
        return convert(data)
    except RecipeError as err:
        raise RecipeError(f"{path}: {err}", err.loc) from None


def _finish(config: MergekitConfig, out: dict[str, Any], differences: list[str]) -> Conversion:
    """The conversion of ``out`` (the recipe so far) with the config's output keys, validated as a recipe."""
    _outputs(config, out, [], [], out["base"], differences)
    return _validated(out, differences)


def _validated(out: dict[str, Any], differences: list[str]) -> Conversion:
    try:
        recipe = Recipe.from_dict(out)
    except RecipeError as err:
        raise RecipeError(f"the mergekit config as a specmerge recipe: {err}", err.loc) from None
    return Conversion(out, recipe, differences)


def say_conversion(conversion: Conversion, stream: Any = None) -> None:
    """On the console (stderr): the method the config runs as, and each difference from mergekit."""
    stream = stream or sys.stderr
    print(f"mergekit config: run with mergekit's meaning as specmerge's '{conversion.recipe.method}'", file=stream)
    for note in conversion.differences:
        print(f"mergekit config: {note}", file=stream)


def _shared(
    dialect: Dialect, given: Mapping[str, Any], method: str, differences: list[str]
) -> tuple[dict[str, Any], Any]:
    """The specmerge params from the config's ``parameters`` (mergekit's defaults for those omitted), and a weight
    given there for every model (or None)."""
    params = dict(dialect.fixed)
    for key in given:
        if key not in dialect.shared and key not in dialect.per_model:
            known = [*dialect.shared, *dialect.per_model]
            raise RecipeError(
                unknown_name_message(f"parameter of mergekit's {method}", key, known), ("parameters", key)
            )
    for key, target in dialect.shared.items():
        value = _setting(target, given.get(key))
        if value is REQUIRED:
            raise RecipeError(
                f"mergekit's {method} needs parameters: {{{key}: ...}} (it has no default)", ("parameters",)
            )
        if target.kind == "none":
            if key in given and value != target.default:
                differences.append(f"{key}: {value} changes nothing in mergekit's {method} ({target.why}): not used")
            continue
        params[target.name] = _mapped(value, target, f"parameters.{key}")
    return params, given.get("weight")


def _per_model(
    dialect: Dialect, experts: Sequence[ModelEntry], given: Mapping[str, Any], differences: list[str]
) -> tuple[list[Any] | None, list[dict[str, Any]], dict[str, Any]]:
    """Each expert's weight (None when the method takes none) and own params (mergekit's per-model parameters, with
    those in ``parameters`` and then mergekit's defaults for the rest), or those params once when every expert has
    the same (then the experts' own are empty)."""
    own: list[dict[str, Any]] = [{} for _ in experts]
    weights: list[Any] | None = [] if "weight" in dialect.per_model else None
    for i, entry in enumerate(experts):
        for key in entry.parameters or {}:
            if key in dialect.shared:
                raise RecipeError(
                    f"model '{entry.model}': '{key}' is one value for the whole merge: put it under parameters",
                    ("models", i, key),
                )
            if key not in dialect.per_model:
                known = list(dialect.per_model) or ["none"]
                raise RecipeError(
                    unknown_name_message(f"per-model parameter of mergekit's {dialect.method}", key, known),
                    ("models", i, key),
                )
    for key, target in dialect.per_model.items():
        values = []
        for entry in experts:
            value = _setting(target, (entry.parameters or {}).get(key), given.get(key))
            if value is REQUIRED:
                raise RecipeError(f"model '{entry.model}' has no {key} (mergekit requires one for {dialect.method})")
            values.append(value)
        if target.kind == "none":
            if any(v != target.default for v in values):
                differences.append(f"{key} changes nothing in mergekit's {dialect.method} ({target.why}): not used")
            continue
        mapped = [_mapped(v, target, f"{key} of model '{e.model}'") for v, e in zip(values, experts, strict=True)]
        if target.kind == "weights" and weights is not None:
            weights.extend(mapped)
        else:
            for i, value in enumerate(mapped):
                own[i][target.name] = value
    common = own[0] if own and all(o == own[0] for o in own) else {}  # the same for every model: the method's
    return weights, [{} for _ in experts] if common else own, common


def _setting(target: Target, *given: Any) -> Any:
    """The setting of a parameter given (from the highest precedence down, None where not given) with mergekit's
    default after them (:func:`~specmerge.pipeline.recipe.mergekit.config.setting_of`); REQUIRED when none is given
    and mergekit requires one."""
    value = setting_of(*given, None if target.default is REQUIRED else target.default)
    return target.default if value is None else value


def _mapped(value: Any, target: Target, what: str) -> Any:
    """A mergekit setting (number, gradient, conditions, or a boolean) as the specmerge value (mapped number by
    number); a boolean or text that varies is refused (specmerge varies numbers only)."""
    if not varies(value):
        if target.value is None or isinstance(value, bool):
            return value
        return target.value(float(value))

    def number(leaf: Any, k: int) -> Any:
        if isinstance(leaf, bool) or not isinstance(leaf, int | float):
            raise ValueError(f"{what}: value {k} is {leaf!r}: only numbers vary across layers or filters in specmerge")
        return target.value(float(leaf)) if target.value else leaf

    try:
        return validate_value(value, number, what)
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _base_weight(base_entry: ModelEntry, every: Any, method: str) -> Any:
    """The weight of the model standing as the base among the points of a base-free spherical mean."""
    weight = setting_of((base_entry.parameters or {}).get("weight"), every)
    if weight is None:
        raise RecipeError(f"model '{base_entry.model}' has no weight (mergekit requires one for {method})")
    return _mapped(weight, Target("weights"), f"weight of model '{base_entry.model}'")


def _linear_base(
    base_entry: ModelEntry | None,
    given: Mapping[str, Any],
    params: dict[str, Any],
    weights: list[Any] | None,
    every: Any,
) -> None:
    """linear with the base among the models: its weight is ``base_weight``; without normalize, the same average when
    the weights are constant and sum to 1, else ``model_sum`` (mergekit's sum of the models, the base's too)."""
    base_weight = setting_of((base_entry.parameters or {}).get("weight"), every) if base_entry else None
    if base_entry is not None and base_weight is None:
        raise RecipeError(f"model '{base_entry.model}' has no weight (mergekit requires one for linear)")
    if base_weight is not None:
        params["base_weight"] = base_weight
    if params.get("normalize", True):
        return
    values = [base_weight or 0, *(weights or [])]
    if not any(varies(v) for v in values) and abs(sum(float(v) for v in values) - 1) <= 1e-9:
        params["normalize"] = True  # weights summing to 1: the same average
        return
    params.pop("normalize")  # the sum of the models, the base scaled by the weights too
    params["method"] = "model_sum"


def _outputs(
    config: MergekitConfig,
    out: dict[str, Any],
    keys: Sequence[str],
    paths: Sequence[str],
    base: str,
    differences: list[str],
) -> None:
    """dtype, out_dtype, tokenizer_source, tokenizer and chat_template as specmerge's keys."""
    for key in ("dtype", "out_dtype"):
        value = getattr(config, key)
        if value is not None and value not in DTYPES:
            raise RecipeError(f"{key} '{value}': give one of {', '.join(sorted(set(DTYPES)))}", (key,))
    out_dtype = config.out_dtype or config.dtype
    if out_dtype:  # else each tensor's own dtype, as mergekit keeps the models'
        out["dtype"] = DTYPES[out_dtype]
    if config.dtype is not None and DTYPES[config.dtype] != "float32":
        differences.append(
            f"differs from mergekit: mergekit computes in dtype {config.dtype}; specmerge computes in float32 and "
            "rounds once to the output dtype (tensors differ by that dtype's round-off)"
        )
    source = config.tokenizer_source
    if config.tokenizer is not None:
        unknown = [key for key in config.tokenizer if key != "source"]
        if unknown:
            raise RecipeError(f"tokenizer: '{unknown[0]}' (mergekit's token surgery) is not supported", ("tokenizer",))
        if source is not None:
            raise RecipeError("give the tokenizer's source once: tokenizer_source or tokenizer.source", ("tokenizer",))
        source = config.tokenizer.get("source")
    if source in (None, "base") or source == base:
        out["tokenizer_source"] = "base"
    elif source == "union":
        out["tokenizer_source"] = "union"
    elif source in paths:
        out["tokenizer_source"] = keys[list(paths).index(source)]
    else:
        raise RecipeError(f"tokenizer_source '{source}' is not one of the models: give union, base or one of them")
    template = config.chat_template
    if template in TEMPLATE_NAMES:
        raise RecipeError(
            f"chat_template '{template}' is one of mergekit's built-in templates, which specmerge does not ship: give "
            "the template's text or a .jinja file",
            ("chat_template",),
        )
    if template is None:  # mergekit keeps the template of the tokenizer it copies: the base's, or the source model's
        source = out.get("tokenizer_source", "base")
        out["chat_template"] = "base" if source in ("base", "union") else source
    elif template != "auto":
        out["chat_template"] = template
    else:
        differences.append(
            "differs from mergekit: chat_template auto takes the most common template in mergekit; specmerge takes the "
            "experts' when they agree, else the base's, and refuses experts that differ (it says which one it took)"
        )
