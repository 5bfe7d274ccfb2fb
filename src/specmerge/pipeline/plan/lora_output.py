"""What cannot become a PEFT adapter (``output_format: lora``), refused before anything is written."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specmerge.methods import all_methods, get_method
from specmerge.pipeline.plan.rules import PlanError, TensorPlan
from specmerge.pipeline.recipe.model import Recipe


def check_lora_output(recipe: Recipe, plan: Sequence[TensorPlan], experts: Sequence[Any]) -> None:
    """Refuse, before anything is written, what cannot become a PEFT adapter (``output_format: lora``).

    Every expert must be a LoRA adapter (:class:`specmerge.io.views.experts.AdapterExpert`), all agreeing on
    ``fan_in_fan_out``; without ``max_rank`` every merged tensor that an adapter changes needs a method with an
    exact factored form (``Method.factored``), since a densifying method's result is not low-rank.
    """
    for expert in experts:
        if getattr(expert, "variant_kinds", None):
            raise PlanError(
                f"output_format lora: adapter '{expert.path}' carries {', '.join(expert.variant_kinds)}, which are "
                "not LoRA deltas and cannot be written as a LoRA adapter: write a merged model (output_format model)"
            )
    stacked = next((e.name for e in plan if e.stacked and any(x.changes(e.name) for x in experts)), None)
    if stacked is not None:
        raise PlanError(
            f"output_format lora: the adapters change the MoE expert stack '{stacked}', which specmerge does not "
            "write back as LoRA on parameters yet: write a merged model (output_format model)"
        )
    full = [str(e.path) for e in experts if not e.low_rank]
    if full:
        raise PlanError(
            f"output_format lora needs every expert to be a LoRA adapter, but '{full[0]}' is a full checkpoint: "
            "write a merged model instead (output_format model)"
        )
    if len({e.fan_in_fan_out for e in experts}) > 1:
        raise PlanError("the adapters disagree on fan_in_fan_out: they were not trained on the same base model")
    for entry in plan:
        if entry.action == "merge" and get_method(entry.method).needs_base:
            raise PlanError(
                f"method '{entry.method}' (tensor '{entry.name}') merges whole weights and needs the base's; "
                "an adapter holds only deltas: write a merged model instead (output_format model)"
            )
    if recipe.max_rank is not None:
        return
    for entry in plan:
        densified = entry.action == "merge" and not get_method(entry.method).factored
        if densified and any(e.changes(entry.name) for e in experts):
            factored = ", ".join(sorted(name for name, m in all_methods().items() if m.factored))
            raise PlanError(
                f"method '{entry.method}' (tensor '{entry.name}') densifies LoRA experts, so its result is not "
                "low-rank: give max_rank (--max-rank K) to write its best rank-K approximation, or use a "
                f"method with an exact factored form ({factored})"
            )
