"""Whole-model merges: recipe -> inputs -> plan -> job -> executor -> writer -> report.

``merge(base, experts, output, method=..., params=...)`` is the Python entry point;
``run_recipe(recipe, output)`` does the work for both it and the command line. Both take an ``executor``
(:class:`specmerge.pipeline.run.work.Executor`; default the in-process
:class:`~specmerge.pipeline.run.executor.StreamingExecutor`) that runs the job's work items.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import RecipeError
from specmerge.io.formats.peft_write import adapter_config, write_adapter
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.hub.ids import absolute_spec
from specmerge.io.output.chat_template import apply_template
from specmerge.io.output.folder import OUTPUT_LOG, atomic_directory, check_output
from specmerge.io.output.model_files import copy_config_files, copy_tokenizer_files, write_output_config
from specmerge.io.output.writer import ShardWriter
from specmerge.io.quant.output import OutputQuantizer
from specmerge.linalg.solve import LayerProjections
from specmerge.methods import get_method
from specmerge.pipeline.inputs.open import portable_recipe, portable_spec, refuse_output_inside_inputs
from specmerge.pipeline.inputs.related import check_related
from specmerge.pipeline.plan.prepare import PreparedMerge, prepare_merge
from specmerge.pipeline.plan.summary import say_not_merged
from specmerge.pipeline.recipe.mergekit import convert as convert_mergekit
from specmerge.pipeline.recipe.mergekit import load_mergekit, say_conversion
from specmerge.pipeline.recipe.model import DTYPES, Recipe
from specmerge.pipeline.run.card import card_for
from specmerge.pipeline.run.executor import StreamingExecutor
from specmerge.pipeline.run.jobs import AdapterJob, ComputeOptions, ModelJob
from specmerge.pipeline.run.quantized_output import output_quantizer
from specmerge.pipeline.run.threads import check_threads, merge_threads
from specmerge.pipeline.run.work import Executor, TensorReport
from specmerge.version import __version__


def merge(
    base: str | os.PathLike | None = None,
    experts: Sequence[str | os.PathLike] | None = None,
    output: str | os.PathLike | None = None,
    *,
    method: str = "swudi_a",
    params: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    fsync: bool = True,
    threads: int | None = None,
    executor: Executor | str | None = None,
    mergekit_config: str | os.PathLike | Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Merge ``experts`` (fine-tuned from ``base``) into a new model folder ``output``; return the report.

    ``mergekit_config`` (a mergekit YAML file, or its parsed mapping) stands for ``base``, ``experts``, ``method``
    and ``params``: the config is run with mergekit's meaning (:mod:`specmerge.pipeline.recipe.mergekit`); the
    ``options`` it does not set (device, shard_size, ...) may still be given.

    ``options`` are the other recipe fields (overrides, dtype, device, shard_size, non_matrix, ...),
    see :class:`specmerge.pipeline.recipe.model.Recipe`. Everything is validated before any tensor is read. With
    ``fsync`` (default) the shards are flushed to disk before the folder is renamed into place. ``threads``
    is torch's thread count during the merge (default: chosen from the CPUs free,
    see :mod:`specmerge.pipeline.run.threads`). ``executor`` runs the work items: an
    :class:`~specmerge.pipeline.run.work.Executor`, or the recipe's name for one, ``"local"`` (the default,
    :class:`~specmerge.pipeline.run.executor.StreamingExecutor`) or ``"ray"`` (with ``address=``).
    """
    if isinstance(executor, str):
        options, executor = {**options, "executor": executor}, None
    if output is None:
        raise RecipeError("merge: give the output folder (output=...)")
    if mergekit_config is not None:
        if base is not None or experts is not None or method != "swudi_a" or params is not None:
            raise RecipeError("a mergekit config names the models, the method and its parameters: give it alone")
        recipe = mergekit_recipe(mergekit_config, **options)
    elif experts is None:
        raise RecipeError("merge: give the base and the experts (or mergekit_config=...)")
    else:
        recipe = merge_recipe(base, experts, method=method, params=params, **options)
    return run_recipe(
        recipe, output, overwrite=overwrite, progress=progress, fsync=fsync, threads=threads, executor=executor
    )


def merge_recipe(
    base: str | os.PathLike,
    experts: Sequence[str | os.PathLike],
    *,
    method: str = "swudi_a",
    params: dict[str, Any] | None = None,
    **options: Any,
) -> Recipe:
    """The validated recipe :func:`merge` runs for these arguments (what ``merge --dry-run`` estimates)."""
    return Recipe.from_dict(
        {  # paths made absolute from the current folder; hub ids (org/name@rev, nothing local of that name) kept
            "base": _absolute_path(base, "base"),
            "experts": [_absolute_path(e, f"experts[{i}]") for i, e in enumerate(_path_list(experts))],
            "method": method,
            "params": _params_mapping(params),
            **options,
        }
    )


