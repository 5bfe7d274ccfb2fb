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
from specmerge.adapters import AdapterExpert, adapter_config, is_adapter, open_adapter, write_adapter
from specmerge.executor import resolve_device, run_adapter_plan, run_plan
from specmerge.plan import make_plan, summarize
from specmerge.recipe import DTYPES, Recipe
from specmerge.registry import get_method, methods
from specmerge.sources import TensorInfo, TensorSource, open_source
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
    fsync: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Merge ``experts`` (fine-tuned from ``base``) into a new model folder ``output``; return the report.

    ``options`` are the other recipe fields (overrides, dtype, device, shard_size, non_matrix, ...),
    see :class:`specmerge.recipe.Recipe`. Everything is validated before any tensor is read. With
    ``fsync`` (default) the shards are flushed to disk before the folder is renamed into place.
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
    return run_recipe(recipe, output, overwrite=overwrite, progress=progress, fsync=fsync)


def run_recipe(
    recipe: Recipe, output: str | os.PathLike, *, overwrite: bool = False, progress: bool = True, fsync: bool = True
) -> dict:
    """Run a validated recipe and write the merged model (or adapter) folder atomically; return the report."""
    output = Path(output)
    _refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])
    device = resolve_device(recipe.device)
    compute_dtype = getattr(torch, recipe.compute_dtype)
    started = time.perf_counter()
    method = get_method(recipe.method)
    with ExitStack() as stack:
        base = stack.enter_context(open_source(recipe.base))
        experts = [stack.enter_context(open_expert(path, base.infos())) for path in recipe.experts]
        plan = make_plan(recipe, base.infos(), [e.infos() for e in experts], list(recipe.experts))
        if recipe.output_format == "lora":
            _check_lora_output(recipe, plan, experts)
        with atomic_directory(output, overwrite=overwrite) as folder:
            if recipe.output_format == "lora":
                reports, extra = _write_adapter(recipe, plan, experts, folder, device, compute_dtype, progress)
            else:
                reports, extra = _write_model(
                    recipe, plan, base, experts, folder, device, compute_dtype, progress, fsync
                )
            report = {
                "specmerge": __version__,
                "method": recipe.method,
                "citation": method.citation,
                "params": recipe.params,
                "output_format": recipe.output_format,
                "device": str(device),
                "torch": torch.__version__,
                "host": platform.node(),
                "seconds": round(time.perf_counter() - started, 3),
                "files": sorted([p.name for p in folder.iterdir()] + ["recipe.yaml", "report.json", "README.md"]),
                "summary": summarize(plan),
                **extra,
                "tensors": [asdict(r) for r in reports],
            }
            (folder / "recipe.yaml").write_text(recipe.to_yaml())
            (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
            (folder / "README.md").write_text(model_card(recipe, method.citation))
    return report


def open_expert(path: str | os.PathLike, base_infos: dict[str, TensorInfo]) -> TensorSource | AdapterExpert:
    """An expert checkpoint (full weights) or PEFT LoRA adapter folder, checked against the base's tensors."""
    if not is_adapter(path):
        return open_source(path)
    adapter = open_adapter(path)
    try:
        return AdapterExpert(adapter, base_infos)
    except BaseException:
        adapter.close()
        raise


def _write_model(recipe, plan, base, experts, folder, device, compute_dtype, progress, fsync) -> tuple[list, dict]:
    writer = ShardWriter(
        folder,
        [TensorInfo(p.name, p.shape, p.out_dtype) for p in plan],
        max_shard_bytes=recipe.shard_bytes,
        metadata={"merged_with": f"specmerge {__version__}", "method": recipe.method},
        fsync=fsync,
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
    return reports, {}


def _check_lora_output(recipe: Recipe, plan: list, experts: list) -> None:
    """Refuse, before anything is written, what cannot become a PEFT adapter."""
    full = [str(e.path) for e in experts if not isinstance(e, AdapterExpert)]
    if full:
        raise ValueError(
            f"output_format lora needs every expert to be a LoRA adapter, but '{full[0]}' is a full checkpoint: "
            "write a merged model instead (output_format model)"
        )
    if len({bool(e.adapter.config.get("fan_in_fan_out")) for e in experts}) > 1:
        raise ValueError("the adapters disagree on fan_in_fan_out: they were not trained on the same base model")
    if recipe.max_rank is not None:
        return
    for entry in plan:
        densified = entry.action == "merge" and not get_method(entry.method).factored
        if densified and any(e.changes(entry.name) for e in experts):
            factored = ", ".join(sorted(name for name, m in methods().items() if m.factored))
            raise ValueError(
                f"method '{entry.method}' (tensor '{entry.name}') densifies LoRA experts, so its result is not "
                "low-rank: give max_rank (--max-rank K) to write its best rank-K approximation, or use a "
                f"method with an exact factored form ({factored})"
            )


def _write_adapter(recipe, plan, experts, folder, device, compute_dtype, progress) -> tuple[list, dict]:
    out_dtype = DTYPES[recipe.dtype] if recipe.dtype != "auto" else experts[0].adapter.dtype
    factors, reports = run_adapter_plan(
        plan,
        experts,
        device=device,
        compute_dtype=compute_dtype,
        max_rank=recipe.max_rank,
        out_dtype=out_dtype,
        expert_keys=recipe.expert_keys,
        progress=progress,
    )
    ranks = {name: f.rank for name, f in factors.items()}
    write_adapter(folder, factors, adapter_config(ranks, base_model=recipe.base, like=experts[0].adapter.config))
    extra = {
        "adapter": {
            "modules": len(factors),
            "max_rank": max(ranks.values(), default=0),
            "max_discarded_energy": max((f.discarded_energy for f in factors.values()), default=0.0),
        }
    }
    return reports, extra


def model_card(recipe: Recipe, citation: str) -> str:
    """A short README.md for the merged model or adapter: what was merged, how, and the recipe to redo it."""
    experts = "\n".join(f"- `{e}`" for e in recipe.experts)
    if recipe.output_format == "lora":
        title = "Merged LoRA adapter"
        usage = (
            "A PEFT LoRA adapter of the base model (exact merge"
            + (f", modules truncated to rank {recipe.max_rank}" if recipe.max_rank else "")
            + "):\n\n```python\nfrom peft import PeftModel\n"
            "model = PeftModel.from_pretrained(base_model, path_to_this_folder)\n```\n\n"
        )
    else:
        title, usage = "Merged model", ""
    return (
        "---\ntags:\n- merge\n- specmerge\n---\n\n"
        f"# {title}\n\nBase model: `{recipe.base}`\n\nExperts:\n{experts}\n\n"
        f"Merged with specmerge {__version__}, method `{recipe.method}` ({citation}).\n\n{usage}"
        "Per-tensor diagnostics (kept rank, spectrum, time) are in `report.json`.\n\n"
        f"## Recipe\n\n```yaml\n{recipe.to_yaml()}```\n"
    )


def _refuse_output_inside_inputs(output: Path, inputs: Sequence[str]) -> None:
    target = output.resolve()
    for path in inputs:
        source = Path(path).resolve()
        if target == source or source in target.parents or target in source.parents:
            raise ValueError(f"output '{output}' overlaps the input '{path}': choose a separate output folder")
