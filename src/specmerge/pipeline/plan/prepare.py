"""A merge prepared: the inputs opened and checked, the plan made, nothing computed or written yet.

:func:`prepare_merge` is everything a merge decides before it reads a tensor's data: the base and experts
opened (:func:`~specmerge.pipeline.inputs.open.open_inputs`), the layout of 2-D weights, the plan
(:func:`~specmerge.pipeline.plan.rules.make_plan`) and its checks. ``run_recipe`` runs a prepared merge and writes
it; a dry run (``--dry-run``) only shows it.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmerge.io.formats.layout import read_config, weights_stored_in_out
from specmerge.io.formats.protocol import TensorSource
from specmerge.io.formats.stacks import expert_stacks
from specmerge.io.hub.ids import InputResolution
from specmerge.io.output.chat_template import ChosenTemplate, choose_template
from specmerge.io.output.model_files import check_layer_count, config_files, tokenizer_files
from specmerge.io.output.readme import read_license
from specmerge.io.quant.source import quantization_note
from specmerge.io.views.experts import Expert
from specmerge.io.views.vocab import VocabularyPlan
from specmerge.pipeline.inputs.align import align_inputs
from specmerge.pipeline.inputs.configs import adapter_bases, compare_configs
from specmerge.pipeline.inputs.open import input_notes, open_inputs, resolve_inputs
from specmerge.pipeline.inputs.stack import stacked_inputs
from specmerge.pipeline.plan.lora_output import check_lora_output
from specmerge.pipeline.plan.rules import TensorPlan, make_plan
from specmerge.pipeline.plan.summary import summarize
from specmerge.pipeline.recipe.model import Recipe


@dataclass
class PreparedMerge:
    """A merge ready to run: its recipe, opened inputs, plan and plan summary (counts and output bytes per action,
    method and reason), and ``notes``: what the report should say about how the inputs were found and matched."""

    recipe: Recipe
    base: TensorSource
    experts: list[Expert]
    plan: list[TensorPlan]
    summary: dict[str, Any]
    base_path: Path  # the local base folder or file (a hub id resolved to its cache snapshot)
    expert_paths: list[Path]  # the local expert folders or files, in recipe order
    config_path: Path  # the folder whose config (and processor files) the merged model gets
    notes: dict[str, Any] = field(default_factory=dict)
    inputs: list[InputResolution] = field(default_factory=list)  # where the base and experts were found, in order
    vocabulary: VocabularyPlan | None = None  # the output's vocabulary and tokenizer (None: the base's files)
    base_quantized: Any = None  # the base's QuantizedSource when it is a quantized checkpoint (quantize: same)
    chat_template: ChosenTemplate | None = None  # the output's chat template (None: the tokenizer files' own)
    layer_count: int | None = None  # a frankenmerge's layers (the output config's num_hidden_layers); None: as is
    layer_inputs: dict[str, InputResolution] = field(default_factory=dict)  # where each model of its layers was found


def prepare_merge(stack: ExitStack, recipe: Recipe, output: str | Path | None) -> PreparedMerge:
    """Open the inputs of ``recipe`` (closed when ``stack`` closes), check them against each other and ``output``
    (None for a dry run) and make the plan; raises before any tensor data is read."""
    resolved = resolve_inputs(recipe.base, recipe.experts)  # hub ids -> their cache snapshots
    base_path, expert_paths = resolved[0].path, [r.path for r in resolved[1:]]
    base, experts = open_inputs(stack, recipe.base, recipe.experts, output, resolved)
    layer_count, layer_inputs = None, {}
    if recipe.layers is not None:  # a frankenmerge: the output's tensors read from the stacked layers
        base, layer_count, layer_inputs = stacked_inputs(stack, recipe, base, base_path, output)
    quantization = [quantization_note(item) for item in (base, *experts)]  # before the views wrap them
    experts_opened, base_opened = list(experts), base
    config_notes = compare_configs(recipe, base_path, expert_paths)  # experts not of the base's architecture
    aligned = align_inputs(recipe, base, experts, base_path, expert_paths)  # one set of names, own modules
    base, experts, config_path = aligned.base, aligned.experts, aligned.config_path
    if recipe.output_format == "model":  # the files copied at the end, checked before any work
        config_files(config_path)
        if aligned.vocabulary is not None and aligned.vocabulary.tokenizer_from is not None:
            tokenizer_files(aligned.vocabulary.tokenizer_from)
    config = read_config(config_path)  # read once: which weights are stored (in, out), which are expert stacks
    if layer_count is not None:
        check_layer_count(config)  # the output config can state the frankenmerge's layer count
    transposed = weights_stored_in_out(config, base.infos(), experts)
    stacks = expert_stacks(config, base.infos())
    plan = make_plan(
        recipe, base.infos(), [e.infos() for e in experts], list(recipe.experts), transposed, aligned.own, stacks
    )
    if recipe.output_format == "lora":
        check_lora_output(recipe, plan, experts)
    license = read_license(base_path)  # for the model card (a README.md linked out of the folder is refused here)
    inputs = [
        {**note, "quantization": quant} if quant else note
        for note, quant in zip(input_notes(recipe, resolved, output), quantization, strict=True)
    ]
    notes = {"inputs": inputs, **aligned.notes, **({"config_differences": config_notes} if config_notes else {})}
    keys = list(recipe.expert_keys or recipe.experts)
    other_bases = adapter_bases(recipe.experts, keys, experts_opened, resolved[0])
    if other_bases:
        notes["adapters_of_other_bases"] = other_bases
    if license:
        notes["license"] = license
    summary = summarize(plan)
    template = None  # an adapter carries no tokenizer files: no template to choose
    if recipe.output_format == "model":
        keys = list(recipe.expert_keys or recipe.experts)
        template = choose_template(recipe.chat_template, base_path, expert_paths, keys)  # experts that differ: refused
        if template.source != "none":
            notes["chat_template"] = template.source
    return PreparedMerge(
        recipe, base, experts, plan, summary, base_path, expert_paths, config_path, notes, resolved, aligned.vocabulary,
        base_opened if quantization[0] else None, template, layer_count, layer_inputs,
    )  # fmt: skip