def mergekit_recipe(config: str | os.PathLike | Mapping[str, Any], **options: Any) -> Recipe:
    """The recipe of a mergekit config (a YAML file or its mapping) with mergekit's meaning, its differences from
    mergekit said on the console, and the ``options`` it does not set (device, shard_size, ...) added."""
    if isinstance(config, Mapping):
        conversion = convert_mergekit(config)
    else:
        conversion = load_mergekit(config)
        if conversion is None:
            raise RecipeError(f"{config} is not a mergekit config (merge_method and models): run it as a recipe")
    taken = [key for key in options if key in conversion.data]
    if taken:
        raise RecipeError(f"'{taken[0]}' is set by the mergekit config: change it there")
    say_conversion(conversion)
    if not options:
        return conversion.recipe
    return Recipe.from_dict({**conversion.data, **options})


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
    return absolute_spec(os.fspath(path))


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
    executor: Executor | None = None,
    layers: Mapping[str, LayerProjections] | None = None,
    home: str | os.PathLike | None = None,
) -> dict:
    """Run a validated recipe and write the merged model (or adapter) folder atomically; return the report.

    ``executor`` runs the work items (:class:`~specmerge.pipeline.run.work.Executor`; default
    :class:`~specmerge.pipeline.run.executor.StreamingExecutor`); the output files do not depend on it. ``layers``:
    stored projections of spectral layers by tensor name (``specmerge tune``'s spectral cache, see
    :class:`~specmerge.pipeline.run.jobs.ModelJob`); the output is the same. ``home``: where the folder will be
    used from when it is moved after writing (a tune's candidate becoming ``best/``): ``recipe.yaml``, the card and
    an adapter's config name local inputs by their path relative to it (default ``output``).
    """
    check_threads(threads)
    executor = executor_for(recipe, threads) if executor is None else executor
    output = Path(output)
    named_from = output if home is None else Path(home)
    refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])
    check_output(output, overwrite)  # before any work: parent exists, an existing folder may be replaced
    if hasattr(executor, "check_reachable"):  # a cluster that does not answer: refused before the work folder exists
        executor.check_reachable()
    options = ComputeOptions.for_recipe(recipe)
    started = time.perf_counter()
    with ExitStack() as stack:
        threads_used = stack.enter_context(merge_threads(threads))  # torch's count restored on leaving
        prepared = prepare_merge(stack, recipe, output)
        say_not_merged(prepared.plan, recipe.method)  # every tensor that does not get the method asked for, and why
        keys = list(recipe.expert_keys or recipe.experts)
        related = check_related(prepared.plan, prepared.base, prepared.experts, list(recipe.experts), keys)
        if related:
            prepared.notes["relatedness"] = related
        size = prepared.summary["bytes"] if recipe.output_format == "model" else None  # for a full disk's message
        with atomic_directory(output, overwrite=overwrite, expected_bytes=size) as folder:
            if recipe.output_format == "lora":
                reports, extra = _write_adapter(prepared, folder, options, executor, progress, named_from)
            else:
                reports, extra = _write_model(prepared, folder, options, executor, progress, fsync, layers)
            extra = {"threads": threads_used.threads, "threads_from": threads_used.source, **extra}
            if hasattr(executor, "describe"):
                extra["executor"] = executor.describe()
            report = record_output(prepared, folder, named_from, options, reports, extra, started)
    return report


def executor_for(recipe: Recipe, threads: int | None = None) -> Executor:
    """The executor a recipe names: ``local`` (:class:`~specmerge.pipeline.run.executor.StreamingExecutor`; with
    ``device: cuda`` on a machine with several GPUs, :class:`~specmerge.pipeline.run.devices.DevicesExecutor` over all
    of them) or ``ray`` (:class:`~specmerge.pipeline.run.ray_executor.RayExecutor` at the recipe's ``address``, each
    task asking for ``threads`` CPUs, default 1; Ray must be installed)."""
    if recipe.executor == "ray":
        from specmerge.pipeline.run.ray_executor import RayExecutor

        return RayExecutor(recipe.address, cpus_per_task=threads or 1, threads=threads)
    several = recipe.device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 1
    if several and recipe.output_format == "model":
        from specmerge.pipeline.run.devices import DevicesExecutor  # every GPU of this machine, in this process

        return DevicesExecutor([torch.device("cuda", i) for i in range(torch.cuda.device_count())])
    return StreamingExecutor()


def _write_model(
    prepared: PreparedMerge,
    folder: Path,
    options: ComputeOptions,
    executor: Executor,
    progress: bool,
    fsync: bool,
    layers: Mapping[str, LayerProjections] | None = None,
) -> tuple[list[TensorReport], dict]:
    plan = prepared.plan
    quantizer = output_quantizer(prepared)  # None: written dense
    with shard_writer(prepared, folder, fsync, quantizer) as writer:  # closes (index, check) on success, else aborts
        write = writer.write if quantizer is None else quantizer.sink(writer.write, {p.name: p.shape for p in plan})
        job = ModelJob(
            plan, prepared.base, prepared.experts, write, options,
            fsync=fsync, layers=layers, recipe=prepared.recipe, shards=writer,
        )  # fmt: skip
        extra = {}
        if options.device.type == "cuda":  # batches and the CPU for what does not fit, by the device's memory
            from specmerge.pipeline.run import device_plan

            extra["device_plan"] = device_plan.plan_and_apply(job, executor, prepared.recipe).describe()
        reports = executor.run(job, progress=progress)
    model_files(prepared, folder, None if quantizer is None else quantizer.config)
    if quantizer is None:
        return reports, extra
    summary = quantizer.summary()
    worst = summary["largest"]
    logging.getLogger(OUTPUT_LOG).info(
        f"wrote {summary['weights']} weights in fp8 ({prepared.recipe.quantize}): largest relative error "
        f"{worst['relative_error']:.2e} ('{worst['tensor']}'), each in report.json"
    )
    return reports, {**extra, "quantization": summary}


