"""Selection, scoring and reporting of the accuracy benchmark: every method, hyperparameters chosen on val.

For each training seed: the experts' deltas are merged with every candidate (:mod:`specmerge_bench.accuracy.merging`),
each candidate x final scale s is scored on the validation splits, each results row keeps the setting with
the best mean validation accuracy over the tasks, and only that setting is scored on the test splits. Test
accuracy is never used to choose anything. Every score is cached on disk (keyed by the experts, the
candidate, the scale, the split and a hash of the merging code), so a rerun only computes what is missing.

Grids (trimmed from the paper's; stated in BENCHMARKS.md): s in SCALES for every method; SWUDI r in SWUDI_R
x t in SWUDI_T; the exponential-only filter t in SWUDI_T; WUDI (Adam, lr 1e-5) after WUDI_STEPS steps (one
run with snapshots). Other parameters are the registry defaults (TIES top 20 %, DARE p = 0.5 seed 0,
TSV-M k = floor(min(d)/N), OptMerge rank-k centred proxy 300 Adam steps, SWUDI-A tau_init = sum).

Reported per method, mean +- std over seeds: average test accuracy over the tasks, normalised accuracy
(mean over tasks of merged / expert accuracy) and gap closed (mean over tasks of (merged - base) /
(expert - base)), and the per-task accuracies.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmerge_bench.accuracy.merging import Candidate, MergedDeltas, StateDict, merge_candidates

SCALES = (0.1, 0.2, 0.3, 0.5, 1.0)
SWUDI_R = (0.55, 0.65, 0.75, 0.85)
SWUDI_T = (300.0, 800.0, 1300.0, 1800.0)
WUDI_STEPS = (100, 200, 300, 500, 700, 1000)

Scorer = Callable[[StateDict, str], dict[str, float]]  # (state dict, "val" | "test") -> task -> accuracy


@dataclass(frozen=True)
class Row:
    """One line of the results table: the candidates whose best (on val) setting it reports."""

    label: str
    title: str
    candidates: tuple[Candidate, ...]


def _one(label: str, title: str, method: str, **params: Any) -> Row:
    return Row(label, title, (Candidate(label, method, params),))


def method_rows() -> list[Row]:
    """The rows of the main table, in display order."""
    return [
        _one("weight_average", "Weight average", "weight_average"),
        _one("task_arithmetic", "Task arithmetic", "task_arithmetic"),
        _one("ties", "TIES (top 20 %)", "ties"),
        _one("dare_task_arithmetic", "DARE-TA (p = 0.5)", "dare_task_arithmetic"),
        _one("dare_ties", "DARE-TIES (p = 0.5)", "dare_ties"),
        _one("tsv_m", "TSV-M", "tsv_m"),
        _one("iso_c", "Iso-C", "iso_c"),
        _one("closed_form", "D C⁺ (closed form)", "closed_form"),
        _one("wudi", "WUDI (Adam, 300 steps)", "wudi", steps=300),
        _one("optmerge", "OptMerge (300 steps)", "optmerge"),
        Row(
            "swudi",
            "SWUDI (r, t on val)",
            tuple(Candidate("swudi", "swudi", {"rank_ratio": r, "t": t}) for r in SWUDI_R for t in SWUDI_T),
        ),
        _one("swudi_a_psqrt", "SWUDI-A (psqrt)", "swudi_a", rule="psqrt"),
        _one("swudi_a_gd", "SWUDI-A (Gavish–Donoho)", "swudi_a", rule="gavish_donoho"),
        Row(
            "exponential",
            "Exponential filter, no truncation (t on val)",
            tuple(Candidate("exponential", "spectral_filter", {"filter": "exponential", "t": t}) for t in SWUDI_T),
        ),
    ]


def step_rows() -> list[Row]:
    """The WUDI step sweep (and D C⁺, its limit)."""
    rows = [_one(f"wudi_{s}", f"WUDI {s} steps", "wudi", steps=s) for s in WUDI_STEPS]
    return [*rows, _one("closed_form", "D C⁺ (closed form)", "closed_form")]


def code_key() -> str:
    """A hash of the code that computes merges: cached scores are reused only while it is unchanged."""
    import specmerge

    core = Path(specmerge.__file__).resolve().parent
    files = [
        *sorted(core.glob("methods/**/*.py")),  # every method, whatever file it is in
        *sorted(core.glob("linalg/**/*.py")),
        core / "pipeline" / "plan.py",
        core / "pipeline" / "recipe.py",
        Path(__file__).resolve().with_name("merging.py"),
    ]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


class ScoreCache:
    """Scores on disk, one JSON file per (experts, code) key, rewritten atomically after each new score."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.scores: dict[str, dict[str, float]] = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, key: str, compute: Callable[[], dict[str, float]]) -> dict[str, float]:
        if key not in self.scores:
            self.put(key, compute())
        return self.scores[key]

    def put(self, key: str, value: dict[str, float]) -> None:
        self.scores[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            json.dump(self.scores, f, indent=0, sort_keys=True)
        os.replace(f.name, self.path)


def _mean(values: Sequence[float]) -> float:
    """Exactly rounded mean: independent of the order of ``values`` (a score read back from the cache lists
    its tasks in another order than a fresh one, and settings with equal validation scores must tie exactly)."""
    return math.fsum(values) / len(values)


def evaluate_seed(
    base: StateDict,
    experts: Mapping[str, StateDict],
    score: Scorer,
    cache: ScoreCache,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Every row for one set of experts (task -> expert state dict): chosen setting, val mean, test accuracies.

    Only the candidates with a score missing from ``cache`` are merged, so a rerun over cached scores does
    no merging at all. Merge times are cached with the scores (key ``<candidate>|merge``).
    """
    tasks = list(experts)
    rows = method_rows() + step_rows()
    needed = {c.key: c for c in missing_candidates(rows, cache)}
    wudi_steps = sorted({c.params["steps"] for c in needed.values() if c.method == "wudi"})  # one run, snapshots
    deltas = merge_candidates(
        base, list(experts.values()), [c for c in needed.values() if c.method != "wudi"], expert_keys=tasks,
        wudi_steps=wudi_steps, progress=progress and bool(needed),
    )  # fmt: skip
    merged = [c.key for c in needed.values() if c.method != "wudi"] + (["wudi_steps"] if wudi_steps else [])
    for key in merged:
        cache.put(f"{key}|merge", {"seconds": deltas.seconds[key]})
    result: dict[str, Any] = {
        "tasks": tasks,
        "base": {split: cache.get(f"base|{split}", lambda s=split: score(base, s)) for split in ("val", "test")},
        "experts": {},
        "rows": {},
        "merge_seconds": {k[: -len("|merge")]: v["seconds"] for k, v in cache.scores.items() if k.endswith("|merge")},
    }
    for task, state in experts.items():
        own = {
            split: cache.get(f"expert-{task}|{split}", lambda s=split, st=state: score(st, s))
            for split in ("val", "test")
        }
        result["experts"][task] = {"val": own["val"][task], "test": own["test"][task], "all_test": own["test"]}
    for row in rows:
        result["rows"][row.label] = choose(row, base, deltas, score, cache)
    return result


def missing_candidates(rows: Sequence[Row], cache: ScoreCache) -> list[Candidate]:
    """The candidates of ``rows`` that :func:`choose` would have to merge: a val score or the chosen test missing."""
    out = []
    for row in rows:
        lacking = [c for c in row.candidates if any(f"{c.key}|{s}|val" not in cache.scores for s in SCALES)]
        if not lacking:
            _, best, scale = _best_on_val(row, cache)
            if f"{best.key}|{scale}|test" not in cache.scores:
                lacking = [best]
        out += [c for c in lacking if all(c.key != o.key for o in out)]
    return out


def _best_on_val(row: Row, cache: ScoreCache, score: Callable[[Candidate, float], dict[str, float]] | None = None):
    """(mean val accuracy, candidate, scale) of the best setting of ``row``; ``score`` fills missing val scores."""
    best: tuple[float, Candidate, float] | None = None
    for candidate in row.candidates:
        for scale in SCALES:
            key = f"{candidate.key}|{scale}|val"
            val = cache.get(key, lambda c=candidate, s=scale: score(c, s)) if score else cache.scores[key]
            if best is None or _mean(list(val.values())) > best[0]:
                best = (_mean(list(val.values())), candidate, scale)
    assert best is not None
    return best


def choose(row: Row, base: StateDict, deltas: MergedDeltas, score: Scorer, cache: ScoreCache) -> dict[str, Any]:
    """The (candidate, scale) of ``row`` with the best mean validation accuracy, and its test accuracies."""
    val_mean, candidate, scale = _best_on_val(row, cache, lambda c, s: score(deltas.state(base, c, s), "val"))
    test = cache.get(f"{candidate.key}|{scale}|test", lambda: score(deltas.state(base, candidate, scale), "test"))
    merge = cache.scores.get(f"{candidate.key}|merge", {}).get("seconds")
    return {"title": row.title, "choice": candidate.describe(), "scale": scale, "val_mean": val_mean, "test": test,
            "seconds": merge}  # fmt: skip


def summarize(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and std over seeds of average accuracy, normalised accuracy and gap closed, per row."""
    tasks = per_seed[0]["tasks"]

    def stats(values: Sequence[float]) -> dict[str, float]:
        """Mean and sample standard deviation (nan stays nan: a task whose expert equals the base)."""
        mean = _mean(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        return {"mean": mean, "std": math.sqrt(var)}

    def figures(test_of: Callable[[Mapping[str, Any]], Mapping[str, float]]) -> dict[str, Any]:
        avg, norm, gap = [], [], []
        per_task: dict[str, list[float]] = {t: [] for t in tasks}
        for seed in per_seed:
            test = test_of(seed)
            expert = {t: seed["experts"][t]["test"] for t in tasks}
            base = seed["base"]["test"]
            avg.append(_mean([test[t] for t in tasks]))
            norm.append(_mean([test[t] / expert[t] for t in tasks]))
            gap.append(_mean([(test[t] - base[t]) / (expert[t] - base[t]) if expert[t] != base[t] else math.nan
                              for t in tasks]))  # fmt: skip
            for t in tasks:
                per_task[t].append(test[t])
        return {"average": stats(avg), "normalised": stats(norm), "gap_closed": stats(gap),
                "per_task": {t: stats(v) for t, v in per_task.items()}}  # fmt: skip

    summary = {
        "seeds": len(per_seed),
        "tasks": tasks,
        "base": figures(lambda s: s["base"]["test"]),
        "experts": figures(lambda s: {t: s["experts"][t]["test"] for t in tasks}),
        "rows": {},
    }
    for label, row in per_seed[0]["rows"].items():
        summary["rows"][label] = {
            "title": row["title"],
            **figures(lambda s, lab=label: s["rows"][lab]["test"]),
            "choices": [f"{s['rows'][label]['choice']}, s={s['rows'][label]['scale']}" for s in per_seed],
        }
    return summary


def markdown(summary: Mapping[str, Any]) -> str:
    """The results tables (main and WUDI step sweep) as Markdown, accuracies in percent."""
    tasks = summary["tasks"]

    def pm(stat: Mapping[str, float], factor: float = 100.0) -> str:
        return f"{factor * stat['mean']:.1f} ± {factor * stat['std']:.1f}"

    head = "| method | avg acc | normalised | gap closed | " + " | ".join(tasks) + " |"
    lines = [head, "|---" + "|---:" * (3 + len(tasks)) + "|"]

    def line(title: str, fig: Mapping[str, Any]) -> str:
        cells = [pm(fig["average"]), pm(fig["normalised"]), pm(fig["gap_closed"])]
        cells += [f"{100 * fig['per_task'][t]['mean']:.1f}" for t in tasks]
        return f"| {title} | " + " | ".join(cells) + " |"

    lines.append(line("Base model (probe heads)", summary["base"]))
    lines.append(line("Individual experts", summary["experts"]))
    sweep = {r.label for r in step_rows()}
    for label, row in summary["rows"].items():
        if label not in sweep or label == "closed_form":
            lines.append(line(row["title"], row))
    lines += ["", "| WUDI steps | avg acc | gap closed |", "|---|---:|---:|"]
    for r in step_rows():
        row = summary["rows"][r.label]
        lines.append(f"| {row['title']} | {pm(row['average'])} | {pm(row['gap_closed'])} |")
    lines += ["", "Chosen settings (per seed):", ""]
    for row in summary["rows"].values():
        lines.append(f"- {row['title']}: " + "; ".join(row["choices"]))
    return "\n".join(lines) + "\n"


def plots(summary: Mapping[str, Any], folder: Path) -> list[Path]:
    """accuracy.png (average accuracy per method, mean ± std over seeds) and wudi_steps.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = {r.label for r in step_rows()} - {"closed_form"}
    rows = [(r["title"], r["average"]) for lab, r in summary["rows"].items() if lab not in sweep]
    rows.sort(key=lambda x: x[1]["mean"])
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    ax.barh([t for t, _ in rows], [100 * s["mean"] for _, s in rows], xerr=[100 * s["std"] for _, s in rows],
            color="tab:blue", alpha=0.8)  # fmt: skip
    for value, name, style in ((summary["base"], "base", "--"), (summary["experts"], "experts", ":")):
        ax.axvline(100 * value["average"]["mean"], color="k", linestyle=style, label=f"{name} (avg)")
    low = min(100 * summary["base"]["average"]["mean"], *(100 * s["mean"] for _, s in rows)) - 3
    ax.set_xlim(low, 100 * summary["experts"]["average"]["mean"] + 1)
    seeds = f"{summary['seeds']} seed{'s' if summary['seeds'] > 1 else ''}"
    ax.set_xlabel(f"average test accuracy over {len(summary['tasks'])} tasks (%), mean ± std of {seeds}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = [folder / "accuracy.png"]
    fig.savefig(out[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [r.label for r in step_rows() if r.label != "closed_form"]
    x = [int(label.split("_")[1]) for label in labels]
    y = [100 * summary["rows"][lab]["average"]["mean"] for lab in labels]
    e = [100 * summary["rows"][lab]["average"]["std"] for lab in labels]
    ax.errorbar(x, y, yerr=e, marker="o", label="WUDI (Adam, lr 1e-5)")
    closed = summary["rows"]["closed_form"]["average"]
    ax.axhline(100 * closed["mean"], color="tab:red", linestyle="--", label="D C⁺ (closed form)")
    ax.set_xlabel("WUDI optimizer steps")
    ax.set_ylabel("average test accuracy (%)")
    ax.legend()
    fig.tight_layout()
    out.append(folder / "wudi_steps.png")
    fig.savefig(out[1], dpi=120)
    plt.close(fig)
    return out


def load_scoring(built: Mapping[str, Any], model_dir: str | Path | None = None) -> tuple[Any, StateDict, Any, Any]:
    """(base model, a copy of its state dict, encoded tasks, probe heads) for scoring, from ``build_experts``."""
    from specmerge_bench.accuracy import model as accuracy_model

    base_model, _ = accuracy_model.load_base(model_dir)
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    tasks_encoded = accuracy_model.load_encoded(built["paths"]["tokens"])
    return base_model, base, tasks_encoded, accuracy_model.load_heads(built["paths"]["heads"])


def load_experts(built: Mapping[str, Any], seed: int, base: StateDict) -> dict[str, StateDict]:
    """Task -> the seed's expert state dict, with the base's tensor names."""
    from safetensors.torch import load_file

    experts = {}
    for task, folder in built["paths"]["experts"][seed].items():
        state = load_file(Path(folder) / "model.safetensors")
        experts[task] = {name: state[name] for name in base}
    return experts


def run_benchmark(
    cache_dir: str | Path,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    model_dir: str | Path | None = None,
    manifest: Mapping[str, Any] | None = None,
    steps: int = 800,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], Path]:
    """The whole benchmark: data -> probes -> experts -> merges -> scores -> tables and plots, every stage cached.

    Returns the summary and the results folder (``results.json``, ``results.md``, ``accuracy.png``,
    ``wudi_steps.png``, ``timings.json``: the stage times of every run, appended) under
    ``cache_dir/results/<experts key>-<code key>-seeds-...``.
    ``model_dir`` / ``manifest`` replace the pinned MiniLM and the Debian-derived tasks (the tests use a tiny
    BERT and a synthetic task set).
    """
    import time

    from specmerge_bench.accuracy import model as accuracy_model

    cache_dir = Path(cache_dir).resolve()
    started = time.perf_counter()
    built = accuracy_model.build_experts(cache_dir, seeds, steps=steps, model_dir=model_dir, manifest=manifest, log=log)
    prepared = time.perf_counter() - started
    base_model, base, tasks_encoded, heads = load_scoring(built, model_dir)

    def score(state: StateDict, split: str) -> dict[str, float]:
        return accuracy_model.evaluate(state, tasks_encoded, heads, split, scratch=base_model)

    experts_key = Path(next(iter(built["paths"]["experts"][seeds[0]].values()))).parents[1].name
    per_seed, seconds = [], {"build (data, probes, experts)": prepared}
    for seed in seeds:
        start = time.perf_counter()
        experts = load_experts(built, seed, base)
        cache = ScoreCache(cache_dir / "scores" / experts_key / f"seed{seed}-{code_key()}.json")
        per_seed.append(evaluate_seed(base, experts, score, cache, progress=progress))
        seconds[f"merge and score, seed {seed}"] = time.perf_counter() - start
        log(f"seed {seed}: merged and scored in {seconds[f'merge and score, seed {seed}']:.0f} s")
    summary = summarize(per_seed)
    folder = cache_dir / "results" / f"{experts_key}-{code_key()}-seeds-{'-'.join(map(str, seeds))}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"summary": summary, "per_seed": per_seed}, indent=1))
    (folder / "results.md").write_text(markdown(summary))
    seconds["total"] = time.perf_counter() - started
    history = folder / "timings.json"  # one entry per run: a cached rerun does not hide the full run's times
    runs = json.loads(history.read_text()) if history.is_file() else []
    runs = runs if isinstance(runs, list) else [runs]
    runs.append({"seconds": seconds, "build": built["seconds"]})
    history.write_text(json.dumps(runs, indent=1))
    plots(summary, folder)
    return summary, folder


def main(argv: Sequence[str] | None = None) -> int:
    """``specmerge bench accuracy --cache DIR [--seeds 0 1 2]``: run (or re-score) and print the tables."""
    import argparse

    parser = argparse.ArgumentParser(prog="specmerge bench accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", required=True, type=Path, help="cache folder: sources, tasks, experts, scores")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    parser.add_argument("--steps", type=int, default=800, help="fine-tuning steps per expert (default 800)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    summary, folder = run_benchmark(args.cache, args.seeds, steps=args.steps, progress=not args.quiet)
    print(markdown(summary))
    print(f"results, plots and timings: {folder}")
    return 0
