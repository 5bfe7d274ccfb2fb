"""The PEFT LoRA adapter format: reading adapters as per-tensor low-rank deltas (:mod:`.peft_write` writes them).

``open_adapter(folder)`` reads ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``); ``adapter.deltas()`` names, for every adapted base weight, the factors of
its delta, and ``adapter.load(name)`` returns a :class:`specmerge.linalg.lowrank.LoraDelta` with

    delta W = scale * B @ A,   scale = alpha / r   (alpha / sqrt(r) with rsLoRA),

r the module's rank (read from the stored factors, which is what ``rank_pattern`` sets) and alpha
from ``alpha_pattern`` or ``lora_alpha``. Patterns follow PEFT: the first key in the pattern dict
that matches the end of the module name (``(.*\\.)?key$``) wins. With ``fan_in_fan_out`` (GPT-2's
Conv1D, whose weight is stored as d_in x d_out) the delta is transposed into the weight's layout. LoRA on
embeddings is a delta too; DoRA, LoRA biases, saved modules and trainable tokens are read by :mod:`.peft_variants`;
other PEFT types and config fields that make an adapter something else are refused by name (:mod:`.peft_fields`).
The config is checked against the factors before anything is merged: ``r`` (or the ``rank_pattern``
entry of a module) must be the rank of its stored factors, ``lora_alpha`` and ``alpha_pattern`` values
positive finite numbers, ``use_rslora`` and ``fan_in_fan_out`` booleans, pattern keys regular expressions,
and every stored module one that ``target_modules`` selects. A config that leaves out ``r``,
``lora_alpha``, ``use_rslora`` or ``fan_in_fan_out`` gets PEFT's own defaults (:data:`PEFT_DEFAULTS`,
those of ``peft.LoraConfig``), and an :class:`AdapterConfigWarning` says which were used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import SpecmergeWarning
from specmerge.io.formats.files import folder_file
from specmerge.io.formats.names import ADAPTER_CONFIG, ADAPTER_FILES, PEFT_PREFIX, lora_key
from specmerge.io.formats.peft_fields import AdapterError, check_fields, config_object
from specmerge.io.formats.peft_params import stack_deltas, stack_rank, targeted_parameter
from specmerge.io.formats.peft_variants import split_variants
from specmerge.io.formats.protocol import Closing, TensorInfo, TensorSource
from specmerge.io.formats.sources import open_stored
from specmerge.linalg.lowrank import LoraDelta

_KEY = re.compile(rf"^(?:{re.escape(PEFT_PREFIX)})?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# peft.LoraConfig's defaults (peft 0.21, tuners/lora/config.py) for the keys that set the delta.
PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8, "use_rslora": False, "fan_in_fan_out": False}


class AdapterConfigWarning(SpecmergeWarning):
    """An ``adapter_config.json`` leaves out keys; PEFT's defaults are used for them."""


@dataclass(frozen=True)
class LoraSettings:
    """The keys of a PEFT LoRA config that set the deltas, checked (PEFT's defaults for missing ones)."""

    r: int
    lora_alpha: float
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_rslora: bool
    fan_in_fan_out: bool
    target_modules: list[str] | str | None


