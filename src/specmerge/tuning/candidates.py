"""A tune's candidate models (:class:`Candidates`): each setting merged when first asked for, several in one pass,
into a model folder under ``work/`` or, for a Python evaluation that takes them in memory, into a state dict
(:func:`~specmerge.tuning.batch.merge_in_memory`), and dropped once scored.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.recipe.values import parse_size
from specmerge.pipeline.run.api import run_recipe
from specmerge.pipeline.run.compute import resolve_device
from specmerge.tuning.batch import NotBatchable, merge_in_memory, run_settings
from specmerge.tuning.cache_build import available_memory
from specmerge.tuning.space import Setting


def candidates_in_memory(candidates: str, command: str | None, module: torch.nn.Module | None, recipe: Recipe) -> bool:
    """Whether the candidates are merged in memory (see :func:`~specmerge.tuning.tune.tune`'s ``candidates``)."""
    if candidates not in ("auto", "memory", "disk"):
        raise ValueError(f"candidates must be auto, memory or disk, got {candidates!r}")
    dense_model = recipe.output_format == "model" and recipe.quantize == "none"
    if candidates == "memory":
        if command is not None:
            raise ValueError("a command evaluates a model folder: candidates='memory' needs a Python evaluation")
        if not dense_model:
            raise ValueError(
                f"this recipe writes {'a LoRA adapter' if recipe.output_format != 'model' else 'quantized weights'}, "
                "which a state dict in memory would not be: evaluate the candidates from disk (candidates='disk')"
            )
    return candidates == "memory" or (candidates == "auto" and module is not None and dense_model)


class Candidates:
    """Each setting's model in ``work/<key>`` (or, in memory, its state dict in ``held``), merged when first asked for
    together with up to ``batch`` - 1 of the round's next unscored settings in one pass
    (:func:`~specmerge.tuning.batch.run_settings`, :func:`~specmerge.tuning.batch.merge_in_memory`), as many as half
    the free disk (or the available memory) holds; a setting whose plan differs beyond parameters is merged alone."""

    def __init__(
        self,
        recipe: Recipe,
        folder: Path,
        layers: dict,
        threads: int | None,
        batch: int,
        reuse: bool = False,
        in_memory: bool = False,
    ) -> None:
        self.recipe, self.folder, self.layers, self.threads, self.batch = recipe, folder, layers, threads, batch
        self.reuse, self.in_memory = reuse, in_memory
        self.round: list[Setting] = []
        self.seconds: dict[str, float] = {}
        self.model_bytes: int | None = None
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    def _merged(self, setting: Setting) -> bool:
        if self.in_memory:
            return setting.key in self.held
        return (self.folder / "work" / setting.key / "report.json").is_file()

    def candidate(self, setting: Setting) -> Path | dict[str, torch.Tensor]:
        """What the evaluation gets: the setting's model folder, or its state dict."""
        return self.held[setting.key] if self.in_memory else self.folder / "work" / setting.key

    def discard(self, setting: Setting) -> None:
        self.held.pop(setting.key, None)
        discard(self.folder / "work" / setting.key)

    def model(self, setting: Setting, unscored: list[Setting]) -> float:
        """Merge ``setting`` (and the next ``unscored`` ones) unless its model is there; its share of the seconds."""
        if self._merged(setting):
            return self.seconds.get(setting.key, 0.0)
        after = unscored[unscored.index(setting) + 1 :] if setting in unscored else []
        after = [s for s in after if not self._merged(s)]  # merged by an earlier pass
        chosen = [setting, *after[: self._room() - 1]]
        recipes = [recipe_for(self.recipe, s) for s in chosen]
        start = time.perf_counter()
        merge = self._merge_in_memory if self.in_memory else self._merge_to_disk
        chosen = merge(chosen, recipes)  # the settings merged: only the first when the plans differ
        share = (time.perf_counter() - start) / len(chosen)
        self.seconds.update({s.key: share for s in chosen})
        return share

    def _merge_in_memory(self, chosen: list[Setting], recipes: list[Recipe]) -> list[Setting]:
        try:
            states = merge_in_memory(recipes, layers=self.layers, threads=self.threads, reuse=self.reuse)
        except NotBatchable:
            chosen, states = chosen[:1], merge_in_memory(recipes[:1], layers=self.layers, threads=self.threads)
        self.held.update({s.key: state for s, state in zip(chosen, states, strict=True)})
        if self.model_bytes is None:
            self.model_bytes = sum(t.numel() * t.element_size() for t in states[0].values())
        return chosen

    def _merge_to_disk(self, chosen: list[Setting], recipes: list[Recipe]) -> list[Setting]:
        setting, work = chosen[0], self.folder / "work"
        work.mkdir(exist_ok=True)
        if len(chosen) > 1:
            try:
                outputs, homes = [work / s.key for s in chosen], [self.folder / "best"] * len(chosen)
                run_settings(recipes, outputs, layers=self.layers, threads=self.threads, reuse=self.reuse, homes=homes)
            except NotBatchable:
                chosen, recipes = chosen[:1], recipes[:1]
        if len(chosen) == 1:
            run_recipe(recipes[0], work / setting.key, overwrite=True, progress=False, fsync=False,
                       threads=self.threads, layers=self.layers, home=self.folder / "best")  # fmt: skip
        if self.model_bytes is None:
            self.model_bytes = sum(f.stat().st_size for f in (work / setting.key).iterdir() if f.is_file())
        return chosen

    def _room(self) -> int:
        """How many models one pass may make: ``batch``, and no more than half the free disk (or, in memory, half
        the available memory) holds."""
        if self.model_bytes is None:
            return 1
        free = available_memory(torch.device("cpu")) if self.in_memory else shutil.disk_usage(self.folder).free
        return max(1, min(self.batch, int(free / 2 // max(self.model_bytes, 1))))


def beside_cache(recipe: Recipe, layers: Mapping[str, Any]) -> Recipe:
    """The recipe the settings merge with: on a GPU with a budget given (``gpu_memory``), that budget less what the
    spectral cache keeps on the device, so that the merges and the cache together stay within it."""
    resident = getattr(layers, "resident_bytes", 0)
    if not resident or recipe.gpu_memory is None or resolve_device(recipe.device).type != "cuda":
        return recipe

    data = recipe.model_dump()
    data["gpu_memory"] = max(parse_size(recipe.gpu_memory, "gpu_memory") - resident, 0)
    return Recipe.from_dict(data)


def recipe_for(recipe: Recipe, setting: Setting) -> Recipe:
    data = recipe.model_dump()
    data["params"] = {**recipe.params, **setting.params}
    return Recipe.from_dict(data)


def discard(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
