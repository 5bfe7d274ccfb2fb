"""Selection and scoring of the accuracy benchmark: every method, hyperparameters chosen on val.

For each training seed: the experts' deltas are merged with every candidate (:mod:`specmerge_bench.accuracy.merging`),
each candidate x final scale s is scored on the validation splits, each results row keeps the setting with
the best mean validation accuracy over the tasks (found by :func:`specmerge.tuning.search.search`, the code
``specmerge tune`` runs), and only that setting is scored on the test splits. Test accuracy is never used to
choose anything. The AdaMerging rows (:mod:`specmerge_bench.accuracy.adamerging`) adapt the merge their anchor
row chose on val to the unlabeled test inputs, and are scored on test like the others. Every score is cached on
disk (:mod:`specmerge_bench.accuracy.scores`: by the experts, the candidate, the scale, the split and a hash of
the merging code, and by a digest of the weights scored), so a rerun only computes what is missing, and after a
change to the merge code only the candidates whose weights changed are scored again.

Rows and grids (:mod:`specmerge_bench.accuracy.rows`; stated in BENCHMARKS.md): s in SCALES for every row;
the other grids are declared by each method's settings in the registry (SWUDI r x t, the exponential-only
filter's t, WUDI at 300 steps, SWUDI-A psqrt and Gavish-Donoho, ...), everything else at the registry
defaults; the WUDI step sweep is one run per seed with snapshots. Tables and plots:
:mod:`specmerge_bench.accuracy.report`.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specmerge.tuning.search import Strategy, search
from specmerge.tuning.space import Setting
from specmerge_bench.accuracy.merge_store import Merger, seed_store, stored_merge, sweep_split
from specmerge_bench.accuracy.merging import Candidate, MergedDeltas, StateDict, merge_candidates
from specmerge_bench.accuracy.precision import PRECISIONS
from specmerge_bench.accuracy.report import exact_mean, markdown, plots, summarize
from specmerge_bench.accuracy.rows import (
    ADAMERGING,
    ADAMERGING_ROWS,
    CLAIMS,
    AdaMergingRow,
    AdaMergingSettings,
    Row,
    method_rows,
    step_rows,
)
from specmerge_bench.accuracy.scores import ScoreCache, code_key, score_paths

if TYPE_CHECKING:
    from specmerge_bench.accuracy.adamerging import AdaMergingStage

SCALES = (0.1, 0.2, 0.3, 0.5, 1.0)

Scorer = Callable[[StateDict, str], dict[str, float]]  # (state dict, "val" | "test") -> task -> accuracy


def evaluate_seed(
    base: StateDict,
    experts: Mapping[str, StateDict],
    score: Scorer,
    cache: ScoreCache,
    *,
    adamerging: AdaMergingStage | None = None,
    progress: bool = True,
    expert_scores: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    merge: Merger | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Every row for one set of experts (task -> expert state dict): chosen setting, val mean, test accuracies;
    with ``adamerging``, the AdaMerging rows, each next to its anchor row.

    ``expert_scores`` (task -> split -> task -> accuracy, as ``build_experts`` scored each expert with the same
    scorer) gives each expert's own accuracy without scoring it again; without it the experts are scored here.
    ``merge`` computes the candidates' deltas (default: :func:`merge_candidates` on the experts' state dicts; the
    LoRA track's :class:`~specmerge_bench.accuracy.lora.AdapterMerger` merges adapter folders instead). ``log``
    gets a line per merge call and per row (its choice, test accuracy and seconds, cached work included).

    The main table's rows are merged and scored first, then the WUDI step sweep (its run to 5,000 steps is the
    longest merge), so a run stopped in the sweep keeps every main row. Only the candidates with a score (or,
    where ``cache`` records weights, its weights' digest) missing from ``cache`` are merged, so a rerun over
    cached scores does no merging at all; a merged candidate whose weights ``cache`` has scored under another code
    key is not scored again. Merge times are cached with the scores (key ``<candidate>|merge``).
    """
    tasks = list(experts)
    if merge is None:
        merge = functools.partial(full_merge, base, list(experts.values()))

    def both_splits(name: str, state: StateDict) -> dict[str, dict[str, float]]:
        return {
            split: cache.scored(f"{name}|{split}", lambda: state, lambda st, s=split: score(st, s), split)
            for split in ("val", "test")
        }

    result: dict[str, Any] = {"tasks": tasks, "base": both_splits("base", base), "experts": {}, "rows": {}}
    for task, state in experts.items():
        own = expert_scores[task] if expert_scores is not None else both_splits(f"expert-{task}", state)
        result["experts"][task] = {"val": own["val"][task], "test": own["test"][task]}
    # the main table first, then the WUDI step sweep (its long run merged only once the main rows are scored);
    # within each, the rows the paper's claims compare first (CLAIMED), the table keeps the registry's order
    chosen: dict[str, dict[str, Any]] = {}

    def timed(label: str, compute: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        chosen[label] = record = compute()
        test = 100 * exact_mean(list(record["test"].values()))
        log(f"{record['title']}: {record['choice']}, s={record['scale']}, test {test:.2f} % "
            f"({time.perf_counter() - start:.0f} s)")  # fmt: skip

    for rows in (method_rows(), step_rows()):
        needed = {c.key: c for c in missing_candidates(rows, cache, adamerging)}
        todo, wudi_steps = sweep_split(needed.values())  # WUDI: one run, snapshots
        start = time.perf_counter()
        deltas = merge(todo, wudi_steps, progress) if needed else MergedDeltas({}, {}, {})
        merged = [c.key for c in todo] + (["wudi_steps"] if wudi_steps else [])
        if needed:  # (a stored merge is read from disk: seconds, not minutes)
            log(f"merged {len(todo)} candidates, WUDI snapshots {wudi_steps}: {time.perf_counter() - start:.0f} s")
        for key in merged:
            routes = {"routes": deltas.routes[key]} if key in deltas.routes else {}
            cache.put(f"{key}|merge", {"seconds": deltas.seconds[key], **routes})
        for row in sorted(rows, key=lambda r: r.label not in CLAIMED):  # stable: registry order otherwise
            timed(row.label, functools.partial(choose, row, base, deltas, score, cache))
            for ada in anchored(row, adamerging):
                timed(ada.label, functools.partial(adamerge_row, ada, row, base, deltas, score, cache, adamerging,
                                                   progress))  # fmt: skip
        del deltas
    for row in method_rows() + step_rows():
        for label in (row.label, *(ada.label for ada in anchored(row, adamerging))):
            result["rows"][label] = chosen[label]
    merges = {k[: -len("|merge")]: v for k, v in cache.scores.items() if k.endswith("|merge")}
    result["merge_seconds"] = {k: v["seconds"] for k, v in merges.items()}
    result["routes"] = {k: v["routes"] for k, v in merges.items() if "routes" in v}
    return result


CLAIMED = {label for pair in CLAIMS for label in pair}  # the rows the paper's claims compare: scored first


def anchored(row: Row, adamerging: AdaMergingStage | None) -> list[AdaMergingRow]:
    """The AdaMerging rows that start from ``row``'s choice (none without an AdaMerging stage)."""
    return [ada for ada in ADAMERGING_ROWS if adamerging is not None and ada.anchor == row.label]


def full_merge(
    base: StateDict, experts: Sequence[StateDict], candidates: Sequence[Candidate], steps: Sequence[int], show: bool
) -> MergedDeltas:
    """The full track's :data:`Merger`: :func:`merge_candidates` on the experts' state dicts."""
    return merge_candidates(base, experts, candidates, wudi_steps=steps, progress=show)


def missing_candidates(
    rows: Sequence[Row], cache: ScoreCache, adamerging: AdaMergingStage | None = None
) -> list[Candidate]:
    """The candidates of ``rows`` that :func:`choose` would have to merge: a val score or the chosen test missing;
    with ``adamerging``, those :func:`adamerge_row` would have to merge (an anchor's val scores or its result)."""
    out = []
    for row in rows:
        lacking = [c for c in row.candidates if not all(cache.has(f"{c.key}|{s}|val") for s in SCALES)]
        if not lacking:
            _, best, scale = best_on_val(row, cache)
            if not cache.has(f"{best.key}|{scale}|test"):
                lacking = [best]
        known = tuple(c for c in row.candidates if c not in lacking)
        if known and anchored(row, adamerging):
            # the choice is the best of the known val scores, or one of the lacking candidates (merged anyway)
            _, best, scale = best_on_val(Row(row.label, row.title, known), cache)
            if best not in lacking and (lacking or not cache.has(adamerging_key(best, scale, adamerging))):
                lacking = [*lacking, best]
        out += [c for c in lacking if all(c.key != o.key for o in out)]
    return out


def best_on_val(row: Row, cache: ScoreCache, score: Callable[[str, Candidate, float], dict[str, float]] | None = None):
    """(mean val accuracy, candidate, scale) of the best setting of ``row``; ``score(key, candidate, scale)`` gives
    each val score (cached or not; without it, every val score must be cached).

    The settings are candidate x scale in grid order, searched by :func:`specmerge.tuning.search.search` (a grid,
    maximising the mean val accuracy over the tasks): of equal scores, the first wins.
    """
    candidates = {c.key: c for c in row.candidates}
    settings = [Setting({"candidate": c.key, "scale": s}) for c in row.candidates for s in SCALES]

    def val_mean(setting: Setting, budget: float) -> float:
        candidate, scale = candidates[setting.params["candidate"]], setting.params["scale"]
        key = f"{candidate.key}|{scale}|val"
        val = score(key, candidate, scale) if score else cache.scores[key]
        return exact_mean(list(val.values()))

    best, value = search(settings, val_mean, Strategy("grid", maximize=True))
    return value, candidates[best.params["candidate"]], best.params["scale"]


def choose(row: Row, base: StateDict, deltas: MergedDeltas, score: Scorer, cache: ScoreCache) -> dict[str, Any]:
    """The (candidate, scale) of ``row`` with the best mean validation accuracy, and its test accuracies."""

    def scored(key: str, candidate: Candidate, scale: float, split: str) -> dict[str, float]:
        return cache.scored(key, lambda: deltas.state(base, candidate, scale), lambda st: score(st, split), split)

    val_mean, candidate, scale = best_on_val(row, cache, lambda key, c, s: scored(key, c, s, "val"))
    test = scored(f"{candidate.key}|{scale}|test", candidate, scale, "test")
    merge = cache.scores.get(f"{candidate.key}|merge", {}).get("seconds")
    return {"title": row.title, "choice": candidate.describe(), "scale": scale, "val_mean": val_mean, "test": test,
            "seconds": merge}  # fmt: skip


def adamerging_key(candidate: Candidate, scale: float, stage: AdaMergingStage) -> str:
    return f"{candidate.key}|{scale}|{stage.key}|test"


def adamerge_row(
    ada: AdaMergingRow,
    anchor: Row,
    base: StateDict,
    deltas: MergedDeltas,
    score: Scorer,
    cache: ScoreCache,
    stage: AdaMergingStage,
    progress: bool = False,
) -> dict[str, Any]:
    """AdaMerging from the (candidate, scale) ``anchor`` chose on val, its test accuracies and what it learned."""
    _, candidate, scale = best_on_val(anchor, cache)

    def compute(merged: StateDict) -> dict[str, Any]:
        adapted, record = stage.adapt(base, merged, progress=progress)
        return {**record, "test": score(adapted, "test")}

    def merged() -> StateDict:
        return deltas.state(base, candidate, scale)

    record = cache.scored(adamerging_key(candidate, scale, stage), merged, compute, f"{stage.key}|test")
    return {"title": ada.title, "anchor": anchor.label, "choice": f"AdaMerging({stage.settings.describe()}) on "
            f"{candidate.describe()}", "scale": scale, "val_mean": None, "test": record["test"],
            "seconds": record["seconds"], "coefficients": record["coefficients"],
            "entropy": [record["entropy_start"], record["entropy_end"]]}  # fmt: skip


def run_benchmark(
    cache_dir: str | Path,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    model_dir: str | Path | None = None,
    manifest: Mapping[str, Any] | None = None,
    steps: int = 800,
    adamerging: AdaMergingSettings | None = ADAMERGING,
    progress: bool = True,
    log: Callable[[str], None] = print,
    precision: str = "auto",
    track: str = "full",
    n_tasks: int = 8,
) -> tuple[dict[str, Any], Path]:
    """The whole benchmark: data -> probes -> experts -> merges -> scores -> tables and plots, every stage cached.

    Returns the summary and the results folder (``results.json``, ``results.md``, ``accuracy.png``,
    ``wudi_steps.png``, ``timings.json``: the stage times of every run, appended) under
    ``cache_dir/results/<experts key>-<code key>-seeds-...``.
    ``model_dir`` / ``manifest`` replace the pinned MiniLM and the Debian-derived tasks (the tests use a tiny
    BERT and a synthetic task set). ``adamerging`` sets the AdaMerging rows (None leaves them out); they are
    given the test inputs only, without labels. ``precision``: ``auto`` (bfloat16 autocast where the CPU runs bf16
    natively, float32 elsewhere), ``bfloat16`` or ``float32`` (:mod:`specmerge_bench.accuracy.precision`); every
    stage's cache key and the results folder name hold it with the CPU's capability. ``track``: ``full``
    (fine-tuned experts) or ``lora`` (PEFT LoRA adapters merged through the adapter path,
    :mod:`specmerge_bench.accuracy.lora`; no AdaMerging rows); the results folder name starts with ``lora-``.
    ``n_tasks``: the 8-task setting or the 16-task one (:mod:`specmerge_bench.accuracy.settings`).
    """
    from specmerge_bench.accuracy import precision as accuracy_precision

    with accuracy_precision.using(precision) as name:
        log(f"precision: {name} ({accuracy_precision.tag()}; asked {precision})")
        return _run_benchmark(cache_dir, seeds, model_dir=model_dir, manifest=manifest, steps=steps,
                              adamerging=adamerging if track == "full" else None, progress=progress, log=log,
                              track=track, n_tasks=n_tasks)  # fmt: skip


def _run_benchmark(
    cache_dir: str | Path,
    seeds: Sequence[int],
    *,
    model_dir: str | Path | None,
    manifest: Mapping[str, Any] | None,
    steps: int,
    adamerging: AdaMergingSettings | None,
    progress: bool,
    log: Callable[[str], None],
    track: str,
    n_tasks: int,
) -> tuple[dict[str, Any], Path]:
    from specmerge_bench.accuracy import model as accuracy_model
    from specmerge_bench.accuracy import precision as accuracy_precision
    from specmerge_bench.accuracy.adamerging import AdaMergingStage
    from specmerge_bench.accuracy.cache_files import load_experts, load_scoring  # transformers: the [bench] extra
    from specmerge_bench.accuracy.settings import build_setting

    cache_dir = Path(cache_dir).resolve()
    started = time.perf_counter()
    built = build_setting(cache_dir, seeds, n_tasks, steps=steps, model_dir=model_dir, manifest=manifest, track=track,
                          log=log)  # fmt: skip
    prepared = time.perf_counter() - started
    base_model, base, tasks_encoded, heads = load_scoring(built, model_dir)
    stage = None
    if adamerging is not None:
        stage = AdaMergingStage(base_model, heads, accuracy_model.unlabeled_inputs(tasks_encoded, "test"), adamerging)

    def score(state: StateDict, split: str) -> dict[str, float]:
        return accuracy_model.evaluate(state, tasks_encoded, heads, split, scratch=base_model)

    experts_key = built["experts_key"]
    per_seed, seconds = [], {"build (data, probes, experts)": prepared}
    for seed in seeds:
        start = time.perf_counter()
        merge = None
        if track == "lora":
            from specmerge_bench.accuracy.base_model import load_base_model_path
            from specmerge_bench.accuracy.lora import AdapterMerger, dense_expert

            folders = built["paths"]["experts"][seed]
            experts = {task: dense_expert(base_model, folder) for task, folder in folders.items()}
            base_dir = model_dir or load_base_model_path()
            merge = AdapterMerger(base_dir, base, list(folders.values()), list(experts.values()))
        else:
            experts = load_experts(built, seed, base)
            merge = functools.partial(full_merge, base, list(experts.values()))
        merge = stored_merge(merge, seed_store(cache_dir, experts_key, seed, track))
        cache = ScoreCache(*score_paths(cache_dir, experts_key, seed, track))
        per_seed.append({"seed": seed, "track": track, **evaluate_seed(
            base, experts, score, cache, adamerging=stage, progress=progress, expert_scores=built["experts"][seed],
            merge=merge, log=lambda line, seed=seed: log(f"seed {seed}: {line}"))})  # fmt: skip
        seconds[f"merge and score, seed {seed}"] = time.perf_counter() - start
        log(f"seed {seed}: merged and scored in {seconds[f'merge and score, seed {seed}']:.0f} s")
    summary = summarize(per_seed)
    seeds_named = "-".join(map(str, seeds))
    named = f"{'lora-' if track == 'lora' else ''}{experts_key}-{code_key(track)}-{accuracy_precision.tag()}"
    folder = cache_dir / "results" / f"{named}-seeds-{seeds_named}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"summary": summary, "per_seed": per_seed}, indent=1))
    (folder / "results.md").write_text(markdown(summary))
    seconds["total"] = time.perf_counter() - started
    history = folder / "timings.json"  # one entry per run: a cached rerun does not hide the full run's times
    runs = json.loads(history.read_text()) if history.is_file() else []
    runs = runs if isinstance(runs, list) else [runs]
    runs.append({"seconds": seconds, "build": built["seconds"], "precision": accuracy_precision.tag()})
    history.write_text(json.dumps(runs, indent=1))
    plots(summary, folder)
    return summary, folder


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``specmerge-bench accuracy``; the parsed arguments go to :func:`run`."""
    parser.add_argument("--cache", required=True, type=Path,
                        help="cache folder, created if missing: sources/, tasks/, tokens/, probes/, experts/, merges/, "
                             "scores/, results/ (reuse it: every stage is cached by its inputs)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=800, help="fine-tuning steps per expert (default 800)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="forward passes under bfloat16 autocast or in float32; auto (default): bfloat16 where "
                             "the CPU runs it natively (oneDNN's check), float32 elsewhere")  # fmt: skip
    parser.add_argument("--track", choices=("full", "lora"), default="full",
                        help="full (default): fine-tuned experts; lora: rank-16 PEFT LoRA experts, merged from their "
                             "adapter folders")  # fmt: skip
    parser.add_argument("--tasks", type=int, choices=(8, 16), default=8,
                        help="8 (default): the eight tasks; 16: those and eight more")  # fmt: skip
    parser.add_argument("--scores-from", type=Path, metavar="KEPT",
                        help="first add the scores by weights kept in KEPT (bench/accuracy_keep.py) to the cache: "
                             "weights whose every byte was scored there are not scored again")  # fmt: skip
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=lambda args: run(args, parser))


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``specmerge-bench accuracy --cache DIR [--seeds 0 1 2]``: run (or re-score) and print the tables."""
    if args.cache.exists() and not args.cache.is_dir():
        parser.error(f"--cache {args.cache} is a file; give a folder (created if missing)")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds must be distinct non-negative integers, got {' '.join(map(str, args.seeds))}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.scores_from is not None:
        from specmerge_bench.accuracy.scores import import_scores

        try:
            added = import_scores(args.scores_from, args.cache)
        except ValueError as err:
            parser.error(f"--scores-from: {err}")
        print(f"--scores-from {args.scores_from}: {added} scores by weights added to {args.cache}")
    summary, folder = run_benchmark(
        args.cache,
        args.seeds,
        steps=args.steps,
        progress=not args.quiet,
        precision=args.precision,
        track=args.track,
        n_tasks=args.tasks,
    )
    print(markdown(summary))
    print(f"results, plots and timings: {folder}")
    return 0
