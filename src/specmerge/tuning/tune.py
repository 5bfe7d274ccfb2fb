"""``specmerge tune`` / :func:`tune`: merge every setting of a search space, score each with the user's evaluation,
keep the best model.

The tune folder holds ``tune.json`` (the recipe, space, strategy and evaluation it was started with),
``results.jsonl`` (every score, appended as it comes: :mod:`.results`), ``results.csv``, ``results.md``,
``plots/``, ``best/`` (the best model so far, a full model folder with its ``recipe.yaml``) and by default
``cache/`` (the spectral cache). Running the same tune again in the same folder skips every setting already scored.

Each setting is a complete merge by :func:`specmerge.pipeline.run.api.run_recipe` of the recipe with the setting's
parameters, written to ``work/`` and removed once scored (or moved to ``best/``: its ``recipe.yaml`` names local inputs
relative to ``best/`` from the start). A Python evaluation may take the
candidates in memory instead (``candidates="memory"``; the default when it is given a ``module``): each setting is
merged into a state dict (:func:`~specmerge.tuning.batch.merge_in_memory`, the same tensors as the folder's shards),
handed to the evaluation, and dropped; nothing is written but the winner, merged once more into ``best/`` at the end.
Spectral methods merge from the spectral cache (:mod:`.spectral_cache`): the first setting pays the decompositions,
every other one only the filter products and the I/O, with the same bits as a fresh merge. On a GPU the cache stays
in device memory across the grid when it takes at most half the budget (``gpu_memory``, else the free memory less a
margin), and the settings' merges plan with the rest. Strategies: ``grid`` (every setting at the full
evaluation) and ``halving`` (successive halving: every setting on the smallest share of the evaluation, the best
1/eta of them on eta times more, and so on up to the full evaluation; the evaluation takes that share as
``{budget}`` / ``budget=``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import RecipeError
from specmerge.methods import get_method
from specmerge.pipeline.inputs.open import refuse_output_inside_inputs
from specmerge.pipeline.recipe.layered import validate_layered
from specmerge.pipeline.recipe.model import Recipe, load_recipe_with
from specmerge.pipeline.run.api import run_recipe
from specmerge.tuning.candidates import Candidates, beside_cache, candidates_in_memory, discard, recipe_for
from specmerge.tuning.evaluation import Evaluate, callable_evaluator, command_evaluator, takes_budget, uses_budget
from specmerge.tuning.results import ResultsLog, Scored, write_plots, write_tables
from specmerge.tuning.search import Strategy, search
from specmerge.tuning.space import Setting, TuneOptions, parse_options
from specmerge.version import __version__


@dataclass
class TuneResult:
    """What a tune found: the best score and setting, the best model's folder, every score, the tune folder."""

    best: Scored
    best_model: Path
    scores: list[Scored]
    folder: Path
    seconds: float


def load_tune_file(path: str | os.PathLike) -> tuple[Recipe, Any]:
    """A tune file: a recipe plus an optional ``tune:`` section (see :mod:`specmerge.tuning.space`)."""
    return load_recipe_with(path, "tune")


