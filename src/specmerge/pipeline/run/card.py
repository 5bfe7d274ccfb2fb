"""The model card (README.md) written into a merged model or adapter folder, with the hub's YAML front matter.

The front matter follows the Hugging Face hub's model-card conventions (what ``huggingface_hub.ModelCard``
parses): ``base_model`` (a merged model: the base and every expert found on the Hugging Face hub, by repository id;
an adapter: its base, when a hub id) and ``base_model_relation`` (merge / adapter), both left out when no such
input is a hub id: local inputs are not repositories, so the text names them instead, by their path relative to
the output folder; ``library_name`` (transformers for a model folder with a config, peft for an adapter),
``tags: [merge, specmerge, <method>]`` and, when the base states one, its ``license`` (from the front matter of
the base's README.md, else its config.json). The text says what was merged and how, and holds the recipe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from specmerge.io.formats.names import CONFIG_FILE
from specmerge.io.hub.ids import parse_hub_id
from specmerge.pipeline.plan.prepare import PreparedMerge
from specmerge.pipeline.recipe.model import Recipe
from specmerge.version import __version__


def model_card(
    recipe: Recipe,
    citation: str,
    *,
    hub: Sequence[bool],
    license: Mapping[str, str] | None = None,
    library_name: str | None = None,
) -> str:
    """README.md for the merged model or adapter: the front matter, what was merged and how, and the recipe.

    ``recipe`` is the recipe as written beside the output (inputs named portably, see
    :func:`specmerge.pipeline.inputs.open.portable_spec`); ``hub`` says of its base, each expert and the model of
    each of its ``layers``, in order, whether it was found on the hub (its name is then a hub id); ``license`` the
    base's license keys (:func:`specmerge.io.output.readme.read_license`).
    """
    lora = recipe.output_format == "lora"
    layers = recipe.layers or []
    specs = (recipe.base, *recipe.experts, *(r.model for r in layers))
    inputs = list(zip(specs, hub, strict=True))[: 1 if lora else None]
    ids = list(dict.fromkeys(_bare_id(spec) for spec, from_hub in inputs if from_hub))
    local = list(dict.fromkeys(f"`{spec}`" for spec, from_hub in inputs if not from_hub))
    meta: dict[str, Any] = {"base_model": ids, "base_model_relation": "adapter" if lora else "merge"} if ids else {}
    if library_name or lora:
        meta["library_name"] = "peft" if lora else library_name
    meta["tags"] = ["merge", "specmerge", recipe.method]
    meta.update(license or {})
    experts = "Experts:\n" + "".join(f"- `{e}`\n" for e in recipe.experts)
    if layers:  # a frankenmerge: the layers' models instead of experts
        experts = "Layers, in order:\n" + "".join(
            f"- layers {r.range[0]} to {r.range[1] - 1} of `{r.model}`\n" for r in layers
        )
    if lora:
        title = "Merged LoRA adapter"
        usage = (
            "A PEFT LoRA adapter of the base model (exact merge"
            + (f", modules truncated to rank {recipe.max_rank}" if recipe.max_rank else "")
            + "):\n\n```python\nfrom peft import PeftModel\n"
            "model = PeftModel.from_pretrained(base_model, path_to_this_folder)\n```\n\n"
        )
    else:
        title, usage = "Merged model", ""
    unlisted = f" and left out of `base_model`, which names hub repositories: {', '.join(local)}" if local else ""
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return (
        f"---\n{front}---\n\n"
        f"# {title}\n\nBase model: `{recipe.base}`\n\n{experts}\n"
        f"Merged with specmerge {__version__}, method `{recipe.method}` ({citation}).\n\n{usage}"
        "Hub ids are pinned to the commit merged (`org/name@<commit>`); local inputs are named by their path "
        f"relative to this folder{unlisted}.\n\n"
        "Per-tensor diagnostics (kept rank, spectrum, time) are in `report.json`.\n\n"
        f"## Recipe\n\n```yaml\n{recipe.to_yaml()}```\n"
    )


def _bare_id(spec: str) -> str:
    """A hub id without its ``@revision`` (the hub's base_model names a repository)."""
    hub = parse_hub_id(spec)
    return hub[0] if hub else spec


def card_for(prepared: PreparedMerge, written: Recipe, citation: str) -> str:
    """The model card of a prepared merge whose output recipe is ``written`` (inputs named portably): the base's
    license (read by ``prepare_merge``, :func:`specmerge.io.output.readme.read_license`), and ``library_name:
    transformers`` when the output gets a config.json."""
    has_config = prepared.config_path.is_dir() and os.path.lexists(prepared.config_path / CONFIG_FILE)
    return model_card(
        written,
        citation,
        hub=[r.origin == "hub" for r in prepared.inputs]
        + [prepared.layer_inputs[r.model].origin == "hub" for r in prepared.recipe.layers or ()],
        license=prepared.notes.get("license"),
        library_name="transformers" if has_config else None,
    )
