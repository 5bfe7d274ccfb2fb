"""Whole-model merges: recipe -> sources -> plan -> executor -> writer -> report.

``merge(base, experts, output, method=..., params=...)`` is the Python entry point;
``run_recipe(recipe, output)`` does the work for both it and the command line.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specmerge import __version__
from specmerge.executor import resolve_device, run_plan
from specmerge.plan import make_plan, summarize
from specmerge.recipe import Recipe
from specmerge.registry import get_method
from specmerge.sources import TensorInfo, open_source
from specmerge.writer import ShardWriter, atomic_directory, copy_model_files


def merge(
    base: str | os.PathLike,
    experts: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    method: str = "swudi_a",
    params: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Merge ``experts`` (fine-tuned from ``base``) into a new model folder ``output``; return the report.

    ``options`` are the other recipe fields (overrides, dtype, device, shard_size, non_matrix, ...),
    see :class:`specmerge.recipe.Recipe`. Everything is validated before any tensor is read.
    """
    recipe = Recipe.from_dict(
        {  # absolute paths: the recipe written next to the output must work from anywhere
            "base": os.path.abspath(base),
            "experts": [os.path.abspath(e) for e in experts],
            "method": method,
            "params": dict(params or {}),
            **options,
        }
    )
    return run_recipe(recipe, output, overwrite=overwrite, progress=progress)


def run_recipe(recipe: Recipe, output: str | os.PathLike, *, overwrite: bool = False, progress: bool = True) -> dict:
    """Run a validated recipe and write the merged model folder atomically; return the report."""
    output = Path(output)
    _refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])
    device = resolve_device(recipe.device)
    compute_dtype = getattr(torch, recipe.compute_dtype)
    started = time.perf_counter()
    with ExitStack() as stack:
        base = stack.enter_context(open_source(recipe.base))
        experts = [stack.enter_context(open_source(path)) for path in recipe.experts]
        plan = make_plan(recipe, base.infos(), [e.infos() for e in experts], list(recipe.experts))
        method = get_method(recipe.method)
        with atomic_directory(output, overwrite=overwrite) as folder:
            writer = ShardWriter(
                folder,
                [TensorInfo(p.name, p.shape, p.out_dtype) for p in plan],
                max_shard_bytes=recipe.shard_bytes,
                metadata={"merged_with": f"specmerge {__version__}", "method": recipe.method},
            )
            with writer:  # closes (index, completeness check) on success, aborts on error
                reports = run_plan(
                    plan,
                    base,
                    experts,
                    writer.write,
                    device=device,
                    compute_dtype=compute_dtype,
                    expert_keys=recipe.expert_keys,
                    progress=progress,
                )
            copy_model_files(Path(recipe.base), folder)
            report = {
                "specmerge": __version__,
                "method": recipe.method,
                "citation": method.citation,
                "params": recipe.params,
                "device": str(device),
                "torch": torch.__version__,
                "host": platform.node(),
                "seconds": round(time.perf_counter() - started, 3),
                "files": sorted([p.name for p in folder.iterdir()] + ["recipe.yaml", "report.json", "README.md"]),
                "summary": summarize(plan),
                "tensors": [asdict(r) for r in reports],
            }
            (folder / "recipe.yaml").write_text(recipe.to_yaml())
            (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
            (folder / "README.md").write_text(model_card(recipe, method.citation))
    return report


def model_card(recipe: Recipe, citation: str) -> str:
    """A short README.md for the merged model: what was merged, how, and the recipe to redo it."""
    experts = "\n".join(f"- `{e}`" for e in recipe.experts)
    return (
        "---\ntags:\n- merge\n- specmerge\n---\n\n"
        f"# Merged model\n\nBase model: `{recipe.base}`\n\nExperts:\n{experts}\n\n"
        f"Merged with specmerge {__version__}, method `{recipe.method}` ({citation}).\n\n"
        "Per-tensor diagnostics (kept rank, spectrum, time) are in `report.json`.\n\n"
        f"## Recipe\n\n```yaml\n{recipe.to_yaml()}```\n"
    )


def _refuse_output_inside_inputs(output: Path, inputs: Sequence[str]) -> None:
    target = output.resolve()
    for path in inputs:
        source = Path(path).resolve()
        if target == source or source in target.parents or target in source.parents:
            raise ValueError(f"output '{output}' overlaps the input '{path}': choose a separate output folder")