def tune(
    recipe: Recipe | str | os.PathLike | Mapping[str, Any],
    output: str | os.PathLike,
    *,
    evaluate: Callable[..., Any] | None = None,
    command: str | None = None,
    space: Mapping[str, Any] | None = None,
    strategy: str | None = None,
    metric: str | None = None,
    maximize: bool | None = None,
    module: torch.nn.Module | None = None,
    cache: str | os.PathLike | None = None,
    restart: bool = False,
    progress: bool = True,
    threads: int | None = None,
    timeout: float | None = None,
    batch: int = 8,
    reuse_products: bool = False,
    candidates: str = "auto",
    device: str | None = None,
    gpu_memory: int | str | None = None,
    log: Callable[[str], None] = print,
) -> TuneResult:
    """Tune ``recipe`` (a :class:`Recipe`, a mapping, or a tune file's path) against an evaluation into ``output``.

    The evaluation is ``evaluate`` (a callable given the model folder, or ``module`` holding the merged weights;
    returns a number or a mapping with ``metric``) or ``command`` (a shell command with ``{model}``). ``space``,
    ``strategy``, ``metric`` and ``maximize`` override the tune file's ``tune:`` section (defaults: the paper's
    grid for the method, ``grid``, the only number printed, maximize). ``cache`` is the spectral cache's folder
    (default ``output/cache``; share one between tunes of the same inputs). ``restart`` discards the scores of an
    earlier tune in ``output`` of another recipe or space instead of refusing. ``batch``: at most this many settings
    are merged in one pass over the inputs (their models wait in ``work/`` for their evaluation; fewer when the
    disk is short: at most half its free space). ``reuse_products``: within a pass, spectral settings that keep
    nested sets of directions (SWUDI at several r) build each filter product on the previous one: equal to
    ``specmerge merge`` to float32 rounding instead of bit for bit, and several times faster on a CPU.
    ``candidates``: ``"disk"`` (each setting's model folder written to ``work/`` for the evaluation), ``"memory"``
    (a Python evaluation gets the merged state dict, or ``module`` holding it; nothing but the winner is written;
    a pass holds at most half the available memory of models) or ``"auto"`` (memory when ``module`` is given and
    the model is written dense, else disk). ``device`` and ``gpu_memory`` replace the recipe's.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a whole number >= 1 (settings merged in one pass), got {batch!r}")
    started = time.perf_counter()
    recipe, section = _recipe_and_section(recipe)
    replaced = {k: v for k, v in {"device": device, "gpu_memory": gpu_memory}.items() if v is not None}
    if replaced:
        recipe = Recipe.from_dict({**recipe.model_dump(), **replaced})
    section = {**(section or {}), **{k: v for k, v in {"space": space, "strategy": strategy, "metric": metric,
                                                        "maximize": maximize}.items() if v is not None}}  # fmt: skip
    method = get_method(recipe.method)
    options = parse_options(method, section, recipe.params)
    score_with, description = _evaluation(evaluate, command, options, module, timeout)
    in_memory = candidates_in_memory(candidates, command, module, recipe)
    folder = Path(output)
    refuse_output_inside_inputs(folder, [recipe.base, *recipe.experts])
    if cache is not None:  # the spectral cache is written too: never into an input
        refuse_output_inside_inputs(Path(cache), [recipe.base, *recipe.experts])
    state = {"specmerge": __version__, "recipe": recipe.model_dump(mode="json"), "space": options.space.to_dict(),
             "strategy": options.strategy, "eta": options.eta, "min_budget": options.min_budget,
             "maximize": options.maximize, "metric": options.metric, "evaluation": description}  # fmt: skip
    results = _open_folder(folder, state, restart)
    settings = options.space.settings()
    log(f"tuning {recipe.method} over {len(settings)} settings ({options.strategy}) -> {folder}")
    layers = _layers(recipe, settings, Path(cache) if cache is not None else folder / "cache", progress, log)
    strategy = Strategy(options.strategy, options.eta, options.min_budget, options.maximize)

    merging = Candidates(beside_cache(recipe, layers), folder, layers, threads, batch, reuse_products, in_memory)
    log("candidates merged in memory, only the best written" if in_memory else f"candidates written to {folder}/work")

    def score(setting: Setting, budget: float) -> float:
        found = results.find(setting.key, budget)
        if found is not None:
            return found.score
        seconds = merging.model(setting, [s for s in merging.round if results.find(s.key, budget) is None])
        start = time.perf_counter()
        numbers = score_with(merging.candidate(setting), budget)
        entry = Scored(setting.key, dict(setting.params), budget, numbers.pop("score"), numbers, seconds,
                       time.perf_counter() - start)  # fmt: skip
        results.add(entry)
        return entry.score

    def after(setting: Setting, budget: float, value: float, new_best: bool) -> None:
        if new_best and not in_memory:
            _keep_best(folder, setting)
        merging.discard(setting)

    def before_round(settings: list[Setting], budget: float) -> None:
        merging.round = settings

    chosen, _ = search(settings, score, strategy, after=after, before_round=before_round, progress=progress)
    discard(folder / "work")  # models merged ahead for settings a halving round dropped
    merging.held.clear()
    best = results.find(chosen.key, 1.0)
    if best is None:
        raise RuntimeError("no setting was scored at the full budget")
    if hasattr(layers, "release"):
        layers.release()  # the winner's merge has the whole budget (it reads the cache from disk if merged again)
    best_model = _finish_best(recipe, best, folder, layers, threads)
    names = list(options.space.values)
    write_tables(results.entries, names, folder, options.maximize)
    write_plots(results.entries, names, folder, options.maximize)
    log(f"best: {Setting(best.params).describe()} -> score {best.score:.6g}; model in {best_model}")
    return TuneResult(best, best_model, list(results.entries), folder, time.perf_counter() - started)


def _recipe_and_section(recipe: Any) -> tuple[Recipe, Any]:
    if isinstance(recipe, Recipe):
        return recipe, None
    if isinstance(recipe, Mapping):
        data = dict(recipe)
        section = data.pop("tune", None)
        return Recipe.from_dict(data), section
    return load_tune_file(recipe)


def _evaluation(
    evaluate: Callable[..., Any] | None,
    command: str | None,
    options: TuneOptions,
    module: torch.nn.Module | None,
    timeout: float | None,
) -> tuple[Evaluate, str]:
    if (evaluate is None) == (command is None):
        raise ValueError("give the evaluation: a Python callable (evaluate=) or a shell command (--eval / command=)")
    halving = options.strategy == "halving"
    if command is not None:
        if halving and not uses_budget(command):
            raise ValueError("strategy halving runs each round on a share of the evaluation: put {budget} in --eval")
        return command_evaluator(command, options.metric, timeout=timeout), command
    if halving and not takes_budget(evaluate):
        raise ValueError("strategy halving runs each round on a share of the evaluation: evaluate must take budget=")
    return callable_evaluator(evaluate, options.metric, module=module), f"python:{getattr(evaluate, '__name__', '?')}"


def _open_folder(folder: Path, state: dict[str, Any], restart: bool) -> ResultsLog:
    """The tune folder's results, after checking that an earlier tune there was of this recipe and space."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "tune.json"
    if marker.is_file():
        before = json.loads(marker.read_text())
        differ = [k for k in state if k != "specmerge" and before.get(k) != state[k]]
        if differ and not restart:
            raise RecipeError(
                f"{folder} holds a tune with another {', '.join(differ)}: use a new folder, or --restart to discard "
                "its scores"
            )
        if differ:
            (folder / "results.jsonl").unlink(missing_ok=True)
            (folder / "best.json").unlink(missing_ok=True)
            discard(folder / "best")
            discard(folder / "work")
    elif any(p.name != "cache" for p in folder.iterdir()):
        raise RecipeError(f"{folder} is not empty and holds no tune (no tune.json): give a new or empty folder")
    marker.write_text(json.dumps(state, indent=1))
    return ResultsLog(folder / "results.jsonl")


