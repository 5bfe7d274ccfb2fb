"""The merge recipe: a strict schema, validated completely before any tensor is read.

A recipe names the base model, the experts, the method and its parameters, per-tensor overrides and
the output options. ``load_recipe(path)`` reads YAML (relative paths are taken from the recipe file's
folder), ``Recipe.from_dict(d)`` or ``Recipe(**d)`` build one in Python, ``Recipe.to_yaml()`` writes it
back (it round-trips). Every mistake raises :class:`RecipeError` with a one-line message that names the
key, the value and, for misspellings, the closest valid name.

After validation a recipe is complete: ``params`` (and every merge override's ``params``) hold every
parameter of their method with defaults filled in, and ``expert_keys`` holds one unique name per expert.

The model is also the one source of ``specmerge merge``'s options: each field's ``description`` is its
help, and its flag is ``--field-name`` unless a :class:`~specmerge.pipeline.recipe.values.Flag` says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.foreign import RECIPE_KEYS
from specmerge.io.hub.ids import HUB_SPEC, absolute_spec
from specmerge.methods import all_methods, get_method
from specmerge.pipeline.recipe.errors import TOO_DEEP, line_of, parse_yaml, recipe_error
from specmerge.pipeline.recipe.expert_entries import (
    WEIGHTS_HELP,
    check_expert_params,
    check_weights,
    default_expert_keys,
    normalize_weights,
    refuse_boolean_weights,
    split_entries,
)
from specmerge.pipeline.recipe.frankenmerge import LAYERS_HELP, LayerRange, check_layers
from specmerge.pipeline.recipe.input_choice import BASE, CONFIG_SOURCE_HELP, MODULES_HELP, ConfigSource, ModuleSources
from specmerge.pipeline.recipe.layered import validate_layered
from specmerge.pipeline.recipe.override import Override
from specmerge.pipeline.recipe.tokenizer_source import TOKENIZER_SOURCE_HELP, UNION, TokenizerSource
from specmerge.pipeline.recipe.values import (
    ADDRESS_HELP,
    CHAT_TEMPLATE_HELP,
    EXECUTOR_HELP,
    MERGE_EMBEDDINGS_HELP,
    QUANTIZE_HELP,
    Device,
    Flag,
    auto_is_none,
    dtype_name,
    override_shorthands,
    parse_size,
    size_field,
)

# Output and compute dtypes a recipe may name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class Recipe(BaseModel):
    """A complete, validated merge recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = Field(min_length=1, description=f"base model: Hugging Face folder, .safetensors file or {HUB_SPEC}")
    experts: list[str] = Field(
        description=f"fine-tuned experts of the same base: model folders/files, PEFT LoRA adapters or {HUB_SPEC}",
    )
    expert_keys: Annotated[list[str] | None, Flag("--expert-key", metavar="NAME")] = Field(
        default=None,
        validate_default=True,
        description="names of the experts in reports, config_source, tokenizer_source and modules, one per expert, "
        "in order (repeatable; default: each expert path's folder/file name, made unique); seeded methods (DARE) "
        "seed each expert's mask from its weights, never from its name",
    )
    expert_weights: Annotated[
        list[float | list[Any]] | None, BeforeValidator(refuse_boolean_weights), Flag("--weight", metavar="W")
    ] = Field(default=None, validate_default=True, description=WEIGHTS_HELP)
    method: Annotated[str, Flag("--method", "-m")] = Field(
        default="swudi_a", description="merge method (see `specmerge methods`)"
    )
    params: Annotated[dict[str, Any], Flag("--param", "-p", "KEY=VALUE")] = Field(
        default_factory=dict,
        validate_default=True,
        description="method parameter, read as in a YAML recipe (repeatable; default: the method's defaults)",
    )
    overrides: Annotated[
        list[Override], BeforeValidator(override_shorthands), Flag("--override", metavar="PATTERN=RULE")
    ] = Field(
        default_factory=list,
        validate_default=True,
        description="per-tensor treatment: pattern (fnmatch glob), action merge / average / keep_base, method, "
        "params; the first matching pattern wins (repeatable; on the command line PATTERN=RULE, RULE keep_base, "
        "average, merge or a method with optional :key=value,..., e.g. '*.mlp.*=ties:density=0.3')",
    )
    expert_params: Annotated[list[dict[str, Any]] | None, Flag("--expert-params", metavar="{KEY: VALUE}")] = Field(
        default=None,
        validate_default=True,
        description="each expert's own values of the method's per-expert parameters (density, gamma, epsilon; "
        "mergekit's per-model parameters), one mapping per expert in order (repeatable, e.g. '{density: 0.5}'); in "
        "a recipe experts: [{path: ..., params: {density: 0.5}}]",
    )
    non_matrix: Literal["average", "keep_base"] = Field(
        default="average", description="what the tensors the method does not take get"
    )
    scale_non_matrix: bool = Field(default=False, description="the method's `scale` also multiplies averaged tensors")
    chat_template: str | None = Field(default=None, description=CHAT_TEMPLATE_HELP)
    merge_embeddings: Annotated[bool | None, BeforeValidator(auto_is_none)] = Field(
        default=None, description=MERGE_EMBEDDINGS_HELP
    )
    dtype: Annotated[Literal["auto", "float32", "float16", "bfloat16"], BeforeValidator(dtype_name)] = Field(
        default="auto", description="output dtype; auto = each tensor's base dtype"
    )
    compute_dtype: Annotated[Literal["float32", "float64"], BeforeValidator(dtype_name)] = Field(
        default="float32", description="dtype of the merge's arithmetic"
    )
    device: Device = Field(default="cpu", description="cpu, cuda, cuda:N or auto (cuda when available)")
    gpu_memory: Annotated[int | str | None, BeforeValidator(size_field("gpu_memory")), Flag(metavar="SIZE")] = Field(
        default=None,
        description="device memory a merge on a GPU may use, e.g. 20GiB (default: the free memory less 10 %); "
        "spectral layers are batched to fit it, and a layer that cannot fit is computed on the CPU (said)",
    )
    shard_size: Annotated[int | str, BeforeValidator(size_field("shard_size")), Flag(metavar="SIZE")] = Field(
        default="5GB",
        description="largest output shard: bytes, or 500MB / 2GB (powers of 1000) / 1.5GiB (powers of 1024)",
    )
    quantize: Literal["none", "fp8-block", "same"] = Field(default="none", description=QUANTIZE_HELP)
    output_format: Literal["model", "lora"] = Field(
        default="model",
        description="model: a merged model folder; lora: a PEFT adapter (every expert a LoRA adapter), exact "
        "unless max_rank",
    )
    max_rank: Annotated[int | None, Flag(metavar="RANK")] = Field(
        default=None,
        ge=1,
        description="lora output: truncate each module to this rank (SVD; the discarded energy is reported)",
    )
    config_source: ConfigSource = Field(default=BASE, description=CONFIG_SOURCE_HELP)
    modules: ModuleSources = Field(default_factory=dict, validate_default=True, description=MODULES_HELP)
    tokenizer_source: TokenizerSource = Field(default=UNION, description=TOKENIZER_SOURCE_HELP)
    layers: list[LayerRange] | None = Field(default=None, description=LAYERS_HELP)
    executor: Literal["local", "ray"] = Field(default="local", description=EXECUTOR_HELP)
    address: Annotated[str | None, Flag(metavar="ADDRESS")] = Field(default=None, description=ADDRESS_HELP)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise recipe_error(err, data) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Validate a plain mapping (as read from YAML or JSON); the mapping is not modified."""
        if not isinstance(data, Mapping):
            raise RecipeError(f"a recipe is a mapping of keys (base, experts, method, ...), got {type(data).__name__}")
        for key in data:
            if not isinstance(key, str):
                raise RecipeError(f"recipe keys are names, got {key!r}", (key,))
        try:
            return cls(**data)
        except RecursionError:  # a value nested thousands deep
            raise RecipeError(f"the recipe is nested too deeply to validate: {TOO_DEEP}") from None

    @property
    def shard_bytes(self) -> int:
        """The largest output shard, in bytes."""
        return parse_size(self.shard_size)

    def to_yaml(self) -> str:
        """The recipe as YAML; ``Recipe.from_dict(yaml.safe_load(r.to_yaml())) == r``."""
        return yaml.safe_dump(self.model_dump(), sort_keys=False, default_flow_style=False)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = split_entries(data)
        for key in data:
            if key in cls.model_fields:
                continue
            if key == "tune":
                raise RecipeError(
                    "'tune:' is a search space for `specmerge tune RECIPE --eval CMD`, which merges every setting; "
                    "a merge runs one recipe: remove 'tune:' (or run specmerge tune)",
                    (key,),
                )
            if any(key in (p.name for p in m.params) for m in all_methods().values()):
                raise RecipeError(
                    f"unknown recipe key '{key}': method parameters go under 'params:' (params: {{{key}: ...}})",
                    (key,),
                )
            foreign = RECIPE_KEYS.get(str(key))
            raise RecipeError(
                unknown_name_message("recipe key", str(key), list(cls.model_fields), foreign=foreign), (key,)
            )
        empty = {key: {} if key == "params" else [] for key in ("params", "overrides") if data.get(key, 0) is None}
        return {**data, **empty}  # an empty `params:` or `overrides:` in YAML means none

    @field_validator("base", "experts", mode="before")
    @classmethod
    def _fspath(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, list | tuple):
            return [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
        return value

    @field_validator("experts")
    @classmethod
    def _distinct_experts(cls, experts: list[str]) -> list[str]:
        seen: dict[str, int] = {}
        for i, path in enumerate(experts):
            if not path:
                raise RecipeError(f"experts[{i}] is an empty path", (i,))
            key = os.path.normpath(path)
            if key in seen:
                raise RecipeError(f"expert '{path}' is listed twice (experts[{seen[key]}] and experts[{i}])", (i,))
            seen[key] = i
        return experts

    @field_validator("expert_keys")
    @classmethod
    def _expert_keys(cls, keys: list[str] | None, info: ValidationInfo) -> list[str] | None:
        experts = info.data.get("experts")
        if experts is None:
            return keys  # experts are invalid; that error is reported
        if keys is None:
            return default_expert_keys(experts)
        if len(keys) != len(experts):
            raise RecipeError(
                f"expert_keys has {len(keys)} names but there are {len(experts)} experts: give one name per expert",
            )
        for i, key in enumerate(keys):
            if not key:
                raise RecipeError(f"expert_keys[{i}] is empty", (i,))
            if key in keys[:i]:
                raise RecipeError(f"expert_keys has '{key}' twice: the names must be unique", (i,))
        return keys

    @field_validator("expert_weights")
    @classmethod
    def _expert_weights(cls, weights: list[float] | None, info: ValidationInfo) -> list[float] | None:
        experts = info.data.get("experts")
        return normalize_weights(weights, None if experts is None else len(experts))

    @field_validator("method")
    @classmethod
    def _known_method(cls, name: str) -> str:
        try:
            return get_method(name).name  # as registered: SWUDI-A is swudi_a
        except ValueError as err:
            raise RecipeError(str(err)) from None

    @field_validator("params")
    @classmethod
    def _complete_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "method" not in info.data:
            return params  # unknown method; that error is reported
        experts = info.data.get("experts")
        try:
            return validate_layered(get_method(info.data["method"]), params, len(experts) if experts else None)
        except ValueError as err:
            raise RecipeError(str(err)) from None

    @field_validator("overrides")
    @classmethod
    def _complete_override_params(cls, overrides: list[Override], info: ValidationInfo) -> list[Override]:
        if "method" not in info.data or "params" not in info.data:
            return overrides
        completed = []
        for i, override in enumerate(overrides):
            if override.action != "merge":
                completed.append(override)
                continue
            try:
                method = get_method(override.method or info.data["method"])
            except ValueError as err:
                raise RecipeError(f"override '{override.pattern}': {err}", (i, "method")) from None
            # Without its own method an override refines the recipe's params; with one it starts from its defaults.
            given = override.params if override.method else {**info.data["params"], **override.params}
            experts = info.data.get("experts")
            try:
                params = validate_layered(method, given, len(experts) if experts else None)
            except ValueError as err:
                raise RecipeError(f"override '{override.pattern}': {err}", (i, "params")) from None
            named = {"method": method.name} if override.method else {}
            completed.append(override.model_copy(update={"params": params, **named}))
        n = len(info.data["experts"]) if info.data.get("experts") else None
        for i, override in enumerate(completed):
            if override.expert_weights is not None:
                weights = normalize_weights(override.expert_weights, n) or [1.0] * len(override.expert_weights)
                completed[i] = override.model_copy(update={"expert_weights": weights})
        return completed

    @field_validator("expert_params")
    @classmethod
    def _expert_params(cls, own: list[dict[str, Any]] | None, info: ValidationInfo) -> list[dict[str, Any]] | None:
        if "method" not in info.data or "params" not in info.data or "overrides" not in info.data:
            return own  # an error in those is reported
        method, overrides = info.data["method"], info.data["overrides"]
        merging = [(o.method or method, o.params) for o in overrides if o.action == "merge"]
        return check_expert_params(own, info.data.get("expert_keys"), [(method, info.data["params"]), *merging])

    @field_validator("max_rank", mode="before")
    @classmethod
    def _rank_not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise RecipeError(f"max_rank must be a whole number >= 1, got {value!r}")
        return value

    @model_validator(mode="after")
    def _lora_only_options(self) -> Recipe:
        if self.max_rank is not None and self.output_format != "lora":
            raise RecipeError("max_rank applies only to output_format lora; remove it or set output_format: lora")
        for key in ("quantize", "chat_template"):  # set (not at its default) for an adapter, which has neither
            if getattr(self, key) not in ("none", None, "auto") and self.output_format != "model":
                raise RecipeError(f"{key} applies to a merged model (output_format model), not to an adapter")
        if self.address is not None and self.executor != "ray":
            raise RecipeError("address (a Ray cluster) applies only to executor ray; remove it or set executor: ray")
        check_layers(self)
        merging = [(o.method or self.method, o.params) for o in self.overrides if o.action == "merge"]
        check_weights(self.expert_weights, [(self.method, self.params), *merging])
        for o in self.overrides:
            if o.expert_weights is not None:
                check_weights(o.expert_weights, [(o.method or self.method, o.params)] if o.action == "merge" else [])
        return self


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a YAML recipe; relative ``base`` and ``experts`` paths are taken from its folder."""
    return load_recipe_with(path)[0]


