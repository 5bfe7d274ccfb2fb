"""Option values typed as text, read as a YAML recipe reads them, and how an option is spelled on the command line.

One reader for every place where a person types a value outside a recipe file: the command line's flags,
``-p/--param key=value`` of ``specmerge merge`` and the ``NAME:key=value,...`` method specs of ``specmerge
inspect``. A value is read as the same text in a YAML recipe is (``0.5``, ``true``, ``.inf``, ``psqrt``,
``5GB``; ``''`` stays the empty string), so the command line and a recipe accept and refuse exactly the same
values: the model's validation decides, never the reader.

:class:`Flag` is the command-line spelling of a model field where it is not the default ``--field-name``;
it rides in the field's annotation (``Annotated[..., Flag(...)]``) so that the model stays the one source
of every option, its help (the field's ``description``) and its flag. :func:`option_flag` gives the flag
that error messages name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel
from pydantic.fields import FieldInfo

from specmerge.errors import RecipeError

# Decimal units are powers of 1000 (5GB = 5e9 bytes, as Hugging Face writes shard sizes), binary ones of 1024.
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
DEVICE_PATTERN = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")  # the devices a recipe or an option may name


def auto_is_none(value: Any) -> Any:
    """``auto`` (a YAML or command-line spelling) as None: the choice is made later, by the rule of the field."""
    return None if isinstance(value, str) and value.strip().lower() == "auto" else value


def check_device(device: str) -> str:
    """``device`` when it is one a recipe may name (cpu, cuda, cuda:N, auto), else a one-line :class:`RecipeError`."""
    if not DEVICE_PATTERN.match(device):
        raise RecipeError(f"device '{device}' is not one of cpu, cuda, cuda:N (N = 0, 1, ...), auto")
    return device


Device = Annotated[str, AfterValidator(check_device)]

EXECUTOR_HELP = (
    "what runs the work: local (this process: read ahead, compute, write behind) or ray (Ray tasks over the CPUs "
    "and GPUs of this machine or a cluster; pip install 'specmerge[ray]'); the output is the same bits"
)
QUANTIZE_HELP = (
    "the merged model's weights: none (dense), fp8-block (float8 codes with a scale per 128 x 128 block, as "
    "DeepSeek-V3 ships), same (the base's fp8 scheme); the quantization error is reported"
)
CHAT_TEMPLATE_HELP = (
    "the merged model's chat template: auto (default: the experts' when they agree, else the base's; experts that "
    "differ are refused), base, an expert's name, a path to a .jinja file, or the template text itself"
)
MERGE_EMBEDDINGS_HELP = (
    "whether embeddings and lm_head get the method (true) or the non_matrix rule (false); default auto: the "
    "method's own convention (elementwise methods, slerp and model_stock merge them; methods of linear layers, such "
    "as the spectral ones, average them as their papers do); the console says which tensors did not get the method"
)
ADDRESS_HELP = "with executor ray: the cluster to use (auto, or ray://host:10001); default a local one for the merge"

# Dtype spellings people type (mergekit's bf16/fp16, torch's torch.float32) -> the names a recipe holds.
DTYPE_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16", "fp32": "float32", "f32": "float32",
    "float": "float32", "fp64": "float64", "f64": "float64", "double": "float64",
}  # fmt: skip


def dtype_name(value: Any) -> Any:
    """A dtype as typed (``bf16``, ``FP16``, ``torch.float32``) as the name a recipe holds (``bfloat16``, ...); any
    other value unchanged (the field then says which names it takes)."""
    if not isinstance(value, str):
        return value
    name = value.strip().lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class Flag:
    """The command-line spelling of a model field: ``name`` (default ``--field-name``, or ``--no-field-name``
    for a switch that is on by default), an optional one-letter ``short`` alias and the ``metavar`` of help."""

    name: str | None = None
    short: str | None = None
    metavar: str | None = None


def field_flag(name: str, field: FieldInfo) -> Flag:
    """The :class:`Flag` declared on ``field`` (named ``name`` in its model), its ``name`` filled in."""
    declared = next((m for m in field.metadata if isinstance(m, Flag)), Flag())
    if declared.name:
        return declared
    switch_off = field.annotation is bool and field.get_default(call_default_factory=True) is True
    spelled = name.replace("_", "-")
    return Flag(f"--no-{spelled}" if switch_off else f"--{spelled}", declared.short, declared.metavar)


def option_flag(model: type[BaseModel], name: str) -> str | None:
    """The long flag of ``model``'s field ``name`` (``--rank-ratio``), or None when it has no such field."""
    field = model.model_fields.get(name)
    return None if field is None else field_flag(name, field).name


