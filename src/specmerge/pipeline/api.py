"""Whole-model merges: recipe -> sources -> plan -> executor -> writer -> report.

``merge(base, experts, output, method=..., params=...)`` is the Python entry point;
``run_recipe(recipe, output)`` does the work for both it and the command line.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specmerge.io.adapters import AdapterExpert, adapter_config, is_adapter, open_adapter, write_adapter
from specmerge.io.layout import transposed_weights
from specmerge.io.sources import TensorInfo, TensorSource, open_source
from specmerge.io.writer import (
    OutputError,
    ShardWriter,
    atomic_directory,
    check_output,
    copy_model_files,
    model_files,
    write_output_config,
)
from specmerge.methods.registry import all_methods, get_method
from specmerge.pipeline.executor import resolve_device, run_adapter_plan, run_plan
from specmerge.pipeline.plan import make_plan, summarize
from specmerge.pipeline.recipe import DTYPES, Recipe, RecipeError
from specmerge.pipeline.threads import check_threads, merge_threads
from specmerge.version import __version__


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
    threads: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Merge ``experts`` (fine-tuned from ``base``) into a new model folder ``output``; return the report.

    ``options`` are the other recipe fields (overrides, dtype, device, shard_size, non_matrix, ...),
    see :class:`specmerge.pipeline.recipe.Recipe`. Everything is validated before any tensor is read. With
    ``fsync`` (default) the shards are flushed to disk before the folder is renamed into place. ``threads``
    is torch's thread count during the merge (default: chosen from the CPUs free,
    see :mod:`specmerge.pipeline.threads`).
    """
    recipe = Recipe.from_dict(
        {  # absolute paths: the recipe written next to the output must work from anywhere
            "base": _absolute_path(base, "base"),
            "experts": [_absolute_path(e, f"experts[{i}]") for i, e in enumerate(_path_list(experts))],
            "method": method,
            "params": _params_mapping(params),
            **options,
        }
    )
    return run_recipe(recipe, output, overwrite=overwrite, progress=progress, fsync=fsync, threads=threads)


def _path_list(experts: Any) -> list[Any]:
    """``experts`` as a list, refusing a single path (a string would be taken as a list of characters)."""
    if isinstance(experts, str | bytes | os.PathLike):
        raise RecipeError(
            f"experts must be a list of paths, got the single path {os.fspath(experts)!r}: pass "
            f"[{os.fspath(experts)!r}] for one expert",
            ("experts",),
        )
    if not isinstance(experts, Iterable) or isinstance(experts, Mapping):
        raise RecipeError(f"experts must be a list of paths, got {type(experts).__name__}", ("experts",))
    return list(experts)


def _absolute_path(path: Any, what: str) -> str:
    if not isinstance(path, str | os.PathLike) or not isinstance(os.fspath(path), str):
        raise RecipeError(f"{what} must be a path (str or os.PathLike), got {type(path).__name__} {path!r}", (what,))
    if not os.fspath(path) or "\0" in os.fspath(path):
        raise RecipeError(f"{what} is not a valid path: {os.fspath(path)!r}", (what,))
    return os.path.abspath(path)