def _layers(recipe: Recipe, settings: list[Setting], root: Path, progress: bool, log: Callable[[str], None]) -> dict:
    """The spectral cache's layers for every start the settings use ({} when the method is not spectral)."""
    method = get_method(recipe.method)
    starts, kept = set(), []
    if method.spectral:  # the settings' own starts and filters
        for s in settings:
            params = validate_layered(method, {**recipe.params, **s.params})
            starts.add(params["tau_init"])
            kept += _kept(method.name, params)
    for override in recipe.overrides:  # and each spectral override's
        other = get_method(override.method or recipe.method)
        if other.spectral:
            params = validate_layered(other, override.params or {})
            starts.add(params["tau_init"])
            kept += _kept(other.name, params)
    if not starts:
        return {}
    from specmerge.tuning.cache_build import cached_layers

    return cached_layers(recipe, root, sorted(starts), kept=kept, progress=progress, log=log)


def _kept(method: str, params: dict) -> list:
    """What a spectral setting's filter keeps, for each value of a per-layer rank_ratio list."""
    from specmerge.methods.spectral import kept_directions

    ratios = params.get("rank_ratio")
    if isinstance(ratios, list):
        return [kept_directions(method, {**params, "rank_ratio": r}) for r in ratios]
    return [kept_directions(method, params)]


def _keep_best(folder: Path, setting: Setting) -> None:
    """Move the setting's model to ``best/`` (replacing the previous best; ``best.json`` names its setting)."""
    work = folder / "work" / setting.key
    if work.is_dir():
        (folder / "best.json").unlink(missing_ok=True)
        discard(folder / "best")
        os.replace(work, folder / "best")
        _mark_best(folder, setting)


def _finish_best(recipe: Recipe, best: Scored, folder: Path, layers: dict, threads: int | None) -> Path:
    """``best/`` holding the best setting's model, flushed to disk; merged again if an interruption lost it."""
    target, marker = folder / "best", folder / "best.json"
    if not (marker.is_file() and json.loads(marker.read_text()).get("key") == best.key and target.is_dir()):
        marker.unlink(missing_ok=True)
        run_recipe(recipe_for(recipe, Setting(best.params)), target, overwrite=True, progress=False, threads=threads,
                   layers=layers)  # fmt: skip
        _mark_best(folder, Setting(best.params))
    for file in target.iterdir():
        if file.is_file():
            with file.open("rb") as f:
                os.fsync(f.fileno())
    return target


def _mark_best(folder: Path, setting: Setting) -> None:
    """``best.json``: which setting the model in ``best/`` is."""
    (folder / "best.json").write_text(json.dumps({"key": setting.key, "params": dict(setting.params)}))