def lora_settings(config: Mapping[str, Any], where: str) -> LoraSettings:
    """Check the LoRA keys of a PEFT config (``where`` names it in messages); warn once for defaults used."""
    missing = [key for key in PEFT_DEFAULTS if key not in config]
    if missing:
        used = ", ".join(f"{key} = {json.dumps(PEFT_DEFAULTS[key])}" for key in missing)
        plural = "s" if len(missing) > 1 else ""
        message = f"{where} has no {', '.join(missing)}: using PEFT's default{plural} {used}"
        warnings.warn(message, AdapterConfigWarning, stacklevel=2)
    values = {**PEFT_DEFAULTS, **{k: config[k] for k in PEFT_DEFAULTS if k in config}}
    r = _rank(values["r"], f"{where}: 'r'")
    alpha = _alpha(values["lora_alpha"], f"{where}: 'lora_alpha'")
    flags = {}
    for key in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(values[key], bool):
            raise AdapterError(f"{where}: '{key}' must be true or false, got {values[key]!r}")
        flags[key] = values[key]
    patterns = {}
    for key, check in (("rank_pattern", _rank), ("alpha_pattern", _alpha)):
        given = {} if config.get(key) is None else config[key]
        if not isinstance(given, dict):
            raise AdapterError(f"{where}: '{key}' must map module-name patterns to values, got {given!r}")
        for pattern, value in given.items():
            try:
                re.compile(rf"(.*\.)?({pattern})$")
            except re.error as err:
                raise AdapterError(f"{where}: {key} key {pattern!r} is not a regular expression ({err})") from None
            check(value, f"{where}: {key}[{pattern!r}]")
        patterns[key] = dict(given)
    targets = config.get("target_modules")
    if not (targets is None or isinstance(targets, str) or _is_name_list(targets)):
        raise AdapterError(f"{where}: 'target_modules' must be a list of module names or a pattern, got {targets!r}")
    if isinstance(targets, str) and targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as err:
            raise AdapterError(f"{where}: target_modules {targets!r} is not a regular expression ({err})") from None
    return LoraSettings(r, alpha, patterns["rank_pattern"], patterns["alpha_pattern"], **flags, target_modules=targets)