def load_recipe_with(path: str | os.PathLike, section: str | None = None) -> tuple[Recipe, Any]:
    """:func:`load_recipe`, and the value of one more top-level key ``section`` that is not a recipe key (None when
    absent), taken out before the recipe is validated (``specmerge tune`` reads its ``tune:`` this way)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"recipe file '{path}' cannot be read: {err}") from None
    data = parse_yaml(text, path)
    if data is None:
        raise RecipeError(f"{path}: the recipe file is empty; it needs at least 'base' and 'experts'")
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of keys (base, experts, ...), got {type(data).__name__}")
    extra = data.pop(section, None) if section is not None else None
    data = _resolve_paths(data, Path(os.path.abspath(path)).parent)  # absolute: a relative path is never an id
    try:
        return Recipe.from_dict(data), extra
    except RecipeError as err:
        line = line_of(text, err.loc)
        raise RecipeError(f"{path}:{line}: {err}" if line else f"{path}: {err}", err.loc) from None


def _resolve_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    def resolve(value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        value = os.path.expanduser(value)
        return value if os.path.isabs(value) else absolute_spec(value, folder)  # a hub id (nothing there) stays one

    data = dict(data)
    if "base" in data:
        data["base"] = resolve(data["base"])
    if isinstance(data.get("layers"), list):
        data["layers"] = [
            {**r, "model": resolve(r["model"])} if isinstance(r, dict) and "model" in r else r for r in data["layers"]
        ]
    if isinstance(data.get("experts"), list):
        data["experts"] = [
            {**e, "path": resolve(e["path"])} if isinstance(e, dict) and "path" in e else resolve(e)
            for e in data["experts"]
        ]
    return data
