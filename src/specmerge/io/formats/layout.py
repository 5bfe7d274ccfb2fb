"""Which 2-D weights of a checkpoint are stored (in, out), from the base model's architecture, never from shapes.

``torch.nn.Linear`` stores its weight as (out, in) and every spectral method of specmerge reads a task vector
that way (C = sum_i tau_i^T tau_i is d_in x d_in). ``transformers.pytorch_utils.Conv1D`` (GPT-2's "1-D
convolution", really a linear layer) stores its weight transposed, as (in, out) = (nx, nf), and computes
``x @ weight + bias``. A matrix method given such a weight as stored solves the problem of the transposed
layer: its spectrum is over the output side. So the plan marks these weights (``TensorPlan.transposed``),
the executor hands matrix methods the (out, in) view tau_i^T and transposes the merged delta back before
adding it to W_0 and writing; elementwise methods (task arithmetic, TIES, DARE) and averages do not
depend on the orientation and see the stored layout.

The table below lists, per ``model_type`` of ``config.json``, the modules whose weight is a ``Conv1D``, as
(parent, module) pairs of the tensor name ``...<parent>.<module>.weight``. It was read from the modeling
code of transformers 5.23 (every ``Conv1D(`` in ``transformers/models/*/modeling_*.py``):

- ``gpt2`` (``models/gpt2/modeling_gpt2.py``): ``GPT2Attention`` builds ``c_attn``, ``c_proj`` and, for
  cross-attention, ``q_attn`` as Conv1D; a ``GPT2Block`` holds it as ``attn`` and ``crossattention``;
  ``GPT2MLP`` builds ``c_fc`` and ``c_proj``, held as ``mlp``. ``gpt-sw3`` uses the same classes
  (``models/auto/modeling_auto.py`` maps it to ``GPT2Model``, ``GPT2LMHeadModel``, ...).
- ``imagegpt`` (``models/imagegpt/modeling_imagegpt.py``) and ``decision_transformer``
  (``models/decision_transformer/modeling_decision_transformer.py``): copies of GPT-2's attention, block
  and MLP, the same names.
- ``openai-gpt`` (``models/openai/modeling_openai.py``): ``Attention`` builds ``c_attn`` and ``c_proj``,
  ``MLP`` builds ``c_fc`` and ``c_proj``, held by ``Block`` as ``attn`` and ``mlp`` (no cross-attention).
- ``clvp`` and ``clvp_decoder`` (``models/clvp/modeling_clvp.py``): only ``ClvpDecoderMLP`` (``c_fc``,
  ``c_proj``, held as ``mlp`` by the decoder layers); its attention and the encoder (``clvp_encoder``) are
  ``nn.Linear``.

A config without ``model_type`` is matched by its ``architectures`` (the class names those files export).
The composite models of transformers (``encoder-decoder``, ``vision-encoder-decoder``,
``speech-encoder-decoder``, e.g. a ViT encoder with a GPT-2 decoder) apply their ``encoder`` / ``decoder``
sub-config to the tensors under ``encoder.`` / ``decoder.``. Every other model type marks nothing: its 2-D
weights are (out, in). Custom-code models (``auto_map``) are taken at their ``model_type``.

The config is the ``config.json`` of the base folder (or of the folder holding a base given as a
``*.index.json``). A base given as a single weights file (``.safetensors``, ``.bin``) has no config: nothing
is transposed, so a GPT-2-family base must be given as its folder for matrix methods to see (out, in).
PEFT adapters record the same fact as ``fan_in_fan_out`` (PEFT sets it exactly for Conv1D modules), so
:func:`transposed_weights` also marks the weights such adapters change.

The orientation changes the result of the WUDI family, ``closed_form`` and ``spectral_filter`` (C is
d_in x d_in). TSV-M and Iso-C treat the left and right singular vectors alike, so for them
merge(tau^T) = merge(tau)^T and the orientation changes only rounding; they get (out, in) all the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import SpecmergeError
from specmerge.io.formats.files import folder_file
from specmerge.io.formats.names import CONFIG_FILE
from specmerge.linalg.lowrank import FactoredResult

_GPT2 = frozenset(
    {
        ("attn", "c_attn"),
        ("attn", "c_proj"),
        ("crossattention", "c_attn"),
        ("crossattention", "q_attn"),
        ("crossattention", "c_proj"),
        ("mlp", "c_fc"),
        ("mlp", "c_proj"),
    }
)
_OPENAI_GPT = frozenset({("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")})
_CLVP = frozenset({("mlp", "c_fc"), ("mlp", "c_proj")})

# model_type -> the (parent, module) pairs whose ``.weight`` is a transformers Conv1D, stored (in, out).
CONV1D_MODULES: dict[str, frozenset[tuple[str, str]]] = {
    "gpt2": _GPT2,
    "gpt-sw3": _GPT2,
    "imagegpt": _GPT2,
    "decision_transformer": _GPT2,
    "openai-gpt": _OPENAI_GPT,
    "clvp": _CLVP,
    "clvp_decoder": _CLVP,
}
# ``architectures`` class names -> model_type, for a config that lacks ``model_type``.
ARCHITECTURES: dict[str, str] = {
    **dict.fromkeys(
        (
            "GPT2Model", "GPT2LMHeadModel", "GPT2DoubleHeadsModel", "GPT2ForSequenceClassification",
            "GPT2ForTokenClassification", "GPT2ForQuestionAnswering",
        ),
        "gpt2",
    ),
    **dict.fromkeys(
        ("OpenAIGPTModel", "OpenAIGPTLMHeadModel", "OpenAIGPTDoubleHeadsModel", "OpenAIGPTForSequenceClassification"),
        "openai-gpt",
    ),
    **dict.fromkeys(("ImageGPTModel", "ImageGPTForCausalImageModeling", "ImageGPTForImageClassification"), "imagegpt"),
    **dict.fromkeys(("DecisionTransformerModel", "DecisionTransformerGPT2Model"), "decision_transformer"),
    **dict.fromkeys(("ClvpModelForConditionalGeneration", "ClvpModel", "ClvpForCausalLM", "ClvpDecoder"), "clvp"),
}  # fmt: skip
COMPOSITE_MODEL_TYPES = frozenset({"encoder-decoder", "vision-encoder-decoder", "speech-encoder-decoder"})
COMPOSITE_PARTS = ("encoder", "decoder")

CONV1D_LAYOUT = "conv1d (in, out), merged as (out, in)"  # the report's per-tensor "layout" of a transposed weight


class LayoutError(SpecmergeError):
    """The base's config.json cannot be read, so the layout of its weights is unknown."""


