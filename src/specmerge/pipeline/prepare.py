"""A merge prepared: the inputs opened and checked, the plan made, nothing computed or written yet.

:func:`prepare_merge` is everything a merge decides before it reads a tensor's data: the base and experts
opened (:func:`~specmerge.pipeline.inputs.open_inputs`), the layout of 2-D weights, the plan
(:func:`~specmerge.pipeline.plan.make_plan`) and its checks. ``run_recipe`` runs a prepared merge and writes
it; a dry run (``--dry-run``) only shows it.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmerge.io.experts import Expert
from specmerge.io.layout import transposed_weights
from specmerge.io.model_files import model_files
from specmerge.io.protocol import TensorSource
from specmerge.pipeline.inputs import open_inputs
from specmerge.pipeline.plan import TensorPlan, check_lora_output, make_plan, summarize
from specmerge.pipeline.recipe import Recipe


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


def prepare_merge(stack: ExitStack, recipe: Recipe, output: str | Path | None) -> PreparedMerge:
    """Open the inputs of ``recipe`` (closed when ``stack`` closes), check them against each other and ``output``
    (None for a dry run) and make the plan; raises before any tensor data is read."""
    base_path, expert_paths = Path(recipe.base), [Path(e) for e in recipe.experts]
    base, experts = open_inputs(stack, recipe.base, recipe.experts, output)
    config_path = base_path
    if recipe.output_format == "model":
        model_files(config_path)  # the files copied at the end, checked before any work
    transposed = transposed_weights(config_path, base.infos(), experts)
    plan = make_plan(recipe, base.infos(), [e.infos() for e in experts], list(recipe.experts), transposed)
    if recipe.output_format == "lora":
        check_lora_output(recipe, plan, experts)
    return PreparedMerge(recipe, base, experts, plan, summarize(plan), base_path, expert_paths, config_path)