def _params_mapping(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise RecipeError(
            f"params must be a mapping of parameter names to values, such as {{'scale': 0.5}}; "
            f"got {type(params).__name__} {params!r}",
            ("params",),
        )
    return dict(params)


def run_recipe(
    recipe: Recipe,
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = True,
    fsync: bool = True,
    threads: int | None = None,
) -> dict:
    """Run a validated recipe and write the merged model (or adapter) folder atomically; return the report."""
    check_threads(threads)
    output = Path(output)
    _refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])
    check_output(output, overwrite)  # before any work: parent exists, an existing folder may be replaced
    device = resolve_device(recipe.device)
    compute_dtype = getattr(torch, recipe.compute_dtype)
    started = time.perf_counter()
    method = get_method(recipe.method)
    with ExitStack() as stack:
        threads_used = stack.enter_context(merge_threads(threads))  # torch's count restored on leaving
        base = stack.enter_context(open_source(recipe.base))
        experts = [stack.enter_context(open_expert(path, base.infos())) for path in recipe.experts]
        _refuse_duplicate_inputs([recipe.base, *recipe.experts], [base, *experts])
        _refuse_output_inside_inputs(output, [recipe.base, *recipe.experts], [base, *experts])
        if recipe.output_format == "model":
            model_files(recipe.base)  # the files copied at the end, checked before any work
        transposed = stored_in_out(recipe.base, base.infos(), experts)
        plan = make_plan(recipe, base.infos(), [e.infos() for e in experts], list(recipe.experts), transposed)
        if recipe.output_format == "lora":
            _check_lora_output(recipe, plan, experts)
        summary = summarize(plan)  # its output bytes go into a full disk's message
        size = summary["bytes"] if recipe.output_format == "model" else None
        with atomic_directory(output, overwrite=overwrite, expected_bytes=size) as folder:
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
                "threads": threads_used.threads,
                "threads_from": threads_used.source,
                "torch": torch.__version__,
                "host": platform.node(),
                "seconds": round(time.perf_counter() - started, 3),
                "files": sorted([p.name for p in folder.iterdir()] + ["recipe.yaml", "report.json", "README.md"]),
                "summary": summary,
                **extra,
                "tensors": [asdict(r) for r in reports],
            }
            (folder / "recipe.yaml").write_text(recipe.to_yaml())
            (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
            (folder / "README.md").write_text(model_card(recipe, method.citation))
    return report


def stored_in_out(base: str | os.PathLike, base_infos: dict[str, TensorInfo], experts: Sequence[Any]) -> frozenset[str]:
    """The base weights stored (in, out), which matrix methods merge transposed: the Conv1D weights that the
    base's config.json implies (:mod:`specmerge.io.layout`), and the weights that adapters with ``fan_in_fan_out``
    change (PEFT sets it exactly for Conv1D modules; it covers a base given as a single file)."""
    names = set(transposed_weights(base, base_infos))
    for expert in experts:
        if isinstance(expert, AdapterExpert) and expert.adapter.config.get("fan_in_fan_out"):
            names.update(expert.adapter.modules())
    return frozenset(names)


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
    write_output_config(folder, [TensorInfo(p.name, p.shape, p.out_dtype) for p in plan])
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
            factored = ", ".join(sorted(name for name, m in all_methods().items() if m.factored))
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


def _refuse_output_inside_inputs(output: Path, inputs: Sequence[str], sources: Sequence[Any] = ()) -> None:
    """Refuse an output that is, holds or lies inside an input, so that replacing it can never delete an input.

    Compares the real paths (links resolved) of the output and of the typed ``inputs`` and, given the opened
    ``sources`` (one per input, in order), of every file they read: a file reached through a link counts
    where it really lies.
    """
    target = Path(os.path.realpath(output))  # never raises, even for a symbolic link loop
    for path in inputs:
        source = Path(os.path.realpath(path))
        if target == source or source in target.parents or target in source.parents:
            raise OutputError(f"output '{output}' overlaps the input '{path}': choose a separate output folder")
    for path, source in zip(inputs, sources, strict=False):
        for file in source.files():
            if file == target or target in file.parents:
                raise OutputError(
                    f"output '{output}' holds {file}, which the input '{path}' reads (through a link): "
                    "choose a separate output folder"
                )


def _refuse_duplicate_inputs(inputs: Sequence[str], sources: Sequence[Any]) -> None:
    """Refuse an expert that reads the same files as the base or as another expert.

    ``inputs`` are the base and then the experts, ``sources`` the opened ones in the same order. Files are
    compared as the files really read (device and inode), so a link, a hard link, or a folder given once as
    a folder and once as its own weights file are all found.
    """
    seen: dict[frozenset, int] = {}
    for i, source in enumerate(sources):
        files = source.files()
        key = frozenset(_file_identity(f) for f in files)
        first = seen.setdefault(key, i)
        if first == i:
            continue
        shown = f"{files[-1]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "")
        if first == 0:
            raise RecipeError(
                f"expert '{inputs[i]}' is the base model '{inputs[0]}' (both read {shown}): an expert is a "
                "fine-tuned copy of the base; remove it from the experts",
                ("experts", i - 1),
            )
        raise RecipeError(
            f"experts '{inputs[first]}' and '{inputs[i]}' are the same checkpoint (both read {shown}): "
            "list each expert once",
            ("experts", i - 1),
        )


def _file_identity(path: Path) -> tuple[int, int] | str:
    try:
        info = os.stat(path)
    except OSError:
        return str(path)
    return info.st_dev, info.st_ino