def conv1d_modules(config: Mapping[str, Any] | None) -> list[tuple[str, frozenset[tuple[str, str]]]]:
    """(tensor-name prefix, Conv1D (parent, module) pairs) that ``config`` implies; [] for (out, in)-only models."""
    if not config:
        return []
    model_type = config.get("model_type")
    if model_type in COMPOSITE_MODEL_TYPES:
        parts = [(f"{key}.", conv1d_modules(config.get(key))) for key in COMPOSITE_PARTS]
        return [(prefix + inner, modules) for prefix, found in parts for inner, modules in found]
    if model_type is None:
        found = [ARCHITECTURES[a] for a in config.get("architectures") or () if a in ARCHITECTURES]
        model_type = found[0] if found else None
    modules = CONV1D_MODULES.get(model_type) if isinstance(model_type, str) else None
    return [("", modules)] if modules else []


def is_conv1d_weight(name: str, shape: Sequence[int], modules: Sequence[tuple[str, frozenset]]) -> bool:
    """Whether tensor ``name`` of ``shape`` is the 2-D weight of one of the Conv1D modules ``modules``."""
    parts = name.split(".")
    if len(shape) != 2 or len(parts) < 3 or parts[-1] != "weight":
        return False
    return any(name.startswith(prefix) and (parts[-3], parts[-2]) in pairs for prefix, pairs in modules)


def stored_in_out(config: Mapping[str, Any] | None, infos: Mapping[str, Any]) -> frozenset[str]:
    """The names among ``infos`` (name -> object with ``.shape``) that ``config`` says are stored (in, out)."""
    modules = conv1d_modules(config)
    if not modules:
        return frozenset()
    return frozenset(name for name, info in infos.items() if is_conv1d_weight(name, tuple(info.shape), modules))


def config_file(base: str | os.PathLike) -> Path | None:
    """The config.json that describes the checkpoint at ``base``: in its folder, or next to its index file."""
    path = Path(base).expanduser()
    if path.is_dir():
        return path / CONFIG_FILE
    if path.name.endswith(".index.json"):
        return path.parent / CONFIG_FILE
    return None  # a single weights file: no config


def read_config(base: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed config.json of the checkpoint at ``base``, or None when it has none."""
    file = config_file(base)
    if file is None or not file.is_file():
        return None
    folder_file(file)  # a config.json linked from outside the model folder is refused, never read
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LayoutError(
            f"{file}: cannot read it ({type(err).__name__}: {err}); it says which weights are stored (in, out): "
            "fix or remove it"
        ) from None
    if not isinstance(config, dict):
        raise LayoutError(f"{file}: expected a JSON object, got {type(config).__name__}; fix or remove it")
    return config


def transposed_weights(
    base: str | os.PathLike, infos: Mapping[str, Any], experts: Sequence[Any] = ()
) -> frozenset[str]:
    """The tensors of the base checkpoint at ``base`` that are stored (in, out), which matrix methods merge
    transposed: the Conv1D weights that the base's config.json implies, and the weights that ``experts``
    (:class:`specmerge.io.views.experts.Expert`) say are stored so (adapters with ``fan_in_fan_out``: it covers a
    base given as a single file)."""
    return weights_stored_in_out(read_config(base), infos, experts)


def weights_stored_in_out(
    config: Mapping[str, Any] | None, infos: Mapping[str, Any], experts: Sequence[Any] = ()
) -> frozenset[str]:
    """:func:`transposed_weights` from the base's parsed config (None: none) instead of its folder."""
    names = set(stored_in_out(config, infos))
    for expert in experts:
        names.update(expert.stored_in_out_weights())
    return frozenset(names)


def transpose_result(delta: torch.Tensor | FactoredResult | None) -> torch.Tensor | FactoredResult | None:
    """The other orientation of a merged delta: (L R)^T = R^T L^T for a factored one, a view for a dense one."""
    if isinstance(delta, FactoredResult):
        return FactoredResult(delta.right.T, delta.left.T, delta.diagnostics)
    return None if delta is None else delta.T