def _rank(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{what} must be a whole number >= 1 (the rank of the factors), got {value!r}")
    return value


def _alpha(value: Any, what: str) -> float:
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise AdapterError(f"{what} must be a positive finite number (the LoRA scale is alpha / r), got {value!r}")
    return number


def _is_name_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _targeted(targets: list[str] | str | None, module: str) -> bool:
    """Whether PEFT's ``target_modules`` selects ``module`` (an exact name or a name's end; a str is a full-match
    regex; ``all-linear`` and None are taken to select every stored module)."""
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


@dataclass(frozen=True)
class LoraModule:
    """One adapted weight: the base tensor it changes and how."""

    base_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    module: str
    rank: int
    alpha: float
    scale: float
    shape: tuple[int, int]  # the delta in the base weight's layout
    transposed: bool  # fan_in_fan_out: the base weight is stored d_in x d_out
    embedding: bool = False  # factors lora_embedding_A [r, vocab] / _B [dim, r]: delta = s (B A)^T
    experts: int = 0  # > 0: LoRA on an MoE expert stack [E, ., .] (target_parameters, specmerge.io.formats.peft_params)
    swapped: bool = False  # such a stack's slices are [out, in] (transformers' fused Mixtral), else [in, out]


def _pattern_value(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class LoraAdapter(Closing):
    """A PEFT LoRA adapter read lazily, one module at a time: its config and a source of its factors (which it owns).

    :func:`open_adapter` reads one from a folder; one held in memory passes its config, a source of its tensors and
    the names its messages use (``path``; ``config_name``, default ``path / adapter_config.json``)."""

    def __init__(
        self,
        path: Path,
        config: Any,
        source: TensorSource,
        *,
        config_name: str | None = None,
        config_file: Path | None = None,
    ) -> None:
        self.path, self._source, self._config_file = path, source, config_file
        self.config_name = str(path / ADAPTER_CONFIG) if config_name is None else config_name
        try:
            self.config = config_object(config, self.config_name)
            self._check_supported(self.config_name)
            self.settings = lora_settings(self.config, self.config_name)
            self._modules = self._read_modules()
        except BaseException:
            source.close()
            raise

    def _check_supported(self, config_file: str) -> None:
        kind = self.config.get("peft_type")
        if kind != "LORA":
            raise AdapterError(f"{config_file}: PEFT type {kind!r} is not supported; specmerge merges LoRA adapters")
        check_fields(self.config, config_file)

    def _read_modules(self) -> dict[str, LoraModule]:
        stored, self.variants = split_variants(self._source.infos(), self.config)
        factors: dict[str, dict[str, TensorInfo]] = {}
        for name, info in stored.items():
            match = _KEY.match(name)
            if match is None:
                raise AdapterError(f"{self._source.path}: unexpected tensor '{name}' in a LoRA adapter")
            factors.setdefault(match["module"], {})[match["which"]] = info
        pairs = {module: (pair.get("A"), pair.get("B"), False) for module, pair in factors.items()}
        infos = self._source.infos()
        for module, a_name in self.variants.embedding_A.items():
            pairs[module] = (infos[a_name], infos[self.variants.embedding_B[module]], True)
        if not pairs:
            raise AdapterError(f"{self._source.path}: holds no LoRA factors (lora_A / lora_B weights)")
        modules = {}
        for module, (A, B, embedding) in pairs.items():
            if A is None or B is None:
                raise AdapterError(f"{self._source.path}: module '{module}' has lora_{'B' if A is None else 'A'} only")
            for info in (A, B):
                if not info.dtype.is_floating_point:
                    raise AdapterError(
                        f"{self._source.path}: LoRA factor '{info.name}' is {info.dtype}, not floating point"
                    )
            if len(A.shape) != 2 or len(B.shape) != 2 or A.shape[0] != B.shape[1]:
                raise AdapterError(
                    f"{self._source.path}: module '{module}' has lora_A {list(A.shape)} and lora_B {list(B.shape)}, "
                    "which are not the factors of a linear layer"
                )
            param = targeted_parameter(module, self.config)
            modules[param or f"{module}.weight"] = self._module(module, A, B, embedding, param)
        return modules

    def _module(
        self, module: str, A: TensorInfo, B: TensorInfo, embedding: bool, param: str | None = None
    ) -> LoraModule:
        """One adapted weight, its rank and scale checked against the config (an embedding's factors are
        lora_embedding_A [r, vocab] and lora_embedding_B [dim, r]: its delta is their product transposed; an
        expert stack's, ``param``, hold r ranks per expert)."""
        settings, config_file = self.settings, self.config_name
        if param is not None:
            r = _pattern_value(settings.rank_pattern, module, settings.r)
            experts = stack_rank(A, B, r, param)
            alpha = float(_pattern_value(settings.alpha_pattern, module, settings.lora_alpha))
            scale = alpha / (math.sqrt(r) if settings.use_rslora else r)
            shape = (experts, A.shape[1], B.shape[0])
            return LoraModule(param, module, r, alpha, scale, shape, False, False, experts)
        rank = A.shape[0]
        expected = _pattern_value(settings.rank_pattern, module, None)
        source = "its rank_pattern entry" if expected is not None else "'r'"
        if expected is None:
            expected = settings.r
            source += "" if "r" in self.config else " (missing: PEFT's default)"
        if rank != expected:
            raise AdapterError(
                f"{config_file}: module '{module}' has rank-{rank} factors (lora_A {list(A.shape)}, lora_B "
                f"{list(B.shape)}) but {source} says rank {expected}: the config does not describe these "
                "weights; fix r / rank_pattern in the config"
            )
        if not _targeted(settings.target_modules, module):
            raise AdapterError(
                f"{config_file}: the weights hold module '{module}', which target_modules "
                f"{settings.target_modules!r} does not select: the config does not describe these weights"
            )
        alpha = float(_pattern_value(settings.alpha_pattern, module, settings.lora_alpha))
        scale = alpha / (math.sqrt(rank) if settings.use_rslora else rank)
        transposed = settings.fan_in_fan_out and not embedding
        shape = (A.shape[1], B.shape[0]) if transposed or embedding else (B.shape[0], A.shape[1])
        return LoraModule(f"{module}.weight", module, rank, alpha, scale, shape, transposed, embedding)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored factors (of the first one)."""
        return next(iter(self._source.infos().values())).dtype

    def modules(self) -> dict[str, LoraModule]:
        """The adapted base weights, by base tensor name."""
        return dict(self._modules)

    def load(self, base_name: str) -> LoraDelta:
        """The delta of one adapted base weight, in the weight's layout."""
        module = self._modules.get(base_name)
        if module is None:
            raise AdapterError(f"{self.path}: the adapter does not change '{base_name}'")
        if module.embedding:  # delta = s (B_e A_e)^T = s A_e^T B_e^T
            A = self._source.load(self.variants.embedding_A[module.module])
            B = self._source.load(self.variants.embedding_B[module.module])
            return LoraDelta(A.T.contiguous(), B.T.contiguous(), module.scale)
        B = self._source.load(self._key(module.module, "B"))
        A = self._source.load(self._key(module.module, "A"))
        if module.transposed:  # delta W = (scale B A)^T = scale A^T B^T
            return LoraDelta(A.T.contiguous(), B.T.contiguous(), module.scale)
        return LoraDelta(B, A, module.scale)

    def load_stack(self, base_name: str) -> list[LoraDelta]:
        """Each expert's delta of an adapted expert stack (``target_parameters``), in the stack's slice layout."""
        module = self._modules[base_name]
        B = self._source.load(self._key(module.module, "B"))
        A = self._source.load(self._key(module.module, "A"))
        return stack_deltas(A, B, module.experts, module.scale, module.swapped)

    def stored_infos(self) -> dict[str, TensorInfo]:
        """Every tensor the adapter's file holds, by its stored name."""
        return self._source.infos()

    def load_stored(self, name: str) -> torch.Tensor:
        """One tensor of the adapter's file by its stored name (DoRA magnitudes, biases, saved modules...)."""
        return self._source.load(name)

    def _key(self, module: str, which: str) -> str:
        for name in (lora_key(module, which), lora_key(module, which, prefixed=False)):
            if name in self._source.infos():
                return name
        raise AdapterError(f"{self.path}: lora_{which} of '{module}' not found")

    def check_base(self, base: dict[str, TensorInfo]) -> None:
        """Every adapted module must be a 2-D base weight of the delta's shape (else: adapter for another base)."""
        for name, module in list(self._modules.items()):
            info = base.get(name)
            if info is None:
                raise AdapterError(
                    f"{self.path}: targets '{name}', which the base model does not have; "
                    "was the adapter trained on another base?"
                )
            experts, fan_in, fan_out = module.shape if module.experts else (0, 0, 0)
            if module.experts and tuple(info.shape) == (experts, fan_out, fan_in) and fan_in != fan_out:
                module = self._modules[name] = dataclasses.replace(module, shape=tuple(info.shape), swapped=True)
            elif module.experts and fan_in == fan_out:
                raise AdapterError(
                    f"{self.path}: its LoRA on the expert stack '{name}' has square slices ({fan_in} x {fan_out}), "
                    "whose layout its factors do not tell; merge the adapter into the model with PEFT first"
                )
            if tuple(info.shape) != module.shape:
                raise AdapterError(
                    f"{self.path}: '{name}' is {list(info.shape)} in the base but the adapter's delta is "
                    f"{list(module.shape)}; the adapter was trained on another base model"
                )

    def files(self) -> list[Path]:
        """The real paths (links resolved) of the files the adapter reads: its config and its weights (none for an
        adapter held in memory)."""
        return [*([self._config_file] if self._config_file else []), *self._source.files()]

    def close(self) -> None:
        self._source.close()


def is_adapter(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PEFT adapter folder (holds an ``adapter_config.json``, which is checked on opening)."""
    return os.path.lexists(Path(path) / ADAPTER_CONFIG)


def open_adapter(path: str | os.PathLike) -> LoraAdapter:
    """The PEFT LoRA adapter saved in folder ``path`` (``save_pretrained``): its config and weights file, both files
    of the folder (not links out of it)."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"{folder}: not a folder; a PEFT adapter is a folder with {ADAPTER_CONFIG}")
    config_file = folder / ADAPTER_CONFIG
    if not os.path.lexists(config_file):
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG}; point at a PEFT adapter folder (save_pretrained output)")
    real_config = folder_file(config_file, folder)  # a file of the folder, not a link elsewhere
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{config_file}: not valid JSON ({err})") from None
    except RecursionError:
        raise AdapterError(f"{config_file}: not valid JSON (nested too deeply)") from None
    config_object(config, str(config_file))  # the config's own errors before the weights'
    weights = next((folder / f for f in ADAPTER_FILES if os.path.lexists(folder / f)), None)
    if weights is None:
        raise AdapterError(f"{folder}: no adapter weights ({' or '.join(ADAPTER_FILES)})")
    folder_file(weights, folder)
    return LoraAdapter(folder, config, open_stored(weights), config_file=real_config)  # its own checks
