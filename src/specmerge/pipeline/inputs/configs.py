"""Experts that are not what the base is: each expert's config.json compared with the base's before any work.

An expert fine-tuned from the base has the base's architecture: same layer count, widths, head layout and
tying of embeddings. :func:`compare_configs` refuses an expert of the base's ``model_type`` whose config differs
in one of those :data:`STRUCTURAL` fields (its extra layers would be kept as modules the written config never
loads, its own ``lm_head`` averaged into a tensor a tied config ignores), unless the recipe names that expert as
``config_source`` (the output is then built on its architecture, as asked). Fields that change what the same
weights compute (:data:`SEMANTIC`: rope, activation, positions, norms' eps, routing) may differ: the console
says which input's value the output's config carries. Experts of another ``model_type`` (a vision-language
expert of a language base: modality merging) and adapters (whose config is the base's) are not compared.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge.errors import SpecmergeError
from specmerge.io.formats.layout import read_config
from specmerge.io.hub.ids import InputResolution
from specmerge.pipeline.recipe.input_choice import input_index
from specmerge.pipeline.recipe.model import Recipe

LOG = logging.getLogger("specmerge.inputs")
STRUCTURAL = (
    "num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model", "num_attention_heads",
    "n_head", "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "ffn_dim", "tie_word_embeddings",
    "num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
)  # fmt: skip
SEMANTIC = (
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "hidden_act", "hidden_activation",
    "activation_function", "max_position_embeddings", "n_positions", "sliding_window", "rms_norm_eps",
    "layer_norm_eps", "layer_norm_epsilon", "num_experts_per_tok", "attn_logit_softcapping",
    "final_logit_softcapping",
)  # fmt: skip


class ConfigMismatch(SpecmergeError):
    """An expert's architecture is not the base's."""


def differences(a: Mapping[str, Any], b: Mapping[str, Any], keys: Sequence[str]) -> list[tuple[str, Any, Any]]:
    """(key, a's value, b's value) for each of ``keys`` that both configs (and their ``text_config``) state
    differently."""
    found = [(k, a[k], b[k]) for k in keys if k in a and k in b and a[k] != b[k]]
    text_a, text_b = a.get("text_config"), b.get("text_config")
    if isinstance(text_a, Mapping) and isinstance(text_b, Mapping):
        found += [(f"text_config.{k}", x, y) for k, x, y in differences(text_a, text_b, keys)]
    return found


def stated(config: Mapping[str, Any], key: str) -> Any:
    """The value of ``key`` (``text_config.<k>`` for a nested one) in ``config``; None when absent."""
    for part in key.split(".")[:-1]:
        config = config.get(part) or {}
    return config.get(key.rsplit(".", 1)[-1])


def compare_configs(recipe: Recipe, base_path: Path, expert_paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Refuse an expert whose architecture is not the base's (see the module docstring); return report.json's
    account of the semantic differences (one entry per expert and field), said on the console too."""
    base = read_config(base_path)
    if not isinstance(base, Mapping):
        return []
    keys = list(recipe.expert_keys or [])
    names = keys or list(recipe.experts)  # report.json names experts by key, never by local path
    chosen = input_index(recipe.config_source, recipe.experts, keys)
    chosen = -1 if chosen is None else chosen
    source_name = "the base" if chosen == -1 else f"expert '{recipe.experts[chosen]}'"
    output_config = base if chosen == -1 else (read_config(expert_paths[chosen]) or {})
    notes = []
    for i, path in enumerate(expert_paths):
        expert = read_config(path)
        if not isinstance(expert, Mapping) or expert.get("model_type") != base.get("model_type"):
            continue
        spec = recipe.experts[i]
        structural = differences(expert, base, STRUCTURAL)
        if structural and chosen != i:
            key, theirs, ours = structural[0]
            more = f" (and {len(structural) - 1} more such fields)" if len(structural) > 1 else ""
            raise ConfigMismatch(
                f"expert '{spec}' is not the base's architecture: its config.json has {key} = {theirs!r} where the "
                f"base's has {ours!r}{more}, so it was not fine-tuned from this base and its tensors would be merged "
                "or kept where the written config does not load them: merge experts of this base only, or, to build "
                f"the output on its architecture, name it as config_source"
            )
        for key, theirs, ours in differences(expert, base, SEMANTIC):
            output = stated(output_config, key)
            LOG.info(
                f"expert '{spec}' has {key} = {theirs!r} where the base has {ours!r}: the output's config.json "
                f"takes {source_name}'s ({output!r})"
            )
            notes.append(
                {"expert": names[i], "field": key, "expert_value": theirs, "base_value": ours, "output": output}
            )
    return notes


def adapter_bases(
    specs: Sequence[str], keys: Sequence[str], experts: Sequence[Any], base: InputResolution
) -> list[dict[str, str]]:
    """Warn for each adapter whose ``base_model_name_or_path`` names another model than the base given (a hub id
    other than the base's, or a local folder other than the base's); report.json's account of them, by expert
    key and without local paths."""
    notes = []
    for spec, key, expert in zip(specs, keys, experts, strict=True):
        config = getattr(getattr(expert, "adapter", None), "config", None) or {}
        named = config.get("base_model_name_or_path")
        if not isinstance(named, str) or not named or names_base(named, base):
            continue
        given = base.repo_id if base.origin == "hub" else str(base.path)
        LOG.warning(
            f"adapter '{spec}' was trained on '{named}' (its base_model_name_or_path), but the base given is "
            f"'{given}': an adapter merged onto another model of the same shapes gives neither; check the base"
        )
        local = os.path.isabs(named) or named.startswith(".")
        notes.append(
            {
                "adapter": key,
                "trained_on": "a local folder" if local else named,
                "base": given if base.origin == "hub" else "a local folder",
            }
        )
    return notes


def names_base(named: str, base: InputResolution) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` may be the base given: the same hub id, the same local
    folder, or a hub id and a local folder (what it holds cannot be told from its name)."""
    local = os.path.isdir(named) or os.path.isabs(named) or named.startswith(".")
    if base.origin == "hub":
        return not local and named.split("@")[0].lower() == str(base.repo_id).lower()
    if local:
        return os.path.realpath(named) == os.path.realpath(base.path)
    return True