def shard_writer(
    prepared: PreparedMerge, folder: Path, fsync: bool, quantizer: OutputQuantizer | None = None
) -> ShardWriter:
    """The writer of a merged model's shards into ``folder``: every planned tensor (as ``quantizer`` stores it, when
    given), the recipe's shard size."""
    recipe = prepared.recipe
    infos = [TensorInfo(p.name, p.shape, p.out_dtype) for p in prepared.plan]
    return ShardWriter(
        folder,
        infos if quantizer is None else quantizer.stored(infos),
        max_shard_bytes=recipe.shard_bytes,
        metadata={"merged_with": f"specmerge {__version__}", "method": recipe.method},
        fsync=fsync,
    )


def model_files(prepared: PreparedMerge, folder: Path, quantization: Mapping[str, Any] | None = None) -> None:
    """A merged model's files beside its shards: the config (its vocabulary size and dtype updated, and
    ``quantization`` as its quantization_config when the weights are written quantized) and tokenizer, with the
    chat template chosen for it (:mod:`specmerge.io.output.chat_template`)."""
    copy_config_files(prepared.config_path, folder)
    vocabulary = prepared.vocabulary  # the tokenizer: the base's files, an expert's, or the union written
    if vocabulary is None:
        copy_tokenizer_files(prepared.base_path, folder)
    else:
        vocabulary.write_tokenizer(folder)
    if prepared.chat_template is not None:
        apply_template(folder, prepared.chat_template)
    rows = None if vocabulary is None else vocabulary.rows
    infos = [TensorInfo(p.name, p.shape, p.out_dtype) for p in prepared.plan]
    write_output_config(folder, infos, vocab_size=rows, quantization=quantization, layers=prepared.layer_count)


def record_output(
    prepared: PreparedMerge,
    folder: Path,
    output: Path,
    options: ComputeOptions,
    reports: list[TensorReport],
    extra: dict,
    started: float,
) -> dict:
    """Write ``report.json``, ``recipe.yaml`` (hub ids pinned, paths relative to ``output``) and the model card into
    ``folder`` (the output being written, renamed to ``output`` when done, or used from ``output`` after a move);
    return the report."""
    recipe = prepared.recipe
    method = get_method(recipe.method)
    report = {
        "specmerge": __version__,
        "method": recipe.method,
        "citation": method.citation,
        "params": recipe.params,
        "output_format": recipe.output_format,
        "device": str(options.device),
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - started, 3),
        "files": sorted([p.name for p in folder.iterdir()] + ["recipe.yaml", "report.json", "README.md"]),
        "summary": prepared.summary,
        **prepared.notes,
        **extra,
        "tensors": [asdict(r) for r in reports],
    }
    written = portable_recipe(recipe, prepared.inputs, output, prepared.layer_inputs)  # pinned ids, relative paths
    (folder / "recipe.yaml").write_text(written.to_yaml())
    (folder / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (folder / "README.md").write_text(card_for(prepared, written, method.citation))
    return report


def _write_adapter(
    prepared: PreparedMerge,
    folder: Path,
    options: ComputeOptions,
    executor: Executor,
    progress: bool,
    output: Path,
) -> tuple[list[TensorReport], dict]:
    recipe, plan, experts = prepared.recipe, prepared.plan, prepared.experts
    out_dtype = DTYPES[recipe.dtype] if recipe.dtype != "auto" else experts[0].adapter.dtype
    job = AdapterJob(plan, experts, options, max_rank=recipe.max_rank, out_dtype=out_dtype, recipe=recipe)
    reports = executor.run(job, progress=progress)
    factors = job.factors()
    ranks = {name: f.rank for name, f in factors.items()}
    base = prepared.inputs[0]  # named as in the written recipe: a hub id, or a path relative to the output folder
    config = adapter_config(ranks, base_model=portable_spec(base, output, pinned=False), like=experts[0].adapter.config)
    embeddings = {n for e in experts for n, m in e.adapter.modules().items() if m.embedding}  # lora_embedding_A/B
    write_adapter(folder, factors, {**config, "revision": base.commit} if base.commit else config, embeddings)
    extra = {
        "adapter": {
            "modules": len(factors),
            "max_rank": max(ranks.values(), default=0),
            "max_discarded_energy": max((f.discarded_energy for f in factors.values()), default=0.0),
        }
    }
    return reports, extra
