"""Merges in memory: state dicts, ``nn.Module``\\ s and PEFT models in, a state dict (or a new module) out.

``merge_state_dicts(base, experts, method=..., params=..., **options)`` runs what :func:`specmerge.merge` runs
(the :class:`~specmerge.pipeline.recipe.model.Recipe`'s validation, :func:`~specmerge.pipeline.plan.rules.make_plan`, a
:class:`~specmerge.pipeline.run.jobs.ModelJob` run by an executor, :mod:`specmerge.pipeline.run.compute`) with the
inputs read from memory (:mod:`specmerge.io.views.memory`) and the merged tensors collected into a dict instead of
written as shards: the same tensors, bit for bit, as the folder API gives for the same weights and thread count.
``merge_modules`` returns a new module, a copy of the base holding the merged weights. No input is modified.

Inputs: a mapping of names to tensors, an ``nn.Module`` (its ``state_dict()``), or a PEFT model. A PEFT model
as an expert is its active LoRA adapter (a low-rank task vector, merged exactly in factored form, as an adapter
folder is); as the base (or a base that PEFT wrapped in place) it is the weights under its adapters. Tensor
names must be the base's: the name maps, own modules and vocabulary matching of folder merges need the inputs'
config and tokenizer files. A base module with a transformers ``config`` gives the layout of GPT-2-style
Conv1D weights as a base folder's ``config.json`` does; a bare state dict has none, like a single weights file.

Options that only concern files are refused (:data:`FILE_OPTIONS`); every other keyword goes to the Recipe.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from specmerge.errors import RecipeError
from specmerge.io.formats.layout import weights_stored_in_out
from specmerge.io.formats.protocol import SourceError
from specmerge.io.formats.stacks import expert_stacks
from specmerge.io.views.experts import CheckpointExpert, Expert
from specmerge.io.views.memory import (
    MemoryAdapterExpert,
    MemorySource,
    is_peft_model,
    peft_adapter,
    peft_tensor,
    storage_key,
    unwrapped_weights,
)
from specmerge.pipeline.plan.rules import PlanError, TensorPlan, make_plan
from specmerge.pipeline.plan.summary import say_not_merged
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.executor import StreamingExecutor
from specmerge.pipeline.run.jobs import ComputeOptions, ModelJob
from specmerge.pipeline.run.threads import check_threads, merge_threads
from specmerge.pipeline.run.work import Executor

StateDict = Mapping[str, torch.Tensor]
Model = StateDict | torch.nn.Module

# Recipe keys about files, refused here with what to do instead.
FILE_OPTIONS: dict[str, str] = {
    "shard_size": "the merged tensors are returned, not written in shards",
    "output_format": "the merged tensors are returned; write a LoRA adapter with specmerge.merge",
    "max_rank": "it applies to LoRA adapters written by specmerge.merge (output_format lora)",
    "config_source": "the tensor names are the base's; choose another config with specmerge.merge",
    "tokenizer_source": "experts with added tokens are matched by their tokenizer files: use specmerge.merge",
    "modules": "own modules of experts (tensors the base lacks) are merged by specmerge.merge",
    "address": "an in-memory merge runs in this process; merge saved folders with specmerge.merge on a Ray cluster",
    "chat_template": "the chat template goes with a model folder's tokenizer: merge folders with specmerge.merge",
}


def merge_state_dicts(
    base: Model,
    experts: Sequence[Model],
    *,
    method: str = "swudi_a",
    params: Mapping[str, Any] | None = None,
    progress: bool = False,
    threads: int | None = None,
    executor: Executor | str | None = None,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """Merge ``experts`` (fine-tuned from ``base``) in memory; the merged state dict, in the base's order.

    ``base`` and each expert are a state dict (name -> tensor), an ``nn.Module`` or a PEFT model (see the module
    docstring). ``method``, ``params`` and ``options`` (overrides, non_matrix, dtype, compute_dtype, device,
    expert_keys, ...) are those of :func:`specmerge.merge`, validated before any tensor is read; the options
    about files (:data:`FILE_OPTIONS`) are refused. The merged tensors are new CPU tensors (tied names share
    one); ``threads`` and ``executor`` as in :func:`specmerge.merge`; ``progress`` shows a progress bar.
    """
    check_threads(threads)
    if isinstance(executor, str) and executor != "local":
        raise RecipeError(
            f"executor {executor!r} does not apply to an in-memory merge: Ray workers read the inputs from files; "
            "save the models and use specmerge.merge(..., executor='ray')",
            ("executor",),
        )
    recipe = memory_recipe(experts, method=method, params=params, **options)
    executor = StreamingExecutor() if executor is None or executor == "local" else executor
    compute = ComputeOptions.for_recipe(recipe)  # device, compute dtype, expert weights: as specmerge.merge
    weights = base_weights(base)
    with ExitStack() as stack:
        source = stack.enter_context(MemorySource(weights, "in memory"))
        opened = [stack.enter_context(open_memory_expert(e, source, key)) for e, key in _keyed(experts, recipe)]
        refuse_repeated(base, experts, list(recipe.expert_keys or []))  # each input's kind checked first
        plan = memory_plan(recipe, source, opened, layout_config(base))
        say_not_merged(plan, recipe.method)
        collected = CollectedTensors(plan)
        job = ModelJob(plan, source, opened, collected.write, compute, fsync=False)  # fsync: the cost estimate
        with merge_threads(threads):  # torch's thread count restored on leaving
            executor.run(job, progress=progress)
    return collected.state_dict(source.aliases, order=list(weights))


def merge_modules(base: torch.nn.Module, experts: Sequence[Model], **options: Any) -> torch.nn.Module:
    """A new module: a deep copy of ``base`` holding the weights :func:`merge_state_dicts` gives for these
    arguments (each tensor in its merged dtype, on the device of the base's tensor). ``base`` is not modified."""
    if not isinstance(base, torch.nn.Module):
        raise RecipeError(
            f"merge_modules takes the base as an nn.Module, got {type(base).__name__}: use merge_state_dicts"
        )
    lora = peft_tensor(list(base.state_dict()))
    if lora is not None:
        raise RecipeError(
            f"the base module holds PEFT tensors (e.g. '{lora}'), which a copy of it would keep: pass the model "
            "without adapters (a fresh from_pretrained), or use merge_state_dicts"
        )
    merged = merge_state_dicts(base, experts, **options)
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if tensor.dtype != merged[name].dtype:  # tied names are one parameter: cast once
                tensor.data = tensor.data.to(merged[name].dtype)
        model.load_state_dict(merged)
    return model


def memory_recipe(experts: Sequence[Model], *, method: str, params: Mapping[str, Any] | None, **options: Any) -> Recipe:
    """The validated recipe of an in-memory merge of ``experts`` (named ``expert0``, ``expert1``, ... unless
    ``expert_keys`` says otherwise); file options (:data:`FILE_OPTIONS`) are refused."""
    for key, why in FILE_OPTIONS.items():
        if key in options:
            raise RecipeError(f"option '{key}' does not apply to an in-memory merge: {why}", (key,))
    if isinstance(experts, Mapping | torch.nn.Module | str | bytes) or not isinstance(experts, Sequence):
        raise RecipeError(
            f"experts must be a list of state dicts, modules or PEFT models, got {type(experts).__name__}: "
            "pass [expert] for one expert (names go in expert_keys=[...])",
            ("experts",),
        )
    if isinstance(params, Mapping):
        params = dict(params)
    placeholders = [f"expert{i}" for i in range(len(experts))]
    given = {"method": method, "params": {} if params is None else params, **options}
    return Recipe.from_dict({"base": "in memory", "experts": placeholders, **given})


def refuse_repeated(base: Model, experts: Sequence[Model], keys: Sequence[str]) -> None:
    """Refuse an expert that is the base, or another expert, in memory: the same object, or a mapping whose
    tensors are all the same memory (``dict(sd)``), as files that are the same are refused."""

    def identity(model: Model) -> Any:
        tensors = [t for t in _names(model).values() if isinstance(t, torch.Tensor) and t.numel()]
        return frozenset(storage_key(t) for t in tensors) or id(model)

    seen = {identity(base): "the base"}
    for expert, key in zip(experts, keys, strict=True):
        found = seen.setdefault(identity(expert), f"expert '{key}'")
        if found != f"expert '{key}'":
            raise RecipeError(
                f"expert '{key}' is {found} again (the same tensors in memory): an expert is a fine-tuned copy; list "
                "each model once"
            )


def _keyed(experts: Sequence[Model], recipe: Recipe) -> list[tuple[Model, str]]:
    return list(zip(experts, recipe.expert_keys or [], strict=True))


def _refuse_path(obj: Any, what: str) -> None:
    if isinstance(obj, str | bytes | os.PathLike):
        raise RecipeError(
            f"{what} is a path ({obj!r}): merge_state_dicts takes state dicts, nn.Modules or PEFT models; "
            "merge model folders with specmerge.merge"
        )
    if not isinstance(obj, Mapping | torch.nn.Module):
        raise RecipeError(f"{what} must be a state dict, an nn.Module or a PEFT model, got {type(obj).__name__}")


def _names(obj: Model) -> Mapping[str, Any]:
    return obj.state_dict() if isinstance(obj, torch.nn.Module) else obj


def base_weights(base: Model) -> dict[str, torch.Tensor]:
    """The base's tensors by name: a module's state dict; a model PEFT wrapped, without its adapters."""
    _refuse_path(base, "the base")
    tensors = _names(base)
    if is_peft_model(base) or peft_tensor(list(tensors)) is not None:
        return unwrapped_weights(tensors, prefixed=is_peft_model(base))
    return dict(tensors)


def open_memory_expert(expert: Model, base: MemorySource, key: str) -> Expert:
    """An expert held in memory: a PEFT model's active LoRA adapter (low-rank), else its full weights."""
    label = f"expert '{key}'"
    _refuse_path(expert, label)
    if is_peft_model(expert):
        config, tensors = peft_adapter(expert, label)
        return MemoryAdapterExpert(config, tensors, base.infos(), key, base)
    tensors = _names(expert)
    lora = peft_tensor(list(tensors))
    if lora is not None:
        raise SourceError(
            f"{label} holds PEFT tensors (e.g. '{lora}') but is not a PEFT model: pass the PeftModel itself "
            "(its LoRA adapter is merged exactly), or its merge_and_unload() model"
        )
    return CheckpointExpert(MemorySource(tensors, key))


def layout_config(base: Model) -> dict[str, Any] | None:
    """The transformers config of a base module (what a base folder's config.json holds), or None."""
    config = getattr(base, "config", None) if isinstance(base, torch.nn.Module) else None
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def memory_plan(
    recipe: Recipe, base: MemorySource, experts: Sequence[Expert], config: Mapping[str, Any] | None
) -> list[TensorPlan]:
    """The plan (:func:`~specmerge.pipeline.plan.rules.make_plan`) of in-memory inputs; tied names must be
    tied alike."""
    keys = list(recipe.expert_keys or [])
    for expert, key in zip(experts, keys, strict=True):
        if isinstance(expert, CheckpointExpert) and isinstance(expert.source, MemorySource):
            check_ties(base.aliases, expert.source.aliases, f"expert '{key}'")
    transposed = weights_stored_in_out(config, base.infos(), experts)
    stacks = expert_stacks(config, base.infos())
    return make_plan(recipe, base.infos(), [e.infos() for e in experts], keys, transposed, stacks=stacks)


def check_ties(base: Mapping[str, str], expert: Mapping[str, str], label: str) -> None:
    """Refuse an expert whose tied names (alias -> name, :attr:`MemorySource.aliases`) are not the base's."""
    name = next((n for n in [*base, *expert] if (n in base) != (n in expert)), None)
    if name is None:
        return
    tied, untied = ("the base", label) if name in base else (label, "the base")
    raise PlanError(
        f"tensor '{name}' is tied to '{base.get(name) or expert[name]}' in {tied} but not in {untied}: "
        "tie or untie them alike in every input"
    )


class CollectedTensors:
    """A ModelJob's sink that keeps the merged tensors (whole, or assembled from blocks of rows) in memory."""

    def __init__(self, plan: Sequence[TensorPlan]) -> None:
        self._plan = {entry.name: entry for entry in plan}
        self._tensors: dict[str, torch.Tensor] = {}

    def write(self, name: str, tensor: torch.Tensor, *, row_start: int | None = None) -> None:
        entry = self._plan[name]
        if row_start is None:
            self._tensors[name] = tensor
            return
        if name not in self._tensors:
            self._tensors[name] = torch.empty(entry.shape, dtype=entry.out_dtype)
        self._tensors[name][row_start : row_start + tensor.shape[0]].copy_(tensor)

    def state_dict(self, aliases: Mapping[str, str], order: Sequence[str]) -> dict[str, torch.Tensor]:
        """The merged tensors in ``order`` (the base's names), each tied name the tensor of the name it is tied to."""
        out = {}
        for name in order:
            target = aliases.get(name, name)
            if target in self._tensors:
                out[name] = self._tensors[target]
        return out