def parse_value(text: str, where: str) -> Any:
    """``text`` read as a YAML recipe reads a value; blank text stays as typed (the model refuses it where it must).

    ``where`` names the value in the one-line error (``--param scale=``, ``--dtype``).
    """
    if not text.strip():
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not a YAML value"
        raise RecipeError(f"{where} {text!r}: not a valid value ({problem}); quote it as in a recipe") from None


def parse_pairs(pairs: Iterable[str], where: str) -> dict[str, Any]:
    """``key=value`` strings to a dict, each value read by :func:`parse_value`; a later key replaces an earlier one.

    ``where`` names the pairs in the one-line errors (``--param``, ``method 'swudi:t=1'``).
    """
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"{where} expects key=value, got '{pair}'")
        values[key] = parse_value(text, f"{where} {key}=")
    return values


OVERRIDE_FORM = "PATTERN=RULE (RULE: keep_base, average, merge, or a method with optional :key=value,...)"


def parse_override(text: str, where: str = "--override") -> dict[str, Any]:
    """An override typed as one string, ``PATTERN=RULE``, as the mapping a recipe holds: ``*.mlp.*=keep_base``,
    ``*.mlp.*=average``, ``*.mlp.*=merge:scale=0.5`` (the recipe's method) or ``*.mlp.*=ties:density=0.3,scale=1``
    (that method); the pattern is everything before the first ``=``, the values are read as :func:`parse_value`."""
    pattern, sep, rule = text.partition("=")
    name, _, params = rule.partition(":")
    name = name.strip()
    if not sep or not pattern or not name:
        raise RecipeError(f"{where} '{text}': expected {OVERRIDE_FORM}, e.g. 'model.layers.*.mlp.*=ties:density=0.3'")
    if name in ("keep_base", "average"):
        if params.strip():
            raise RecipeError(f"{where} '{text}': {name} takes no parameters")
        return {"pattern": pattern, "action": name}
    values = parse_pairs(_split_params(params), f"{where} '{text}':") if params.strip() else {}
    method = {} if name == "merge" else {"method": name}
    return {"pattern": pattern, "action": "merge", **method, "params": values}


def _split_params(text: str) -> list[str]:
    """``a=1,b=[2,3]`` -> ``["a=1", "b=[2,3]"]``: commas inside brackets or braces stay in their value."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def override_shorthands(value: Any) -> Any:
    """A recipe's ``overrides`` with each ``PATTERN=RULE`` string (:func:`parse_override`) as its mapping."""
    if not isinstance(value, list):
        return value
    return [parse_override(item, "override") if isinstance(item, str) else item for item in value]


def size_field(what: str) -> Callable[[Any], Any]:
    """A before-validator of a size setting (``shard_size``, ``gpu_memory``): None kept, a whole float from YAML
    (5e9) as an int, a number of bytes or a size string checked by :func:`parse_size`; anything else refused."""

    def check(value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # 5e9 from YAML
        if not isinstance(value, int | str):
            raise RecipeError(f"{what} must be a number of bytes or a size such as '5GB', got {value!r}")
        parse_size(value, what)
        return value

    return check


def parse_size(value: int | str, what: str = "shard_size") -> int:
    """Bytes from an int or a string such as ``"500MB"``, ``"2GB"`` (10**9) or ``"1.5GiB"`` (2**30); ``what`` names
    the setting in errors."""
    if isinstance(value, bool):
        raise RecipeError(f"{what} must be a number of bytes or a size such as '5GB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).lower() if match else None
        if unit not in _SIZE_UNITS:
            raise RecipeError(
                f"{what} {value!r} is not a size: use bytes or a number with a unit "
                f"(B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024), e.g. '5GB'"
            )
        size = round(float(match.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise RecipeError(f"{what} must be at least 1 byte, got {value!r}")
    return size
